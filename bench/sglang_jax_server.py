"""The canary's cost in sglang-jax's own HTTP server: canary on vs off, at each load.

    python -m bench.sglang_jax_server [--points 256x8 256x32 2048x8:1 2048x32:1] [--rounds 5]
        [--max-new-tokens 64] [--model DIR] [--out DIR]
    python -m bench.sglang_jax_server --merge A.json B.json [--out DIR]

Needs sglang-jax (its main branch) in this environment; runs on the CPU with the tiny Qwen2 of
``tests/support/tiny_qwen2.py`` unless ``--model`` names another model directory. For each point
(prompt tokens x concurrent clients, ``--points``), rounds of two server runs alternate (off then on, then on
then off, ...): each starts the launcher (``--kv-canary none`` or ``log``) with the same engine
arguments, times one first request, then runs a bounded load: the clients each send their
requests (the point's requests per client) of distinct fixed prompts of
that length, one after the other, with ``--max-new-tokens`` (greedy, no early stop), and the
server is stopped by its process group. ``--merge`` reports the runs of earlier outputs together
(points measured by separate invocations). Both modes run the launcher of
``tests.support.launch_with_stand_ins``, whose copy of each step's page table
(``cpu_stand_ins.own_page_table_buffers``) removes sglang-jax's CPU page-table race under the
overlap scheduler (README): on the stock build concurrent clients read other batches' tables now
and then, the canary reports it, and a clean benchmark would measure the reporting.

Measured per run: output tokens/s over the load (all clients' tokens / wall time), the scheduler's
time per decode step (its ``Decode batch`` log lines with every client running: ``#running-req``
/ ``gen throughput``), the first request's latency, and, canary on, the canary's host work per step
(the CPU time of the canary's code on the scheduler process's threads: the model wrapper, the
engine's call excluded, and the scheduler hooks; the launcher logs its median and p90 over the
last steps with ``--kv-canary-stats-interval``). Per point: the median and the spread (min-max)
of the per-round on/off ratios of tokens/s and of the decode step, and the medians over the
rounds of the host work's median and p90. Targets, each at every point: tokens/s on/off >= 0.97,
decode step on/off <= 1.02, host work median <= 100 us and p90 <= 150 us per step. Writes
``sglang-jax-server-<date>-<points>.json`` (after each run, so an interrupted bench keeps
its runs), ``.md`` and ``.png`` (on/off ratios and host work
against clients, a line per prompt length; needs matplotlib) to ``--out``; exit code 1 when a
target is missed.
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
#: the target limits
TARGET_TOKS_RATIO = 0.97
TARGET_STEP_RATIO = 1.02
TARGET_HOST_MEDIAN_US = 100.0
TARGET_HOST_P90_US = 150.0
#: the points the issue's targets name: prompt tokens x clients : requests per client
DEFAULT_POINTS = ("256x8:3", "256x32:3", "2048x8:1", "2048x32:1")


def engine_args(model: str, context: int, clients: int, max_new: int) -> list:
    per_req = context + max_new + 8
    tokens = clients * per_req + 64
    chunk = max(512, min(4096, context))
    return ["--model-path", model, "--device", "cpu", "--attention-backend", "native",
            "--skip-server-warmup", "--dtype", "float32", "--mem-fraction-static", "0.1",
            "--max-total-tokens", str(tokens), "--max-running-requests", str(clients),
            "--context-length", str(per_req + 8), "--chunked-prefill-size", str(chunk),
            "--max-prefill-tokens", str(chunk), "--precompile-bs-paddings", str(clients),
            "--precompile-token-paddings", str(chunk), "--random-seed", "42",
            "--decode-log-interval", "8", "--page-size", "1"]


def prompts(context: int, n: int, seed: int) -> list:
    """``n`` distinct fixed prompts of ``context`` token ids (no prefix-cache hits between them)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, VOCAB_SIZE, context)] for _ in range(n)]


def run_load(srv: Server, prompt_ids: list, clients: int, max_new: int) -> dict:
    """The load: ``clients`` clients, each sending its share of ``prompt_ids`` in turn."""
    params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    counts, errors = [0] * clients, []

    def client(i):
        try:
            for ids in prompt_ids[i::clients]:
                r = srv.post("/generate", {"input_ids": ids, "sampling_params": params}, timeout=900)
                counts[i] += int(r["meta_info"]["completion_tokens"])
        except Exception as e:  # a failed request fails the run
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"load failed: {errors[0]!r}")
    return {"tokens": sum(counts), "seconds": wall, "tokens_per_s": sum(counts) / wall}


def one_run(mode: str, model: str, point: dict, args, workdir: str, round_no: int) -> dict:
    context, clients, per_client = point["context"], point["clients"], point["requests_per_client"]
    log = os.path.join(workdir, f"ctx{context}-c{clients}-r{round_no}-{mode}.log")
    extra = ["--kv-canary", mode] + (["--kv-canary-stats-interval", "32"] if mode != "none" else [])
    srv = Server(extra + engine_args(model, context, clients, args.max_new_tokens), log,
                 module=STAND_INS)
    srv.start()
    try:
        first_ids = prompts(context, 1, seed=10_000 + context)[0]
        t0 = time.perf_counter()
        srv.post("/generate", {"input_ids": first_ids, "sampling_params": {
            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}, timeout=900)
        first = time.perf_counter() - t0
        load = run_load(srv, prompts(context, clients * per_client, seed=context), clients,
                        args.max_new_tokens)
        time.sleep(0.5)
        text = srv.log()
    finally:
        srv.stop()
    steps = [int(n) / float(x) for n, x in DECODE_RE.findall(text)
             if int(n) == clients and float(x) > 0]
    host = HOST_RE.findall(text)
    rec = {"mode": mode, **point, "round": round_no, "start_s": srv.start_seconds,
           "first_request_s": first, **load,
           "decode_step_ms": 1e3 * statistics.median(steps) if steps else None,
           "decode_step_samples": len(steps),
           "violations": text.count("kv_canary violation"), "log": log}
    if host:
        n, med, p90, mean = host[-1]
        rec.update(host_steps=int(n), host_median_us=float(med), host_p90_us=float(p90),
                   host_mean_us=float(mean))
    print(f"  ctx {context} clients {clients} round {round_no} {mode:4s}: "
          f"{rec['tokens_per_s']:.1f} tok/s, decode step "
          f"{rec['decode_step_ms'] or float('nan'):.2f} ms, first request {first * 1e3:.0f} ms"
          + (f", canary time per step median {rec['host_median_us']:.1f} us, "
             f"p90 {rec['host_p90_us']:.1f} us" if host else ""), flush=True)
    return rec


def _spread(xs: list) -> dict:
    """``{"median", "min", "max"}`` of ``xs`` (None values dropped; all None without any)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


#: the targets, each judged at every point on the median over the rounds: (key, the summary's
#: figure, at most (else at least), limit, what it is)
TARGETS = (("toks_ratio", "toks_ratio", False, TARGET_TOKS_RATIO, "tokens/s on/off"),
           ("step_ratio", "step_ratio", True, TARGET_STEP_RATIO, "decode step on/off"),
           ("host_median", "host_median_us", True, TARGET_HOST_MEDIAN_US, "host work median"),
           ("host_p90", "host_p90_us", True, TARGET_HOST_P90_US, "host work p90"))


def met(value, at_most: bool, limit: float) -> bool:
    """Whether ``value`` (None: not measured) is within ``limit``."""
    return value is not None and (value <= limit if at_most else value >= limit)


def summarize(runs: list) -> list:
    """One row per point (prompt tokens, clients) of ``runs``: the rounds that have both modes,
    the per-round on/off ratios (median and spread), the host work's medians over the rounds,
    and which targets are met."""
    points = {}
    for r in runs:
        points.setdefault((r["context"], r["clients"]), {}).setdefault(r["round"], {})[
            r["mode"]] = r
    rows = []
    for (context, clients), by_round in points.items():
        pairs = [v for v in by_round.values() if "none" in v and "log" in v]
        med = lambda xs: _spread(xs)["median"]  # noqa: E731
        toks = _spread([p["log"]["tokens_per_s"] / p["none"]["tokens_per_s"] for p in pairs])
        step = _spread([p["log"]["decode_step_ms"] / p["none"]["decode_step_ms"] for p in pairs
                        if p["log"]["decode_step_ms"] and p["none"]["decode_step_ms"]])
        host = _spread([p["log"].get("host_median_us") for p in pairs])
        p90 = _spread([p["log"].get("host_p90_us") for p in pairs])
        figures = {"toks_ratio": toks, "step_ratio": step, "host_median_us": host,
                   "host_p90_us": p90}
        rows.append({
            "context": context, "clients": clients, "rounds": len(pairs),
            "requests_per_client": max(r["requests_per_client"] for v in by_round.values()
                                       for r in v.values()),
            "tok_s_off": med([p["none"]["tokens_per_s"] for p in pairs]),
            "tok_s_on": med([p["log"]["tokens_per_s"] for p in pairs]),
            "step_ms_off": med([p["none"]["decode_step_ms"] for p in pairs]),
            "step_ms_on": med([p["log"]["decode_step_ms"] for p in pairs]),
            **figures,
            "first_ms_off": med([1e3 * p["none"]["first_request_s"] for p in pairs]),
            "first_ms_on": med([1e3 * p["log"]["first_request_s"] for p in pairs]),
            "violations": sum(p["log"]["violations"] + p["none"]["violations"] for p in pairs),
            "ok": {key: met(figures[field]["median"], at_most, limit)
                   for key, field, at_most, limit, _ in TARGETS},
        })
    return rows


def markdown(rows: list, meta: dict) -> str:
    f = lambda x, d=2: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    sp = lambda s, d=3: (f"{f(s['median'], d)} ({f(s['min'], d)}-{f(s['max'], d)})")  # noqa: E731
    out = [f"# sglang-jax server: canary on vs off ({meta['date']})", "",
           f"`python -m bench.sglang_jax_server {' '.join(meta['argv'])}`; sglang-jax "
           f"{meta['sglang_jax']}, jax {meta['jax']}, {meta['cpu']} ({meta['cores']} cores); "
           f"{meta['max_new_tokens']} new tokens per request, overlap scheduler, page size 1, "
           "real-KV partial; ratios: median (min-max) of the per-round on/off ratios; the other "
           "figures: medians over the rounds.", "",
           "| prompt tokens | clients | requests | rounds | tok/s off | tok/s on | tok/s on/off | "
           "decode step off / on (ms) | decode step on/off | host us/step median | "
           "host us/step p90 | first request off / on (ms) | violations |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(
            f"| {r['context']} | {r['clients']} | {r['clients'] * r['requests_per_client']} | "
            f"{r['rounds']} | {f(r['tok_s_off'], 1)} | {f(r['tok_s_on'], 1)} | "
            f"{sp(r['toks_ratio'])} | {f(r['step_ms_off'])} / {f(r['step_ms_on'])} | "
            f"{sp(r['step_ratio'])} | {sp(r['host_median_us'], 1)} | {sp(r['host_p90_us'], 1)} | "
            f"{f(r['first_ms_off'], 0)} / {f(r['first_ms_on'], 0)} | {r['violations']} |")
    out.append("")
    for key, _, at_most, limit, what in TARGETS:
        text = f"{what} {'<=' if at_most else '>='} {limit:g}" + (" us" if "host" in key else "")
        out.append(f"- {text}: " + ", ".join(
            f"{r['context']}x{r['clients']} {'PASS' if r['ok'][key] else 'FAIL'}" for r in rows))
    return "\n".join(out) + "\n"


def plot(rows: list, path: str) -> bool:
    """On/off ratios and host work per step against clients, a line per prompt length; False
    without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for context in sorted({r["context"] for r in rows}):
        pts = sorted((r for r in rows if r["context"] == context), key=lambda r: r["clients"])
        x = [r["clients"] for r in pts]
        for key, style, label in (("toks_ratio", "-o", "tok/s on/off"),
                                  ("step_ratio", "--s", "decode step on/off")):
            med = [r[key]["median"] for r in pts]
            err = [[m - r[key]["min"] for m, r in zip(med, pts)],
                   [r[key]["max"] - m for m, r in zip(med, pts)]]
            axes[0].errorbar(x, med, yerr=err, fmt=style, capsize=3,
                             label=f"{label}, prompt {context}")
        for key, style, label in (("host_median_us", "-o", "median"), ("host_p90_us", "--s", "p90")):
            axes[1].plot(x, [r[key]["median"] for r in pts], style,
                         label=f"{label}, prompt {context}")
    axes[0].axhline(TARGET_TOKS_RATIO, color="grey", lw=0.8)
    axes[0].axhline(TARGET_STEP_RATIO, color="grey", lw=0.8, ls="--")
    axes[0].set_title("canary on / off (median, min-max over rounds)")
    axes[1].axhline(TARGET_HOST_MEDIAN_US, color="grey", lw=0.8)
    axes[1].axhline(TARGET_HOST_P90_US, color="grey", lw=0.8, ls="--")
    axes[1].set_title("canary host work per step (us, CPU time)")
    for ax in axes:
        ax.set_xlabel("concurrent clients")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["clients"] for r in rows}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_point(text: str) -> dict:
    """``PROMPTxCLIENTS[:REQUESTS]`` (requests per client, default 3) -> a point's dict."""
    m = re.fullmatch(r"(\d+)x(\d+)(?::(\d+))?", text)
    if m is None:
        raise argparse.ArgumentTypeError(f"a point is PROMPTxCLIENTS[:REQUESTS_PER_CLIENT] "
                                         f"(e.g. 2048x8:1), got {text!r}")
    return {"context": int(m[1]), "clients": int(m[2]), "requests_per_client": int(m[3] or 3)}


def report(runs: list, meta: dict, stem: str) -> int:
    """Summarize ``runs``, print and write ``stem``.md, .png (and the JSON); 1 when a target is
    missed."""
    rows = summarize(runs)
    text = markdown(rows, meta)
    print("\n" + text)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "summary": rows, "runs": runs}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(text)
    made = plot(rows, stem + ".png")
    print(f"wrote {stem}.json, {stem}.md" + (f" and {stem}.png" if made else
                                              " (no plot: matplotlib not installed)"))
    return 0 if all(all(r["ok"].values()) for r in rows) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--points", type=parse_point, nargs="+", default=[
        parse_point(t) for t in DEFAULT_POINTS], metavar="PROMPTxCLIENTS[:REQUESTS]",
        help="prompt tokens x concurrent clients, and requests per client (default 3)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", default=None, help="model directory (default: the tiny Qwen2)")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="report the runs of these earlier outputs together; runs nothing")
    args = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    os.makedirs(args.out, exist_ok=True)
    date = datetime.date.today().isoformat()
    if args.merge:
        loaded = [json.load(open(path)) for path in args.merge]
        meta = dict(loaded[0]["meta"], date=date, argv=argv,
                    merged=[d["meta"]["argv"] for d in loaded])
        # each file's rounds stay apart (a point measured twice has rounds 0.. in both)
        runs = [dict(r, round=f"{i}.{r['round']}") for i, d in enumerate(loaded) for r in d["runs"]]
        return report(runs, meta,
                      os.path.join(args.out, f"sglang-jax-server-{date}-merged"))

    import jax
    import sgl_jax  # noqa: F401  (fails here without sglang-jax)
    from importlib.metadata import version

    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"],
                         capture_output=True, text=True).stdout.strip() or "unknown CPU"
    meta = {"date": date, "argv": argv, "jax": jax.__version__,
            "sglang_jax": version("sglang-jax"), "cpu": cpu, "cores": os.cpu_count(),
            "max_new_tokens": args.max_new_tokens}
    stem = os.path.join(args.out, f"sglang-jax-server-{date}-" + "-".join(
        f"{q['context']}x{q['clients']}" for q in args.points))
    workdir = tempfile.mkdtemp(prefix="kvc-sgl-bench-")
    model = args.model or write_tiny_qwen2(os.path.join(workdir, "tiny-qwen2"))
    runs = []
    for point in args.points:
        for k in range(args.rounds):
            for mode in (("none", "log") if k % 2 == 0 else ("log", "none")):
                runs.append(one_run(mode, model, point, args, workdir, k))
                with open(stem + ".json", "w") as f:    # kept if the bench is interrupted
                    json.dump({"meta": meta, "runs": runs}, f, indent=1)
    return report(runs, meta, stem)


if __name__ == "__main__":
    sys.exit(main())
