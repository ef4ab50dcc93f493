"""The endpoint bundle inside a jitted, donated step, with the real ops (package default impl)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support import hlo
from tests.support.impls import BACKEND_PARAMS
import jax_kvcanary as kvc
from jax_kvcanary.consts import LaunchTag as T
from jax_kvcanary.runtime import (CanaryBatch, CanaryConfig, CanaryEndpoints, CanaryHealthError,
                                  Monitor, set_chain_position_assert, translate_slots)

S, L = 32, 16


def i32(x):
    return jnp.asarray(np.asarray(x, np.int32))


def sources(kv):
    s = kvc.RealKvSource(kv, 1, 64, 64)
    return {"FULL": {"K": s, "V": s}}


def make(cfg=None):
    cfg = cfg or CanaryConfig(health_interval=2, write_input_assert=True)
    ep = CanaryEndpoints(cfg, num_slots=S, write_req_capacity=2, verify_capacity=2 * L)

    def step(st, kv, b):
        st, ctx = ep.head(st, b)
        kv = kv.at[b.out_cache_loc].set(b.input_ids[:, None].astype(jnp.float32) + 0.5)
        return ep.tail(st, ctx, sources(kv)), kv

    return ep, jax.jit(step, donate_argnums=(0, 1))


class Req:
    """One request row (pool row 1) fed token by token: a 4-token prefill, then decodes."""

    def __init__(self):
        self.r2t = np.zeros((3, L), np.int32)
        self.n = 0

    def batch(self, e, pos_shift=0, token=None):
        p = self.n
        slots = list(range(p + 1, p + 1 + e))
        self.r2t[1, p:p + e] = slots
        self.n += e
        ids = [token if token is not None else 100 + p + i for i in range(e)]
        pad = lambda v: v + [0] * (4 - len(v))  # noqa: E731
        pos = [p + i + pos_shift for i in range(e)]
        return CanaryBatch(i32([1, 0]), i32([p, 0]), i32([e, 0]), i32(self.r2t), i32(pad(ids)),
                           i32(pad(pos)), i32(pad(slots)), expected_input_tokens=i32(pad(ids)),
                           expected_input_positions=i32(pad(pos)))


def test_clean_steps_are_silent_and_counted():
    ep, step = make()
    st, kv, req, mon = ep.init_state(), jnp.zeros((S, 16), jnp.float32), Req(), None
    mon = Monitor.from_config(ep.config)
    for e in (4, 1, 1, 1):
        st, kv = step(st, kv, req.batch(e))
        assert mon.step(st) == []
    assert mon.flush() == []
    runs, slot_runs = st.log.kernel_runs(), st.log.slot_runs()
    for t in (T.HEAD_K_FULL, T.HEAD_V_FULL, T.TAIL_K_FULL, T.TAIL_V_FULL):
        assert runs[t] == 8                                   # +2 per step (verify + write)
        assert slot_runs[t] == (0 + 4 + 5 + 6) + 7            # verified prefixes + written
    assert runs[T.HEAD_K_SWA] == runs[T.SWEEP_K_FULL] == 0
    c = mon.counters
    assert c.written[0, T.TAIL_K_FULL] == 7 and c.verified[0, T.TAIL_K_FULL] == 15
    assert st.log.total() == 0
    fields = kvc.canary_fields(st.canaries["TAIL_K_FULL"])
    assert fields[1:8, 0].tolist() == [100, 101, 102, 103, 104, 105, 106]
    assert np.all(fields[1:8, 3] != 0) and np.all(kvc.canary_fields(st.canaries["HEAD_K_FULL"])[:, 3] == 0)


def test_one_step_lag_with_real_ops():
    ep, step = make()
    st, kv, req, mon = ep.init_state(), jnp.zeros((S, 16), jnp.float32), Req(), Monitor("log")
    st, kv = step(st, kv, req.batch(4))
    assert mon.step(st) == []
    kv = kv.at[2, 0].add(1.0)                                 # corrupt the KV of slot 2
    st, kv = step(st, kv, req.batch(1))                       # step 2 records the violation
    assert mon.step(st) == []                                 # ... not reported yet
    st, kv = step(st, kv, req.batch(1))
    vs = mon.step(st)                                         # reported after step 3
    assert {(v.tag_name, v.slot, v.reasons) for v in vs} == {
        ("TAIL_K_FULL", 2, ("verify_real_kv_hash",)), ("TAIL_V_FULL", 2, ("verify_real_kv_hash",))}
    assert all(v.step == 3 for v in vs)


def test_chain_position_assert_flag_without_recompile():
    ep, step = make()
    st, kv, req = ep.init_state(), jnp.zeros((S, 16), jnp.float32), Req()
    st = set_chain_position_assert(st, False)                 # warm-up
    st, kv = step(st, kv, req.batch(4))
    st, kv = step(st, kv, req.batch(1, pos_shift=3))          # synthetic position: 7 after 3
    assert st.log.total() == 0 and not st.log.chain_position_assert_enabled()
    st = set_chain_position_assert(st, True)                  # serving
    st, kv = step(st, kv, req.batch(1, pos_shift=6))          # position 11 after 8
    rows = st.log.rows()
    assert step._cache_size() == 1
    assert {(int(r[0]), int(r[7])) for r in rows} >= {(int(T.HEAD_K_FULL), 16), (int(T.TAIL_V_FULL), 16)}
    assert all(int(r[6]) == 8 and int(r[2]) == 11 for r in rows if r[7] == 16)   # seed pos 7 + 1


def assert_device_only(hlo: str):
    """No host callback, infeed/outfeed or send/recv in compiled HLO; custom calls are ours."""
    targets = set(re.findall(r'custom_call_target="([^"]+)"', hlo))
    assert all(t.startswith("kvcanary_") for t in targets), targets
    assert not any("callback" in t for t in targets)
    assert not re.search(r"\b(outfeed|infeed|send|recv|send-done|recv-done)\(", hlo)


def test_compiled_step_is_device_only_and_donates():
    ep, step = make()
    st, kv, req = ep.init_state(), jnp.zeros((S, 16), jnp.float32), Req()
    hlo = step.lower(st, kv, req.batch(4)).compile().as_text()
    assert_device_only(hlo)
    assert "input_output_alias" in hlo or "may-alias" in hlo or "must-alias" in hlo
    old = st.log.ring
    step(st, kv, req.batch(1))
    assert old.is_deleted()                                   # the state was donated


@pytest.mark.parametrize("impl", BACKEND_PARAMS)
def test_compiled_step_copies_no_canary_state(impl, monkeypatch):
    """The whole engine step (plan, HEAD and TAIL verify + write of K and V with real-KV sources)
    updates every canary buffer and the log in place, on both backends. (The runtime's own 96-byte
    ``written`` statistics counter is aliased too, but XLA may copy it between its row updates.)"""
    monkeypatch.setenv("JAX_KVCANARY_IMPL", impl)   # read at trace time
    ep, step = make()
    st, kv, req = ep.init_state(), jnp.zeros((S, 16), jnp.float32), Req()
    text = step.lower(st, kv, req.batch(4)).compile().as_text()
    leaves = jax.tree_util.tree_leaves(st)
    assert set(range(len(leaves))) <= set(hlo.aliases(text).values())
    assert not hlo.state_copies(impl, text, jax.tree_util.tree_leaves((st.canaries, st.log)))


def test_health_check_catches_bypass_and_dead_code():
    ep, step = make()
    bypass = jax.jit(lambda st, kv, b: (st, kv.at[b.out_cache_loc].set(1.0)), donate_argnums=(0, 1))

    def dce(st, kv, b):                                       # canary computed, result dropped
        st2, ctx = ep.head(st, b)
        del st2, ctx
        return st, kv

    for bad in (bypass, jax.jit(dce)):
        st, kv, req = ep.init_state(), jnp.zeros((S, 16), jnp.float32), Req()
        mon = Monitor.from_config(ep.config)
        st, kv = step(st, kv, req.batch(4))
        mon.step(st)
        with pytest.raises(CanaryHealthError) as e:
            for _ in range(6):
                st, kv = bad(st, kv, req.batch(1))
                mon.step(st)
        assert set(e.value.missing_tags) == {T.HEAD_K_FULL, T.HEAD_V_FULL, T.TAIL_K_FULL, T.TAIL_V_FULL}


def test_trace_time_errors():
    ep, _ = make(CanaryConfig(token_check=True))
    b = Req().batch(4)
    with pytest.raises(ValueError, match="token_check=True needs batch.token_pool"):
        jax.jit(lambda st: ep.head(st, b)[0])(ep.init_state())
    ep, _ = make(CanaryConfig(write_input_assert=True))
    with pytest.raises(ValueError, match="write_input_assert=True needs batch.expected_input_tokens"):
        ep.head(ep.init_state(), b._replace(expected_input_tokens=None))
    ep, _ = make(CanaryConfig())
    st, ctx = ep.head(ep.init_state(), b)
    with pytest.raises(ValueError, match=r"no real-KV source was given for TAIL_K_FULL"):
        ep.tail(st, ctx, {})
    with pytest.raises(ValueError, match="swa_num_slots"):
        CanaryEndpoints(CanaryConfig(groups=("FULL", "SWA"), swa_window_size=4), num_slots=8,
                        write_req_capacity=1, verify_capacity=8)
    with pytest.raises(TypeError, match="CanaryConfig"):
        CanaryEndpoints({}, num_slots=8, write_req_capacity=1, verify_capacity=8)


def test_mode_none_installs_nothing():
    ep, step = make(CanaryConfig(mode="none"))
    st = ep.init_state()
    assert st.canaries == {}
    st, kv = step(st, jnp.zeros((S, 16), jnp.float32), Req().batch(4))
    assert st.log.kernel_runs().sum() == 0


def test_translate_slots():
    lut = i32([0, 5, 0, 7])
    assert translate_slots(lut, i32([1, 2, 3, 4, -1, 0])).tolist() == [5, 0, 7, -1, -1, 0]
