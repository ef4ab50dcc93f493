"""The CPU handlers against what a plain C loop or one thread does, on the serving path's hot cases.

Each target is measured in one run against its own baseline (interleaved rounds, per-round ratios):

* ``write_chain``: one request of ``tokens`` new tokens (a long prefill chunk: one serial hash chain)
  after a 64-token prefix; ``ffi`` write vs the C chain loop (``kvb_write_chain``) on the same
  scenario buffers. Ratio = C time / ffi time.
* ``write_decode``: ``bs`` decode requests of one token each. A single such launch is dominated by
  getting into it (jit dispatch from Python, a ctypes call), so both sides are measured the way a
  serving step pays them: the ffi write's cost inside a compiled step (the slope of a jitted chain of
  N writes over N) vs the C loop's cost inside C (``kvb_write_chain_reps``: the slope over reps).
  Ratio = the median over rounds of the two slopes' ratio in each round.
* ``verify_scaling``: a verify of ``bs x prefix`` entries with the CPU handlers on XLA's thread pool vs
  capped to one thread (``kvc.set_cpu_threads(1)``). Ratio = one-thread time / pool time, the median
  of per-round ratios; beside it the fastest round's of each (``speedup_fastest``).
"""

from __future__ import annotations

import os
import statistics

import jax
import jax.numpy as jnp

import jax_kvcanary as kvc

from . import harness, opbench, scenarios

TAG = scenarios.TAG


def write_chain(env, tokens: int, *, rounds: int, target_s: float, seed: int = 0) -> dict:
    sc = scenarios.build(f"write chain 1 x {tokens}", 1, 64, tokens, seed=seed)
    cs = [c for c in opbench.write_contenders(sc, env) if c.name in ("ffi", "c_write_chain")]
    res = harness.measure(cs, rounds=rounds, target_s=target_s)
    return {"target": "write_chain", "requests": 1, "tokens": tokens,
            "ffi_entries_per_s": tokens / res["ffi"].median,
            "c_entries_per_s": tokens / res["c_write_chain"].median,
            "ffi_over_c": harness.ratio(res, "ffi", "c_write_chain"),
            "violations_recorded": next(c for c in cs if c.name == "ffi").fn.state["log"].total()}


def _write_chain_fn(n):
    def f(canary, log, wp, ids, pos, loc):
        for _ in range(n):
            canary, log = kvc.write(canary, log, wp, ids, pos, loc, tag=TAG, impl="ffi")
        return canary, log
    return jax.jit(f, donate_argnums=(0, 1))


def write_decode(env, bs: int, prefix: int, chain=(4, 16, 64), *, rounds: int, target_s: float,
                 seed: int = 0) -> dict:
    sc = scenarios.build(f"write decode bs={bs} prefix={prefix}", bs, prefix, 1, seed=seed)
    wp = sc.write_plan
    cs, logs = [], {}
    for n in chain:
        f = _write_chain_fn(n)
        st = {"canary": jnp.array(sc.canary, copy=True), "log": kvc.ViolationLog.create(64)}
        logs[n] = st

        def run(f=f, st=st):
            st["canary"], st["log"] = f(st["canary"], st["log"], wp, sc.input_ids, sc.positions, sc.out_cache_loc)
            return st["log"]
        cs.append(harness.Contender(f"ffi_x{n}", run))
        cbuf = jnp.array(sc.canary, copy=True).block_until_ready()
        fn = env.native.write_chain_reps(cbuf, wp.offsets, wp.seed_slot_indices, bs, sc.input_ids, sc.positions,
                                         sc.out_cache_loc, n)
        fn.buffer = cbuf
        cs.append(harness.Contender(f"c_x{n}", fn, kind="baseline"))
    res = harness.measure(cs, rounds=rounds, target_s=target_s)

    def slope(prefix, k=None):  # us per launch: over the medians, or over round k's times
        ys = [(res[f"{prefix}{n}"].median if k is None else res[f"{prefix}{n}"].times[k]) * 1e6 for n in chain]
        return harness.fit_line(list(chain), ys)[0]
    per_round = [slope("c_x", k) / slope("ffi_x", k) for k in range(rounds) if slope("ffi_x", k) > 0]
    return {"target": "write_decode", "requests": bs, "prefix": prefix, "chain": list(chain),
            "ffi_us_per_launch": slope("ffi_x"), "c_us_per_launch": slope("c_x"),
            "ffi_over_c": statistics.median(per_round) if per_round else None,
            "violations_recorded": sum(st["log"].total() for st in logs.values())}


def verify_scaling(bs: int, prefix: int, *, rounds: int, target_s: float, seed: int = 0) -> dict:
    sc = scenarios.build(f"verify scaling bs={bs} prefix={prefix}", bs, prefix, 1, seed=seed)
    f = opbench._verify_fn("ffi", sc.mode)
    cs, logs = [], []
    for name, threads in (("one_thread", 1), ("pool", None)):
        st = {"log": kvc.ViolationLog.create(64)}
        logs.append(st)

        def run(st=st, threads=threads):
            kvc.set_cpu_threads(threads)
            st["log"] = f(sc.canary, st["log"], sc.verify_plan, sc.sources)
            return st["log"]
        cs.append(harness.Contender(name, run, kind="baseline" if threads == 1 else "backend"))
    try:
        res = harness.measure(cs, rounds=rounds, target_s=target_s)
    finally:
        kvc.set_cpu_threads(None)
    n = sc.verify_entries
    return {"target": "verify_scaling", "entries": n, "cpu_count": os.cpu_count(),
            "pool_entries_per_s": n / res["pool"].median, "one_thread_entries_per_s": n / res["one_thread"].median,
            "speedup": harness.ratio(res, "pool", "one_thread"),
            "speedup_fastest": min(res["one_thread"].times) / min(res["pool"].times),
            "rounds": rounds,
            "violations_recorded": sum(st["log"].total() for st in logs)}
