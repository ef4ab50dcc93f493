"""WRITE golden vectors (docs/format.md §12.3-§12.6): chains and real-KV fingerprints as stored by a
write, the §12.5 examples, request order and clamps; through the ``ops`` fixture (reference, ffi, xla)."""

import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcanary as kvc
from jax_kvcanary import hashing
from jax_kvcanary.consts import RealKvHashMode
from tests.support.goldens import H0, H0S, i64, arr, canary_with, wplan, vplan, fields, rec_hex, ring_hex, rows, do_write, src, CHAINS, _golden_ratio_tokens, _page4_pattern_source, _addressing_source

NONE = RealKvHashMode.NONE
PARTIAL = RealKvHashMode.PARTIAL
ALL = RealKvHashMode.ALL


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
    # offset_bytes (§12.4): the strip starts inside the slot
    ("addr_offset_partial", [(_addressing_source(), 4, 64, 32, 32)], 9, PARTIAL, 0x344bdaf9666261f8),
    ("addr_offset_all", [(_addressing_source(), 4, 64, 32, 32)], 9, ALL, 0x40612c9889df0761),
    ("addr_offset_bf16_3d", [(_addressing_source().view(jnp.bfloat16).reshape(4, 2, 64), 4, 64, 32, 32)],
     9, ALL, 0x40612c9889df0761),
    ("addr_p1_offset_max_partial", [(_addressing_source(), 1, 256, 32, 224)], 2, PARTIAL, 0xbb4593d6cc0f0e28),
    ("addr_p1_offset_max_all", [(_addressing_source(), 1, 256, 32, 224)], 2, ALL, 0x3555c04ab5eeab7e),
    ("addr_offset_then_plain", [(_addressing_source(), 4, 64, 32, 32), (_addressing_source(), 4, 64, 32)], 9,
     ALL, 0x7d91c4c56900e4c1),
]


@pytest.mark.parametrize("name,sources,slot,mode,expect", REALKV_WRITE_CASES,
                         ids=[c[0] for c in REALKV_WRITE_CASES])
def test_realkv_write(ops, name, sources, slot, mode, expect):
    if slot == 0:  # verify skips slot 0 (padding): move the strip to slot 1 of a 2-row source
        sources = [(np.concatenate([np.zeros_like(a), a]), *geometry) for a, *geometry in sources]
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
        s0 = srcs[0]
        ps, nb, off = s0.page_size, s0.num_bytes_per_token, s0.offset_bytes

        def flip(col):
            a = np.array(np.asarray(s0.array))
            a.view(np.uint8).reshape(a.shape[0], -1)[slot // ps, (slot % ps) * nb + col] ^= 0xFF
            flipped = [kvc.RealKvSource(jnp.asarray(a), ps, nb, s0.read_bytes, off)] + srcs[1:]
            return rows(ops.verify(canary, log, plan, tag=2, real_kv_sources=tuple(flipped),
                                   real_kv_hash_mode=mode))

        assert flip(off) == [[2, slot, 0, 7, -1, H0S, H0S, 4]]     # the strip's first byte
        if off:
            assert flip(off - 1) == []                              # a byte before the strip


def test_realkv_addressing_oob_slot16(ops):
    for srcs in ((src(_addressing_source(), 4, 32, 32),), (src(_addressing_source(), 4, 64, 32, 32),)):
        canary, log = _one_slot_write(ops, srcs, ALL, slot=16, num_slots=20, tag=4, tok=9, pos=0)
        assert rows(log) == [[4, 16, 0, 9, 4, 16, 4, 64]]
        assert fields(canary)[16].tolist() == [9, 0, H0S, 0]


def _sliced_copy(a, page_size, nbpt, lo, hi):
    """The copy a caller makes without offset_bytes: bytes [lo, hi) of every slot, ``uint8[rows,
    page_size * (hi - lo)]``."""
    b = np.ascontiguousarray(a).view(np.uint8).reshape(a.shape[0], -1)[:, :page_size * nbpt]
    return np.ascontiguousarray(b.reshape(a.shape[0], page_size, nbpt)[:, :, lo:hi]).reshape(a.shape[0], -1)


# (page_size, num_bytes_per_token, [(read_bytes, offset_bytes) per source], dtype, row hole bytes)
OFFSET_EQUIV = [
    (1, 64, [(32, 32)], np.uint8, 0),
    (1, 256, [(16, 128), (64, 192), (32, 0)], "bfloat16", 16),
    (4, 48, [(32, 16), (16, 32)], np.float32, 0),
    (2, 64, [(16, 48), (48, 16), (64, 0), (32, 16)], np.int32, 32),
]


@pytest.mark.parametrize("mode", [PARTIAL, ALL], ids=["partial", "all"])
@pytest.mark.parametrize("ps,nbpt,geos,dtype,hole", OFFSET_EQUIV,
                         ids=[f"p{c[0]}n{c[1]}x{len(c[2])}" for c in OFFSET_EQUIV])
def test_offset_equals_sliced_copy(ops, mode, ps, nbpt, geos, dtype, hole):
    """``RealKvSource(a, ps, n, r, offset_bytes=o)`` fingerprints what ``RealKvSource(a_sliced, ps, w,
    w)`` does, ``a_sliced`` the copy of bytes ``[o, o + w)`` of every slot (``w = r`` for ALL, 16 for
    PARTIAL); slots past the rows give the same out-of-range rows."""
    rng = np.random.default_rng([7, ps, nbpt, len(geos), int(mode)])
    S = 40
    rows_ = 32 // ps                         # slots 32.. are past every source's rows
    arrays = [rng.integers(0, 256, (rows_, ps * nbpt + hole), dtype=np.uint8) for _ in geos]
    if dtype == "bfloat16":
        arrays = [a.view(jnp.bfloat16).reshape(rows_, 2, -1) for a in arrays]
    else:
        arrays = [a.view(dtype) for a in arrays]
    with_offset = tuple(src(a, ps, nbpt, r, o) for a, (r, o) in zip(arrays, geos))
    sliced = []
    for a, (r, o) in zip(arrays, geos):
        w = 16 if mode == PARTIAL else r
        sliced.append(src(_sliced_copy(a, ps, nbpt, o, o + w), ps, w, w))
    slots = list(range(1, S - 1))
    positions = list(range(len(slots)))

    def run(srcs):
        return do_write(ops, canary_with(S), kvc.ViolationLog.create(64), [0, len(slots)], [-1], slots,
                        slots, positions, tag=5, real_kv_sources=srcs, real_kv_hash_mode=mode)

    canary, log = run(with_offset)
    canary_s, log_s = run(tuple(sliced))
    np.testing.assert_array_equal(np.asarray(canary), np.asarray(canary_s))
    assert rows(log) == rows(log_s) and len(rows(log)) == S - 1 - 32
    got = fields(canary)[1:32, 3]
    expect = hashing.slot_real_kv_hash(tuple(sliced), np.arange(1, 32), mode)
    np.testing.assert_array_equal(got, hashing.to_i64(expect))
    assert (got != 0).all()
    vlog = ops.verify(canary, kvc.ViolationLog.create(64), vplan(slots, positions, [0] * len(slots)),
                      tag=5, real_kv_sources=with_offset, real_kv_hash_mode=mode)
    assert [r[5] for r in rows(vlog)] == [16] * (S - 1 - 32)    # only the out-of-range rows


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
