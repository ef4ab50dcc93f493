"""Property tests: every implementation under test against the numpy reference, byte for byte.

The reference (``jax_kvcanary.reference``) is always the oracle; the compared implementations are
``ffi`` and ``xla``. Cases come from ``tests/support/cases.py``: a few fixed shapes/static options per
op ("configs", so jit compiles are reused) with the data varied by seed. ``KVC_PROPERTY_SEEDS``
(default 26) sets the seeds per config: 8 configs x 26 = 208 cases per op. The ``xla`` cases of all
but one config per op are marked ``slow`` (each config is a compile of the pure-JAX backend).

Compared bytes: canary (whole buffer, padding bytes included), ring (whole ring), write_index, both
counter arrays, the chain-position flag (passthrough), every plan array, the scatter pool.

The reference itself is checked against the §6 invariants on the same cases (this part runs even when
only ``reference`` is selected), and the generators are checked to reach every sentinel and row kind.
"""

import os

import numpy as np
import pytest

from jax_kvcanary import consts
from tests.support.cases import (CONFIGS, OPS, case_id, compare, describe_case, make_case, run_impl,
                                 run_reference, x64_scope)
from tests.support.impls import COMPARED_IMPLS

SEEDS = int(os.environ.get("KVC_PROPERTY_SEEDS", "26"))
OP_CONFIGS = [(op, cfg) for op in OPS for cfg in CONFIGS[op]]
EAGER_CONFIGS = [(op, sorted(CONFIGS[op])[0]) for op in OPS]   # also the quick loop's xla configs
MASK = (1 << 64) - 1

_ref_cache = {}


def cases_of(op, config):
    key = (op, config)
    if key not in _ref_cache:
        out = []
        for seed in range(SEEDS):
            case = make_case(op, config, seed)
            out.append((case, run_reference(case)))
        _ref_cache[key] = out
    return _ref_cache[key]


def test_case_count():
    for op in OPS:
        assert len(CONFIGS[op]) * SEEDS >= 200 or "KVC_PROPERTY_SEEDS" in os.environ, op


# ---- impl vs reference --------------------------------------------------------------------------

def impl_params(op_configs):
    """``op, config, impl`` parameters; the ``xla`` ones marked ``xla``, and ``slow`` but in
    ``EAGER_CONFIGS``."""
    def marks(op, cfg, impl):
        if impl != "xla":
            return ()
        return (pytest.mark.xla,) + (() if (op, cfg) in EAGER_CONFIGS else (pytest.mark.slow,))
    return [pytest.param(op, cfg, impl, marks=marks(op, cfg, impl), id=f"{op}-{cfg}-{impl}")
            for op, cfg in op_configs for impl in COMPARED_IMPLS]


@pytest.mark.parametrize("op,config,impl", impl_params(OP_CONFIGS))
def test_matches_reference(op, config, impl):
    failures = []
    for case, ref in cases_of(op, config):
        try:
            with x64_scope(case):
                got = run_impl(case, impl)
        except Exception as e:  # noqa: BLE001 - report which case raised
            failures.append(f"{case_id(case)} raised {type(e).__name__}: {e}\n{describe_case(case)}")
            continue
        diffs = compare(op, ref, got)
        if diffs:
            failures.append(f"{case_id(case)} [{impl}] differs from reference:\n  "
                            + "\n  ".join(diffs) + "\n" + describe_case(case))
    assert not failures, (f"{len(failures)}/{SEEDS} cases differ; first ones:\n\n"
                          + "\n\n".join(failures[:3]))


@pytest.mark.parametrize("op,config,impl", impl_params(EAGER_CONFIGS))
def test_matches_reference_eager(op, config, impl):
    """Seed 0 of one config per op, called outside jit (the eager dispatch path; the goldens
    cover eager calls much more)."""
    case, ref = cases_of(op, config)[0]
    with x64_scope(case):
        got = run_impl(case, impl, jit=False)
    diffs = compare(op, ref, got)
    assert not diffs, "\n".join(diffs) + "\n" + describe_case(case)


# ---- reference invariants (format.md §6, §5.1, §9.2, §9.5) --------------------------------------------

def _u64_rows(counters):
    return [int(v) for v in np.asarray(counters).view("<u8").ravel()]


def _snapshot(tree):
    import jax
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def _write_slot_count(case):
    canary, log, wp, ids, pos, loc = case["args"]
    N = len(ids)
    C = len(wp.seed_slot_indices)
    active = min(max(int(wp.num_valid_reqs[0]), 0), C)
    o = [min(max(int(wp.offsets[0]), 0), N)]
    for k in range(1, active + 1):
        o.append(min(max(int(wp.offsets[k]), o[-1]), N))
    return sum(1 for i in range(o[0], o[active]) if int(loc[i]) >= 0), active


def _check_log_invariants(case, log0, log, n_bound):
    tag = case["kwargs"]["tag"]
    k0, k1 = _u64_rows(log0.kernel_run_counters), _u64_rows(log.kernel_run_counters)
    assert k1[tag] == (k0[tag] + 1) & MASK
    assert k1[:tag] + k1[tag + 1:] == k0[:tag] + k0[tag + 1:]
    s0, s1 = _u64_rows(log0.slot_run_counters), _u64_rows(log.slot_run_counters)
    assert s1[:tag] + s1[tag + 1:] == s0[:tag] + s0[tag + 1:]
    np.testing.assert_array_equal(log.enable_chain_position_assert, log0.enable_chain_position_assert)
    for name, dt, shape in (("ring", np.uint8, log0.ring.shape), ("write_index", np.int32, (1,)),
                            ("kernel_run_counters", np.uint8, log0.kernel_run_counters.shape),
                            ("slot_run_counters", np.uint8, log0.slot_run_counters.shape),
                            ("enable_chain_position_assert", np.int32, (1,))):
        a = getattr(log, name)
        assert isinstance(a, np.ndarray) and a.dtype == dt and a.shape == shape, name
    base, new = int(log0.write_index[0]), int(log.write_index[0])
    cap = log0.ring.shape[0]
    if base == new:
        np.testing.assert_array_equal(log.ring, log0.ring)
        return 0, (s1[tag] - s0[tag]) & MASK
    n = new - base
    assert 0 < n <= n_bound or new == consts.WRITE_INDEX_MAX
    keep = [k for k in range(cap) if not (base <= k < base + max(n, 0))]
    np.testing.assert_array_equal(log.ring[keep], log0.ring[keep])
    written = log.ring.view("<i8")[[k for k in range(cap) if k not in keep]]
    if len(written):
        assert (written[:, 0] == tag).all()
        bits = written[:, 7]
        assert ((bits == 64) | ((bits & 64) == 0)).all()  # OOB rows are never OR-ed into others
    return n, (s1[tag] - s0[tag]) & MASK


@pytest.mark.parametrize("op,config", OP_CONFIGS, ids=[f"{o}-{c}" for o, c in OP_CONFIGS])
def test_reference_invariants(op, config):
    for seed in range(SEEDS):
        case = make_case(op, config, seed)
        before = _snapshot((case["args"], case["kwargs"]))
        out = run_reference(case)
        assert _snapshot((case["args"], case["kwargs"])) == before, "inputs mutated"
        msg = case_id(case)
        if op == "write":
            canary0, log0 = case["args"][0], case["args"][1]
            canary, log = out
            assert canary.dtype == np.uint8 and canary.shape == canary0.shape, msg
            np.testing.assert_array_equal(canary[:, 32:], canary0[:, 32:], err_msg=msg)
            count, active = _write_slot_count(case)
            n, dslot = _check_log_invariants(case, log0, log, 3 * len(case["args"][3]) + active)
            assert dslot == count, msg
        elif op == "verify":
            canary0, log0, vp = case["args"]
            log = out
            V = len(vp.slot_indices)
            active = min(max(int(vp.num_valid[0]), 0), V) if int(vp.enable[0]) else 0
            n, dslot = _check_log_invariants(case, log0, log, 3 * active)
            assert dslot == active, msg
        elif op == "plan":
            vp, wp = out
            kw = case["kwargs"]
            Vc, Wc, bs = kw["verify_capacity"], kw["write_req_capacity"], len(case["args"][0])
            for f, n in (("slot_indices", Vc), ("expected_tokens", Vc), ("expected_positions", Vc),
                         ("prev_slot_indices", Vc), ("num_valid", 1), ("enable", 1)):
                a = getattr(vp, f)
                assert a.dtype == np.int32 and a.shape == (n,), (msg, f)
            for f, n in (("offsets", Wc + 1), ("seed_slot_indices", Wc), ("num_valid_reqs", 1)):
                a = getattr(wp, f)
                assert a.dtype == np.int32 and a.shape == (n,), (msg, f)
            nv = int(vp.num_valid[0])
            assert 0 <= nv <= Vc and int(vp.enable[0]) in (0, 1), msg
            if int(vp.enable[0]) == 0:
                assert nv == Vc and not any(getattr(vp, f).any() for f in vp._FIELDS[:4]), msg
            else:
                assert not any(getattr(vp, f)[nv:].any() for f in vp._FIELDS[:4]), msg
            assert not wp.offsets[bs + 1:].any() and not wp.seed_slot_indices[bs:].any(), msg
            assert int(wp.num_valid_reqs[0]) == bs and int(wp.offsets[0]) == 0, msg
            assert (np.diff(wp.offsets[:bs + 1].astype(np.int64)) >= 0).all(), msg
        else:
            pool0, ids, offs, rps = case["args"]
            Rp, Cp = pool0.shape
            assert out.dtype == pool0.dtype and out.shape == pool0.shape, msg
            touched = np.zeros(pool0.shape, bool)
            for r in range(len(rps)):
                start, end, rp = int(offs[r]), int(offs[r + 1]), int(rps[r])
                n = min(end - start, Cp)
                if n > 0 and 0 <= rp < Rp:
                    for c in range(n):
                        if 0 <= start + c < len(ids):
                            touched[rp, c] = True
            np.testing.assert_array_equal(out[~touched], pool0[~touched], err_msg=msg)


# ---- the generators reach every sentinel / row kind ----------------------------------------------

def _rows_of(log0, log):
    base, new = int(log0.write_index[0]), int(log.write_index[0])
    cap = log.ring.shape[0]
    ks = [k for k in range(max(base, 0), min(new, cap))]
    return log.ring.view("<i8")[ks], new - base, base + (new - base) > cap


def test_generator_coverage():
    seen = set()
    for op, config in OP_CONFIGS:
        for case, out in cases_of(op, config):
            if op in ("write", "verify"):
                log0 = case["args"][1]
                log = out[1] if op == "write" else out
                rows, n, overflow = _rows_of(log0, log)
                for row in rows:
                    seen.add((op, "bits", int(row[7])))
                    if row[7] == 64:
                        seen.add((op, "kind", int(row[5])))
                if overflow and n > 0:
                    seen.add((op, "dropped"))
                if int(log.write_index[0]) == consts.WRITE_INDEX_MAX and n > 0:
                    seen.add((op, "saturated"))
            elif op == "plan":
                vp, wp = out
                seen.add(("plan", "enable", int(vp.enable[0])))
                if (vp.slot_indices == -1).any():
                    seen.add(("plan", "slot-1"))
                if (vp.slot_indices[:int(vp.num_valid[0])] == 0).any():
                    seen.add(("plan", "slot0"))
                if (vp.expected_tokens[:int(vp.num_valid[0])] != -1).any():
                    seen.add(("plan", "token"))
                if (wp.seed_slot_indices > 0).any():
                    seen.add(("plan", "seed"))
    need = {("write", "bits", b) for b in (8, 16, 24, 64)} | \
           {("write", "kind", k) for k in (1, 2, 16, 17, 18, 19)} | \
           {("verify", "bits", b) for b in (1, 2, 4, 32, 64)} | \
           {("verify", "kind", k) for k in (3, 4, 16, 17, 18, 19)} | \
           {("write", "dropped"), ("verify", "dropped"), ("write", "saturated"),
            ("verify", "saturated"), ("plan", "enable", 0), ("plan", "enable", 1),
            ("plan", "slot-1"), ("plan", "slot0"), ("plan", "token"), ("plan", "seed")}
    missing = need - seen
    assert not missing or SEEDS < 26, f"generators never produced: {sorted(missing)}"
