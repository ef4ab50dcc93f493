"""CUDA-specific throughput checks (supplements ``python -m bench --platform gpu``).

The main suite times every op against its jitted baselines over the upstream scenario matrix. This
script times what only the CUDA launchers have, at sizes that fill an H100/H200:

  verify    clean plans (no rows: the count pass + an empty emit pass) vs a jitted gather of the same
            32-byte records (slot and predecessor), and violation-heavy plans (every entry emits a row:
            the ordered ring path), at 1M and 16M entries;
  write     decode (1024 requests x 1 token) and prefill (1 x 4096 tokens: the serial chain) on the
            fast path, the same decode with duplicate slots (the in-order path), and with 4 real-KV
            sources (ALL); vs a jitted scatter of the same 32-byte records;
  plan      bs=1024 x prefix 4096 (4M entries).

Each op runs R times inside one jitted ``fori_loop`` (state carried, so nothing is hoisted), and the
time per launch is the median over rounds. Achieved bandwidth counts the bytes the op must move (plan
arrays read, records gathered/stored, rows written) against ~4.3 TB/s (an H200's measured copy rate).

    python bench/gpu_bench.py [--out DIR] [--quick]
Writes DIR/gpu_bench.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import jax_kvcanary as kvc  # noqa: E402

COPY_TBPS = 4.3


def _time(fn, state, reps, rounds):
    """Median seconds per launch of `fn` run `reps` times in one jitted fori_loop."""
    loop = jax.jit(lambda s: lax.fori_loop(0, reps, lambda i, x: fn(x), s))
    state = jax.block_until_ready(loop(state))  # compile + warm-up
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        state = jax.block_until_ready(loop(state))
        ts.append((time.perf_counter() - t0) / reps)
    return float(np.median(ts))


def _row(name, op, entries, seconds, bytes_moved, baseline_s=None):
    r = dict(name=name, op=op, entries=entries, us=seconds * 1e6, entries_per_s=entries / seconds,
             GBps=bytes_moved / seconds / 1e9, frac_of_copy_bw=bytes_moved / seconds / (COPY_TBPS * 1e12))
    if baseline_s is not None:
        r["baseline_us"] = baseline_s * 1e6
        r["speed_vs_baseline"] = baseline_s / seconds
    return r


def bench_verify(V, S, heavy, reps, rounds, dev):
    rng = np.random.default_rng(1)
    slots = rng.integers(1, S, V).astype(np.int32)
    prevs = rng.integers(1, S, V).astype(np.int32)
    canary = np.zeros((S, 32), np.uint8)
    pos = np.zeros(V, np.int32)
    if not heavy:  # all-zero records, prev slot 0 (chain unchecked), positions 0: no rows
        prevs[:] = 0
    put = lambda x: jax.device_put(x, dev)  # noqa: E731
    vp = kvc.VerifyPlan(put(slots), put(np.full(V, -1, np.int32)), put(pos), put(prevs),
                        put(np.array([V], np.int32)), put(np.array([1], np.int32)))
    cap = 1 << 20 if heavy else 1024
    c = put(canary)

    def f(log):
        lg = kvc.ViolationLog(log[0], jnp.zeros((1,), jnp.int32), log[1], log[2], log[3])  # restart the ring
        out = kvc.verify(c, lg, vp, tag=0, impl="ffi")
        return (out.ring, out.kernel_run_counters, out.slot_run_counters, out.enable_chain_position_assert)

    lg = jax.device_put(kvc.ViolationLog.create(cap), dev)
    t = _time(f, (lg.ring, lg.kernel_run_counters, lg.slot_run_counters, lg.enable_chain_position_assert),
              reps, rounds)
    rows = min(V, cap) if heavy else 0
    nbytes = V * 16 + V * 32 * (2 if heavy else 1) + rows * 64

    def g(acc):  # jitted gather of the same records (slot and predecessor), reduced
        acc, sl, pv = lax.optimization_barrier((acc, vp.slot_indices, vp.prev_slot_indices))  # no hoisting
        rec = c[sl].view(jnp.uint32) ^ c[pv].view(jnp.uint32)
        return acc ^ jnp.bitwise_xor.reduce(rec, axis=0)

    tb = _time(g, jnp.zeros((8,), jnp.uint32, device=dev), reps, rounds)
    return _row(f"verify {'heavy' if heavy else 'clean'} V={V}", "verify", V, t, nbytes, tb)


def bench_write(bs, extend, S, dup, nsrc, reps, rounds, dev):
    rng = np.random.default_rng(2)
    N = bs * extend
    loc = rng.permutation(S - 1)[:N].astype(np.int32) + 1
    if dup:
        loc[1::7] = loc[0]  # duplicate slots across requests: the in-order path
    ids = rng.integers(0, 32000, N).astype(np.int32)
    pos = np.tile(np.arange(extend, dtype=np.int32), bs) + 1
    put = lambda x: jax.device_put(x, dev)  # noqa: E731
    wp = kvc.WritePlan(put(np.arange(bs + 1, dtype=np.int32) * extend), put(np.full(bs, -1, np.int32)),
                       put(np.array([bs], np.int32)))
    srcs = tuple(kvc.RealKvSource(put(np.frombuffer(rng.bytes(S * 256), np.uint8).reshape(S // 16, 16 * 256)),
                                  16, 256, 256) for _ in range(nsrc))
    mode = kvc.RealKvHashMode.ALL if nsrc else kvc.RealKvHashMode.NONE
    ids_d, pos_d, loc_d = put(ids), put(pos), put(loc)

    def f(st):
        canary, ring, kc, sc, flag = st
        lg = kvc.ViolationLog(ring, jnp.zeros((1,), jnp.int32), kc, sc, flag)
        canary, lg = kvc.write(canary, lg, wp, ids_d, pos_d, loc_d, tag=2, real_kv_sources=srcs,
                               real_kv_hash_mode=mode, impl="ffi")
        return (canary, lg.ring, lg.kernel_run_counters, lg.slot_run_counters, lg.enable_chain_position_assert)

    lg = jax.device_put(kvc.ViolationLog.create(1024), dev)
    st = (put(np.zeros((S, 32), np.uint8)), lg.ring, lg.kernel_run_counters, lg.slot_run_counters,
          lg.enable_chain_position_assert)
    t = _time(f, st, reps, rounds)
    nbytes = N * 12 + N * 32 + N * nsrc * 256
    rec = jnp.zeros((N, 32), jnp.uint8, device=dev) + jnp.uint8(1)

    def g(canary):  # jitted scatter of the same 32-byte records
        return canary.at[loc_d].set(rec, unique_indices=not dup)

    tb = _time(g, put(np.zeros((S, 32), np.uint8)), reps, rounds)
    name = f"write bs={bs} x {extend}" + (" dup (in-order)" if dup else "") + (f" realkv x{nsrc}" if nsrc else "")
    return _row(name, "write", N, t, nbytes, tb)


def bench_plan(bs, prefix, reps, rounds, dev):
    rng = np.random.default_rng(3)
    L = prefix + 8
    r2t = rng.integers(1, 1 << 24, (bs + 1, L)).astype(np.int32)
    put = lambda x: jax.device_put(x, dev)  # noqa: E731
    rpi = put(np.arange(1, bs + 1, dtype=np.int32))
    P = put(np.full(bs, prefix, np.int32))
    E = put(np.ones(bs, np.int32))
    r2t_d = put(r2t)
    V = bs * prefix

    def f(acc):
        acc, p = lax.optimization_barrier((acc, P))  # loop-variant inputs: the plan is not hoisted
        vp, wp = kvc.plan(rpi, p, E, r2t_d, verify_capacity=V, write_req_capacity=bs, impl="ffi")
        return acc ^ vp.slot_indices[-1:] ^ wp.seed_slot_indices[-1:]

    t = _time(f, jnp.zeros((1,), jnp.int32, device=dev), reps, rounds)
    return _row(f"plan bs={bs} prefix={prefix}", "plan", V, t, V * 4 * 2 + V * 16)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--quick", action="store_true", help="smaller sizes, fewer rounds")
    args = ap.parse_args(argv)
    dev = jax.devices("gpu")[0]
    from jax_kvcanary import _ffi
    if "gpu" not in _ffi.NATIVE_PLATFORMS:
        raise SystemExit("gpu_bench: the CUDA module is not built (jax_kvcanary._kvcanary_cuda)")
    rounds = 3 if args.quick else 5
    big = 1 << 22 if args.quick else 1 << 24
    S = 1 << 22
    rows = []
    t0 = time.time()
    for V in (1 << 20, big):
        rows.append(bench_verify(V, S, False, 10, rounds, dev))
    rows.append(bench_verify(1 << 20, S, True, 5, rounds, dev))
    Sw = 1 << 20  # write: 1M slots (4 sources x 256 MiB)
    rows.append(bench_write(1024, 1, Sw, False, 0, 20, rounds, dev))
    rows.append(bench_write(1024, 1, Sw, True, 0, 10, rounds, dev))
    rows.append(bench_write(1024, 1, Sw, False, 4, 20, rounds, dev))
    rows.append(bench_write(1, 4096, Sw, False, 0, 3, rounds, dev))
    rows.append(bench_plan(1024, 4096 if not args.quick else 1024, 5, rounds, dev))
    out = dict(device=str(dev), device_kind=getattr(dev, "device_kind", ""), jax=jax.__version__,
               copy_TBps_assumed=COPY_TBPS, rows=rows, elapsed_s=round(time.time() - t0, 1))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_bench.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{'case':44s} {'us/launch':>10s} {'Mentries/s':>11s} {'GB/s':>8s} {'%4.3TB/s':>9s} {'baseline us':>12s} "
          f"{'x baseline':>10s}")
    for r in rows:
        b = f"{r['baseline_us']:12.1f} {r['speed_vs_baseline']:10.2f}" if "baseline_us" in r else f"{'-':>12s} {'-':>10s}"
        print(f"{r['name']:44s} {r['us']:10.1f} {r['entries_per_s'] / 1e6:11.1f} {r['GBps']:8.0f} "
              f"{100 * r['frac_of_copy_bw']:8.1f}% {b}")
    print(f"wrote {path} ({out['elapsed_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
