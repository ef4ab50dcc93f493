"""Running one replay: a bug's build and the fixed build under the guarded server, counted.

For a ``bugs.Bug``:

1. **Reference answers**: the fixed build, stock server (``--kv-canary none``, non-overlap
   scheduler), every prompt of the workload one at a time.
2. **The bug in mode ``abort``**: the bug's build with the canary; each phase (without and with
   background CPU load, ``CpuLoad``) sends ``bursts`` bursts of ``concurrency`` concurrent
   ``/generate`` requests (greedy), each burst its own prompts. Every answer is classified against
   the reference (``classify``): right, damaged and delivered as a success (``silent``: the
   promise broken), aborted after a wrong token, aborted before any wrong token, or no answer.
3. **The bug in mode ``log``**: the same phases; each damaged answer must be named by the canary
   (a ``kv-canary: request rid=...`` line for its request id).
4. **The fixed build in mode ``abort``**: the same phases; it must give no damaged answer, no
   violation row and no abort.

A bug whose damage makes the engine end the server by itself (``Bug.ends_server``) is allowed
that end and the requests it leaves unanswered on its own build; every answer it delivered is
held to the same promise, and its fixed build must serve every request.

Servers are the launcher's (``tests.support.sglang_server.Server``) on 127.0.0.1, stopped by their
process group; a PD bug runs a whole PD setup instead (``tests.support.pd_cluster``: prefill and
decode servers guarded alike, requests through its router, both logs read). The load is two busy
processes, stopped the same way, each bounded in time.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from tests.support.pd_cluster import PDCluster
from tests.support.sglang_server import LAUNCHER, Server
from tests.support.tiny_gemma2 import write_tiny_gemma2
from tests.support.tiny_qwen2 import write_tiny_qwen2

from . import builds

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
         "sigma tau upsilon phi chi psi omega cache key value slot token page table canary record "
         "hash chain position request server batch prefix decode prefill").split()

#: the canary's line for each request a violation concerns (mode abort / mode log)
NAMED_RE = re.compile(r"kv-canary: (?:aborting request|request) rid=(\S+) (?:read KV that failed "
                      r"the canary )?at step (\d+)")
ROWS_RE = re.compile(r"kv_canary episode \d+ ended: .* rows=(\d+) ")
ABORT_RE = re.compile(r"kv-canary: aborting request rid=")


#: the tiny models a replay can serve, by name: what writes each (random weights, nothing downloaded)
MODELS = {"tiny-qwen2": write_tiny_qwen2, "tiny-gemma2": write_tiny_gemma2}


def model_path(workdir: str, name: str) -> str:
    """The directory of the tiny model ``name`` (``MODELS``) under ``workdir``, written once."""
    path = os.path.join(workdir, name)
    if not os.path.exists(os.path.join(path, "config.json")):
        MODELS[name](path)
    return path


def words(rng, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def prompts(count: int, seed: int, prefixes: Sequence[str] = ()) -> List[str]:
    """``count`` distinct prompts of 12-40 words (repeatable for a ``seed``); with ``prefixes``,
    prompt ``i`` starts with ``prefixes[i % len(prefixes)]``."""
    import random

    rng = random.Random(seed)
    return [(prefixes[i % len(prefixes)] + " " if prefixes else "")
            + f"request {seed}-{i}: " + words(rng, 12, 40) for i in range(count)]


class CpuLoad:
    """Background load: ``procs`` busy Python processes (one per core here), each in a process
    group of its own and ending by itself after ``seconds``; ``stop()`` (or leaving the ``with``
    block) kills them by their groups."""

    def __init__(self, procs: int = 2, seconds: float = 900.0):
        self.procs, self.seconds = procs, seconds
        self._p: List[subprocess.Popen] = []

    def start(self) -> "CpuLoad":
        code = f"import time\nend = time.time() + {self.seconds}\nwhile time.time() < end: pass\n"
        self._p = [subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
                   for _ in range(self.procs)]
        return self

    def stop(self) -> None:
        for p in self._p:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        self._p = []

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


@dataclasses.dataclass(frozen=True)
class Workload:
    """Bursts of concurrent greedy ``/generate`` requests, per phase."""

    bursts: int = 3
    concurrency: int = 16
    new_tokens: int = 10
    shared_prefixes: int = 0      # prompts share this many long prefixes (across a phase's bursts)
    identical: bool = False       # every request of a burst sends the same long prompt
    #: instead of bursts: prompts of token ids sent one at a time, ``(name, tokens)`` each (the
    #: same name: the same prompt, within a phase)
    sequence: Tuple[Tuple[str, int], ...] = ()

    def phase_prompts(self, seed: int) -> List[list]:
        """The prompts of each burst of one phase (``seed``: the phase): texts, or for a
        ``sequence`` one-prompt bursts of token-id tuples."""
        import random

        if self.sequence:
            return [[tuple((ord(name[0]) * 7919 + seed * 104729 + i * 31) % 1000 + 10
                           for i in range(n))] for name, n in self.sequence]
        rng = random.Random(seed)
        if self.identical:
            return [[f"burst {seed}-{b}: " + words(rng, 38, 44)] * self.concurrency
                    for b in range(self.bursts)]
        pre = [f"shared {seed}-{k}: " + words(rng, 40, 60) for k in range(self.shared_prefixes)]
        return [prompts(self.concurrency, seed * 100 + b, pre) for b in range(self.bursts)]


def prompt_key(prompt) -> str:
    """A prompt (text, or a tuple of token ids) as a key of the reference answers."""
    return prompt if isinstance(prompt, str) else json.dumps(list(prompt))


def generate(srv: Server, prompt, new_tokens: int, timeout: float = 600) -> dict:
    """One greedy ``/generate`` of a text or of token ids."""
    body = {"text": prompt} if isinstance(prompt, str) else {"input_ids": list(prompt)}
    body["sampling_params"] = {"max_new_tokens": new_tokens, "temperature": 0}
    return srv.post("/generate", body, timeout=timeout)


def burst(srv: Server, texts: Sequence, new_tokens: int) -> list:
    """Send ``texts`` (prompts) as concurrent ``/generate`` requests; each reply (dict) or the
    exception."""
    out: list = [None] * len(texts)

    def go(i):
        try:
            out[i] = generate(srv, texts[i], new_tokens)
        except Exception as e:            # noqa: BLE001 (an HTTP failure is a result here)
            out[i] = e

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def classify(reply, reference: List[int]) -> str:
    """``right``, ``silent`` (damaged, delivered as a success), ``aborted`` (aborted, and what it
    delivered already differs from the reference), ``aborted_early`` (aborted before any wrong
    token: what it delivered is right so far) or ``error`` (no HTTP answer)."""
    if isinstance(reply, Exception) or reply is None or "output_ids" not in reply:
        return "error"                     # no answer (an error body when the engine has ended)
    out = reply["output_ids"]
    if reply["meta_info"]["finish_reason"]["type"] == "abort":
        return "aborted_early" if out == reference[:len(out)] else "aborted"
    return "right" if out == reference else "silent"


@dataclasses.dataclass
class PhaseResult:
    """One phase of one server: its answers counted, and what the log says of them."""

    build: str                  # "bug" or "fixed"
    mode: str                   # "abort" or "log"
    load: bool
    requests: int = 0
    counts: Dict[str, int] = dataclasses.field(default_factory=dict)
    kinds: Dict[str, str] = dataclasses.field(default_factory=dict)     # rid -> classify()
    named_rids: List[str] = dataclasses.field(default_factory=list)
    rows: int = 0
    aborts: int = 0
    first_step: Optional[int] = None
    server_died: bool = False

    @property
    def damaged(self) -> int:
        return self.counts.get("silent", 0) + self.counts.get("aborted", 0)

    @property
    def unnamed_damaged(self) -> int:
        """Damaged answers the canary's log does not name."""
        return sum(kind in ("silent", "aborted") and rid not in self.named_rids
                   for rid, kind in self.kinds.items())

    @property
    def named_right(self) -> int:
        """Requests the canary named whose answer came out right all the same."""
        return sum(self.kinds.get(rid) == "right" for rid in set(self.named_rids))


@contextlib.contextmanager
def serving(model_dir: str, engine_args: Sequence[str], args: Sequence[str], log_dir: str,
            name: str, env: dict, launcher: str = LAUNCHER, pd: bool = False):
    """The server of one run, ``(client, logs, died)``: the ``Server`` that takes the requests,
    a function giving the logs of the guarded processes, and one saying whether any of them
    ended. ``pd``: a PD setup, ``args`` on both engines."""
    if pd:
        with PDCluster(model_dir, log_dir, args, args, name=name, env=env,
                       engine_args=engine_args) as cluster:
            yield (cluster.router, cluster.logs,
                   lambda: any(s.proc.poll() is not None for s in (cluster.prefill,
                                                                    cluster.decode)))
        return
    with Server(["--model-path", model_dir, *engine_args, *args],
                os.path.join(log_dir, f"{name}.log"), env=env, module=launcher) as srv:
        yield srv, lambda: [srv.log()], lambda: srv.proc.poll() is not None


def reference_answers(model_dir: str, engine_args: Sequence[str], workload: Workload,
                      phases: Sequence[bool], workdir: str, log_dir: str,
                      fixtures: Sequence[str] = builds.FIXTURES,
                      launcher: str = LAUNCHER, pd: bool = False,
                      env: Optional[dict] = None) -> Dict[str, list]:
    """The stock answers of the build with ``fixtures`` (the fixed build) to every prompt of the
    phases, one at a time (cached in ``workdir`` by build, engine arguments and workload), by
    ``prompt_key``; ``env``: more environment for the server."""
    key = json.dumps([os.path.basename(model_dir), list(fixtures), list(engine_args),
                      dataclasses.asdict(workload), list(phases), launcher, pd, env or {}])
    path = os.path.join(workdir, f"reference-{hashlib.sha1(key.encode()).hexdigest()[:10]}.json")
    if os.path.exists(path):
        with open(path) as f:
            cached = json.load(f)
        if cached["key"] == key:
            return cached["answers"]
    build = builds.make_build(workdir, (), fixtures)
    answers = {}
    with serving(model_dir, engine_args, ["--kv-canary", "none", "--disable-overlap-schedule"],
                 log_dir, "reference", dict(build.env, **(env or {})), launcher,
                 pd) as (srv, _, _):
        for seed, _ in enumerate(phases):
            for texts in workload.phase_prompts(seed):
                for t in texts:
                    if prompt_key(t) not in answers:
                        answers[prompt_key(t)] = generate(srv, t, workload.new_tokens)["output_ids"]
    with open(path, "w") as f:
        json.dump({"key": key, "answers": answers}, f)
    return answers


def run_server(build: builds.Build, label: str, mode: str, model_dir: str,
               engine_args: Sequence[str], canary_args: Sequence[str], workload: Workload,
               phases: Sequence[bool], reference: Dict[str, list], log_dir: str,
               launcher: str = LAUNCHER, pd: bool = False,
               first_seed: int = 0, env: Optional[dict] = None) -> List[PhaseResult]:
    """One guarded server (or PD setup) of ``build`` in ``mode``; one ``PhaseResult`` per phase
    (``phases``: whether each runs under ``CpuLoad``; the phases' prompts are those of seeds
    ``first_seed``, ``first_seed + 1``, ...; ``env``: more environment for the server)."""
    results = []
    name = f"{label}-{mode}" + (f"-{first_seed}" if first_seed else "")
    with serving(model_dir, engine_args, ["--kv-canary", mode, *canary_args], log_dir,
                 name, dict(build.env, **(env or {})), launcher, pd) as (srv, logs, died):
        for seed, loaded in enumerate(phases, start=first_seed):
            res = PhaseResult(label, mode, loaded)
            start = [len(text) for text in logs()]
            with (CpuLoad() if loaded else _Nothing()):
                for texts in workload.phase_prompts(seed):
                    for text, reply in zip(texts, burst(srv, texts, workload.new_tokens)):
                        kind = classify(reply, reference[prompt_key(text)])
                        res.requests += 1
                        res.counts[kind] = res.counts.get(kind, 0) + 1
                        if kind != "error":
                            res.kinds[reply["meta_info"]["id"]] = kind
            # idle: the last readbacks are decoded and the episodes end with their row counts
            time.sleep(3.0)
            log = "".join(text[at:] for text, at in zip(logs(), start))
            named = NAMED_RE.findall(log)
            res.named_rids = [rid for rid, _ in named]
            res.first_step = min((int(s) for _, s in named), default=None)
            res.rows = sum(int(n) for n in ROWS_RE.findall(log))
            res.aborts = len(ABORT_RE.findall(log))
            res.server_died = died() or "Traceback" in log
            results.append(res)
    return results


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run_bug(bug, workdir: str, log_dir: str, phases: Sequence[bool],
            bursts: Optional[int] = None) -> dict:
    """Replay ``bug`` (a ``bugs.Bug``) with its model written under ``workdir``; returns its
    results (``summarize`` reads them)."""
    workload = bug.workload if bursts is None else dataclasses.replace(bug.workload, bursts=bursts)
    model_dir = model_path(workdir, bug.model)
    os.makedirs(log_dir, exist_ok=True)
    fix = (bug.fix,) if bug.fix else ()
    devices = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={bug.devices}"}
    reference = reference_answers(model_dir, bug.engine_args, workload, phases, workdir, log_dir,
                                  fixtures=builds.FIXTURES + fix, launcher=bug.launcher,
                                  pd=bug.pd, env=devices if bug.devices > 1 else {})
    bug_build = builds.make_build(workdir, (bug.patch,) if bug.patch else ())
    fixed = builds.make_build(workdir, fix)
    out = {"bug": bug.key, "phases": []}
    # a bug that ends its server gets a server per phase, so that each phase is replayed
    runs = ([(phases, 0)] if not bug.ends_server
            else [((loaded,), seed) for seed, loaded in enumerate(phases)])
    for build, label, mode in ((bug_build, "bug", "abort"), (bug_build, "bug", "log"),
                               (fixed, "fixed", "abort")):
        for run_phases, first_seed in runs:
            for res in run_server(build, f"{bug.key}-{label}", mode, model_dir, bug.engine_args,
                                  bug.canary_args, workload, run_phases, reference, log_dir,
                                  launcher=bug.launcher, pd=bug.pd, first_seed=first_seed,
                                  env=devices if bug.devices > 1 else {}):
                res.build = label
                out["phases"].append(res)
    return out


def summarize(bug, result: dict) -> List[dict]:
    """One table row per load phase: the replay's figures."""
    rows = []
    by = collections.defaultdict(dict)
    for res in result["phases"]:
        by[res.load][(res.build, res.mode)] = res
    for load, runs in sorted(by.items()):
        ab, lg, fx = runs[("bug", "abort")], runs[("bug", "log")], runs[("fixed", "abort")]
        rows.append(dict(
            bug=bug.key, load="busy" if load else "idle", requests=ab.requests,
            damaged=ab.damaged, silent=ab.counts.get("silent", 0),
            aborted=ab.counts.get("aborted", 0) + ab.counts.get("aborted_early", 0),
            aborted_early=ab.counts.get("aborted_early", 0), errors=ab.counts.get("error", 0),
            log_damaged=lg.damaged, log_unnamed=lg.unnamed_damaged, log_named_right=lg.named_right,
            first_step=ab.first_step if ab.first_step is not None else lg.first_step,
            fixed_damaged=fx.damaged, fixed_rows=fx.rows, fixed_aborts=fx.aborts,
            bug_died=ab.server_died or lg.server_died, fixed_died=fx.server_died,
            ends_server=bool(bug.ends_server)))
    return rows
