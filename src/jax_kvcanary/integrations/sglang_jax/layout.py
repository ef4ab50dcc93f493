"""sglang-jax's structures as the canary addresses them, for both runner layouts it supports.

A ``ModelRunner`` is handled by one of two adapters, chosen by what the runner has (never by a
version string):

- ``PoolsRunner``: sglang-jax's main branch. Its ``jitted_run_model(forward_batch,
  logits_metadata)`` donates the ``MemoryPools`` pytree and returns ``(output, pool_updates,
  flags, layers_topk_ids)``; ``ModelRunner._forward`` stores the KV back with
  ``memory_pools.replace_all(pool_updates)``. Layer ``l``'s fused KV buffer is
  ``[pages, page_size, 2 * kv_heads // packing, packing, head_dim]``.
- ``LegacyRunner``: sglang-jax 0.0.2. ``jitted_run_model`` donates ``token_to_kv_pool`` and returns
  ``(output, layers_kv_fused, flags)``; ``_set_kv_cache_after_forward`` stores the KV back. Layer
  ``l``'s fused KV buffer is ``[slots, 2 * kv_heads, head_dim]``.

In both, heads are interleaved ``K0, V0, K1, V1, ...``, slot ``s`` (a token index) is token row
``s`` of the buffer (page ``s // page_size``, row ``s % page_size`` of it), and slot 0 is the
allocator's padding slot.

The step's page table is ``forward_batch.cache_loc`` (a device array): batch row ``r``'s slots for
positions ``0 .. seq_len_r - 1`` at ``cache_loc[start_r + pos]``. The scheduler lays the segments
out page-aligned (``start_r`` = the sum of the earlier rows' ``seq_len`` rounded up to whole pages);
the native attention backend reads them at the unaligned starts (the plain sum of the earlier
``seq_len``), so the canary reads them as the configured attention backend does
(``segment_starts``).
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ...consts import RealKvHashMode
from ...inputs import RealKvSource
from ...runtime.endpoints import CanaryBatch
from . import pools

#: attention backends whose reads of ``cache_loc`` the canary models (``segment_starts``):
#: ``dsa_sparse`` reads it page-aligned like ``fa`` (it serves the latent pool only)
ATTENTION_BACKENDS = ("native", "fa", "dsa_sparse")


class FusedGeometry(NamedTuple):
    """Layer 0's fused KV buffer as token rows: ``rows`` (its first dimension), ``page_size``
    (token rows per buffer row), ``token_elems`` / ``head_elems`` (elements per token row / per
    head) and ``itemsize``."""

    rows: int
    page_size: int
    token_elems: int
    head_elems: int
    itemsize: int

    @property
    def num_slots(self) -> int:
        return self.rows * self.page_size

    @property
    def token_bytes(self) -> int:
        return self.token_elems * self.itemsize


def fused_geometry(kv0) -> FusedGeometry:
    """The geometry of a fused KV buffer: 3-D ``[slots, heads2, head_dim]`` (0.0.2) or 5-D
    ``[pages, page_size, heads2 // packing, packing, head_dim]`` (main).

    Raises:
      ValueError: another shape, or K/V heads that are not a multiple of 16 bytes.
    """
    shape = tuple(int(d) for d in kv0.shape)
    isz = np.dtype(kv0.dtype).itemsize
    if len(shape) == 3 and shape[1] % 2 == 0:
        geo = FusedGeometry(shape[0], 1, shape[1] * shape[2], shape[2], isz)
    elif len(shape) == 5 and (shape[2] * shape[3]) % 2 == 0:
        geo = FusedGeometry(shape[0], shape[1], shape[2] * shape[3] * shape[4], shape[4], isz)
    else:
        raise ValueError("kv-canary: expected layer 0's fused KV buffer [slots, 2 * kv_heads, "
                         "head_dim] or [pages, page_size, 2 * kv_heads // packing, packing, "
                         f"head_dim], got shape {shape}")
    if (geo.head_elems * isz) % 16:
        raise ValueError("kv-canary: a KV head must be a multiple of 16 bytes, got head_dim="
                         f"{geo.head_elems} x {isz} bytes")
    return geo


def real_kv_sources(kv0, mode: RealKvHashMode) -> dict:
    """``{'K': source, 'V': source}`` over layer 0's fused buffer ``kv0`` (3-D or 5-D, see
    ``fused_geometry``), both addressing the buffer itself (no copy).

    PARTIAL: K folds the first 16 bytes of each token row (K head 0), V the first 16 bytes of V
    head 0 (``offset_bytes``: one head into the row). ALL: both halves fold the whole token row
    (every K and V head of the slot), so no step copies a layer's worth of KV to split the
    interleaved heads."""
    geo = fused_geometry(kv0)
    tb = geo.token_bytes
    whole = RealKvSource(kv0, geo.page_size, tb, tb)
    if mode == RealKvHashMode.ALL:
        return {"K": whole, "V": whole}
    v0 = RealKvSource(kv0, geo.page_size, tb, 16, offset_bytes=geo.head_elems * geo.itemsize)
    return {"K": whole, "V": v0}


class LatentDims(NamedTuple):
    """Where the parts of an absorbed-MLA latent row lie, in elements (sglang-jax's
    ``MLATokenToKVPool``: ``[pages, align(page_size, packing) // packing, packing, nope + rope]``,
    the layout of its MLA v2 kernel): the compressed KV in ``[0, nope)`` (``kv_lora_rank`` of it
    used, the rest padding to 128) and the rope part in ``[nope, nope + rope)``."""

    nope: int
    rope: int


def latent_geometry(kv, page_size: int) -> FusedGeometry:
    """The geometry of an absorbed-MLA latent buffer ``[pages, align(page_size, packing) //
    packing, packing, kv_dim]`` as token rows: slot ``s`` is row ``s % page_size`` (in
    ``[page_rows, packing]`` order) of page ``s // page_size``; one latent "head" per row.

    Raises:
      ValueError: another shape, or a page that holds fewer than ``page_size`` rows.
    """
    shape = tuple(int(d) for d in kv.shape)
    if len(shape) != 4 or shape[1] * shape[2] < page_size:
        raise ValueError("kv-canary: expected the latent buffer [pages, align(page_size, packing) "
                         f"// packing, packing, kv_dim] with page_size={page_size}, got shape "
                         f"{shape}")
    isz = np.dtype(kv.dtype).itemsize
    if (shape[3] * isz) % 16:
        raise ValueError(f"kv-canary: a latent row must be a multiple of 16 bytes, got "
                         f"kv_dim={shape[3]} x {isz} bytes")
    return FusedGeometry(shape[0], page_size, shape[3], shape[3], isz)


def latent_kv_sources(kv, indexer, dims: LatentDims, page_size: int,
                      mode: RealKvHashMode) -> dict:
    """``{'K': source, 'V': sources}`` over an absorbed-MLA layer's latent buffer ``kv`` and,
    with DSA, an indexer-key buffer ``indexer`` of the same pages (None without), all read in
    place. K folds the compressed KV (its first 16 bytes in PARTIAL, its ``nope`` elements in
    ALL), V the rope part (likewise, from element ``nope``) and the slot's indexer keys (the
    first 16 bytes, or the whole row): what the MLA and DSA kernels read for a cached token."""
    geo = latent_geometry(kv, page_size)
    isz, tb = geo.itemsize, geo.token_bytes
    part = mode != RealKvHashMode.ALL
    k = RealKvSource(kv, page_size, tb, 16 if part else dims.nope * isz)
    v = [RealKvSource(kv, page_size, tb, 16 if part else dims.rope * isz,
                      offset_bytes=dims.nope * isz)]
    if indexer is not None:
        ib = latent_geometry(indexer, page_size).token_bytes
        v.append(RealKvSource(indexer, page_size, ib, 16 if part else ib))
    return {"K": k, "V": tuple(v)}


def segment_starts(seq_lens, page_size: int, aligned: bool):
    """``int32[B]``: where each batch row's segment of ``cache_loc`` starts (inside the jit).

    ``aligned``: each segment takes whole pages (the scheduler's layout, what page-granular
    attention kernels read); otherwise segments follow each other (what sglang-jax's native
    attention backend reads: the two agree for ``page_size == 1``)."""
    span = seq_lens.astype(jnp.int32)
    if aligned and page_size > 1:
        span = (span + page_size - 1) // page_size * page_size
    return jnp.cumsum(span) - span


#: step arrays that are not per-rank sections of a data-parallel batch (the same on every rank)
REPLICATED_ARRAYS = ("token_pool", "swa_lut")


def replicated(mesh):
    """Inside the jit: an int32 copy of a batch array, replicated over ``mesh`` (sglang-jax shards
    its batch arrays over the ``data`` axis; the canary's plan reads every row). ``mesh=None``:
    inside ``shard_map``, where the arrays come in replicated already."""
    reshard = getattr(jax.sharding, "reshard", None)
    if mesh is None or reshard is None:
        return lambda x: x.astype(jnp.int32)
    spec = NamedSharding(mesh, PartitionSpec())
    return lambda x: reshard(x.astype(jnp.int32), spec)


#: the ``ForwardBatch`` fields ``step_arrays`` reads
STEP_FIELDS = ("req_pool_indices", "seq_lens", "extend_prefix_lens", "extend_seq_lens",
               "cache_loc", "input_ids", "positions", "out_cache_loc")
_step_fields = operator.attrgetter(*STEP_FIELDS)


def step_arrays(forward_batch, from_attention: bool = False) -> dict:
    """The arrays of an sglang-jax ``ForwardBatch`` the canary reads (on the device): the page
    table ``cache_loc``, the lengths, and the step's tokens (extend lengths are None in DECODE).

    A speculative-decoding step (``TARGET_VERIFY``), and with ``from_attention`` every step (an
    EAGLE draft model's, whose batch arrays are placeholders: ``speculative``), is read from the
    attention metadata its kernel reads (``attention_arrays``) instead of the batch's own lengths
    and page table."""
    fb = forward_batch
    arrays = dict(zip(STEP_FIELDS, _step_fields(fb)))
    if from_attention or fb.forward_mode.is_target_verify():
        arrays.update(attention_arrays(fb.attn_backend.forward_metadata))
    return arrays


def attention_arrays(metadata) -> dict:
    """A step's lengths and page table as sglang-jax's ``fa`` attention backend reads them
    (``FlashAttentionMetadata``): ``seq_lens`` the KV length of each batch row (its new tokens
    included), ``cu_q_lens`` the cumulative new tokens (a row's new tokens lie at KV positions
    ``[seq_len - q_len, seq_len)``), ``page_indices`` the pages, each row's from its page-aligned
    start ``cu_kv_lens[r]`` (``token_table``, ``row_starts``); ``cache_loc``, the extend lengths
    and ``out_cache_loc`` (the slots allocated that round, not where the kernel writes: see
    ``written_slots``) None."""
    return dict(seq_lens=metadata.seq_lens, cu_q_lens=metadata.cu_q_lens,
                cu_kv_lens=metadata.cu_kv_lens, page_indices=metadata.page_indices,
                cache_loc=None, extend_prefix_lens=None, extend_seq_lens=None,
                out_cache_loc=None)


def token_table(arrays: dict, page_size: int, get, xp=jnp):
    """The step's flat page table in token slots: ``cache_loc``, or the slots of the pages of
    ``page_indices`` (``attention_arrays``). ``get`` reads an array (replicated int32 inside the
    jit, int64 numpy on the host), ``xp`` is ``jnp`` or ``np``."""
    if arrays.get("page_indices") is None:
        return get(arrays["cache_loc"])
    pages = get(arrays["page_indices"])
    return (pages[:, None] * page_size + xp.arange(page_size, dtype=pages.dtype)).reshape(-1)


def row_starts(arrays: dict, seq, page_size: int, aligned: bool, get):
    """Where each batch row's segment of ``token_table`` starts: the attention metadata's own
    ``cu_kv_lens`` (``attention_arrays``), else ``segment_starts``."""
    if arrays.get("cu_kv_lens") is not None:
        return get(arrays["cu_kv_lens"])[:-1]
    return segment_starts(seq, page_size, aligned)


def table_entries(arrays: dict, page_size: int) -> int:
    """The length of ``token_table`` (static: from the arrays' shapes)."""
    if arrays.get("page_indices") is None:
        return int(arrays["cache_loc"].shape[0])
    return int(arrays["page_indices"].shape[0]) * page_size


def batch_lengths(arrays: dict, *, decode: bool, get, xp=jnp):
    """``(live, seq, prefix, extend)`` of a step's batch rows (``get`` and ``xp`` as in
    ``token_table``): row ``r`` is live when ``req_pool_indices[r] >= 0`` and ``seq_lens[r] > 0``;
    DECODE rows have a prefix of ``seq_len - 1`` and one new token, EXTEND rows their extend
    lengths, a speculative step's rows their new tokens from ``cu_q_lens``."""
    seq_lens = get(arrays["seq_lens"])
    live = (get(arrays["req_pool_indices"]) >= 0) & (seq_lens > 0)
    seq = xp.where(live, seq_lens, 0)
    if decode:
        extend = live.astype(seq.dtype)
        prefix = xp.where(live, seq - 1, 0)
    elif arrays.get("cu_q_lens") is not None:
        cu = get(arrays["cu_q_lens"])
        extend = xp.where(live, cu[1:] - cu[:-1], 0)
        prefix = xp.where(live, seq - extend, 0)
    elif arrays["extend_seq_lens"] is not None and arrays["extend_prefix_lens"] is not None:
        prefix = xp.where(live, get(arrays["extend_prefix_lens"]), 0)
        extend = xp.where(live, get(arrays["extend_seq_lens"]), 0)
    else:
        raise ValueError("kv-canary: an EXTEND step without extend lengths is not supported by the "
                         "sglang-jax integration")
    return live, seq, prefix, extend


def page_table_batch(arrays: dict, *, decode: bool, page_size: int, aligned: bool,
                     mesh, kv_positions: bool = False) -> CanaryBatch:
    """The ``CanaryBatch`` of a step (inside the jit), read from its own page table.

    Args:
      arrays: ``step_arrays(forward_batch)``.
      decode: the step is a DECODE step (else EXTEND, or a speculative step with ``cu_q_lens``).
      page_size, aligned: how attention reads the page table (``segment_starts``).
      mesh: the engine's mesh (its batch arrays are sharded over ``data``; the plan reads them
        replicated); None inside ``shard_map`` (the arrays are passed in replicated).
      kv_positions: record each new token at the KV position it is written to (``entry_rows``)
        rather than at its input position (an EAGLE draft model's: ``speculative``).

    Rows as ``batch_lengths`` reads them (padding rows have ``req_pool_indices`` -1 and
    ``seq_len`` 0). Padded tokens (id 0, position 0, ``out_cache_loc`` -1) are skipped by the
    write."""
    get = replicated(mesh)
    live, seq, prefix, extend = batch_lengths(arrays, decode=decode, get=get)
    table, starts = token_table(arrays, page_size, get), row_starts(arrays, seq, page_size, aligned,
                                                                      get)
    positions = (entry_rows(arrays, live, prefix, get)[1] if kv_positions
                 else get(arrays["positions"]))
    return CanaryBatch(live.astype(jnp.int32), prefix, extend, table, get(arrays["input_ids"]),
                       positions, written_slots(arrays, table, starts, live, prefix, get),
                       req_to_token_row_starts=starts)


def entry_rows(arrays: dict, live, prefix, get, xp=jnp):
    """For a step planned from ``cu_q_lens``: ``(row, kv_position, written)`` of each new token,
    its batch row, the KV position it is written to (``[seq_len - q_len, seq_len)`` of its row,
    where the ``fa`` kernel writes it) and whether it is a live row's token (padding rows have
    tokens too in a draft model's DECODE steps)."""
    cu = get(arrays["cu_q_lens"])
    i = xp.arange(arrays["input_ids"].shape[0], dtype=cu.dtype)
    row = xp.clip(xp.searchsorted(cu[1:], i, side="right"), 0, prefix.shape[0] - 1)
    return row, prefix[row] + i - cu[row], (i < cu[-1]) & live[row]


def written_slots(arrays: dict, table, starts, live, prefix, get, xp=jnp):
    """The slot each of the step's new tokens (``input_ids``) is written to: ``out_cache_loc``, or
    in a step planned from ``cu_q_lens`` the slot the page table holds at the token's KV position
    (``entry_rows``), where the ``fa`` kernel writes it; -1 for a token of no live row."""
    if arrays.get("cu_q_lens") is None:
        return get(arrays["out_cache_loc"])
    row, at, written = entry_rows(arrays, live, prefix, get, xp)
    return xp.where(written, table[xp.clip(starts[row] + at, 0, table.shape[0] - 1)], -1)


# -- the two runner layouts ---------------------------------------------------------------------------
def _need(ok: bool, what: str) -> None:
    if not ok:
        raise TypeError(f"kv-canary: this sglang-jax model runner has no {what}; the sglang-jax "
                        "integration supports the ModelRunner of sglang-jax 0.0.2 and of its main "
                        "branch (MemoryPools)")


class _Runner:
    """What the canary needs from one ``ModelRunner`` (subclasses: the two layouts).

    Attributes: ``groups`` (``("FULL",)``, or ``("FULL", "SWA")`` for a hybrid sliding-window
    pool), ``layer`` (per group, the layer whose KV is fingerprinted, the first of the group's
    layers, as its index in a step's list of KV buffers: its global id, but 0 with the hybrid
    linear pool, whose list holds the full-attention layers only), ``geometries`` (per group,
    that layer's ``FusedGeometry``; ``geometry`` is the FULL one), ``swa_window`` (the sliding
    window, 0 without SWA), ``page_size``, ``latent`` (the ``LatentDims`` of an absorbed-MLA
    latent pool, else None), ``recurrent`` (the hybrid linear pool: the model's linear-attention
    layers keep a recurrent state per request, which the canary does not check), ``dp``
    (data-parallel attention ranks: the buffer's slots are ``dp`` equal rank sections, each
    with its own padding page, addressed by rank-local slot ids)."""

    def __init__(self, runner):
        _need(callable(getattr(runner, "jitted_run_model", None)), "jitted_run_model")
        _need(getattr(runner, "mesh", None) is not None, "mesh")
        pool = getattr(runner, "token_to_kv_pool", None)
        refused = pool is not None and pools.install_refusal(type(pool).__name__)
        if refused:
            raise ValueError(refused)
        self.dp = int(getattr(runner, "dp_size", 1) or 1)
        if self.dp > 1 and (pools.is_swa(pool) or pools.is_latent(pool) or
                            pools.is_recurrent(pool)):
            raise ValueError(f"kv-canary: data-parallel attention (dp_size={self.dp}) is guarded "
                             f"with the MHA KV pool, this runner has {type(pool).__name__}")
        if self.dp > 1 and int(dict(runner.mesh.shape).get("data", 1)) != self.dp:
            raise ValueError(f"kv-canary: dp_size={self.dp} needs the mesh's data axis of "
                             f"{self.dp} devices, got mesh {dict(runner.mesh.shape)}")
        self.runner = runner
        self.groups, self.layer, self.swa_window, self.latent = ("FULL",), {"FULL": 0}, 0, None
        self.recurrent = pools.is_recurrent(pool)
        if self.recurrent and type(pool.full_kv_pool).__name__ != "MHATokenToKVPool":
            raise ValueError("kv-canary: the hybrid linear pool is guarded around an "
                             "MHATokenToKVPool, this one holds a "
                             f"{type(pool.full_kv_pool).__name__}")
        if pools.is_swa(pool):
            self.groups, self.swa_window = ("FULL", "SWA"), int(runner.sliding_window_size)
            self.layer = {"FULL": min(l for l, (_, swa) in pool.layers_mapping.items() if not swa),
                          "SWA": min(l for l, (_, swa) in pool.layers_mapping.items() if swa)}
        else:
            _need(isinstance(getattr(self._pool(), "kv_buffer", None), list),
                  "token_to_kv_pool.kv_buffer list")
            if pools.is_latent(pool):
                self.latent = LatentDims(int(pool.nope_dim), int(pool.rope_dim))
        self.page_size = int(getattr(runner, "page_size", 1) or 1)
        self.geometries = {g: (latent_geometry(self.kv(g), self.page_size) if self.latent
                               else fused_geometry(self.kv(g))) for g in self.groups}
        backend = getattr(getattr(runner, "server_args", None), "attention_backend", "native")
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"kv-canary: attention backend {backend!r} is not supported by the "
                             f"sglang-jax integration (supported: {', '.join(ATTENTION_BACKENDS)})")
        self.attention_backend = backend

    @property
    def aligned_segments(self) -> bool:
        """Whether attention reads ``cache_loc`` at page-aligned segment starts."""
        return self.attention_backend != "native"

    @property
    def geometry(self) -> FusedGeometry:
        """The FULL group's ``FusedGeometry``."""
        return self.geometries["FULL"]

    def _pool(self):
        """The pool whose ``kv_buffer`` list holds the KV (the hybrid linear pool's inner one)."""
        pool = self.runner.token_to_kv_pool
        return pool.full_kv_pool if self.recurrent else pool

    def _buffers(self, group: str):
        """The list holding ``group``'s fingerprinted layer, and its index there."""
        pool = self._pool()
        if len(self.groups) == 1:
            return pool.kv_buffer, 0
        index, _ = pool.layers_mapping[self.layer[group]]
        return (pool.swa_kv_pool if group == "SWA" else pool.full_kv_pool).kv_buffer, index

    def kv(self, group: str = "FULL"):
        """The current fused KV buffer of ``group``'s fingerprinted layer (layer 0 without SWA)."""
        buffers, i = self._buffers(group)
        return buffers[i]

    def set_kv(self, array, group: str = "FULL") -> None:
        """Replace that buffer (fault injection)."""
        buffers, i = self._buffers(group)
        buffers[i] = array

    def fingerprinted(self, group: str = "FULL"):
        """What ``sources`` reads of ``group`` now: ``kv(group)``, or with the latent pool the
        pair (latent buffer, the first DSA indexer-key buffer or None)."""
        if self.latent is None:
            return self.kv(group)
        indexer = getattr(self.runner.token_to_kv_pool, "indexer_key_buffer", None)
        return self.kv(group), (indexer[0] if indexer else None)

    def step_kvs(self, outputs) -> dict:
        """``{group: fingerprinted KV}`` (see ``fingerprinted``) as the step's forward left it."""
        layers = self.layers(outputs)
        if self.latent is None:
            return {g: layers[self.layer[g]] for g in self.groups}
        _, indexer = self.fingerprinted()
        if isinstance(layers, tuple):                # DSA: (latent buffers, indexer buffers)
            layers, written = layers
            indexer = written[0] if written else indexer
        return {"FULL": (layers[self.layer["FULL"]], indexer)}

    def sources(self, kvs: dict, mode: RealKvHashMode) -> dict:
        """``{group: {'K': ..., 'V': ...}}``: the real-KV sources over ``kvs`` (``step_kvs``)."""
        if self.latent is None:
            return {g: real_kv_sources(kv, mode) for g, kv in kvs.items()}
        return {g: latent_kv_sources(*kv, self.latent, self.page_size, mode)
                for g, kv in kvs.items()}

    def swa_map(self):
        """The engine's full-to-SWA slot map (host ``int`` array; 0 = not in the SWA pool)."""
        return self.runner.token_to_kv_pool.full_to_swa_index_mapping

    @staticmethod
    def layers(outputs) -> list:
        """The per-layer fused KV buffers after the forward, from what ``jitted_run_model``
        returned."""
        raise NotImplementedError

    def store_kv(self, outputs, forward_batch) -> None:
        """Hand the engine the KV buffers of a step's ``outputs``, as its own forward does after
        ``jitted_run_model`` returns (used when the canary raises after a step that donated them)."""
        raise NotImplementedError

    def donated_pool(self):
        """What the engine's ``jitted_run_model`` takes and donates as its pool argument."""
        raise NotImplementedError


class PoolsRunner(_Runner):
    """sglang-jax main: ``MemoryPools`` donated, four results, ``replace_all``."""

    def __init__(self, runner):
        super().__init__(runner)
        pools = runner.memory_pools
        _need(callable(getattr(pools, "replace_all", None)), "memory_pools.replace_all")
        names = tuple(sorted(getattr(pools, "_pools", {}) or {}))
        expected = (("recurrent_state_pool", "token_to_kv_pool") if self.recurrent
                    else ("token_to_kv_pool",))
        if names != expected:
            raise ValueError(f"kv-canary: the sglang-jax integration supports a MemoryPools of "
                             f"{' and '.join(expected)} with the KV pool "
                             f"{type(runner.token_to_kv_pool).__name__}, this runner has {names}")

    @staticmethod
    def layers(outputs):
        updates = outputs[1]
        return updates["token_to_kv_pool"] if isinstance(updates, dict) else updates

    def store_kv(self, outputs, forward_batch) -> None:
        updates = outputs[1]
        if self.runner.tp_size == 1 and isinstance(updates, list):
            sharding = self.runner.token_to_kv_pool.kv_sharding
            updates = [jax.device_put(kv, sharding) for kv in updates]
        self.runner.memory_pools.replace_all(updates)

    def donated_pool(self):
        return self.runner.memory_pools


class LegacyRunner(_Runner):
    """sglang-jax 0.0.2: ``token_to_kv_pool`` donated, three results,
    ``_set_kv_cache_after_forward``."""

    def __init__(self, runner):
        super().__init__(runner)
        _need(callable(getattr(runner, "_set_kv_cache_after_forward", None)),
              "_set_kv_cache_after_forward")
        if int(getattr(runner, "tp_size", 1)) != 1:
            raise ValueError("kv-canary: tensor parallelism is supported on sglang-jax main only; "
                             f"this 0.0.2 runner has tp_size={runner.tp_size}")

    @staticmethod
    def layers(outputs):
        return outputs[1]

    def store_kv(self, outputs, forward_batch) -> None:
        self.runner._set_kv_cache_after_forward(outputs[1], forward_batch)

    def donated_pool(self):
        return self.runner.token_to_kv_pool


def runner_layout(runner) -> _Runner:
    """The adapter of ``runner``: ``PoolsRunner`` when it has ``memory_pools``, else
    ``LegacyRunner``. Raises ``TypeError`` / ``ValueError`` (``kv-canary:``) for a runner or a
    setting the integration does not support."""
    return PoolsRunner(runner) if hasattr(runner, "memory_pools") else LegacyRunner(runner)
