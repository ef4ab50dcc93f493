"""The report text (format.md §10) against literal expected text, and the first-line parser."""

import numpy as np
import pytest

from jax_kvcanary.consts import CANARY_ANCHOR_HASH, FailReason, IndexKind, LaunchTag
from jax_kvcanary.runtime import report as R
from jax_kvcanary.runtime.monitor import Monitor
from jax_kvcanary.state import ViolationLog

H0S = CANARY_ANCHOR_HASH - (1 << 64)  # anchor hash as stored i64

FULL_EXAMPLE = """\
kv_canary violation: launch_tag=HEAD_K_FULL fail_reason=verify_chain_hash+verify_position+verify_real_kv_hash slot_idx=17 position=42 stored_token=111 expected_token=0 stored_chain_hash=0x1111111111111111 expected_aux=0x2222222222222222
KV cache canary violation detected (kernel_kind=HEAD_K_FULL, slot_idx=17, position=42)
canary_kind:       per_forward_head_k_full
  fail_reasons: verify_chain_hash verify_position verify_real_kv_hash
  stored:   token_id=111   position=42 prev_hash=0x1111111111111111
  expected: prev_hash=0x2222222222222222
  total_violations=1 ring_overflow=False step_when_pumped=7"""

EXAMPLE_B = """\
kv_canary violation: launch_tag=HEAD_V_SWA fail_reason=write_token slot_idx=6 position=3 stored_token=44 expected_token=45 stored_chain_hash=0x324a24cacfabcb37 expected_aux=0x0000000000000003
KV cache canary violation detected (kernel_kind=HEAD_V_SWA, slot_idx=6, position=3)
canary_kind:       per_forward_head_v_swa
  fail_reasons: write_token
  actual:   token_id=44   position=3 prev_hash=0x324a24cacfabcb37
  expected: token_id=45   position=3
  total_violations=2 ring_overflow=False step_when_pumped=12"""

X1 = """\
kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=index_out_of_range slot_idx=9 position=1 stored_token=43 expected_token=9 stored_chain_hash=0x0000000000000001 expected_aux=0x0000000000000008
KV cache canary violation detected (kernel_kind=TAIL_K_FULL, slot_idx=9, position=1)
canary_kind:       per_forward_tail_k_full
  fail_reasons: index_out_of_range
  index:    kind=write_slot value=9 bound=8
  entry:    token_id=43   position=1
  total_violations=1 ring_overflow=False step_when_pumped=5"""

ROW_FULL = [0, 17, 42, 111, 0, 0x1111111111111111, 0x2222222222222222, 1 | 2 | 4]
ROW_B = [7, 6, 3, 44, 45, 3623749303659121463, 3, 8]
ROW_X1 = [2, 9, 1, 43, 9, 1, 8, 64]


def test_full_example_literal():
    assert R.format_report(ROW_FULL, total=1, ring_capacity=1024, step=7) == FULL_EXAMPLE


def test_write_row_literal():
    assert R.format_report(ROW_B, total=2, ring_capacity=1024, step=12) == EXAMPLE_B


def test_oob_row_literal():
    assert R.format_report(ROW_X1, total=1, ring_capacity=16, step=5) == X1


def test_token_row_pins():
    row = [0, 1, 10, 42, 99, H0S, H0S, 32]
    lines = R.format_report(row, total=1, ring_capacity=4, step=1).split("\n")
    assert lines[-3:] == [
        "  stored:   token_id=42   position=10 prev_hash=0xde7fae23a9a1b716",
        "  expected: token_id=99 prev_hash=0xde7fae23a9a1b716",
        "  total_violations=1 ring_overflow=False step_when_pumped=1",
    ]
    assert lines[0].split(" fail_reason=")[1].startswith("verify_token ")


def test_unknown_tag_and_no_bits():
    text = R.format_report([9999, 1, 2, 3, 4, 5, 6, 0], total=1, ring_capacity=4, step=3)
    lines = text.split("\n")
    assert "launch_tag=unknown(9999) fail_reason=none" in lines[0]
    assert lines[1] == "KV cache canary violation detected (kernel_kind=unknown(9999), slot_idx=1, position=2)"
    assert lines[2] == "canary_kind:       unknown(9999)"
    assert lines[3] == "  fail_reasons: none"


def test_unknown_bits_and_index_kind():
    bits = 64 | (1 << 7) | (1 << 63)
    row = [4, 5, 6, -1, 7, 99, 8, bits - (1 << 64)]
    lines = R.format_report(row, total=1, ring_capacity=4, step=0).split("\n")
    assert "fail_reason=index_out_of_range+bit7+bit63 " in lines[0]
    assert lines[2] == "canary_kind:       sweep_k_full"
    assert lines[3] == "  fail_reasons: index_out_of_range bit7 bit63"
    assert lines[4] == "  index:    kind=unknown(99) value=7 bound=8"


def test_device_line_and_line_count():
    assert len(R.format_report(ROW_FULL, total=1, ring_capacity=4, step=1).split("\n")) == 7
    text = R.format_report(ROW_FULL, total=1, ring_capacity=4, step=1, device=3)
    assert text.split("\n")[-1] == "  device=3" and len(text.split("\n")) == 8
    assert not text.endswith("\n")


@pytest.mark.parametrize("row", [ROW_FULL, ROW_B, ROW_X1, [11, -5, 7, -1, -5, 3, 8, 64]])
def test_parser_roundtrip(row):
    text = R.format_report(row, total=1, ring_capacity=4, step=1)
    h = R.parse_first_line(text)
    assert h is not None
    assert (h.slot_idx, h.position, h.stored_token, h.expected_token) == tuple(row[1:5])
    assert h.stored_chain_hash == row[5] & (2**64 - 1)
    assert h.expected_aux == row[6] & (2**64 - 1)
    assert h.tag == LaunchTag(row[0])
    assert h.reasons == tuple(R.reason_labels(row[7]))
    m = R.REPORT_LINE_RE.search(text)
    assert m.group(1) == LaunchTag(row[0]).name and m.group(2) == "+".join(h.reasons)


def test_parser_rejects_other_text():
    assert R.parse_first_line("hello") is None
    assert R.parse_first_line("kv_canary violation: launch_tag=X fail_reason=y") is None


def test_labels():
    assert R.canary_kind(LaunchTag.SWEEP_K_SWA) == "sweep_k_swa"
    assert R.canary_kind(LaunchTag.TAIL_V_FULL) == "per_forward_tail_v_full"
    assert R.index_kind_label(IndexKind.REAL_KV_SOURCE_2) == "real_kv_source_2"
    assert R.reason_labels(int(FailReason.VERIFY_TOKEN_MISMATCH | FailReason.VERIFY_POSITION_MISMATCH)) \
        == ["verify_position", "verify_token"]
    assert R.hex64(-1) == "0xffffffffffffffff"


def _log_with_rows(rows, write_index, cap):
    ring = np.zeros((cap, 8), np.int64)
    ring[:len(rows)] = rows
    log = ViolationLog.create(ring_capacity=cap)
    return ViolationLog(ring.view(np.uint8).reshape(cap, 64), np.array([write_index], np.int32),
                        log.kernel_run_counters, log.slot_run_counters, log.enable_chain_position_assert)


def test_overflow_pin_through_monitor():
    # write_index 5 with capacity 2: two reports, each ending total_violations=5 ring_overflow=True
    log = _log_with_rows([ROW_FULL, ROW_B], write_index=5, cap=2)
    mon = Monitor("log")
    assert mon.step(log) == []
    vs = mon.step(log)
    assert len(vs) == 2
    for v in vs:
        assert v.report.split("\n")[-1] == "  total_violations=5 ring_overflow=True step_when_pumped=2"
    assert mon.step(log) == []   # each stored row is reported once
