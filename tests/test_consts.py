"""consts.py is the one Python source of truth; csrc/canary_core.h must mirror every value (format.md §2)."""

import pathlib
import re

import jax_kvcanary as kvc
from jax_kvcanary import consts

HEADER = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "canary_core.h"


def header_text():
    return HEADER.read_text()


def header_scalars():
    pat = re.compile(r"constexpr\s+(?:u?int\d+_t|int)\s+(\w+)\s*=\s*(0x[0-9A-Fa-f]+|\d+)(?:ull|ll)?;")
    return {name: int(value, 0) for name, value in pat.findall(header_text())}


def header_enum(name):
    body = re.search(r"enum class " + name + r"\s*:\s*\w+\s*\{(.*?)\};", header_text(), re.S).group(1)
    return {k: int(v, 0) for k, v in re.findall(r"(\w+)\s*=\s*(\w+),", body)}


def test_scalars_match_header():
    scalars = header_scalars()
    python = {k: v for k, v in vars(consts).items() if k.isupper() and isinstance(v, int)}
    shifts = consts.SPLITMIX64_SHIFTS
    expected = dict(python, SPLITMIX64_SHIFT1=shifts[0], SPLITMIX64_SHIFT2=shifts[1], SPLITMIX64_SHIFT3=shifts[2])
    assert set(expected) <= set(scalars), sorted(set(expected) - set(scalars))
    for name, value in expected.items():
        assert scalars[name] == value, name


def test_enums_match_header():
    for enum_cls in (consts.FailReason, consts.LaunchTag, consts.RealKvHashMode, consts.IndexKind):
        assert header_enum(enum_cls.__name__) == {m.name: int(m) for m in enum_cls}, enum_cls.__name__


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
