"""VERIFY golden vectors (docs/format.md §12.7), through the ``ops`` fixture (reference, ffi, xla)."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcanary as kvc
from jax_kvcanary import hashing
from tests.support.goldens import H0, H0S, i64, arr, canary_with, vplan, ring_hex, rows, do_write


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
