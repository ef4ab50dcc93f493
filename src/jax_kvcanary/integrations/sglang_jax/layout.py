"""sglang-jax's structures as the canary addresses them, for both runner layouts it supports.

A ``ModelRunner`` is driven through one of two adapters, chosen by what the runner has (never by a
version string):

- ``PoolsRunner``: sglang-jax's main branch. The model is called as
  ``model(forward_batch, memory_pools, logits_metadata)`` with the ``MemoryPools`` pytree donated
  and returns ``(output, pool_updates, flags, layers_topk_ids)``; ``ModelRunner._forward`` stores
  the KV back with ``memory_pools.replace_all(pool_updates)``. Layer ``l``'s fused KV buffer is
  ``[pages, page_size, 2 * kv_heads // packing, packing, head_dim]``.
- ``LegacyRunner``: sglang-jax 0.0.2. The model is called as
  ``model(forward_batch, token_to_kv_pool, logits_metadata)`` and returns
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

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ...consts import RealKvHashMode
from ...inputs import RealKvSource
from ...runtime.endpoints import CanaryBatch

#: attention backends whose reads of ``cache_loc`` the canary models (``segment_starts``)
ATTENTION_BACKENDS = ("native", "fa")


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
    ``fused_geometry``).

    PARTIAL: K folds the first 16 bytes of each token row (K head 0) from the buffer itself, V the
    first 16 bytes of V head 0 (a 16-byte-per-slot slice). ALL: both halves fold the whole token
    row (every K and V head of the slot) from the buffer itself, so no step copies a layer's worth
    of KV to split the interleaved heads. No source copies the buffer."""
    geo = fused_geometry(kv0)
    tb = geo.token_bytes
    whole = RealKvSource(kv0, geo.page_size, tb, tb)
    if mode == RealKvHashMode.ALL:
        return {"K": whole, "V": whole}
    rows = kv0.reshape(geo.rows, geo.page_size, geo.token_elems)
    v0 = rows[:, :, geo.head_elems: geo.head_elems + 16 // geo.itemsize]
    return {"K": whole, "V": RealKvSource(v0, geo.page_size, 16, 16)}


def segment_starts(seq_lens, page_size: int, aligned: bool):
    """``int32[B]``: where each batch row's segment of ``cache_loc`` starts (inside the jit).

    ``aligned``: each segment takes whole pages (the scheduler's layout, what page-granular
    attention kernels read); otherwise segments follow each other (what sglang-jax's native
    attention backend reads: the two agree for ``page_size == 1``)."""
    span = seq_lens.astype(jnp.int32)
    if aligned and page_size > 1:
        span = (span + page_size - 1) // page_size * page_size
    return jnp.cumsum(span) - span


def page_table_batch(forward_batch, *, page_size: int, aligned: bool) -> CanaryBatch:
    """The ``CanaryBatch`` of an sglang-jax ``ForwardBatch`` (inside the jit), read from the step's
    own page table ``cache_loc``.

    Batch row ``r`` is live when ``req_pool_indices[r] >= 0`` (padding rows have -1 and
    ``seq_len`` 0); EXTEND rows take ``extend_prefix_lens`` / ``extend_seq_lens``, DECODE rows a
    prefix of ``seq_len - 1`` and one token. Padded tokens (id 0, position 0, ``out_cache_loc``
    -1) are skipped by the write."""
    fb = forward_batch
    live = (fb.req_pool_indices >= 0) & (fb.seq_lens > 0)
    seq = jnp.where(live, fb.seq_lens, 0).astype(jnp.int32)
    if fb.forward_mode.is_decode():
        prefix = jnp.where(live, seq - 1, 0)
        extend = live.astype(jnp.int32)
    elif fb.extend_seq_lens is not None and fb.extend_prefix_lens is not None:
        prefix = jnp.where(live, fb.extend_prefix_lens, 0).astype(jnp.int32)
        extend = jnp.where(live, fb.extend_seq_lens, 0).astype(jnp.int32)
    else:
        raise ValueError(f"kv-canary: forward mode {fb.forward_mode!r} without extend lengths is "
                         "not supported by the sglang-jax integration")
    return CanaryBatch(live.astype(jnp.int32), prefix, extend, fb.cache_loc.astype(jnp.int32),
                       fb.input_ids.astype(jnp.int32), fb.positions.astype(jnp.int32),
                       fb.out_cache_loc.astype(jnp.int32),
                       req_to_token_row_starts=segment_starts(seq, page_size, aligned))


# -- the two runner layouts ---------------------------------------------------------------------------
def _need(ok: bool, what: str) -> None:
    if not ok:
        raise TypeError(f"kv-canary: this sglang-jax model runner has no {what}; the sglang-jax "
                        "integration supports the ModelRunner of sglang-jax 0.0.2 and of its main "
                        "branch (MemoryPools)")


class _Runner:
    """What the canary needs from one ``ModelRunner`` (subclasses: the two layouts)."""

    #: the name of the KV argument of the model call (donated by the step)
    kv_arg = ""

    def __init__(self, runner):
        _need(callable(getattr(runner, "jitted_run_model", None)), "jitted_run_model")
        _need(getattr(runner, "model", None) is not None, "model")
        _need(getattr(runner, "mesh", None) is not None, "mesh")
        pool = getattr(runner, "token_to_kv_pool", None)
        _need(isinstance(getattr(pool, "kv_buffer", None), list), "token_to_kv_pool.kv_buffer list")
        if getattr(runner, "use_mla_backend", False):
            raise ValueError("kv-canary: the sglang-jax integration does not support MLA KV pools")
        if getattr(runner, "is_hybrid", False):
            raise ValueError("kv-canary: the sglang-jax integration does not support hybrid "
                             "sliding-window KV pools (SWA layers)")
        if int(getattr(runner, "tp_size", 1)) != 1:
            raise ValueError("kv-canary: the sglang-jax integration supports tp_size=1 only (the "
                             f"fused KV buffer is sharded over heads with tp_size={runner.tp_size})")
        if int(getattr(runner, "dp_size", 1)) != 1:
            raise ValueError("kv-canary: the sglang-jax integration supports dp_size=1 only, got "
                             f"dp_size={runner.dp_size}")
        self.runner = runner
        self.geometry = fused_geometry(pool.kv_buffer[0])
        backend = getattr(getattr(runner, "server_args", None), "attention_backend", "native")
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"kv-canary: attention backend {backend!r} is not supported by the "
                             f"sglang-jax integration (supported: {', '.join(ATTENTION_BACKENDS)})")
        self.attention_backend = backend
        self.page_size = int(getattr(runner, "page_size", 1) or 1)

    @property
    def aligned_segments(self) -> bool:
        """Whether attention reads ``cache_loc`` at page-aligned segment starts."""
        return self.attention_backend != "native"

    def kv0(self):
        """Layer 0's current fused KV buffer."""
        return self.runner.token_to_kv_pool.kv_buffer[0]

    def set_kv0(self, array) -> None:
        """Replace layer 0's fused KV buffer (fault injection)."""
        self.runner.token_to_kv_pool.kv_buffer[0] = array

    def split_model(self):
        """``(model_def, model_state_def, leaves)`` of the runner's current weights."""
        from flax import nnx

        model_def, model_state = nnx.split(self.runner.model)
        leaves, state_def = jax.tree_util.tree_flatten(model_state)
        return model_def, state_def, leaves

    def kv_argument(self):
        """The runner's KV argument of the model call (donated by the step)."""
        raise NotImplementedError

    @staticmethod
    def call_model(model, forward_batch, kv, logits_metadata) -> tuple:
        """Inside the jit: ``(outputs, layers_kv_fused)``; ``outputs`` is what the runner's own
        ``jitted_run_model`` returns."""
        raise NotImplementedError

    def store_kv(self, outputs, forward_batch) -> None:
        """Hand the engine the KV buffers of a step's ``outputs``, as its own forward does after
        ``jitted_run_model`` returns (used when the canary raises after a step that donated them)."""
        raise NotImplementedError


class PoolsRunner(_Runner):
    """sglang-jax main: ``MemoryPools`` donated, four results, ``replace_all``."""

    def __init__(self, runner):
        super().__init__(runner)
        pools = runner.memory_pools
        _need(callable(getattr(pools, "replace_all", None)), "memory_pools.replace_all")
        names = tuple(getattr(pools, "_pools", {}) or {})
        if names != ("token_to_kv_pool",):
            raise ValueError("kv-canary: the sglang-jax integration supports a MemoryPools of one "
                             f"token_to_kv_pool, this runner has {names} (hybrid or recurrent "
                             "model?)")
        if getattr(runner, "linear_recurrent_config", None) is not None:
            raise ValueError("kv-canary: the sglang-jax integration does not support models with "
                             "recurrent (linear attention) state")

    def kv_argument(self):
        return self.runner.memory_pools

    @staticmethod
    def call_model(model, forward_batch, kv, logits_metadata):
        output, updates, flags, topk = model(forward_batch, kv, logits_metadata)
        layers = updates["token_to_kv_pool"] if isinstance(updates, dict) else updates
        return (output, updates, flags, topk), layers

    def store_kv(self, outputs, forward_batch) -> None:
        updates = outputs[1]
        if self.runner.tp_size == 1 and isinstance(updates, list):
            sharding = self.runner.token_to_kv_pool.kv_sharding
            updates = [jax.device_put(kv, sharding) for kv in updates]
        self.runner.memory_pools.replace_all(updates)


class LegacyRunner(_Runner):
    """sglang-jax 0.0.2: ``token_to_kv_pool`` donated, three results,
    ``_set_kv_cache_after_forward``."""

    def __init__(self, runner):
        super().__init__(runner)
        _need(callable(getattr(runner, "_set_kv_cache_after_forward", None)),
              "_set_kv_cache_after_forward")

    def kv_argument(self):
        return self.runner.token_to_kv_pool

    @staticmethod
    def call_model(model, forward_batch, kv, logits_metadata):
        output, layers, flags = model(forward_batch, kv, logits_metadata)
        return (output, layers, flags), layers

    def store_kv(self, outputs, forward_batch) -> None:
        self.runner._set_kv_cache_after_forward(outputs[1], forward_batch)


def runner_layout(runner) -> _Runner:
    """The adapter of ``runner``: ``PoolsRunner`` when it has ``memory_pools``, else
    ``LegacyRunner``. Raises ``TypeError`` / ``ValueError`` (``kv-canary:``) for a runner or a
    setting the integration does not support."""
    return PoolsRunner(runner) if hasattr(runner, "memory_pools") else LegacyRunner(runner)
