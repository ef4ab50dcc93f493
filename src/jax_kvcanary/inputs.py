"""Op inputs: the two plan pytrees and the real-KV source descriptor."""

from __future__ import annotations

import operator

import jax
import numpy as np

from . import consts
from ._pytree import FieldsPytree
from .errors import KvCanaryTypeError


@jax.tree_util.register_pytree_node_class
class VerifyPlan(FieldsPytree):
    """Work list of one verify launch (``V = verify_capacity``).

      slot_indices, expected_tokens, expected_positions, prev_slot_indices   int32/int64[V]
      num_valid, enable                                                        int32[1]

    Sentinels: slot 0 = padding; expected token -1 = no token check; prev < 0 = chain head,
    prev 0 = predecessor unknown (chain check skipped). The constructor does not validate.

    ``has_expected_tokens`` (static, default True) is False for a plan ``plan`` made without a token
    pool, whose ``expected_tokens`` are all -1: ``verify`` then refuses
    ``check_verify_expected_token=True``, which would check nothing.
    """

    _FIELDS = ("slot_indices", "expected_tokens", "expected_positions", "prev_slot_indices",
               "num_valid", "enable")

    def __init__(self, slot_indices: jax.Array, expected_tokens: jax.Array, expected_positions: jax.Array,
                 prev_slot_indices: jax.Array, num_valid: jax.Array, enable: jax.Array,
                 has_expected_tokens: bool = True):
        self.slot_indices = slot_indices
        self.expected_tokens = expected_tokens
        self.expected_positions = expected_positions
        self.prev_slot_indices = prev_slot_indices
        self.num_valid = num_valid
        self.enable = enable
        self.has_expected_tokens = bool(has_expected_tokens)

    def tree_flatten(self):
        return tuple(getattr(self, f) for f in self._FIELDS), self.has_expected_tokens

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, has_expected_tokens=aux)


@jax.tree_util.register_pytree_node_class
class WritePlan(FieldsPytree):
    """Work list of one write launch (``C = write_req_capacity``).

      offsets             int32/int64[C + 1]  request r owns flat indices [offsets[r], offsets[r+1])
      seed_slot_indices   int32/int64[C]      chain-seed slot per request; negative = anchor
      num_valid_reqs      int32[1]

    The constructor does not validate.
    """

    _FIELDS = ("offsets", "seed_slot_indices", "num_valid_reqs")

    def __init__(self, offsets: jax.Array, seed_slot_indices: jax.Array, num_valid_reqs: jax.Array):
        self.offsets = offsets
        self.seed_slot_indices = seed_slot_indices
        self.num_valid_reqs = num_valid_reqs


def _static_int(name: str, value) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise KvCanaryTypeError(
            f"kv-canary: RealKvSource.{name} must be an int, got {type(value).__name__}") from None


def source_row_bytes(array) -> int:
    """Bytes of ``array[r]`` in the default row-major layout."""
    return int(np.dtype(array.dtype).itemsize * int(np.prod(array.shape[1:], dtype=np.int64)))


@jax.tree_util.register_pytree_node_class
class RealKvSource:
    """One live KV array to fingerprint, with its slot addressing (docs/format.md §4.4).

    Slot ``s`` reads ``eff`` bytes at ``(s % page_size) * num_bytes_per_token + offset_bytes`` of row
    ``s // page_size``, with ``eff = 16`` (PARTIAL) or ``read_bytes`` (ALL). A pytree whose only
    child is ``array``; the four ints are static.

    Args:
      array: the live KV buffer, a jax.Array of any dtype of >= 8 bits with >= 2 dimensions; row
        ``r`` is the bytes of ``array[r]`` (row-major), a multiple of 16 bytes. For example layer 0's
        K of a paged cache ``[num_pages, page_size, heads, head_dim]``.
      page_size: slots per row (>= 1).
      num_bytes_per_token: bytes between consecutive slots of a row, a positive multiple of 16;
        ``page_size * num_bytes_per_token`` must fit in a row.
      read_bytes: bytes per slot folded in ALL mode, a multiple of 16 in ``(0, num_bytes_per_token]``.
      offset_bytes: where the strip starts inside each slot's ``num_bytes_per_token`` bytes, a
        non-negative multiple of 16 with ``offset_bytes + read_bytes <= num_bytes_per_token``
        (default 0: the slot's first bytes). The JAX form of a torch view's storage offset: e.g. V
        head 0 of an interleaved fused row ``[K0, V0, K1, V1, ...]`` is
        ``RealKvSource(kv, 1, row_bytes, 16, offset_bytes=head_bytes)``, read in place, where a
        slice ``kv[:, 1, :16 bytes]`` would make XLA copy those bytes of every slot of the pool.

    Raises:
      TypeError, ValueError: a ``kv-canary:`` message naming the field, the expected and the actual
        value (the upstream texts).
    """

    def __init__(self, array: jax.Array, page_size: int, num_bytes_per_token: int, read_bytes: int,
                 offset_bytes: int = 0):
        page_size = _static_int("page_size", page_size)
        num_bytes_per_token = _static_int("num_bytes_per_token", num_bytes_per_token)
        read_bytes = _static_int("read_bytes", read_bytes)
        offset_bytes = _static_int("offset_bytes", offset_bytes)
        if page_size < 1:
            raise ValueError(f"kv-canary: RealKvSource.page_size must be >= 1, got {page_size}")
        if num_bytes_per_token <= 0 or num_bytes_per_token % consts.REAL_KV_CHUNK_BYTES:
            raise ValueError(
                "kv-canary: RealKvSource.num_bytes_per_token must be a positive multiple of 16, "
                f"got {num_bytes_per_token}")
        if (read_bytes <= 0 or read_bytes > num_bytes_per_token
                or read_bytes % consts.REAL_KV_CHUNK_BYTES):
            raise ValueError(
                "kv-canary: RealKvSource.read_bytes must be a positive multiple of 16 in "
                f"(0, num_bytes_per_token={num_bytes_per_token}], got {read_bytes}")
        if offset_bytes < 0 or offset_bytes % consts.REAL_KV_CHUNK_BYTES:
            raise ValueError(
                f"kv-canary: RealKvSource.offset_bytes must be a non-negative multiple of 16, got {offset_bytes}")
        if offset_bytes + read_bytes > num_bytes_per_token:
            raise ValueError(
                "kv-canary: RealKvSource.offset_bytes + read_bytes must be <= num_bytes_per_token="
                f"{num_bytes_per_token}, got {offset_bytes} + {read_bytes}")
        if not (hasattr(array, "shape") and hasattr(array, "dtype")):
            raise KvCanaryTypeError(
                f"kv-canary: RealKvSource.array must be a jax.Array, got {type(array).__name__}")
        shape = tuple(int(d) for d in array.shape)
        if len(shape) < 2:
            raise ValueError(f"kv-canary: RealKvSource.array must be at least 2-D, got shape {shape}")
        dtype = np.dtype(array.dtype)
        if dtype.itemsize < 1 or _is_sub_byte(dtype):
            raise KvCanaryTypeError(
                f"kv-canary: RealKvSource.array dtype {dtype.name} is not supported: elements "
                "narrower than 8 bits have no defined byte layout")
        row_bytes = source_row_bytes(array)
        if row_bytes % consts.REAL_KV_CHUNK_BYTES:
            raise ValueError(
                "kv-canary: RealKvSource.array row stride must be a multiple of 16 bytes, "
                f"got {row_bytes} bytes (shape={shape}, dtype={dtype.name})")
        if row_bytes < page_size * num_bytes_per_token:
            raise ValueError(
                "kv-canary: RealKvSource row is too narrow for its slot layout: a row is "
                f"{row_bytes} bytes but page_size={page_size} x num_bytes_per_token="
                f"{num_bytes_per_token} needs {page_size * num_bytes_per_token}")
        self.array = array
        self.page_size = page_size
        self.num_bytes_per_token = num_bytes_per_token
        self.read_bytes = read_bytes
        self.offset_bytes = offset_bytes

    @property
    def rows(self) -> int:
        return int(self.array.shape[0])

    @property
    def row_bytes(self) -> int:
        return source_row_bytes(self.array)

    def tree_flatten(self):
        return (self.array,), (self.page_size, self.num_bytes_per_token, self.read_bytes, self.offset_bytes)

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)  # bypass validation: leaves may be placeholders
        obj.array = children[0]
        obj.page_size, obj.num_bytes_per_token, obj.read_bytes, obj.offset_bytes = aux
        return obj

    def __repr__(self):
        return (f"RealKvSource(array={getattr(self.array, 'shape', None)} "
                f"{getattr(self.array, 'dtype', None)}, page_size={self.page_size}, "
                f"num_bytes_per_token={self.num_bytes_per_token}, read_bytes={self.read_bytes}, "
                f"offset_bytes={self.offset_bytes})")


def _is_sub_byte(dtype: np.dtype) -> bool:
    """int4, uint4, float4_e2m1fn, ...: ml_dtypes reports itemsize 1 but fewer than 8 bits."""
    import ml_dtypes  # a dependency of jax

    for info in (ml_dtypes.iinfo, ml_dtypes.finfo):
        try:
            return info(dtype).bits < 8
        except (ValueError, TypeError):
            continue
    return False
