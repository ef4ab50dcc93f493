"""consts.py is the one Python source of truth; the native modules compile csrc/canary_core.h's copy
of every value (format.md §2) and report it (``constants()``), and ``_ffi`` refuses to register a
module whose values differ."""

import pytest

import jax_kvcanary as kvc
from jax_kvcanary import _ffi, consts

_kvcanary = pytest.importorskip("jax_kvcanary._kvcanary", reason="the native CPU module is not built")


def test_the_compiled_constants_are_consts_py():
    assert _kvcanary.constants() == _ffi.expected_constants()
    assert _ffi.constants_mismatch(_kvcanary.constants()) is None


def test_a_module_compiled_from_other_values_is_refused():
    native = dict(_kvcanary.constants(), **{"FailReason.WRITE_TOKEN_MISMATCH": 9})
    why = _ffi.constants_mismatch(native)
    assert why.startswith("its compiled constants differ from consts.py (FailReason.WRITE_TOKEN_MISMATCH: "
                          "compiled 9, consts.py 8)")
    assert "EXTRA: compiled 1, consts.py None" in _ffi.constants_mismatch(dict(_kvcanary.constants(), EXTRA=1))
def test_pinned_values():
    assert kvc.CANARY_CHAIN_ANCHOR == 0xC0FFEE1234567890
    assert consts.CANARY_ANCHOR_HASH == 0xDE7FAE23A9A1B716
    assert kvc.CANARY_SLOT_BYTES == 32 and kvc.VIOLATION_FIELDS == 8 and kvc.MAX_REAL_KV_SOURCES == 4
    assert kvc.FailReason.INDEX_OUT_OF_RANGE == 64 and kvc.FailReason.VERIFY_TOKEN_MISMATCH == 32
    assert kvc.LaunchTag.HEAD_K_FULL == 0 and kvc.LaunchTag.SWEEP_V_SWA == 11 and len(kvc.LaunchTag) == 12
    assert [int(m) for m in kvc.RealKvHashMode] == [0, 1, 2]


def test_fail_reason_labels():
    labels = [consts.fail_reason_label(1 << b) for b in range(8)]
    assert labels == ["verify_chain_hash", "verify_position", "verify_real_kv_hash", "write_token",
                      "write_position", "verify_token", "index_out_of_range", "bit7"]
