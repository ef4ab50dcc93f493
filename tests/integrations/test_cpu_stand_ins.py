"""The CPU stand-ins of sglang-jax's TPU-only kernels (``tests/support/cpu_stand_ins.py``) against
sglang-jax's own references: a stand-in that differs from the kernel would make the server tests
on top of it meaningless."""

import numpy as np
import pytest

from tests.support.sglang_server import installed_sglang_jax

pytestmark = pytest.mark.integration
if installed_sglang_jax() != "main":
    pytest.skip("these tests need sglang-jax's main branch (BUILD.md)", allow_module_level=True)

import jax.numpy as jnp  # noqa: E402

from tests.support.cpu_stand_ins import ragged_paged_attention_reference  # noqa: E402

PAGE, KV_HEADS, Q_HEADS, DIM, HD = 4, 2, 4, 16, 128
#: (prefix already in the cache, new tokens): a decode, a prefill over a cached prefix, a prefill
SEQS = ((9, 1), (5, 6), (0, 7))


def fused(k, v):
    """``[tokens, heads2, 1, HD]``: K and V interleaved per head, head_dim padded (float32)."""
    rows = np.concatenate([k, v], axis=-1).reshape(k.shape[0], 2 * KV_HEADS, DIM)
    return np.pad(rows, ((0, 0), (0, 0), (0, HD - DIM)))[:, :, None, :]


@pytest.mark.parametrize("sliding_window,soft_cap", [(None, None), (4, 30.0)])
def test_the_fa_stand_in_writes_the_new_kv_and_attends_as_sglang_jax_reference(sliding_window,
                                                                                soft_cap):
    from sgl_jax.srt.kernels.ragged_paged_attention.ragged_paged_attention_v3 import (
        ref_ragged_paged_attention)

    rng = np.random.default_rng(0)
    num_pages = 16
    cache = rng.standard_normal((num_pages, PAGE, 2 * KV_HEADS, 1, HD)).astype(np.float32)
    pages = rng.permutation(np.arange(1, num_pages))            # page 0: padding, never used
    page_lists, at = [], 0
    for prefix, new in SEQS:
        n = -(-(prefix + new) // PAGE)
        page_lists.append(pages[at:at + n])
        at += n
    total = sum(new for _, new in SEQS)
    padded = total + 3                                          # padding tokens at the end
    q = rng.standard_normal((padded, Q_HEADS, DIM)).astype(np.float32)
    k = rng.standard_normal((padded, KV_HEADS, DIM)).astype(np.float32)
    v = rng.standard_normal((padded, KV_HEADS, DIM)).astype(np.float32)
    kv_lens = np.array([p + n for p, n in SEQS] + [0], np.int32)
    cu_q = np.concatenate([[0], np.cumsum([n for _, n in SEQS]), [total]]).astype(np.int32)
    cu_kv = np.concatenate([[0], np.cumsum([len(p) * PAGE for p in page_lists]),
                            [at * PAGE]]).astype(np.int32)
    flat_pages = np.concatenate(page_lists + [np.zeros(2, np.int64)]).astype(np.int32)
    distribution = np.array([0, len(SEQS), len(SEQS)], np.int32)

    out, written = ragged_paged_attention_reference(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(cache), jnp.asarray(kv_lens),
        jnp.asarray(flat_pages), jnp.asarray(cu_q), jnp.asarray(cu_kv), jnp.asarray(distribution),
        None, None, causal=1, sm_scale=0.25, sliding_window=sliding_window, soft_cap=soft_cap)

    expected = cache.copy().reshape(num_pages * PAGE, 2 * KV_HEADS, 1, HD)
    for (prefix, new), plist, q0 in zip(SEQS, page_lists, cu_q):
        slots = (plist[:, None] * PAGE + np.arange(PAGE)).reshape(-1)[prefix:prefix + new]
        expected[slots] = fused(k[q0:q0 + new], v[q0:q0 + new])
    expected = expected.reshape(cache.shape)
    np.testing.assert_array_equal(np.asarray(written), expected)  # padding wrote nothing

    kv = expected[:, :, :, 0, :DIM]
    width = max(len(p) for p in page_lists)
    table = np.array([np.pad(p, (0, width - len(p))) for p in page_lists], np.int32)
    ref = ref_ragged_paged_attention(
        jnp.asarray(q), jnp.asarray(kv[:, :, 0::2]), jnp.asarray(kv[:, :, 1::2]),
        jnp.asarray(kv_lens[:len(SEQS)]), jnp.asarray(table), jnp.asarray(cu_q[:len(SEQS) + 1]),
        jnp.asarray([len(SEQS)]), sm_scale=0.25, sliding_window=sliding_window,
        soft_cap=soft_cap)
    np.testing.assert_allclose(np.asarray(out)[:total], np.asarray(ref), rtol=2e-5, atol=2e-5)
    assert not np.asarray(out)[total:].any()                      # padding tokens: zeros
