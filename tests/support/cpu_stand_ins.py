"""Stand-ins for sglang-jax kernels that only run on a TPU, so that the features built on them serve
on the CPU in tests. Test support only: the product never installs them.

``fused_kv_scatter`` replaces ``sgl_jax.srt.mem_cache.memory_pool.update_fused_kv_cache_vectorized``,
the Pallas kernel (TPU only: "Only interpret mode is supported on CPU backend") through which
HiCache's load back and PD's KV receive write whole pages into a layer's fused KV buffer: a plain
JAX scatter with the kernel's contract (token ``i`` of ``fused_kv`` goes to slot ``loc[i]`` of the
paged buffer; ``loc == -1`` is padding and writes nothing).

``own_page_table_buffers`` makes ``ScheduleBatch._merge_cache_loc`` return a copy of each step's
page table instead of a view of sglang-jax's one persistent host buffer
(``ReqToTokenPool.cache_loc_host_buf``). On the CPU, JAX aliases such a numpy array instead of
copying it to a device, so under the overlap scheduler the next batch's table can be written into
the buffer before the previous step has read it (README, the ``cache-loc-alias`` twin; the replay
builds carry the same change as a patch). HiCache's sequential requests hit it: a finished
request's last overlapped step runs beside the next request's prefill.
"""

from __future__ import annotations

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


def install() -> None:
    """Put the stand-ins in place (in this process) unless JAX runs on a TPU."""
    if jax.default_backend() == "tpu":
        return
    from sgl_jax.srt.mem_cache import memory_pool

    memory_pool.update_fused_kv_cache_vectorized = fused_kv_scatter
    own_page_table_buffers()
