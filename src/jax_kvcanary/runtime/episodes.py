"""Violation episodes: the rows of one fault, reported once with a count instead of once per row.

A fault usually yields many rows: a flipped KV byte is reported by every step that reads the slot,
a swapped table entry by every entry of the chain behind it, and both again for every request that
shares the prefix. ``EpisodeLog`` groups rows into *episodes*, one per (launch tag, fail reasons,
run of adjacent slots): the first row of an episode is reported in full (upstream's text, whose
first line log parsers match) with an ``episode:`` line naming its slots; later rows of the same
episode only count; when an episode has seen no row for ``quiet_steps`` steps (or at ``close``)
one ``kv_canary episode ended:`` line gives its slots, rows and first/last step. New-episode
reports are rate-limited (``max_reports_per_s``); what the limit holds back is counted and said.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..consts import reason_labels, tag_name


@dataclasses.dataclass
class Episode:
    """One fault's rows: ``tag`` and ``bits`` (fail reasons), the slots ``lo..hi``, how many
    ``rows``, the monitor steps ``first_step..last_step``, its number ``index`` (from 1)."""

    index: int
    tag: int
    bits: int
    lo: int
    hi: int
    rows: int
    first_step: int
    last_step: int

    @property
    def key(self) -> Tuple[int, int]:
        return self.tag, self.bits

    def describe(self) -> str:
        slots = f"{self.lo}" if self.lo == self.hi else f"{self.lo}..{self.hi}"
        return (f"launch_tag={tag_name(self.tag)} fail_reason={'+'.join(reason_labels(self.bits))} "
                f"slots={slots} rows={self.rows} steps={self.first_step}..{self.last_step}")


def _runs(slots: Sequence[int], gap: int) -> List[Tuple[int, int]]:
    """Sorted runs ``(lo, hi)`` of ``slots`` whose neighbours are at most ``gap`` apart."""
    out: List[Tuple[int, int]] = []
    for s in sorted(set(int(x) for x in slots)):
        if out and s - out[-1][1] <= gap:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


class EpisodeLog:
    """Groups violations into episodes and says what to log.

    Args:
      quiet_steps: steps without a row after which an episode ends (and its summary is logged).
      slot_gap: slots at most this far apart in one step belong to the same run.
      max_reports_per_s: new-episode reports per second; beyond it they are counted, not shown.
      clock: seconds (``time.monotonic``), for tests.
    """

    def __init__(self, quiet_steps: int = 16, slot_gap: int = 1, max_reports_per_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.quiet_steps = int(quiet_steps)
        self.slot_gap = int(slot_gap)
        self.max_reports_per_s = float(max_reports_per_s)
        self.clock = clock
        self.open: Dict[int, Episode] = {}
        self.closed: List[Episode] = []
        self.count = 0
        self.suppressed = 0
        self._window_start = None
        self._window_reports = 0

    def _allow_report(self) -> bool:
        now = self.clock()
        if self._window_start is None or now - self._window_start >= 1.0:
            self._window_start, self._window_reports = now, 0
        if self._window_reports < self.max_reports_per_s:
            self._window_reports += 1
            return True
        self.suppressed += 1
        return False

    def _find(self, tag: int, bits: int, lo: int, hi: int) -> Optional[Episode]:
        for ep in self.open.values():
            if ep.key == (tag, bits) and lo <= ep.hi + self.slot_gap and hi >= ep.lo - self.slot_gap:
                return ep
        return None

    def add(self, violations: Sequence, step: int) -> List[str]:
        """Take one step's new violations (``monitor.Violation``); returns the lines to log: the
        full report of each new episode's first row, with its ``episode:`` line."""
        groups: Dict[Tuple[int, int], list] = {}
        for v in violations:
            groups.setdefault((v.tag, v.bits), []).append(v)
        lines: List[str] = []
        for (tag, bits), vs in groups.items():
            for lo, hi in _runs([v.slot for v in vs], self.slot_gap):
                rows = [v for v in vs if lo <= v.slot <= hi]
                ep = self._find(tag, bits, lo, hi)
                if ep is not None:
                    ep.lo, ep.hi = min(ep.lo, lo), max(ep.hi, hi)
                    ep.rows += len(rows)
                    ep.last_step = step
                    continue
                self.count += 1
                ep = Episode(self.count, tag, bits, lo, hi, len(rows), step, step)
                self.open[ep.index] = ep
                if self._allow_report():
                    first = min(rows, key=lambda v: v.slot)
                    lines.append(f"{first.report}\n  episode {ep.index}: {ep.describe()} "
                                 "(later rows of this episode are counted, not logged)")
        return lines

    def end_quiet(self, step: int) -> List[str]:
        """End the episodes without a row in the last ``quiet_steps`` steps; returns their
        summary lines (and one for reports the rate limit held back)."""
        done = [ep for ep in self.open.values() if step - ep.last_step >= self.quiet_steps]
        return self._end(done)

    def close(self) -> List[str]:
        """End every open episode (at the end of serving)."""
        return self._end(list(self.open.values()))

    def _end(self, done: List[Episode]) -> List[str]:
        lines = []
        for ep in sorted(done, key=lambda e: e.index):
            del self.open[ep.index]
            self.closed.append(ep)
            lines.append(f"kv_canary episode {ep.index} ended: {ep.describe()}")
        if self.suppressed:
            lines.append(f"kv-canary: {self.suppressed} new episode report(s) held back by the "
                         f"rate limit ({self.max_reports_per_s:g} per second); their rows are "
                         "counted in the episode lines")
            self.suppressed = 0
        return lines
