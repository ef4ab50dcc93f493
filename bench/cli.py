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

from .modes import MODES, matrix

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# verify / plan sweep: bs = 32 requests x prefix P (entries = 32 P); write sweep: 32 requests x E new
# tokens after a 64-token prefix (entries = 32 E).
SWEEP_BS = 32
WRITE_PREFIX = 64

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
            for name, kw in matrix(args.mode):
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
