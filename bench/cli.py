"""``python -m bench``: the jax_kvcanary benchmark suite.

Sections (all by default, or ``--sections``):
  sweep     per-op throughput vs entries (bs=32) for every backend and baseline -> the plot
  matrix    upstream's kernel-benchmark scenario matrix (decode / prefill / SWA / real-KV)
  dispatch  per-call cost of a custom call inside jit (slope over N chained calls)
  targets   CPU: the serving path's hot cases against a C loop or one thread (bench/cpu_targets.py)
  step      the canary's overhead inside a jitted serving step (off vs on), toy and realistic model sizes
  offload   the host check of an offloaded KV copy vs a plain host memcpy of the same bytes
Outputs: ``<out>/<platform>-<date>.json``, ``.md``, ``.png`` and ``<out>/README_snippet.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# verify / plan sweep: bs = 32 requests x prefix P (entries = 32 P); write sweep: 32 requests x E new
# tokens after a 64-token prefix (entries = 32 E).
SWEEP_BS = 32
WRITE_PREFIX = 64

DECODE_BS = (1, 32, 256, 1024)

# Serving-step model sizes: the toy of bench/overhead.py, and sizes where the model dominates the step
# as in real serving.
REALISTIC = {"layers": 8, "d_model": 1024}
REALISTIC_WIDE = {"layers": 8, "d_model": 2048}
DECODE_PREFIX = (128, 1024, 4096, 16384)


def _matrix(mode: str):
    """[(name, build kwargs)] of the scenario matrix for a mode."""
    from jax_kvcanary import RealKvHashMode as M
    out = []
    for bs in DECODE_BS:
        for p in DECODE_PREFIX:
            out.append((f"decode bs={bs} prefix={p}", dict(bs=bs, prefix=p, extend=1)))
    for p in (0, 4096, 12288):
        out.append((f"prefill chunk=4096 prefix={p}", dict(bs=1, prefix=p, extend=4096)))
    for bs in (32, 256):
        out.append((f"swa w=128 decode bs={bs} prefix=4096", dict(bs=bs, prefix=4096, extend=1, window=128)))
    out.append(("swa w=128 prefill chunk=4096 prefix=12288", dict(bs=1, prefix=12288, extend=4096, window=128)))
    out.append(("realkv none decode bs=32 prefix=1024", dict(bs=32, prefix=1024, extend=1)))
    for m in (M.PARTIAL, M.ALL):
        for k in (1, 4):
            out.append((f"realkv {m.name.lower()} x{k} decode bs=32 prefix=1024",
                        dict(bs=32, prefix=1024, extend=1, mode=m, num_sources=k)))
    if mode == "full":
        return out
    if mode == "medium":
        return [(n, kw) for n, kw in out if kw["bs"] * max(kw["prefix"], 1) <= (1 << 20)]
    if mode == "smoke":
        return [(n, kw) for n, kw in out if n == "decode bs=1 prefix=128"]
    quick = {"decode bs=1 prefix=128", "decode bs=32 prefix=1024", "decode bs=256 prefix=4096",
             "prefill chunk=4096 prefix=4096", "swa w=128 decode bs=32 prefix=4096",
             "realkv partial x1 decode bs=32 prefix=1024", "realkv all x4 decode bs=32 prefix=1024"}
    return [(n, kw) for n, kw in out if n in quick]


MODES = {
    # test-only: the whole pipeline on tiny sizes in seconds (tests/test_bench.py)
    "smoke": dict(rounds=5, step_rounds=5, step_target_s=0.0005, target_s=0.0005, sweep=[16], xla_sweep=[16], ref_cap=512, xla_cap=512,
                  chain=[1, 4], step=[(2, 32, {"layers": 1, "d_model": 64, "vocab": 256})], gpu_sweep=[16],
                  copy_mib=8, targets=dict(chain_tokens=4096, decode_bs=16, scaling=(4, 256), scaling_rounds=5, scaling_target_s=0.0005)),
    # rounds >= 5 everywhere; target_s = wall time of one contender's calls per round. step_rounds,
    # step_target_s: a model-dominated step on a shared CPU varies by ~10 % from call to call (with
    # bench/host_memory.py; 20-40 % without) and has outliers of 2-4x, so its on/off ratio (a median of
    # per-round ratios) needs more rounds, and rounds of several calls. scaling_rounds, scaling_target_s:
    # the same for the thread-pool scaling line, whose one-thread verify of 2^20 entries (~8 ms) varies
    # by up to 1.8x between calls on a shared VM.
    "quick": dict(rounds=5, step_rounds=9, step_target_s=0.1, target_s=0.004, sweep=[128, 2048], xla_sweep=[128], ref_cap=4096, xla_cap=4096,
                  chain=[1, 16, 64], step=[(4, 256), (16, 1024), (8, 512, REALISTIC)], gpu_sweep=[128, 2048, 32768],
                  targets=dict(chain_tokens=1 << 20, decode_bs=256, scaling=(256, 4096), scaling_rounds=15,
                               scaling_target_s=0.02)),
    "medium": dict(rounds=9, step_rounds=41, step_target_s=0.25, target_s=0.01, sweep=[128, 512, 2048, 8192, 32768], xla_sweep=[128, 2048],
                   ref_cap=16384, xla_cap=1 << 20, chain=[1, 4, 16, 64],
                   step=[(8, 512), (32, 1024), (32, 4096), (128, 1024), (8, 512, REALISTIC), (32, 1024, REALISTIC),
                         (16, 2048, REALISTIC), (8, 1024, REALISTIC_WIDE)],
                   gpu_sweep=[128, 2048, 32768, 131072, 524288],
                   targets=dict(chain_tokens=1 << 20, decode_bs=256, scaling=(256, 4096), scaling_rounds=31,
                                scaling_target_s=0.05)),
    "full": dict(rounds=7, step_rounds=41, step_target_s=0.25, target_s=0.05, sweep=[128, 512, 2048, 8192, 32768, 131072],
                 xla_sweep=[128, 2048, 32768], ref_cap=16384, xla_cap=1 << 20, chain=[1, 4, 16, 64, 128],
                 step=[(8, 512), (32, 1024), (32, 4096), (128, 1024), (64, 4096), (8, 512, REALISTIC),
                       (32, 1024, REALISTIC), (64, 4096, REALISTIC), (16, 2048, REALISTIC_WIDE)],
                 gpu_sweep=[128, 2048, 32768, 131072, 524288],
                 targets=dict(chain_tokens=1 << 20, decode_bs=256, scaling=(256, 4096), scaling_rounds=31,
                                scaling_target_s=0.05)),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", dest="mode", action="store_const", const="quick",
                   help="CI smoke run: tiny sizes, a subset of the matrix (< 3 min on 2 cores)")
    g.add_argument("--medium", dest="mode", action="store_const", const="medium",
                   help="the sweep to 1M entries and the matrix up to 1M verify entries (default)")
    g.add_argument("--full", dest="mode", action="store_const", const="full",
                   help="the whole upstream matrix (decode up to bs=1024 x prefix=16384)")
    g.add_argument("--smoke", dest="mode", action="store_const", const="smoke", help=argparse.SUPPRESS)
    ap.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--out", default=DEFAULT_OUT, help="output directory (default bench/results)")
    ap.add_argument("--sections", default="sweep,matrix,dispatch,targets,step,offload",
                    help="comma list of sweep,matrix,dispatch,targets,step,offload")
    ap.add_argument("--no-xla", action="store_true", help="skip impl='xla' (its compiles are slow)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="", help="suffix for the output file names (default none)")
    ap.set_defaults(mode="medium")
    return ap.parse_args(argv)


def _log(msg):
    print(msg, flush=True)


def _fmt_rate(x):
    return "-" if x is None else f"{x / 1e6:.1f}M/s"


def _measure(ops, sc, env, rk) -> list:
    """Times each op of ``ops`` on scenario ``sc``; prints and returns the records."""
    from . import opbench

    recs = []
    for op in ops:
        recs.append(opbench.measure_op(op, sc, env, **rk))
        _print_rec(recs[-1])
    return recs


def _print_rec(rec):
    c = rec["contenders"]
    parts = [f"{k}={_fmt_rate(v['entries_per_s'])}" for k, v in c.items()]
    rs = []
    for k, v in rec["ratios"].items():
        for kk, vv in v.items():
            if vv is not None and k in ("ffi", "xla"):
                rs.append(f"{k}/{kk[3:]}={vv:.2f}")
    _log(f"    {rec['op']:6s} n={rec['entries']:>9d}  " + " ".join(parts) + ("  | " + " ".join(rs) if rs else ""))


def run(argv=None) -> dict:
    """Runs the suite; returns what it wrote to the JSON file."""
    args = parse_args(argv)
    cfg = MODES[args.mode]
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    t_start = time.time()

    import jax
    try:
        devices = jax.devices(args.platform)
    except RuntimeError as e:
        raise SystemExit(f"bench: no {args.platform} device: {e}")
    dev = devices[0]

    from . import cpu_targets, harness, native, offload, opbench, overhead, report, scenarios, step_process

    with jax.default_device(dev):
        meta = harness.machine_info(args.platform)
        meta.update({"mode": args.mode, "command": "python -m bench " + " ".join(shlex.quote(a) for a in
                                                                             (argv if argv is not None else sys.argv[1:])),
                     "date": datetime.date.today().isoformat(),
                     "started": datetime.datetime.now().isoformat(timespec="seconds"),
                     "rounds": cfg["rounds"], "step_rounds": cfg["step_rounds"], "target_s_per_round": cfg["target_s"],
                     "step_target_s_per_round": cfg["step_target_s"],
                     "page_size": scenarios.PAGE_SIZE, "pool_slack": scenarios.SLACK})
        notes = []
        from jax_kvcanary import _ffi
        backends = []
        ffi_ok = args.platform in _ffi.NATIVE_PLATFORMS
        if ffi_ok:
            backends.append("ffi")
        else:
            notes.append(f"impl='ffi' has no native handler for {args.platform} (built: "
                         f"{sorted(_ffi.NATIVE_PLATFORMS)}): skipped")
        xla_note = "skipped (--no-xla)" if args.no_xla else opbench.probe_xla()
        if xla_note is None:
            backends.append("xla")
        else:
            notes.append(f"impl='xla': {xla_note}")
        nat = None
        if args.platform == "cpu":
            backends.append("reference")
            nat, why = native.load()
            if why:
                notes.append(why)
            else:
                meta["native_baselines"] = nat.describe()
        else:
            notes.append("numpy reference and native C baselines are CPU-only: not run on gpu")
        if "ffi" not in backends and "xla" not in backends:
            raise SystemExit("bench: neither impl='ffi' nor impl='xla' is usable: " + "; ".join(notes))
        meta["backends"] = backends
        xla_sweep = set(cfg["xla_sweep"])
        env = opbench.Env(args.platform, backends, nat, ref_cap=cfg["ref_cap"], xla_cap=cfg["xla_cap"], notes=notes)
        out = {"meta": meta, "notes": notes}
        rk = dict(rounds=cfg["rounds"], target_s=cfg["target_s"])
        out["copy_bandwidth"] = report.copy_bandwidth(args.platform, cfg.get("copy_mib"))
        _log(f"bench: mode={args.mode} platform={args.platform} backends={backends} "
             f"copy-bw={out['copy_bandwidth']['GBps']:.0f} GB/s")
        for n in notes:
            _log(f"  note: {n}")

        if "sweep" in sections:
            t_sec = time.time()
            _log("== sweep (bs=32)")
            sweep = []
            points = cfg["gpu_sweep"] if args.platform == "gpu" else cfg["sweep"]
            for p in points:
                with_xla = p in xla_sweep
                env.backends = [b for b in backends if b != "xla" or with_xla]
                sc = scenarios.build(f"sweep verify/plan bs={SWEEP_BS} prefix={p}", SWEEP_BS, p, 1, seed=args.seed)
                sweep += _measure(("verify", "plan"), sc, env, rk)
                del sc
                sc = scenarios.build(f"sweep write bs={SWEEP_BS} prefix={WRITE_PREFIX} extend={p}", SWEEP_BS,
                                     WRITE_PREFIX, p, seed=args.seed)
                sweep += _measure(("write",), sc, env, rk)
                del sc
            env.backends = backends
            out["sweep"] = sweep
            meta.setdefault("section_s", {})["sweep"] = round(time.time() - t_sec, 1)

        if "matrix" in sections:
            t_sec = time.time()
            _log("== scenario matrix")
            env.backends = [b for b in backends if b != "xla"]
            if "xla" in backends:
                notes.append("impl='xla' is timed in the sweep only (each new shape costs a 10-30 s compile)")
            matrix = []
            for name, kw in _matrix(args.mode):
                sc = scenarios.build(name, seed=args.seed, **kw)
                _log(f"  {name}")
                matrix += _measure(("plan", "verify", "write"), sc, env, rk)
                del sc
            env.backends = backends
            out["matrix"] = matrix
            meta.setdefault("section_s", {})["matrix"] = round(time.time() - t_sec, 1)

        if "dispatch" in sections:
            t_sec = time.time()
            _log("== per-call overhead inside jit")
            impls = [b for b in backends if b == "ffi"]
            d = overhead.dispatch(impls, cfg["chain"], **rk)
            for k, v in d["ops"].items():
                _log(f"    {k:14s} {v['per_call_us']:8.2f} us/call  (intercept {v['intercept_us']:.1f} us)")
            out["dispatch"] = d
            meta.setdefault("section_s", {})["dispatch"] = round(time.time() - t_sec, 1)

        if "targets" in sections and args.platform == "cpu" and "ffi" in backends and nat is not None:
            t_sec = time.time()
            tc = cfg["targets"]
            _log("== the serving path's hot cases: ffi vs a C loop / one thread")
            targets = [cpu_targets.write_chain(env, tc["chain_tokens"], seed=args.seed, **rk),
                       cpu_targets.write_decode(env, tc["decode_bs"], 1024, seed=args.seed, **rk),
                       cpu_targets.verify_scaling(*tc["scaling"], seed=args.seed, rounds=tc["scaling_rounds"],
                                                  target_s=tc["scaling_target_s"])]
            for line in report._targets_lines(targets)[2:]:
                _log("    " + line)
            out["targets"] = targets
            meta.setdefault("section_s", {})["targets"] = round(time.time() - t_sec, 1)

        if "step" in sections:
            t_sec = time.time()
            _log("== serving step, canary off vs on")
            if args.platform == "cpu":
                out["step"], meta["step_host_allocator"] = step_process.run_in_child(args.mode, args.seed)
            else:
                out["step"] = step_process.run_steps(cfg, args.seed, _log)
            meta.setdefault("section_s", {})["step"] = round(time.time() - t_sec, 1)

        if "offload" in sections:
            t_sec = time.time()
            _log("== host check of an offloaded copy vs memcpy")
            out["offload"] = offload.run(args.mode, rounds=cfg["rounds"], target_s=cfg["target_s"], log=_log)
            meta.setdefault("section_s", {})["offload"] = round(time.time() - t_sec, 1)

        out["acceptance"] = report.acceptance(out, args.platform)
        meta["elapsed_s"] = round(time.time() - t_start, 1)
        try:
            meta["loadavg_at_end"] = list(os.getloadavg())
        except OSError:
            pass
        os.makedirs(args.out, exist_ok=True)
        stem = f"{args.platform}-{meta['date']}{('-' + args.tag) if args.tag else ''}"
        paths = report.write_all(out, args.out, stem)
        _log("== acceptance")
        for a in out["acceptance"]["checks"]:
            _log(f"    [{'PASS' if a['ok'] else 'FAIL'}] {a['what']}: {a['value']}")
        _log("wrote " + ", ".join(paths) + f"  ({meta['elapsed_s']} s)")
        return out


def main(argv=None):
    """``python -m bench``."""
    run(argv)
    return 0
