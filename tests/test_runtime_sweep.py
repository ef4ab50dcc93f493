"""Sweep plans: buckets, padding, LUT translation, and a SWEEP run against TAIL canaries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcanary as kvc
from jax_kvcanary.consts import LaunchTag as T
from jax_kvcanary.runtime import (CanaryBatch, CanaryConfig, CanaryEndpoints, Monitor,
                                  bucket_capacity, build_group_sweep_plans, build_sweep_plan,
                                  translate_chains)


def test_bucket_capacity():
    assert [bucket_capacity(n, 4) for n in (0, 1, 4, 5, 9)] == [4, 4, 4, 8, 16]
    assert bucket_capacity(300) == 512 and bucket_capacity(3) == 256


def test_plan_padding():
    plan = build_sweep_plan([(5, 0, -1), (6, 1, 5), (9, 2, 6)], min_capacity=4)
    assert np.asarray(plan.slot_indices).tolist() == [5, 6, 9, 0]
    assert np.asarray(plan.expected_positions).tolist() == [0, 1, 2, 0]
    assert np.asarray(plan.prev_slot_indices).tolist() == [-1, 5, 6, 0]
    assert np.asarray(plan.expected_tokens).tolist() == [-1, -1, -1, 0]
    assert np.asarray(plan.num_valid).tolist() == [3] and np.asarray(plan.enable).tolist() == [1]
    assert all(np.asarray(x).dtype == np.int32 for x in jax.tree.leaves(plan))
    empty = build_sweep_plan([], min_capacity=4)
    assert np.asarray(empty.num_valid).tolist() == [0] and empty.slot_indices.shape == (4,)
    with pytest.raises(ValueError, match="do not fit capacity 2"):
        build_sweep_plan([(1, 0, -1)] * 3, capacity=2)
    with pytest.raises(ValueError, match="triples"):
        build_sweep_plan([(1, 0)])


def test_translate_chains():
    lut = np.array([0, 11, 0, 13, 14])           # slot 2 evicted
    out = translate_chains([(1, 0, -1), (2, 1, 1), (3, 2, 2), (9, 3, 3)], lut)
    assert out.tolist() == [[11, 0, -1], [0, 1, 11], [13, 2, 0], [-1, 3, 13]]


def test_group_plans_share_capacity():
    plans = build_group_sweep_plans([(1, 0, -1)], ("FULL", "SWA"), lut=np.arange(4) + 10, min_capacity=8)
    assert plans["FULL"].slot_indices.shape == plans["SWA"].slot_indices.shape == (8,)
    assert int(plans["SWA"].slot_indices[0]) == 11
    with pytest.raises(ValueError, match="lut"):
        build_group_sweep_plans([(1, 0, -1)], ("SWA",))



def test_sweep_detects_cached_kv_corruption():
    """Write a chain through TAIL, then a SWEEP of it is clean until a cached slot's KV byte flips."""
    cfg = CanaryConfig(sweep_interval=1, real_kv_hash_mode="ALL")
    ep = CanaryEndpoints(cfg, num_slots=16, write_req_capacity=1, verify_capacity=16)
    kv = jnp.arange(16 * 16, dtype=jnp.float32).reshape(16, 16)
    src = lambda kv: {"FULL": {"K": kvc.RealKvSource(kv, 1, 64, 64),  # noqa: E731
                               "V": kvc.RealKvSource(kv, 1, 64, 64)}}
    r2t = np.zeros((2, 8), np.int32)
    r2t[1, :4] = [3, 4, 5, 6]
    i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))  # noqa: E731
    batch = CanaryBatch(i32([1]), i32([0]), i32([4]), i32(r2t), i32([10, 11, 12, 13]),
                        i32([0, 1, 2, 3]), i32([3, 4, 5, 6]))

    @jax.jit
    def step(st, kv):
        st, ctx = ep.head(st, batch)
        return ep.tail(st, ctx, src(kv))

    sweep = jax.jit(lambda st, kv, plans: ep.sweep(st, plans, src(kv)))
    st = step(ep.init_state(), kv)
    plans = {"FULL": build_sweep_plan([(3, 0, -1), (4, 1, 3), (5, 2, 4), (6, 3, 5)])}
    st = sweep(st, kv, plans)
    mon = Monitor("log")
    mon.step(st)
    assert mon.flush() == []
    runs = st.log.kernel_runs()
    assert runs[T.SWEEP_K_FULL] == runs[T.SWEEP_V_FULL] == 1 and runs[T.SWEEP_K_SWA] == 0
    assert st.log.slot_runs()[T.SWEEP_K_FULL] == 4
    kv2 = kv.at[5, 0].add(1.0)                   # the KV of cached slot 5 changes
    st = sweep(st, kv2, plans)
    mon.step(st)
    vs = mon.flush()
    assert [(v.tag_name, v.slot, v.position, v.reasons) for v in vs] == [
        ("SWEEP_K_FULL", 5, 2, ("verify_real_kv_hash",)),
        ("SWEEP_V_FULL", 5, 2, ("verify_real_kv_hash",))]


def test_a_sweep_covers_the_groups_its_plans_name():
    """A FULL-only sweep on FULL + SWA endpoints (a radix cache holds full-pool slots): only the
    FULL tags run; a plan for a group the endpoints lack is refused."""
    cfg = CanaryConfig(groups=("FULL", "SWA"), swa_window_size=4, sweep_interval=1,
                       real_kv_hash_mode="NONE")
    ep = CanaryEndpoints(cfg, num_slots=16, write_req_capacity=1, verify_capacity=16,
                         swa_num_slots=8)
    st = ep.init_state()
    plans = {"FULL": build_sweep_plan([(3, 0, -1), (4, 1, 3)])}
    st = jax.jit(lambda st, plans: ep.sweep(st, plans))(st, plans)
    runs = st.log.kernel_runs()
    assert runs[T.SWEEP_K_FULL] == runs[T.SWEEP_V_FULL] == 1
    assert runs[T.SWEEP_K_SWA] == runs[T.SWEEP_V_SWA] == 0
    with pytest.raises(ValueError, match=r"sweep plans must name groups of \['FULL'\], got "
                                         r"\['SWA'\]"):
        CanaryEndpoints(CanaryConfig(sweep_interval=1, real_kv_hash_mode="NONE"), num_slots=16,
                        write_req_capacity=1,
                        verify_capacity=16).sweep(ep.init_state(), {"SWA": plans["FULL"]})
