"""Exceptions raised by the serving runtime (host side)."""

from __future__ import annotations


class CanaryViolationError(RuntimeError):
    """Raised by a ``Monitor`` in ``raise`` mode.

    ``message`` is every new row's report joined by ``\\n``. ``violations`` holds the decoded
    ``Violation`` objects; ``rows`` is ``int64[n, 8]`` (the raw ring rows, oldest first).
    """

    def __init__(self, message: str, violations=()):
        super().__init__(message)
        self.violations = tuple(violations)

    @property
    def rows(self):
        import numpy as np
        if not self.violations:
            return np.zeros((0, 8), np.int64)
        return np.stack([v.row for v in self.violations])


class CanaryHealthError(RuntimeError):
    """A canary endpoint stopped running: an expected tag's kernel-run counter did not move."""

    def __init__(self, message: str, missing_tags=(), step: int = -1):
        super().__init__(message)
        self.missing_tags = tuple(missing_tags)
        self.step = step
