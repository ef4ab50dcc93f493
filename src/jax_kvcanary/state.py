"""Canary state: the canary buffer and the violation log, and their host-side decoding.

All 64-bit quantities live in uint8 arrays (little-endian), so nothing here needs ``jax_enable_x64``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import consts
from ._pytree import FieldsPytree


def new_canary_buffer(num_slots: int, slot_stride_bytes: int = consts.CANARY_SLOT_BYTES) -> jax.Array:
    """A fresh canary buffer: zeros, ``uint8[num_slots, slot_stride_bytes]``."""
    num_slots = int(num_slots)
    slot_stride_bytes = int(slot_stride_bytes)
    if num_slots < 1:
        raise ValueError(f"kv-canary: num_slots must be >= 1, got {num_slots}")
    if slot_stride_bytes < consts.CANARY_SLOT_BYTES:
        raise ValueError(
            "kv-canary: canary slot stride must hold at least 32 bytes per slot, "
            f"got {slot_stride_bytes}")
    if slot_stride_bytes % 8:
        raise ValueError(
            f"kv-canary: canary slot stride must be a multiple of 8 bytes, got {slot_stride_bytes}")
    return jnp.zeros((num_slots, slot_stride_bytes), jnp.uint8)


def canary_fields(canary) -> np.ndarray:
    """Host view of a canary buffer: ``int64[num_slots, 4]`` = (token, position, prev_hash, real_kv_hash)."""
    raw = np.asarray(canary)
    return np.ascontiguousarray(raw[:, : consts.CANARY_SLOT_BYTES]).view("<i8").astype(np.int64)


def _le_int64(arr) -> np.ndarray:
    """uint8[..., 8k] little-endian bytes -> int64[..., k] on the host."""
    return np.ascontiguousarray(np.asarray(arr)).view("<i8").astype(np.int64)


@jax.tree_util.register_pytree_node_class
class ViolationLog(FieldsPytree):
    """Device-side violation log shared by every launch of a step.

    Fields (device arrays):
      ring                          uint8[cap, 64]      rows of 8 little-endian int64
      write_index                   int32[1]            violations ever recorded (saturating)
      kernel_run_counters           uint8[num_tags, 8]  little-endian int64 per tag
      slot_run_counters             uint8[num_tags, 8]  little-endian int64 per tag
      enable_chain_position_assert  int32[1]            != 0 enables write's chain-position assert

    The constructor does not validate (pytree unflattening passes placeholders); the ops do.
    """

    _FIELDS = ("ring", "write_index", "kernel_run_counters", "slot_run_counters",
               "enable_chain_position_assert")

    def __init__(self, ring, write_index, kernel_run_counters, slot_run_counters,
                 enable_chain_position_assert):
        self.ring = ring
        self.write_index = write_index
        self.kernel_run_counters = kernel_run_counters
        self.slot_run_counters = slot_run_counters
        self.enable_chain_position_assert = enable_chain_position_assert

    @classmethod
    def create(cls, ring_capacity: int = consts.DEFAULT_RING_CAPACITY,
               num_tags: int = consts.NUM_LAUNCH_TAGS) -> "ViolationLog":
        """Empty log: zero ring and counters, write_index 0, chain-position assert enabled."""
        ring_capacity = int(ring_capacity)
        num_tags = int(num_tags)
        if ring_capacity < 1:
            raise ValueError(f"kv-canary: ViolationLog ring_capacity must be positive, got {ring_capacity}")
        if num_tags < 1:
            raise ValueError(f"kv-canary: ViolationLog num_tags must be positive, got {num_tags}")
        return cls(
            ring=jnp.zeros((ring_capacity, consts.VIOLATION_ROW_BYTES), jnp.uint8),
            write_index=jnp.zeros((1,), jnp.int32),
            kernel_run_counters=jnp.zeros((num_tags, consts.COUNTER_BYTES), jnp.uint8),
            slot_run_counters=jnp.zeros((num_tags, consts.COUNTER_BYTES), jnp.uint8),
            enable_chain_position_assert=jnp.ones((1,), jnp.int32),
        )

    def with_chain_position_assert(self, enabled: bool) -> "ViolationLog":
        """The same log with the chain-position assert flag set (a buffer value: no recompile)."""
        flag = jnp.full((1,), 1 if enabled else 0, jnp.int32)
        return ViolationLog(self.ring, self.write_index, self.kernel_run_counters,
                            self.slot_run_counters, flag)

    # -- host accessors (block on the device) ------------------------------------------------
    @property
    def ring_capacity(self) -> int:
        return int(self.ring.shape[0])

    def total(self) -> int:
        """Violations ever recorded (``write_index``)."""
        return int(np.asarray(self.write_index)[0])

    def rows(self) -> np.ndarray:
        """``int64[min(write_index, cap), 8]``: the stored rows, oldest first."""
        n = min(max(self.total(), 0), self.ring_capacity)
        return _le_int64(self.ring)[:n]

    def kernel_runs(self) -> np.ndarray:
        """``int64[num_tags]``: launches per tag."""
        return _le_int64(self.kernel_run_counters).reshape(-1)

    def slot_runs(self) -> np.ndarray:
        """``int64[num_tags]``: entries processed per tag."""
        return _le_int64(self.slot_run_counters).reshape(-1)

    def chain_position_assert_enabled(self) -> bool:
        return bool(np.asarray(self.enable_chain_position_assert)[0] != 0)

    def __repr__(self):
        return (f"ViolationLog(ring={getattr(self.ring, 'shape', self.ring)}, "
                f"write_index={self.write_index!r})")
