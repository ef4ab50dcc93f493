"""PLAN golden vectors (docs/format.md §12.8), through the ``ops`` fixture (reference, ffi, xla)."""

import jax
import numpy as np
import pytest

import jax_kvcanary as kvc
from tests.support.goldens import arr, canary_with, rows, do_write


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


def evicted_case(ops, report):
    """Row 1 (P 6, window [2, 6)): the LUT maps full slot 19 (position 3) to 0, and slot 17
    (position 1, the first entry's prev, outside the window) too; row 2 (P 3): its table holds the
    padding slot 0 at position 1, which stays 0 (skipped) either way."""
    rt = np.arange(4)[:, None] * 16 + np.arange(16)[None, :]
    rt[2, 1] = 0
    lut = np.arange(65) + 100
    lut[[0, 17, 19]] = 0
    return do_plan(ops, [1, 2], [6, 3], [1, 1], rt=arr(rt), swa_window_size=4,
                   full_to_swa_index_mapping=arr(lut), report_evicted_in_window=report)


@pytest.mark.parametrize("report", [False, True])
def test_plan_evicted_in_window(ops, report):
    vp, wp = evicted_case(ops, report)
    check_plan(vp, wp, slots=[118, -1 if report else 0, 120, 121, 132, 0, 134],
               poss=[2, 3, 4, 5, 0, 1, 2], prevs=[0, 118, 0, 120, -1, 132, 0], num_valid=7,
               offsets=[0, 1, 2, 0, 0], seeds=[121, 134, 0, 0], nvr=2)


def test_plan_evicted_in_window_is_reported_by_verify(ops):
    vp, _ = evicted_case(ops, True)
    log = ops.verify(canary_with(140), kvc.ViolationLog.create(16), vp, tag=8)
    assert [r for r in rows(log) if r[7] == 64] == [[8, -1, 3, -1, -1, 3, 140, 64]]


def test_plan_evicted_in_window_needs_a_lut():
    with pytest.raises(ValueError, match="report_evicted_in_window=True requires full_to_swa"):
        kvc.plan(arr([1]), arr([3]), arr([1]), table(), verify_capacity=8, write_req_capacity=1,
                 report_evicted_in_window=True)
    with pytest.raises(TypeError, match="report_evicted_in_window must be a static bool"):
        kvc.plan(arr([1]), arr([3]), arr([1]), table(), verify_capacity=8, write_req_capacity=1,
                 full_to_swa_index_mapping=arr(np.arange(64)), report_evicted_in_window="yes")


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


# ---- row_starts: a flat per-step page table (format.md §9.3) ------------------------------------------

def flat(N=24, base=100):
    return arr(base + np.arange(N))


def test_plan_row_starts_two_segments(ops):
    vp, wp = do_plan(ops, [1, 2], [3, 2], [1, 1], rt=flat(), row_starts=arr([4, 12]))
    check_plan(vp, wp, slots=[104, 105, 106, 112, 113], poss=[0, 1, 2, 0, 1], prevs=[-1, 104, 105, -1, 112],
               num_valid=5, offsets=[0, 1, 2, 0, 0], seeds=[106, 113, 0, 0], nvr=2)


def test_plan_row_starts_page_aligned_gaps(ops):
    # pages of 4: row 0 uses pages 0-1 (6 tokens), row 1 page 2, a padding row with a garbage start,
    # and a new request without a prefix; slots 6, 7, 11 are the gaps nobody reads
    vp, wp = do_plan(ops, [3, 1, 0, 2], [6, 3, 99, 0], [1, 1, 99, 2], rt=flat(16),
                     row_starts=arr([0, 8, 99, 12]))
    check_plan(vp, wp, slots=[100, 101, 102, 103, 104, 105, 108, 109, 110], poss=[0, 1, 2, 3, 4, 5, 0, 1, 2],
               prevs=[-1, 100, 101, 102, 103, 104, -1, 108, 109], num_valid=9,
               offsets=[0, 1, 2, 2, 4], seeds=[105, 110, -1, -1], nvr=4)


def test_plan_row_starts_out_of_range(ops):
    # a start before the table, a segment running off its end, a start past it
    vp, wp = do_plan(ops, [1, 2, 3], [4, 3, 2], [1, 1, 1], rt=flat(), row_starts=arr([-2, 22, 30]))
    check_plan(vp, wp, slots=[-1, -1, 100, 101, 122, 123, -1, -1, -1], poss=[0, 1, 2, 3, 0, 1, 2, 0, 1],
               prevs=[-1, -1, -1, 100, -1, 122, 123, -1, -1], num_valid=9,
               offsets=[0, 1, 2, 3, 0], seeds=[101, -1, -1, 0], nvr=3)


def test_plan_row_starts_pool_and_lut(ops):
    # the token pool and liveness still follow req_pool_indices; the LUT translates the flat reads
    vp, wp = do_plan(ops, [2, 1], [3, 2], [1, 1], rt=flat(), row_starts=arr([10, 0]), swa_window_size=2,
                     full_to_swa_index_mapping=arr(np.arange(128) + 1000),
                     req_to_verify_expected_tokens=pool(), req_to_verify_expected_tokens_valid_lens=arr([16, 1]))
    check_plan(vp, wp, slots=[1111, 1112, 1100, 1101], toks=[2001, 2002, 1000, -1], poss=[1, 2, 0, 1],
               prevs=[1110, 1111, -1, 1100], num_valid=4, offsets=[0, 1, 2, 0, 0], seeds=[1112, 1101, 0, 0],
               nvr=2)


def test_plan_row_starts_int64_no_narrowing(ops):
    # int64 starts are used whole: 2**32 + 1 is not start 1, and the sums near 2**63 wrap to
    # negative indices (-1), never into the table
    with jax.enable_x64(True):
        starts = arr([2**32 + 1, 2**63 - 1, -2**63 + 1, 3], np.int64)
        vp, wp = do_plan(ops, [1, 2, 3, 1], [2, 2, 2, 2], [1, 1, 1, 1], rt=flat(24).astype(np.int64),
                         row_starts=starts)
        check_plan(vp, wp, slots=[-1, -1, -1, -1, -1, -1, 103, 104], poss=[0, 1] * 4,
                   prevs=[-1, -1, -1, -1, -1, -1, -1, 103], num_valid=8, offsets=[0, 1, 2, 3, 4],
                   seeds=[-1, -1, -1, 104], nvr=4)


EQUIV_CASES = [  # (seed, R, L, window, lut, pool, offset)
    (0, 5, 12, 0, False, False, 0),
    (1, 6, 16, 0, True, True, 1),
    (2, 4, 20, 5, True, True, -1),
    (3, 8, 8, 3, True, False, 0),
]


@pytest.mark.parametrize("seed,R,L,W,with_lut,with_pool,koff", EQUIV_CASES)
def test_plan_row_starts_equals_2d_table(ops, seed, R, L, W, with_lut, with_pool, koff):
    """plan(rp, P, E, T) == plan(rp, P, E, T.reshape(-1), row_starts=rp * L) when every read is
    inside the rows."""
    rng = np.random.default_rng(seed)
    bs = 5
    t = rng.integers(-3, 90, (R, L))
    rps = rng.integers(0, R, bs)
    P = rng.integers(0, L + 1, bs)
    E = rng.integers(-1, 4, bs)
    kw = dict(verify_capacity=64, write_req_capacity=bs + 1)
    if W:
        kw["swa_window_size"] = W
    if with_lut:
        kw["full_to_swa_index_mapping"] = arr(rng.integers(-2, 100, 80))
    if with_pool:
        kw["req_to_verify_expected_tokens"] = arr(rng.integers(0, 5000, (R, L + 2)))
        kw["req_to_verify_expected_tokens_valid_lens"] = arr(rng.integers(0, L + 3, bs))
    if koff:
        kw["kv_token_id_vs_position_offset"] = koff
    two_d = ops.plan(arr(rps), arr(P), arr(E), arr(t), **kw)
    flat_ = ops.plan(arr(rps), arr(P), arr(E), arr(t.reshape(-1)), row_starts=arr(rps * L), **kw)
    for a, b in zip(jax.tree_util.tree_leaves(two_d), jax.tree_util.tree_leaves(flat_)):
        assert np.asarray(a).dtype == np.asarray(b).dtype == np.int32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(np.asarray(two_d[0].num_valid)[0]) > 0
