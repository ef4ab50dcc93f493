"""The serving-step section, run in a process of its own on CPU.

The serving steps are timed with freed host memory kept (bench/host_memory.py): without it their
rounds vary by +-30 %. The per-call sections must not run under that setting: with one malloc arena
shared by every thread a custom call's launch costs ~0.3 us more. glibc takes the arena setting only
before JAX's threads first allocate, so the two cannot share a process: ``python -m bench`` times the
per-call sections with glibc's defaults and starts ``python -m bench.step_process`` for the steps,
which sets the allocator first, runs :func:`run_steps` and hands its records back as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from .modes import MODES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_steps(cfg: dict, seed: int, log) -> list:
    """Times every serving step of the mode's config ``cfg`` (``bench.modes.MODES``); returns the records."""
    from . import overhead

    steps = []
    for bs, p, *model in cfg["step"]:
        r = overhead.serving_step(bs, p, rounds=cfg["step_rounds"], target_s=cfg["step_target_s"], seed=seed,
                                  model=model[0] if model else None)
        md = r["model"]
        log(f"    {md['layers']}x{md['d_model']:<5d} bs={bs:4d} prefix={p:5d}  off={r['off_ms']:.2f} ms  "
            f"on={r['on_ms']:.2f} ms  on/off={r['on_over_off']:.3f} (min {r['on_over_off_min']:.3f})  "
            f"canary only={r['canary_only_ms']:.2f} ms  rows={r['violations_recorded']}")
        steps.append(r)
    return steps


def run_in_child(mode: str, seed: int) -> tuple:
    """Runs :func:`run_steps` for ``mode`` in a child CPU process that keeps freed host memory.

    Its log lines go to this process's stdout as they come. Returns (step records, what the child did
    to its allocator). Raises RuntimeError when the child fails."""
    fd, path = tempfile.mkstemp(prefix="bench-steps-", suffix=".json")
    os.close(fd)
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        sys.stdout.flush()
        proc = subprocess.run([sys.executable, "-m", "bench.step_process", "--mode", mode, "--seed", str(seed),
                               "--out", path], env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"bench: the serving-step process exited with {proc.returncode}")
        with open(path) as f:
            res = json.load(f)
    finally:
        os.unlink(path)
    return res["steps"], res["host_allocator"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_process", description=__doc__)
    ap.add_argument("--mode", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="JSON file for the step records")
    args = ap.parse_args(argv)

    from .host_memory import keep_freed_memory
    allocator = keep_freed_memory()  # before JAX starts its threads

    import jax

    from .report import json_default

    with jax.default_device(jax.devices("cpu")[0]):
        steps = run_steps(MODES[args.mode], args.seed, lambda m: print(m, flush=True))
    with open(args.out, "w") as f:
        json.dump({"steps": steps, "host_allocator": allocator}, f, default=json_default)
    return 0


if __name__ == "__main__":
    sys.exit(main())
