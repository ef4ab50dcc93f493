"""Hashing golden vectors (docs/format.md §12.1-§12.4): splitmix64, mix3, chains and real-KV
fingerprints, checked on ``jax_kvcanary.hashing`` (the host implementation the reference uses)."""

import random

import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcanary as kvc
from jax_kvcanary import hashing
from jax_kvcanary.consts import RealKvHashMode
from tests.support.goldens import H0, i64, CHAINS, _golden_ratio_tokens, _page4_pattern_source, _addressing_source

NONE = RealKvHashMode.NONE
PARTIAL = RealKvHashMode.PARTIAL
ALL = RealKvHashMode.ALL


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


def test_100_steps_hashing():
    toks = _golden_ratio_tokens(100)
    assert toks[:3] == [0x0, 0x7f4a7c15, 0x7e94f82a] and toks[-1] == 0x39cdfc1f
    stored, running = hashing.chain(toks, range(100))
    assert stored[:5] == [H0, 0xf0d7fe5eb92c788f, 0x3ddfeafec17352bc, 0xf2a3db1523a7d509,
                          0xfcec3d0431bb9378]
    assert stored[99] == 0x9feaec53590d2150
    assert running == 0xb075589883ee5e18
    assert stored[1] != 0xf0f807b576df665d  # obsolete XOR-chain fixture: not a golden


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


def test_source_addressing_offset_hashing():
    """§12.4's offset example: the strip starts offset_bytes into the slot."""
    a = kvc.RealKvSource(_addressing_source(), 4, 64, 32, offset_bytes=32)
    # slot 9 -> row 2, column 1 * 64 + 32 = 96, flat offset 608
    np.testing.assert_array_equal(hashing.slot_strip(a, 9, ALL), np.arange(608, 640) & 0xFF)
    assert [int(w) for w in hashing.slot_strip_words(a, 9, PARTIAL)] == [0x6766656463626160,
                                                                         0x6f6e6d6c6b6a6968]
    assert hashing.slot_real_kv_hash([a], 9, PARTIAL) == 0x344bdaf9666261f8
    assert hashing.to_i64(0x344bdaf9666261f8) == 3768346277924987384
    assert hashing.slot_real_kv_hash([a], 9, ALL) == 0x40612c9889df0761
    assert hashing.to_i64(0x40612c9889df0761) == 4639038124828067681
    assert hashing.slot_real_kv_hash([a, kvc.RealKvSource(_addressing_source(), 4, 64, 32)], 9, ALL) == \
        0x7d91c4c56900e4c1
    assert hashing.slot_real_kv_hash([a], 9, NONE) == 0
    assert hashing.first_unaddressable_source([a], 15) is None       # the offset moves no row
    assert hashing.first_unaddressable_source([a], 16) == 0
    # page_size 1, the largest offset (num_bytes_per_token - read_bytes): slot 2 reads flat 736..767
    p1 = kvc.RealKvSource(_addressing_source(), 1, 256, 32, offset_bytes=224)
    np.testing.assert_array_equal(hashing.slot_strip(p1, 2, ALL), np.arange(736, 768) & 0xFF)
    assert hashing.slot_real_kv_hash([p1], 2, PARTIAL) == 0xbb4593d6cc0f0e28
    assert hashing.to_i64(0xbb4593d6cc0f0e28) == -4952389664468169176
    assert hashing.slot_real_kv_hash([p1], 2, ALL) == 0x3555c04ab5eeab7e
    assert hashing.to_i64(0x3555c04ab5eeab7e) == 3843189284143016830
    # the same bytes as a sliced copy (what a caller does without offset_bytes)
    sliced = np.ascontiguousarray(_addressing_source().reshape(4, 4, 64)[:, :, 32:64]).reshape(4, 128)
    s = kvc.RealKvSource(sliced, 4, 32, 32)
    for mode in (PARTIAL, ALL):
        assert hashing.slot_real_kv_hash([s], 9, mode) == hashing.slot_real_kv_hash([a], 9, mode)
