"""Seeded fuzzing of every public op with malformed device data, ``impl="ffi"`` and ``impl="xla"``
against the numpy reference.

Each case draws adversarial values: negative and huge slots, seeds, predecessors, LUT entries,
req_to_token and pool values; non-monotonic and overlong offsets; negative and huge ``num_valid`` /
``num_valid_reqs`` / ``enable``; prefix lengths past the table; ``valid_lens`` past the pool; rings of
capacity 1 and ``write_index`` near saturation or negative; canary buffers of random bytes; real-KV
sources with too few (or zero) rows for a slot; plan ``row_starts`` before, across the end of and past
a flat table, and near the integer limits (sums that wrap). A share of every case is well formed (valid chains,
in-range slots) so that the passing paths are exercised too. For each case:

* every output byte of both backends equals the reference (``ffi`` and ``xla`` run jitted; shapes and
  static options are fixed per *class*, so all cases of a class share one compile);
* an INDEX_OUT_OF_RANGE row appears for exactly the out-of-range values, with the ``IndexKind`` and
  bound docs/format.md gives (§5.3), computed here independently of the reference;
* the §6 invariants hold (Δkernel_run == 1, Δslot_run, verify rows <= 3 x active, fill-once ring).

With x64 off every index array is int32 (values span the int32 range); with x64 on they are int64
(values span the int64 range, including sums that wrap). 10,000 cases per op (about a minute on 2
cores; marked ``slow``). ``KVC_FUZZ_SEED`` changes the seed (default 0).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcanary as kvc
from jax_kvcanary import hashing, reference
from jax_kvcanary.consts import IndexKind, RealKvHashMode

from tests.support.cases import compare as diffs
from tests.support.impls import COMPARED_IMPLS, XLA

pytestmark = pytest.mark.fuzz
X64 = bool(jax.config.jax_enable_x64)
CASES = 10_000  # per op
SEED = int(os.environ.get("KVC_FUZZ_SEED", "0"))

I32_MIN, I32_MAX = -2**31, 2**31 - 1
I64_MIN, I64_MAX = -2**63, 2**63 - 1
HUGE32 = [I32_MIN, I32_MAX, I32_MIN + 1, I32_MAX - 1, 2**30, -2**30]
HUGE64 = HUGE32 + [I64_MIN, I64_MAX, I64_MIN + 1, I64_MAX - 1, 2**31, -2**31 - 1, 2**32, 2**40,
                   -2**40, 2**62, -2**62]
NONE, PARTIAL, ALL = int(RealKvHashMode.NONE), int(RealKvHashMode.PARTIAL), int(RealKvHashMode.ALL)
OOB = 64


# ---- value generation ---------------------------------------------------------------------------

class Gen:
    def __init__(self, *key):
        self.rng = np.random.default_rng([SEED, *key])
        self.wide = X64
        self.dtype = np.int64 if X64 else np.int32

    def p(self, prob):
        return bool(self.rng.random() < prob)

    def int(self, lo, hi):
        return int(self.rng.integers(lo, hi, endpoint=True))

    def choice(self, seq):
        return seq[int(self.rng.integers(0, len(seq)))]

    def fit(self, v):
        """Clamp to the index dtype (int32 with x64 off)."""
        lo, hi = (I64_MIN, I64_MAX) if self.wide else (I32_MIN, I32_MAX)
        return min(max(int(v), lo), hi)

    def pick(self, lo, hi):
        """Usually in [lo, hi], often at its edges, sometimes huge or uniformly random."""
        k = self.rng.random()
        if k < 0.62:
            v = self.int(lo, hi)
        elif k < 0.80:
            v = self.choice([lo - 1, lo, hi, hi + 1, -1, 0, 1, -2])
        elif k < 0.92:
            v = self.choice(HUGE64 if self.wide else HUGE32)
        elif self.wide:
            v = int(self.rng.integers(I64_MIN, I64_MAX, endpoint=True))
        else:
            v = int(self.rng.integers(I32_MIN, I32_MAX, endpoint=True))
        return self.fit(v)

    def idx(self, values):
        return np.array([self.fit(v) for v in values], dtype=np.int64).astype(self.dtype)

    def i32(self, v):
        return np.array([min(max(int(v), I32_MIN), I32_MAX)], np.int32)

    def bytes(self, *shape):
        return self.rng.integers(0, 256, shape, dtype=np.uint8)


def rand_log(g: Gen, cap: int, tag: int) -> kvc.ViolationLog:
    T = kvc.NUM_LAUNCH_TAGS
    ring = g.bytes(cap, 64)
    wi = g.choice([0, 0, 0, 0, 0, 1, cap - 1, cap, cap + 2, I32_MAX, I32_MAX - 1, I32_MAX - 3, -1, -5,
                   I32_MIN, g.int(0, 3 * cap)])
    if g.p(0.5):
        kc, sc = np.zeros((T, 8), np.uint8), np.zeros((T, 8), np.uint8)
    else:
        kc, sc = g.bytes(T, 8), g.bytes(T, 8)
    if g.p(0.1):
        kc[tag] = 0xFF
        sc[tag] = 0xFF  # both counters wrap
    flag = g.choice([1, 1, 1, 0, 2, -1])
    return kvc.ViolationLog(ring=ring, write_index=g.i32(wi), kernel_run_counters=kc,
                            slot_run_counters=sc, enable_chain_position_assert=g.i32(flag))


# Source layouts: (dtype, page_size, num_bytes_per_token, read_bytes, rows, hole bytes, ndim);
# rows: "full" (every slot addressable), "few" (the last slots are not), "zero", or an int.
SOURCES = {
    "u8_p1_full": (np.uint8, 1, 32, 32, "full", 0, 2),
    "u8_p1_few": (np.uint8, 1, 32, 16, "few", 0, 2),
    "bf16_p4_hole": (jnp.bfloat16, 4, 16, 16, "full", 32, 2),
    "f32_p2_few": (np.float32, 2, 48, 32, "few", 16, 3),
    "i32_p8_one": (np.int32, 8, 16, 16, 1, 0, 2),
    "u8_p4_zero": (np.uint8, 4, 16, 16, "zero", 0, 2),
}


def make_sources(g: Gen, names, S):
    out = []
    for name in names:
        dt, page, nbpt, rb, rows, hole, ndim = SOURCES[name]
        need = -(-S // page)
        # fixed per class (shapes must not vary between cases, or every case recompiles)
        rows = {"full": need, "few": max(1, need - max(1, need // 3)), "zero": 0}.get(rows, rows)
        raw = g.bytes(rows, page * nbpt + hole)
        if g.p(0.1):
            raw[:] = 0
        arr = raw.view(np.dtype(dt))
        if ndim == 3:
            arr = arr.reshape(rows, 2, -1)
        out.append(kvc.RealKvSource(arr, page, nbpt, rb))
    return tuple(out)


def src_bounds(sources):
    return [(s.page_size, int(s.array.shape[0])) for s in sources]


def first_bad(bounds, slot):
    for k, (ps, rows) in enumerate(bounds):
        if slot // ps >= rows:
            return k
    return None


def record(tok, pos, prev, rkv):
    return np.array([hashing.to_i64(v) for v in (tok, pos, prev, rkv)], "<i8").view(np.uint8)


# ---- case classes (fixed shapes and static options per class) ------------------------------------

VERIFY_CLASSES = {
    # ring capacity 1, two sources (one too short), token check on
    "v_cap1_all": dict(S=16, stride=32, V=12, cap=1, tag=3, check=True, mode=ALL,
                       srcs=("u8_p1_few", "bf16_p4_hole")),
    # big ring: every row is kept, so the OOB rows are checked one by one
    "v_big_partial": dict(S=24, stride=40, V=16, cap=64, tag=0, check=False, mode=PARTIAL,
                          srcs=("f32_p2_few", "i32_p8_one", "u8_p1_full")),
    "v_none": dict(S=8, stride=32, V=8, cap=4, tag=11, check=True, mode=NONE, srcs=()),
    "v_zero_rows": dict(S=12, stride=64, V=6, cap=32, tag=7, check=False, mode=ALL,
                        srcs=("u8_p1_full", "u8_p4_zero")),
}

WRITE_CLASSES = {
    "w_cap1_all_assert": dict(S=16, stride=32, N=12, C=4, cap=1, tag=2, assert_on=True, mode=ALL,
                              srcs=("u8_p1_few",)),
    "w_big_partial": dict(S=24, stride=48, N=16, C=3, cap=96, tag=5, assert_on=False,
                          mode=PARTIAL, srcs=("f32_p2_few", "bf16_p4_hole", "i32_p8_one")),
    "w_none_assert": dict(S=12, stride=32, N=10, C=5, cap=8, tag=9, assert_on=True, mode=NONE,
                          srcs=()),
    "w_n0": dict(S=6, stride=32, N=0, C=2, cap=2, tag=1, assert_on=False, mode=ALL,
                 srcs=("u8_p1_full",)),
}

PLAN_CLASSES = {
    "p_pool": dict(bs=4, R=4, L=8, Vc=12, Wc=5, W=0, lut=0, pool=(4, 6), koff=0),
    "p_swa_lut": dict(bs=3, R=3, L=6, Vc=8, Wc=3, W=3, lut=20, pool=(3, 9), koff=1),
    "p_lut_nowin": dict(bs=5, R=6, L=5, Vc=30, Wc=6, W=0, lut=7, pool=None, koff=-1, evicted=True),
    "p_empty_table": dict(bs=2, R=2, L=0, Vc=4, Wc=2, W=0, lut=0, pool=(0, 3), koff=0),
}

# plan with row_starts: req_to_token is a flat page table of N slots; R bounds req_pool_indices (and
# the pool rows), L the prefix lengths.
PLAN_FLAT_CLASSES = {
    "f_plain": dict(bs=4, R=4, L=8, N=24, Vc=16, Wc=5, W=0, lut=0, pool=None, koff=0),
    "f_swa_lut_pool": dict(bs=3, R=3, L=8, N=20, Vc=10, Wc=4, W=3, lut=20, pool=(3, 9), koff=1,
                           evicted=True),
    "f_empty_table": dict(bs=2, R=2, L=4, N=0, Vc=4, Wc=2, W=0, lut=0, pool=(2, 3), koff=0),
}

SCATTER_CLASSES = {
    "s_i32": dict(pool=np.int32, Rp=4, Cp=6, bs=3, total=10),
    "s_wide_pool": dict(pool=np.int64 if X64 else np.int32, Rp=3, Cp=4, bs=5, total=7),
    "s_cp0": dict(pool=np.int32, Rp=2, Cp=0, bs=2, total=3),
    "s_noids": dict(pool=np.int32, Rp=3, Cp=5, bs=4, total=0),
}


def verify_case(cls, seed):
    c = VERIFY_CLASSES[cls]
    g = Gen(0, sorted(VERIFY_CLASSES).index(cls), seed)
    S, V, mode = c["S"], c["V"], c["mode"]
    sources = make_sources(g, c["srcs"], S)
    canary = g.bytes(S, c["stride"])
    if g.p(0.2):
        canary[:] = 0
    # a valid chain over a permutation of slots, then malformed values on top
    perm = [int(x) for x in g.rng.permutation(np.arange(1, S))]
    chain_mode = g.p(0.7)
    pos0 = 0 if g.p(0.7) else g.int(0, 50)
    h = hashing.ANCHOR_HASH
    slots, toks, poss, prevs = [], [], [], []
    for e in range(V):
        if chain_mode and e < len(perm):
            s, tok, pos = perm[e], g.int(-3, 50000), pos0 + e
            rkv = 0
            if mode != NONE and sources and hashing.first_unaddressable_source(sources, s) is None:
                rkv = hashing.slot_real_kv_hash(sources, s, mode)
            canary[s, :32] = record(tok, pos, h, rkv)
            h = hashing.mix3(h, tok, pos)
            slots.append(s), toks.append(tok if g.p(0.8) else -1), poss.append(pos)
            prevs.append((-1 if pos0 == 0 else 0) if e == 0 else perm[e - 1])
        else:
            slots.append(g.pick(-2, S + 1)), toks.append(g.pick(-2, 50)), poss.append(g.pick(-1, 40))
            prevs.append(g.pick(-2, S + 1))
        if g.p(0.1):
            slots[e] = g.pick(-2, S + 1)
        if g.p(0.1):
            prevs[e] = g.pick(-2, S + 1)
        if g.p(0.05):
            poss[e] = g.pick(-1, 40)
    if g.p(0.3):
        canary[g.int(0, S - 1), :32] = g.bytes(32)
    nv = g.int(0, V) if g.p(0.7) else g.pick(-2, V + 2)
    enable = g.choice([1] * 12 + [0, 0, -1, 7, I32_MIN])
    plan = kvc.VerifyPlan(slot_indices=g.idx(slots), expected_tokens=g.idx(toks),
                          expected_positions=g.idx(poss), prev_slot_indices=g.idx(prevs),
                          num_valid=g.i32(nv), enable=g.i32(enable))
    kwargs = dict(tag=c["tag"], check_verify_expected_token=c["check"], real_kv_sources=sources,
                  real_kv_hash_mode=mode)
    return (canary, rand_log(g, c["cap"], c["tag"]), plan), kwargs


def write_case(cls, seed):
    c = WRITE_CLASSES[cls]
    g = Gen(1, sorted(WRITE_CLASSES).index(cls), seed)
    S, N, C = c["S"], c["N"], c["C"]
    canary = g.bytes(S, c["stride"])
    if g.p(0.3):
        canary[:] = 0
    if g.p(0.6):
        offsets, acc = [], 0
        for _ in range(C + 1):
            offsets.append(acc)
            acc += g.int(0, 5)
        if g.p(0.3):
            offsets[g.int(0, C)] = g.pick(-2, N + 2)
    else:
        offsets = [g.pick(-2, N + 3) for _ in range(C + 1)]
    seeds = [g.pick(-2, S + 1) for _ in range(C)]
    p0 = g.int(0, 8)
    ids = [g.int(-2, 1000) if g.p(0.85) else g.pick(0, 10) for _ in range(N)]
    pos = [p0 + i if g.p(0.7) else g.pick(-1, 30) for i in range(N)]
    loc = [g.int(0, S - 1) if g.p(0.7) else g.pick(-2, S + 1) for _ in range(N)]
    nvr = g.int(0, C) if g.p(0.7) else g.pick(-2, C + 2)
    plan = kvc.WritePlan(offsets=g.idx(offsets), seed_slot_indices=g.idx(seeds), num_valid_reqs=g.i32(nvr))
    kwargs = dict(tag=c["tag"], real_kv_sources=make_sources(g, c["srcs"], S), real_kv_hash_mode=c["mode"],
                  enable_write_input_assert=c["assert_on"])
    if c["assert_on"]:
        kwargs["expected_input_tokens"] = g.idx([t if g.p(0.85) else g.pick(-1, 1000) for t in ids])
        kwargs["expected_input_positions"] = g.idx([q if g.p(0.85) else g.pick(-1, 30) for q in pos])
    args = (canary, rand_log(g, c["cap"], c["tag"]), plan, g.idx(ids), g.idx(pos), g.idx(loc))
    return args, kwargs


def plan_case(cls, seed):
    c = PLAN_CLASSES[cls]
    g = Gen(2, sorted(PLAN_CLASSES).index(cls), seed)
    bs, R, L, S = c["bs"], c["R"], c["L"], 40
    table = np.array([g.int(0, S - 1) if g.p(0.8) else g.pick(-1, S) for _ in range(R * L)], np.int64)
    rps = [g.int(0, max(R - 1, 0)) if g.p(0.75) else g.pick(-1, R) for _ in range(bs)]
    P = [g.int(0, L) if g.p(0.7) else g.pick(-1, L + 2) for _ in range(bs)]
    E = [g.int(0, 4) if g.p(0.7) else g.pick(-1, 5) for _ in range(bs)]
    kwargs = dict(verify_capacity=c["Vc"], write_req_capacity=c["Wc"], swa_window_size=c["W"],
                  kv_token_id_vs_position_offset=c["koff"])
    kwargs.update(plan_optional_kwargs(g, c, bs, S))
    return (g.idx(rps), g.idx(P), g.idx(E), g.idx(table).reshape(R, L)), kwargs


def plan_optional_kwargs(g, c, bs, S):
    """The LUT and token-pool arguments of a plan case of class ``c`` (drawn in this order), and
    the class's ``report_evicted_in_window``."""
    kwargs = {}
    if c["lut"]:
        kwargs["full_to_swa_index_mapping"] = g.idx(
            [g.int(0, S - 1) if g.p(0.8) else g.pick(-1, S) for _ in range(c["lut"])])
    if c["pool"]:
        Rp, Cp = c["pool"]
        kwargs["req_to_verify_expected_tokens"] = g.idx(
            [g.int(-1, 1000) if g.p(0.85) else g.pick(-1, 5) for _ in range(Rp * Cp)]).reshape(Rp, Cp)
        kwargs["req_to_verify_expected_tokens_valid_lens"] = g.idx(
            [g.int(0, Cp) if g.p(0.6) else g.pick(-1, Cp + 2) for _ in range(bs)])
    if c.get("evicted"):
        kwargs["report_evicted_in_window"] = True
    return kwargs


def plan_flat_case(cls, seed):
    c = PLAN_FLAT_CLASSES[cls]
    g = Gen(4, sorted(PLAN_FLAT_CLASSES).index(cls), seed)
    bs, R, L, N, S = c["bs"], c["R"], c["L"], c["N"], 40
    table = [g.int(0, S - 1) if g.p(0.8) else g.pick(-1, S) for _ in range(N)]
    rps = [g.int(0, R - 1) if g.p(0.75) else g.pick(-1, R) for _ in range(bs)]
    P = [g.int(0, L) if g.p(0.7) else g.pick(-1, L + 2) for _ in range(bs)]
    E = [g.int(0, 4) if g.p(0.7) else g.pick(-1, 5) for _ in range(bs)]
    starts, cursor = [], 0
    for p in P:  # segments one after the other, or anything (negative, past N, huge, near the wrap)
        if g.p(0.6):
            starts.append(cursor)
            cursor += min(max(p, 0), L) + g.int(0, 3)
        else:
            starts.append(g.pick(-L, N + L))
    kwargs = dict(verify_capacity=c["Vc"], write_req_capacity=c["Wc"], swa_window_size=c["W"],
                  kv_token_id_vs_position_offset=c["koff"], row_starts=g.idx(starts))
    kwargs.update(plan_optional_kwargs(g, c, bs, S))
    return (g.idx(rps), g.idx(P), g.idx(E), g.idx(table)), kwargs


def scatter_case(cls, seed):
    c = SCATTER_CLASSES[cls]
    g = Gen(3, sorted(SCATTER_CLASSES).index(cls), seed)
    Rp, Cp, bs, total = c["Rp"], c["Cp"], c["bs"], c["total"]
    info = np.iinfo(c["pool"])
    pool = g.rng.integers(info.min, info.max, (Rp, Cp), endpoint=True).astype(c["pool"])
    ids = g.idx([g.pick(-1, 100000) for _ in range(total)])
    if g.p(0.5):
        offs, acc = [], 0 if g.p(0.8) else g.int(0, 3)
        for _ in range(bs + 1):
            offs.append(acc)
            acc += g.int(0, Cp + 2)
        if g.p(0.3):
            offs[g.int(0, bs)] = g.pick(-3, total + 3)
    else:
        offs = [g.pick(-3, total + 3) for _ in range(bs + 1)]
    rps = [g.int(0, Rp) if g.p(0.75) else g.pick(-1, Rp) for _ in range(bs)]
    if bs >= 2 and g.p(0.4):
        rps[g.int(1, bs - 1)] = rps[0]  # duplicate pool row: the later batch row wins
    return (pool, ids, g.idx(offs), g.idx(rps)), {}


MAKERS = {"verify": (VERIFY_CLASSES, verify_case), "write": (WRITE_CLASSES, write_case),
          "plan": (PLAN_CLASSES, plan_case), "scatter_req_token_ids": (SCATTER_CLASSES, scatter_case),
          "plan_row_starts": (PLAN_FLAT_CLASSES, plan_flat_case)}
OP_OF = {"plan_row_starts": "plan"}  # a MAKERS key that is not an op name: the op it runs
STATIC = {"tag", "check_verify_expected_token", "real_kv_hash_mode", "enable_write_input_assert",
          "verify_capacity", "write_req_capacity", "swa_window_size", "kv_token_id_vs_position_offset",
          "report_evicted_in_window"}


# ---- running and comparing -----------------------------------------------------------------------

_JITS = {}


def run_backend(op, cls, impl, args, kwargs):
    static = {k: v for k, v in kwargs.items() if k in STATIC}
    dyn = {k: v for k, v in kwargs.items() if k not in STATIC}
    key = (op, cls, impl)
    if key not in _JITS:
        fn = getattr(kvc, op)
        _JITS[key] = jax.jit(lambda a, d: fn(*a, impl=impl, **static, **d))
    out = _JITS[key](*jax.tree_util.tree_map(jnp.asarray, (args, dyn)))
    return jax.tree_util.tree_map(np.asarray, out)


def i64(a):
    return np.ascontiguousarray(np.asarray(a)).view("<i8").reshape(-1)


def ints(a):
    return np.asarray(a).astype(np.int64).reshape(-1).tolist()


def expected_oob_rows(op, args, kwargs):
    """The (IndexKind, value, bound) of every OOB row, in ring order, derived from §5.3/§7.3/§8.3."""
    srcs = kwargs.get("real_kv_sources", ())
    active_src = kwargs.get("real_kv_hash_mode", NONE) != NONE and len(srcs) > 0
    bounds = src_bounds(srcs)
    out = []
    if op == "verify":
        canary, _, vp = args
        S = canary.shape[0]
        if ints(vp.enable)[0] == 0:
            return out
        slots, prevs = ints(vp.slot_indices), ints(vp.prev_slot_indices)
        for e in range(min(max(ints(vp.num_valid)[0], 0), len(slots))):
            s, prev = slots[e], prevs[e]
            if s == 0:
                continue
            if s < 0 or s >= S:
                out.append((IndexKind.VERIFY_SLOT, s, S))
                continue
            if prev >= S:
                out.append((IndexKind.VERIFY_PREV, prev, S))
            k = first_bad(bounds, s) if active_src else None
            if k is not None:
                out.append((IndexKind.REAL_KV_SOURCE_0 + k, s // bounds[k][0], bounds[k][1]))
    else:
        canary, _, wp, input_ids, _, loc = args
        S, N = canary.shape[0], len(input_ids)
        offs, seeds, loc = ints(wp.offsets), ints(wp.seed_slot_indices), ints(loc)
        active = min(max(ints(wp.num_valid_reqs)[0], 0), len(seeds))
        o = [min(max(offs[0], 0), N)]
        for k in range(1, active + 1):
            o.append(min(max(offs[k], o[-1]), N))
        for r in range(active):
            if o[r + 1] == o[r]:
                continue
            if seeds[r] >= S:
                out.append((IndexKind.WRITE_SEED, seeds[r], S))
            for i in range(o[r], o[r + 1]):
                s = loc[i]
                if s >= S:
                    out.append((IndexKind.WRITE_SLOT, s, S))
                elif s >= 0 and active_src:
                    k = first_bad(bounds, s)
                    if k is not None:
                        out.append((IndexKind.REAL_KV_SOURCE_0 + k, s // bounds[k][0], bounds[k][1]))
    return out


def check_invariants(op, args, kwargs, out):
    """§5.1, §5.3 and §6 on the reference-equal output; returns a list of problems."""
    problems = []
    log0 = args[1]
    log1 = out if op == "verify" else out[1]
    tag = kwargs["tag"]
    dk = (i64(log1.kernel_run_counters) - i64(log0.kernel_run_counters))
    ds = (i64(log1.slot_run_counters) - i64(log0.slot_run_counters))
    want_k = np.zeros_like(dk)
    want_k[tag] = 1
    if not np.array_equal(dk, want_k):
        problems.append(f"Δkernel_run {dk.tolist()}")
    if np.count_nonzero(np.delete(ds, tag)):
        problems.append(f"slot_run of another tag moved: {ds.tolist()}")
    base, new = int(np.asarray(log0.write_index)[0]), int(np.asarray(log1.write_index)[0])
    cap = log0.ring.shape[0]
    if op == "verify":
        vp = args[2]
        enabled = ints(vp.enable)[0] != 0
        active = min(max(ints(vp.num_valid)[0], 0), len(ints(vp.slot_indices))) if enabled else 0
        if ds[tag] != active:
            problems.append(f"Δslot_run {ds[tag]} != active {active}")
        if not 0 <= new - base <= 3 * active and new != kvc.consts.WRITE_INDEX_MAX:
            problems.append(f"Δwrite_index {new - base} outside [0, 3 x {active}]")
    n = new - base
    if new < base or (new == kvc.consts.WRITE_INDEX_MAX and base + n != new):
        problems.append(f"write_index went from {base} to {new}")
    # fill-once: only rows [base, base + n) inside the ring may change
    r0, r1 = np.asarray(log0.ring), np.asarray(log1.ring)
    for k in range(cap):
        if not (base <= k < base + max(n, 0)) and not np.array_equal(r0[k], r1[k]):
            problems.append(f"ring row {k} changed outside [{base}, {base + n})")
            break
    rows = r1.view("<i8")
    new_rows = [rows[k] for k in range(max(base, 0), min(base + n, cap))]
    for row in new_rows:
        if row[7] & OOB and row[7] != OOB:
            problems.append(f"OOB bit OR-ed into a check row: {row.tolist()}")
    # the OOB rows themselves, when every row of the launch was kept
    if base == 0 and n <= cap:  # n is exact here (no saturation) and nothing was dropped
        got = [(int(r[5]), int(r[4]), int(r[6])) for r in new_rows if r[7] == OOB]
        want = [(int(k), v, b) for k, v, b in expected_oob_rows(op, args, kwargs)]
        if got != want:
            problems.append(f"OOB rows {got} != expected {want}")
    return problems


def _run_op(name):
    classes, maker = MAKERS[name]
    op = OP_OF.get(name, name)
    names = sorted(classes)
    per_class = -(-CASES // len(names))
    failures, checked_oob = [], 0
    for cls in names:
        for seed in range(per_class):
            args, kwargs = maker(cls, seed)
            ref = getattr(reference, op)(*args, **kwargs)
            if op in ("verify", "write"):
                for p in check_invariants(op, args, kwargs, ref):
                    failures.append(f"{op}/{cls}/seed={seed} reference: {p}")
                checked_oob += bool(expected_oob_rows(op, args, kwargs))
            for impl in COMPARED_IMPLS:
                for d in diffs(op, ref, run_backend(op, cls, impl, args, kwargs)):
                    failures.append(f"{op}/{cls}/seed={seed} impl={impl}: {d}")
            if len(failures) >= 8:
                break
        if len(failures) >= 8:
            break
    assert not failures, f"{len(failures)} failure(s) (x64={X64}):\n" + "\n".join(failures[:8])
    if op in ("verify", "write"):
        assert checked_oob > per_class // 2, "the generator stopped producing out-of-range values"


@pytest.mark.slow
@pytest.mark.parametrize("op", ["verify", "write", "plan", "plan_row_starts", "scatter_req_token_ids"])
def test_fuzz_op_against_reference(op):
    _run_op(op)


# ---- regression tests for bugs the fuzzers found ----------------------------------------------------

@pytest.mark.parametrize("impl", ["ffi", XLA])
def test_plan_wrapped_total_fills_only_entries_below_total(impl):
    """The int64 (wrap-around) sum of the verify lengths can be negative: then enable = 1 and
    entries [0, total) are none, so every entry stays 0 (format.md §9.3). The CPU handler used to fill all
    verify_capacity entries (found by tests/native/fuzz_driver.cc, plan case 414). int64 prefix
    lengths need x64: with it off (the default) the case runs inside ``jax.enable_x64(True)``."""
    with jax.enable_x64(True):
        _check_plan_wrapped_total(impl)


def _check_plan_wrapped_total(impl):
    rpi = np.array([1, 0, 1, 1, 1, 0], np.int64)
    P = np.array([1, 5, 2**63 - 2, 3, 3, 0], np.int64)
    E = np.array([3, 1, 4, 5, 0, -1], np.int64)
    table = np.arange(6, dtype=np.int64).reshape(2, 3) + 10
    kw = dict(verify_capacity=7, write_req_capacity=9)
    ref = reference.plan(rpi, P, E, table, **kw)
    assert int(ref[0].enable[0]) == 1 and not ref[0].slot_indices.any()
    got = jax.tree_util.tree_map(np.asarray, kvc.plan(*map(jnp.asarray, (rpi, P, E, table)), impl=impl, **kw))
    assert diffs("plan", ref, got) == []
