"""``python -m tests.integrations.replay``: replay real sglang-jax KV bugs and print the table.

Run from the repository root, with sglang-jax main installed (BUILD.md). Each bug: its build and
the fixed build under the guarded server, without and with background CPU load (``runner``);
``twins``: the problems this project reported on sglang-jax main, with and without their cause
(``twins``). Exit code 1 when a replay breaks its promise (the failures are printed last).

    python -m tests.integrations.replay                   # every bug, both load phases
    python -m tests.integrations.replay --bugs 1504       # some bugs
    python -m tests.integrations.replay twins --runs 3    # the twin runs
    python -m tests.integrations.replay --json out.json --workdir DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

from . import builds, runner, twins
from .bugs import BUGS

COLUMNS = [("bug", "bug"), ("load", "load"), ("requests", "requests"),
           ("damaged", "abort mode: damaged"), ("silent", "delivered without abort"),
           ("aborts", "aborted (before a wrong token)"), ("errors", "no answer"),
           ("log", "log mode: damaged / named / named but right"),
           ("first_step", "first detection (step)"),
           ("fixed", "fixed build: damaged / rows / aborts"),
           ("server", "bug build's server")]


def table(rows) -> str:
    """The replay table (markdown)."""
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |",
             "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for r in rows:
        cells = dict(r, log=(f"{r['log_damaged']} / {r['log_damaged'] - r['log_unnamed']} / "
                             f"{r['log_named_right']}"),
                     aborts=f"{r['aborted']} ({r['aborted_early']})",
                     fixed=f"{r['fixed_damaged']} / {r['fixed_rows']} / {r['fixed_aborts']}",
                     first_step="-" if r["first_step"] is None else r["first_step"],
                     server="ended by the engine" if r["bug_died"] else "served on")
        lines.append("| " + " | ".join(str(cells[k]) for k, _ in COLUMNS) + " |")
    return "\n".join(lines)


def failures(rows) -> list:
    """What breaks the suite's acceptance in ``rows`` (empty: every replay passed)."""
    out = []
    for r in rows:
        where = f"#{r['bug']} ({r['load']})"
        for key, what in (("silent", "damaged answers delivered without abort"),
                          ("log_unnamed", "damaged answers the log does not name"),
                          ("fixed_damaged", "damaged answers from the fixed build"),
                          ("fixed_rows", "violation rows on the fixed build"),
                          ("fixed_aborts", "aborts on the fixed build"),
                          ("errors", "requests without an answer")):
            if r[key] and not (key == "errors" and r["ends_server"]):
                out.append(f"{where}: {r[key]} {what}")
        if r["fixed_died"]:
            out.append(f"{where}: the fixed build's server died or logged a traceback")
        if r["bug_died"] and not r["ends_server"]:
            out.append(f"{where}: the bug build's server died or logged a traceback")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.integrations.replay",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("what", nargs="?", choices=("bugs", "twins"), default="bugs")
    p.add_argument("--bugs", nargs="+", default=sorted(BUGS), choices=sorted(BUGS))
    p.add_argument("--twins", nargs="+", default=list(twins.TWINS), choices=list(twins.TWINS))
    p.add_argument("--runs", type=int, default=3, help="twins: servers per build")
    p.add_argument("--load", choices=("both", "idle", "busy"), default="both",
                   help="run the phases without background load, with it, or both")
    p.add_argument("--bursts", type=int, default=None, help="bursts per phase (default: the bug's)")
    p.add_argument("--workdir", default=None, help="builds, model and reference answers")
    p.add_argument("--logs", default=None, help="where the server logs go (default: workdir/logs)")
    p.add_argument("--json", default=None, help="write the rows and the details here")
    a = p.parse_args(argv)
    workdir = a.workdir or tempfile.mkdtemp(prefix="kvc-replay-")
    logs = a.logs or os.path.join(workdir, "logs")
    phases = {"both": (False, True), "idle": (False,), "busy": (True,)}[a.load]
    print(f"sglang-jax: {builds.installed_package()}; workdir {workdir}", flush=True)
    if a.what == "twins":
        return run_twins(a, runner.model_path(workdir, "tiny-qwen2"), workdir, logs)
    rows, details = [], []
    for key in a.bugs:
        bug = BUGS[key]
        t0 = time.monotonic()
        result = runner.run_bug(bug, workdir, os.path.join(logs, key), phases, a.bursts)
        got = runner.summarize(bug, result)
        rows += got
        details.append({"bug": key, "upstream": bug.upstream, "damages": bug.damages,
                        "patch": bug.patch, "seconds": round(time.monotonic() - t0, 1),
                        "phases": [dataclasses.asdict(r) for r in result["phases"]]})
        print(table(got), f"\n({time.monotonic() - t0:.0f} s; logs in {os.path.join(logs, key)})",
              flush=True)
    print("\n" + table(rows))
    for key in a.bugs:
        print(f"#{key}: {BUGS[key].upstream}: {BUGS[key].damages}")
    bad = failures(rows)
    print("\n" + ("\n".join(bad) if bad else "every replay: no damaged answer delivered without "
                  "abort, every damaged answer named in log mode, fixed builds clean"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "details": details}, f, indent=1)
    return 1 if bad else 0


def run_twins(a, model: str, workdir: str, logs: str) -> int:
    rows = []
    for key in a.twins:
        got = twins.run_twin(twins.TWINS[key], a.runs, model, workdir, os.path.join(logs, key))
        print(twins.table(got), flush=True)
        rows += got
    print("\n" + twins.table(rows))
    for key in a.twins:
        print(f"{key}: {twins.TWINS[key].claim}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"twins": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
