"""Fault-injection functions: what they change, and the detection they promise."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_kvcanary.consts import FailReason, LaunchTag as T
from jax_kvcanary.runtime import perturb


def _bytes(a):
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8).reshape(-1)


@pytest.mark.parametrize("dtype", [np.float32, np.uint8, ml_dtypes.bfloat16, np.int16])
@pytest.mark.parametrize("as_jax", [False, True])
def test_flip_kv_byte_addresses_the_strip(dtype, as_jax):
    # 4 pages of 2 slots, 32 bytes per token; slot 5 = page 2, column 32
    n = 4 * 64 // np.dtype(dtype).itemsize
    base = (np.arange(n) % 7).astype(dtype).reshape(4, -1)
    arr = jnp.asarray(base) if as_jax else base
    out = perturb.flip_kv_byte(arr, 5, page_size=2, num_bytes_per_token=32, byte=3)
    diff = np.nonzero(_bytes(out) != _bytes(base))[0]
    assert diff.tolist() == [2 * 64 + 32 + 3]
    assert (_bytes(out)[diff] ^ _bytes(base)[diff]).tolist() == [0xFF]
    assert np.array_equal(_bytes(arr), _bytes(base))           # input left as it was
    assert type(out) is type(arr) and out.dtype == arr.dtype and out.shape == arr.shape


def test_flip_kv_byte_device_axis_and_bounds():
    arr = np.zeros((3, 2, 16), np.uint8)                       # [device, rows, bytes]
    out = perturb.flip_kv_byte(arr, 1, page_size=1, num_bytes_per_token=16, device=2)
    assert np.nonzero(out)[0].tolist() == [2] and out[2, 1, 0] == 0xFF
    with pytest.raises(ValueError, match="outside the KV array"):
        perturb.flip_kv_byte(arr[0], 2, page_size=1, num_bytes_per_token=16)


def test_swap_req_to_token():
    table = np.arange(12, dtype=np.int32).reshape(2, 6)
    new, f = perturb.swap_req_to_token(table, 1, 2, 99, groups=("FULL",), halves=("K",))
    assert new[1, 2] == 99 and table[1, 2] == 8 and (new != table).sum() == 1
    assert f.kind == "req_to_token_swap" and f.slot == 99 and f.position == 2
    assert f.changed == "req_to_token[1, 2]: 8 -> 99"
    assert f.expected_tags == (T.HEAD_K_FULL, T.TAIL_K_FULL)
    assert f.expected_reasons == (FailReason.VERIFY_CHAIN_HASH_MISMATCH,)
    jt, _ = perturb.swap_req_to_token(jnp.asarray(table), 1, 2, 99)
    assert int(jt[1, 2]) == 99
    with pytest.raises(ValueError, match="slot 0"):
        perturb.swap_req_to_token(table, 1, 2, 0)
    with pytest.raises(ValueError, match="different slot"):
        perturb.swap_req_to_token(table, 1, 2, 8)


@pytest.mark.parametrize("fn, tag, kind", [
    (perturb.flip_real_kv_used, T.TAIL_K_SWA, "real_kv_used"),
    (perturb.flip_real_kv_unused_cache, T.SWEEP_K_SWA, "real_kv_unused_cache"),
    (perturb.flip_real_kv_post_forward, T.TAIL_K_SWA, "real_kv_post_forward"),
])
def test_kv_faults(fn, tag, kind):
    arr = np.zeros((4, 32), np.uint8)
    out, f = fn(arr, 3, 7, page_size=2, num_bytes_per_token=16, group="SWA")
    assert out[1, 16] == 0xFF and out.sum() == 0xFF
    assert (f.kind, f.group, f.slot, f.position, f.expected_tags) == (kind, "SWA", 3, 7, (tag,))
    assert FailReason.VERIFY_REAL_KV_HASH_MISMATCH in f.expected_reasons
    assert kind in perturb.KINDS


def test_swap_next_tokens_and_matching():
    toks = np.array([5, 6, 7], np.int32)
    out, f = perturb.swap_next_tokens(toks, 0, 2)
    assert out.tolist() == [7, 6, 5] and toks.tolist() == [5, 6, 7]
    assert f.expected_labels == ("write_token",)

    class V:
        tag, reasons, device = int(T.TAIL_V_FULL), ("write_token",), None
    assert f.matches(V())
    V.reasons = ("verify_chain_hash",)
    assert not f.matches(V())
    with pytest.raises(ValueError, match="two different tokens"):
        perturb.swap_next_tokens(np.array([1, 1]), 0, 1)


def test_evict_swa_in_window():
    lut = np.arange(10, dtype=np.int32) + 20
    new, f = perturb.evict_swa_in_window(lut, 4, 7, halves=("K",))
    assert new[4] == 0 and lut[4] == 24 and (new != lut).sum() == 1
    assert (f.kind, f.group, f.slot, f.position) == ("swa_evicted_in_window", "SWA", -1, 7)
    assert f.changed == "full_to_swa_index_mapping[4]: 24 -> 0"
    assert f.expected_tags == (T.HEAD_K_SWA, T.TAIL_K_SWA)
    assert f.expected_reasons == (FailReason.INDEX_OUT_OF_RANGE,)
    assert int(perturb.evict_swa_in_window(jnp.asarray(lut), 4, 7)[0][4]) == 0
    with pytest.raises(ValueError, match="already maps to 0"):
        perturb.evict_swa_in_window(new, 4, 7)
