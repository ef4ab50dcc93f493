"""Host-side decoding of the canary counters and the periodic stats line."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from .. import consts
from ..consts import tag_name


@dataclasses.dataclass
class CounterSnapshot:
    """Counters of one step, per device (``D = 1`` for a single-device engine).

      write_index   int64[D]
      kernel_runs   int64[D, num_tags]   launches per tag
      slot_runs     int64[D, num_tags]   entries processed per tag (verified + written)
      written       int64[D, num_tags]   slots written per tag (from ``CanaryState.written``)
    """

    write_index: np.ndarray
    kernel_runs: np.ndarray
    slot_runs: np.ndarray
    written: np.ndarray

    @property
    def verified(self) -> np.ndarray:
        """int64[D, num_tags]: verify entries per tag (slot runs minus written slots)."""
        return self.slot_runs - self.written

    @classmethod
    def decode(cls, host: np.ndarray, num_tags: int = consts.NUM_LAUNCH_TAGS) -> "CounterSnapshot":
        """Decode the monitor's snapshot bytes ``uint8[D, 4 + 16 T (+ 8 T)]`` (see monitor)."""
        host = np.ascontiguousarray(host, dtype=np.uint8)
        if host.ndim == 1:
            host = host[None]
        t8 = num_tags * 8
        wi = host[:, :4].copy().view("<i4").astype(np.int64).reshape(-1)
        kr = host[:, 4:4 + t8].copy().view("<i8").astype(np.int64)
        sr = host[:, 4 + t8:4 + 2 * t8].copy().view("<i8").astype(np.int64)
        if host.shape[1] >= 4 + 3 * t8:
            pairs = host[:, 4 + 2 * t8:4 + 3 * t8].copy().view("<u4").astype(np.int64)
            pairs = pairs.reshape(host.shape[0], num_tags, 2)
            written = pairs[..., 0] + (pairs[..., 1] << 32)
        else:
            written = np.zeros_like(kr)
        return cls(wi, kr, sr, written)


def format_stats_line(steps: int, violations: int, counters: CounterSnapshot,
                      tags: Sequence[int]) -> str:
    """``kv_canary stats: steps=N violations=V TAG=verified/written ...`` (summed over devices)."""
    ver = counters.verified.sum(axis=0)
    wr = counters.written.sum(axis=0)
    runs = counters.kernel_runs.sum(axis=0)
    parts = [f"kv_canary stats: steps={steps} violations={violations}"]
    for t in tags:
        parts.append(f"{tag_name(t)}=runs:{runs[t]},verified:{ver[t]},written:{wr[t]}")
    return " ".join(parts)
