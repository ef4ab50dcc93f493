"""``python -m bench``: the jax_kvcanary benchmark suite.

Sets up the run (device, backends, native baselines), runs the sections of ``bench/sections.py`` in
their registry order, each through ``_run_section``, then the acceptance checks, and writes
``<out>/<platform>-<date>.json``, ``.md``, ``.png`` and ``<out>/README_snippet.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time

from .modes import MODES
from .sections import SECTIONS, Context, Section

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

DESCRIPTION = ("``python -m bench``: the jax_kvcanary benchmark suite.\n\n"
               "Sections (all by default, or ``--sections``):\n"
               + "".join(f"  {name:9s} {section.help}\n" for name, section in SECTIONS.items())
               + "Outputs: ``<out>/<platform>-<date>.json``, ``.md``, ``.png`` and ``<out>/README_snippet.md``.")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench", description=DESCRIPTION,
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
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {','.join(SECTIONS)}")
    ap.add_argument("--no-xla", action="store_true", help="skip impl='xla' (its compiles are slow)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="", help="suffix for the output file names (default none)")
    ap.set_defaults(mode="medium")
    args = ap.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {','.join(unknown)}: choose from {','.join(SECTIONS)}")
    return args


def _log(msg: str) -> None:
    print(msg, flush=True)


def _run_section(name: str, section: Section, ctx: Context):
    """Runs one section under its heading; its wall time goes to ``meta["section_s"][name]``."""
    t0 = time.time()
    _log(f"== {section.title}")
    rows = section.run(ctx)
    ctx.meta.setdefault("section_s", {})[name] = round(time.time() - t0, 1)
    return rows


def _backends(platform: str, no_xla: bool, notes: list) -> tuple:
    """(the usable backends, the native C baselines or None); appends to ``notes`` why any is missing."""
    from jax_kvcanary import _ffi

    from . import native, opbench

    backends = []
    if platform in _ffi.NATIVE_PLATFORMS:
        backends.append("ffi")
    else:
        notes.append(f"impl='ffi' has no native handler for {platform} (built: "
                     f"{sorted(_ffi.NATIVE_PLATFORMS)}): skipped")
    xla_note = "skipped (--no-xla)" if no_xla else opbench.probe_xla()
    if xla_note is None:
        backends.append("xla")
    else:
        notes.append(f"impl='xla': {xla_note}")
    nat = None
    if platform == "cpu":
        backends.append("reference")
        nat, why = native.load()
        if why:
            notes.append(why)
    else:
        notes.append("numpy reference and native C baselines are CPU-only: not run on gpu")
    if "ffi" not in backends and "xla" not in backends:
        raise SystemExit("bench: neither impl='ffi' nor impl='xla' is usable: " + "; ".join(notes))
    return backends, nat


def run(argv=None) -> dict:
    """Runs the suite; returns what it wrote to the JSON file."""
    args = parse_args(argv)
    cfg = MODES[args.mode]
    t_start = time.time()

    import jax
    try:
        devices = jax.devices(args.platform)
    except RuntimeError as e:
        raise SystemExit(f"bench: no {args.platform} device: {e}")

    from . import harness, opbench, report, scenarios

    with jax.default_device(devices[0]):
        meta = harness.machine_info(args.platform)
        meta.update({"mode": args.mode, "command": "python -m bench " + " ".join(shlex.quote(a) for a in
                                                                             (argv if argv is not None else sys.argv[1:])),
                     "date": datetime.date.today().isoformat(),
                     "started": datetime.datetime.now().isoformat(timespec="seconds"),
                     "rounds": cfg["rounds"], "step_rounds": cfg["step_rounds"], "target_s_per_round": cfg["target_s"],
                     "step_target_s_per_round": cfg["step_target_s"],
                     "page_size": scenarios.PAGE_SIZE, "pool_slack": scenarios.SLACK})
        notes = []
        backends, nat = _backends(args.platform, args.no_xla, notes)
        if nat is not None:
            meta["native_baselines"] = nat.describe()
        meta["backends"] = backends
        env = opbench.Env(args.platform, backends, nat, ref_cap=cfg["ref_cap"], xla_cap=cfg["xla_cap"], notes=notes)
        out = {"meta": meta, "notes": notes}
        out["copy_bandwidth"] = report.copy_bandwidth(args.platform, cfg.get("copy_mib"))
        _log(f"bench: mode={args.mode} platform={args.platform} backends={backends} "
             f"copy-bw={out['copy_bandwidth']['GBps']:.0f} GB/s")
        for n in notes:
            _log(f"  note: {n}")

        ctx = Context(platform=args.platform, mode=args.mode, seed=args.seed, cfg=cfg, env=env, backends=backends,
                      native=nat, meta=meta, notes=notes, log=_log)
        for name, section in SECTIONS.items():
            if name in args.sections and section.applies(ctx):
                out[name] = _run_section(name, section, ctx)

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


def main(argv=None) -> int:
    """``python -m bench``."""
    run(argv)
    return 0
