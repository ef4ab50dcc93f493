"""Trace-time argument checks shared by every backend (format.md §7.2, §8.2, §9.4, §9.5).

Each function raises on the first failure, with a ``kv-canary:`` message naming the argument, the
expected and the actual value, and returns the normalised value (a Python int/bool, a length).
Nothing here looks at array *values*: data-dependent conditions are the kernels' business.
"""

from __future__ import annotations

import operator

import jax
import numpy as np

from . import consts
from .errors import KvCanaryTypeError
from .inputs import RealKvSource
from .state import ViolationLog

INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def _shape(x) -> tuple:
    return tuple(int(d) for d in x.shape)


def _dtype(x) -> np.dtype:
    return np.dtype(x.dtype)


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


# ---- [SRC] --------------------------------------------------------------------------------------
def real_kv(real_kv_sources, real_kv_hash_mode):
    """[SRC] 1-4. Returns the normalised pair: ``((), 0)`` or ``(sources, 1|2)``."""
    if not isinstance(real_kv_sources, (tuple, list)):
        raise KvCanaryTypeError(
            f"kv-canary: real_kv_sources must be a tuple of RealKvSource, got {type(real_kv_sources).__name__}")
    if len(real_kv_sources) > consts.MAX_REAL_KV_SOURCES:
        raise ValueError("kv-canary: at most 4 RealKvSource entries supported by the CUDA ABI, "
                         f"got {len(real_kv_sources)}")
    for i, src in enumerate(real_kv_sources):
        if not isinstance(src, RealKvSource):
            raise KvCanaryTypeError(
                f"kv-canary: real_kv_sources[{i}] must be a RealKvSource, got {type(src).__name__}")
    try:
        mode = operator.index(real_kv_hash_mode)
    except TypeError:
        mode = None
    if isinstance(real_kv_hash_mode, (bool, np.bool_)) or mode not in (0, 1, 2):
        raise ValueError("kv-canary: real_kv_hash_mode must be 0 (NONE), 1 (PARTIAL) or 2 (ALL), "
                         f"got {real_kv_hash_mode!r}")
    if mode == consts.RealKvHashMode.NONE:
        return (), 0
    if not real_kv_sources:
        raise ValueError(f"kv-canary: real_kv_hash_mode={consts.RealKvHashMode(mode).name} needs at "
                         "least one RealKvSource in real_kv_sources, got none (nothing would be "
                         "fingerprinted); pass the KV arrays or real_kv_hash_mode=NONE")
    return tuple(real_kv_sources), int(mode)


# ---- [CAN] / [LOG] / [TAG] / [BOOL] -------------------------------------------------------------
def canary(c) -> int:
    """[CAN]. Returns num_slots."""
    if not _is_array(c):
        raise KvCanaryTypeError(f"kv-canary: canary must be a jax.Array, got {type(c).__name__}")
    if _dtype(c) != np.uint8:
        raise KvCanaryTypeError(f"kv-canary: canary must have dtype uint8, got {_dtype(c).name}")
    shape = _shape(c)
    if len(shape) != 2:
        raise ValueError(f"kv-canary: canary must be 2-D, got shape {shape}")
    if shape[0] < 1:
        raise ValueError(f"kv-canary: canary must have at least 1 slot, got shape {shape}")
    if shape[1] < consts.CANARY_SLOT_BYTES:
        raise ValueError(f"kv-canary: canary slot stride must hold at least 32 bytes per slot, got {shape[1]}")
    if shape[1] % 8:
        raise ValueError(f"kv-canary: canary slot stride must be a multiple of 8 bytes, got {shape[1]}")
    return shape[0]


def _exact(x, name, dtype, shape, shape_text=None):
    if not _is_array(x):
        raise KvCanaryTypeError(f"kv-canary: {name} must be a jax.Array, got {type(x).__name__}")
    if _dtype(x) != dtype:
        raise KvCanaryTypeError(f"kv-canary: {name} must have dtype {np.dtype(dtype).name}, got {_dtype(x).name}")
    if _shape(x) != shape:
        raise ValueError(f"kv-canary: {name} must have shape {shape_text or shape}, got {_shape(x)}")


def log(lg) -> int:
    """[LOG]. Returns num_tags."""
    if not isinstance(lg, ViolationLog):
        raise KvCanaryTypeError(f"kv-canary: log must be a ViolationLog, got {type(lg).__name__}")
    ring = lg.ring
    if not _is_array(ring):
        raise KvCanaryTypeError(f"kv-canary: log.ring must be a jax.Array, got {type(ring).__name__}")
    if _dtype(ring) != np.uint8:
        raise KvCanaryTypeError(f"kv-canary: log.ring must have dtype uint8, got {_dtype(ring).name}")
    if len(_shape(ring)) != 2:
        raise ValueError(f"kv-canary: log.ring must be 2-D, got shape {_shape(ring)}")
    if _shape(ring)[1] != consts.VIOLATION_ROW_BYTES:
        raise ValueError("kv-canary: log.ring must have 64 bytes per row (8 little-endian int64), "
                         f"got shape {_shape(ring)}")
    if _shape(ring)[0] < 1:
        raise ValueError(f"kv-canary: ViolationLog ring_capacity must be positive, got {_shape(ring)[0]}")
    _exact(lg.write_index, "log.write_index", np.int32, (1,))
    kc = lg.kernel_run_counters
    if not _is_array(kc):
        raise KvCanaryTypeError(f"kv-canary: log.kernel_run_counters must be a jax.Array, got {type(kc).__name__}")
    if _dtype(kc) != np.uint8:
        raise KvCanaryTypeError(f"kv-canary: log.kernel_run_counters must have dtype uint8, got {_dtype(kc).name}")
    if len(_shape(kc)) != 2 or _shape(kc)[1] != consts.COUNTER_BYTES:
        raise ValueError(f"kv-canary: log.kernel_run_counters must have shape (num_tags, 8), got {_shape(kc)}")
    num_tags = _shape(kc)[0]
    if num_tags < 1:
        raise ValueError(f"kv-canary: ViolationLog num_tags must be positive, got {num_tags}")
    _exact(lg.slot_run_counters, "log.slot_run_counters", np.uint8, _shape(kc))
    _exact(lg.enable_chain_position_assert, "log.enable_chain_position_assert", np.int32, (1,))
    return num_tags


def tag(t, num_tags: int) -> int:
    """[TAG]."""
    try:
        value = operator.index(t)
    except TypeError:
        raise KvCanaryTypeError(f"kv-canary: tag must be an int or LaunchTag, got {type(t).__name__}") from None
    if not 0 <= value < num_tags:
        raise ValueError(f"kv-canary: tag must be in [0, num_tags={num_tags}), got {value}")
    return int(value)


def static_bool(value, name: str) -> bool:
    """[BOOL]: a Python/numpy bool or the ints 0/1; never a traced array."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and not isinstance(value, jax.Array) and value in (0, 1):
        return bool(value)
    raise KvCanaryTypeError(f"kv-canary: {name} must be a static bool, got {type(value).__name__}")


# ---- [IDX] --------------------------------------------------------------------------------------
def index_array(x, name: str, length: int | None = None, length_text: str | None = None) -> int:
    """[IDX] 1-4: a 1-D int32/int64 array (of ``length`` if given). Returns its length."""
    _index_typed(x, name)
    if len(_shape(x)) != 1:
        raise ValueError(f"kv-canary: {name} must be 1-D, got shape {_shape(x)}")
    n = _shape(x)[0]
    if length is not None and n != length:
        raise ValueError(f"kv-canary: {name} length must be {length_text or length}, got {n}")
    return n


def records(x, n: int, name: str = "records") -> None:
    """Exported canary records (format.md §14.1): ``uint8[n, 32]``."""
    if not _is_array(x):
        raise KvCanaryTypeError(f"kv-canary: {name} must be a jax.Array, got {type(x).__name__}")
    if _dtype(x) != np.uint8:
        raise KvCanaryTypeError(f"kv-canary: {name} must have dtype uint8, got {_dtype(x).name}")
    if _shape(x) != (n, consts.CANARY_SLOT_BYTES):
        raise ValueError(f"kv-canary: {name} must have shape (len(slots), 32) = ({n}, 32), got {_shape(x)}")


def scalar_i32(x, name: str) -> None:
    """[IDX] 5-6: an exact ``int32[1]`` field."""
    _exact(x, name, np.int32, (1,))


def index_matrix(x, name: str) -> tuple:
    """A 2-D int32/int64 table (req_to_token, the token pool). Returns its shape."""
    _index_typed(x, name)
    if len(_shape(x)) != 2:
        raise ValueError(f"kv-canary: {name} must be 2-D, got shape {_shape(x)}")
    return _shape(x)


def flat_table(x, name: str, when: str) -> int:
    """A 1-D int32/int64 table read at computed offsets (req_to_token with row_starts). ``when``
    names the argument that asks for it. Returns its length."""
    _index_typed(x, name)
    if len(_shape(x)) != 1:
        raise ValueError(f"kv-canary: {name} must be 1-D when {when}, got shape {_shape(x)}")
    return _shape(x)[0]


def _index_typed(x, name: str) -> None:
    """[IDX] 1-2: an array of dtype int32 or int64."""
    if not _is_array(x):
        raise KvCanaryTypeError(f"kv-canary: {name} must be a jax.Array, got {type(x).__name__}")
    if _dtype(x) not in INDEX_DTYPES:
        raise KvCanaryTypeError(f"kv-canary: {name} must have dtype int32 or int64, got {_dtype(x).name}")


# ---- plan statics (format.md §9.4) -------------------------------------------------------------------
def static_int(value, name: str) -> int:
    try:
        return int(operator.index(value))
    except TypeError:
        raise KvCanaryTypeError(f"kv-canary: {name} must be an int, got {type(value).__name__}") from None


def capacity(value, name: str, positive_text: str) -> int:
    n = static_int(value, name)
    if n <= 0:
        raise ValueError(f"kv-canary: {positive_text} must be positive, got {n}")
    if n >= 2**31:
        raise ValueError(f"kv-canary: {name} must be < 2**31, got {n}")
    return n


# ---- scatter (format.md §9.5) ------------------------------------------------------------------------
def scatter_args(pool, flat_ids, offsets, req_pool_indices) -> None:
    args = (("pool", pool, 2), ("flat_ids", flat_ids, 1), ("offsets", offsets, 1),
            ("req_pool_indices", req_pool_indices, 1))
    for name, x, _ in args:
        if not _is_array(x):
            raise KvCanaryTypeError(
                f"kv-canary: scatter_req_token_ids {name} must be a jax.Array, got {type(x).__name__}")
    for name, x, ndim in args:
        if len(_shape(x)) != ndim:
            raise ValueError(
                f"kv-canary: scatter_req_token_ids {name} must be {ndim}-D, got shape {_shape(x)}")
    for name, x, _ in args:
        if _dtype(x) not in INDEX_DTYPES:
            raise KvCanaryTypeError(
                f"kv-canary: scatter_req_token_ids {name} must be int32 or int64, got {_dtype(x).name}")
    bs = _shape(req_pool_indices)[0]
    if _shape(offsets)[0] != bs + 1:
        raise ValueError(
            f"kv-canary: scatter_req_token_ids offsets length {_shape(offsets)[0]} != bs+1 ({bs + 1})")
