"""Replay upstream SGLang kv-canary golden scenarios (``tests/data/upstream``, see its FORMAT.md)
through the public ops (``ops`` fixture: reference, ffi, xla) and compare bytes.

Mapping onto this project's representation (docs/format.md §3.3 / §13.2):

* ``violation_ring`` int64[cap, 8]  -> ``log.ring`` uint8[cap, 64] (same bytes);
* ``violation_write_index`` [1]     -> ``log.write_index`` int32[1];
* per-launch ``*_run_counter`` [1]  -> row ``tag`` of ``uint8[12, 8]`` counters; the other 11 rows are
  filled with a byte pattern and must pass through unchanged;
* ``real_kv_src{i}_u8`` (or its float16 / bfloat16 twin) -> ``RealKvSource``.

Every scenario runs twice: with int64 index arrays (under ``jax.enable_x64``), and with int32 arrays
(x64 off, the serving default) when every value fits.

The scenarios were produced by upstream's own reference code and are kept in the repository; a
missing or empty data directory fails the suite (it is never skipped).
"""

import contextlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_kvcanary as kvc


UPSTREAM = Path(__file__).resolve().parent / "data" / "upstream"
SCENARIOS = sorted(p.stem for p in UPSTREAM.glob("*.npz"))
SINGLE = [s for s in SCENARIOS if not s.startswith("roundtrip_")]
ROUNDTRIPS = [s for s in SCENARIOS if s.startswith("roundtrip_")]
WIDTHS = ("i64", "i32")
NUM_TAGS = kvc.NUM_LAUNCH_TAGS

_cache = {}


def load(name):
    if name not in _cache:
        z = np.load(UPSTREAM / f"{name}.npz", allow_pickle=False)
        _cache[name] = ({k: z[k] for k in z.files}, json.loads(str(z["meta_json"])))
    return _cache[name]


def test_upstream_data_is_in_the_repository():
    """The scenarios ship with the repository; a missing directory is a failure, not a skip (the
    parametrised tests below then run on a "<missing>" placeholder and fail too)."""
    assert (UPSTREAM / "FORMAT.md").is_file(), f"missing {UPSTREAM}/FORMAT.md"
    assert len(SINGLE) >= 10 and ROUNDTRIPS, f"upstream scenarios missing under {UPSTREAM}: {SCENARIOS}"


def _roundtrip_launch_ids():
    out = []
    for name in ROUNDTRIPS:
        _, meta = load(name)
        out += [(name, L["idx"], L["op"]) for L in meta["launches"]]
    return out


ROUNDTRIP_LAUNCHES = _roundtrip_launch_ids()


# ---- conversion ---------------------------------------------------------------------------------

class Ctx:
    """Index-array width of one replay: int64 under x64, or int32 with x64 off."""

    def __init__(self, width):
        self.width = width
        self.dtype = np.int64 if width == "i64" else np.int32

    def scope(self):
        return jax.enable_x64(True) if self.width == "i64" else contextlib.nullcontext()

    def idx(self, a):
        a = np.asarray(a)
        if self.dtype == np.int32:
            if a.size and (a.min() < -2**31 or a.max() >= 2**31):
                pytest.skip("values do not fit int32; covered by the i64 replay")
        return jnp.asarray(a.astype(self.dtype))


def i32(a):
    return jnp.asarray(np.asarray(a).astype(np.int32))


def _other_rows_pattern(tag, salt):
    """Distinct bytes for the counter rows a launch must not touch."""
    p = ((np.arange(NUM_TAGS * 8).reshape(NUM_TAGS, 8) * 37 + salt) & 0xFF).astype(np.uint8)
    p[tag] = 0
    return p


def _counter_rows(value_1elem, tag, salt):
    c = _other_rows_pattern(tag, salt)
    c[tag] = np.asarray(value_1elem, dtype="<i8").reshape(1).view(np.uint8)
    return c


def make_log(d, p, tag, flag=1):
    """ViolationLog from the ``{p}*_in`` upstream state."""
    ring = np.ascontiguousarray(d[p + "violation_ring_in"].astype("<i8")).view(np.uint8)
    return kvc.ViolationLog(
        ring=jnp.asarray(ring),
        write_index=i32(d[p + "violation_write_index_in"]),
        kernel_run_counters=jnp.asarray(_counter_rows(d[p + "kernel_run_counter_in"], tag, 11)),
        slot_run_counters=jnp.asarray(_counter_rows(d[p + "slot_run_counter_in"], tag, 29)),
        enable_chain_position_assert=i32(np.asarray(flag).reshape(1)))


def make_sources(d, p):
    n = int(d[p + "num_real_kv_sources"])
    params = np.asarray(d[p + "real_kv_source_params"]).reshape(-1, 3)
    out = []
    for i in range(n):
        ps, nb, rb = (int(v) for v in params[i])
        u8 = d[f"{p}real_kv_src{i}_u8"]
        arr = u8
        if f"{p}real_kv_src{i}_f16" in d:
            arr = d[f"{p}real_kv_src{i}_f16"]
            assert arr.view(np.uint8).reshape(u8.shape).tobytes() == u8.tobytes()
        elif f"{p}real_kv_src{i}_bf16_bits" in d:
            arr = d[f"{p}real_kv_src{i}_bf16_bits"].view(ml_dtypes.bfloat16)
            assert arr.view(np.uint8).reshape(u8.shape).tobytes() == u8.tobytes()
        out.append(kvc.RealKvSource(jnp.asarray(arr), ps, nb, rb))
    return tuple(out)


def check_log(log, d, p, tag, what):
    ring = np.asarray(log.ring)
    assert ring.dtype == np.uint8 and ring.shape == (d[p + "violation_ring_out"].shape[0], 64)
    np.testing.assert_array_equal(ring.view("<i8"), d[p + "violation_ring_out"],
                                  err_msg=f"{what}: ring")
    assert np.asarray(log.write_index).tolist() == d[p + "violation_write_index_out"].tolist(), \
        f"{what}: write_index"
    for field, key, salt in (("kernel_run_counters", "kernel_run_counter_out", 11),
                             ("slot_run_counters", "slot_run_counter_out", 29)):
        got = np.asarray(getattr(log, field))
        np.testing.assert_array_equal(got, _counter_rows(d[p + key], tag, salt),
                                      err_msg=f"{what}: {field} (row {tag} = upstream, others kept)")


# ---- single launches ----------------------------------------------------------------------------

def run_write(ops, d, p, cx, canary=None, log=None, plan=None):
    tag = int(d[p + "kernel_kind"])
    if canary is None:
        canary = jnp.asarray(d[p + "canary_buf_in"])
    if log is None:
        log = make_log(d, p, tag, d[p + "enable_chain_position_assert"])
    if plan is None:
        plan = kvc.WritePlan(offsets=cx.idx(d[p + "write_offsets"]),
                             seed_slot_indices=cx.idx(d[p + "write_seed_slot_indices"]),
                             num_valid_reqs=i32(d[p + "write_num_valid_reqs"]))
    kw = {}
    if int(d[p + "enable_write_input_assert"]):
        kw = dict(enable_write_input_assert=True,
                  expected_input_tokens=cx.idx(d[p + "expected_input_tokens"]),
                  expected_input_positions=cx.idx(d[p + "expected_input_positions"]))
    return ops.write(canary, log, plan, cx.idx(d[p + "input_ids"]), cx.idx(d[p + "positions"]),
                     cx.idx(d[p + "out_cache_loc"]), tag=tag,
                     real_kv_sources=make_sources(d, p),
                     real_kv_hash_mode=int(d[p + "real_kv_hash_mode"]), **kw)


def run_verify(ops, d, p, cx, canary=None, log=None, plan=None):
    tag = int(d[p + "kernel_kind"])
    if canary is None:
        canary = jnp.asarray(d[p + "canary_buf_in"])
    if log is None:
        log = make_log(d, p, tag)
    if plan is None:
        plan = kvc.VerifyPlan(slot_indices=cx.idx(d[p + "verify_slot_indices"]),
                              expected_tokens=cx.idx(d[p + "verify_expected_tokens"]),
                              expected_positions=cx.idx(d[p + "verify_expected_positions"]),
                              prev_slot_indices=cx.idx(d[p + "verify_prev_slot_indices"]),
                              num_valid=i32(d[p + "verify_num_valid"]), enable=i32(d[p + "enable"]))
    return ops.verify(canary, log, plan, tag=tag,
                      check_verify_expected_token=bool(int(d[p + "check_verify_expected_token"])),
                      real_kv_sources=make_sources(d, p),
                      real_kv_hash_mode=int(d[p + "real_kv_hash_mode"]))


def run_plan(ops, d, p, cx):
    kw = {}
    if p + "full_to_swa_index_mapping" in d:
        kw["full_to_swa_index_mapping"] = cx.idx(d[p + "full_to_swa_index_mapping"])
    if p + "req_to_verify_expected_tokens" in d:
        kw["req_to_verify_expected_tokens"] = cx.idx(d[p + "req_to_verify_expected_tokens"])
        kw["req_to_verify_expected_tokens_valid_lens"] = cx.idx(
            d[p + "req_to_verify_expected_tokens_valid_lens"])
    return ops.plan(cx.idx(d[p + "req_pool_indices"]), cx.idx(d[p + "prefix_lens"]),
                    cx.idx(d[p + "extend_seq_lens"]), cx.idx(d[p + "req_to_token"]),
                    verify_capacity=int(d[p + "verify_capacity"]),
                    write_req_capacity=int(d[p + "write_req_capacity"]),
                    swa_window_size=int(d[p + "swa_window_size"]),
                    kv_token_id_vs_position_offset=int(d[p + "kv_token_id_vs_position_offset"]), **kw)


VERIFY_FIELDS = ("slot_indices", "expected_tokens", "expected_positions", "prev_slot_indices")


def check_plan(vp, wp, d, p, what):
    """Compare the regions FORMAT.md defines; also the zero tails this project defines (§9.2)."""
    out = {f: np.asarray(getattr(vp, f)) for f in VERIFY_FIELDS + ("num_valid", "enable")}
    out.update(offsets=np.asarray(wp.offsets), seeds=np.asarray(wp.seed_slot_indices),
               nvr=np.asarray(wp.num_valid_reqs))
    for k, v in out.items():
        assert v.dtype == np.int32, f"{what}: {k} dtype {v.dtype}"
    assert out["num_valid"].tolist() == d[p + "verify_num_valid_out"].tolist(), f"{what}: num_valid"
    assert out["enable"].tolist() == d[p + "enable_out"].tolist(), f"{what}: enable"
    assert out["nvr"].tolist() == d[p + "write_num_valid_reqs_out"].tolist(), f"{what}: num_valid_reqs"
    nv = int(d[p + "verify_num_valid_out"][0])
    for f in VERIFY_FIELDS:
        if int(d[p + "enable_out"][0]) == 1:
            np.testing.assert_array_equal(out[f][:nv], d[f"{p}verify_{f}_out"][:nv],
                                          err_msg=f"{what}: {f}")
            assert not out[f][nv:].any(), f"{what}: {f} tail past num_valid must be 0"
        else:
            assert not out[f].any(), f"{what}: {f} must be all 0 on overflow"
    np.testing.assert_array_equal(out["offsets"], d[p + "write_offsets_out"], err_msg=f"{what}: offsets")
    bs = d[p + "req_pool_indices"].shape[0]
    cap = d[p + "write_seed_slot_indices_out"].shape[0]
    np.testing.assert_array_equal(out["seeds"][:min(bs, cap)],
                                  d[p + "write_seed_slot_indices_out"][:min(bs, cap)],
                                  err_msg=f"{what}: seeds")
    assert not out["seeds"][bs:].any(), f"{what}: seeds past bs must be 0"


def replay_one(ops, d, p, kind, cx, what):
    if kind == "plan":
        vp, wp = run_plan(ops, d, p, cx)
        check_plan(vp, wp, d, p, what)
        return
    tag = int(d[p + "kernel_kind"])
    if kind == "write":
        canary, log = run_write(ops, d, p, cx)
        got = np.asarray(canary)
        assert got.dtype == np.uint8
        np.testing.assert_array_equal(got, d[p + "canary_buf_out"], err_msg=f"{what}: canary bytes")
    else:
        log = run_verify(ops, d, p, cx)
        np.testing.assert_array_equal(d[p + "canary_buf_out"], d[p + "canary_buf_in"])
    check_log(log, d, p, tag, what)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("scenario", SINGLE or ["<missing>"])
def test_upstream_scenario(ops, scenario, width):
    d, meta = load(scenario)
    cx = Ctx(width)
    with cx.scope():
        replay_one(ops, d, "", meta["kind"], cx, scenario)
    if "summary" in meta and meta["kind"] != "plan":
        s = meta["summary"]
        assert s["kernel_run_delta"] == 1
        assert int(d["violation_write_index_out"][0] - d["violation_write_index_in"][0]) == \
            s["new_violations"]


# ---- roundtrip: every launch independently, then the chained end state --------------------------

@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("launch", ROUNDTRIP_LAUNCHES or [("<missing>", 0, "")],
                         ids=lambda L: f"{L[0]}-L{L[1]:03d}-{L[2]}")
def test_roundtrip_launch(ops, launch, width):
    name, idx, op = launch
    d, _ = load(name)
    cx = Ctx(width)
    with cx.scope():
        replay_one(ops, d, f"L{idx:03d}_", op, cx, f"{name} L{idx:03d} {op}")


def _plan_matches_launch(vp, wp, d, p, op):
    """The plan a launch recorded equals (on its defined region) the chained plan we produced."""
    if op == "verify":
        nv = int(np.asarray(vp.num_valid)[0])
        assert np.asarray(vp.num_valid).tolist() == d[p + "verify_num_valid"].tolist()
        assert np.asarray(vp.enable).tolist() == d[p + "enable"].tolist()
        if int(d[p + "enable"][0]):
            for f in VERIFY_FIELDS:
                np.testing.assert_array_equal(np.asarray(getattr(vp, f))[:nv],
                                              d[f"{p}verify_{f}"][:nv])
    else:
        n = int(d[p + "write_num_valid_reqs"][0])
        assert np.asarray(wp.num_valid_reqs).tolist() == [n]
        np.testing.assert_array_equal(np.asarray(wp.offsets)[:n + 1], d[p + "write_offsets"][:n + 1])
        np.testing.assert_array_equal(np.asarray(wp.seed_slot_indices)[:n],
                                      d[p + "write_seed_slot_indices"][:n])


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("scenario", ROUNDTRIPS or ["<missing>"])
def test_roundtrip_chained(ops, scenario, width):
    """Run the whole serving sequence on our own state (canaries per buffer, one shared log, plans
    from our own plan launches) and compare every canary and the final log with upstream's."""
    d, meta = load(scenario)
    cx = Ctx(width)
    with cx.scope():
        first = meta["launches"][0]["prefix"]
        canaries, plans = {}, {}
        log = None
        for L in meta["launches"]:
            p, op, buf = L["prefix"], L["op"], L["buffer"]
            what = f"{scenario} chained L{L['idx']:03d} {op} {buf}"
            if op == "plan":
                plans[L["group"]] = run_plan(ops, d, p, cx)
                check_plan(*plans[L["group"]], d, p, what)
                continue
            if log is None:  # fresh 12-tag log from the first mutating launch's ring state
                ring = np.ascontiguousarray(d[p + "violation_ring_in"].astype("<i8")).view(np.uint8)
                log = kvc.ViolationLog(
                    ring=jnp.asarray(ring), write_index=i32(d[p + "violation_write_index_in"]),
                    kernel_run_counters=jnp.zeros((NUM_TAGS, 8), jnp.uint8),
                    slot_run_counters=jnp.zeros((NUM_TAGS, 8), jnp.uint8),
                    enable_chain_position_assert=i32([1]))
            if buf not in canaries:
                canaries[buf] = jnp.asarray(d[p + "canary_buf_in"])
            else:
                np.testing.assert_array_equal(np.asarray(canaries[buf]), d[p + "canary_buf_in"],
                                              err_msg=what + ": chained canary_in")
            vp, wp = plans[L["group"]]
            _plan_matches_launch(vp, wp, d, p, op)
            if op == "write":
                flag = i32(np.asarray(d[p + "enable_chain_position_assert"]).reshape(1))
                log = kvc.ViolationLog(log.ring, log.write_index, log.kernel_run_counters,
                                       log.slot_run_counters, flag)
                canaries[buf], log = run_write(ops, d, p, cx, canary=canaries[buf], log=log, plan=wp)
                np.testing.assert_array_equal(np.asarray(canaries[buf]), d[p + "canary_buf_out"],
                                              err_msg=what + ": canary_out")
            else:
                log = run_verify(ops, d, p, cx, canary=canaries[buf], log=log, plan=vp)
            tag = int(d[p + "kernel_kind"])
            assert log.kernel_runs()[tag] == int(d[p + "kernel_run_counter_out"][0]), what
            assert log.slot_runs()[tag] == int(d[p + "slot_run_counter_out"][0]), what
            assert log.total() == int(d[p + "violation_write_index_out"][0]), what
        assert first  # at least one launch
        np.testing.assert_array_equal(log.kernel_runs(), d["final_kernel_run_counters"])
        np.testing.assert_array_equal(log.slot_runs(), d["final_slot_run_counters"])
        np.testing.assert_array_equal(np.asarray(log.ring).view("<i8"), d["final_violation_ring"])
        assert [log.total()] == d["final_violation_write_index"].tolist()
        assert log.total() == meta.get("total_violations", log.total())
