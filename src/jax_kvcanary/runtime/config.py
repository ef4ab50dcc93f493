"""``CanaryConfig``: the frozen, validated configuration of the serving canary."""

from __future__ import annotations

import dataclasses
import operator
from typing import Optional, Tuple

from .. import consts
from ..consts import LaunchTag, RealKvHashMode

MODES = ("none", "log", "raise")
HALVES = ("K", "V")
GROUPS = ("FULL", "SWA")
STAGES = ("HEAD", "TAIL", "SWEEP")


def launch_tag(stage: str, half: str, group: str) -> LaunchTag:
    """The tag of one endpoint, e.g. ``launch_tag("TAIL", "K", "SWA") == LaunchTag.TAIL_K_SWA``."""
    return LaunchTag[f"{stage}_{half}_{group}"]


def endpoint_of(name: str) -> Tuple[str, str, str]:
    """``(stage, half, group)`` of a canary name, the inverse of ``launch_tag(...).name``: e.g.
    ``endpoint_of("TAIL_K_SWA") == ("TAIL", "K", "SWA")``. Raises ``ValueError`` for another name."""
    parts = tuple(name.split("_"))
    if len(parts) != 3 or parts[0] not in STAGES or parts[1] not in HALVES or parts[2] not in GROUPS:
        raise ValueError(f"kv-canary: {name!r} is not a canary name (STAGE_HALF_GROUP, e.g. "
                         "'TAIL_K_FULL')")
    return parts


def _int(name, value, lo):
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"kv-canary: CanaryConfig.{name} must be an int, got "
                        f"{type(value).__name__}") from None
    if isinstance(value, bool):
        raise TypeError(f"kv-canary: CanaryConfig.{name} must be an int, got bool")
    if v < lo:
        raise ValueError(f"kv-canary: CanaryConfig.{name} must be >= {lo}, got {v}")
    return v


def _subset(name, value, allowed):
    if isinstance(value, str):
        value = (value,)
    try:
        items = tuple(str(v).upper() for v in value)
    except TypeError:
        raise TypeError(f"kv-canary: CanaryConfig.{name} must be a tuple of {allowed}, "
                        f"got {type(value).__name__}") from None
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise ValueError(f"kv-canary: CanaryConfig.{name} must be a non-empty subset of {allowed}, "
                         f"got {tuple(value)!r}")
    if len(set(items)) != len(items):
        raise ValueError(f"kv-canary: CanaryConfig.{name} has duplicates: {tuple(value)!r}")
    return tuple(v for v in allowed if v in items)  # canonical order


@dataclasses.dataclass(frozen=True)
class CanaryConfig:
    """How the canary is installed in a serving engine (frozen; checked on construction).

    Attributes:
      mode: ``'none'`` (not installed), ``'log'`` (log each violation, keep serving) or ``'raise'``
        (raise ``CanaryViolationError``).
      real_kv_hash_mode: fingerprint of the real KV bytes at TAIL and SWEEP: NONE, PARTIAL or ALL
        (a ``RealKvHashMode``, its int, or its name).
      ring_capacity: rows of the device-side violation ring (>= 1).
      sweep_interval: run a SWEEP of the prefix cache every N steps; 0 = no sweeps.
      health_interval: check every N steps that each expected tag ran; 0 = off; None =
        ``max(8, sweep_interval)``. At least ``sweep_interval`` when both are on, so that every
        health window contains a sweep.
      stats_interval: log a stats line every N steps; 0 = off.
      token_check: verify stored tokens against the ground-truth token pool.
      write_input_assert: check written tokens and positions against oracle values (oracle runs).
      halves: the KV halves watched, a subset of ``('K', 'V')``.
      groups: the attention groups watched, a subset of ``('FULL', 'SWA')``.
      swa_window_size: the SWA window W; > 0 exactly when ``'SWA'`` is in ``groups``.

    Raises:
      TypeError, ValueError: a ``kv-canary:`` message naming the field, when a value is of the
        wrong type or out of range, or when the fields contradict each other.
    """

    mode: str = "log"
    real_kv_hash_mode: RealKvHashMode = RealKvHashMode.PARTIAL
    ring_capacity: int = consts.DEFAULT_RING_CAPACITY
    sweep_interval: int = 0
    health_interval: Optional[int] = None
    stats_interval: int = 0
    token_check: bool = False
    write_input_assert: bool = False
    halves: Tuple[str, ...] = HALVES
    groups: Tuple[str, ...] = ("FULL",)
    swa_window_size: int = 0

    def __post_init__(self):
        s = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  (frozen dataclass)
        if self.mode not in MODES:
            raise ValueError(f"kv-canary: CanaryConfig.mode must be one of {MODES}, got {self.mode!r}")
        m = self.real_kv_hash_mode
        try:
            m = RealKvHashMode[m.upper()] if isinstance(m, str) else RealKvHashMode(operator.index(m))
        except (KeyError, ValueError, TypeError):
            raise ValueError("kv-canary: CanaryConfig.real_kv_hash_mode must be NONE, PARTIAL or ALL "
                             f"(0, 1, 2), got {self.real_kv_hash_mode!r}") from None
        s("real_kv_hash_mode", m)
        s("ring_capacity", _int("ring_capacity", self.ring_capacity, 1))
        s("sweep_interval", _int("sweep_interval", self.sweep_interval, 0))
        s("stats_interval", _int("stats_interval", self.stats_interval, 0))
        hi = max(8, self.sweep_interval) if self.health_interval is None else self.health_interval
        s("health_interval", _int("health_interval", hi, 0))
        for flag in ("token_check", "write_input_assert"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"kv-canary: CanaryConfig.{flag} must be a bool, got "
                                f"{type(getattr(self, flag)).__name__}")
        s("halves", _subset("halves", self.halves, HALVES))
        s("groups", _subset("groups", self.groups, GROUPS))
        s("swa_window_size", _int("swa_window_size", self.swa_window_size, 0))
        if "SWA" in self.groups and self.swa_window_size == 0:
            raise ValueError("kv-canary: CanaryConfig.groups includes 'SWA', which needs "
                             "swa_window_size > 0")
        if "SWA" not in self.groups and self.swa_window_size > 0:
            raise ValueError(f"kv-canary: CanaryConfig.swa_window_size={self.swa_window_size} is set "
                             "but 'SWA' is not in groups")
        if self.sweep_interval and self.health_interval and self.health_interval < self.sweep_interval:
            raise ValueError(
                f"kv-canary: CanaryConfig.health_interval={self.health_interval} must be >= "
                f"sweep_interval={self.sweep_interval} (every health window must contain a sweep)")

    # -- derived ------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """False for mode 'none': the canary is not installed."""
        return self.mode != "none"

    def tags(self, stage: str) -> Tuple[LaunchTag, ...]:
        """The watched tags of one stage ('HEAD', 'TAIL' or 'SWEEP'), in tag order."""
        return tuple(sorted(launch_tag(stage, h, g) for g in self.groups for h in self.halves))

    def expected_tags(self) -> Tuple[LaunchTag, ...]:
        """Tags that must run every health window: HEAD and TAIL, plus SWEEP when sweeps are on."""
        if not self.enabled:
            return ()
        stages = ("HEAD", "TAIL") + (("SWEEP",) if self.sweep_interval else ())
        return tuple(sorted(t for st in stages for t in self.tags(st)))

    def replace(self, **changes) -> "CanaryConfig":
        """A copy with some fields changed (re-validated)."""
        return dataclasses.replace(self, **changes)
