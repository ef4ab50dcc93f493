"""Per-op contenders (backends and baselines) for one scenario, and the measurement of a point.

Backends: ``ffi`` (the native custom call of the platform), ``xla`` (pure JAX, when it imports and
runs), ``reference`` (numpy oracle, host loops; CPU only, small sizes). All jitted backends run with
their state donated (verify: the log; write: the canary and the log), so no state is copied.

Baselines, measured in the same interleaved rounds:
- verify ``gather``: a jitted gather of the same 32-byte records (slot and predecessor; plus the same
  real-KV strip bytes when the scenario has sources), XOR-reduced to one word (no output traffic).
- write ``scatter``: a jitted scatter of the same 32-byte records into a donated canary-sized buffer
  (``unique_indices=True``; plus a gather of the written slots' strip bytes with sources).
- plan ``cumsum_gather``: a jitted cumsum of the per-row lengths, the owning row of each entry
  (``jnp.repeat``, itself a cumsum), and the gathers of ``req_to_token`` at each position and its
  predecessor.
- native C (CPU, no sources): ``c_read`` (load both records per entry, no hashing), ``c_read_prefetch``
  (same + software prefetch), ``c_verify_mix3`` (same reads + the mix3 of the predecessor and the
  compares: verify-equivalent work), ``c_write_chain`` (the serial hash chain + record stores).
"""

from __future__ import annotations

import functools
from typing import Dict, List, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_kvcanary as kvc
from jax_kvcanary import RealKvHashMode, reference

from .harness import Contender, Result, measure, ratio
from .scenarios import TAG, Scenario

BASELINE = {"verify": "gather", "write": "scatter", "plan": "cumsum_gather"}
NATIVE_LIMIT = {"verify": "c_read", "write": "c_write_chain"}


# ---- availability of the backends ---------------------------------------------------------------

def probe_xla() -> Optional[str]:
    """None if ``impl="xla"`` imports and runs a tiny verify; else the reason to skip it."""
    try:
        from jax_kvcanary import xla_impl  # noqa: F401
        c = kvc.new_canary_buffer(4)
        vp = kvc.VerifyPlan(*(jnp.zeros(1, jnp.int32) for _ in range(4)), jnp.zeros(1, jnp.int32),
                            jnp.ones(1, jnp.int32))
        kvc.verify(c, kvc.ViolationLog.create(4), vp, tag=0, impl="xla").write_index.block_until_ready()
        return None
    except Exception as e:  # noqa: BLE001 — any failure means: skip with a note
        return f"impl='xla' unavailable: {type(e).__name__}: {str(e)[:200]}"


# ---- jitted ops (cached per static configuration) ---------------------------------------------

@functools.lru_cache(maxsize=None)
def _verify_fn(impl, mode):
    def f(canary, log, vp, srcs):
        return kvc.verify(canary, log, vp, tag=TAG, real_kv_sources=srcs, real_kv_hash_mode=mode, impl=impl)
    return jax.jit(f, donate_argnums=(1,))


@functools.lru_cache(maxsize=None)
def _write_fn(impl, mode):
    def f(canary, log, wp, ids, pos, loc, srcs):
        return kvc.write(canary, log, wp, ids, pos, loc, tag=TAG, real_kv_sources=srcs, real_kv_hash_mode=mode,
                         impl=impl)
    return jax.jit(f, donate_argnums=(0, 1))


@functools.lru_cache(maxsize=None)
def _plan_fn(impl, vcap, wcap, window, has_lut):
    def f(rpi, p, e, r2t, lut):
        return kvc.plan(rpi, p, e, r2t, verify_capacity=vcap, write_req_capacity=wcap, swa_window_size=window,
                        full_to_swa_index_mapping=lut if has_lut else None, impl=impl)
    return jax.jit(f)


def _as_u32_rows(canary):
    """uint8[S, 32k] -> uint32[S, 8k] (a bitcast)."""
    s, w = canary.shape
    return lax.bitcast_convert_type(canary.reshape(s, w // 4, 4), jnp.uint32)


def _xor_all(x):
    return lax.reduce(x, np.array(0, x.dtype), lax.bitwise_xor, tuple(range(x.ndim)))


def _eff(mode, src):
    return 16 if mode == RealKvHashMode.PARTIAL else src.read_bytes


@functools.lru_cache(maxsize=None)
def _gather_fn(effs):
    def f(canary, slots, prevs, arrays):
        rec = _as_u32_rows(canary)[:, :8]
        acc = _xor_all(rec[slots] ^ rec[jnp.maximum(prevs, 0)])
        for arr, eff in zip(arrays, effs):
            acc = acc ^ _xor_all(arr[slots, :eff]).astype(jnp.uint32)
        return acc
    return jax.jit(f)


@functools.lru_cache(maxsize=None)
def _scatter_fn(effs):
    def f(buf, locs, records, arrays):
        buf = buf.at[locs].set(records, unique_indices=True, mode="drop")
        acc = jnp.zeros((), jnp.uint8)
        for arr, eff in zip(arrays, effs):
            acc = acc ^ _xor_all(arr[locs, :eff])
        return buf, acc
    return jax.jit(f, donate_argnums=(0,))


@functools.lru_cache(maxsize=None)
def _cumsum_gather_fn(vcap, window, has_lut):
    def f(rpi, prefix, extend, r2t, lut):
        bs = rpi.shape[0]
        live = rpi != 0
        start = jnp.maximum(prefix - window, 0) if window else jnp.zeros_like(prefix)
        vlen = jnp.where(live, jnp.maximum(prefix - start, 0), 0)
        csum = jnp.cumsum(vlen)
        first = csum - vlen
        row = jnp.repeat(jnp.arange(bs, dtype=jnp.int32), vlen, total_repeat_length=vcap)
        pos = jnp.arange(vcap, dtype=jnp.int32) - first[row] + start[row]
        rp = rpi[row]
        slot = r2t[rp, pos]
        prev = jnp.where(pos > 0, r2t[rp, jnp.maximum(pos - 1, 0)], -1)
        if has_lut:
            slot, prev = lut[slot], jnp.where(prev >= 0, lut[jnp.maximum(prev, 0)], -1)
        offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(jnp.where(live, extend, 0))])
        return slot, pos, prev, offsets, csum[-1]
    return jax.jit(f)


def _host(x):
    return jax.tree_util.tree_map(lambda a: np.array(a), x)


# ---- contenders --------------------------------------------------------------------------------

class Env:
    """What the run has: platform, available backends, native baselines, size caps."""

    def __init__(self, platform, backends, native, *, ref_cap, xla_cap, notes):
        self.platform = platform
        self.backends = backends      # subset of ('ffi', 'xla', 'reference')
        self.native = native          # bench.native.Native or None
        self.ref_cap = ref_cap        # max entries for the numpy reference
        self.xla_cap = xla_cap        # max entries for impl='xla'
        self.notes = notes            # list of strings shared with the report


def _use(env: Env, backend: str, entries: int) -> bool:
    if backend not in env.backends:
        return False
    if backend == "reference":
        return entries <= env.ref_cap
    if backend == "xla":
        return entries <= env.xla_cap
    return True


def verify_contenders(sc: Scenario, env: Env) -> List[Contender]:
    out = []
    n = sc.verify_entries
    for impl in ("ffi", "xla"):
        if _use(env, impl, n):
            f = _verify_fn(impl, sc.mode)
            st = {"log": kvc.ViolationLog.create(ring_capacity=64)}

            def run(f=f, st=st):
                st["log"] = f(sc.canary, st["log"], sc.verify_plan, sc.sources)
                return st["log"]
            run.state = st
            out.append(Contender(impl, run))
    if _use(env, "reference", n):
        hc, hp = np.array(sc.canary), _host(sc.verify_plan)
        hs = tuple(kvc.RealKvSource(np.array(s.array), s.page_size, s.num_bytes_per_token, s.read_bytes,
                                     s.offset_bytes)
                   for s in sc.sources)
        hl = _host(kvc.ViolationLog.create(ring_capacity=64))
        out.append(Contender("reference", lambda: reference.verify(hc, hl, hp, tag=TAG, real_kv_sources=hs,
                                                                   real_kv_hash_mode=sc.mode), max_reps=1))
    g = _gather_fn(tuple(_eff(sc.mode, s) for s in sc.sources))
    arrays = tuple(s.array for s in sc.sources)
    vp = sc.verify_plan
    out.append(Contender("gather", lambda: g(sc.canary, vp.slot_indices, vp.prev_slot_indices, arrays),
                         kind="baseline"))
    if env.native is not None and not sc.sources:
        nat = env.native
        out.append(Contender("c_read", nat.read_records(sc.canary, vp.slot_indices, vp.prev_slot_indices, n),
                             kind="baseline", note="reads both records, no hashing"))
        out.append(Contender("c_read_prefetch", nat.read_records(sc.canary, vp.slot_indices, vp.prev_slot_indices,
                                                                 n, prefetch=True),
                             kind="baseline", note="reads both records + software prefetch, no hashing"))
        out.append(Contender("c_verify_mix3", nat.verify_mix3(sc.canary, vp.slot_indices, vp.expected_positions,
                                                              vp.prev_slot_indices, n),
                             kind="baseline", note="reads both records + mix3 + compares"))
    return out


def write_contenders(sc: Scenario, env: Env) -> List[Contender]:
    out = []
    n = sc.write_entries
    for impl in ("ffi", "xla"):
        if _use(env, impl, n) and _use(env, impl, sc.verify_entries):
            f = _write_fn(impl, sc.mode)
            st = {"canary": jnp.array(sc.canary, copy=True), "log": kvc.ViolationLog.create(ring_capacity=64)}

            def run(f=f, st=st):
                st["canary"], st["log"] = f(st["canary"], st["log"], sc.write_plan, sc.input_ids, sc.positions,
                                            sc.out_cache_loc, sc.sources)
                return st["canary"], st["log"]
            run.state = st
            out.append(Contender(impl, run))
    if _use(env, "reference", n) and _use(env, "reference", sc.num_slots // 8):
        hc, hp = np.array(sc.canary), _host(sc.write_plan)
        hi, hpos, hloc = np.array(sc.input_ids), np.array(sc.positions), np.array(sc.out_cache_loc)
        hs = tuple(kvc.RealKvSource(np.array(s.array), s.page_size, s.num_bytes_per_token, s.read_bytes,
                                     s.offset_bytes)
                   for s in sc.sources)
        hl = _host(kvc.ViolationLog.create(ring_capacity=64))
        out.append(Contender("reference", lambda: reference.write(hc, hl, hp, hi, hpos, hloc, tag=TAG,
                                                                  real_kv_sources=hs, real_kv_hash_mode=sc.mode),
                             max_reps=1))
    # the records the step writes, taken from one real write
    after, _ = _write_fn(None, sc.mode)(jnp.array(sc.canary, copy=True), kvc.ViolationLog.create(ring_capacity=64),
                                         sc.write_plan, sc.input_ids, sc.positions, sc.out_cache_loc, sc.sources)
    records = _as_u32_rows(after)[sc.out_cache_loc][:, :8]
    sf = _scatter_fn(tuple(_eff(sc.mode, s) for s in sc.sources))
    arrays = tuple(s.array for s in sc.sources)
    sst = {"buf": jnp.zeros((sc.num_slots, 8), jnp.uint32)}

    def scatter():
        sst["buf"], acc = sf(sst["buf"], sc.out_cache_loc, records, arrays)
        return sst["buf"], acc
    out.append(Contender("scatter", scatter, kind="baseline"))
    if env.native is not None and not sc.sources:
        wp = sc.write_plan
        cbuf = jnp.array(sc.canary, copy=True).block_until_ready()
        fn = env.native.write_chain(cbuf, wp.offsets, wp.seed_slot_indices, sc.bs, sc.input_ids, sc.positions,
                                    sc.out_cache_loc)
        fn.buffer, fn.expected = cbuf, after
        out.append(Contender("c_write_chain", fn, kind="baseline", note="serial mix3 chain + record stores"))
    return out


def plan_contenders(sc: Scenario, env: Env) -> List[Contender]:
    out = []
    n = sc.verify_entries
    args = (sc.rpi, sc.prefix_lens, sc.extend_lens, sc.req_to_token, sc.lut)
    for impl in ("ffi", "xla"):
        if _use(env, impl, n):
            f = _plan_fn(impl, sc.verify_capacity, sc.bs, sc.window, sc.lut is not None)
            out.append(Contender(impl, lambda f=f: f(*args)))
    if _use(env, "reference", n):
        h = [np.array(a) if a is not None else None for a in args]
        out.append(Contender("reference", lambda: reference.plan(
            h[0], h[1], h[2], h[3], verify_capacity=sc.verify_capacity, write_req_capacity=sc.bs,
            swa_window_size=sc.window, full_to_swa_index_mapping=h[4]), max_reps=1))
    g = _cumsum_gather_fn(sc.verify_capacity, sc.window, sc.lut is not None)
    out.append(Contender("cumsum_gather", lambda: g(*args), kind="baseline"))
    return out


CONTENDERS = {"verify": verify_contenders, "write": write_contenders, "plan": plan_contenders}


def _violations(contenders) -> Dict[str, int]:
    """Rows recorded by each jitted backend's state during timing (0 = the clean path held)."""
    out = {}
    for c in contenders:
        st = getattr(c.fn, "state", None)
        if st and "log" in st:
            out[c.name] = st["log"].total()
    return out


def _check_c_chain(contenders) -> Optional[bool]:
    for c in contenders:
        if c.name == "c_write_chain":
            return bool(np.array_equal(np.array(c.fn.buffer)[:, :32], np.array(c.fn.expected)[:, :32]))
    return None


def measure_op(op: str, sc: Scenario, env: Env, *, rounds: int, target_s: float) -> dict:
    """Time every contender of ``op`` on ``sc``; returns a JSON-ready record."""
    contenders = CONTENDERS[op](sc, env)
    results = measure(contenders, rounds=rounds, target_s=target_s)
    entries = sc.write_entries if op == "write" else sc.verify_entries
    rec = {"op": op, "scenario": sc.describe(), "entries": entries, "rounds": rounds, "contenders": {}}
    for name, r in results.items():
        rec["contenders"][name] = _summary(r, entries)
    base, lim = BASELINE[op], NATIVE_LIMIT.get(op)
    rec["ratios"] = {}
    for name, r in results.items():
        if r.kind != "backend":
            continue
        rs = {}
        for other in results:
            if other != name and results[other].kind == "baseline":
                rs[f"vs_{other}"] = ratio(results, name, other)
        rec["ratios"][name] = rs
    rec["baseline"], rec["native_limit"] = base, lim if lim in results else None
    v = _violations(contenders)
    if v:
        rec["violations_recorded"] = v
    ok = _check_c_chain(contenders)
    if ok is not None:
        rec["c_write_chain_records_match_ffi"] = ok
    return rec


def _summary(r: Result, entries: int) -> dict:
    med = r.median
    return {"kind": r.kind, "median_s": med, "entries_per_s": entries / med if med > 0 else None,
            "spread": r.spread, "reps_per_round": r.reps, "times_s": r.times,
            **({"note": r.note} if r.note else {})}
