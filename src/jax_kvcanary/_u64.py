"""64-bit unsigned arithmetic for the pure-JAX backend, on pairs of uint32 arrays.

A u64 value is carried as a pair ``(lo, hi)`` of uint32 arrays of the same shape; its byte image is
``LE(lo) || LE(hi)`` (format.md §3.3). Everything here works with ``jax_enable_x64`` off. When x64 is on,
``splitmix64`` / ``mix3`` use native uint64 internally (the hot path); the pair interface and the bytes
are the same either way.

The 64x64 -> 64 multiply (mod 2**64) is built from 32-bit products of 16-bit limbs, so no intermediate
ever exceeds 32 bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import consts

U32 = jnp.uint32
_M16 = np.uint32(0xFFFF)
_M32 = 0xFFFFFFFF


def x64_enabled() -> bool:
    return bool(jax.config.jax_enable_x64)


# ---- construction / conversion ------------------------------------------------------------------

def const(value: int, shape=()):
    """A Python int (taken mod 2**64) as a pair of uint32 arrays of ``shape``."""
    value &= (1 << 64) - 1
    return (jnp.full(shape, value & _M32, U32), jnp.full(shape, value >> 32, U32))


def zeros(shape):
    return (jnp.zeros(shape, U32), jnp.zeros(shape, U32))


def from_int(x):
    """int32 / int64 array -> pair; int32 is sign-extended (format.md ``widen``)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.int32:
        lo = lax.bitcast_convert_type(x, U32)
        hi = jnp.where(x < 0, np.uint32(_M32), np.uint32(0))
        return lo, hi
    if x.dtype == jnp.uint32:
        return x, jnp.zeros_like(x)
    if x.dtype in (jnp.int64, jnp.uint64):
        u = lax.bitcast_convert_type(x, jnp.uint64) if x.dtype == jnp.int64 else x
        return (lax.convert_element_type(u & np.uint64(_M32), U32),
                lax.convert_element_type(u >> np.uint64(32), U32))
    if x.dtype in (jnp.int8, jnp.int16, jnp.bool_, jnp.uint8, jnp.uint16):
        return from_int(x.astype(jnp.int32))
    raise TypeError(f"kv-canary: internal: cannot widen dtype {x.dtype}")


def to_u64(p):
    """pair -> native uint64 array (x64 only)."""
    lo, hi = p
    return lo.astype(jnp.uint64) | (hi.astype(jnp.uint64) << np.uint64(32))


def from_u64(x):
    return (lax.convert_element_type(x & np.uint64(_M32), U32),
            lax.convert_element_type(x >> np.uint64(32), U32))


def to_bytes(lo, hi):
    """uint32 ``lo``/``hi`` of shape [..., K] -> uint8 [..., 8K] (K little-endian u64)."""
    w = jnp.stack([lo, hi], axis=-1)                       # [..., K, 2]
    b = lax.bitcast_convert_type(w, jnp.uint8)              # [..., K, 2, 4]
    return b.reshape(b.shape[:-3] + (b.shape[-3] * 8,))


def from_bytes(b):
    """uint8 [..., 8K] -> (lo, hi) uint32 [..., K]."""
    k = b.shape[-1] // 8
    w = lax.bitcast_convert_type(b.reshape(b.shape[:-1] + (k, 2, 4)), U32)   # [..., K, 2]
    return w[..., 0], w[..., 1]


# ---- elementwise ops ----------------------------------------------------------------------------

def xor(a, b):
    return (a[0] ^ b[0], a[1] ^ b[1])


def eq(a, b):
    return (a[0] == b[0]) & (a[1] == b[1])


def ne(a, b):
    return (a[0] != b[0]) | (a[1] != b[1])


def where(c, a, b):
    return (jnp.where(c, a[0], b[0]), jnp.where(c, a[1], b[1]))


def add(a, b):
    lo = a[0] + b[0]
    carry = (lo < a[0]).astype(U32)
    return lo, a[1] + b[1] + carry


def add_small(a, v: int):
    """a + v for a small non-negative Python int v (< 2**32)."""
    lo = a[0] + np.uint32(v)
    carry = (lo < a[0]).astype(U32)
    return lo, a[1] + carry


def shr(a, n: int):
    """Logical right shift by a static 0 < n < 32."""
    lo, hi = a
    return (lo >> np.uint32(n)) | (hi << np.uint32(32 - n)), hi >> np.uint32(n)


def mul32_wide(x, y):
    """Full 32x32 -> 64 product of uint32 arrays, as a pair, via 16-bit limbs."""
    x0 = x & _M16
    x1 = x >> np.uint32(16)
    y0 = y & _M16
    y1 = y >> np.uint32(16)
    p00 = x0 * y0
    p01 = x0 * y1
    p10 = x1 * y0
    p11 = x1 * y1
    mid = (p00 >> np.uint32(16)) + (p01 & _M16) + (p10 & _M16)      # < 3 * 2**16
    lo = (p00 & _M16) | (mid << np.uint32(16))
    hi = p11 + (p01 >> np.uint32(16)) + (p10 >> np.uint32(16)) + (mid >> np.uint32(16))
    return lo, hi


def mul(a, b):
    """a * b mod 2**64 (pairs)."""
    lo, hi = mul32_wide(a[0], b[0])
    return lo, hi + a[0] * b[1] + a[1] * b[0]


def mul_const(a, c: int):
    """a * c mod 2**64 for a Python int constant c."""
    c_lo = np.uint32(c & _M32)
    c_hi = np.uint32((c >> 32) & _M32)
    lo, hi = mul32_wide(a[0], jnp.asarray(c_lo, U32))
    return lo, hi + a[0] * c_hi + a[1] * c_lo


# ---- hashes (format.md §4) ---------------------------------------------------------------------------

def _splitmix64_pairs(x):
    x = mul_const(xor(x, shr(x, 30)), consts.SPLITMIX64_MUL1)
    x = mul_const(xor(x, shr(x, 27)), consts.SPLITMIX64_MUL2)
    return xor(x, shr(x, 31))


def _splitmix64_native(x):
    x = (x ^ (x >> np.uint64(30))) * np.uint64(consts.SPLITMIX64_MUL1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(consts.SPLITMIX64_MUL2)
    return x ^ (x >> np.uint64(31))


def splitmix64(p, *, native=None):
    """splitmix64 finaliser on a pair (format.md §4.1)."""
    if native is None:
        native = x64_enabled()
    if native:
        return from_u64(_splitmix64_native(to_u64(p)))
    return _splitmix64_pairs(p)


def mix3(a, b, c, *, native=None):
    """mix3(a, b, c) on pairs (format.md §4.2)."""
    if native is None:
        native = x64_enabled()
    if native:
        h = _splitmix64_native(to_u64(a))
        h = _splitmix64_native(h ^ to_u64(b))
        return from_u64(_splitmix64_native(h ^ to_u64(c)))
    h = _splitmix64_pairs(a)
    h = _splitmix64_pairs(xor(h, b))
    return _splitmix64_pairs(xor(h, c))


def anchor_hash(shape=()):
    return const(consts.CANARY_ANCHOR_HASH, shape)
