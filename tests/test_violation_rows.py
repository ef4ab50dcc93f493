"""``ViolationLog.violations()`` / ``decode_row``: ring rows decoded per row kind (docs/format.md §3.2),
on the worked examples' rows (§12.5, §12.7, §12.9) and on a log an op filled."""

import jax.numpy as jnp
import numpy as np

import jax_kvcanary as kvc
from jax_kvcanary import ViolationRow, decode_row

H0 = 0xDE7FAE23A9A1B716
H0S = -2414019407054260458


def test_write_row():  # §12.5 Example B, row 0 (the input assert)
    r = decode_row([7, 6, 3, 44, 45, 3623749303659121463, 3, 8], index=0)
    assert r == ViolationRow(index=0, tag="HEAD_V_SWA", kind="write", reasons=("write_token",), slot=6, position=3,
                             stored_token=44, expected_token=45, stored_chain_hash=0x324A24CACFABCB37, expected_aux=3,
                             index_kind=None, fail_bits=8)


def test_verify_row():  # §12.7 row layout: the expected prev_hash decodes as u64
    r = decode_row([0, 5, 0, 33, -1, H0S, H0S, 2], index=4)
    assert (r.index, r.tag, r.kind, r.reasons) == (4, "HEAD_K_FULL", "verify", ("verify_position",))
    assert (r.slot, r.position, r.stored_token, r.expected_token) == (5, 0, 33, -1)
    assert r.stored_chain_hash == r.expected_aux == H0 and r.index_kind is None


def test_index_out_of_range_rows():  # §12.9 X1 and X3
    r = decode_row([2, 9, 1, 43, 9, 1, 8, 64])
    assert (r.kind, r.index_kind, r.reasons) == ("index_out_of_range", "write_slot", ("index_out_of_range",))
    assert (r.slot, r.position, r.stored_token, r.expected_token, r.expected_aux) == (9, 1, 43, 9, 8)
    assert decode_row([8, 3, 0, -1, 20, 4, 8, 64]).index_kind == "verify_prev"
    assert decode_row([3, 9, 1, -1, 2, 18, 2, 64]).index_kind == "real_kv_source_2"


def test_unknown_tag_and_bits():
    r = decode_row([9999, 1, 2, 3, 4, 5, 6, 0])
    assert (r.tag, r.reasons, r.kind) == ("unknown(9999)", ("none",), "verify")
    assert decode_row([0, 1, 2, 3, 4, 5, 6, 1 << 9]).reasons == ("bit9",)


def test_violations_of_a_filled_log(ops):
    """A verify with a corrupted chain, then a write whose position breaks the chain assert."""
    i32 = lambda *v: jnp.asarray(v, jnp.int32)  # noqa: E731
    canary, log = kvc.new_canary_buffer(8), kvc.ViolationLog.create(2)
    vp = kvc.VerifyPlan(i32(3), i32(-1), i32(7), i32(-1), i32(1), i32(1))
    log = ops.verify(canary, log, vp, tag=kvc.LaunchTag.TAIL_K_FULL)    # zero slot 3 vs a chain head
    wp = kvc.WritePlan(i32(0, 1), i32(3), i32(1))
    canary, log = ops.write(canary, log, wp, i32(5), i32(9), i32(4), tag=kvc.LaunchTag.HEAD_K_FULL)
    canary, log = ops.write(canary, log, wp, i32(5), i32(9), i32(4), tag=kvc.LaunchTag.HEAD_K_FULL)
    vs = log.violations()
    assert log.total() == 3 and len(vs) == 2                             # the ring holds 2 rows
    assert [(v.index, v.tag, v.kind, v.reasons, v.slot) for v in vs] == [
        (0, "TAIL_K_FULL", "verify", ("verify_chain_hash", "verify_position"), 3),
        (1, "HEAD_K_FULL", "write", ("write_position",), 4)]
    assert vs[0].expected_aux == H0 and vs[0].stored_chain_hash == 0 and vs[0].position == 0
    assert (vs[1].position, vs[1].expected_aux) == (9, 1)               # zero seed: expects position 1
    assert np.asarray(log.rows()).shape == (2, 8)
