"""Health check: every N steps each expected tag's kernel-run counter must have moved.

This catches a canary that XLA dead-code-eliminated (its outputs were not threaded out of the step)
and an engine path that bypassed the canary wrapper.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .errors import CanaryHealthError
from ..consts import tag_name


class HealthCheck:
    """Feed it the decoded kernel-run counters of each monitored step (``int64[D, num_tags]``).

    ``interval``: steps between checks (0 disables). ``expected_tags``: tags that must run in every
    window. ``observe`` raises ``CanaryHealthError`` naming the tags (and device) that did not move.
    ``checks`` counts the checks made; ``ok`` is False once one failed.
    """

    def __init__(self, interval: int, expected_tags: Sequence[int]):
        self.interval = int(interval)
        self.expected_tags = tuple(int(t) for t in expected_tags)
        self._base_step: Optional[int] = None
        self._base: Optional[np.ndarray] = None
        self.checks = 0
        self.ok = True

    def next_due(self, step: int) -> float:
        """The first step from ``step`` on at which ``observe`` checks (or takes its first
        baseline): ``step`` itself before the first baseline, infinity when disabled."""
        if not self.interval or not self.expected_tags:
            return float("inf")
        return step if self._base is None else self._base_step + self.interval

    def observe(self, step: int, kernel_runs: np.ndarray) -> None:
        if not self.interval or not self.expected_tags:
            return
        runs = np.atleast_2d(np.asarray(kernel_runs, dtype=np.int64))
        if self._base is None:
            self._base_step, self._base = step, runs.copy()
            return
        if step - self._base_step < self.interval:
            return
        self.checks += 1
        tags = list(self.expected_tags)
        stuck = runs[:, tags] == self._base[:, tags]
        window = step - self._base_step
        self._base_step, self._base = step, runs.copy()
        if stuck.any():
            missing = [(int(d), tags[int(k)]) for d, k in zip(*np.nonzero(stuck))]
            self.ok = False
            multi = runs.shape[0] > 1
            names = ", ".join(tag_name(t) + (f"@device{d}" if multi else "") for d, t in missing)
            raise CanaryHealthError(
                f"kv-canary: health check failed at step {step}: the kernel-run counters of {names} "
                f"did not move in the last {window} steps; the canary was dead-code-eliminated "
                "(its outputs were not threaded out of the step) or its wrapper was bypassed",
                missing_tags=tuple(t for _, t in missing), step=step)
