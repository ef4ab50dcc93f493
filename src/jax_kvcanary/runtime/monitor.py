"""``Monitor``: the host side of the canary, with a one-step readback lag (format.md §10).

Call ``monitor.step(state)`` once per serving step, right after the step returns (before the next
step donates the state). It

1. dispatches a tiny snapshot of the counters (``write_index``, kernel/slot-run and written
   counters: one ``uint8`` array) and starts its ``copy_to_host_async``;
2. decodes the snapshot started by the previous call. Only if ``write_index`` moved past the
   watermark does it read the ring (of the current state: rows are fill-once, so they are the
   same), and reports the new rows.

A violation recorded in step T is therefore reported by the call after step T+1, and the serving
step itself never waits for the host. Mode ``log`` logs each new row once (WARNING); ``raise``
raises ``CanaryViolationError`` with every new row, after which the monitor reports nothing more.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import consts
from ..state import ViolationLog
from .config import CanaryConfig
from .endpoints import CanaryState
from .episodes import EpisodeLog
from .errors import CanaryViolationError
from .health import HealthCheck
from ..consts import reason_labels, tag_name
from .report import format_report
from .stats import CounterSnapshot, format_stats_line

LOGGER = logging.getLogger("jax_kvcanary")


@dataclasses.dataclass(frozen=True)
class Violation:
    """One decoded ring row. ``row`` is int64[8]; ``index`` its ring row; ``device`` its device
    (None for a single-device engine); ``step`` the monitor step that pumped it; ``launch_step``
    the monitor step whose launches recorded it (``step`` for rows found on the host)."""

    row: np.ndarray
    report: str
    step: int
    index: int
    total: int
    ring_capacity: int
    device: Optional[int] = None
    launch_step: Optional[int] = None

    @property
    def tag(self) -> int:
        return int(self.row[consts.VIOLATION_FIELD_KERNEL_KIND])

    @property
    def tag_name(self) -> str:
        return tag_name(self.tag)

    @property
    def bits(self) -> int:
        return int(self.row[consts.VIOLATION_FIELD_FAIL_REASON_BITS])

    @property
    def reasons(self) -> tuple:
        return tuple(reason_labels(self.bits))

    @property
    def slot(self) -> int:
        return int(self.row[consts.VIOLATION_FIELD_SLOT_IDX])

    @property
    def position(self) -> int:
        return int(self.row[consts.VIOLATION_FIELD_POSITION])


def _parts(log: ViolationLog, written):
    return log.write_index, log.kernel_run_counters, log.slot_run_counters, written


@jax.jit
def _snapshot(write_index, kernel_runs, slot_runs, written):
    """uint8[(D,) 4 + 24 T]: the counters' bytes in one array (one small device->host copy)."""
    lead = write_index.shape[:-1]
    parts = [jax.lax.bitcast_convert_type(write_index, jnp.uint8), kernel_runs, slot_runs,
             jax.lax.bitcast_convert_type(written, jnp.uint8)]
    return jnp.concatenate([p.reshape(lead + (-1,)) for p in parts], axis=-1)


def local_blocks(x):
    """``(host, indices)``: ``x`` on the host, and the index in ``x``'s first dimension of each
    block of ``host``: the whole array, or when ``x`` spans several processes' devices the blocks
    of this process's shards only, in order (each shard one block of a leading device axis)."""
    if getattr(x, "is_fully_addressable", True):
        host = np.asarray(x)
        return host, list(range(host.shape[0] if host.ndim > 1 else 1))
    shards = {int(s.index[0].start or 0): s for s in x.addressable_shards}
    starts = sorted(shards)
    return np.concatenate([np.asarray(shards[k].data) for k in starts]), starts


def _is_ready(x) -> bool:
    """Whether the computation producing ``x`` has finished (True where JAX cannot tell)."""
    ready = getattr(x, "is_ready", None)
    return True if ready is None else bool(ready())


def counter_snapshot(state) -> jax.Array:
    """The counters ``Monitor.step`` reads back, as one ``uint8[(D,) 4 + 24 T]`` array, of a
    ``CanaryState`` or a ``ViolationLog``. Jit-compatible: a serving step that returns it along
    with the state spares the monitor a dispatch of its own per step
    (``monitor.step(state, snapshot=...)``)."""
    log, written = Monitor._split(state)
    return _snapshot(*_parts(log, written))


class Monitor:
    """Host-side readback of a ``CanaryState`` (or a bare ``ViolationLog``), one step behind.

    Call ``step(state)`` right after each serving step: it starts an async device-to-host copy of
    the counters and decodes the copy started by the previous call, so the step never waits for
    the host and a violation of step T is reported after step T+1 (docs/format.md §10).

    Args:
      mode: ``'log'`` (one WARNING per new row; serving continues), ``'raise'``
        (``CanaryViolationError`` with every new row, then nothing more) or ``'none'``.
      health_interval: steps between health checks (0 = off).
      expected_tags: the launch tags the health check requires to have run.
      stats_interval: steps between INFO stats lines (0 = off).
      stats_tags: the tags a stats line lists (default ``expected_tags``).
      counters_interval: steps between full decodes of the counters into ``monitor.counters``
        (for metrics; stats lines and health checks decode them too); 0 = only when needed.
      logger: where reports go (default ``logging.getLogger('jax_kvcanary')``).
      episodes: an ``EpisodeLog``: log one report per episode (a fault's rows, counted) instead
        of one per row, and in mode ``'raise'`` raise with the first row's report and a count of
        the others. ``monitor.violations`` keeps every row either way.
      device_names: with a leading device axis, each device's label on its reports' ``device=``
        line, after its index (e.g. ``dp_rank=1 (TFRT_CPU_1)``).
      all_processes: the state spans the devices of several processes (multi-controller JAX):
        each process decodes the blocks of its own devices (``addressable_shards``), and each
        snapshot row ends with 4 bytes more, ``int32``: the rows recorded on every device of
        every process since the ring's last reset (the launch's ``psum``). Decisions are taken on
        that total, so every process takes them at the same step: ``ring_has_rows``, and in mode
        ``'raise'`` every process raises (one whose own devices recorded nothing says so).

    Raises:
      ValueError: an unknown ``mode``.

    A state whose arrays carry a leading device axis (``write_index`` of shape ``[D, 1]``, see
    ``runtime.multidevice``) is decoded per device and each report gets a ``device=`` line.
    """

    def __init__(self, mode: str = "log", *, health_interval: int = 0, expected_tags=(),
                 stats_interval: int = 0, stats_tags=None, logger: Optional[logging.Logger] = None,
                 episodes: Optional[EpisodeLog] = None, counters_interval: int = 0,
                 device_names: Optional[Sequence[str]] = None, all_processes: bool = False):
        if mode not in ("log", "raise", "none"):
            raise ValueError(f"kv-canary: Monitor mode must be 'log', 'raise' or 'none', got {mode!r}")
        self.mode = mode
        self.health = HealthCheck(health_interval, expected_tags)
        self.stats_interval = int(stats_interval)
        self.counters_interval = int(counters_interval)
        self.stats_tags = tuple(expected_tags if stats_tags is None else stats_tags)
        self.logger = logger or LOGGER
        self.steps = 0
        self.violations: List[Violation] = []
        self.by_tag_reason = collections.Counter()
        self.counters: Optional[CounterSnapshot] = None
        self.stopped = False
        self._pending = collections.deque()   # (snapshot array, monitor step), oldest first
        self._state = None          # last state passed in (its ring is read on a counter move)
        self._watermark = None      # int64[D]: ring rows reported since the last ring reset
        self._marks = None          # the same as Python ints (the per-step check reads these)
        self._has_rows = False      # whether any of them is > 0
        self._recycled = None       # int64[D]: write_index values cleared by ring resets
        self.host_total = 0         # rows given to report_rows
        self.rows_lost = 0          # rows the full ring could not keep (counted, never decoded)
        self.lost_steps: List[int] = []   # monitor steps whose launches lost rows, in order
        self.episodes = episodes
        self.device_names = list(device_names or ())
        self.all_processes = bool(all_processes)
        self.everywhere = 0         # rows on every process's devices since the last ring reset
        self._local = None          # the global device index of each block this process decodes
        self._copies = None         # whether readbacks start a device-to-host copy (not on CPU)
        self._next_full = 0         # the first step due more than the write_index check
        self._last = None           # (host snapshot, step) of the last readback decoded
        self._counted = None        # the step whose counters ``counters`` holds

    @classmethod
    def from_config(cls, config: CanaryConfig, **kw) -> "Monitor":
        """A monitor with the config's mode, health interval, expected tags and stats interval."""
        return cls(config.mode, health_interval=config.health_interval,
                   expected_tags=config.expected_tags(), stats_interval=config.stats_interval, **kw)

    # -- per step -----------------------------------------------------------------------------------
    def step(self, state, snapshot: Optional[jax.Array] = None, *, wait: bool = True,
             keep: int = 1) -> List[Violation]:
        """Start the readback of ``state`` and report what the previous calls' readbacks found.

        Args:
          state: the ``CanaryState`` (or ``ViolationLog``) the serving step returned.
          snapshot: ``counter_snapshot(state)`` if the step computed it (default: dispatched here).
          wait: decode the previous call's snapshot even if its step is still running (blocks on
            it). ``False``: decode only the snapshots whose steps have finished, in order, and keep
            the others for a later call, so the caller never waits on the device (a serving loop
            that dispatches the next step before the last one has run; reports then lag by more
            than one step while the device is behind).
          keep: readbacks to leave pending (the newest ones); a caller that decodes them itself
            before it acts on a step (``flush_through``) passes more, so that each readback is
            decoded once, there, and this call only starts the newest.

        Returns:
          The new violations (``list[Violation]``), already logged in mode ``'log'``.

        Raises:
          CanaryViolationError: mode ``'raise'`` and new rows were found.
          CanaryHealthError: a health check found an expected tag whose counter did not move.
          TypeError: ``state`` is neither a ``CanaryState`` nor a ``ViolationLog``.
        """
        if self.mode == "none" or self.stopped:
            return []
        self.steps += 1
        log, written = self._split(state)
        snap = _snapshot(*_parts(log, written)) if snapshot is None else snapshot
        if self._copies is None:       # on the CPU the buffer is host memory: nothing to copy
            self._copies = any(d.platform != "cpu" for d in snap.devices())
        if self._copies:
            snap.copy_to_host_async()
        self._pending.append((snap, self.steps))
        self._state = log
        new: List[Violation] = []
        while len(self._pending) > keep and (wait or _is_ready(self._pending[0][0])):
            new += self._decode(*self._pending.popleft())
        if self.episodes is not None:
            for line in self.episodes.end_quiet(self.steps):
                self.logger.warning(line)
        return new

    @property
    def pending(self) -> int:
        """Readbacks started and not decoded yet."""
        return len(self._pending)

    @property
    def ready(self) -> bool:
        """Whether the steps of every pending readback have finished (``flush`` would not wait)."""
        return all(_is_ready(snap) for snap, _ in self._pending)

    def flush(self, close_episodes: bool = True) -> List[Violation]:
        """Decode every pending readback now (at the end of serving, or while the server is idle).
        Blocks on the last step. ``close_episodes``: also end the open episodes
        (``close_episodes()``); False while serving may go on."""
        new: List[Violation] = []
        while self.mode != "none" and not self.stopped and self._pending:
            snap, step = self._pending.popleft()
            new += self._decode(snap, step, full=not self._pending)
        if close_episodes:
            self.close_episodes()
        return new

    def flush_through(self, step: int) -> List[Violation]:
        """Decode the pending readbacks of the monitor steps up to ``step`` (blocks on them), and
        keep the later ones pending: a caller that must know what a step found before it acts on
        the step's results (e.g. before a request finishes), while later steps may still run."""
        new: List[Violation] = []
        while (self.mode != "none" and not self.stopped and self._pending
               and self._pending[0][1] <= step):
            snap, snap_step = self._pending.popleft()
            new += self._decode(snap, snap_step)
        return new

    def refresh_counters(self) -> bool:
        """Decode in full the counters of the last readback decoded, if ``counters`` is older
        (between full decodes only ``write_index`` is read: e.g. once the server has gone idle,
        for the metrics). Returns whether ``counters`` changed."""
        if self._last is None or self._counted == self._last[1]:
            return False
        host, step = self._last
        self.counters = CounterSnapshot.decode(host, int(self._state.kernel_run_counters.shape[-2]))
        self._counted = step
        return True

    def ring_recycled(self) -> None:
        """The owner of the state has reset the device ring's ``write_index`` to 0 (every row
        decoded first: call it with no readback pending). Later rows are numbered from 0 again;
        ``total`` goes on counting every row."""
        if self._pending:
            raise RuntimeError("kv-canary: the ring was reset with readbacks still pending")
        if self._watermark is None:
            return
        wi = self._watermark              # the write_index of the last launch, every row decoded
        self._recycled = wi if self._recycled is None else self._recycled + wi
        self._set_watermark(np.zeros_like(wi))
        self._last = None                 # its write_index is from before the reset
        self.everywhere = 0
        if self.counters is not None:
            self.counters = dataclasses.replace(self.counters, write_index=np.zeros_like(wi))

    @property
    def local_devices(self) -> Optional[list]:
        """The index in the state of each device block this process decoded last (None before
        the first decode): every device, or with ``all_processes`` this process's own."""
        return self._local

    @property
    def ring_has_rows(self) -> bool:
        """Whether rows were recorded since the ring was last reset (decoded or lost); with
        ``all_processes``, on any process's devices."""
        if self.all_processes:
            return self.everywhere > 0
        return self._has_rows

    def _set_watermark(self, marks: np.ndarray) -> None:
        self._watermark = marks
        self._marks = tuple(int(m) for m in marks)
        self._has_rows = any(m > 0 for m in self._marks)

    def close_episodes(self) -> None:
        """End the open episodes (``EpisodeLog``), logging each one's summary line."""
        if self.episodes is not None:
            for line in self.episodes.close():
                self.logger.warning(line)

    # -- internals ----------------------------------------------------------------------------------
    @staticmethod
    def _split(state):
        if isinstance(state, CanaryState):
            return state.log, state.written
        if isinstance(state, ViolationLog):
            lead = tuple(state.write_index.shape[:-1])
            return state, jnp.zeros(lead + (state.kernel_run_counters.shape[-2], 2), jnp.uint32)
        raise TypeError("kv-canary: Monitor.step needs a CanaryState or a ViolationLog, got "
                        f"{type(state).__name__}")

    def _decode(self, snap, snap_step, full: bool = False) -> List[Violation]:
        """Report the new rows of one snapshot. The counters are decoded in full only when
        something needs them (``full``, new rows, a stats line or a counters decode due); a
        health check due reads the kernel-run counters only; otherwise only ``write_index``."""
        if self.all_processes:
            host, self._local = local_blocks(snap)
            everywhere = int(host.reshape(-1, host.shape[-1])[0, -4:].view("<i4")[0])
            host = host[..., :-4]            # the trailing int32: rows on every process
        else:                                # one process: every block is its own
            host, everywhere = np.asarray(snap), self.everywhere
            if self._local is None:
                self._local = list(range(host.shape[0] if host.ndim > 1 else 1))
        self._last = (host, snap_step)
        quiet = (not full and everywhere <= self.everywhere and self._marks is not None
                 and not self._moved(host))
        if quiet and snap_step < self._next_full:     # every step: the write_index check alone
            return []
        log = self._state
        num_tags = int(log.kernel_run_counters.shape[-2])
        if quiet and not self._counters_due(snap_step):   # a health check: kernel-run counters
            blocks = host.reshape(-1, host.shape[-1])
            self.health.observe(snap_step, blocks[:, 4:4 + 8 * num_tags].copy().view("<i8"))
            self._next_full = self._next_full_step(snap_step)
            return []
        counters = CounterSnapshot.decode(host, num_tags)
        self.counters, self._counted = counters, snap_step
        multi = log.write_index.ndim == 2
        ndev = counters.write_index.shape[0]
        if self._watermark is None:
            self._set_watermark(np.zeros((ndev,), np.int64))
        cap = int(log.ring.shape[-2])
        wi = counters.write_index.astype(np.int64)
        ends = np.clip(wi, 0, cap)
        base = np.zeros_like(wi) if self._recycled is None else self._recycled
        lost = int(np.sum(np.maximum(wi - np.maximum(self._watermark, cap), 0)))
        if lost:                     # rows past a full ring: counted by write_index, not kept
            self.rows_lost += lost
            self.lost_steps.append(snap_step)
        new: List[Violation] = []
        if np.any(ends > self._watermark):
            ring = np.ascontiguousarray(local_blocks(log.ring)[0]).view("<i8").astype(np.int64)
            ring = ring.reshape((ndev, cap, consts.VIOLATION_FIELDS))
            for d in range(ndev):
                g = self._local[d]               # the device's index in the whole state
                for i in range(int(self._watermark[d]), int(ends[d])):
                    row = ring[d, i].copy()
                    total = int(base[d] + wi[d])
                    text = format_report(row, total=total, ring_capacity=cap, step=self.steps,
                                         device=g if multi else None,
                                         device_name=(self.device_names[g]
                                                      if g < len(self.device_names) else ""))
                    new.append(Violation(row, text, self.steps, i, total, cap, g if multi else None,
                                         snap_step))
        before = int(self._watermark.sum())
        self._set_watermark(np.maximum(self._watermark, np.maximum(wi, 0)))
        elsewhere = everywhere - self.everywhere > int(self._watermark.sum()) - before
        self.everywhere = everywhere
        if elsewhere and not new and self.mode == "raise":
            self.stopped = True       # every process stops at this step, not only the finder
            raise CanaryViolationError(
                f"kv-canary: violation rows recorded on another process's devices (launch of "
                f"step {snap_step}; {everywhere} row(s) on all processes since the ring's last "
                "reset): that process reports them", [])
        self._emit(new)
        self.health.observe(snap_step, counters.kernel_runs)
        if self.stats_interval and snap_step % self.stats_interval == 0:
            self.logger.info(self.stats_line(snap_step))
        self._next_full = self._next_full_step(snap_step)
        return new

    def _moved(self, host: np.ndarray) -> bool:
        """Whether a device's ``write_index`` in snapshot ``host`` (the first 4 bytes of its
        block) is past the rows reported, in plain Python (numpy's calls on arrays this small
        cost more than the comparison)."""
        if host.ndim == 1:
            return int.from_bytes(host[:4], "little", signed=True) > self._marks[0]
        return any(int.from_bytes(block[:4], "little", signed=True) > mark
                   for block, mark in zip(host, self._marks))

    def _counters_due(self, step: int) -> bool:
        """Whether monitor step ``step`` is due a full decode of the counters (a stats line, or
        ``counters_interval``)."""
        return any(n and step % n == 0 for n in (self.stats_interval, self.counters_interval))

    def _next_full_step(self, step: int) -> int:
        """The first monitor step after ``step`` that is due more than the ``write_index`` check:
        a health check, a stats line or a counters decode."""
        due = [self.health.next_due(step)]
        due += [(step // n + 1) * n for n in (self.stats_interval, self.counters_interval) if n]
        return min(due)

    def _emit(self, new: List[Violation]) -> List[Violation]:
        """Count, keep and log the new violations, or raise them (mode 'raise')."""
        for v in new:
            for r in v.reasons:
                self.by_tag_reason[(v.tag_name, r)] += 1
        self.violations.extend(new)
        if new and self.mode == "raise":
            self.stopped = True
            if self.episodes is None:
                raise CanaryViolationError("\n".join(v.report for v in new), new)
            more = collections.Counter(f"{v.tag_name} {'+'.join(v.reasons)}" for v in new[1:])
            text = new[0].report + ("" if not more else "\n  and {} more row(s) in this step: {}"
                                    .format(len(new) - 1, ", ".join(f"{k} x{n}"
                                                                    for k, n in more.items())))
            raise CanaryViolationError(text, new)
        if self.episodes is not None:
            for line in self.episodes.add(new, self.steps):
                self.logger.warning(line)
            return new
        for v in new:
            self.logger.warning(v.report)
        return new

    def report_rows(self, rows, step: Optional[int] = None) -> List[Violation]:
        """Report rows found on the host (``hostcheck.check_host_copy``, a transfer's check) like ring
        rows: the same text, counting and mode (log each, or raise ``CanaryViolationError`` with all
        of them). Host rows need no readback, so they are reported at once.

        Args:
          rows: ``int64[k, 8]``; ``total_violations`` in their text is ``k``.
          step: the step the rows belong to (``step_when_pumped``; default the monitor's step count).

        Returns:
          The new violations (``list[Violation]``); ``index`` is a row's place in ``rows``.
        """
        rows = np.asarray(rows, np.int64).reshape(-1, consts.VIOLATION_FIELDS)
        if self.mode == "none" or self.stopped or rows.shape[0] == 0:
            return []
        n = int(rows.shape[0])
        step = self.steps if step is None else int(step)
        new = [Violation(r.copy(), format_report(r, total=n, ring_capacity=n, step=step), step, i, n, n)
               for i, r in enumerate(rows)]
        self.host_total += n
        return self._emit(new)

    @property
    def total(self) -> int:
        """Violations recorded so far: the sum of ``write_index`` over devices, as last read back, plus
        the rows given to ``report_rows``."""
        device = 0 if self.counters is None else int(self.counters.write_index.sum())
        recycled = 0 if self._recycled is None else int(self._recycled.sum())
        return device + recycled + self.host_total

    def stats_line(self, steps: Optional[int] = None) -> str:
        """``kv_canary stats: steps=N violations=V TAG=runs:..,verified:..,written:.. ...`` from the
        counters last read back (``steps`` defaults to the monitor's step count)."""
        steps = self.steps if steps is None else steps
        if self.counters is None:
            return f"kv_canary stats: steps={steps} violations=0"
        return format_stats_line(steps, self.total, self.counters, self.stats_tags)
