"""export_records / import_records (format.md §14.1): byte-identical to the numpy reference on
adversarial slot lists (negative, out of range, repeated, slot 0), export/import round-trip
identity, jit with donation (no copy of the canary), x64 on and off identical, the state helpers,
and the trace-time error texts."""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcanary as kvc
from jax_kvcanary.runtime import CanaryConfig, CanaryEndpoints
from jax_kvcanary.runtime.offload import (export_records, export_state_records, import_records,
                                          import_state_records)
from tests.support import hlo, runtime_reference

S, STRIDE = 37, 40      # distinctive: a copy of the canary is recognisable in the HLO


def _canary(seed, num_slots=S, stride=STRIDE):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 256, (num_slots, stride), dtype=np.uint8))


def _slots(seed, n, dtype=np.int32):
    rng = np.random.default_rng(seed)
    s = rng.integers(-3, S + 4, n)
    s[rng.integers(0, n, 3)] = s[0]          # repeated slots
    s[n // 2], s[1], s[2] = 0, S + 2, -1
    return s.astype(dtype)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_export_import_match_the_reference(seed, dtype):
    with jax.enable_x64(True) if dtype == np.int64 else contextlib.nullcontext():
        canary, slots = _canary(seed), jnp.asarray(_slots(seed, 24, dtype))
        recs = jnp.asarray(np.random.default_rng(seed + 100).integers(0, 256, (24, 32), dtype=np.uint8))
        got, oob = export_records(canary, slots)
        want, want_oob = runtime_reference.export_records(canary, slots)
        assert np.array_equal(np.asarray(got), want) and np.array_equal(np.asarray(oob), want_oob)
        new, oob = import_records(canary, slots, recs)
        want, want_oob = runtime_reference.import_records(canary, slots, recs)
        assert np.array_equal(np.asarray(new), want) and np.array_equal(np.asarray(oob), want_oob)
        assert int(want_oob[0]) == int(np.sum(np.asarray(slots) >= S)) > 0


@pytest.mark.parametrize("seed", range(4))
def test_round_trip_is_the_identity(seed):
    """Export at some slots, import into a fresh canary at other (unique) slots, export back: the
    same records; importing them at the original slots leaves the canary bit-identical."""
    rng = np.random.default_rng(seed)
    canary = _canary(seed)
    src = jnp.asarray(rng.permutation(S)[:20].astype(np.int32))
    dst = jnp.asarray(rng.permutation(S)[:20].astype(np.int32))
    recs, _ = export_records(canary, src)
    moved, oob = import_records(kvc.new_canary_buffer(S, STRIDE), dst, recs)
    again, _ = export_records(moved, dst)
    assert int(oob[0]) == 0 and np.array_equal(np.asarray(again), np.asarray(recs))
    back, _ = import_records(canary, src, recs)
    assert np.array_equal(np.asarray(back), np.asarray(canary))
    assert np.array_equal(np.asarray(moved)[np.asarray(dst), 32:], np.zeros((20, STRIDE - 32), np.uint8))


def test_empty_slot_list():
    canary = _canary(0)
    recs, oob = export_records(canary, jnp.zeros((0,), jnp.int32))
    assert recs.shape == (0, 32) and int(oob[0]) == 0
    new, oob = import_records(canary, jnp.zeros((0,), jnp.int32), recs)
    assert np.array_equal(np.asarray(new), np.asarray(canary)) and int(oob[0]) == 0


def test_donated_import_updates_the_canary_in_place():
    f = jax.jit(import_records, donate_argnums=0)
    canary, slots = _canary(1), jnp.asarray(_slots(1, 12))
    recs = jnp.zeros((12, 32), jnp.uint8)
    text = f.lower(canary, slots, recs).compile().as_text()
    assert hlo.aliases(text).get((0,)) == 0
    assert hlo.state_copies("ffi", text, [canary]) == []
    new, _ = f(canary, slots, recs)
    assert canary.is_deleted() and new.shape == (S, STRIDE)


def test_export_inside_a_donating_step_copies_nothing():
    """A step that exports before writing, donating the canary: one buffer, no copy."""
    def step(canary, slots):
        recs, oob = export_records(canary, slots)
        canary, _ = import_records(canary, slots[::-1], recs)
        return canary, oob
    canary, slots = _canary(2), jnp.asarray(_slots(2, 8))
    text = jax.jit(step, donate_argnums=0).lower(canary, slots).compile().as_text()
    assert hlo.aliases(text).get((0,)) == 0
    assert hlo.state_copies("ffi", text, [canary]) == []


@pytest.mark.parametrize("call, text", [
    (lambda: export_records(np.zeros((4, 32), np.int8), np.zeros(2, np.int32)),
     "kv-canary: canary must have dtype uint8, got int8"),
    (lambda: export_records(jnp.zeros((4, 32), jnp.uint8), np.zeros(2, np.float32)),
     "kv-canary: slots must have dtype int32 or int64, got float32"),
    (lambda: import_records(jnp.zeros((4, 32), jnp.uint8), np.zeros(2, np.int32), np.zeros((3, 32), np.uint8)),
     "kv-canary: records must have shape (len(slots), 32) = (2, 32), got (3, 32)"),
    (lambda: import_records(jnp.zeros((4, 32), jnp.uint8), np.zeros(2, np.int32), np.zeros((2, 32), np.int32)),
     "kv-canary: records must have dtype uint8, got int32"),
])
def test_error_texts(call, text):
    with pytest.raises((TypeError, ValueError), match=re.escape(text) + "$"):
        call()


def test_state_helpers_move_every_head_and_tail_canary():
    cfg = CanaryConfig(groups=("FULL", "SWA"), swa_window_size=4)
    ep = CanaryEndpoints(cfg, num_slots=S, write_req_capacity=2, verify_capacity=8, swa_num_slots=19)
    state = ep.init_state()
    state = state.replace(canaries={k: _canary(i, v.shape[0], v.shape[1])
                                    for i, (k, v) in enumerate(sorted(state.canaries.items()))})
    src = {"FULL": jnp.asarray([5, 6, 40], jnp.int32), "SWA": jnp.asarray([3, 4, -1], jnp.int32)}
    dst = {"FULL": jnp.asarray([9, 10, 11], jnp.int32), "SWA": jnp.asarray([7, 8, 2], jnp.int32)}
    recs, oob = export_state_records(state, src)
    assert sorted(recs) == sorted(state.canaries) and len(recs) == 8 and int(oob[0]) == 4  # 40, x4
    new, oob = import_state_records(state, dst, recs)
    assert int(oob[0]) == 0
    for name, c in new.canaries.items():
        g = name.rsplit("_", 1)[1]
        want, _ = runtime_reference.import_records(state.canaries[name], dst[g], recs[name])
        assert np.array_equal(np.asarray(c), want), name
    only_full, _ = export_state_records(state, {"FULL": src["FULL"]})
    assert sorted(only_full) == ["HEAD_K_FULL", "HEAD_V_FULL", "TAIL_K_FULL", "TAIL_V_FULL"]
    with pytest.raises(ValueError, match="kv-canary: records has no entry for canary 'HEAD_K_SWA'"):
        import_state_records(state, dst, only_full)
