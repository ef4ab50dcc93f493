"""INDEX_OUT_OF_RANGE golden vectors (docs/format.md §12.9: X1-X4) on write and verify, through the
``ops`` fixture (reference, ffi, xla). The rendered report text is tested with the runtime."""

import numpy as np

import jax_kvcanary as kvc
from jax_kvcanary.consts import RealKvHashMode
from tests.support.goldens import H0S, i64, canary_with, vplan, fields, rows, do_write, src

ALL = RealKvHashMode.ALL


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
