"""The canary's cost in sglang-jax's own HTTP server: output tokens/s with the canary on vs off.

    python -m bench.sglang_jax_server [--contexts 256 2048] [--concurrency 8] [--rounds 3]
        [--requests-per-client 3] [--max-new-tokens 64] [--model DIR] [--out DIR]

Needs sglang-jax (its main branch) in this environment; runs on the CPU with the tiny Qwen2 of
``tests/support/tiny_qwen2.py`` unless ``--model`` names another model directory. For each context
length (prompt tokens), rounds of two server runs alternate (off then on, then on then off, ...):
each starts the launcher (``--kv-canary none`` or ``log``) with the same engine arguments, times one
first request, then runs a bounded load: ``--concurrency`` HTTP clients each send
``--requests-per-client`` distinct fixed prompts of that length, one after the other, with
``--max-new-tokens`` (greedy, no early stop), and the server is stopped by its process group.
Both modes run the launcher of ``tests.support.launch_with_stand_ins``, whose copy of each step's
page table (``cpu_stand_ins.own_page_table_buffers``) removes sglang-jax's CPU page-table race
under the overlap scheduler (README): on the stock build concurrent clients read other batches'
tables now and then, the canary reports it, and a clean benchmark would measure the reporting.

Measured per run: output tokens/s over the load (all clients' tokens / wall time), the scheduler's
time per decode step (its ``Decode batch`` log lines with every client running: ``#running-req``
/ ``gen throughput``), the first request's latency, and, canary on, the canary's host work per step
(the CPU time of the canary's code on the scheduler process's threads: the model wrapper, the
engine's call excluded, and the scheduler hooks; the launcher logs it with
``--kv-canary-stats-interval``). Reported per context: medians over the rounds and the median of
the per-round on/off ratios; targets: throughput on/off >= 0.95, host work <= 0.1 ms per step.
Writes ``sglang-jax-server-<date>.json`` and ``.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from tests.support.sglang_server import STAND_INS, Server
from tests.support.tiny_qwen2 import VOCAB_SIZE, write_tiny_qwen2

DECODE_RE = re.compile(r"Decode batch\. #running-req: (\d+),.*?gen throughput \(token/s\): ([\d.]+)")
HOST_RE = re.compile(r"; canary time per step over the last (\d+) steps: median ([\d.]+) us, "
                     r"p90 ([\d.]+) us, mean ([\d.]+) us")
TARGET_RATIO = 0.95
TARGET_HOST_US = 100.0


def engine_args(model: str, context: int, concurrency: int, max_new: int) -> list:
    per_req = context + max_new + 8
    tokens = concurrency * per_req + 64
    chunk = max(512, min(4096, context))
    return ["--model-path", model, "--device", "cpu", "--attention-backend", "native",
            "--skip-server-warmup", "--dtype", "float32", "--mem-fraction-static", "0.1",
            "--max-total-tokens", str(tokens), "--max-running-requests", str(concurrency),
            "--context-length", str(per_req + 8), "--chunked-prefill-size", str(chunk),
            "--max-prefill-tokens", str(chunk), "--precompile-bs-paddings", str(concurrency),
            "--precompile-token-paddings", str(chunk), "--random-seed", "42",
            "--decode-log-interval", "8", "--page-size", "1"]


def prompts(context: int, n: int, seed: int) -> list:
    """``n`` distinct fixed prompts of ``context`` token ids (no prefix-cache hits between them)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, VOCAB_SIZE, context)] for _ in range(n)]


def run_load(srv: Server, prompt_ids: list, concurrency: int, max_new: int) -> dict:
    """The load: ``concurrency`` clients, each sending its share of ``prompt_ids`` in turn."""
    params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    counts, errors = [0] * concurrency, []

    def client(i):
        try:
            for ids in prompt_ids[i::concurrency]:
                r = srv.post("/generate", {"input_ids": ids, "sampling_params": params}, timeout=900)
                counts[i] += int(r["meta_info"]["completion_tokens"])
        except Exception as e:  # a failed request fails the run
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"load failed: {errors[0]!r}")
    return {"tokens": sum(counts), "seconds": wall, "tokens_per_s": sum(counts) / wall}


def one_run(mode: str, model: str, context: int, args, workdir: str, round_no: int) -> dict:
    log = os.path.join(workdir, f"ctx{context}-r{round_no}-{mode}.log")
    extra = ["--kv-canary", mode] + (["--kv-canary-stats-interval", "32"] if mode != "none" else [])
    srv = Server(extra + engine_args(model, context, args.concurrency, args.max_new_tokens), log,
                 module=STAND_INS)
    srv.start()
    try:
        first_ids = prompts(context, 1, seed=10_000 + context)[0]
        t0 = time.perf_counter()
        srv.post("/generate", {"input_ids": first_ids, "sampling_params": {
            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}, timeout=900)
        first = time.perf_counter() - t0
        load = run_load(srv, prompts(context, args.concurrency * args.requests_per_client,
                                     seed=context), args.concurrency, args.max_new_tokens)
        time.sleep(0.5)
        text = srv.log()
    finally:
        srv.stop()
    steps = [int(n) / float(x) for n, x in DECODE_RE.findall(text)
             if int(n) == args.concurrency and float(x) > 0]
    host = HOST_RE.findall(text)
    rec = {"mode": mode, "context": context, "round": round_no, "start_s": srv.start_seconds,
           "first_request_s": first, **load,
           "decode_step_ms": 1e3 * statistics.median(steps) if steps else None,
           "decode_step_samples": len(steps),
           "violations": text.count("kv_canary violation"), "log": log}
    if host:
        n, med, p90, mean = host[-1]
        rec.update(host_steps=int(n), host_median_us=float(med), host_p90_us=float(p90),
                   host_mean_us=float(mean))
    print(f"  ctx {context} round {round_no} {mode:4s}: {rec['tokens_per_s']:.1f} tok/s, decode step "
          f"{rec['decode_step_ms'] or float('nan'):.2f} ms, first request {first * 1e3:.0f} ms"
          + (f", canary time per step median {rec['host_median_us']:.1f} us" if host else ""),
          flush=True)
    return rec


def summarize(runs: list, args) -> list:
    rows = []
    for context in args.contexts:
        by_round = {}
        for r in runs:
            if r["context"] == context:
                by_round.setdefault(r["round"], {})[r["mode"]] = r
        pairs = [v for v in by_round.values() if "none" in v and "log" in v]
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        ratio = med([p["log"]["tokens_per_s"] / p["none"]["tokens_per_s"] for p in pairs])
        first = med([p["log"]["first_request_s"] / p["none"]["first_request_s"] for p in pairs])
        host = med([p["log"]["host_median_us"] for p in pairs if "host_median_us" in p["log"]])
        rows.append({
            "context": context, "rounds": len(pairs),
            "tok_s_off": med([p["none"]["tokens_per_s"] for p in pairs]),
            "tok_s_on": med([p["log"]["tokens_per_s"] for p in pairs]),
            "ratio": ratio,
            "step_ms_off": med([p["none"]["decode_step_ms"] for p in pairs
                                if p["none"]["decode_step_ms"]]),
            "step_ms_on": med([p["log"]["decode_step_ms"] for p in pairs
                               if p["log"]["decode_step_ms"]]),
            "host_us": host, "first_ratio": first,
            "first_ms_off": med([1e3 * p["none"]["first_request_s"] for p in pairs]),
            "first_ms_on": med([1e3 * p["log"]["first_request_s"] for p in pairs]),
            "violations": sum(p["log"]["violations"] for p in pairs),
            "ratio_ok": ratio is not None and ratio >= TARGET_RATIO,
            "host_ok": host is not None and host <= TARGET_HOST_US,
        })
    return rows


def markdown(rows: list, meta: dict) -> str:
    out = [f"# sglang-jax server: canary on vs off ({meta['date']})", "",
           f"`python -m bench.sglang_jax_server {' '.join(meta['argv'])}`; sglang-jax "
           f"{meta['sglang_jax']}, jax {meta['jax']}, {meta['cpu']} ({meta['cores']} cores); "
           f"{meta['concurrency']} concurrent clients x {meta['requests_per_client']} requests, "
           f"{meta['max_new_tokens']} new tokens each, overlap scheduler, page size 1, real-KV "
           "partial; medians over the rounds, ratio = median of per-round on/off.", "",
           "| prompt tokens | rounds | tok/s off | tok/s on | on/off | decode step off (ms) | "
           "decode step on (ms) | canary time / step (us) | first request off / on (ms) | "
           "violations |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    f = lambda x, d=2: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    for r in rows:
        out.append(f"| {r['context']} | {r['rounds']} | {f(r['tok_s_off'], 1)} | "
                   f"{f(r['tok_s_on'], 1)} | {f(r['ratio'], 3)} | {f(r['step_ms_off'])} | "
                   f"{f(r['step_ms_on'])} | {f(r['host_us'], 1)} | {f(r['first_ms_off'], 0)} / "
                   f"{f(r['first_ms_on'], 0)} | {r['violations']} |")
    out += ["", f"Targets: throughput on/off >= {TARGET_RATIO} "
            + ", ".join(f"(prompt {r['context']}: {'PASS' if r['ratio_ok'] else 'FAIL'})"
                        for r in rows)
            + f"; canary host work <= {TARGET_HOST_US:.0f} us per step "
            + ", ".join(f"(prompt {r['context']}: {'PASS' if r['host_ok'] else 'FAIL'})"
                        for r in rows) + "."]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 2048])
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests-per-client", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default=None, help="model directory (default: the tiny Qwen2)")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)

    import jax
    import sgl_jax  # noqa: F401  (fails here without sglang-jax)
    from importlib.metadata import version

    workdir = tempfile.mkdtemp(prefix="kvc-sgl-bench-")
    model = args.model or write_tiny_qwen2(os.path.join(workdir, "tiny-qwen2"))
    runs = []
    for context in args.contexts:
        for k in range(args.rounds):
            for mode in (("none", "log") if k % 2 == 0 else ("log", "none")):
                runs.append(one_run(mode, model, context, args, workdir, k))
    rows = summarize(runs, args)
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"],
                         capture_output=True, text=True).stdout.strip() or "unknown CPU"
    meta = {"date": datetime.date.today().isoformat(), "argv": argv, "jax": jax.__version__,
            "sglang_jax": version("sglang-jax"), "cpu": cpu, "cores": os.cpu_count(),
            "concurrency": args.concurrency, "requests_per_client": args.requests_per_client,
            "max_new_tokens": args.max_new_tokens}
    text = markdown(rows, meta)
    print("\n" + text)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"sglang-jax-server-{meta['date']}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "summary": rows, "runs": runs}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(text)
    print(f"wrote {stem}.json and {stem}.md")
    return 0 if all(r["ratio_ok"] and r["host_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
