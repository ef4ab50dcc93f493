"""Host-side hashing of the canary format (format.md §4), in plain Python ints and vectorised numpy.

Every function accepts either

* a **scalar** (a Python ``int`` or a numpy integer scalar, any signedness): the result is a Python
  ``int`` in ``[0, 2**64)`` (the u64 value); or
* an **array** (anything ``np.asarray`` turns into an integer array of any shape, signed or unsigned):
  the result is a ``np.uint64`` array of the broadcast shape.

Signed inputs are *reinterpreted* as u64 (two's complement, ``-1 -> 0xFFFF_FFFF_FFFF_FFFF``), exactly
as the native code loads an int64 field. Use :func:`to_i64` to get the stored (signed) value back.

Nothing here needs ``jax_enable_x64``: it is host numpy only.
"""

from __future__ import annotations

import numbers

import numpy as np

from . import consts

MASK64 = (1 << 64) - 1

_M1 = consts.SPLITMIX64_MUL1
_M2 = consts.SPLITMIX64_MUL2
_S1, _S2, _S3 = consts.SPLITMIX64_SHIFTS


def _is_scalar(x) -> bool:
    """Python ints and numpy integer scalars (not 0-d arrays, which stay arrays)."""
    return isinstance(x, numbers.Integral)


def to_u64(x):
    """Reinterpret as u64. Scalar -> Python int in ``[0, 2**64)``; array -> ``np.uint64`` array."""
    if _is_scalar(x):
        return int(x) & MASK64
    a = np.asarray(x)
    if a.dtype == np.uint64:
        return a.copy()
    if a.dtype.kind not in "iub":
        raise TypeError(f"to_u64: integer input required, got dtype {a.dtype}")
    # widen to int64 (sign extension for signed, zero extension for unsigned < 64 bits), then view
    if a.dtype.kind == "u":
        return a.astype(np.uint64)
    return np.ascontiguousarray(a.astype(np.int64)).view(np.uint64)


def to_i64(x):
    """Reinterpret as i64 (the value a record or ring row stores).

    Scalar -> Python int in ``[-2**63, 2**63)``; array -> ``np.int64`` array.
    """
    if _is_scalar(x):
        v = int(x) & MASK64
        return v - (1 << 64) if v >> 63 else v
    return np.ascontiguousarray(to_u64(x)).view(np.int64)


def splitmix64(x):
    """splitmix64 finaliser (§4.1; no golden-ratio increment). ``splitmix64(0) == 0``.

    Scalar -> Python int (u64); array -> ``np.uint64`` array of the same shape.
    """
    if _is_scalar(x):
        x = int(x) & MASK64
        x = ((x ^ (x >> _S1)) * _M1) & MASK64
        x = ((x ^ (x >> _S2)) * _M2) & MASK64
        return x ^ (x >> _S3)
    x = to_u64(x)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(_S1))) * np.uint64(_M1)
        x = (x ^ (x >> np.uint64(_S2))) * np.uint64(_M2)
        return x ^ (x >> np.uint64(_S3))


def mix3(a, b, c):
    """Order-sensitive ``splitmix64(splitmix64(splitmix64(a) ^ b) ^ c)`` (§4.2); each argument is
    reinterpreted as u64 first. Scalars -> Python int; any array argument -> ``np.uint64`` array of
    the broadcast shape."""
    if _is_scalar(a) and _is_scalar(b) and _is_scalar(c):
        h = splitmix64(a)
        h = splitmix64(h ^ (int(b) & MASK64))
        return splitmix64(h ^ (int(c) & MASK64))
    h = splitmix64(to_u64(a))
    h = splitmix64(h ^ to_u64(b))
    return splitmix64(h ^ to_u64(c))


ANCHOR_HASH = splitmix64(consts.CANARY_CHAIN_ANCHOR)  # 0xDE7FAE23A9A1B716 (Python int)
assert ANCHOR_HASH == consts.CANARY_ANCHOR_HASH


def successor_hash(prev_hash, token, position):
    """The chain hash the *next* slot must store: ``mix3(prev_hash, token, position)`` (§4.3).

    ``real_kv_hash`` is not part of the chain. Scalars or arrays as :func:`mix3`.
    For a negative slot the successor hash is :data:`ANCHOR_HASH`; see :func:`slot_successor_hash`.
    """
    return mix3(prev_hash, token, position)


def slot_successor_hash(fields, s: int) -> int:
    """``successor_hash(canary, s)`` of §4.3 for one slot.

    ``fields``: ``int64[num_slots, 4]`` (``kvc.canary_fields(canary)``) or the raw canary buffer
    ``uint8[num_slots, stride]``; ``s``: int, ``s < num_slots``. Any negative ``s`` gives the anchor
    hash. Returns a Python int (u64).
    """
    s = int(s)
    if s < 0:
        return ANCHOR_HASH
    f = np.asarray(fields)
    if f.dtype == np.uint8:
        f = np.ascontiguousarray(f[:, :consts.CANARY_SLOT_BYTES]).view("<i8")
    tok, pos, prev = (int(v) for v in f[s, :3])
    return mix3(prev, tok, pos)


def chain(tokens, positions, seed_hash: int = ANCHOR_HASH):
    """Hashes of a linear chain (§4.3).

    ``tokens``, ``positions``: sequences of ints (same length n). Returns ``(stored, running)``:
    ``stored`` = list of n Python ints (u64), the ``prev_hash`` each entry stores; ``running`` = the
    hash after the last entry (u64 Python int).
    """
    h = int(seed_hash) & MASK64
    stored = []
    for t, p in zip(tokens, positions):
        stored.append(h)
        h = mix3(h, int(t), int(p))
    return stored, h


# ---- real-KV fold (§4.4) ---------------------------------------------------------------------------

def _strip_words(strip) -> np.ndarray:
    """uint8 bytes ``[..., n]`` (n a multiple of 16) -> little-endian words ``np.uint64[..., n // 8]``."""
    if isinstance(strip, (bytes, bytearray, memoryview)):
        b = np.frombuffer(bytes(strip), dtype=np.uint8)
    else:
        b = np.asarray(strip)
        if b.dtype != np.uint8:
            b = np.ascontiguousarray(b).view(np.uint8)
    if b.shape[-1] % consts.REAL_KV_CHUNK_BYTES:
        raise ValueError(f"fold: strip length must be a multiple of 16 bytes, got {b.shape[-1]}")
    return np.ascontiguousarray(b).view("<u8").astype(np.uint64)


def fold_one(strip):
    """Fold one source's slot strip (§4.4 ``fold_one``): ``acc = splitmix64(acc ^ word)`` over the
    8-byte little-endian words in address order, starting at 0.

    ``strip``: ``bytes`` / uint8 array ``[n]`` -> Python int (u64); uint8 array ``[..., n]`` (a batch of
    strips) -> ``np.uint64[...]``. ``n`` must be a multiple of 16 (0 folds to 0).
    """
    words = _strip_words(strip)
    acc = np.zeros(words.shape[:-1], dtype=np.uint64)
    for k in range(words.shape[-1]):
        acc = splitmix64(acc ^ words[..., k])
    if words.ndim == 1:
        return int(acc)
    return acc


def real_kv_hash(strips):
    """Outer fold over sources (§4.4 ``real_kv_hash``): ``acc = splitmix64(acc ^ fold_one(strip_k))``.

    ``strips``: a list (source order) of per-source strips, each as :func:`fold_one` accepts (all
    scalar strips, or all batches of the same leading shape). An empty list gives 0 (mode NONE /
    no sources). Mode selection (16 bytes vs ``read_bytes``) is the caller's: see :func:`slot_strip`.
    Returns a Python int (u64) for single strips, ``np.uint64[...]`` for batches.
    """
    acc = None
    for strip in strips:
        f = fold_one(strip)
        acc = splitmix64(f if acc is None else acc ^ f)  # acc starts at 0: 0 ^ f == f
    return 0 if acc is None else acc


# ---- source addressing (§4.4) ----------------------------------------------------------------------

def source_row_image(source) -> np.ndarray:
    """The host byte image of a :class:`RealKvSource`: ``uint8[rows, row_bytes]`` where row ``r`` is
    the little-endian in-memory bytes of ``array[r]`` (C order). Works for any dtype >= 8 bits
    (bfloat16, float16, float32, int32, uint8, ...), numpy or jax arrays."""
    arr = np.ascontiguousarray(np.asarray(source.array))
    rows = arr.shape[0]
    if arr.dtype.byteorder == ">":  # never for jax arrays; keep the LE contract for odd numpy input
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    row_bytes = arr.dtype.itemsize * int(np.prod(arr.shape[1:], dtype=np.int64))
    return arr.reshape(rows, -1).view(np.uint8).reshape(rows, row_bytes) if rows else \
        np.zeros((0, row_bytes), np.uint8)


def effective_bytes(source, mode) -> int:
    """Bytes folded per slot for this source: 16 for PARTIAL, ``read_bytes`` for ALL, 0 for NONE."""
    mode = int(mode)
    if mode == consts.RealKvHashMode.NONE:
        return 0
    if mode == consts.RealKvHashMode.PARTIAL:
        return consts.REAL_KV_PARTIAL_BYTES
    return int(source.read_bytes)


def slot_strip(source, slot, mode, image: np.ndarray | None = None) -> np.ndarray:
    """The bytes of slot ``slot``'s strip that the fold reads: ``uint8[eff]`` (a copy).

    ``row = slot // page_size``, ``col = (slot % page_size) * num_bytes_per_token + offset_bytes``;
    ``eff`` from :func:`effective_bytes`. ``slot`` may also be an int array ``[n]`` ->
    ``uint8[n, eff]``. The caller guarantees ``0 <= slot`` and ``row < rows``. ``image`` may pass a
    precomputed :func:`source_row_image`.
    """
    img = source_row_image(source) if image is None else image
    eff = effective_bytes(source, mode)
    ps, nb = int(source.page_size), int(source.num_bytes_per_token)
    s = np.asarray(slot, dtype=np.int64)
    row, col = s // ps, (s % ps) * nb + int(source.offset_bytes)
    idx = col[..., None] + np.arange(eff, dtype=np.int64)
    return img[row[..., None], idx] if s.ndim else img[int(row), int(col):int(col) + eff].copy()


def slot_strip_words(source, slot, mode, image: np.ndarray | None = None) -> np.ndarray:
    """The u64 image of a slot's strip: the :func:`slot_strip` bytes as little-endian 8-byte words,
    ``np.uint64[eff // 8]`` (or ``[n, eff // 8]`` for an array of slots) — the values the fold
    consumes, in order."""
    return _strip_words(slot_strip(source, slot, mode, image))


def slot_real_kv_hash(sources, slot, mode):
    """``real_kv_hash(sources, slot, mode)`` of §4.4: 0 for mode NONE or no sources (nothing read).

    ``slot``: int -> Python int (u64); int array ``[n]`` -> ``np.uint64[n]``. The caller guarantees
    every slot is real-KV-addressable (see :func:`first_unaddressable_source`).
    """
    if int(mode) == consts.RealKvHashMode.NONE or len(sources) == 0:
        return 0 if np.ndim(slot) == 0 else np.zeros(np.shape(slot), np.uint64)
    return real_kv_hash([slot_strip(src, slot, mode) for src in sources])


def first_unaddressable_source(sources, slot: int):
    """Index of the first source ``k`` with ``slot // page_size_k >= rows_k``, or ``None`` (slot >= 0)."""
    for k, src in enumerate(sources):
        if int(slot) // int(src.page_size) >= int(np.shape(src.array)[0]):
            return k
    return None
