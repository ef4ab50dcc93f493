"""Golden vectors of KVCANARY_SPEC.md §12.1–§12.9, as literal expected values.

Hashing pins (§12.1–§12.4) are checked directly on ``jax_kvcanary.hashing``; every op-level example is
run through the ``ops`` fixture, so the same test checks the reference, ffi and xla implementations.
(§12.9's rendered report text belongs to the runtime tests.)
"""

import contextlib
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcanary as kvc
from jax_kvcanary import hashing
from jax_kvcanary.consts import RealKvHashMode

H0 = 0xDE7FAE23A9A1B716          # anchor hash, literal
H0S = -2414019407054260458       # as stored (i64)
NONE, PARTIAL, ALL = RealKvHashMode.NONE, RealKvHashMode.PARTIAL, RealKvHashMode.ALL


def i64(v):
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >> 63 else v


# ---- builders ---------------------------------------------------------------------------------

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
    """The 32 record bytes of slot s as four 16-hex-digit groups (spec byte-dump notation)."""
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


def src(np_array, page_size, nbpt, read_bytes):
    return kvc.RealKvSource(jnp.asarray(np_array), page_size, nbpt, read_bytes)


# ---- §12.1 splitmix64 ------------------------------------------------------------------------

SPLITMIX_PINS = [
    (0x0, 0x0, 0),
    (0x1, 0x5692161D100B05E5, 6238072747940578789),
    (0x9E3779B97F4A7C15, 0xE220A8397B1DCDAF, -2152535657050944081),
    (0xDEADBEEFCAFEBABE, 0x7AD6664F09FFE52C, 8851374607299503404),
    (0xFFFFFFFFFFFFFFFF, 0xB4D055FCF2CBBD7B, -5417735806833148549),
    (0x8000000000000000, 0x25C26EA579CEA98A, 2720858781877447050),
    (0xC0FFEE1234567890, 0xDE7FAE23A9A1B716, -2414019407054260458),
]


@pytest.mark.parametrize("x,out,out_i64", SPLITMIX_PINS, ids=[hex(p[0]) for p in SPLITMIX_PINS])
def test_splitmix64_pins(x, out, out_i64):
    assert hashing.splitmix64(x) == out
    assert hashing.to_i64(hashing.splitmix64(x)) == out_i64
    # vectorised path, signed input reinterpreted
    a = hashing.splitmix64(np.array([i64(x)], dtype=np.int64))
    assert a.dtype == np.uint64 and int(a[0]) == out


def test_splitmix64_vector_and_anchor():
    xs = np.array([p[0] for p in SPLITMIX_PINS], dtype=np.uint64)
    np.testing.assert_array_equal(hashing.splitmix64(xs),
                                  np.array([p[1] for p in SPLITMIX_PINS], dtype=np.uint64))
    assert hashing.splitmix64(kvc.CANARY_CHAIN_ANCHOR) == 0xDE7FAE23A9A1B716
    assert hashing.ANCHOR_HASH == 0xDE7FAE23A9A1B716 == kvc.CANARY_ANCHOR_HASH
    assert kvc.CANARY_CHAIN_ANCHOR == 0xC0FFEE1234567890


def test_splitmix64_1000_distinct():
    rnd = random.Random(0)
    xs = [rnd.getrandbits(64) for _ in range(1000)]
    outs = [hashing.splitmix64(x) for x in xs]
    assert len(set(outs)) == 1000
    np.testing.assert_array_equal(hashing.splitmix64(np.array(xs, dtype=np.uint64)),
                                  np.array(outs, dtype=np.uint64))


# ---- §12.2 mix3 ------------------------------------------------------------------------------

MIX3 = [
    ((H0, 42, 0), 0x1b798564098041c9, 1979760175908667849),
    ((0, 0, 0), 0x0, 0),
    ((H0, -1, 5), 0xa655cdb26a444c27, -6461031924222374873),
    ((0xC0FFEE1234567890, 0, 0), 0xb0cfb7e6fd833012, None),
    ((0x1234567890ABCDEF, 100, 5), 0x0ea63d7d0f5ac3d5, None),
    ((0, 0xFFFF, 0x7FFFFFFF), 0x50b8f729e0c455d6, None),
    ((0x123, 1, 1), 0xe8658e5c1faddb10, None),
    ((0xFFFFFFFFFFFFFFFF, 0xFFFF, 0xFFFF), 0xfcbd57ff526292ff, None),
    ((H0, 100, 4), 0x5022670b6356af64, 5774290970851323748),
    ((H0, 11, 0), 0x89cd2abfbebc0649, None),
    ((H0, 7, 1), 0x7b564cca28e5d52a, None),
    ((H0, 10, 0), 0xcd6d3fc64ab68b75, -3644186402583311499),
]


@pytest.mark.parametrize("abc,out,out_i64", MIX3, ids=[str(i) for i in range(len(MIX3))])
def test_mix3(abc, out, out_i64):
    assert hashing.mix3(*abc) == out
    if out_i64 is not None:
        assert hashing.to_i64(out) == out_i64
    a = hashing.mix3(*(np.array([i64(v)], np.int64) for v in abc))
    assert int(a[0]) == out


def test_mix3_order_sensitive():
    assert hashing.mix3(H0, 42, 0) != hashing.mix3(H0, 0, 42)


# ---- §12.3 chains ----------------------------------------------------------------------------

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


@pytest.mark.parametrize("tokens,stored,nxt", CHAINS, ids=[str(c[0][0]) for c in CHAINS])
def test_chain_hashing(tokens, stored, nxt):
    got, running = hashing.chain(tokens, range(len(tokens)))
    assert got == stored
    if nxt is not None:
        assert running == nxt


def test_chain_101_505_i64():
    got, _ = hashing.chain([101, 202, 303, 404, 505], range(5))
    assert [hashing.to_i64(v) for v in got] == [
        -2414019407054260458, 6066319037333612203, -7453222724029967314, 5914288846698847697,
        -4086541679889574348]
    assert hashing.to_i64(hashing.chain([100, 200, 300], range(3))[0][2]) == 526787347300133704


@pytest.mark.parametrize("tokens,stored,nxt", CHAINS, ids=[str(c[0][0]) for c in CHAINS])
def test_chain_write(ops, tokens, stored, nxt):
    n = len(tokens)
    canary, log = do_write(ops, canary_with(8), kvc.ViolationLog.create(8), [0, n], [-1],
                           list(range(1, n + 1)), tokens, list(range(n)))
    f = fields(canary)
    np.testing.assert_array_equal(f[1:n + 1, 2], np.array([i64(v) for v in stored], np.int64))
    np.testing.assert_array_equal(f[1:n + 1, 0], tokens)
    np.testing.assert_array_equal(f[1:n + 1, 1], np.arange(n))
    np.testing.assert_array_equal(f[1:n + 1, 3], 0)
    assert not f[0].any() and not f[n + 1:].any()
    if nxt is not None:
        assert hashing.slot_successor_hash(f, n) == nxt
    assert log.total() == 0
    assert log.slot_runs()[0] == n and log.kernel_runs()[0] == 1


def test_seed_resume(ops):
    canary = canary_with(50, {42: (7, 10, H0, 0)})
    assert hashing.mix3(H0, 7, 10) == 0x5e35681bcfce7cf6
    canary, log = do_write(ops, canary, kvc.ViolationLog.create(64), [0, 5], [42], [0, 1, 2, 3, 4],
                           [101, 202, 303, 404, 505], [11, 12, 13, 14, 15])
    f = fields(canary)
    expect = [0x5e35681bcfce7cf6, 0x56d3e7d2989b8e36, 0xdd87e0146c9036a8, 0x1cbb47092ff8336e,
              0x3579999bb482d1fc]
    np.testing.assert_array_equal(f[:5], [[t, p, i64(h), 0] for t, p, h in
                                          zip([101, 202, 303, 404, 505], range(11, 16), expect)])
    assert log.total() == 0 and rows(log) == []
    np.testing.assert_array_equal(f[42], [7, 10, H0S, 0])


def test_seeded_single_write(ops):
    canary = canary_with(8, {7: (100, 4, H0, 0)})
    canary, log = do_write(ops, canary, kvc.ViolationLog.create(4), [0, 1], [7], [2], [999], [5])
    assert fields(canary)[2].tolist() == [999, 5, 5774290970851323748, 0]
    assert i64(0x5022670b6356af64) == 5774290970851323748
    assert log.total() == 0


def _golden_ratio_tokens(n):
    return [((i * 0x9E3779B97F4A7C15) % 2**64) & 0x7FFFFFFF for i in range(n)]


def test_100_steps_hashing():
    toks = _golden_ratio_tokens(100)
    assert toks[:3] == [0x0, 0x7f4a7c15, 0x7e94f82a] and toks[-1] == 0x39cdfc1f
    stored, running = hashing.chain(toks, range(100))
    assert stored[:5] == [H0, 0xf0d7fe5eb92c788f, 0x3ddfeafec17352bc, 0xf2a3db1523a7d509,
                          0xfcec3d0431bb9378]
    assert stored[99] == 0x9feaec53590d2150
    assert running == 0xb075589883ee5e18
    assert stored[1] != 0xf0f807b576df665d  # obsolete XOR-chain fixture: not a golden


def test_100_steps_write(ops):
    toks = _golden_ratio_tokens(100)
    canary, log = do_write(ops, canary_with(128), kvc.ViolationLog.create(8), [0, 100], [-1],
                           list(range(1, 101)), toks, list(range(100)))
    f = fields(canary)
    assert [v & (2**64 - 1) for v in f[1:6, 2].tolist()] == [
        H0, 0xf0d7fe5eb92c788f, 0x3ddfeafec17352bc, 0xf2a3db1523a7d509, 0xfcec3d0431bb9378]
    assert f[100, 2] == i64(0x9feaec53590d2150)
    assert hashing.slot_successor_hash(f, 100) == 0xb075589883ee5e18
    assert log.total() == 0 and log.slot_runs()[0] == 100


# ---- §12.4 real-KV fingerprints --------------------------------------------------------------

def test_fold_pins():
    b16 = bytes(range(16))
    assert int.from_bytes(b16[:8], "little") == 0x0706050403020100
    assert hashing.fold_one(b16) == 0x447f1b95028ce131
    assert hashing.real_kv_hash([b16]) == 0xd6d75024dfd6c30c
    assert hashing.to_i64(0xd6d75024dfd6c30c) == -2965813710295743732
    b32 = bytes(range(32))
    assert hashing.real_kv_hash([b32]) == 0xb44181dfe9420039
    assert hashing.real_kv_hash([b32[:16]]) == 0xd6d75024dfd6c30c
    assert hashing.real_kv_hash([b16, b32]) == 0xd07e2a696232a96a
    assert hashing.real_kv_hash([bytes(16)]) == 0
    assert hashing.real_kv_hash([]) == 0
    hand = bytes([0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80,
                  0x81, 0x82, 0x84, 0x88, 0x90, 0xA0, 0xC0, 0xFF])
    assert hashing.real_kv_hash([hand]) == 0x6041580849E6407D
    assert hashing.to_i64(0x6041580849E6407D) == 6935921693750083709
    flipped = bytes([hand[0] ^ 0xFF]) + hand[1:]
    assert hashing.real_kv_hash([flipped]) == 0x10ebb66a5d9445a0
    fills = [bytes([v]) * 16 for v in (0x11, 0x22, 0x33, 0x44)]
    assert [hashing.fold_one(f) for f in fills] == [
        0x17CE308E6A7882EF, 0x5EE98362597073F1, 0x3D68FBA53BE05740, 0x7E2579DC17F74416]
    assert [hashing.real_kv_hash(fills[:k]) for k in (1, 2, 3, 4)] == [
        0xd0d75fb652f288d8, 0x33109c273cc3cc03, 0xc51b4d1fa3f1db5f, 0x69c8723f948c531e]
    assert hashing.real_kv_hash([fills[1], fills[0]]) == 0xac96bffc66438fb4
    f128 = [bytes([0x11]) * 128, bytes([0x22]) * 128]
    assert hashing.real_kv_hash(f128) == 0xfc47700d64361212
    assert hashing.real_kv_hash([f[:16] for f in f128]) == 0x33109c273cc3cc03
    assert hashing.real_kv_hash([bytes(range(1, 17))]) == 0xf8d3fd799f0104b0
    assert hashing.real_kv_hash([bytes(range(101, 117))]) == 0xa8f6c5bf11680335
    # vectorised batch of strips
    batch = np.stack([np.frombuffer(hand, np.uint8), np.frombuffer(flipped, np.uint8)])
    np.testing.assert_array_equal(hashing.real_kv_hash([batch]),
                                  np.array([0x6041580849E6407D, 0x10ebb66a5d9445a0], np.uint64))


def _page4_pattern_source():
    a = np.zeros((2, 64), np.uint8)  # 8 slots, page 4, 16 B per token
    for s in range(8):
        for k in range(16):
            a[s // 4, (s % 4) * 16 + k] = (13 * s + k) & 0xFF
    return a


def _addressing_source():
    return (np.arange(4 * 256) & 0xFF).astype(np.uint8).reshape(4, 256)


def test_source_addressing_hashing():
    s = kvc.RealKvSource(_page4_pattern_source(), 4, 16, 16)
    assert hashing.slot_real_kv_hash([s], 1, ALL) == 0x922a8fe7b5ab263a
    assert hashing.slot_real_kv_hash([s], 5, ALL) == 0xf81d0c5208e7a6de
    a = kvc.RealKvSource(_addressing_source(), 4, 32, 32)
    np.testing.assert_array_equal(hashing.slot_strip(a, 9, ALL), np.arange(544, 576) & 0xFF)
    assert [int(w) for w in hashing.slot_strip_words(a, 9, PARTIAL)] == [0x2726252423222120,
                                                                         0x2f2e2d2c2b2a2928]
    assert hashing.slot_real_kv_hash([a], 9, PARTIAL) == 0x2c75ca2b6b98a11a
    assert hashing.to_i64(0x2c75ca2b6b98a11a) == 3203688997781545242
    assert hashing.slot_real_kv_hash([a], 9, ALL) == 0x9f04b7ee5eee5bd3
    assert hashing.to_i64(0x9f04b7ee5eee5bd3) == -6988258487349388333
    assert hashing.slot_real_kv_hash([a, a], 9, ALL) == 0x2b6144bb0a96983e
    assert hashing.slot_real_kv_hash([a], 9, NONE) == 0
    assert hashing.first_unaddressable_source([a], 15) is None
    assert hashing.first_unaddressable_source([a], 16) == 0
    # bfloat16 / float32 / int32 views of the same bytes give the same strips
    for dt in (jnp.bfloat16, np.float16, np.float32, np.int32):
        v = np.asarray(_addressing_source()).view(dt)
        assert hashing.slot_real_kv_hash([kvc.RealKvSource(v, 4, 32, 32)], 9, ALL) == 0x9f04b7ee5eee5bd3


def _one_slot_write(ops, sources, mode, slot=0, num_slots=8, tag=2, pos=0, tok=7):
    return do_write(ops, canary_with(num_slots), kvc.ViolationLog.create(8), [0, 1], [-1],
                    [slot], [tok], [pos], tag=tag, real_kv_sources=tuple(sources),
                    real_kv_hash_mode=mode)


REALKV_WRITE_CASES = [
    # (name, [(array, page, nbpt, read)], slot, mode, expected u64)
    ("b16_partial", [(np.arange(16, dtype=np.uint8).reshape(1, 16), 1, 16, 16)], 0, PARTIAL,
     0xd6d75024dfd6c30c),
    ("b16_all", [(np.arange(16, dtype=np.uint8).reshape(1, 16), 1, 16, 16)], 0, ALL,
     0xd6d75024dfd6c30c),
    ("b32_all", [(np.arange(32, dtype=np.uint8).reshape(1, 32), 1, 32, 32)], 0, ALL,
     0xb44181dfe9420039),
    ("b32_partial", [(np.arange(32, dtype=np.uint8).reshape(1, 32), 1, 32, 32)], 0, PARTIAL,
     0xd6d75024dfd6c30c),
    ("two_sources", [(np.arange(16, dtype=np.uint8).reshape(1, 16), 1, 16, 16),
                     (np.arange(32, dtype=np.uint8).reshape(1, 32), 1, 32, 32)], 0, ALL,
     0xd07e2a696232a96a),
    ("zeros", [(np.zeros((1, 16), np.uint8), 1, 16, 16)], 0, ALL, 0),
    ("hand_float32", [(np.frombuffer(bytes([1, 2, 4, 8, 16, 32, 64, 128, 0x81, 0x82, 0x84, 0x88,
                                            0x90, 0xA0, 0xC0, 0xFF]), np.float32).reshape(1, 4),
                       1, 16, 16)], 0, PARTIAL, 0x6041580849E6407D),
    ("fills_4", [(np.full((1, 16), v, np.uint8), 1, 16, 16) for v in (0x11, 0x22, 0x33, 0x44)], 0,
     ALL, 0x69c8723f948c531e),
    ("fills_reversed", [(np.full((1, 16), v, np.uint8), 1, 16, 16) for v in (0x22, 0x11)], 0,
     PARTIAL, 0xac96bffc66438fb4),
    ("fills_128_all", [(np.full((1, 128), v, np.uint8), 1, 128, 128) for v in (0x11, 0x22)], 0,
     ALL, 0xfc47700d64361212),
    ("fills_128_partial", [(np.full((1, 128), v, np.uint8), 1, 128, 128) for v in (0x11, 0x22)],
     0, PARTIAL, 0x33109c273cc3cc03),
    ("page4_slot1", [(_page4_pattern_source(), 4, 16, 16)], 1, ALL, 0x922a8fe7b5ab263a),
    ("page4_slot5", [(_page4_pattern_source(), 4, 16, 16)], 5, ALL, 0xf81d0c5208e7a6de),
    ("addr_partial", [(_addressing_source(), 4, 32, 32)], 9, PARTIAL, 0x2c75ca2b6b98a11a),
    ("addr_all", [(_addressing_source(), 4, 32, 32)], 9, ALL, 0x9f04b7ee5eee5bd3),
    ("addr_twice", [(_addressing_source(), 4, 32, 32)] * 2, 9, ALL, 0x2b6144bb0a96983e),
    ("addr_none", [(_addressing_source(), 4, 32, 32)], 9, NONE, 0),
    ("addr_bf16", [(_addressing_source().view(jnp.bfloat16), 4, 32, 32)], 9, ALL,
     0x9f04b7ee5eee5bd3),
    ("addr_3d_f16", [(_addressing_source().view(np.float16).reshape(4, 8, 16), 4, 32, 32)], 9,
     PARTIAL, 0x2c75ca2b6b98a11a),
]


@pytest.mark.parametrize("name,sources,slot,mode,expect", REALKV_WRITE_CASES,
                         ids=[c[0] for c in REALKV_WRITE_CASES])
def test_realkv_write(ops, name, sources, slot, mode, expect):
    if slot == 0:  # verify skips slot 0 (padding): move the strip to slot 1 of a 2-row source
        sources = [(np.concatenate([np.zeros_like(a), a]), ps, nb, rb) for a, ps, nb, rb in sources]
        slot = 1
    srcs = [src(*s) for s in sources]
    canary, log = _one_slot_write(ops, srcs, mode, slot=slot, num_slots=16)
    assert fields(canary)[slot].tolist() == [7, 0, H0S, i64(expect)]
    assert log.total() == 0
    # verify with the same sources is clean; with a flipped byte 0 it reports bit 4 only
    plan = vplan([slot], [0], [-1])
    vlog = ops.verify(canary, log, plan, tag=2, real_kv_sources=tuple(srcs), real_kv_hash_mode=mode)
    assert vlog.total() == 0
    if mode != NONE:
        a = np.array(np.asarray(srcs[0].array))
        b = a.view(np.uint8).reshape(a.shape[0], -1)
        ps, nb = srcs[0].page_size, srcs[0].num_bytes_per_token
        b[slot // ps, (slot % ps) * nb] ^= 0xFF
        flipped = [kvc.RealKvSource(jnp.asarray(a), ps, nb, srcs[0].read_bytes)] + srcs[1:]
        vlog = ops.verify(canary, log, plan, tag=2, real_kv_sources=tuple(flipped),
                          real_kv_hash_mode=mode)
        assert rows(vlog) == [[2, slot, 0, 7, -1, H0S, H0S, 4]]


def test_realkv_addressing_oob_slot16(ops):
    srcs = (src(_addressing_source(), 4, 32, 32),)
    canary, log = _one_slot_write(ops, srcs, ALL, slot=16, num_slots=20, tag=4, tok=9, pos=0)
    assert rows(log) == [[4, 16, 0, 9, 4, 16, 4, 64]]
    assert fields(canary)[16].tolist() == [9, 0, H0S, 0]


# ---- §12.5 WRITE goldens -----------------------------------------------------------------------

def _example_a(ops):
    return do_write(ops, canary_with(8), kvc.ViolationLog.create(16), [0, 3], [-1], [3, -1, 5],
                    [42, 99, 43], [0, 1, 1], tag=0, nvr=1)


def test_write_example_a(ops):
    canary, log = _example_a(ops)
    f = fields(canary)
    assert f[3].tolist() == [42, 0, -2414019407054260458, 0]
    assert rec_hex(canary, 3) == "2a00000000000000 0000000000000000 16b7a1a923ae7fde 0000000000000000"
    assert f[5].tolist() == [43, 1, 1979760175908667849, 0]
    assert rec_hex(canary, 5) == "2b00000000000000 0100000000000000 c94180096485791b 0000000000000000"
    for s in (0, 1, 2, 4, 6, 7):
        assert not np.asarray(canary)[s].any()
    assert log.kernel_runs()[0] == 1 and log.slot_runs()[0] == 2
    assert log.kernel_runs()[1:].tolist() == [0] * 11 and log.slot_runs()[1:].tolist() == [0] * 11
    assert log.total() == 0 and not np.asarray(log.ring).any()
    assert np.asarray(log.write_index).dtype == np.int32


def test_write_example_b(ops):
    canary, log = _example_a(ops)
    assert hashing.mix3(hashing.mix3(H0, 42, 0), 43, 1) == 0x324a24cacfabcb37 == 3623749303659121463
    canary, log = ops.write(canary, log, wplan([0, 1], [5], 1), arr([44]), arr([3]), arr([6]),
                            tag=7, enable_write_input_assert=True,
                            expected_input_tokens=arr([45]), expected_input_positions=arr([3]))
    assert fields(canary)[6].tolist() == [44, 3, 3623749303659121463, 0]
    assert rec_hex(canary, 6) == "2c00000000000000 0300000000000000 37cbabcfca244a32 0000000000000000"
    assert rows(log) == [[7, 6, 3, 44, 45, 3623749303659121463, 3, 8],
                         [7, 6, 3, 44, 44, 3623749303659121463, 2, 16]]
    assert ring_hex(log, 0) == ("0700000000000000 0600000000000000 0300000000000000 2c00000000000000 "
                                "2d00000000000000 37cbabcfca244a32 0300000000000000 0800000000000000")
    assert ring_hex(log, 1).endswith("2c00000000000000 37cbabcfca244a32 0200000000000000 1000000000000000")
    assert log.total() == 2
    kr, sr = log.kernel_runs(), log.slot_runs()
    assert kr[7] == 1 and sr[7] == 1 and kr[0] == 1 and sr[0] == 2
    assert sum(kr) == 2 and sum(sr) == 3


@pytest.mark.parametrize("tok,pos,exp_tok,exp_pos,row", [
    (42, 0, 99, 0, [0, 0, 0, 42, 99, H0S, 0, 8]),
    (42, 7, 42, 0, [0, 0, 7, 42, 42, H0S, 0, 16]),
], ids=["token", "position"])
def test_write_input_assert_slot0(ops, tok, pos, exp_tok, exp_pos, row):
    canary, log = ops.write(canary_with(16), kvc.ViolationLog.create(64), wplan([0, 1], [-1]),
                            arr([tok]), arr([pos]), arr([0]), tag=0, enable_write_input_assert=True,
                            expected_input_tokens=arr([exp_tok]),
                            expected_input_positions=arr([exp_pos]))
    assert rows(log) == [row]
    assert fields(canary)[0].tolist() == [tok, pos, H0S, 0]  # slot 0 is written like any other
    assert log.slot_runs()[0] == 1


@pytest.mark.parametrize("flag", [1, 0])
def test_write_unwritten_seed(ops, flag):
    log = kvc.ViolationLog.create(16).with_chain_position_assert(bool(flag))
    canary, log = do_write(ops, canary_with(8), log, [0, 1], [6], [7], [9], [5])
    assert rows(log) == ([[0, 7, 5, 9, 9, 0, 1, 16]] if flag else [])
    assert fields(canary)[7].tolist() == [9, 5, 0, 0]
    assert np.asarray(log.enable_chain_position_assert).tolist() == [flag]


# ---- §12.6 request order and clamps ------------------------------------------------------------

def test_write_request_order(ops):
    canary, log = do_write(ops, canary_with(16), kvc.ViolationLog.create(16), [0, 2, 3, 4],
                           [-1, 3, -1], [2, 3, 4, 2], [10, 20, 30, 99], [0, 1, 2, 0], nvr=3)
    f = fields(canary)
    assert f[2].tolist() == [99, 0, -2414019407054260458, 0]
    assert f[3].tolist() == [20, 1, -3644186402583311499, 0]
    assert f[4].tolist() == [30, 2, 3177241962306168741, 0]
    assert i64(0x2c17d4bb20b967a5) == 3177241962306168741
    assert log.total() == 0 and log.slot_runs()[0] == 4


def test_write_malformed_offsets(ops):
    canary, log = do_write(ops, canary_with(8), kvc.ViolationLog.create(16), [0, 5, 3, 8],
                           [-1, -1, -1], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5],
                           nvr=3)
    f = fields(canary)
    stored, _ = hashing.chain([1, 2, 3, 4, 5], range(5))
    np.testing.assert_array_equal(f[1:6], [[t, t - 1, i64(h), 0] for t, h in zip(range(1, 6), stored)])
    assert f[6].tolist() == [6, 5, H0S, 0]  # request 2 starts a new chain at slot 6
    assert log.slot_runs()[0] == 6 and log.total() == 0


@pytest.mark.parametrize("nvr", [-3, 0])
def test_write_count_nonpositive(ops, nvr):
    canary, log = do_write(ops, canary_with(8), kvc.ViolationLog.create(4), [0, 2], [-1], [1, 2],
                           [5, 6], [0, 1], nvr=nvr, tag=3)
    assert not np.asarray(canary).any()
    assert log.kernel_runs().tolist() == [0, 0, 0, 1] + [0] * 8
    assert not log.slot_runs().any() and log.total() == 0


def test_write_count_above_capacity(ops):
    canary, log = do_write(ops, canary_with(8), kvc.ViolationLog.create(4), [0, 2], [-1], [1, 2],
                           [5, 6], [0, 1], nvr=99)
    f = fields(canary)
    assert f[1].tolist() == [5, 0, H0S, 0] and f[2, 0] == 6
    assert log.slot_runs()[0] == 2 and log.kernel_runs()[0] == 1


# ---- §12.7 VERIFY goldens ----------------------------------------------------------------------

def test_verify_row_layout(ops):
    canary = canary_with(16, {5: (33, 0, H0)})
    log = ops.verify(canary, kvc.ViolationLog.create(4), vplan([5], [99], [-1]), tag=0)
    assert rows(log) == [[0, 5, 0, 33, -1, -2414019407054260458, -2414019407054260458, 2]]
    assert ring_hex(log, 0) == (
        "0000000000000000 0500000000000000 0000000000000000 2100000000000000 "
        "ffffffffffffffff 16b7a1a923ae7fde 16b7a1a923ae7fde 0200000000000000")
    assert not np.asarray(log.ring)[1:].any()
    assert log.kernel_runs()[0] == 1 and log.slot_runs()[0] == 1


def _clean_chain(ops, tokens, first_slot=1, num_slots=16):
    n = len(tokens)
    canary, _ = do_write(ops, canary_with(num_slots), kvc.ViolationLog.create(4), [0, n], [-1],
                         list(range(first_slot, first_slot + n)), tokens, list(range(n)))
    return np.array(np.asarray(canary))


def _set_record(c, s, rec):
    c[s, :32] = np.array([i64(v) for v in rec], "<i8").view(np.uint8)
    return c


def test_verify_broken_predecessor(ops):
    c = _set_record(_clean_chain(ops, [100, 200, 300]), 2, (999, 1, 0, 0))
    log = ops.verify(jnp.asarray(c), kvc.ViolationLog.create(8), vplan([3], [2], [2]), tag=0)
    assert rows(log) == [[0, 3, 2, 300, -1, 526787347300133704, -5324254265877648933, 1]]
    assert hashing.to_i64(hashing.mix3(0, 999, 1)) == -5324254265877648933


def test_verify_corrupted_prev_hash(ops):
    c = _clean_chain(ops, [10, 20])
    c[2, 16:24] = np.array([0x1234567812345678], "<i8").view(np.uint8)
    log = ops.verify(jnp.asarray(c), kvc.ViolationLog.create(8), vplan([2], [1], [1]), tag=0)
    assert rows(log) == [[0, 2, 1, 20, -1, 1311768465173141112, -3644186402583311499, 1]]


@pytest.mark.parametrize("tag", [0, 5, 11])
def test_verify_head_wrong_content(ops, tag):
    canary = canary_with(20, {16: (7, 99, 0)})
    log = ops.verify(canary, kvc.ViolationLog.create(8), vplan([16], [0], [-1]), tag=tag)
    assert rows(log) == [[tag, 16, 99, 7, -1, 0, -2414019407054260458, 3]]
    assert log.kernel_runs()[tag] == 1 and log.slot_runs()[tag] == 1


TOKEN_CHECK = [
    (-1, True, 10, []),
    (42, True, 10, []),
    (99, True, 10, [[0, 1, 10, 42, 99, H0S, H0S, 32]]),
    (99, False, 10, []),
    (2**63 - 1, False, 10, []),
    (123, True, 99, [[0, 1, 10, 42, 123, H0S, H0S, 34]]),
]


@pytest.mark.parametrize("tok,check,pos,expect", TOKEN_CHECK,
                         ids=["minus1", "match", "mismatch", "off", "off_int64max", "tok_and_pos"])
def test_verify_token_check(ops, tok, check, pos, expect):
    wide = tok > 2**31 - 1
    ctx = jax.enable_x64(True) if wide else contextlib.nullcontext()
    with ctx:
        canary = canary_with(4, {1: (42, 10, H0)})
        plan = vplan([1], [pos], [-1], tokens=[tok], dtype=np.int64 if wide else np.int32)
        log = ops.verify(canary, kvc.ViolationLog.create(8), plan, tag=0,
                         check_verify_expected_token=check)
        assert rows(log) == expect


def test_verify_multi_row_order(ops):
    c = _clean_chain(ops, [11, 22, 33, 44, 55])
    c[3, 8:16] = np.array([101], "<i8").view(np.uint8)
    log = kvc.ViolationLog.create(16)
    log = ops.verify(jnp.asarray(c), log, vplan([1, 2, 3, 4, 5], [0, 1, 2, 3, 4], [-1, 1, 2, 3, 4]),
                     tag=2)
    assert rows(log) == [[2, 3, 101, 33, -1, 6305883652896473243, 6305883652896473243, 2],
                         [2, 4, 3, 44, -1, -775092142951646884, -5030120566886335397, 1]]
    assert log.slot_runs()[2] == 5 and log.kernel_runs()[2] == 1


def test_verify_overflow(ops):
    log = ops.verify(canary_with(16), kvc.ViolationLog.create(4),
                     vplan(list(range(1, 11)), [99] * 10, [-1] * 10), tag=0)
    assert log.total() == 10
    r = rows(log)
    assert len(r) == 4 and [x[1] for x in r] == [1, 2, 3, 4]
    assert r[0] == [0, 1, 0, 0, -1, 0, -2414019407054260458, 3]
    assert all(x[7] == 3 for x in r)


def _garbage_log(cap=4):
    rng = np.random.default_rng(7)
    return kvc.ViolationLog(
        ring=jnp.asarray(rng.integers(0, 256, (cap, 64), dtype=np.uint8)),
        write_index=arr([2]),
        kernel_run_counters=jnp.asarray(rng.integers(0, 256, (12, 8), dtype=np.uint8)),
        slot_run_counters=jnp.asarray(rng.integers(0, 256, (12, 8), dtype=np.uint8)),
        enable_chain_position_assert=arr([1]))


def test_verify_disabled_plan(ops):
    log0 = _garbage_log()
    log = ops.verify(canary_with(16), log0, vplan([1, 2], [99, 99], [-1, -1], enable=0), tag=3)
    np.testing.assert_array_equal(np.asarray(log.ring), np.asarray(log0.ring))
    assert log.total() == 2
    np.testing.assert_array_equal(log.slot_runs(), log0.slot_runs())
    kr = log0.kernel_runs().copy()
    kr[3] += 1
    np.testing.assert_array_equal(log.kernel_runs(), kr)


def test_verify_empty_plan(ops):
    log0 = _garbage_log()
    log = ops.verify(canary_with(16), log0, vplan([1, 2], [99, 99], [-1, -1], num_valid=0), tag=3)
    np.testing.assert_array_equal(np.asarray(log.ring), np.asarray(log0.ring))
    np.testing.assert_array_equal(log.slot_runs(), log0.slot_runs())
    kr = log0.kernel_runs().copy()
    kr[3] += 1
    np.testing.assert_array_equal(log.kernel_runs(), kr)
    assert log.total() == 2


def test_verify_slot0_garbage(ops):
    c = np.random.default_rng(3).integers(0, 256, (4, 32), dtype=np.uint8)
    log = ops.verify(jnp.asarray(c), kvc.ViolationLog.create(4), vplan([0], [99], [-1]), tag=0)
    assert log.total() == 0 and log.slot_runs()[0] == 1 and log.kernel_runs()[0] == 1


# ---- §12.8 PLAN goldens ------------------------------------------------------------------------

def table(R=4, L=16, mult=16):
    return arr(np.arange(R)[:, None] * mult + np.arange(L)[None, :])


def do_plan(ops, rps, P, E, *, rt=None, Vc=64, Wc=4, **kw):
    return ops.plan(arr(rps), arr(P), arr(E), table() if rt is None else rt,
                    verify_capacity=Vc, write_req_capacity=Wc, **kw)


def check_plan(vp, wp, *, slots=None, toks=None, poss=None, prevs=None, num_valid=None, enable=1,
               offsets=None, seeds=None, nvr=None, Vc=64):
    """Compare the whole int32 output arrays (tails are zero)."""
    def full(vals):
        out = np.zeros(Vc, np.int32)
        out[:len(vals)] = vals
        return out
    for name, a in (("slot_indices", vp.slot_indices), ("expected_tokens", vp.expected_tokens),
                    ("expected_positions", vp.expected_positions),
                    ("prev_slot_indices", vp.prev_slot_indices), ("num_valid", vp.num_valid),
                    ("enable", vp.enable), ("offsets", wp.offsets),
                    ("seed_slot_indices", wp.seed_slot_indices), ("num_valid_reqs", wp.num_valid_reqs)):
        assert np.asarray(a).dtype == np.int32, name
    n = len(slots) if slots is not None else None
    if slots is not None:
        np.testing.assert_array_equal(np.asarray(vp.slot_indices), full(slots))
        np.testing.assert_array_equal(np.asarray(vp.expected_tokens), full(toks if toks is not None else [-1] * n))
        np.testing.assert_array_equal(np.asarray(vp.expected_positions), full(poss))
        np.testing.assert_array_equal(np.asarray(vp.prev_slot_indices), full(prevs))
    if num_valid is not None:
        assert np.asarray(vp.num_valid).tolist() == [num_valid]
    assert np.asarray(vp.enable).tolist() == [enable]
    if offsets is not None:
        assert np.asarray(wp.offsets).tolist() == offsets
    if seeds is not None:
        assert np.asarray(wp.seed_slot_indices).tolist() == seeds
    if nvr is not None:
        assert np.asarray(wp.num_valid_reqs).tolist() == [nvr]


def test_plan_first_vector(ops):
    vp, wp = do_plan(ops, [1, 2, 3], [0, 4, 7], [3, 1, 1])
    check_plan(vp, wp, slots=list(range(32, 36)) + list(range(48, 55)),
               poss=list(range(4)) + list(range(7)),
               prevs=[-1, 32, 33, 34, -1, 48, 49, 50, 51, 52, 53], num_valid=11,
               offsets=[0, 3, 4, 5, 0], seeds=[-1, 35, 54, 0], nvr=3)


def test_plan_no_prefix(ops):
    vp, wp = do_plan(ops, [3], [0], [5])
    check_plan(vp, wp, slots=[], poss=[], prevs=[], num_valid=0, offsets=[0, 5, 0, 0, 0],
               seeds=[-1, 0, 0, 0], nvr=1)


def test_plan_decode_one(ops):
    vp, wp = do_plan(ops, [2], [7], [1])
    check_plan(vp, wp, slots=list(range(32, 39)), poss=list(range(7)),
               prevs=[-1] + list(range(32, 38)), num_valid=7, offsets=[0, 1, 0, 0, 0],
               seeds=[38, 0, 0, 0], nvr=1)


def test_plan_prefill_chunk(ops):
    vp, wp = do_plan(ops, [1, 2, 3], [0, 4, 10], [8, 1, 1])
    check_plan(vp, wp, slots=list(range(32, 36)) + list(range(48, 58)),
               poss=list(range(4)) + list(range(10)),
               prevs=[-1, 32, 33, 34, -1] + list(range(48, 57)), num_valid=14,
               offsets=[0, 8, 9, 10, 0], seeds=[-1, 35, 57, 0], nvr=3)


@pytest.mark.parametrize("garbage", [99, 99999])
def test_plan_padding_row(ops, garbage):
    vp, wp = do_plan(ops, [1, 0, 2], [5, garbage, 3], [1, garbage, 1])
    check_plan(vp, wp, slots=[16, 17, 18, 19, 20, 32, 33, 34], poss=[0, 1, 2, 3, 4, 0, 1, 2],
               prevs=[-1, 16, 17, 18, 19, -1, 32, 33], num_valid=8, offsets=[0, 1, 1, 2, 0],
               seeds=[20, -1, 34, 0], nvr=3)


def test_plan_trailing_padding_rows(ops):
    vp, wp = do_plan(ops, [1, 2, 0, 0], [3, 5, 99, 99], [1, 1, 99, 99])
    check_plan(vp, wp, slots=[16, 17, 18, 32, 33, 34, 35, 36], poss=[0, 1, 2, 0, 1, 2, 3, 4],
               prevs=[-1, 16, 17, -1, 32, 33, 34, 35], num_valid=8, offsets=[0, 1, 2, 2, 2],
               seeds=[18, 36, -1, -1], nvr=4)


def test_plan_no_extend(ops):
    vp, wp = do_plan(ops, [1, 2], [4, 6], [0, 0])
    check_plan(vp, wp, slots=[16, 17, 18, 19, 32, 33, 34, 35, 36, 37],
               poss=[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], prevs=[-1, 16, 17, 18, -1, 32, 33, 34, 35, 36],
               num_valid=10, offsets=[0, 0, 0, 0, 0], seeds=[-1, -1, 0, 0], nvr=2)


def test_plan_mixed(ops):
    vp, wp = do_plan(ops, [1, 2, 3], [0, 4, 8], [5, 1, 1])
    check_plan(vp, wp, slots=[32, 33, 34, 35] + list(range(48, 56)),
               poss=[0, 1, 2, 3] + list(range(8)), prevs=[-1, 32, 33, 34, -1] + list(range(48, 55)),
               num_valid=12, offsets=[0, 5, 6, 7, 0], seeds=[-1, 35, 55, 0], nvr=3)


def test_plan_under_by_one(ops):
    vp, wp = do_plan(ops, [1], [3], [1], Vc=2)
    check_plan(vp, wp, slots=[], poss=[], prevs=[], num_valid=2, enable=0,
               offsets=[0, 1, 0, 0, 0], seeds=[18, 0, 0, 0], nvr=1, Vc=2)


def test_plan_tight(ops):
    vp, wp = do_plan(ops, [1], [3], [1], Vc=3)
    check_plan(vp, wp, slots=[16, 17, 18], poss=[0, 1, 2], prevs=[-1, 16, 17], num_valid=3,
               enable=1, offsets=[0, 1, 0, 0, 0], seeds=[18, 0, 0, 0], nvr=1, Vc=3)


def test_plan_swa_window(ops):
    vp, wp = do_plan(ops, [1], [200], [1], rt=table(2, 256, 256), Vc=256, swa_window_size=128,
                     full_to_swa_index_mapping=arr(np.arange(512)))
    check_plan(vp, wp, slots=list(range(328, 456)), poss=list(range(72, 200)),
               prevs=list(range(327, 455)), num_valid=128, offsets=[0, 1, 0, 0, 0],
               seeds=[455, 0, 0, 0], nvr=1, Vc=256)
    assert int(np.asarray(vp.prev_slot_indices)[0]) == 327


def test_plan_lut_shift(ops):
    vp, wp = do_plan(ops, [1], [3], [1], swa_window_size=16,
                     full_to_swa_index_mapping=arr(np.arange(65) + 100))
    check_plan(vp, wp, slots=[116, 117, 118], poss=[0, 1, 2], prevs=[-1, 116, 117], num_valid=3,
               offsets=[0, 1, 0, 0, 0], seeds=[118, 0, 0, 0], nvr=1)


def test_plan_swa_sum(ops):
    vp, wp = do_plan(ops, [1, 2, 3, 1], [50, 128, 200, 1024], [1, 1, 1, 1],
                     rt=table(4, 2048, 2048), Vc=1024, swa_window_size=128,
                     full_to_swa_index_mapping=arr(np.arange(4 * 2048)))
    assert np.asarray(vp.num_valid).tolist() == [434] and np.asarray(vp.enable).tolist() == [1]
    slots = (list(range(2048, 2048 + 50)) + list(range(4096, 4096 + 128))
             + list(range(6144 + 72, 6144 + 200)) + list(range(2048 + 896, 2048 + 1024)))
    poss = list(range(50)) + list(range(128)) + list(range(72, 200)) + list(range(896, 1024))
    prevs = ([-1] + list(range(2048, 2097)) + [-1] + list(range(4096, 4223))
             + list(range(6144 + 71, 6144 + 199)) + list(range(2048 + 895, 2048 + 1023)))
    check_plan(vp, wp, slots=slots, poss=poss, prevs=prevs, num_valid=434,
               offsets=[0, 1, 2, 3, 4], seeds=[2097, 4223, 6343, 3071], nvr=4, Vc=1024)


def test_plan_prefix_past_row(ops):
    vp, wp = do_plan(ops, [1], [20], [1])
    check_plan(vp, wp, slots=list(range(16, 32)) + [-1] * 4, poss=list(range(20)),
               prevs=[-1] + list(range(16, 31)) + [31, -1, -1, -1], num_valid=20,
               offsets=[0, 1, 0, 0, 0], seeds=[-1, 0, 0, 0], nvr=1)
    # verify of that plan on a clean chain in slots 16..31: exactly 4 VERIFY_SLOT rows
    toks = list(range(500, 516))
    canary, _ = do_write(ops, canary_with(40), kvc.ViolationLog.create(4), [0, 16], [-1],
                         list(range(16, 32)), toks, list(range(16)))
    log = ops.verify(canary, kvc.ViolationLog.create(16), vp, tag=1)
    assert rows(log) == [[1, -1, p, -1, -1, 3, 40, 64] for p in (16, 17, 18, 19)]
    assert log.slot_runs()[1] == 20


def test_plan_rp_past_table(ops):
    vp, wp = do_plan(ops, [5], [2], [1])
    check_plan(vp, wp, slots=[-1, -1], poss=[0, 1], prevs=[-1, -1], num_valid=2,
               offsets=[0, 1, 0, 0, 0], seeds=[-1, 0, 0, 0], nvr=1)


def pool(R=4, C=16):
    return arr(np.arange(R)[:, None] * 1000 + np.arange(C)[None, :])


POOL_CASES = [
    # (name, rps, P, valid, offset, pool shape, swa W, expected tokens)
    ("valid16_off0", [1, 2], [3, 5], [16, 16], 0, (4, 16), 0,
     [1000, 1001, 1002, 2000, 2001, 2002, 2003, 2004]),
    ("valid16_off1", [1, 2], [3, 5], [16, 16], 1, (4, 16), 0,
     [1001, 1002, 1003, 2001, 2002, 2003, 2004, 2005]),
    ("valid2", [1], [3], [2], 0, (4, 16), 0, [1000, 1001, -1]),
    ("valid3", [1], [3], [3], 0, (4, 16), 0, [1000, 1001, 1002]),
    ("valid0", [1], [3], [0], 0, (4, 16), 0, [-1, -1, -1]),
    ("valid2_off1", [1], [3], [2], 1, (4, 16), 0, [1001, -1, -1]),
    ("valid_2_4", [1, 2], [3, 3], [2, 4], 0, (4, 16), 0, [1000, 1001, -1, 2000, 2001, 2002]),
    ("swa3", [1], [5], [4], 0, (4, 16), 3, [1002, 1003, -1]),
    ("width4", [1], [6], [16], 0, (4, 4), 0, [1000, 1001, 1002, 1003, -1, -1]),
    ("width4_off1", [1], [4], [16], 1, (4, 4), 0, [1001, 1002, 1003, -1]),
]


@pytest.mark.parametrize("name,rps,P,valid,off,shape,W,expect", POOL_CASES,
                         ids=[c[0] for c in POOL_CASES])
def test_plan_token_pool(ops, name, rps, P, valid, off, shape, W, expect):
    kw = {}
    if W:
        kw = dict(swa_window_size=W, full_to_swa_index_mapping=arr(np.arange(64)))
    vp, wp = do_plan(ops, rps, P, [1] * len(rps), req_to_verify_expected_tokens=pool(*shape),
                     req_to_verify_expected_tokens_valid_lens=arr(valid),
                     kv_token_id_vs_position_offset=off, **kw)
    n = len(expect)
    assert np.asarray(vp.num_valid).tolist() == [n]
    tok = np.asarray(vp.expected_tokens)
    assert tok[:n].tolist() == expect and not tok[n:].any()
    if W:
        assert np.asarray(vp.expected_positions)[:n].tolist() == [2, 3, 4]


def test_plan_no_pool_tokens(ops):
    vp, _ = do_plan(ops, [1, 2], [3, 5], [1, 1])
    tok = np.asarray(vp.expected_tokens)
    assert tok[:8].tolist() == [-1] * 8 and not tok[8:].any()


# ---- §12.9 INDEX_OUT_OF_RANGE goldens ----------------------------------------------------------

def _x1(ops):
    return do_write(ops, canary_with(8), kvc.ViolationLog.create(16), [0, 3], [-1], [3, 9, 5],
                    [42, 43, 44], [0, 1, 2], tag=2)


def test_x1_write_slot_oob(ops):
    canary, log = _x1(ops)
    assert rows(log) == [[2, 9, 1, 43, 9, 1, 8, 64]]
    f = fields(canary)
    assert f[3].tolist() == [42, 0, -2414019407054260458, 0]
    assert f[5].tolist() == [44, 2, 3623749303659121463, 0]
    assert log.slot_runs()[2] == 3 and log.kernel_runs()[2] == 1


def test_x2_write_seed_oob(ops):
    canary, log = _x1(ops)
    canary, log = do_write(ops, canary, log, [0, 1], [12], [4], [7], [3], tag=2)
    assert rows(log) == [[2, 9, 1, 43, 9, 1, 8, 64], [2, 12, -1, -1, 12, 2, 8, 64]]
    assert fields(canary)[4].tolist() == [7, 3, -2414019407054260458, 0]
    assert log.slot_runs()[2] == 4 and log.kernel_runs()[2] == 2


def test_x3_verify_oob(ops):
    canary, log = _x1(ops)
    canary, log = do_write(ops, canary, log, [0, 1], [12], [4], [7], [3], tag=2)
    log = ops.verify(canary, log, vplan([3, -5, 8, 0], [0, 7, 1, 0], [20, -1, 3, 0], num_valid=4),
                     tag=8)
    assert rows(log)[2:] == [[8, 3, 0, -1, 20, 4, 8, 64],
                             [8, -5, 7, -1, -5, 3, 8, 64],
                             [8, 8, 1, -1, 8, 3, 8, 64]]
    assert log.slot_runs()[8] == 4 and log.kernel_runs()[8] == 1 and log.total() == 5


def test_x4_realkv_oob(ops):
    a = ((7 * np.arange(128)) & 0xFF).astype(np.uint8).reshape(2, 64)
    srcs = (src(a, 4, 16, 16),)
    canary, log = do_write(ops, canary_with(16), kvc.ViolationLog.create(16), [0, 2], [-1], [7, 9],
                           [5, 6], [0, 1], tag=3, real_kv_sources=srcs, real_kv_hash_mode=ALL)
    assert rows(log) == [[3, 9, 1, 6, 2, 16, 2, 64]]
    f = fields(canary)
    assert f[7].tolist() == [5, 0, H0S, i64(0x1427447e7e6f4a84)]
    assert f[9, 3] == 0 and f[9, :2].tolist() == [6, 1]
    log = ops.verify(canary, log, vplan([7, 9], [0, 1], [-1, 7]), tag=3, real_kv_sources=srcs,
                     real_kv_hash_mode=ALL)
    assert rows(log) == [[3, 9, 1, 6, 2, 16, 2, 64], [3, 9, 1, -1, 2, 16, 2, 64]]
    assert log.slot_runs()[3] == 4 and log.kernel_runs()[3] == 2


# ---- §9.5 scatter (worked by hand from the spec) -----------------------------------------------

def test_scatter_basic(ops):
    p = ops.scatter_req_token_ids(arr(np.full((4, 4), -7)), arr([10, 11, 12, 20, 21, 22, 23, 24, 30]),
                                  arr([0, 3, 8, 9, 9]), arr([1, 2, 1, 0]))
    # row 1: first [10,11,12], then r=2 rewrites cell 0 with 30; row 2 truncated to 4 ids
    assert np.asarray(p).tolist() == [[-7, -7, -7, -7], [30, 11, 12, -7], [20, 21, 22, 23],
                                      [-7, -7, -7, -7]]
    assert np.asarray(p).dtype == np.int32
