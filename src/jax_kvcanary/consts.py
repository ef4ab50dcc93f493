"""Constants and enums of the canary format: the one Python source of truth.

Every integer here is repeated, with the same value, in ``csrc/canary_core.h``, except
``HostCheckTag``: the host-check tags only ever reach the native code as a tag value, to which it
attaches no meaning. The native modules report the values they were compiled with, and ``_ffi``
compares them with these before it registers a module's handlers.
"""

import enum

CANARY_CHAIN_ANCHOR = 0xC0FFEE1234567890
CANARY_ANCHOR_HASH = 0xDE7FAE23A9A1B716  # splitmix64(CANARY_CHAIN_ANCHOR)

SPLITMIX64_MUL1 = 0xBF58476D1CE4E5B9
SPLITMIX64_MUL2 = 0x94D049BB133111EB
SPLITMIX64_SHIFTS = (30, 27, 31)

REQ_POOL_IDX_PADDING = 0
TOKEN_TO_KV_SLOT_PADDING = 0

CANARY_FIELDS_PER_SLOT = 4
CANARY_FIELD_TOKEN = 0
CANARY_FIELD_POSITION = 1
CANARY_FIELD_PREV_HASH = 2
CANARY_FIELD_REAL_KV_HASH = 3
CANARY_SLOT_BYTES = 32

VIOLATION_FIELDS = 8
VIOLATION_FIELD_KERNEL_KIND = 0
VIOLATION_FIELD_SLOT_IDX = 1
VIOLATION_FIELD_POSITION = 2
VIOLATION_FIELD_STORED_TOKEN = 3
VIOLATION_FIELD_EXPECTED_TOKEN = 4
VIOLATION_FIELD_STORED_CHAIN_HASH = 5
VIOLATION_FIELD_EXPECTED_AUX = 6
VIOLATION_FIELD_FAIL_REASON_BITS = 7
VIOLATION_ROW_BYTES = 64
COUNTER_BYTES = 8

MAX_REAL_KV_SOURCES = 4
REAL_KV_SOURCE_FIELDS_PER_ENTRY = 3
REAL_KV_SOURCE_FIELD_PAGE_SIZE = 0
REAL_KV_SOURCE_FIELD_NUM_BYTES_PER_TOKEN = 1
REAL_KV_SOURCE_FIELD_READ_BYTES = 2
REAL_KV_CHUNK_BYTES = 16
REAL_KV_PARTIAL_BYTES = 16

NUM_LAUNCH_TAGS = 12
DEFAULT_RING_CAPACITY = 1024
WRITE_INDEX_MAX = 2**31 - 1


class FailReason(enum.IntFlag):
    """Bits of ring column 7. Bits 0-5 are upstream; bit 6 is this project's."""

    VERIFY_CHAIN_HASH_MISMATCH = 1 << 0
    VERIFY_POSITION_MISMATCH = 1 << 1
    VERIFY_REAL_KV_HASH_MISMATCH = 1 << 2
    WRITE_TOKEN_MISMATCH = 1 << 3
    WRITE_POSITION_MISMATCH = 1 << 4
    VERIFY_TOKEN_MISMATCH = 1 << 5
    INDEX_OUT_OF_RANGE = 1 << 6


class LaunchTag(enum.IntEnum):
    """The 12 upstream launch tags: (HEAD|TAIL|SWEEP) x (K|V) x (FULL|SWA)."""

    HEAD_K_FULL = 0
    HEAD_V_FULL = 1
    TAIL_K_FULL = 2
    TAIL_V_FULL = 3
    SWEEP_K_FULL = 4
    SWEEP_V_FULL = 5
    HEAD_K_SWA = 6
    HEAD_V_SWA = 7
    TAIL_K_SWA = 8
    TAIL_V_SWA = 9
    SWEEP_K_SWA = 10
    SWEEP_V_SWA = 11


class HostCheckTag(enum.IntEnum):
    """This project's launch tags after the upstream 12 (format.md §2.6): the host-side checks of KV
    that left the device (``runtime.hostcheck``). HOST_BACKUP: a host copy right after the
    device-to-host copy; HOST_TRANSFER: a transfer pack on the receiving side."""

    HOST_BACKUP_K_FULL = 12
    HOST_BACKUP_V_FULL = 13
    HOST_TRANSFER_K_FULL = 14
    HOST_TRANSFER_V_FULL = 15
    HOST_BACKUP_K_SWA = 16
    HOST_BACKUP_V_SWA = 17
    HOST_TRANSFER_K_SWA = 18
    HOST_TRANSFER_V_SWA = 19


class RealKvHashMode(enum.IntEnum):
    """How many bytes of each real-KV source are folded per slot."""

    NONE = 0
    PARTIAL = 1
    ALL = 2


class IndexKind(enum.IntEnum):
    """Code in column 5 of an INDEX_OUT_OF_RANGE row: which index was out of range."""

    WRITE_SLOT = 1
    WRITE_SEED = 2
    VERIFY_SLOT = 3
    VERIFY_PREV = 4
    REAL_KV_SOURCE_0 = 16
    REAL_KV_SOURCE_1 = 17
    REAL_KV_SOURCE_2 = 18
    REAL_KV_SOURCE_3 = 19


def fail_reason_label(bit: int) -> str:
    """Report label of one fail bit: member name lower-cased, trailing ``_mismatch`` removed."""
    known = {int(m): m.name for m in FailReason}
    if bit not in known:
        return f"bit{bit.bit_length() - 1}"
    name = known[bit].lower()
    return name[: -len("_mismatch")] if name.endswith("_mismatch") else name


def tag_name(kind: int) -> str:
    """``LaunchTag`` name for 0..11, ``HostCheckTag`` name for 12..19, else ``unknown({kind})``."""
    for enum_cls in (LaunchTag, HostCheckTag):
        try:
            return enum_cls(int(kind)).name
        except ValueError:
            continue
    return f"unknown({int(kind)})"


def reason_labels(bits: int) -> list:
    """Labels of the set bits of a u64 fail-reason word, ascending; ``['none']`` when no bit is set."""
    bits = int(bits) & ((1 << 64) - 1)
    labels = [fail_reason_label(1 << j) for j in range(64) if bits >> j & 1]
    return labels or ["none"]


def index_kind_label(code: int) -> str:
    """Lower-cased ``IndexKind`` name, else ``unknown({code})``."""
    try:
        return IndexKind(int(code)).name.lower()
    except ValueError:
        return f"unknown({int(code)})"
