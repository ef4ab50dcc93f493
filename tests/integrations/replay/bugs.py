"""The real sglang-jax KV bugs the suite replays: each re-introduced by a patch under ``patches/``
(whose header names the upstream issue and fix and says how the patch re-creates it), with the
engine settings and the workload that trigger it."""

from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

from tests.support.sglang_server import LAUNCHER, STAND_INS, TINY_ENGINE_ARGS

from .runner import Workload

#: prompts one at a time on a 512-slot pool: A is backed up to the host when hit, evicted by the
#: long B, recomputed when the device has no room to load it back (reviving its tombstone), then
#: hit again after other requests took slots
HICACHE_SEQUENCE = (("A", 60), ("A", 60), ("C", 60), ("B", 440), ("D", 60), ("D", 60), ("A", 60),
                    ("B", 440), ("D", 60), ("A", 60), ("B", 440), ("C", 60), ("A", 60))

#: PD, one at a time: prompts longer than a prefill chunk (256 tokens: two chunks each) among
#: short ones, a row reused by a later long prompt
PD_SEQUENCE = (("P", 400), ("Q", 60), ("R", 300), ("P", 400), ("S", 500), ("Q", 60), ("T", 200))

#: the write-input assert and the token check
TOKEN_FLAGS = ("--kv-canary-write-input-assert", "--kv-canary-token-check")


def engine_args(**changes) -> Tuple[str, ...]:
    """``TINY_ENGINE_ARGS`` with flags changed (``max_running_requests="8"``: ``--max-running-requests
    8``; a tuple value for several values; None drops the flag) or added."""
    args = list(TINY_ENGINE_ARGS)
    for key, value in changes.items():
        flag = "--" + key.replace("_", "-")
        if flag in args:
            i = args.index(flag)
            j = i + 1
            while j < len(args) and not args[j].startswith("--"):
                j += 1
            del args[i:j]
        if value is not None:
            args += [flag, *((value,) if isinstance(value, str) else value)]
    return tuple(args)


@dataclasses.dataclass(frozen=True)
class Bug:
    """A real sglang-jax KV bug, re-introduced by ``patch`` (or the snapshot's own, fixed by
    ``fix``).

    Attributes:
      key: the upstream number the suite names it by.
      upstream: the upstream issue / PR and the commit that fixed it.
      damages: what it damages, in a few words.
      patch: the file under ``patches/`` that re-introduces it; "" when the snapshot has it.
      fix: for a bug the snapshot has, the file under ``patches/`` that fixes it (the fixed
        build and the reference answers apply it).
      devices: forced host devices for the servers (data-parallel attention needs several).
      engine_args: sglang-jax's arguments for the replay (the overlap scheduler unless they say).
      canary_args: the canary's arguments besides ``--kv-canary MODE``.
      workload: what the replay sends.
      launcher: the module that starts the server (the kv-canary launcher, or the same with the
        CPU stand-ins of sglang-jax's TPU-only kernels for features that need them).
      pd: a PD setup instead of one server (prefill and decode engines both with
        ``engine_args`` and the canary, requests through the router).
      model: the tiny model served (``runner.MODELS``).
      ends_server: how the engine itself ends the bug's server after the damage (an error of its
        own, canary on or off), or "" when the bug's server serves on. Where set, that end and
        the requests it leaves unanswered are expected of the bug's build, never of the fixed
        build; every answer delivered before it is held to the same promise.
    """

    key: str
    upstream: str
    damages: str
    patch: str
    engine_args: Tuple[str, ...]
    canary_args: Tuple[str, ...] = TOKEN_FLAGS
    workload: Workload = Workload()
    launcher: str = LAUNCHER
    pd: bool = False
    model: str = "tiny-qwen2"
    ends_server: str = ""
    fix: str = ""
    devices: int = 1


BUGS: Dict[str, Bug] = {b.key: b for b in (
    Bug("1504", "#1487 / PR #1504, fix cfcbf85f",
        "first decode consumes another batch's token (overlap future-token ring wraps)",
        "1504-future-token-ring-wrap.patch",
        engine_args(max_running_requests="8", precompile_bs_paddings=("1", "4", "8"))),
    Bug("994", "PR #994, fix 5b7150bd",
        "a finished request's next slot freed twice (overlap): two owners of one slot",
        "994-overlap-finished-double-free.patch",
        engine_args(max_running_requests="8", precompile_bs_paddings=("1", "4", "8"),
                    max_total_tokens="512"),
        workload=Workload(shared_prefixes=4)),
    Bug("1008", "PR #1008, fix 00c60d51",
        "a chunked request's req_to_token row freed and reused between its chunks",
        "1008-chunked-req-row-freed.patch",
        engine_args(), workload=Workload(shared_prefixes=4)),
    Bug("1618", "#1618 (fix PR #1648)",
        "a revived HiCache prefix's slots freed while the radix tree serves them",
        "1618-hicache-revive-frees-adopted-slots.patch",
        engine_args(max_total_tokens="512", chunked_prefill_size="512",
                    precompile_token_paddings=("64", "512"), hicache_storage="none",
                    hicache_ratio="8"),
        workload=Workload(new_tokens=8, sequence=HICACHE_SEQUENCE), launcher=STAND_INS),
    Bug("1366", "PR #1366 (d2ef476a, in 1c03ee49; symptom in PR #1386)",
        "PD prefill sends a chunked prompt's KV after its first chunk: decode gets stale pages",
        "1366-pd-prefill-sends-first-chunk.patch",
        engine_args(page_size="128", disable_radix_cache=(), chunked_prefill_size="256",
                    precompile_token_paddings="256"),
        workload=Workload(new_tokens=8, sequence=PD_SEQUENCE), launcher=STAND_INS, pd=True),
    Bug("1355", "#1266 / PR #1355 (in main's add_chunked_req)",
        "hybrid SWA: a chunked prompt's uncomputed tail taken as its cached prefix when the SWA "
        "pool has no budget for its next chunk",
        "1355-swa-chunked-fill-ids-kept.patch",
        engine_args(swa_full_tokens_ratio="0.05"),
        workload=Workload(new_tokens=40, shared_prefixes=4), launcher=STAND_INS,
        model="tiny-gemma2",
        ends_server="the radix tree then holds slots the request never wrote and frees them, "
                    "and the engine's own checks end the scheduler (its memory-leak check, or "
                    "'Out of memory' when the SWA pool's count has gone wrong)"),
    Bug("cpu-dp", "sglang-jax main as vendored (no upstream issue found; the TPU path is per rank)",
        "data-parallel attention off the TPU: rank 1's KV written into rank 0's rows at its "
        "rank-local slot ids, and read from there",
        "", engine_args(tp_size="2", dp_size="2", disable_overlap_schedule=()),
        canary_args=("--kv-canary-sweep-interval", "4"),
        workload=Workload(bursts=3, concurrency=4), fix="fix-cpu-dp-rank-slots.patch",
        devices=2),
)}
