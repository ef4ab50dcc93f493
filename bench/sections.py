"""The suite's sections: one function each, returning the rows of its key in the result JSON, and
the registry ``SECTIONS`` (name -> ``Section``, in run order) that ``python -m bench`` iterates."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional

from . import cpu_targets, modes, offload, opbench, overhead, report, scenarios, step_process

# verify / plan sweep: bs = 32 requests x prefix P (entries = 32 P); write sweep: 32 requests x E new
# tokens after a 64-token prefix (entries = 32 E).
SWEEP_BS = 32
WRITE_PREFIX = 64


@dataclasses.dataclass
class Context:
    """What every section gets: the run's options and the backends and baselines it found."""

    platform: str
    mode: str
    seed: int
    cfg: dict                     # modes.MODES[mode]
    env: opbench.Env              # env.backends: the usable backends; a section may narrow them while it runs
    backends: List[str]           # every usable backend
    native: Optional[Any]         # bench.native.Native, or None
    meta: dict                    # the JSON's "meta": a section may add what it alone knows
    notes: List[str]              # the report's notes
    log: Callable[[str], None]

    @property
    def rk(self) -> dict:
        """The per-call sections' rounds and seconds per contender per round."""
        return dict(rounds=self.cfg["rounds"], target_s=self.cfg["target_s"])


@dataclasses.dataclass(frozen=True)
class Section:
    """One part of the suite: ``run(ctx)`` returns its rows; it runs only where ``applies(ctx)``.
    ``title`` heads its log lines, ``help`` describes it in ``python -m bench --help``."""

    title: str
    help: str
    run: Callable[[Context], Any]
    applies: Callable[[Context], bool] = lambda ctx: True


def _fmt_rate(x):
    return "-" if x is None else f"{x / 1e6:.1f}M/s"


def _log_rec(ctx: Context, rec: dict) -> None:
    c = rec["contenders"]
    parts = [f"{k}={_fmt_rate(v['entries_per_s'])}" for k, v in c.items()]
    rs = []
    for k, v in rec["ratios"].items():
        for kk, vv in v.items():
            if vv is not None and k in ("ffi", "xla"):
                rs.append(f"{k}/{kk[3:]}={vv:.2f}")
    ctx.log(f"    {rec['op']:6s} n={rec['entries']:>9d}  " + " ".join(parts) + ("  | " + " ".join(rs) if rs else ""))


def _measure(ctx: Context, ops, sc) -> list:
    """Times each op of ``ops`` on scenario ``sc``; logs and returns the records."""
    recs = []
    for op in ops:
        recs.append(opbench.measure_op(op, sc, ctx.env, **ctx.rk))
        _log_rec(ctx, recs[-1])
    return recs


def sweep(ctx: Context) -> list:
    """verify and plan of 32 requests x prefix P, write of 32 x P new tokens, for each sweep point."""
    rows = []
    points = ctx.cfg["gpu_sweep"] if ctx.platform == "gpu" else ctx.cfg["sweep"]
    xla_points = set(ctx.cfg["xla_sweep"])
    for p in points:
        ctx.env.backends = [b for b in ctx.backends if b != "xla" or p in xla_points]
        sc = scenarios.build(f"sweep verify/plan bs={SWEEP_BS} prefix={p}", SWEEP_BS, p, 1, seed=ctx.seed)
        rows += _measure(ctx, ("verify", "plan"), sc)
        del sc
        sc = scenarios.build(f"sweep write bs={SWEEP_BS} prefix={WRITE_PREFIX} extend={p}", SWEEP_BS,
                             WRITE_PREFIX, p, seed=ctx.seed)
        rows += _measure(ctx, ("write",), sc)
        del sc
    ctx.env.backends = ctx.backends
    return rows


def matrix(ctx: Context) -> list:
    """plan, verify and write of every scenario of the mode's matrix (``modes.matrix``)."""
    ctx.env.backends = [b for b in ctx.backends if b != "xla"]
    if "xla" in ctx.backends:
        ctx.notes.append("impl='xla' is timed in the sweep only (each new shape costs a 10-30 s compile)")
    rows = []
    for name, kw in modes.matrix(ctx.mode):
        sc = scenarios.build(name, seed=ctx.seed, **kw)
        ctx.log(f"  {name}")
        rows += _measure(ctx, ("plan", "verify", "write"), sc)
        del sc
    ctx.env.backends = ctx.backends
    return rows


def dispatch(ctx: Context) -> dict:
    """Per-call cost of each native op inside jit, and of one XLA op."""
    d = overhead.dispatch([b for b in ctx.backends if b == "ffi"], ctx.cfg["chain"], **ctx.rk)
    for k, v in d["ops"].items():
        ctx.log(f"    {k:14s} {v['per_call_us']:8.2f} us/call  (intercept {v['intercept_us']:.1f} us)")
    return d


def targets(ctx: Context) -> list:
    """The serving path's hot cases against a C loop or one thread (``bench/cpu_targets.py``)."""
    tc = ctx.cfg["targets"]
    rows = [cpu_targets.write_chain(ctx.env, tc["chain_tokens"], seed=ctx.seed, **ctx.rk),
            cpu_targets.write_decode(ctx.env, tc["decode_bs"], 1024, seed=ctx.seed, **ctx.rk),
            cpu_targets.verify_scaling(*tc["scaling"], seed=ctx.seed, rounds=tc["scaling_rounds"],
                                       target_s=tc["scaling_target_s"])]
    for line in report._targets_lines(rows)[2:]:
        ctx.log("    " + line)
    return rows


def step(ctx: Context) -> list:
    """The serving steps off vs on; on CPU in a child process that keeps freed host memory."""
    if ctx.platform != "cpu":
        return step_process.run_steps(ctx.cfg, ctx.seed, ctx.log)
    rows, ctx.meta["step_host_allocator"] = step_process.run_in_child(ctx.mode, ctx.seed)
    return rows


def offload_check(ctx: Context) -> list:
    """The host check of an offloaded copy vs memcpy (``bench/offload.py``)."""
    return offload.run(ctx.mode, rounds=ctx.cfg["rounds"], target_s=ctx.cfg["target_s"], log=ctx.log)


SECTIONS = {
    "sweep": Section(f"sweep (bs={SWEEP_BS})",
                     "per-op throughput vs entries (bs=32) for every backend and baseline -> the plot", sweep),
    "matrix": Section("scenario matrix",
                      "upstream's kernel-benchmark scenario matrix (decode / prefill / SWA / real-KV)", matrix),
    "dispatch": Section("per-call overhead inside jit",
                        "per-call cost of a custom call inside jit (slope over N chained calls)", dispatch),
    "targets": Section("the serving path's hot cases: ffi vs a C loop / one thread",
                       "CPU: the serving path's hot cases against a C loop or one thread (bench/cpu_targets.py)",
                       targets, applies=lambda ctx: ctx.platform == "cpu" and "ffi" in ctx.backends
                       and ctx.native is not None),
    "step": Section("serving step, canary off vs on",
                    "the canary's overhead inside a jitted serving step (off vs on), toy and realistic model "
                    "sizes", step),
    "offload": Section("host check of an offloaded copy vs memcpy",
                       "the host check of an offloaded KV copy vs a plain host memcpy of the same bytes",
                       offload_check),
}
