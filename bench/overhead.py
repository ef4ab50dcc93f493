"""Per-call overhead of the custom calls inside jit, and the canary's overhead in a serving step.

1. ``dispatch``: one jitted function chains N calls of an op on a tiny input (each call depends on the
   previous one through the donated log); the slope of time over N is the cost of one call inside a
   compiled step, the intercept the jit dispatch. For comparison, the same slope for a chain of tiny
   XLA ops kept apart by ``optimization_barrier`` (the cost of one XLA thunk).
2. ``step``: a toy paged-KV decoder step (per layer: q/k/v projections, K/V stores at
   ``out_cache_loc``, attention over the request's prefix gathered through ``req_to_token``, an output
   projection; then the logits matmul), jitted with the KV caches and the canary state donated. The
   canary-on step wraps it with the runtime endpoints (``jax_kvcanary.runtime.CanaryEndpoints``:
   plan -> HEAD verify+write for K and V before, TAIL verify+write with real-KV PARTIAL fingerprints of
   layer-0 K/V after). Off and on run in interleaved rounds; the ratio is on/off per round. The canary is populated by a
   prefill pass first, so the timed decode steps take the clean path (checked: no rows). Off and on take
   turns on the same two sets of KV buffers (each call takes the set the other used last), so neither
   keeps the luckier memory placement for a bandwidth-bound step.
"""

from __future__ import annotations

from typing import List

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_kvcanary as kvc
from jax_kvcanary.runtime import CanaryBatch, CanaryConfig, CanaryEndpoints

from .harness import Contender, fit_line, measure, ratio
from .scenarios import PAGE_SIZE, SLACK

# ---- 1. per-call overhead -----------------------------------------------------------------------


def _tiny():
    canary = kvc.new_canary_buffer(64)
    one = lambda v: jnp.full((1,), v, jnp.int32)  # noqa: E731
    vp = kvc.VerifyPlan(one(5), one(-1), one(0), one(-1), one(1), one(1))
    wp = kvc.WritePlan(jnp.array([0, 1], jnp.int32), one(-1), one(1))
    r2t = jnp.arange(2 * 8, dtype=jnp.int32).reshape(2, 8)
    return canary, vp, wp, r2t


def _chain_fn(op, impl, n):
    if op == "verify":
        def f(canary, log, vp):
            for _ in range(n):
                log = kvc.verify(canary, log, vp, tag=0, impl=impl)
            return log
        return jax.jit(f, donate_argnums=(1,))
    if op == "write":
        def f(canary, log, wp, x):
            for _ in range(n):
                canary, log = kvc.write(canary, log, wp, x, x, x + 5, tag=0, impl=impl)
            return canary, log
        return jax.jit(f, donate_argnums=(0, 1))
    if op == "plan":
        def f(rpi, p, r2t):
            acc = p
            for _ in range(n):  # each plan's prefix length depends on the previous plan
                vp, wp = kvc.plan(rpi, acc, p, r2t, verify_capacity=4, write_req_capacity=1, impl=impl)
                acc = jnp.minimum(vp.num_valid, 2)
            return acc
        return jax.jit(f)
    if op == "xla_op":
        def f(x):
            for _ in range(n):
                x = lax.optimization_barrier(x + 1)
            return x
        return jax.jit(f, donate_argnums=(0,))
    raise ValueError(op)


def dispatch(impls: List[str], chain_lengths: List[int], *, rounds: int, target_s: float) -> dict:
    canary, vp, wp, r2t = _tiny()
    ops = [(op, impl) for impl in impls for op in ("verify", "write", "plan")] + [("xla_op", "-")]
    out = {"chain_lengths": chain_lengths, "ops": {}}
    for op, impl in ops:
        contenders = []
        for n in chain_lengths:
            f = _chain_fn(op, impl if impl != "-" else None, n)
            if op == "verify":
                st = {"log": kvc.ViolationLog.create(8)}

                def run(f=f, st=st):
                    st["log"] = f(canary, st["log"], vp)
                    return st["log"]
            elif op == "write":
                st = {"c": jnp.array(canary, copy=True), "log": kvc.ViolationLog.create(8)}
                x = jnp.ones((1,), jnp.int32)

                def run(f=f, st=st, x=x):
                    st["c"], st["log"] = f(st["c"], st["log"], wp, x)
                    return st["log"]
            elif op == "plan":
                args = (jnp.ones((1,), jnp.int32), jnp.ones((1,), jnp.int32), r2t)

                def run(f=f, args=args):
                    return f(*args)
            else:
                st = {"x": jnp.zeros((1,), jnp.int32)}

                def run(f=f, st=st):
                    st["x"] = f(st["x"])
                    return st["x"]
            contenders.append(Contender(f"n{n}", run))
        res = measure(contenders, rounds=rounds, target_s=target_s)
        med = [res[f"n{n}"].median for n in chain_lengths]
        slope, icpt = fit_line(chain_lengths, med)
        key = op if op == "xla_op" else f"{op}[{impl}]"
        out["ops"][key] = {"per_call_us": slope * 1e6, "intercept_us": icpt * 1e6,
                           "median_us": {str(n): m * 1e6 for n, m in zip(chain_lengths, med)}}
    return out


# ---- 2. serving step -----------------------------------------------------------------------------

MODEL = {"layers": 4, "d_model": 256, "vocab": 4096, "dtype": "float32"}


def _endpoints(num_slots, bs, vcap):
    """The runtime's endpoints in their default configuration (FULL group, K and V, PARTIAL)."""
    return CanaryEndpoints(CanaryConfig(mode="log", real_kv_hash_mode="PARTIAL"), num_slots=num_slots,
                           write_req_capacity=bs, verify_capacity=vcap)


def _canary_batch(b):
    return CanaryBatch(b["rpi"], b["prefix"], b["extend"], b["r2t"], b["ids"], b["pos"], b["loc"])


def _model_params(rng, model):
    d, L, v = model["d_model"], model["layers"], model["vocab"]
    def mk(*s):  # float32 whatever x64 says (numpy would promote by the float64 scale)
        return jnp.asarray((rng.standard_normal(s) / np.sqrt(s[-2] if len(s) > 1 else 1)).astype(np.float32))

    return {"embed": mk(v, d), "wq": mk(L, d, d), "wk": mk(L, d, d), "wv": mk(L, d, d), "wo": mk(L, d, d)}


def _forward(params, kc, vc, b, *, attend: bool, total_len: int):
    """Returns (kc, vc, next_tokens). kc/vc: tuples of per-layer [S, d] caches."""
    x = params["embed"][b["ids"]]
    kc, vc = list(kc), list(vc)
    d = x.shape[-1]
    for l in range(len(kc)):
        q, k, v = x @ params["wq"][l], x @ params["wk"][l], x @ params["wv"][l]
        kc[l] = kc[l].at[b["loc"]].set(k)
        vc[l] = vc[l].at[b["loc"]].set(v)
        if attend:  # decode: one query per request, attention over positions [0, P] (prefix + itself)
            idx = b["r2t"][b["rpi"], :total_len]
            K, V = kc[l][idx], vc[l][idx]                       # [bs, T, d]
            s = jnp.einsum("bd,btd->bt", q, K) / np.sqrt(d)
            o = jnp.einsum("bt,btd->bd", jax.nn.softmax(s, axis=-1), V)
            x = x + o @ params["wo"][l]
    return tuple(kc), tuple(vc), jnp.argmax(x @ params["embed"].T, axis=-1).astype(jnp.int32)


def _sources(kc, vc):
    """Layer 0's K and V, one slot per row (the TAIL endpoints' real-KV sources)."""
    nb = kc[0].shape[1] * kc[0].dtype.itemsize
    return {"FULL": {"K": kvc.RealKvSource(kc[0], 1, nb, nb), "V": kvc.RealKvSource(vc[0], 1, nb, nb)}}


def _make_steps(ep, total_len):
    def off(params, kc, vc, b):
        kc, vc, nxt = _forward(params, kc, vc, b, attend=True, total_len=total_len)
        return kc, vc, nxt

    def on(params, kc, vc, state, b):
        state, ctx = ep.head(state, _canary_batch(b))
        kc, vc, nxt = _forward(params, kc, vc, b, attend=True, total_len=total_len)
        state = ep.tail(state, ctx, _sources(kc, vc))
        return kc, vc, state, nxt

    def fill(params, kc, vc, state, b):
        state, ctx = ep.head(state, _canary_batch(b))
        kc, vc, _ = _forward(params, kc, vc, b, attend=False, total_len=0)
        state = ep.tail(state, ctx, _sources(kc, vc))
        return kc, vc, state

    def canary_only(kc, vc, state, b):  # the same launches on the same state, without the model
        state, ctx = ep.head(state, _canary_batch(b))
        return ep.tail(state, ctx, _sources(kc, vc))

    return (jax.jit(off, donate_argnums=(1, 2)), jax.jit(on, donate_argnums=(1, 2, 3)),
            jax.jit(fill, donate_argnums=(1, 2, 3)), jax.jit(canary_only, donate_argnums=(2,)))


def _batch_arrays(rpi, prefix, extend, r2t, ids, pos, loc):
    i32 = lambda a: jnp.asarray(np.asarray(a, np.int32))  # noqa: E731
    return {"rpi": i32(rpi), "prefix": i32(prefix), "extend": i32(extend), "r2t": i32(r2t), "ids": i32(ids),
            "pos": i32(pos), "loc": i32(loc)}


def serving_step(bs: int, prefix: int, *, rounds: int, target_s: float, seed: int = 0, model=None) -> dict:
    model = dict(MODEL, **(model or {}))
    rng = np.random.default_rng(seed)
    length = prefix + 1
    ppr = -(-length // PAGE_SIZE)
    lp = ppr * PAGE_SIZE
    num_pages = int(np.ceil(bs * ppr * SLACK)) + 1
    S = num_pages * PAGE_SIZE
    perm = rng.permutation(np.arange(1, num_pages))[:bs * ppr]
    r2t = np.zeros((bs + 1, lp), np.int32)
    r2t[1:] = (perm.reshape(bs, ppr, 1) * PAGE_SIZE + np.arange(PAGE_SIZE)).reshape(bs, lp)
    tokens = rng.integers(1, model["vocab"], size=(bs + 1, lp), dtype=np.int32)
    rpi = np.arange(1, bs + 1, dtype=np.int32)

    ep = _endpoints(S, bs, bs * prefix)
    params = _model_params(rng, model)
    d = model["d_model"]
    zeros = lambda: tuple(jnp.zeros((S, d), jnp.float32) for _ in range(model["layers"]))  # noqa: E731
    off, on, fill, canary_only = _make_steps(ep, length)

    # prefill the prefix (K/V stores + canary records, no attention), for both the on and off caches
    fill_b = _batch_arrays(rpi, np.zeros(bs), np.full(bs, prefix), r2t, tokens[1:, :prefix].reshape(-1),
                           np.tile(np.arange(prefix), bs), r2t[1:, :prefix].reshape(-1))
    step_b = _batch_arrays(rpi, np.full(bs, prefix), np.ones(bs), r2t, tokens[1:, prefix],
                           np.full(bs, prefix), r2t[1:, prefix])
    kc, vc, state = fill(params, zeros(), zeros(), ep.init_state(), fill_b)
    copy = lambda t: jax.tree.map(lambda x: jnp.array(x, copy=True), t)  # noqa: E731
    # the two KV sets (same contents: every step stores the same K/V at the same slots), least recently used first
    st = {"kv": [(kc, vc), (copy(kc), copy(vc))], "state": state, "canary": copy(state)}

    def run_off():
        kc, vc = st["kv"].pop(0)
        kc, vc, nxt = off(params, kc, vc, step_b)
        st["kv"].append((kc, vc))
        return nxt

    def run_on():
        kc, vc = st["kv"].pop(0)
        kc, vc, st["state"], nxt = on(params, kc, vc, st["state"], step_b)
        st["kv"].append((kc, vc))
        return nxt, st["state"]

    def run_canary():
        kc, vc = st["kv"][-1]
        st["canary"] = canary_only(kc, vc, st["canary"], step_b)
        return st["canary"]

    res = measure([Contender("canary_off", run_off, kind="baseline"), Contender("canary_on", run_on),
                   Contender("canary_only", run_canary)], rounds=rounds, target_s=target_s)
    rows = st["state"].log.total() + st["canary"].log.total()
    halves = len(ep.halves)
    return {"bs": bs, "prefix": prefix, "num_slots": S, "verify_entries_per_verify": bs * prefix,
            "canary": "runtime.CanaryEndpoints",
            "launches": "plan + HEAD verify/write K,V + TAIL verify/write K,V (real-KV PARTIAL, layer 0)",
            "off_ms": res["canary_off"].median * 1e3, "on_ms": res["canary_on"].median * 1e3,
            "on_over_off": ratio(res, "canary_off", "canary_on"),
            # interference only adds time: the fastest rounds' ratio bounds the cost from the quiet side
            "on_over_off_min": min(res["canary_on"].times) / min(res["canary_off"].times),
            "off_round_ms": [t * 1e3 for t in res["canary_off"].times],
            "on_round_ms": [t * 1e3 for t in res["canary_on"].times],
            "canary_only_ms": res["canary_only"].median * 1e3,
            "launches_per_step": 1 + 2 * halves * 2,
            "verified_entries_per_step": 2 * halves * bs * prefix,
            "fingerprint_bytes_per_step": halves * (bs * prefix + bs) * 16,
            "spread_off": res["canary_off"].spread, "spread_on": res["canary_on"].spread,
            "violations_recorded": rows, "model": model}
