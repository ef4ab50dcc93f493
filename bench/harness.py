"""Timing harness: warm-up, calibrated repetitions, interleaved rounds, medians, per-round ratios.

Method: every contender of one measurement point is warmed up (compile + two
calls), then timed in *rounds*. In each round every contender runs ``reps`` back-to-back calls that end
with ``block_until_ready``; the contenders' order rotates from round to round, so slow drift of a
shared machine hits every contender alike. A contender's time is the median over rounds of its
per-call time; a ratio between two contenders is the median over rounds of the per-round ratio
(both measured within seconds of each other), not the ratio of two medians. As in ``timeit``, Python's
garbage collector is off while timing: its pauses depend on the whole process's heap, not on the op.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import jax


def block(x):
    """Wait for every JAX array in ``x`` (host values pass through)."""
    return jax.block_until_ready(x)


@dataclasses.dataclass
class Contender:
    """One thing to time at a measurement point.

    ``fn()`` runs one call (updating its own donated state in a closure) and returns what to block on.
    ``kind`` is 'backend' (a jax_kvcanary implementation) or 'baseline'. ``max_reps`` caps the
    calibrated repetitions (1 for slow host references).
    """

    name: str
    fn: Callable[[], Any]
    kind: str = "backend"
    max_reps: int = 1000
    note: str = ""


@dataclasses.dataclass
class Result:
    name: str
    kind: str
    times: List[float]  # per-call seconds, one per round
    reps: int
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def spread(self) -> float:
        """(max - min) / median over rounds: how noisy this contender was."""
        return (max(self.times) - min(self.times)) / self.median if self.median > 0 else 0.0


def _time_reps(fn, reps: int) -> float:
    t0 = time.perf_counter()
    out = None
    for _ in range(reps):
        out = fn()
    block(out)
    return (time.perf_counter() - t0) / reps


def measure(contenders: List[Contender], *, rounds: int, target_s: float, warmup: int = 2) -> Dict[str, Result]:
    """Time every contender in ``rounds`` interleaved rounds; returns ``{name: Result}``."""
    reps = {}
    for c in contenders:
        for _ in range(warmup):
            block(c.fn())
        one = _time_reps(c.fn, 1)
        reps[c.name] = max(1, min(c.max_reps, int(math.ceil(target_s / max(one, 1e-7)))))
    times = {c.name: [] for c in contenders}
    n = len(contenders)
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            order = contenders[r % n:] + contenders[:r % n]
            for c in order:
                times[c.name].append(_time_reps(c.fn, reps[c.name]))
    finally:
        if was_enabled:
            gc.enable()
    return {c.name: Result(c.name, c.kind, times[c.name], reps[c.name], c.note) for c in contenders}


def ratio(results: Dict[str, Result], num: str, den: str) -> Optional[float]:
    """Median over rounds of throughput(num) / throughput(den) = time(den) / time(num)."""
    if num not in results or den not in results:
        return None
    a, b = results[num].times, results[den].times
    return statistics.median([tb / ta for ta, tb in zip(a, b) if ta > 0])


def fit_line(xs, ys):
    """Least-squares slope and intercept of ys over xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return slope, my - slope * mx


# ---- machine, versions, backend ------------------------------------------------------------------

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_gib() -> Optional[float]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _git_commit(root: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
        if out.returncode == 0:
            return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def machine_info(platform_name: str) -> dict:
    import jaxlib
    import numpy as np

    import jax_kvcanary
    from jax_kvcanary import _ffi

    devs = jax.devices(platform_name)
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {
        "hostname": platform.node(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_gib": _mem_gib(),
        "loadavg_at_start": list(load) if load else None,
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "numpy": np.__version__,
        "jax_kvcanary": getattr(jax_kvcanary, "__version__", None) or _pkg_version(),
        "jax_kvcanary_path": os.path.dirname(jax_kvcanary.__file__),
        "native_platforms": sorted(_ffi.NATIVE_PLATFORMS),
        "git_commit": _git_commit(root),
        "platform": platform_name,
        "devices": [str(d) for d in devs],
        "device_kind": devs[0].device_kind if devs else None,
        "x64": bool(jax.config.jax_enable_x64),
    }


def _pkg_version():
    try:
        from importlib.metadata import version
        return version("jax_kvcanary")
    except Exception:  # noqa: BLE001 — running from the source tree
        return "source tree"
