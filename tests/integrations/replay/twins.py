"""Twin runs: two problems this project reported on sglang-jax main, each run with and without a
minimal patch that removes its cause, ``runs`` servers each way, answers and rows counted.

A claim holds when the build with the cause damages answers and the canary reports rows, and the
build without it gives neither. Each patch is one of the suite's fixtures (``builds.FIXTURES``),
so the replays run on builds without these problems.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, List, Tuple

from . import builds, runner
from .bugs import TOKEN_FLAGS, engine_args

CACHE_LOC = "fixture-cpu-cache-loc-copy.patch"
NATIVE_LAYOUT = "fixture-native-page-table-layout.patch"


@dataclasses.dataclass(frozen=True)
class Twin:
    """A claim about sglang-jax main and the patch that removes its cause.

    Attributes:
      key: its name.
      claim: what is claimed.
      with_cause / without_cause: the fixtures of the two builds.
      engine_args, workload, load: the server and what it is sent (``load``: under ``CpuLoad``).
    """

    key: str
    claim: str
    with_cause: Tuple[str, ...]
    without_cause: Tuple[str, ...]
    engine_args: Tuple[str, ...]
    workload: runner.Workload
    load: bool = False


TWINS: Dict[str, Twin] = {t.key: t for t in (
    Twin("cache-loc-alias",
         "the overlap scheduler's reused page-table buffer (cache_loc_host_buf), aliased by JAX "
         "on the CPU, hands a step another batch's table",
         (), (CACHE_LOC,),
         engine_args(max_running_requests="8", precompile_bs_paddings=("1", "4", "8")),
         runner.Workload(bursts=3), load=True),
    Twin("native-page-table",
         "with page size 4 the native backend reads the page-aligned table at unaligned "
         "offsets: a batch's later requests attend to wrong slots",
         (CACHE_LOC,), (CACHE_LOC, NATIVE_LAYOUT),
         engine_args(page_size="4", max_running_requests="8",
                     precompile_bs_paddings=("1", "4", "8")) + ("--disable-overlap-schedule",),
         runner.Workload(bursts=3)),
    Twin("identical-prompts-eviction",
         "two identical ~100-token prompts in one batch under eviction pressure (chunked "
         "prefill 64) gave verify_position / write_position rows on a plain guarded server",
         (), builds.FIXTURES,
         engine_args(max_total_tokens="256"),
         runner.Workload(bursts=6, concurrency=2, identical=True), load=True),
)}


def run_twin(twin: Twin, runs: int, model_dir: str, workdir: str, log_dir: str) -> List[dict]:
    """``runs`` guarded servers (mode ``log``) of each build; a row of counts per build."""
    os.makedirs(log_dir, exist_ok=True)
    phases = (twin.load,)
    reference = runner.reference_answers(model_dir, twin.engine_args, twin.workload, phases,
                                         workdir, log_dir, fixtures=twin.without_cause)
    out = []
    for label, fixtures in (("with cause", twin.with_cause),
                            ("cause removed", twin.without_cause)):
        build = builds.make_build(workdir, (), fixtures)
        row = dict(twin=twin.key, build=label, runs=runs, requests=0, damaged=0, rows=0,
                   runs_with_rows=0, named=0, died=0)
        for i in range(runs):
            name = f"{twin.key}-{label.replace(' ', '-')}-{i}"
            for res in runner.run_server(build, name, "log", model_dir, twin.engine_args,
                                         TOKEN_FLAGS, twin.workload, phases, reference, log_dir):
                row["requests"] += res.requests
                row["damaged"] += res.damaged
                row["rows"] += res.rows
                row["runs_with_rows"] += res.rows > 0
                row["named"] += len(set(res.named_rids))
                row["died"] += res.server_died
        out.append(row)
    return out


def table(rows) -> str:
    cols = ("twin", "build", "runs", "requests", "damaged", "rows", "runs_with_rows", "named",
            "died")
    head = ("twin", "build", "runs", "requests", "damaged answers", "violation rows",
            "runs with rows", "requests named", "servers died")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)
