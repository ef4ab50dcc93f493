"""Canary state: the canary buffer and the violation log, and their host-side decoding.

All 64-bit quantities live in uint8 arrays (little-endian), so nothing here needs ``jax_enable_x64``.
"""

from __future__ import annotations

import operator
from typing import NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from . import consts
from ._pytree import FieldsPytree
from .errors import KvCanaryTypeError


def _size(name: str, value) -> int:
    """``value`` as an int, refusing what is not an integer (``2.5`` is not silently 2)."""
    if isinstance(value, bool):
        raise KvCanaryTypeError(f"kv-canary: {name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise KvCanaryTypeError(f"kv-canary: {name} must be an int, got {type(value).__name__} "
                                f"{value!r}") from None


def new_canary_buffer(num_slots: int, slot_stride_bytes: int = consts.CANARY_SLOT_BYTES) -> jax.Array:
    """A fresh canary buffer: zeros, ``uint8[num_slots, slot_stride_bytes]``.

    Raises:
      TypeError: a size that is not an int; ValueError: a size out of range.
    """
    num_slots = _size("num_slots", num_slots)
    slot_stride_bytes = _size("slot_stride_bytes", slot_stride_bytes)
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


def canary_fields(canary: jax.Array) -> np.ndarray:
    """Host view of a canary buffer: ``int64[num_slots, 4]`` = (token, position, prev_hash, real_kv_hash)."""
    raw = np.asarray(canary)
    return np.ascontiguousarray(raw[:, : consts.CANARY_SLOT_BYTES]).view("<i8").astype(np.int64)


def _le_int64(arr) -> np.ndarray:
    """uint8[..., 8k] little-endian bytes -> int64[..., k] on the host."""
    return np.ascontiguousarray(np.asarray(arr)).view("<i8").astype(np.int64)


_U64 = (1 << 64) - 1
_WRITE_BITS = int(consts.FailReason.WRITE_TOKEN_MISMATCH | consts.FailReason.WRITE_POSITION_MISMATCH)
_OOB_BIT = int(consts.FailReason.INDEX_OUT_OF_RANGE)


class ViolationRow(NamedTuple):
    """One ring row, decoded (docs/format.md §3.2). ``kind`` says how to read columns 4 to 6.

    Attributes:
      index: the row's place in the ring (0 = the first violation ever recorded).
      tag: the launch tag's name (``"TAIL_K_FULL"``), or ``"unknown(k)"``.
      kind: ``"verify"``, ``"write"`` (the write input or chain-position assert) or
        ``"index_out_of_range"``.
      reasons: the fail-reason labels of the set bits, ascending (``("verify_chain_hash",
        "verify_position")``).
      slot: the canary slot (column 1).
      position: verify: the stored position; write: the input position; index_out_of_range: the
        entry's position (-1 for a write seed).
      stored_token: verify: the stored token; write: the input token; index_out_of_range: the input
        token (write) or -1.
      expected_token: verify: the plan's token (-1 = not checked); write: the expected token;
        index_out_of_range: the out-of-range index value.
      stored_chain_hash: verify: the stored prev_hash; write: the chain hash being stored (u64);
        index_out_of_range: the ``IndexKind`` code.
      expected_aux: verify: the expected prev_hash (u64); write: the expected position;
        index_out_of_range: the exclusive bound that was violated.
      index_kind: index_out_of_range rows: which index (``"write_slot"``, ``"verify_prev"``,
        ``"real_kv_source_2"``, ...); None for the other kinds.
      fail_bits: column 7, the raw ``FailReason`` bits.
    """

    index: int
    tag: str
    kind: str
    reasons: tuple
    slot: int
    position: int
    stored_token: int
    expected_token: int
    stored_chain_hash: int
    expected_aux: int
    index_kind: Optional[str]
    fail_bits: int


def decode_row(row: Union[np.ndarray, Sequence[int]], index: int = 0) -> ViolationRow:
    """A ring row (8 int64, docs/format.md §3.2) as a ``ViolationRow``; ``index`` is its ring row."""
    k, slot, pos, st, et, h, a, bits = (int(v) for v in row)
    if bits & _OOB_BIT:
        kind, index_kind, aux = "index_out_of_range", consts.index_kind_label(h), a
    elif bits & _WRITE_BITS:
        kind, index_kind, aux = "write", None, a
    else:
        kind, index_kind, aux = "verify", None, a & _U64
    return ViolationRow(index=int(index), tag=consts.tag_name(k), kind=kind,
                        reasons=tuple(consts.reason_labels(bits)), slot=slot, position=pos, stored_token=st,
                        expected_token=et, stored_chain_hash=h & _U64, expected_aux=aux, index_kind=index_kind,
                        fail_bits=bits)


@jax.tree_util.register_pytree_node_class
class ViolationLog(FieldsPytree):
    """Device-side violation log shared by every launch of a step (a pytree; docs/format.md §3.3, §5).

    Args:
      ring: ``uint8[cap, 64]``, rows of 8 little-endian int64 (fill-once: row 0 is the first
        violation ever recorded).
      write_index: ``int32[1]``, violations ever recorded (saturating at ``2**31 - 1``; more than
        ``cap`` means the ring overflowed).
      kernel_run_counters: ``uint8[num_tags, 8]``, launches per tag (little-endian int64).
      slot_run_counters: ``uint8[num_tags, 8]``, entries processed per tag.
      enable_chain_position_assert: ``int32[1]``; non-zero enables write's chain-position assert
        (the runtime sets 0 during warm-up; a buffer value, so no recompile).

    ``ViolationLog.create()`` builds an empty log; the constructor wraps existing arrays (restored
    or transferred state) and does not validate them (pytree unflattening passes placeholders): the
    ops do. The host accessors (``total``, ``rows``, ``violations``, ``kernel_runs``,
    ``slot_runs``) block on the device.
    """

    _FIELDS = ("ring", "write_index", "kernel_run_counters", "slot_run_counters",
               "enable_chain_position_assert")

    def __init__(self, ring: jax.Array, write_index: jax.Array, kernel_run_counters: jax.Array,
                 slot_run_counters: jax.Array, enable_chain_position_assert: jax.Array):
        self.ring = ring
        self.write_index = write_index
        self.kernel_run_counters = kernel_run_counters
        self.slot_run_counters = slot_run_counters
        self.enable_chain_position_assert = enable_chain_position_assert

    @classmethod
    def create(cls, ring_capacity: int = consts.DEFAULT_RING_CAPACITY,
               num_tags: int = consts.NUM_LAUNCH_TAGS) -> ViolationLog:
        """An empty log: zero ring and counters, write_index 0, chain-position assert enabled.

        Args:
          ring_capacity: rows of the ring (>= 1).
          num_tags: counter rows (>= 1; the 12 ``LaunchTag`` values by default).

        Raises:
          TypeError: a capacity or tag count that is not an int.
          ValueError: a capacity or tag count below 1.
        """
        ring_capacity = _size("ViolationLog ring_capacity", ring_capacity)
        num_tags = _size("ViolationLog num_tags", num_tags)
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

    def with_chain_position_assert(self, enabled: bool) -> ViolationLog:
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

    def violations(self) -> list:
        """The stored rows decoded, oldest first: ``list[ViolationRow]`` (host; blocks). Rows past the
        ring's capacity were dropped; ``total()`` still counts them."""
        return [decode_row(r, i) for i, r in enumerate(self.rows())]

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
