"""The canary's counters for operators: a periodic stats line, and Prometheus metrics on
sglang-jax's own ``/metrics`` endpoint (``--enable-metrics``).

sglang-jax serves ``/metrics`` from its HTTP process by aggregating the files every process writes
into ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode; the launcher sets the
directory before it starts the scheduler). ``PrometheusCounters`` made in the scheduler process
therefore show up there with no endpoint of their own:

==================================  =======  =============================================
``kv_canary_violations_total``      counter  rows recorded, by ``tag`` (launch tag) and
                                             ``reason`` (fail reason)
``kv_canary_slots_verified_total``  counter  entries verified, by ``tag``
``kv_canary_slots_written_total``   counter  records written, by ``tag``
``kv_canary_steps_total``           counter  serving steps the canary checked
``kv_canary_sweeps_total``          counter  prefix-cache sweeps run
``kv_canary_health_checks_total``   counter  health checks made
``kv_canary_health_ok``             gauge    1 while every health check passed, else 0
``kv_canary_protected_tokens``      gauge    KV slots in use (their records are checked)
``kv_canary_hicache_pages_total``   counter  HiCache host pages by ``what``: records
                                             ``exported`` (backup), ``imported`` (load),
                                             ``skipped`` (not loaded), ``checked`` (host)
``kv_canary_pd_requests_total``     counter  PD requests whose records went with their KV, by
                                             ``side`` (``prefill``: sent, ``decode``:
                                             received and imported)
``kv_canary_pd_slots_total``        counter  their prompt slots, by ``side``
==================================  =======  =============================================

The device counters (verified, written) are as of the monitor's last full readback: every
``COUNTERS_INTERVAL`` steps, at a stats line, and when the server goes idle. With tensor
parallelism a slot counts once (not once per device of the ``tensor`` axis, whose devices all
check it, each on its own heads); with data-parallel attention the ranks' counts add up.
Violations count rows, each device's own.
"""

from __future__ import annotations

import collections
from typing import Dict, Optional, Tuple

import numpy as np

from ...consts import (NUM_LAUNCH_TAGS, FailReason, HostCheckTag, LaunchTag, fail_reason_label,
                       tag_name)

#: steps between full readbacks of the device counters when metrics are on
COUNTERS_INTERVAL = 64


def protected_tokens(allocator) -> int:
    """KV slots in use in an sglang-jax token-to-KV allocator (size minus available), -1 if it
    does not say."""
    try:
        return int(allocator.size) - int(allocator.available_size())
    except Exception:  # an allocator without these (e.g. hybrid SWA pools)
        return -1


#: the HiCache page counts of ``hicache.HostRecords`` in the stats line and the metrics
HOST_PAGE_COUNTS = ("exported", "imported", "skipped", "checked")


def per_rank(counts: np.ndarray, tp: int, devices=None, tensor_zero: bool = False) -> np.ndarray:
    """``int64[T]``: per-device counts ``[L, T]`` of the devices ``devices`` (their indices in the
    canary state, rank-major, ``tp`` devices per data-parallel rank; default ``0 .. L-1``) summed
    over the ranks, one device each (a rank's devices check the same slots, each on its own
    heads: a slot counts once): the first of each rank here, or with ``tensor_zero`` its tensor
    device 0 only (on several processes: summed over them, each rank is counted once)."""
    c = np.asarray(counts)
    idx = np.arange(c.shape[0]) if devices is None else np.asarray(devices)
    if tensor_zero:
        keep = idx % tp == 0
    else:
        keep = np.zeros(idx.shape[0], bool)
        keep[np.unique(idx // tp, return_index=True)[1]] = True
    return c[keep].sum(axis=0)


#: the (tag, reason) keys of the violation counts a process shares with the others
SHARED_VIOLATION_KEYS = [(t.name, fail_reason_label(int(r)))
                         for t in (*LaunchTag, *HostCheckTag) for r in FailReason]


class CanaryTotals:
    """What the canary has counted since its last reset, as plain numbers (for the stats line and
    the metrics): read from a ``SglangJaxCanary`` by ``read``."""

    def __init__(self):
        self.steps = self.sweeps = 0
        self.violations: Dict[Tuple[str, str], int] = {}
        self.verified: Dict[str, int] = {}
        self.written: Dict[str, int] = {}
        self.health_checks = 0
        self.health_ok = True
        self.host_pages: Dict[str, int] = {}     # HiCache pages: exported, imported, skipped, checked
        self.pd_side: Optional[str] = None        # PD: prefill or decode
        self.pd: Dict[str, int] = {}              # PD: requests, slots (sent or received)

    @classmethod
    def read(cls, canary, tensor_zero: bool = False) -> "CanaryTotals":
        """The canary's totals: its own devices' counters (``per_rank``)."""
        t = cls()
        m = canary.monitor
        t.steps, t.sweeps = int(canary.steps), int(canary.sweeps)
        t.violations = dict(m.by_tag_reason)
        t.health_checks, t.health_ok = m.health.checks, m.health.ok
        host = getattr(canary, "host_tier", None)
        if host is not None:
            t.host_pages = {k: int(getattr(host, k)) for k in HOST_PAGE_COUNTS}
        transfer = getattr(canary, "transfer", None)
        if transfer is not None:
            t.pd_side = transfer.role
            t.pd = {"requests": int(transfer.requests), "slots": int(transfer.slots)}
        if m.counters is not None:
            tp, here = int(getattr(canary, "tp", 1)), m.local_devices
            count = lambda c: per_rank(c, tp, here, tensor_zero)
            ver, wr = count(m.counters.verified), count(m.counters.written)
            for tag in np.flatnonzero(count(m.counters.slot_runs)):
                t.verified[tag_name(int(tag))] = int(ver[tag])
                t.written[tag_name(int(tag))] = int(wr[tag])
        return t

    @classmethod
    def everywhere(cls, canary) -> "CanaryTotals":
        """With several processes: the totals of every process's devices (each rank's slots
        counted once, every device's rows), the same on every process. A collective: call it at
        the same step on every process."""
        from jax.experimental import multihost_utils

        t = cls.read(canary, tensor_zero=True)
        tags = [tag_name(k) for k in range(NUM_LAUNCH_TAGS)]
        mine = np.concatenate([[t.verified.get(k, 0) for k in tags],
                               [t.written.get(k, 0) for k in tags],
                               [t.violations.get(k, 0) for k in SHARED_VIOLATION_KEYS]])
        total = np.asarray(multihost_utils.process_allgather(mine.astype(np.int64))).sum(axis=0)
        n = len(tags)
        ver, wr = total[:n], total[n:2 * n]
        seen = [i for i in range(n) if ver[i] or wr[i]]
        t.verified = {tags[i]: int(ver[i]) for i in seen}
        t.written = {tags[i]: int(wr[i]) for i in seen}
        t.violations = {k: int(v) for k, v in zip(SHARED_VIOLATION_KEYS, total[2 * n:]) if v}
        return t

    @property
    def total_violations(self) -> int:
        return sum(self.violations.values())

    def stats_line(self, protected: int) -> str:
        """``kv_canary stats: step=N protected_tokens=P sweep_passes=S violations=V
        TAG=verified:..,written:.. ...`` (upstream's fields first)."""
        parts = [f"kv_canary stats: step={self.steps} protected_tokens={protected} "
                 f"sweep_passes={self.sweeps} violations={self.total_violations}"]
        parts += [f"{tag}=verified:{self.verified[tag]},written:{self.written[tag]}"
                  for tag in sorted(self.verified)]
        if self.host_pages:
            parts.append("hicache_pages=" + ",".join(f"{k}:{self.host_pages[k]}"
                                                     for k in HOST_PAGE_COUNTS))
        if self.pd:
            parts.append(f"pd_{self.pd_side}=requests:{self.pd['requests']},"
                         f"slots:{self.pd['slots']}")
        return " ".join(parts)


class PrometheusCounters:
    """The canary's Prometheus metrics (module docstring) in this process's registry.

    ``update(totals, protected)`` adds what changed since the last call; totals that went down
    (the canary state was reset, e.g. after the engine's precompile) start a new baseline.

    Args:
      registry: a ``prometheus_client.CollectorRegistry`` (default: the process's default one,
        which in multiprocess mode writes to ``PROMETHEUS_MULTIPROC_DIR``).
    """

    def __init__(self, registry=None):
        from prometheus_client import REGISTRY, Counter, Gauge

        reg = REGISTRY if registry is None else registry
        self.violations = Counter("kv_canary_violations", "KV-canary violation rows recorded",
                                  ["tag", "reason"], registry=reg)
        self.verified = Counter("kv_canary_slots_verified", "KV-canary entries verified",
                                ["tag"], registry=reg)
        self.written = Counter("kv_canary_slots_written", "KV-canary records written", ["tag"],
                               registry=reg)
        self.steps = Counter("kv_canary_steps", "serving steps the KV canary checked",
                             registry=reg)
        self.sweeps = Counter("kv_canary_sweeps", "KV-canary prefix-cache sweeps run",
                              registry=reg)
        self.health_checks = Counter("kv_canary_health_checks", "KV-canary health checks made",
                                     registry=reg)
        self.health_ok = Gauge("kv_canary_health_ok", "1 while every KV-canary health check "
                               "passed, else 0", registry=reg, multiprocess_mode="mostrecent")
        self.protected = Gauge("kv_canary_protected_tokens", "KV slots in use, checked by the "
                               "canary", registry=reg, multiprocess_mode="mostrecent")
        self.host_pages = Counter("kv_canary_hicache_pages", "HiCache host pages whose canary "
                                  "records were exported (backup), imported (load), skipped (a "
                                  "page the engine did not load) or checked on the host",
                                  ["what"], registry=reg)
        self.pd_requests = Counter("kv_canary_pd_requests", "PD requests whose canary records "
                                   "were sent with their KV (prefill) or received and imported "
                                   "(decode)", ["side"], registry=reg)
        self.pd_slots = Counter("kv_canary_pd_slots", "prompt slots of those PD requests",
                                ["side"], registry=reg)
        self.health_ok.set(1)
        self._last = collections.defaultdict(int)

    def _add(self, counter, key, value: int) -> None:
        last = self._last[(id(counter), key)]
        delta = value - last if value >= last else value
        if delta:
            (counter.labels(*key) if key else counter).inc(delta)
        self._last[(id(counter), key)] = value

    def update(self, totals: CanaryTotals, protected: Optional[int] = None) -> None:
        """Add the changes of ``totals`` (a ``CanaryTotals``); set the protected-token gauge."""
        for key, n in totals.violations.items():
            self._add(self.violations, key, n)
        for tag, n in totals.verified.items():
            self._add(self.verified, (tag,), n)
        for tag, n in totals.written.items():
            self._add(self.written, (tag,), n)
        self._add(self.steps, (), totals.steps)
        self._add(self.sweeps, (), totals.sweeps)
        self._add(self.health_checks, (), totals.health_checks)
        for what, n in totals.host_pages.items():
            self._add(self.host_pages, (what,), n)
        if totals.pd:
            self._add(self.pd_requests, (totals.pd_side,), totals.pd["requests"])
            self._add(self.pd_slots, (totals.pd_side,), totals.pd["slots"])
        self.health_ok.set(1 if totals.health_ok else 0)
        if protected is not None and protected >= 0:
            self.protected.set(protected)
