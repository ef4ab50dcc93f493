"""Donation safety: inside a donating jax.jit no canary or log buffer is copied.

Inside a jitted step that donates the canary state:

* the compiled HLO aliases every donated state parameter to an output (``input_output_alias``) and
  contains no ``copy`` of a state-shaped buffer (ffi: none at all; xla: none of the canary or the
  ring, and of the 96-byte counters at most one each from jax 0.11 — see ``hlo.XLA_ALLOWED_COPIES``);
* no "donated buffers were not usable" warning is emitted (all warnings are errors here);
* the donated input arrays are really consumed (deleted) and replaced by valid outputs;
* maximally malformed data fed into a donated step completes and gives the reference's bytes: a
  native handler that returned an error for a data-dependent condition would fail the step and
  delete the caller's donated state, so none may (also checked statically on the handler sources).
"""

from __future__ import annotations

import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcanary as kvc
from jax_kvcanary import reference

from tests.support import hlo
from tests.support.impls import BACKEND_PARAMS

ROOT = pathlib.Path(__file__).resolve().parents[1]
X64 = bool(jax.config.jax_enable_x64)

# Distinctive shapes, so that a copy of a state buffer is recognisable in the HLO text.
S, STRIDE, CAP, N, C, VC, BS = 96, 40, 24, 10, 4, 40, 3
KV_ROWS = 80  # one source too short for slots >= 80: OOB rows on real data


@pytest.fixture(autouse=True)
def _warnings_are_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def _i(values, dtype=jnp.int32):
    return jnp.asarray(np.asarray(values), dtype)


def _state():
    return kvc.new_canary_buffer(S, STRIDE), kvc.ViolationLog.create(CAP)


def _sources(rows=KV_ROWS):
    kv = jnp.asarray(np.random.default_rng(0).integers(0, 256, (rows, 64), dtype=np.uint8))
    return (kvc.RealKvSource(kv, 1, 32, 32), kvc.RealKvSource(kv.view(jnp.uint16), 2, 32, 16))


def _table():
    t = np.zeros((5, 24), np.int32)
    for rp in range(1, 5):
        t[rp] = np.arange(24) + 1 + (rp - 1) * 24  # disjoint slots 1..96 (slot 96 is out of range)
    return jnp.asarray(t)


def serving_step(impl, sources=()):
    """plan -> HEAD verify+write -> TAIL verify+write, as an engine step would run them."""
    table = _table()

    def step(canary, log, tail, rpi, prefix, extend, ids, pos, loc):
        vp, wp = kvc.plan(rpi, prefix, extend, table, verify_capacity=VC, write_req_capacity=C, impl=impl)
        log = kvc.verify(canary, log, vp, tag=kvc.LaunchTag.HEAD_K_FULL, impl=impl)
        canary, log = kvc.write(canary, log, wp, ids, pos, loc, tag=kvc.LaunchTag.HEAD_K_FULL, impl=impl)
        log = kvc.verify(tail, log, vp, tag=kvc.LaunchTag.TAIL_K_FULL, real_kv_sources=sources,
                         real_kv_hash_mode=kvc.RealKvHashMode.ALL, impl=impl)
        tail, log = kvc.write(tail, log, wp, ids, pos, loc, tag=kvc.LaunchTag.TAIL_K_FULL,
                              real_kv_sources=sources, real_kv_hash_mode=kvc.RealKvHashMode.ALL, impl=impl)
        return canary, log, tail

    return step


def _step_args():
    canary, log = _state()
    tail = kvc.new_canary_buffer(S, STRIDE)
    return (canary, log, tail, _i([1, 2, 3]), _i([0, 0, 0]), _i([4, 3, 3]), _i(np.arange(N) + 100),
            _i([0, 1, 2, 3, 0, 1, 2, 0, 1, 2]), _i([1, 2, 3, 4, 25, 26, 27, 49, 50, 51]))


_COMPILED = {}


def _compiled_serving_step(impl):
    """One lowering and compile of the donated serving step per backend, shared by the tests below:
    (lowered, compiled)."""
    if impl not in _COMPILED:
        lowered = jax.jit(serving_step(impl, _sources()), donate_argnums=(0, 1, 2)).lower(*_step_args())
        _COMPILED[impl] = lowered, lowered.compile()
    return _COMPILED[impl]


def _hlo(fn, donate, args):
    """(lowered StableHLO text, compiled HLO text) of ``fn`` jitted with ``donate``."""
    lowered = jax.jit(fn, donate_argnums=donate).lower(*args)
    return lowered.as_text(), lowered.compile().as_text()


def _check_module(impl, texts, donated_leaves, n_params_before):
    """``n_params_before``: flat arguments before the donated ones (hoisted constants come first)."""
    lowered_text, text = texts
    aliases = hlo.aliases(text)
    params = set(aliases.values())
    first = hlo.hoisted_constants(lowered_text) + n_params_before
    want = set(range(first, first + len(donated_leaves)))
    assert want <= params, f"donated state params {sorted(want - params)} are not aliased: {aliases}"
    bad = hlo.state_copies(impl, text, donated_leaves)
    assert not bad, f"copies of state-shaped buffers in the donated step: {bad}"


@pytest.mark.parametrize("impl", BACKEND_PARAMS)
def test_serving_step_aliases_all_state_and_copies_none(impl):
    args = _step_args()
    lowered, compiled = _compiled_serving_step(impl)
    leaves = jax.tree_util.tree_leaves(args[:3])
    assert len(leaves) == 7  # head canary, 5 log arrays, tail canary
    _check_module(impl, (lowered.as_text(), compiled.as_text()), leaves, 0)


@pytest.mark.parametrize("impl", BACKEND_PARAMS)
def test_single_op_steps_alias_their_state(impl):
    canary, log = _state()
    z = lambda n: jnp.zeros((n,), jnp.int32)  # noqa: E731
    vp = kvc.VerifyPlan(z(VC), z(VC), z(VC), z(VC), _i([VC]), _i([1]))
    wp = kvc.WritePlan(_i([0, 4, 7, 10, 10]), _i([-1, -1, -1, 0]), _i([3]))
    src = _sources()

    def verify(canary, log, vp):
        return kvc.verify(canary, log, vp, tag=3, real_kv_sources=src, real_kv_hash_mode=1, impl=impl)

    def write(canary, log, wp, ids, pos, loc):
        return kvc.write(canary, log, wp, ids, pos, loc, tag=2, enable_write_input_assert=True,
                         expected_input_tokens=ids, expected_input_positions=pos, real_kv_sources=src,
                         real_kv_hash_mode=2, impl=impl)

    def scatter(pool, ids, offs, rpi):
        return kvc.scatter_req_token_ids(pool, ids, offs, rpi, impl=impl)

    log_leaves = jax.tree_util.tree_leaves(log)
    _check_module(impl, _hlo(verify, (1,), (canary, log, vp)), log_leaves, 1)
    _check_module(impl, _hlo(write, (0, 1), (canary, log, wp, z(N), z(N), z(N))), [canary] + log_leaves, 0)
    pool = jnp.zeros((7, 13), jnp.int32)
    _check_module(impl, _hlo(scatter, (0,), (pool, z(30), _i([0, 5, 9, 30]), _i([1, 2, 3]))), [pool], 0)


def _run_donated(jitted, donate, args):
    """Call a donated jitted step; the donated inputs must be consumed and nothing may warn."""
    out = jitted(*args)
    jax.block_until_ready(out)
    for k in donate:
        for leaf in jax.tree_util.tree_leaves(args[k]):
            assert leaf.is_deleted(), "a donated state buffer was not consumed (donation unusable)"
    for leaf in jax.tree_util.tree_leaves(out):
        assert not leaf.is_deleted()
        np.asarray(leaf)  # readable
    return out


@pytest.mark.parametrize("impl", BACKEND_PARAMS)
def test_donated_serving_loop_runs_without_warnings(impl):
    step = _compiled_serving_step(impl)[1]
    canary, log, tail, rpi, prefix, extend, ids, pos, loc = _step_args()
    table = np.asarray(_table())
    P = np.zeros(3, np.int64)
    for t in range(4):
        E = np.array([4, 3, 3]) if t == 0 else np.array([1, 1, 1])
        pad = N - int(E.sum())  # constant N (one compile): the tail is outside every range
        ids = _i(np.arange(N) + 7 * t)
        pos = _i(np.concatenate([np.arange(p, p + e) for p, e in zip(P, E)] + [np.zeros(pad, int)]))
        loc = _i(np.concatenate([table[r + 1, p:p + e] for r, (p, e) in enumerate(zip(P, E))]
                                + [np.full(pad, -1)]))
        old = jax.tree_util.tree_leaves((canary, log, tail))
        canary, log, tail = step(canary, log, tail, rpi, _i(P), _i(E), ids, pos, loc)
        assert all(x.is_deleted() for x in old)
        P = P + E
    assert log.total() == 0  # a clean run records nothing
    runs = log.kernel_runs()
    assert runs[kvc.LaunchTag.HEAD_K_FULL] == 8 and runs[kvc.LaunchTag.TAIL_K_FULL] == 8


def _garbage(shape_n, rng, lo=-2**31, hi=2**31 - 1):
    edge = np.array([-1, 0, 1, S - 1, S, S + 1, -2**31, 2**31 - 1, -2**31 + 1, 2**31 - 2])
    v = rng.integers(lo, hi, shape_n, endpoint=True)
    m = rng.random(shape_n) < 0.5
    v[m] = rng.choice(edge, int(m.sum()))
    return v


@pytest.mark.parametrize("impl", BACKEND_PARAMS)
def test_malformed_data_in_donated_steps_completes_with_reference_bytes(impl):
    """Every device-side value malformed at once, ring capacity 1, write_index near saturation:
    each donated op completes, consumes its state, and returns exactly the reference's bytes."""
    rng = np.random.default_rng(7)
    dt = np.int64 if X64 else np.int32
    src_np = (kvc.RealKvSource(rng.integers(0, 256, (3, 32), dtype=np.uint8), 1, 32, 32),
              kvc.RealKvSource(rng.integers(0, 256, (0, 64), dtype=np.uint8), 2, 32, 16))
    src = jax.tree_util.tree_map(jnp.asarray, src_np)

    def verify(canary, log, vp, src):
        return kvc.verify(canary, log, vp, tag=4, check_verify_expected_token=True,
                          real_kv_sources=src, real_kv_hash_mode=2, impl=impl)

    def write(canary, log, wp, ids, pos, loc, src):
        return kvc.write(canary, log, wp, ids, pos, loc, tag=5, enable_write_input_assert=True,
                         expected_input_tokens=pos, expected_input_positions=ids, real_kv_sources=src,
                         real_kv_hash_mode=2, impl=impl)

    verify = jax.jit(verify, donate_argnums=(1,))
    write = jax.jit(write, donate_argnums=(0, 1))
    scatter = jax.jit(lambda p, i, o, r: kvc.scatter_req_token_ids(p, i, o, r, impl=impl), donate_argnums=(0,))

    for trial in range(6):
        canary_np = rng.integers(0, 256, (S, STRIDE), dtype=np.uint8)
        log_np = kvc.ViolationLog(
            ring=rng.integers(0, 256, (1, 64), dtype=np.uint8),
            write_index=np.array([[0, 2**31 - 2, -3, 1, 2**31 - 1, 0][trial]], np.int32),
            kernel_run_counters=np.full((12, 8), 0xFF, np.uint8),
            slot_run_counters=rng.integers(0, 256, (12, 8), dtype=np.uint8),
            enable_chain_position_assert=np.array([[1, 0, 7, -1, 1, 1][trial]], np.int32))
        vp_np = kvc.VerifyPlan(*(_garbage(VC, rng).astype(dt) for _ in range(4)),
                               num_valid=np.array([[VC, 2**31 - 1, -5, 3, VC + 9, -2**31][trial]], np.int32),
                               enable=np.array([[1, -1, 7, 1, 1, 0][trial]], np.int32))
        wp_np = kvc.WritePlan(offsets=_garbage(C + 1, rng, -3, N + 3).astype(dt),
                              seed_slot_indices=_garbage(C, rng).astype(dt),
                              num_valid_reqs=np.array([[C, 2**31 - 1, -1, C, 2, C + 5][trial]], np.int32))
        ids_np, pos_np, loc_np = (_garbage(N, rng).astype(dt) for _ in range(3))
        kw = dict(real_kv_sources=src_np, real_kv_hash_mode=2)

        J = lambda t: jax.tree_util.tree_map(jnp.asarray, t)  # noqa: E731
        got = _run_donated(verify, (1,), (J(canary_np), J(log_np), J(vp_np), src))
        want = reference.verify(canary_np, log_np, vp_np, tag=4, check_verify_expected_token=True, **kw)
        for f in want._FIELDS:
            assert np.asarray(getattr(got, f)).tobytes() == np.asarray(getattr(want, f)).tobytes(), (trial, f)

        got_c, got_log = _run_donated(write, (0, 1), (J(canary_np), J(log_np), J(wp_np), J(ids_np), J(pos_np),
                                                      J(loc_np), src))
        want_c, want_log = reference.write(canary_np, log_np, wp_np, ids_np, pos_np, loc_np, tag=5,
                                           enable_write_input_assert=True, expected_input_tokens=pos_np,
                                           expected_input_positions=ids_np, **kw)
        assert np.asarray(got_c).tobytes() == want_c.tobytes(), trial
        for f in want_log._FIELDS:
            assert np.asarray(getattr(got_log, f)).tobytes() == np.asarray(getattr(want_log, f)).tobytes(), (trial, f)

        pool_np = rng.integers(-2**31, 2**31 - 1, (4, 5)).astype(np.int32)
        offs_np = _garbage(4, rng, -4, 12).astype(dt)
        rpi_np = _garbage(3, rng, -2, 5).astype(dt)
        got_pool = _run_donated(scatter, (0,), (J(pool_np), J(ids_np), J(offs_np), J(rpi_np)))
        assert np.asarray(got_pool).tobytes() == reference.scatter_req_token_ids(
            pool_np, ids_np, offs_np, rpi_np).tobytes(), trial


def test_native_handlers_return_no_data_dependent_errors():
    """Static check of the handler sources. A CPU handler sees the data, so the only error it may
    return is the argument checks' ``InvalidArgument`` (one constructor, in ``refused()``), and the
    check functions (``csrc/call_args.h``) may read shapes, dtypes and attributes but never a buffer's
    data. A CUDA handler's host code cannot see device values without a device->host copy or a sync
    (which the graph-safety rule of docs/design.md forbids anyway), so its errors
    (launch/resource/alignment) cannot depend on data as long as there is none: check that."""
    cpu = [ROOT / "csrc" / f for f in ("ffi_handlers.h", "ffi_attrs.h", "call_args.h", "cpu_handlers.cc",
                                       "cpu_handlers.h", "cpu_launchers.h")]
    gpu = [ROOT / "cuda" / f for f in ("cuda_handlers.cc", "cuda_kernels.h", "cuda_kernels.cu")]
    assert all(p.is_file() for p in cpu + gpu)
    offenders = []
    allowed = ("inline ffi::Error refused(const std::string& message) { return ffi::Error::InvalidArgument(message); }")
    for path in cpu:
        for n, line in enumerate(path.read_text().splitlines()):
            code = line.split("//")[0]
            for m in re.finditer(r"ffi::Error::(\w+)|ffi::Error\s*\(\s*[^)\s]|XLA_FFI_Error_Create|absl::\w+Error", code):
                if m.group(1) != "Success" and code.strip() != allowed:
                    offenders.append(f"{path.name}:{n + 1}: {line.strip()}")
    call_args = (ROOT / "csrc" / "call_args.h").read_text()
    checks = call_args[call_args.index("// ---- checks"):call_args.index("// ---- launch arguments")]
    assert {"check_verify", "check_write", "check_plan", "check_scatter"} <= set(
        re.findall(r"^inline std::string (check_\w+)\(", checks, re.M))
    for n, line in enumerate(checks.splitlines()):
        if re.search(r"\.data\b", line.split("//")[0]):
            offenders.append(f"call_args.h checks read buffer data: {line.strip()}")
    sync = re.compile(r"cudaMemcpyDeviceToHost|cudaMemcpyDefault|\bcudaMemcpy(?:2D|3D)?\s*\(|Synchronize\s*\(|"
                      r"cudaStreamQuery\s*\(|cudaMallocHost|cudaHostAlloc|cudaMallocManaged")
    for path in gpu:
        for n, line in enumerate(path.read_text().splitlines()):
            if sync.search(line.split("//")[0]):
                offenders.append(f"{path.name}:{n + 1}: {line.strip()}")
    assert not offenders, "possible data-dependent handler errors / host syncs:\n" + "\n".join(offenders)
