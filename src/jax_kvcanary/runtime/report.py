"""The violation report text (format.md §10) and a parser for its first line.

A ring row is ``int64[8]``: ``[kernel_kind, slot_idx, position, stored_token, expected_token,
stored_chain_hash, expected_aux, fail_reason_bits]`` (format.md §3.2). ``format_report`` renders one row;
the text is upstream's byte for byte for upstream rows. Line 1 is frozen for log parsers:
``kv_canary violation: launch_tag=(\\S+) fail_reason=(\\S+)``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Sequence

from ..consts import FailReason, HostCheckTag, LaunchTag, index_kind_label, reason_labels, tag_name

_U64 = (1 << 64) - 1
_WRITE_BITS = int(FailReason.WRITE_TOKEN_MISMATCH | FailReason.WRITE_POSITION_MISMATCH)

#: The frozen regex of upstream log parsers (format.md §10): groups are the tag and the fail reasons.
REPORT_LINE_RE = re.compile(r"kv_canary violation: launch_tag=(\S+) fail_reason=(\S+)")

_FULL_LINE_RE = re.compile(
    r"^kv_canary violation: launch_tag=(?P<tag>\S+) fail_reason=(?P<reasons>\S+)"
    r" slot_idx=(?P<slot_idx>-?\d+) position=(?P<position>-?\d+)"
    r" stored_token=(?P<stored_token>-?\d+) expected_token=(?P<expected_token>-?\d+)"
    r" stored_chain_hash=(?P<stored_chain_hash>0x[0-9a-f]{16})"
    r" expected_aux=(?P<expected_aux>0x[0-9a-f]{16})$")


def hex64(value: int) -> str:
    """u64 reinterpretation as ``0x`` + 16 lower-case hex digits."""
    return f"{int(value) & _U64:#018x}"




def canary_kind(kind: int) -> str:
    """``sweep_*`` for SWEEP tags, ``per_forward_*`` for HEAD/TAIL tags, ``host_backup_*`` /
    ``host_transfer_*`` for the host-check tags (format.md §2.6), ``unknown(k)`` otherwise."""
    try:
        return HostCheckTag(int(kind)).name.lower()
    except ValueError:
        pass
    try:
        name = LaunchTag(int(kind)).name.lower()
    except ValueError:
        return f"unknown({int(kind)})"
    return name if name.startswith("sweep_") else "per_forward_" + name






def format_first_line(row: Sequence[int]) -> str:
    """Line 1 of the report (the frozen, parseable line)."""
    k, slot, pos, st, et, h, a, bits = (int(v) for v in row)
    return (f"kv_canary violation: launch_tag={tag_name(k)} fail_reason={'+'.join(reason_labels(bits))}"
            f" slot_idx={slot} position={pos} stored_token={st} expected_token={et}"
            f" stored_chain_hash={hex64(h)} expected_aux={hex64(a)}")


def format_report(row: Sequence[int], *, total: int, ring_capacity: int, step: int,
                  device: Optional[int] = None, device_name: str = "") -> str:
    """The full multi-line report of one ring row (7 lines; 8 with ``device``), no trailing newline.
    ``device_name`` follows the device's index on its line (e.g. its data-parallel rank).

    ``total`` is the log's ``write_index``, ``ring_capacity`` its ring size and ``step`` the monitor
    step at which the row was pumped.
    """
    if len(row) != 8:
        raise ValueError(f"kv-canary: a violation row has 8 fields, got {len(row)}")
    k, slot, pos, st, et, h, a, bits = (int(v) for v in row)
    ubits = bits & _U64
    lines = [
        format_first_line(row),
        f"KV cache canary violation detected (kernel_kind={tag_name(k)}, slot_idx={slot}, position={pos})",
        f"canary_kind:       {canary_kind(k)}",
        f"  fail_reasons: {' '.join(reason_labels(bits))}",
    ]
    if ubits & int(FailReason.INDEX_OUT_OF_RANGE):
        lines += [f"  index:    kind={index_kind_label(h)} value={et} bound={a}",
                  f"  entry:    token_id={st}   position={pos}"]
    elif ubits & _WRITE_BITS:
        lines += [f"  actual:   token_id={st}   position={pos} prev_hash={hex64(h)}",
                  f"  expected: token_id={et}   position={a}"]
    else:
        lines.append(f"  stored:   token_id={st}   position={pos} prev_hash={hex64(h)}")
        if ubits & int(FailReason.VERIFY_TOKEN_MISMATCH):
            lines.append(f"  expected: token_id={et} prev_hash={hex64(a)}")
        else:
            lines.append(f"  expected: prev_hash={hex64(a)}")
    lines.append(f"  total_violations={int(total)} ring_overflow={int(total) > int(ring_capacity)}"
                 f" step_when_pumped={int(step)}")
    if device is not None:
        lines.append(f"  device={device}" + (f" {device_name}" if device_name else ""))
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class ReportHeader:
    """The fields of a report's first line. Hashes are u64 ints; ``reasons`` are the labels."""

    launch_tag: str
    reasons: tuple
    slot_idx: int
    position: int
    stored_token: int
    expected_token: int
    stored_chain_hash: int
    expected_aux: int

    @property
    def tag(self) -> Optional[LaunchTag]:
        """The ``LaunchTag``, or ``None`` for ``unknown(k)``."""
        return LaunchTag[self.launch_tag] if self.launch_tag in LaunchTag.__members__ else None


def parse_first_line(line: str) -> Optional[ReportHeader]:
    """Parse line 1 of a report (or a whole report: only its first line is read).

    Returns ``None`` when the text is not a kv_canary violation line.
    """
    m = _FULL_LINE_RE.match(line.split("\n", 1)[0])
    if m is None:
        return None
    g = m.groupdict()
    return ReportHeader(
        launch_tag=g["tag"], reasons=tuple(g["reasons"].split("+")),
        slot_idx=int(g["slot_idx"]), position=int(g["position"]),
        stored_token=int(g["stored_token"]), expected_token=int(g["expected_token"]),
        stored_chain_hash=int(g["stored_chain_hash"], 16), expected_aux=int(g["expected_aux"], 16))
