"""Stand-ins for sglang-jax kernels that only run on a TPU, so that the features built on them serve
on the CPU in tests. Test support only: the product never installs them.

``fused_kv_scatter`` replaces ``sgl_jax.srt.mem_cache.memory_pool.update_fused_kv_cache_vectorized``,
the Pallas kernel (TPU only: "Only interpret mode is supported on CPU backend") through which
HiCache's load back and PD's KV receive write whole pages into a layer's fused KV buffer: a plain
JAX scatter with the kernel's contract (token ``i`` of ``fused_kv`` goes to slot ``loc[i]`` of the
paged buffer; ``loc == -1`` is padding and writes nothing).

``ragged_paged_attention_reference`` replaces the ``fa`` attention backend's Pallas kernel
(``ragged_paged_attention_v3``, which neither runs on the CPU nor in Pallas' interpret mode there),
and ``keep_fa_on_cpu`` stops the model runner from switching ``--attention-backend fa`` back to
``native`` on the CPU, so that the backend TPU users run (its page-aligned page tables, its metadata
and the fused KV buffer layout) serves here: plain JAX with the kernel's contract, causal attention
only (no custom or tree mask, attention sink or temperature).

``own_page_table_buffers`` makes ``ScheduleBatch._merge_cache_loc`` return a copy of each step's
page table instead of a view of sglang-jax's one persistent host buffer
(``ReqToTokenPool.cache_loc_host_buf``). On the CPU, JAX aliases such a numpy array instead of
copying it to a device, so under the overlap scheduler the next batch's table can be written into
the buffer before the previous step has read it (README, the ``cache-loc-alias`` twin; the replay
builds carry the same change as a patch). HiCache's sequential requests hit it: a finished
request's last overlapped step runs beside the next request's prefill.

``serve_swa_pool_on_cpu`` lets the hybrid sliding-window pool (``SWAKVPool``: what Gemma2, Gemma4
and MiMo-V2 models get unless ``--disable-hybrid-swa-memory`` is given) serve on the CPU, standing
in for the TPU path, where the ``fa`` backend writes each layer's KV through the pool's
``set_kv_buffer`` and reads the sliding layers' pages through ``swa_page_indices``. On the CPU the
model runner picks the ``native`` backend, which writes through ``set_kv_buffer_legacy`` (only the
single pools have it: the stock server dies at its precompile) and reads every layer at the
batch's ``cache_loc``, full-pool slots, also for the sliding layers whose KV is in the SWA pool.
The stand-in adds ``SWAKVPool.set_kv_buffer_legacy`` (a layer's write goes to its sub-pool, a
sliding layer's slots translated through the full-to-SWA map) and gives the native backend's
sliding layers a ``cache_loc`` translated the same way. sglang-jax's own translation
(``SWAKVPool._remap_swa_loc``) fails to trace on the CPU ("Resource axis: data of P('data',) is not
found in mesh: ()": the map, a host numpy array, has no mesh; the slots are sharded over ``data``);
the stand-in's indexes a replicated map with replicated slots. And it hands each step a copy of
the map, as the TPU path's transfer does: the map is a numpy leaf of the pool, which JAX on the CPU
aliases, so under the overlap scheduler the next batch's allocations and frees rewrote the map
while the step in flight read it (the ``cache-loc-alias`` problem again, seen as an occasional
wrong answer with the canary silent: the canary checks the map as it was at the call).

``serve_hybrid_linear_pool_on_cpu`` lets the hybrid linear pool (``HybridLinearKVPool``: the
full-attention layers' KV of Qwen3.5 and Kimi-Linear, whose linear-attention layers keep a
recurrent state per request instead) serve on the native backend, which writes through
``set_kv_buffer_legacy``: the pool lacks it (the stock server dies at its precompile with
``'HybridLinearKVPool' object has no attribute 'set_kv_buffer_legacy'``); the stand-in forwards it
to the inner MHA pool with the layer id translated.

``verify_spec_on_cpu`` runs speculative decoding's greedy verify kernel (Pallas, TPU only) in
Pallas' TPU interpret mode, so that EAGLE3 serves on the CPU with ``fa``.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


def fused_kv_scatter(fused_kv, loc, kv_cache, page_size, kv_partition_axis="tensor",
                     data_partition_axis="data", mesh=None):
    """``kv_cache`` (``[pages, page_size, heads2 // packing, packing, head_dim]``) with token rows
    ``fused_kv[:, 0]`` written at slots ``loc`` (``-1``: skipped)."""
    del page_size
    pages, ps = kv_cache.shape[:2]
    tokens = PartitionSpec(data_partition_axis, kv_partition_axis, None, None)
    paged = PartitionSpec(data_partition_axis, None, kv_partition_axis, None, None)
    if mesh is not None:
        tokens, paged = NamedSharding(mesh, tokens), NamedSharding(mesh, paged)
    rows = jax.lax.reshape(kv_cache, (pages * ps,) + tuple(kv_cache.shape[2:]),
                           out_sharding=tokens)
    loc = loc.astype(jnp.int32)
    target = jnp.where(loc < 0, pages * ps, loc)          # out of range: dropped
    rows = rows.at[target].set(fused_kv[:, 0].astype(rows.dtype), mode="drop",
                               out_sharding=tokens)
    return jax.lax.reshape(rows, kv_cache.shape, out_sharding=paged)


def ragged_paged_attention_reference(queries, keys, values, kv_cache_fused, kv_lens, page_indices,
                                     cu_q_lens, cu_kv_lens, distribution, custom_mask=None,
                                     attention_sink=None, *, causal=1, sm_scale=1.0,
                                     sliding_window=None, soft_cap=None, xai_temperature_len=None,
                                     softmax_dtype=None, **_block_sizes):
    """``(attention output [T, q_heads, head_dim], kv_cache_fused)``: the new tokens' K/V written
    into the paged, head-interleaved fused buffer (``[pages, page_size, heads2 // packing,
    packing, head_dim_128]``), then causal attention of each token over its sequence's KV.

    Sequence ``i`` (``i < distribution[2]``) has the queries ``cu_q_lens[i]:cu_q_lens[i + 1]``, the
    KV length ``kv_lens[i]`` (its new tokens are the last positions) and its pages at
    ``page_indices[cu_kv_lens[i] // page_size:]`` (``cu_kv_lens`` counts page-aligned lengths).
    """
    if not causal or custom_mask is not None or attention_sink is not None \
            or xai_temperature_len is not None:
        raise NotImplementedError("kv-canary test stand-in: causal attention only (no custom "
                                  "mask, attention sink or temperature)")
    num_tokens, q_heads, dim = queries.shape
    kv_heads = keys.shape[1]
    pages, ps, packed, packing, hd = kv_cache_fused.shape
    num_seqs, batch = distribution[2], kv_lens.shape[0]
    cu_q, cu_kv = cu_q_lens.astype(jnp.int32), cu_kv_lens.astype(jnp.int32)

    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(cu_q[1:batch + 1], t, side="right"), batch - 1)
    valid = t < cu_q[num_seqs]
    pos = kv_lens[seq] - (cu_q[seq + 1] - cu_q[seq]) + (t - cu_q[seq])     # position in its seq
    last_page = page_indices.shape[0] - 1

    def slots(flat):                       # flat index into the page-aligned token list -> slot
        return page_indices[jnp.clip(flat // ps, 0, last_page)] * ps + flat % ps

    # write: [K0, V0, K1, V1, ...] per token, heads and head_dim padded as the buffer is
    rows = jnp.concatenate([keys, values], axis=-1).reshape(num_tokens, 2 * kv_heads, dim)
    rows = jnp.pad(rows, ((0, 0), (0, packed * packing - 2 * kv_heads), (0, hd - dim)))
    cache = kv_cache_fused.reshape(pages * ps, packed, packing, hd)
    target = jnp.where(valid, slots(cu_kv[seq] + pos), pages * ps)          # padding: dropped
    cache = cache.at[target].set(rows.reshape(num_tokens, packed, packing, hd)
                                 .astype(cache.dtype), mode="drop")

    # attend: every token of the flat list, masked to the token's own sequence, causal
    flat = jnp.arange((last_page + 1) * ps, dtype=jnp.int32)
    kv = cache[slots(flat)].reshape(flat.shape[0], packed * packing, hd)[:, :2 * kv_heads, :dim]
    k, v = kv[:, 0::2], kv[:, 1::2]
    q = queries.reshape(num_tokens, kv_heads, q_heads // kv_heads, dim)
    scores = jnp.einsum("tkgd,jkd->tkgj", q, k, preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    kv_pos = flat[None, :] - cu_kv[seq][:, None]
    allowed = (kv_pos >= 0) & (kv_pos <= pos[:, None]) & valid[:, None]
    if sliding_window is not None:
        allowed &= pos[:, None] - sliding_window < kv_pos
    scores = jnp.where(allowed[:, None, None, :], scores, -jnp.inf)
    if softmax_dtype is not None:
        scores = scores.astype(softmax_dtype)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(valid[:, None, None, None], probs, 0).astype(jnp.float32)
    out = jnp.einsum("tkgj,jkd->tkgd", probs, v.astype(jnp.float32))
    return (out.reshape(num_tokens, q_heads, dim).astype(queries.dtype),
            cache.reshape(kv_cache_fused.shape))


def keep_fa_on_cpu() -> None:
    """``--attention-backend fa`` stays ``fa`` on the CPU (sglang-jax's model runner switches it
    to ``native`` there, since its kernel cannot run): with ``ragged_paged_attention_reference``."""
    from sgl_jax.srt.layers.attention import flashattention_backend
    from sgl_jax.srt.model_executor.model_runner import ModelRunner

    flashattention_backend.ragged_paged_attention_v3 = ragged_paged_attention_reference
    pick = ModelRunner._get_attention_backend
    if getattr(pick, "keeps_fa", False):
        return

    def get_attention_backend(self):
        args = self.server_args
        if args.device != "cpu" or args.attention_backend != "fa":
            return pick(self)
        args.device = "cpu (fa kept by the test stand-in)"
        try:
            return pick(self)
        finally:
            args.device = "cpu"

    get_attention_backend.keeps_fa = True
    ModelRunner._get_attention_backend = get_attention_backend


def own_page_table_buffers() -> None:
    """Every step's ``cache_loc`` host array a copy of its own (see the module docstring)."""
    from sgl_jax.srt.managers.schedule_batch import ScheduleBatch

    merge = ScheduleBatch._merge_cache_loc
    if getattr(merge, "copies", False):
        return

    def merge_cache_loc_copy(self, *args, **kwargs):
        return np.array(merge(self, *args, **kwargs), copy=True)

    merge_cache_loc_copy.copies = True
    ScheduleBatch._merge_cache_loc = merge_cache_loc_copy


def swa_slots(pool, loc):
    """``loc`` (full-pool slots; ``-1``: padding, kept) translated into ``pool``'s (an
    ``SWAKVPool``) SWA sub-pool through its full-to-SWA map (inside the jitted step: the map is a
    leaf of the pool). A slot whose SWA KV was freed (outside the window) maps to 0, the padding
    slot that attention reads as empty."""
    mapping = pool.full_to_swa_index_mapping
    if mapping is None:
        return loc
    if isinstance(mapping, (list, tuple)):
        raise NotImplementedError("kv-canary test stand-in: the SWA pool with one data-parallel "
                                  "rank only")
    replicated = NamedSharding(pool.full_kv_pool.mesh, PartitionSpec())
    loc = jax.sharding.reshard(loc.astype(jnp.int32), replicated)
    table = jax.sharding.reshard(jnp.asarray(mapping, jnp.int32), replicated)
    return jnp.where(loc < 0, -1, table[jnp.clip(loc, 0, table.shape[0] - 1)])


def serve_swa_pool_on_cpu() -> None:
    """The hybrid sliding-window pool serves on the native backend (see the module docstring):
    ``SWAKVPool.set_kv_buffer_legacy``, and the sliding layers' ``cache_loc`` in SWA slots."""
    from sgl_jax.srt.layers.attention.native_backend import NativeAttention
    from sgl_jax.srt.mem_cache.memory_pool import SWAKVPool

    if not hasattr(SWAKVPool, "set_kv_buffer_legacy"):
        def set_kv_buffer_legacy(self, layer_id, loc, cache_k, cache_v):
            """The layer's updated fused buffer (5D) in its sub-pool: ``loc`` (full-pool slots)
            translated into SWA slots for a sliding layer."""
            index, is_swa = self.layers_mapping[layer_id]
            if is_swa:
                return self.swa_kv_pool.set_kv_buffer_legacy(index, swa_slots(self, loc),
                                                              cache_k, cache_v)
            return self.full_kv_pool.set_kv_buffer_legacy(index, loc, cache_k, cache_v)

        SWAKVPool.set_kv_buffer_legacy = set_kv_buffer_legacy

    flatten = SWAKVPool.tree_flatten
    if not getattr(flatten, "copies_map", False):
        def tree_flatten(self):
            """The pool's leaves, the full-to-SWA map(s) copied (the leaves after the two pools)."""
            children, aux = flatten(self)
            maps = tuple(None if m is None else np.array(m, copy=True) for m in children[2:])
            return children[:2] + maps, aux

        tree_flatten.copies_map = True
        SWAKVPool.tree_flatten = tree_flatten

    attend = NativeAttention.__call__
    if getattr(attend, "reads_swa_slots", False):
        return

    def call(self, q, k, v, layer, forward_batch, token_to_kv_pool, **kwargs):
        if isinstance(token_to_kv_pool, SWAKVPool) \
                and token_to_kv_pool.layers_mapping[layer.layer_id][1]:
            forward_batch = copy.copy(forward_batch)
            forward_batch.cache_loc = swa_slots(token_to_kv_pool, forward_batch.cache_loc)
        return attend(self, q, k, v, layer, forward_batch, token_to_kv_pool, **kwargs)

    call.reads_swa_slots = True
    NativeAttention.__call__ = call


def serve_hybrid_linear_pool_on_cpu() -> None:
    """The hybrid linear pool (``HybridLinearKVPool``: Qwen3.5, Kimi-Linear) serves on the native
    backend: ``set_kv_buffer_legacy``, which the native backend calls on the CPU and only the
    single pools have (the stock server dies at its precompile), forwarded to the inner pool with
    the layer's global id translated as the pool's other accessors do."""
    from sgl_jax.srt.mem_cache.memory_pool import HybridLinearKVPool

    if hasattr(HybridLinearKVPool, "set_kv_buffer_legacy"):
        return

    def set_kv_buffer_legacy(self, layer_id, loc, cache_k, cache_v):
        return self.full_kv_pool.set_kv_buffer_legacy(self._to_physical(layer_id), loc, cache_k,
                                                      cache_v)

    HybridLinearKVPool.set_kv_buffer_legacy = set_kv_buffer_legacy


def verify_spec_on_cpu() -> None:
    """Speculative decoding's greedy verify (``kernels/speculative/verify_tree_greedy_kernel``,
    a Pallas kernel: "Only interpret mode is supported on CPU backend") runs in Pallas' TPU
    interpret mode: the kernel module's ``pl.pallas_call`` gets ``interpret`` by default."""
    import types

    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from sgl_jax.srt.kernels.speculative import verify_tree_greedy_kernel as kernel

    if getattr(kernel.pl, "interprets", False):
        return
    interpret = pltpu.InterpretParams() if hasattr(pltpu, "InterpretParams") else True

    def pallas_call(*args, **kwargs):
        kwargs.setdefault("interpret", interpret)
        return pl.pallas_call(*args, **kwargs)

    shim = types.SimpleNamespace(**{n: getattr(pl, n) for n in dir(pl) if not n.startswith("__")})
    shim.pallas_call, shim.interprets = pallas_call, True
    kernel.pl = shim


def install() -> None:
    """Put the stand-ins in place (in this process) unless JAX runs on a TPU."""
    if jax.default_backend() == "tpu":
        return
    from sgl_jax.srt.mem_cache import memory_pool

    memory_pool.update_fused_kv_cache_vectorized = fused_kv_scatter
    keep_fa_on_cpu()
    own_page_table_buffers()
    serve_swa_pool_on_cpu()
    serve_hybrid_linear_pool_on_cpu()
    verify_spec_on_cpu()
