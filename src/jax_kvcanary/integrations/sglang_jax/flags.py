"""The canary's command-line flags for sglang-jax (upstream SGLang's names) and their config."""

from __future__ import annotations

import argparse

from ...runtime.config import CanaryConfig

MODES = ("none", "log", "abort", "raise")
REAL_DATA_CHOICES = ("none", "partial", "all")
#: rows of the violation ring in the server (1 MiB per device): the ring is emptied after every
#: step that recorded rows, so it holds at most the rows of the steps since; a step with more
#: loses the rest (counted, and in mode ``abort`` every request of that step is aborted)
RING_CAPACITY = 1 << 14


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the flags ``--kv-canary none|log|abort|raise``, ``--kv-canary-real-data
    none|partial|all``, ``--kv-canary-sweep-interval N``, ``--kv-canary-stats-interval N``,
    ``--kv-canary-write-input-assert`` and ``--kv-canary-token-check`` to ``parser`` (returned)."""
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
    g.add_argument("--kv-canary-write-input-assert", action="store_true",
                   help="check that every KV entry is written with the token and position the "
                        "scheduler intends for its request (the prompt, then the token sampled "
                        "for it in its previous step): write_token / write_position")
    g.add_argument("--kv-canary-token-check", action="store_true",
                   help="also check every verified slot's stored token against the request's "
                        "token at that position: verify_token")
    return parser


def aborts(ns: argparse.Namespace) -> bool:
    """Whether the flags ask for mode ``abort`` (whose ``CanaryConfig`` mode is ``'log'``: the
    monitor logs, the server's ``request_guard.RequestGuard`` aborts)."""
    return getattr(ns, "kv_canary", "none") == "abort"


def config_from_args(ns: argparse.Namespace, **overrides) -> CanaryConfig:
    """The ``CanaryConfig`` of parsed flags (see ``add_cli_args``; mode ``abort`` gives ``'log'``,
    see ``aborts``); ``overrides`` set other fields."""
    real = getattr(ns, "kv_canary_real_data", "partial")
    if real not in REAL_DATA_CHOICES:
        raise ValueError(f"kv-canary: --kv-canary-real-data must be one of {REAL_DATA_CHOICES}, "
                         f"got {real!r}")
    mode = "log" if aborts(ns) else getattr(ns, "kv_canary", "none")
    overrides.setdefault("ring_capacity", RING_CAPACITY)
    return CanaryConfig(mode=mode, real_kv_hash_mode=real.upper(),
                        sweep_interval=getattr(ns, "kv_canary_sweep_interval", 0),
                        stats_interval=getattr(ns, "kv_canary_stats_interval", 0),
                        write_input_assert=bool(getattr(ns, "kv_canary_write_input_assert", False)),
                        token_check=bool(getattr(ns, "kv_canary_token_check", False)), **overrides)
