"""Random-case generators for the four ops, and helpers to run a case on any implementation.

Used by ``tests/test_property.py``; importable by other tests and fuzzers::

    from tests.support.cases import CONFIGS, make_case, run_reference, run_impl, compare

A **case** is a plain dict::

    {"op": "write" | "verify" | "plan" | "scatter_req_token_ids",
     "config": str, "seed": int,
     "args": tuple,          # positional arguments, numpy leaves (ViolationLog / plans with numpy leaves)
     "kwargs": dict,         # keyword arguments (static options, optional arrays, RealKvSource tuple)
     "x64": bool}            # True if some index array is int64 (run under jax.enable_x64)

Shapes and static options are fixed per *config* (so jit compiles are reused across seeds); the data
varies with the seed. ``make_case(op, config, seed)`` is deterministic.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jax_kvcanary as kvc
from jax_kvcanary import hashing, reference
from jax_kvcanary.consts import RealKvHashMode

OPS = ("plan", "write", "verify", "scatter_req_token_ids")

I32_MIN, I32_MAX = -2**31, 2**31 - 1
NONE, PARTIAL, ALL = int(RealKvHashMode.NONE), int(RealKvHashMode.PARTIAL), int(RealKvHashMode.ALL)
DTYPES = {"u8": np.uint8, "bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32,
          "i32": np.int32}

# Source spec: (dtype, page_size, num_bytes_per_token, read_bytes, rows: "full"|"few"|"zero"|int,
#               hole chunks of 16 B per row, ndim[, offset_bytes])
_SRC = {
    "u8p1": ("u8", 1, 32, 32, "full", 0, 2),
    "u8p1few": ("u8", 1, 32, 32, "few", 0, 2),
    "u8p1n16": ("u8", 1, 16, 16, "full", 0, 2),
    "bf16p4hole": ("bf16", 4, 16, 16, "full", 2, 2),
    "f32p16few": ("f32", 16, 32, 16, "few", 0, 3),
    "i32p1": ("i32", 1, 16, 16, "full", 0, 2),
    "i32p1r12": ("i32", 1, 16, 16, 12, 0, 2),      # slots 12.. unaddressable (as 3rd source)
    "i32p4r5": ("i32", 4, 48, 32, 5, 1, 2),        # slots 20.. unaddressable (as 4th source)
    "f16p4few": ("f16", 4, 32, 32, "few", 1, 3),
    "bf16p16": ("bf16", 16, 16, 16, "full", 0, 2),
    "i32p4hole": ("i32", 4, 48, 32, "full", 1, 2),
    "f16p4": ("f16", 4, 16, 16, "full", 0, 2),
    "u8p16zero": ("u8", 16, 16, 16, "zero", 0, 2),
    "u8p16few": ("u8", 16, 16, 16, "few", 1, 2),
    "f32p4x3": ("f32", 4, 64, 64, "full", 0, 3),
    # strips inside the slot (offset_bytes), up to the largest offset allowed (nbpt - read_bytes)
    "u8p1o32": ("u8", 1, 64, 32, "full", 0, 2, 32),
    "bf16p4o16hole": ("bf16", 4, 48, 32, "full", 1, 2, 16),
    "i32p2o48few": ("i32", 2, 64, 16, "few", 0, 2, 48),
    "f16p4o16r5": ("f16", 4, 32, 16, 5, 0, 3, 16),       # slots 20.. unaddressable
    "u8p1o16": ("u8", 1, 48, 16, "full", 0, 2, 16),
}

# ---- configs ------------------------------------------------------------------------------------
# dt: "i32" (x64 off), "i64" (x64 on), "mixed" (each index array int32 or int64 at random; x64 on)

WRITE_CONFIGS = {
    "w1_i32_none": dict(dt="i32", S=24, stride=32, N=16, C=4, cap=8, tag=0, assert_on=False,
                        mode=NONE, srcs=()),
    "w2_i64_none_srcs": dict(dt="i64", S=24, stride=40, N=16, C=4, cap=8, tag=5, assert_on=True,
                             mode=NONE, srcs=("u8p1",)),
    "w3_i32_partial": dict(dt="i32", S=24, stride=64, N=16, C=4, cap=6, tag=2, assert_on=True,
                           mode=PARTIAL, srcs=("u8p1few",)),
    "w4_i32_all3": dict(dt="i32", S=32, stride=32, N=20, C=5, cap=8, tag=3, assert_on=False,
                        mode=ALL, srcs=("bf16p4hole", "f32p16few", "i32p1r12")),
    "w5_mixed_all4": dict(dt="mixed", S=32, stride=40, N=20, C=3, cap=16, tag=11, assert_on=True,
                          mode=ALL, srcs=("u8p1n16", "f16p4few", "bf16p16", "i32p4r5")),
    "w6_i64_none_nosrc": dict(dt="i64", S=16, stride=32, N=12, C=6, cap=4, tag=7,
                              assert_on=True, mode=NONE, srcs=()),
    "w7_i32_n0": dict(dt="i32", S=8, stride=32, N=0, C=2, cap=4, tag=1, assert_on=True, mode=ALL,
                      srcs=("u8p1n16",)),
    "w8_i32_c1": dict(dt="i32", S=16, stride=32, N=24, C=1, cap=8, tag=9, assert_on=False,
                      mode=PARTIAL, srcs=("f32p4x3",)),
    "w9_i32_offsets_all4": dict(dt="i32", S=32, stride=32, N=20, C=4, cap=16, tag=6, assert_on=False,
                                mode=ALL, srcs=("u8p1o32", "bf16p4o16hole", "i32p2o48few", "f16p4o16r5")),
    "w10_mixed_offsets_partial": dict(dt="mixed", S=24, stride=40, N=16, C=4, cap=8, tag=3,
                                      assert_on=True, mode=PARTIAL,
                                      srcs=("i32p2o48few", "u8p1o32", "u8p1n16")),
}

VERIFY_CONFIGS = {
    "v1_i32_none": dict(dt="i32", S=24, stride=32, V=16, cap=8, tag=0, check=False, mode=NONE,
                        srcs=()),
    "v2_i64_none_srcs": dict(dt="i64", S=24, stride=40, V=16, cap=8, tag=4, check=True, mode=NONE,
                             srcs=("u8p1",)),
    "v3_i32_partial": dict(dt="i32", S=32, stride=64, V=20, cap=6, tag=2, check=True,
                           mode=PARTIAL, srcs=("u8p1few",)),
    "v4_mixed_all3": dict(dt="mixed", S=32, stride=32, V=20, cap=16, tag=8, check=False, mode=ALL,
                          srcs=("bf16p4hole", "f32p16few", "i32p1r12")),
    "v5_i32_all4": dict(dt="i32", S=32, stride=40, V=12, cap=4, tag=10, check=True, mode=ALL,
                        srcs=("u8p1n16", "f16p4few", "bf16p16", "i32p4r5")),
    "v6_i64_none_nosrc": dict(dt="i64", S=16, stride=32, V=8, cap=8, tag=6, check=True,
                              mode=NONE, srcs=()),
    "v7_i32_v1": dict(dt="i32", S=8, stride=32, V=1, cap=2, tag=11, check=True, mode=ALL,
                      srcs=("f16p4",)),
    "v8_i32_rows": dict(dt="i32", S=40, stride=32, V=24, cap=32, tag=3, check=False, mode=PARTIAL,
                        srcs=("u8p16few", "u8p16zero")),
    "v9_i32_offsets_all4": dict(dt="i32", S=32, stride=32, V=20, cap=16, tag=9, check=True, mode=ALL,
                                srcs=("f16p4o16r5", "u8p1o16", "bf16p4o16hole", "i32p2o48few")),
    "v10_i64_offsets_partial": dict(dt="i64", S=32, stride=32, V=16, cap=8, tag=1, check=False,
                                    mode=PARTIAL, srcs=("u8p1o32", "i32p2o48few")),
}

PLAN_CONFIGS = {
    "p1_i32_full": dict(dt="i32", bs=4, R=6, L=16, Vc=40, Wc=4, W=0, lut=None, pool=None, koff=0),
    "p2_i64_pool": dict(dt="i64", bs=3, R=5, L=12, Vc=24, Wc=5, W=0, lut=None, pool=(5, 12),
                        koff=0),
    "p3_i32_lut_nowin": dict(dt="i32", bs=4, R=6, L=16, Vc=48, Wc=6, W=0, lut=48, pool=(6, 10),
                             koff=1),
    "p4_i32_swa": dict(dt="i32", bs=5, R=6, L=20, Vc=24, Wc=5, W=4, lut=40, pool=(4, 24), koff=1),
    "p5_mixed_swa": dict(dt="mixed", bs=4, R=4, L=24, Vc=16, Wc=4, W=8, lut=64, pool=None, koff=0),
    "p6_i32_empty": dict(dt="i32", bs=0, R=2, L=4, Vc=4, Wc=2, W=0, lut=None, pool=(2, 4), koff=0),
    "p7_i64_swa_negoff": dict(dt="i64", bs=2, R=3, L=8, Vc=8, Wc=3, W=3, lut=30, pool=(3, 8),
                              koff=-1),
    "p8_i32_pool_narrow": dict(dt="i32", bs=6, R=8, L=8, Vc=64, Wc=8, W=0, lut=None, pool=(8, 6),
                               koff=0),
    # row_starts: req_to_token is a flat page table of N slots (R only bounds req_pool_indices and
    # the pool rows, L the prefix lengths)
    "p9a_i32_rows": dict(dt="i32", bs=5, R=6, L=12, Vc=48, Wc=6, W=0, lut=None, pool=None, koff=0,
                         flat=40),
    "p9b_i64_rows_pool_lut": dict(dt="i64", bs=4, R=5, L=10, Vc=40, Wc=5, W=0, lut=40, pool=(5, 12),
                                  koff=1, flat=30),
    "p9c_mixed_rows_swa": dict(dt="mixed", bs=4, R=4, L=16, Vc=24, Wc=4, W=5, lut=64, pool=(4, 16),
                               koff=0, flat=50),
    "p9d_i32_rows_swa_pool": dict(dt="i32", bs=6, R=4, L=9, Vc=30, Wc=7, W=3, lut=30, pool=(4, 8),
                                  koff=-1, flat=36),
    "p9e_i32_rows_empty": dict(dt="i32", bs=0, R=2, L=4, Vc=4, Wc=2, W=0, lut=None, pool=(2, 4), koff=0,
                               flat=6),
    "p9f_i32_rows_no_table": dict(dt="i32", bs=3, R=3, L=6, Vc=12, Wc=3, W=0, lut=None, pool=None,
                                  koff=0, flat=0),
}

SCATTER_CONFIGS = {
    "s1_i32": dict(dt="i32", pool_dt=np.int32, Rp=4, Cp=8, bs=3, total=20),
    "s2_i64": dict(dt="i64", pool_dt=np.int64, Rp=5, Cp=6, bs=4, total=16),
    "s3_mixed_narrow": dict(dt="mixed", pool_dt=np.int32, Rp=3, Cp=4, bs=5, total=12),
    "s4_i32_into_i64": dict(dt="i32", pool_dt=np.int64, Rp=2, Cp=16, bs=2, total=40),
    "s5_i32_bs0": dict(dt="i32", pool_dt=np.int32, Rp=6, Cp=5, bs=0, total=3),
    "s6_i32_noids": dict(dt="i32", pool_dt=np.int32, Rp=1, Cp=1, bs=3, total=0),
    "s7_mixed_i64pool": dict(dt="mixed", pool_dt=np.int64, Rp=8, Cp=12, bs=8, total=64),
    "s8_i64_into_i32": dict(dt="i64", pool_dt=np.int32, Rp=4, Cp=8, bs=6, total=10),
}

CONFIGS = {"write": WRITE_CONFIGS, "verify": VERIFY_CONFIGS, "plan": PLAN_CONFIGS,
           "scatter_req_token_ids": SCATTER_CONFIGS}

_OP_INDEX = {op: i for i, op in enumerate(OPS)}


# ---- small generators ---------------------------------------------------------------------------

class _Gen:
    """A seeded numpy Generator plus the index-dtype policy of a config."""

    def __init__(self, op, config, seed, dt):
        cidx = sorted(CONFIGS[op]).index(config)
        self.rng = np.random.default_rng([_OP_INDEX[op], cidx, seed])
        # "mixed" dtypes are drawn per config, not per seed (same draw order in every case), so
        # all seeds of a config share one jit signature
        self._dt_rng = np.random.default_rng([_OP_INDEX[op], cidx, 10**6])
        self.dt = dt

    def p(self, prob):
        return bool(self.rng.random() < prob)

    def int(self, lo, hi):
        """Uniform int in [lo, hi] inclusive."""
        return int(self.rng.integers(lo, hi, endpoint=True))

    def u64(self):
        """Uniform in [0, 2**64)."""
        return int(self.rng.integers(0, 2**64, dtype=np.uint64, endpoint=False))

    def choice(self, seq):
        return seq[int(self.rng.integers(0, len(seq)))]

    def idx_dtype(self):
        if self.dt == "i32":
            return np.int32
        if self.dt == "i64":
            return np.int64
        return np.int32 if self._dt_rng.random() < 0.5 else np.int64

    def idx(self, values, dtype=None):
        """Python ints -> an index array of the config's dtype (values must fit the dtype)."""
        dtype = dtype or self.idx_dtype()
        a = np.array([int(v) for v in values], dtype=np.int64)
        if dtype == np.int32:
            assert a.size == 0 or (a.min() >= I32_MIN and a.max() <= I32_MAX), a
        return a.astype(dtype)

    def wide(self):
        """True when values beyond int32 may be generated (every array is int64 then)."""
        return self.dt == "i64"

    def token(self):
        if self.p(0.05):
            return -1
        if self.wide() and self.p(0.1):
            return self.int(-2**62, 2**62)
        return self.int(0, 50000)

    def garbage(self):
        if self.wide() and self.p(0.2):
            return self.int(-2**63, 2**63 - 1)
        return self.int(I32_MIN, I32_MAX) if self.p(0.3) else self.int(-50, 100)


def _rand_log(g: _Gen, cap: int, tag: int) -> kvc.ViolationLog:
    rng = g.rng
    ring = rng.integers(0, 256, (cap, 64), dtype=np.uint8)
    wi = g.choice([0, 0, 0, 0, 1, cap // 2, cap - 1, cap - 2, cap, cap + 3, 2**31 - 1, 2**31 - 2,
                   2**31 - 5, -1, g.int(0, 3 * cap)])
    kc = rng.integers(0, 256, (kvc.NUM_LAUNCH_TAGS, 8), dtype=np.uint8)
    sc = rng.integers(0, 256, (kvc.NUM_LAUNCH_TAGS, 8), dtype=np.uint8)
    if g.p(0.15):
        kc[tag] = 0xFF  # kernel counter wraps to 0
    if g.p(0.15):
        sc[tag] = 0xFF  # slot counter wraps
    if g.p(0.3):
        kc[tag] = 0
        sc[tag] = 0
    flag = g.choice([1, 1, 1, 0, 2])
    return kvc.ViolationLog(ring=ring, write_index=np.array([wi], np.int32),
                            kernel_run_counters=kc, slot_run_counters=sc,
                            enable_chain_position_assert=np.array([flag], np.int32))


def _rows_for(kind, S: int, page: int) -> int:
    if isinstance(kind, int):
        return kind
    need = -(-S // page)
    if kind == "full":
        return need
    if kind == "zero":
        return 0
    return max(1, need - max(1, need // 3))


def _make_sources(g: _Gen, names, S: int):
    out = []
    for name in names:
        dt, page, nbpt, rb, rows_kind, hole, ndim, *offset = _SRC[name]
        rows = _rows_for(rows_kind, S, page)
        row_bytes = page * nbpt + 16 * hole
        raw = g.rng.integers(0, 256, (rows, row_bytes), dtype=np.uint8)
        if g.p(0.1):
            raw[:] = 0  # all-zero bytes fold to 0 (the NONE blind spot)
        arr = raw.view(DTYPES[dt])
        if ndim == 3:
            arr = arr.reshape(rows, 2, -1)
        out.append(kvc.RealKvSource(arr, page, nbpt, rb, *offset))
    return tuple(out)


def _record(tok, pos, prev, rkv):
    return np.array([hashing.to_i64(v) for v in (tok, pos, prev, rkv)], "<i8").view(np.uint8)


# ---- WRITE --------------------------------------------------------------------------------------

def _write_case(config: str, seed: int) -> dict:
    c = WRITE_CONFIGS[config]
    g = _Gen("write", config, seed, c["dt"])
    S, stride, N, C, cap, tag = c["S"], c["stride"], c["N"], c["C"], c["cap"], c["tag"]

    canary = g.rng.integers(0, 256, (S, stride), dtype=np.uint8)
    stored_pos = {}
    for s in range(S):
        u = g.rng.random()
        if u < 0.15:
            canary[s, :32] = 0  # never written
            stored_pos[s] = 0
        elif u < 0.8:  # realistic record
            pos = g.int(0, 30)
            canary[s, :32] = _record(g.int(0, 999), pos, g.u64(), g.u64())
            stored_pos[s] = pos
        else:
            stored_pos[s] = int(canary[s, 8:16].copy().view("<i8")[0])
    log = _rand_log(g, cap, tag)

    # requests
    n_req = g.int(0, C)
    lens = [g.int(0, 5) for _ in range(n_req)]
    off0 = 0 if g.p(0.8) else g.int(1, 2)
    offsets = [off0]
    for ln in lens:
        offsets.append(min(offsets[-1] + ln, N))
    offsets += [g.garbage() if g.p(0.5) else g.int(-3, N + 3) for _ in range(C + 1 - len(offsets))]
    malformed = g.p(0.15)
    if malformed:
        offsets = [g.int(-3, N + 3) for _ in range(C + 1)]
    nvr = n_req if g.p(0.75) else g.choice([-2, 0, C, C + 3, g.int(0, C), I32_MAX, I32_MIN])

    ids = [g.token() for _ in range(N)]
    pos = [g.int(0, 40) for _ in range(N)]
    loc = [g.int(-5, S + 5) for _ in range(N)]  # tail garbage, overwritten for real ranges
    seeds = [g.choice([-1, 0, g.int(0, S - 1), S, S + 7, -9]) for _ in range(C)]
    written = []  # in-range slots written so far in this launch (flat order)
    cur = dict(stored_pos)
    for r in range(C):
        lo, hi = offsets[r], offsets[r + 1]
        if malformed or r >= n_req:
            lo, hi = max(0, min(lo, N)), max(0, min(hi, N))
        u = g.rng.random()
        if u < 0.3:
            seed = -1
        elif u < 0.35:
            seed = -7
        elif u < 0.65:
            seed = g.int(0, S - 1)
        elif u < 0.75:
            seed = g.choice([S, S + 5, 2**31 - 1])
        elif written:
            seed = g.choice(written)
        else:
            seed = g.int(1, S - 1)
        seeds[r] = seed
        p = cur.get(seed, -1) + 1 if 0 <= seed < S else g.int(0, 20)
        if g.wide() and g.p(0.05):
            p = 2**63 - 3  # position wrap in the chain-position assert
        for i in range(lo, hi):
            v = g.rng.random()
            if v < 0.66:
                slot = g.int(1, S - 1)
            elif v < 0.71:
                slot = 0
            elif v < 0.8:
                slot = g.choice([-1, -1, -5])
            elif v < 0.88:
                slot = g.choice([S, S + 1, S + 10, 2**31 - 1])
            elif written:
                slot = g.choice(written)  # duplicate across / within requests
            else:
                slot = g.int(0, S - 1)
            loc[i] = slot
            if g.p(0.08):
                p = g.choice([p - 1, p + 2, 0])
            pos[i] = hashing.to_i64(p)
            if 0 <= slot < S:
                written.append(slot)
                cur[slot] = pos[i]
            if slot >= 0:
                p = pos[i] + 1
    if not g.wide():
        pos = [min(max(v, I32_MIN), I32_MAX) for v in pos]

    kwargs = dict(tag=tag, real_kv_sources=_make_sources(g, c["srcs"], S),
                  real_kv_hash_mode=c["mode"])
    if c["assert_on"]:
        et = [t if g.p(0.85) else g.token() for t in ids]
        ep = [q if g.p(0.85) else g.int(0, 40) for q in pos]
        kwargs.update(enable_write_input_assert=True, expected_input_tokens=g.idx(et),
                      expected_input_positions=g.idx(ep))
    elif g.p(0.3):
        kwargs.update(enable_write_input_assert=False)
    if not g.wide():
        seeds = [min(max(v, I32_MIN), I32_MAX) for v in seeds]
        offsets = [min(max(v, I32_MIN), I32_MAX) for v in offsets]
    plan = kvc.WritePlan(offsets=g.idx(offsets), seed_slot_indices=g.idx(seeds),
                         num_valid_reqs=np.array([nvr], np.int32))
    args = (canary, log, plan, g.idx(ids), g.idx(pos), g.idx(loc))
    return dict(args=args, kwargs=kwargs)


# ---- VERIFY -------------------------------------------------------------------------------------

def _verify_case(config: str, seed: int) -> dict:
    c = VERIFY_CONFIGS[config]
    g = _Gen("verify", config, seed, c["dt"])
    S, stride, V, cap, tag, mode = c["S"], c["stride"], c["V"], c["cap"], c["tag"], c["mode"]
    sources = _make_sources(g, c["srcs"], S)

    canary = g.rng.integers(0, 256, (S, stride), dtype=np.uint8)
    # clean chains over a permutation of slots 1..S-1
    perm = [int(x) for x in g.rng.permutation(np.arange(1, S))]
    chains, i = [], 0
    while i < len(perm):
        n = g.int(1, 6)
        chains.append(perm[i:i + n])
        i += n
    entries = []  # (slot, token, position, prev_slot)
    for ch in chains:
        h = hashing.ANCHOR_HASH
        prev = -1
        for p, s in enumerate(ch):
            tok = g.token()
            if mode != NONE and sources and hashing.first_unaddressable_source(sources, s) is None \
                    and g.p(0.9):
                rkv = hashing.slot_real_kv_hash(sources, s, mode)
            else:
                rkv = 0 if g.p(0.8) else g.u64()
            canary[s, :32] = _record(tok, p, h, rkv)
            entries.append((s, tok, p, prev))
            h = hashing.mix3(h, tok, p)
            prev = s
    # corruptions
    for s in range(1, S):
        u = g.rng.random()
        if u < 0.05:
            canary[s, g.int(0, 7)] ^= 0xFF  # token
        elif u < 0.1:
            canary[s, 8 + g.int(0, 7)] ^= 0x10  # position
        elif u < 0.15:
            canary[s, 16 + g.int(0, 7)] ^= 0x01  # prev_hash
        elif u < 0.2:
            canary[s, 24 + g.int(0, 7)] ^= 0x80  # real_kv_hash
        elif u < 0.25:
            canary[s, :32] = g.rng.integers(0, 256, 32, dtype=np.uint8)
    for src in sources:  # real-KV byte flips (inside a strip, or anywhere incl. holes)
        a = np.asarray(src.array)
        if a.size == 0:
            continue
        b = a.view(np.uint8).reshape(a.shape[0], -1)
        for _ in range(g.int(0, 2)):
            b[g.int(0, b.shape[0] - 1), g.int(0, b.shape[1] - 1)] ^= 1 << g.int(0, 7)

    order = list(range(len(entries)))
    g.rng.shuffle(order)
    slots, toks, poss, prevs = [], [], [], []
    for k in range(V):
        s, tok, p, prev = entries[order[k % len(order)]] if g.p(0.85) else (
            g.int(1, S - 1), g.token(), g.int(0, 8), g.int(-1, S - 1))
        u = g.rng.random()
        if u < 0.05:
            prev = 0
        elif u < 0.08:
            prev = g.choice([-3, -2**31])
        elif u < 0.12:
            prev = g.choice([S, S + 3, 2**31 - 1])
        u = g.rng.random()
        if u < 0.05:
            s = 0
        elif u < 0.08:
            s = g.choice([-2, -1, I32_MIN])
        elif u < 0.12:
            s = g.choice([S, S + 9])
        u = g.rng.random()
        if u < 0.1:
            tok = -1
        elif u < 0.18:
            tok = g.token()
        if g.p(0.05):
            p = g.int(0, 40)
        slots.append(s)
        toks.append(tok if g.wide() or I32_MIN <= tok <= I32_MAX else -1)
        poss.append(p)
        prevs.append(prev)
    nv = V if g.p(0.6) else g.choice([g.int(0, V), 0, -3, V + 5, I32_MIN, I32_MAX])
    # garbage past num_valid
    for k in range(max(0, min(nv, V)), V):
        if g.p(0.5):
            slots[k], toks[k], poss[k], prevs[k] = (g.int(-3, S + 3), g.token(), g.int(-9, 99),
                                                    g.int(-3, S + 3))
    enable = g.choice([1] * 16 + [0, 0, 7])
    plan = kvc.VerifyPlan(slot_indices=g.idx(slots), expected_tokens=g.idx(toks),
                          expected_positions=g.idx(poss), prev_slot_indices=g.idx(prevs),
                          num_valid=np.array([nv], np.int32), enable=np.array([enable], np.int32))
    kwargs = dict(tag=tag, real_kv_sources=sources, real_kv_hash_mode=mode)
    if c["check"]:
        kwargs["check_verify_expected_token"] = True
    elif g.p(0.3):
        kwargs["check_verify_expected_token"] = False
    return dict(args=(canary, _rand_log(g, cap, tag), plan), kwargs=kwargs)


# ---- PLAN ---------------------------------------------------------------------------------------

def _plan_case(config: str, seed: int) -> dict:
    c = PLAN_CONFIGS[config]
    g = _Gen("plan", config, seed, c["dt"])
    bs, R, L, W = c["bs"], c["R"], c["L"], c["W"]
    big = 2**31 + 5
    lut_len = c["lut"]
    slot_hi = lut_len + 8 if lut_len else 64  # some table values past a short LUT
    table = g.rng.integers(1, slot_hi, (R, L)).astype(np.int64)
    mask = g.rng.random((R, L))
    table[mask < 0.05] = 0
    table[(mask >= 0.05) & (mask < 0.08)] = -1
    if g.wide():
        table[(mask >= 0.08) & (mask < 0.1)] = big  # narrowed to int32 in the plan
    rps, P, E = [], [], []
    for r in range(bs):
        u = g.rng.random()
        rp = 0 if u < 0.25 else (g.int(1, R - 1) if u < 0.85 else g.choice([R, R + 2, -1]))
        rps.append(rp)
        if rp == 0:
            P.append(g.choice([99999, -3, 0, g.int(0, L)]))
            E.append(g.choice([99999, -3, 0, 1]))
        else:
            P.append(g.int(0, L) if g.p(0.8) else g.choice([L + 2, -1, 0, 3 * L]))
            E.append(g.int(0, 4) if g.p(0.85) else g.choice([-2, 0, 7]))
    kwargs = dict(verify_capacity=c["Vc"], write_req_capacity=c["Wc"])
    if W or g.p(0.3):
        kwargs["swa_window_size"] = W
    if lut_len:
        lut = g.rng.integers(1, 60, lut_len).astype(np.int64)
        lm = g.rng.random(lut_len)
        lut[lm < 0.15] = 0
        lut[(lm >= 0.15) & (lm < 0.2)] = -1
        if g.wide():
            lut[(lm >= 0.2) & (lm < 0.23)] = -big
        kwargs["full_to_swa_index_mapping"] = g.idx(lut)
    if c["pool"]:
        Rp, Cp = c["pool"]
        pool = g.rng.integers(I32_MIN, I32_MAX, (Rp, Cp), endpoint=True).astype(np.int64)
        if g.wide():
            pool[g.rng.random((Rp, Cp)) < 0.1] = -big
        valid = [g.choice([Cp, Cp + 4, g.int(0, Cp), -2, 0, 1]) for _ in range(bs)]
        kwargs["req_to_verify_expected_tokens"] = g.idx(pool.ravel()).reshape(Rp, Cp)
        kwargs["req_to_verify_expected_tokens_valid_lens"] = g.idx(valid)
    if c["koff"] or g.p(0.3):
        kwargs["kv_token_id_vs_position_offset"] = c["koff"]
    args = (g.idx(rps), g.idx(P), g.idx(E), g.idx(table.ravel()).reshape(R, L))
    if c.get("flat") is not None:
        table, kwargs["row_starts"] = _flat_table(g, c["flat"], slot_hi, P)
        args = args[:3] + (table,)
    return dict(args=args, kwargs=kwargs)


def _flat_table(g: _Gen, N: int, slot_hi: int, P):
    """A flat page table of N slots and each batch row's start in it: mostly segments laid out one
    after the other (with page-aligned gaps), and starts before the table, running off its end, past
    it, near the int32 limits (their sums wrap in int32) and, with int64 arrays, near the int64
    limits and past 2**32 (wrong if narrowed)."""
    big = 2**31 + 5
    table = g.rng.integers(1, slot_hi, N).astype(np.int64)
    mask = g.rng.random(N)
    table[mask < 0.05] = 0
    table[(mask >= 0.05) & (mask < 0.08)] = -1
    if g.wide():
        table[(mask >= 0.08) & (mask < 0.1)] = big
    starts, cursor = [], 0
    for p in P:
        if g.p(0.65):
            starts.append(cursor)
            cursor += min(max(p, 0), 16) + g.choice([0, 0, 1, 3])
            cursor += g.choice([0, -cursor % 4])  # sometimes the next segment starts on a page of 4
        else:
            odd = [-g.int(1, 6), N - g.int(0, 4), N + g.int(0, 5), I32_MAX - g.int(0, 3), I32_MIN + g.int(0, 3)]
            if g.wide():
                odd += [2**63 - 1 - g.int(0, 3), -2**63 + g.int(0, 3), 2**32 + g.int(0, 4),
                        g.int(-2**63, 2**63 - 1)]
            starts.append(g.choice(odd))
    return g.idx(table), g.idx(starts)


# ---- SCATTER ------------------------------------------------------------------------------------

def _scatter_case(config: str, seed: int) -> dict:
    c = SCATTER_CONFIGS[config]
    g = _Gen("scatter_req_token_ids", config, seed, c["dt"])
    Rp, Cp, bs, total = c["Rp"], c["Cp"], c["bs"], c["total"]
    pool_dt = c["pool_dt"]
    lim = 2**62 if pool_dt == np.int64 else 2**31 - 1
    pool = g.rng.integers(-lim, lim, (Rp, Cp), endpoint=True).astype(pool_dt)
    ids_dt = g.idx_dtype()
    if ids_dt == np.int64:
        ids = g.rng.integers(-2**62, 2**62, total, endpoint=True)
        m = g.rng.random(total) < 0.5
        ids[m] = g.rng.integers(-100, 100000, int(m.sum()))  # narrow-safe values too
    else:
        ids = g.rng.integers(I32_MIN, I32_MAX, total, endpoint=True)
    if g.p(0.7):  # well-formed segments (with truncation past Cp)
        offs = [0 if g.p(0.8) else g.int(0, 2)]
        for _ in range(bs):
            offs.append(offs[-1] + g.int(0, Cp + 3))
        offs = [min(o, total + g.int(0, 2)) for o in offs]
    else:  # malformed: negative, decreasing, beyond total
        offs = [g.int(-4, total + 4) for _ in range(bs + 1)]
        if g.wide() and g.p(0.2):
            offs[g.int(0, bs)] = g.choice([-2**62, 2**62])
    rps = [g.choice([g.int(0, Rp - 1), g.int(0, Rp - 1), g.int(0, Rp - 1), -1, Rp, 0])
           for _ in range(bs)]
    if bs >= 2 and g.p(0.5):
        rps[g.int(1, bs - 1)] = rps[0]  # duplicate pool row: the later r wins
    return dict(args=(pool, g.idx(ids, ids_dt), g.idx(offs), g.idx(rps)), kwargs={})


_MAKERS = {"write": _write_case, "verify": _verify_case, "plan": _plan_case,
           "scatter_req_token_ids": _scatter_case}


def make_case(op: str, config: str, seed: int) -> dict:
    """The deterministic random case ``seed`` of ``config`` for ``op`` (a plain dict, see module doc)."""
    case = _MAKERS[op](config, seed)
    leaves = jax.tree_util.tree_leaves((case["args"], case["kwargs"]))
    wide = any(isinstance(x, np.ndarray) and x.dtype in (np.int64, np.uint64) for x in leaves)
    case.update(op=op, config=config, seed=seed, x64=wide or CONFIGS[op][config]["dt"] != "i32")
    return case


def iter_cases(op: str, seeds_per_config: int):
    for config in CONFIGS[op]:
        for seed in range(seeds_per_config):
            yield make_case(op, config, seed)


def case_id(case) -> str:
    return f"{case['op']}/{case['config']}/seed={case['seed']}"


# ---- running ------------------------------------------------------------------------------------

STATIC_KWARGS = {"tag", "enable_write_input_assert", "check_verify_expected_token",
                 "real_kv_hash_mode", "verify_capacity", "write_req_capacity", "swa_window_size",
                 "kv_token_id_vs_position_offset"}


_STATIC_DEFAULTS = {
    "write": {"enable_write_input_assert": False, "real_kv_hash_mode": 0},
    "verify": {"check_verify_expected_token": False, "real_kv_hash_mode": 0},
    "plan": {"swa_window_size": 0, "kv_token_id_vs_position_offset": 0},
    "scatter_req_token_ids": {},
}


def x64_scope(case):
    return jax.enable_x64(True) if case["x64"] else contextlib.nullcontext()


def _is_np(x):
    return isinstance(x, np.ndarray)


def to_jax(tree):
    """Every numpy-array leaf -> a jax array (pytrees of the package are traversed)."""
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x) if _is_np(x) else x, tree,
                                  is_leaf=lambda x: x is None)


def to_numpy(tree):
    return jax.tree_util.tree_map(lambda x: np.asarray(x), tree)


def run_reference(case):
    """Run the numpy reference on the case (numpy inputs). Returns numpy-leaved output."""
    return getattr(reference, case["op"])(*case["args"], **case["kwargs"])


_JIT_CACHE = {}


def _jitted(op, impl, static_items):
    key = (op, impl, static_items)
    if key not in _JIT_CACHE:
        fn = getattr(kvc, op)
        static = dict(static_items)

        def f(args, dyn):
            return fn(*args, impl=impl, **static, **dyn)

        _JIT_CACHE[key] = jax.jit(f)
    return _JIT_CACHE[key]


def run_impl(case, impl, *, jit=True):
    """Run the public op with ``impl`` ('ffi'/'xla') on jax copies of the inputs; numpy output.

    With ``jit=True`` the op runs inside a cached ``jax.jit`` (static options closed over), so
    cases of one config share one compile. Call inside :func:`x64_scope`.
    """
    args = to_jax(case["args"])
    kwargs = to_jax(case["kwargs"])
    if not jit:
        return to_numpy(getattr(kvc, case["op"])(*args, impl=impl, **kwargs))
    # explicit defaults and omitted options are the same compile: key on the filled-in set
    static = dict(_STATIC_DEFAULTS[case["op"]])
    static.update((k, v) for k, v in kwargs.items() if k in STATIC_KWARGS)
    static = tuple(sorted((k, v if isinstance(v, bool) else int(v)) for k, v in static.items()))
    dyn = {k: v for k, v in kwargs.items() if k not in STATIC_KWARGS}
    return to_numpy(_jitted(case["op"], impl, static)(args, dyn))


# ---- comparison ---------------------------------------------------------------------------------

def flatten_output(op, out) -> dict:
    """Output of an op -> {name: np.ndarray} (every byte that the op defines)."""
    if op == "write":
        canary, log = out
        d = {"canary": canary}
    elif op == "verify":
        log, d = out, {}
    elif op == "plan":
        vp, wp = out
        return {"verify." + f: np.asarray(getattr(vp, f)) for f in vp._FIELDS} | \
               {"write." + f: np.asarray(getattr(wp, f)) for f in wp._FIELDS}
    else:
        return {"pool": np.asarray(out)}
    for f in log._FIELDS:
        d["log." + f] = getattr(log, f)
    return {k: np.asarray(v) for k, v in d.items()}


def _describe_diff(name, ref, got) -> str:
    if ref.dtype != got.dtype or ref.shape != got.shape:
        return f"{name}: dtype/shape {got.dtype}{got.shape} != reference {ref.dtype}{ref.shape}"
    if name == "log.ring":
        r, o = ref.view("<i8"), got.view("<i8")
        bad = np.nonzero((r != o).any(axis=1))[0]
        lines = [f"{name}: {len(bad)} rows differ, first rows:"]
        for k in bad[:4]:
            lines.append(f"  row {k}: got {o[k].tolist()} expected {r[k].tolist()}")
        return "\n".join(lines)
    if name == "canary":
        rf = np.ascontiguousarray(ref[:, :32]).view("<i8")
        of = np.ascontiguousarray(got[:, :32]).view("<i8")
        bad = np.nonzero((ref != got).any(axis=1))[0]
        lines = [f"{name}: {len(bad)} slots differ, first slots (fields):"]
        for s in bad[:4]:
            lines.append(f"  slot {s}: got {of[s].tolist()} expected {rf[s].tolist()}"
                         + ("" if (ref[s, 32:] == got[s, 32:]).all() else " (padding bytes differ)"))
        return "\n".join(lines)
    if name.startswith("log.") and name.endswith("counters"):
        return f"{name}: got {got.view('<i8').ravel().tolist()} expected {ref.view('<i8').ravel().tolist()}"
    return f"{name}: got {got.ravel().tolist()[:40]} expected {ref.ravel().tolist()[:40]}"


def compare(op, ref_out, got_out) -> list:
    """Byte-for-byte comparison; returns a list of difference descriptions (empty = identical)."""
    ref, got = flatten_output(op, ref_out), flatten_output(op, got_out)
    diffs = []
    for name in ref:
        r, o = ref[name], got.get(name)
        if o is None:
            diffs.append(f"{name}: missing")
        elif r.dtype != o.dtype or r.shape != o.shape or r.tobytes() != o.tobytes():
            diffs.append(_describe_diff(name, r, o))
    return diffs


def describe_case(case) -> str:
    """Compact printable summary of a case's inputs (for failure messages)."""
    def show(x):
        if isinstance(x, np.ndarray):
            if x.dtype == np.uint8 and x.ndim == 2 and x.shape[1] >= 32:
                return f"uint8{x.shape}"
            return f"{x.dtype}{list(x.shape)}={x.ravel().tolist()[:32]}"
        if isinstance(x, (kvc.ViolationLog, kvc.VerifyPlan, kvc.WritePlan)):
            return type(x).__name__ + "(" + ", ".join(
                f"{f}={show(np.asarray(getattr(x, f)))}" for f in x._FIELDS if f != "ring") + ")"
        if isinstance(x, tuple) and x and isinstance(x[0], kvc.RealKvSource):
            return "(" + ", ".join(repr(s) for s in x) + ")"
        return repr(x)
    parts = [show(a) for a in case["args"]] + [f"{k}={show(v)}" for k, v in case["kwargs"].items()]
    return case_id(case) + ":\n  " + "\n  ".join(parts)
