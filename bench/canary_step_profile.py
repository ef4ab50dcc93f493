"""Where the canary's host time per serving step goes, in sglang-jax's own HTTP server.

    python -m bench.canary_step_profile [--context 256] [--concurrency 8] [--requests-per-client 6]
        [--max-new-tokens 64] [--rate 250] [--model DIR] [--out FILE]

Starts the launcher with ``--kv-canary log`` (the engine arguments of ``bench.sglang_jax_server``)
through ``tests.support.launch_with_stand_ins``, whose copy of each step's page table keeps the
overlap scheduler's CPU page-table race (README) out of the profile: with it, concurrent requests
may report thousands of rows, and the profile then measures the reporting. It sends one warm-up
request, then samples the server's processes with ``py-spy`` (``pip install
py-spy``; it reads the processes' stacks from outside, the server runs unchanged) while the bench's
load runs: the thread holding the GIL (``--gil``), i.e. host work in Python and in the C++ that
runs under the GIL (JAX's dispatch), not threads that sleep or wait on the device. Each sample of a
scheduler-process thread is charged to the innermost frame of sglang-jax or of this package on its
stack: this package's frames are the canary's host work (with the JAX dispatches they make),
sglang-jax's the engine's (its model call below the canary's wrapper included; py-spy names some
of its files without the package directory, hence the ``ModelRunner.`` rule and the file names
of ``engine_files`` in ``owner``; the
canary's ``_engine_call`` frame, below which the engine's jitted step runs with no Python frame
of its own, is the engine's too). Prints, per thread, the canary's share, and the canary's functions by
time per serving step (samples / rate / the canary's step count), most first; writes the table as
Markdown to ``--out``. A sampling profile: small entries are noisy, and py-spy's non-blocking
sampling drops some samples (it says how many).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from bench.sglang_jax_server import engine_args, prompts, run_load
from tests.support.sglang_server import Server
from tests.support.tiny_qwen2 import write_tiny_qwen2

FRAME_RE = re.compile(r"^(?P<func>.*) \((?P<file>[^():]+):(?P<line>\d+)\)$")
STEPS_RE = re.compile(r"kv_canary stats: step=(\d+)")
SCHEDULER = '"sglang::scheduler"'
#: the canary's frame that calls the engine's jitted model call (with the canary's checks traced
#: into it: one program, whose dispatch is the engine's, thousands of weight arguments beside the
#: canary state's few): charged to the engine
ENGINE_CALL = "SglangJaxCanary._engine_call"


@functools.lru_cache(maxsize=None)
def engine_files() -> frozenset:
    """The file names of the installed sglang-jax's modules (py-spy names some frames by the
    file name alone); empty without sglang-jax."""
    try:
        import sgl_jax
    except ImportError:
        return frozenset()
    root = os.path.dirname(sgl_jax.__file__)
    return frozenset(f for _, _, fs in os.walk(root) for f in fs if f.endswith(".py"))


def owner(frames: list):
    """``('canary' | 'engine' | None, 'file:function')``: the innermost frame of this package or
    of sglang-jax on a stack (root first)."""
    for frame in reversed(frames):
        m = FRAME_RE.match(frame)
        if not m:
            continue
        path = m.group("file")
        if m.group("func") == ENGINE_CALL:
            return "engine", f"{path}:{m.group('func')}"
        if path.startswith("jax_kvcanary/"):
            return "canary", f"{path}:{m.group('func')}"
        if (path.startswith("sgl_jax/") or m.group("func").startswith("ModelRunner.")
                or ("/" not in path and path in engine_files())):
            return "engine", f"{path}:{m.group('func')}"
    return None, None


def aggregate(raw: str):
    """From py-spy's raw (collapsed) output: ``{thread: Counter(owner kind)}`` and
    ``Counter('file:function')`` of the canary's samples, for the scheduler process's threads."""
    threads = collections.defaultdict(collections.Counter)
    canary = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or SCHEDULER not in stack or not count.isdigit():
            continue                       # another process, or a line py-spy cut short
        frames = stack.split(";")
        thread = next((f for f in frames if f.startswith("thread (")), "thread ?")
        kind, where = owner(frames)
        threads[thread][kind or "other"] += int(count)
        if kind == "canary":
            canary[where] += int(count)
    return threads, canary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests-per-client", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--model", default=None)
    p.add_argument("--out", default=None, help="write the table (Markdown) here")
    args = p.parse_args(argv)
    spy = shutil.which("py-spy")
    if spy is None:
        print("py-spy is not installed (pip install py-spy)", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="kvc-profile-")
    model = args.model or write_tiny_qwen2(os.path.join(work, "tiny-qwen2"))
    srv = Server(["--kv-canary", "log", "--kv-canary-stats-interval", "32"]
                 + engine_args(model, args.context, args.concurrency, args.max_new_tokens),
                 os.path.join(work, "server.log"), module="tests.support.launch_with_stand_ins")
    raw_path = os.path.join(work, "samples.txt")
    srv.start()
    try:
        srv.post("/generate", {"input_ids": prompts(args.context, 1, seed=1)[0], "sampling_params": {
            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}, timeout=900)
        before = STEPS_RE.findall(srv.log())
        sampler = subprocess.Popen([spy, "record", "--pid", str(srv.proc.pid), "--subprocesses",
                                    "--threads", "--gil", "--nonblocking", "--rate", str(args.rate),
                                    "--format", "raw", "--output", raw_path],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        time.sleep(1.0)
        load = run_load(srv, prompts(args.context, args.concurrency * args.requests_per_client,
                                     seed=args.context), args.concurrency, args.max_new_tokens)
        sampler.send_signal(subprocess.signal.SIGINT)
        said = sampler.communicate(timeout=120)[0].decode(errors="replace")
        time.sleep(1.0)
        log = srv.log()
    finally:
        srv.stop()
    steps_seen = STEPS_RE.findall(log)
    steps = int(steps_seen[-1]) - (int(before[-1]) if before else 0) if steps_seen else 0
    with open(raw_path) as f:
        threads, canary = aggregate(f.read())
    dropped = re.search(r"Samples: (\d+) Errors: (\d+)", said)
    lines = [f"# Canary host time per serving step (py-spy, GIL holder, {args.rate} Hz)", "",
             f"`python -m bench.canary_step_profile --context {args.context} --concurrency "
             f"{args.concurrency} --requests-per-client {args.requests_per_client} "
             f"--max-new-tokens {args.max_new_tokens}`: {load['tokens']} tokens in "
             f"{load['seconds']:.1f} s, {steps} canary steps (stats lines); py-spy samples "
             + (f"{dropped.group(1)}, errors {dropped.group(2)}" if dropped else "?")
             + f"; violation lines in the server log: {log.count('kv_canary violation')}.", "",
             "Samples of the scheduler process's threads while they held the GIL, by owner:", "",
             "| scheduler thread | samples | canary | engine | other |", "|---|---:|---:|---:|---:|"]
    for name, c in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(c.values())
        lines.append(f"| {name} | {total} | {c['canary'] / total:.1%} | {c['engine'] / total:.1%} "
                     f"| {c['other'] / total:.1%} |")
    per_step = 1e6 / args.rate / max(steps, 1)
    lines += ["", f"Canary functions (innermost frame of this package; {sum(canary.values())} "
              f"samples = {sum(canary.values()) * per_step:.0f} us per step):", "",
              "| function | samples | us per step |", "|---|---:|---:|"]
    lines += [f"| `{where}` | {n} | {n * per_step:.1f} |" for where, n in canary.most_common(25)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
