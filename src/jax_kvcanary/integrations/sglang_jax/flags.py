"""The canary's command-line flags for sglang-jax (upstream SGLang's names) and their config."""

from __future__ import annotations

import argparse

from ...runtime.config import CanaryConfig

MODES = ("none", "log", "abort", "raise")
REAL_DATA_CHOICES = ("none", "partial", "all")


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the upstream flags ``--kv-canary none|log|raise``, ``--kv-canary-real-data
    none|partial|all`` and ``--kv-canary-sweep-interval N`` to ``parser`` (returned)."""
    g = parser.add_argument_group("kv-canary")
    g.add_argument("--kv-canary", choices=MODES, default="none",
                   help="KV-cache canary: none (off: the stock server); log each violation and "
                        "keep serving; abort the requests a violation names (their clients get "
                        "an abort with the report), evict the named slots from the prefix cache "
                        "and keep serving the others; or raise on the first (the server ends)")
    g.add_argument("--kv-canary-real-data", choices=REAL_DATA_CHOICES, default="partial",
                   help="fingerprint of layer 0's real KV bytes at TAIL and SWEEP (default: "
                        "partial, 16 bytes of K head 0 and of V head 0 per slot)")
    g.add_argument("--kv-canary-sweep-interval", type=int, default=0, metavar="N",
                   help="verify every slot held by the prefix cache every N steps (0 = never)")
    g.add_argument("--kv-canary-stats-interval", type=int, default=0, metavar="N",
                   help="log the canary's counters and its host work per step every N steps "
                        "(0 = never)")
    return parser


def aborts(ns: argparse.Namespace) -> bool:
    """Whether the flags ask for mode ``abort`` (whose ``CanaryConfig`` mode is ``'log'``: the
    monitor logs, the server's ``RequestAborter`` aborts)."""
    return getattr(ns, "kv_canary", "none") == "abort"


def config_from_args(ns: argparse.Namespace, **overrides) -> CanaryConfig:
    """The ``CanaryConfig`` of parsed flags (see ``add_cli_args``; mode ``abort`` gives ``'log'``,
    see ``aborts``); ``overrides`` set other fields."""
    real = getattr(ns, "kv_canary_real_data", "partial")
    if real not in REAL_DATA_CHOICES:
        raise ValueError(f"kv-canary: --kv-canary-real-data must be one of {REAL_DATA_CHOICES}, "
                         f"got {real!r}")
    mode = "log" if aborts(ns) else getattr(ns, "kv_canary", "none")
    return CanaryConfig(mode=mode, real_kv_hash_mode=real.upper(),
                        sweep_interval=getattr(ns, "kv_canary_sweep_interval", 0),
                        stats_interval=getattr(ns, "kv_canary_stats_interval", 0), **overrides)
