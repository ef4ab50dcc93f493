"""Builders and shared vectors of the golden tests (tests/test_goldens_*.py): literal records and
plans, byte dumps in the notation of docs/format.md §12, the chain table (§12.3) and the real-KV
sources (§12.4)."""

import jax.numpy as jnp
import numpy as np

import jax_kvcanary as kvc


H0 = 0xDE7FAE23A9A1B716          # anchor hash, literal


H0S = -2414019407054260458       # as stored (i64)




def i64(v):
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >> 63 else v


def arr(values, dtype=np.int32):
    return jnp.asarray(np.asarray(values, dtype=dtype))


def canary_with(num_slots, records=None, stride=32):
    """A canary with the given {slot: (token, position, prev_hash, real_kv_hash)} records."""
    c = np.zeros((num_slots, stride), np.uint8)
    for s, rec in (records or {}).items():
        rec = tuple(rec) + (0,) * (4 - len(rec))
        c[s, :32] = np.array([i64(v) for v in rec], "<i8").view(np.uint8)
    return jnp.asarray(c)


def wplan(offsets, seeds, nvr=None):
    return kvc.WritePlan(offsets=arr(offsets), seed_slot_indices=arr(seeds),
                         num_valid_reqs=arr([len(seeds) if nvr is None else nvr]))


def vplan(slots, positions, prevs, tokens=None, num_valid=None, enable=1, dtype=np.int32):
    tokens = [-1] * len(slots) if tokens is None else tokens
    return kvc.VerifyPlan(slot_indices=arr(slots, dtype), expected_tokens=arr(tokens, dtype),
                          expected_positions=arr(positions, dtype),
                          prev_slot_indices=arr(prevs, dtype),
                          num_valid=arr([len(slots) if num_valid is None else num_valid]),
                          enable=arr([enable]))


def fields(canary):
    return kvc.canary_fields(canary)


def rec_hex(canary, s):
    """The 32 record bytes of slot s as four 16-hex-digit groups (the byte-dump notation of docs/format.md §12)."""
    b = np.asarray(canary)[s, :32].tobytes().hex()
    return " ".join(b[i:i + 16] for i in range(0, 64, 16))


def ring_hex(log, k):
    b = np.asarray(log.ring)[k].tobytes().hex()
    return " ".join(b[i:i + 16] for i in range(0, 128, 16))


def rows(log):
    return np.asarray(log.rows()).tolist()


def do_write(ops, canary, log, offsets, seeds, loc, ids, pos, *, tag=0, nvr=None, **kw):
    return ops.write(canary, log, wplan(offsets, seeds, nvr), arr(ids), arr(pos), arr(loc),
                     tag=tag, **kw)


def src(np_array, page_size, nbpt, read_bytes, offset_bytes=0):
    return kvc.RealKvSource(jnp.asarray(np_array), page_size, nbpt, read_bytes, offset_bytes)


CHAINS = [
    ([101, 202, 303, 404, 505],
     [0xde7fae23a9a1b716, 0x542fe5061275a6ab, 0x9890d56bde53142e, 0x5213c65eee8a1dd1, 0xc749affe5a5a9634],
     0x3a650fcc4023cd13),
    ([11, 22, 33, 44, 55],
     [H0, 0x89cd2abfbebc0649, 0x5782ffc5b5d6409b, 0xf53e51cd772bb95c, 0x5fae4135d917cb64],
     0xae76343810f54045),
    ([10, 20, 30, 40, 50],
     [H0, 0xcd6d3fc64ab68b75, 0x2c17d4bb20b967a5, 0xe86a7c7bf16787b0, 0x61e4a96d91de0165],
     0xabdc6a563124e341),
    ([100, 200, 300], [H0, 0xbbab8afa7bcf5fec, 0x074f864d23feab48], 0x76d238ff4a42cbd3),
    ([7, 8, 9], [H0, 0xdbc1207686f8bbc5, 0x4ef09c7785a21caf], None),
]


def _golden_ratio_tokens(n):
    return [((i * 0x9E3779B97F4A7C15) % 2**64) & 0x7FFFFFFF for i in range(n)]


def _page4_pattern_source():
    a = np.zeros((2, 64), np.uint8)  # 8 slots, page 4, 16 B per token
    for s in range(8):
        for k in range(16):
            a[s // 4, (s % 4) * 16 + k] = (13 * s + k) & 0xFF
    return a


def _addressing_source():
    return (np.arange(4 * 256) & 0xFF).astype(np.uint8).reshape(4, 256)
