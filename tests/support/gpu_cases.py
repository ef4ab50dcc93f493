"""Stress cases for the CUDA launchers: the paths that tests/support/cases.py's small configs do not reach.

Same case format as ``tests/support/cases.py`` (``op, config, seed, args, kwargs, x64``), so its
``run_reference`` / ``run_impl`` / ``compare`` apply. Two scales: ``"emu"`` (for the CPU emulation's
small-geometry build, tests/test_cuda_emu.py: tens to a few thousand entries) and ``"gpu"``
(tests/test_gpu.py: multi-block grids with the production geometry, up to ~10^5..10^6 entries).

What they exercise (beyond cases.py):
  write_long        long requests: many tiles per request block; chain-position / input-assert rows
  write_many        many short requests: multi-tile single-block scans, grid-stride request loops
  write_conflict*   duplicate slots (same tile, across tiles, across requests) and seeds written by
                    earlier / later requests of the same launch: the conflict detector + in-order path
  write_overflow    violation-heavy with a ring that overflows (and a base past the capacity)
  verify_heavy      nearly every entry violates (1..3 rows each): the ordered ring across blocks
  verify_clean      valid chains with a few corruptions: sparse rows in far-apart blocks
  verify_overflow   violation-heavy with a small ring
  plan_big          many batch rows (multi-tile row scan), long prefixes, SWA + LUT, pool tokens
  plan_overflow     total > verify_capacity (enable = 0) with a full write plan
  plan_flat         plan_big's batch read from a flat page table through row_starts (segments with
                    page-aligned gaps; a few starts before, across the end of and past the table)
  scatter_big       many rows and columns (grid-stride over column tiles), duplicate pool rows
"""

from __future__ import annotations

import zlib

import numpy as np

import jax_kvcanary as kvc
from jax_kvcanary import hashing
from jax_kvcanary.consts import RealKvHashMode

NONE, PARTIAL, ALL = int(RealKvHashMode.NONE), int(RealKvHashMode.PARTIAL), int(RealKvHashMode.ALL)
I32_MIN, I32_MAX = -2**31, 2**31 - 1

# scale -> sizes
_SIZES = {
    "emu": dict(long_len=(50, 110), long_reqs=4, many_reqs=150, conflict_reqs=10, conflict_len=(1, 80),
                verify_V=2000, verify_chain=40, plan_bs=150, plan_L=48, scatter_bs=90, scatter_Rp=40,
                scatter_Cp=100),
    "gpu": dict(long_len=(300, 900), long_reqs=6, many_reqs=3000, conflict_reqs=48, conflict_len=(1, 400),
                verify_V=300_000, verify_chain=512, plan_bs=3000, plan_L=1024, scatter_bs=1500,
                scatter_Rp=400, scatter_Cp=3000),
}

_NAMES = ("write_long", "write_many", "write_conflict", "write_conflict_seeds", "write_overflow",
          "verify_heavy", "verify_clean", "verify_overflow", "plan_big", "plan_overflow", "plan_flat",
          "scatter_big")


def stress_names():
    return list(_NAMES)


def _rng(name, seed, scale):
    return np.random.default_rng([zlib.crc32(name.encode()), seed, zlib.crc32(scale.encode())])


def _idx(rng, values, dt):
    """int64 values -> int32 or int64 array ('i32', 'i64' or 'mixed' per array)."""
    a = np.asarray(values, dtype=np.int64)
    if dt == "mixed":
        dt = "i64" if rng.random() < 0.5 else "i32"
    if dt == "i32":
        assert a.size == 0 or (a.min() >= I32_MIN and a.max() <= I32_MAX)
        return a.astype(np.int32)
    return a


def _log(rng, cap, tag, base="zero"):
    ring = rng.integers(0, 256, (cap, 64), dtype=np.uint8)
    wi = {"zero": 0, "near": max(cap - 3, 0), "past": cap + 2, "neg": -1,
          "sat": 2**31 - 4}.get(base, 0)
    kc = rng.integers(0, 256, (kvc.NUM_LAUNCH_TAGS, 8), dtype=np.uint8)
    sc = rng.integers(0, 256, (kvc.NUM_LAUNCH_TAGS, 8), dtype=np.uint8)
    flag = 1 if rng.random() < 0.85 else 0
    return kvc.ViolationLog(ring=ring, write_index=np.array([wi], np.int32), kernel_run_counters=kc,
                            slot_run_counters=sc, enable_chain_position_assert=np.array([flag], np.int32))


def _sources(rng, S, kinds):
    """kinds: list of (dtype, page_size, bytes_per_token, read_bytes, coverage in (0, 1][,
    offset_bytes])."""
    out = []
    for dt, page, nbpt, rb, cover, *offset in kinds:
        rows = max(1, int(-(-S // page) * cover))
        raw = rng.integers(0, 256, (rows, page * nbpt), dtype=np.uint8)
        out.append(kvc.RealKvSource(raw.view(dt), page, nbpt, rb, *offset))
    return tuple(out)


def _records(n, rng, max_pos=50):
    rec = np.zeros((n, 4), np.int64)
    rec[:, 0] = rng.integers(0, 50000, n)
    rec[:, 1] = rng.integers(0, max_pos, n)
    rec[:, 2] = rng.integers(-2**63, 2**63 - 1, n, endpoint=True)
    rec[:, 3] = rng.integers(-2**63, 2**63 - 1, n, endpoint=True)
    return rec


def _canary(rec, stride, rng):
    c = rng.integers(0, 256, (rec.shape[0], stride), dtype=np.uint8)
    c[:, :32] = rec.astype("<i8").view(np.uint8).reshape(rec.shape[0], 32)
    return c


def _case(op, name, seed, args, kwargs):
    import jax
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    wide = any(isinstance(x, np.ndarray) and x.dtype == np.int64 for x in leaves)
    return dict(op=op, config=name, seed=seed, args=args, kwargs=kwargs, x64=wide)


# ---- WRITE --------------------------------------------------------------------------------------

def _write(name, seed, scale):
    z, rng = _SIZES[scale], _rng(name, seed, scale)
    dt = ("i32", "i64", "mixed")[seed % 3]
    conflict = name.startswith("write_conflict")
    if name == "write_many":
        lens = list(rng.integers(0, 4, z["many_reqs"]))
    elif conflict:
        lens = list(rng.integers(*z["conflict_len"], z["conflict_reqs"]))
    else:
        lens = list(rng.integers(*z["long_len"], z["long_reqs"]))
    n_req = len(lens)
    C = n_req + int(rng.integers(0, 3))
    N = int(sum(lens)) + int(rng.integers(0, 5))
    S = 2 * N + 64
    stride = (32, 40, 64)[seed % 3]
    rec = _records(S, rng)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    offsets = np.concatenate([offsets, rng.integers(-3, N + 3, C + 1 - len(offsets))])
    nvr = n_req if rng.random() < 0.8 else C
    perm = rng.permutation(np.arange(1, S))  # distinct targets (no conflict unless made)
    locs = np.full(N, -1, np.int64)
    locs[:] = rng.integers(-3, S + 3, N)  # tail garbage
    seeds = np.full(C, -1, np.int64)
    ids = rng.integers(0, 50000, N)
    pos = rng.integers(0, 40, N)
    nxt = 0
    for r in range(n_req):
        lo, hi = offsets[r], offsets[r + 1]
        u = rng.random()
        seed_slot = -1 if u < 0.3 else (S + 3 if u < 0.35 else int(perm[-1 - r]))  # untargeted seeds
        seeds[r] = seed_slot
        p = (rec[seed_slot, 1] + 1) if 0 <= seed_slot < S else 0
        for i in range(lo, hi):
            v = rng.random()
            if v < 0.06:
                locs[i] = -1 - int(rng.integers(0, 3))
            elif v < 0.10:
                locs[i] = S + int(rng.integers(0, 9))
            else:
                locs[i] = perm[nxt]
                nxt += 1
            if rng.random() < 0.05:
                p += int(rng.integers(-2, 3))
            pos[i] = p
            if locs[i] >= 0:
                p += 1
    if conflict:
        live = [i for r in range(n_req) for i in range(offsets[r], offsets[r + 1]) if 0 <= locs[i] < S]
        for _ in range(max(2, len(live) // 8)):
            i, j = rng.choice(live, 2)
            locs[j] = locs[i]  # duplicate: same tile, other tile or other request
        for i in live[:-1]:
            if rng.random() < 0.05:
                locs[i + 1] = locs[i]  # adjacent duplicate (same tile)
        if name == "write_conflict_seeds":
            for r in range(n_req):
                if rng.random() < 0.5 and live:
                    seeds[r] = locs[rng.choice(live)]  # a slot written by an earlier or later request
    kw = dict(tag=int(rng.integers(0, kvc.NUM_LAUNCH_TAGS)))
    if rng.random() < 0.6:
        et = np.where(rng.random(N) < 0.95, ids, rng.integers(0, 50000, N))
        ep = np.where(rng.random(N) < 0.95, pos, rng.integers(0, 40, N))
        kw.update(enable_write_input_assert=True, expected_input_tokens=_idx(rng, et, dt),
                  expected_input_positions=_idx(rng, ep, dt))
    mode = (NONE, PARTIAL, ALL)[seed % 3] if name != "write_many" else ALL
    kw["real_kv_hash_mode"] = mode
    if mode != NONE:
        kinds = [(np.uint8, 1, 64, 48, 1.0, 16), (np.float32, 4, 32, 32, 0.9), (ml_bf16(), 2, 16, 16, 1.0),
                 (np.int32, 8, 48, 16, 0.8, 32)][: 1 + seed % 4]
        kw["real_kv_sources"] = _sources(rng, S, kinds)
    cap = 4 * N + 8
    base = "zero"
    if name == "write_overflow":
        cap, base = max(8, N // 6), ("near", "past", "zero", "sat")[seed % 4]
        pos[:] = rng.integers(0, 40, N)  # chain-position rows everywhere
    log = _log(rng, cap, kw["tag"], base)
    wp = kvc.WritePlan(offsets=_idx(rng, offsets, dt), seed_slot_indices=_idx(rng, seeds, dt),
                       num_valid_reqs=np.array([nvr], np.int32))
    args = (_canary(rec, stride, rng), log, wp, _idx(rng, ids, dt), _idx(rng, pos, dt), _idx(rng, locs, dt))
    return _case("write", name, seed, args, kw)


def ml_bf16():
    import ml_dtypes
    return ml_dtypes.bfloat16


def has_write_conflict(case) -> bool:
    """True when the case takes the in-order path: a duplicated in-range target slot in the active
    ranges, or a non-empty request whose seed slot is targeted."""
    canary, log, wp, ids, pos, locs = case["args"]
    S = canary.shape[0]
    offs = np.asarray(wp.offsets, np.int64)
    seeds = np.asarray(wp.seed_slot_indices, np.int64)
    C, N = seeds.shape[0], np.asarray(ids).shape[0]
    active = min(max(int(np.asarray(wp.num_valid_reqs)[0]), 0), C)
    o = np.clip(np.maximum.accumulate(offs[: active + 1]), 0, N) if active >= 0 else offs[:1]
    locs = np.asarray(locs, np.int64)
    targets = [int(locs[i]) for r in range(active) for i in range(o[r], o[r + 1]) if 0 <= locs[i] < S]
    if len(set(targets)) != len(targets):
        return True
    ts = set(targets)
    return any(o[r + 1] > o[r] and 0 <= seeds[r] < S and int(seeds[r]) in ts for r in range(active))


# ---- VERIFY -------------------------------------------------------------------------------------

def _verify(name, seed, scale):
    z, rng = _SIZES[scale], _rng(name, seed, scale)
    dt = ("i32", "i64", "mixed")[seed % 3]
    V = z["verify_V"]
    S = V + 101
    stride = (32, 48)[seed % 2]
    mode = (NONE, PARTIAL, ALL)[seed % 3]
    sources = ()
    if mode != NONE:
        sources = _sources(rng, S, [(np.uint8, 1, 32, 32, 1.0), (np.float32, 4, 64, 48, 0.95, 16)][: 1 + seed % 2])
    tag = int(rng.integers(0, kvc.NUM_LAUNCH_TAGS))
    check = bool(seed % 2)
    if name == "verify_clean":
        Lc = z["verify_chain"]
        slots = rng.permutation(np.arange(1, S))[:V]
        chains = slots.reshape(-1, Lc) if V % Lc == 0 else slots[: V - V % Lc].reshape(-1, Lc)
        n_ch = chains.shape[0]
        rec = _records(S, rng)
        rec[:, 3] = 0  # mode NONE / no sources: the expected real-KV hash is 0
        toks = rng.integers(0, 50000, chains.shape)
        h = np.full(n_ch, hashing.ANCHOR_HASH, dtype=np.uint64)
        ent_slot, ent_tok, ent_pos, ent_prev = [], [], [], []
        for j in range(Lc):
            s = chains[:, j]
            rec[s, 0] = toks[:, j]
            rec[s, 1] = j
            rec[s, 2] = h.view(np.int64)
            h = np.asarray(hashing.mix3(h, toks[:, j].astype(np.uint64), np.full(n_ch, j, np.uint64)),
                           dtype=np.uint64)
        if sources:
            ok = np.array([hashing.first_unaddressable_source(sources, int(s)) is None for s in chains.ravel()])
            flat = chains.ravel()[ok]
            strips = [hashing.slot_strip(src, flat, mode, hashing.source_row_image(src)) for src in sources]
            rec[flat, 3] = np.asarray(hashing.real_kv_hash(strips), dtype=np.uint64).view(np.int64)
        # entries: chain by chain, positions ascending (a plan's layout)
        ent_slot = chains.ravel()
        ent_tok = toks.ravel()
        ent_pos = np.tile(np.arange(Lc), n_ch)
        ent_prev = np.concatenate([np.full((n_ch, 1), -1), chains[:, :-1]], axis=1).ravel()
        pad = V - ent_slot.shape[0]
        ent_slot = np.concatenate([ent_slot, np.zeros(pad, np.int64)])
        ent_tok = np.concatenate([ent_tok, np.full(pad, -1)])
        ent_pos = np.concatenate([ent_pos, np.zeros(pad, np.int64)])
        ent_prev = np.concatenate([ent_prev, np.zeros(pad, np.int64)])
        # sparse corruptions, far apart
        for s in rng.choice(ent_slot[ent_slot > 0], max(3, V // 2000), replace=False):
            rec[s, int(rng.integers(0, 4))] ^= 1 << int(rng.integers(0, 63))
        canary = _canary(rec, stride, rng)
        for src in sources:
            b = np.asarray(src.array).view(np.uint8).reshape(np.asarray(src.array).shape[0], -1)
            b[int(rng.integers(0, b.shape[0])), int(rng.integers(0, b.shape[1]))] ^= 0x40
        cap = 4096
    else:
        rec = _records(S, rng, max_pos=4)
        canary = _canary(rec, stride, rng)
        ent_slot = rng.integers(1, S, V)
        u = rng.random(V)
        ent_slot[u < 0.04] = 0
        ent_slot[(u >= 0.04) & (u < 0.07)] = rng.choice([-1, -5, S, S + 7], int(((u >= 0.04) & (u < 0.07)).sum()))
        ent_prev = rng.integers(1, S, V)
        u = rng.random(V)
        ent_prev[u < 0.1] = -1
        ent_prev[(u >= 0.1) & (u < 0.15)] = 0
        ent_prev[(u >= 0.15) & (u < 0.2)] = S + 1
        ent_pos = rng.integers(0, 4, V)
        ent_tok = np.where(rng.random(V) < 0.8, rec[np.clip(ent_slot, 0, S - 1), 0], -1)
        cap = 3 * V + 16 if name == "verify_heavy" else max(16, V // 10)
    nv = V if rng.random() < 0.8 else int(rng.integers(V // 2, V))
    vp = kvc.VerifyPlan(slot_indices=_idx(rng, ent_slot, dt), expected_tokens=_idx(rng, ent_tok, dt),
                        expected_positions=_idx(rng, ent_pos, dt), prev_slot_indices=_idx(rng, ent_prev, dt),
                        num_valid=np.array([nv], np.int32), enable=np.array([1], np.int32))
    base = ("zero", "near", "past")[seed % 3] if name == "verify_overflow" else "zero"
    kw = dict(tag=tag, check_verify_expected_token=check, real_kv_sources=sources, real_kv_hash_mode=mode)
    return _case("verify", name, seed, (canary, _log(rng, cap, tag, base), vp), kw)


# ---- PLAN ---------------------------------------------------------------------------------------

def _plan(name, seed, scale):
    z, rng = _SIZES[scale], _rng(name, seed, scale)
    dt = ("i32", "i64", "mixed")[seed % 3]
    bs, L = z["plan_bs"], z["plan_L"]
    R = bs + 3
    table = rng.integers(1, 4 * L, (R, L))
    table[rng.random((R, L)) < 0.03] = 0
    rps = rng.integers(1, R, bs)
    rps[rng.random(bs) < 0.2] = 0
    rps[rng.random(bs) < 0.02] = R + 1
    P = rng.integers(0, L + 1, bs)
    P[rng.random(bs) < 0.02] = L + 5
    E = rng.integers(0, 5, bs)
    W = (0, 16, 0)[seed % 3]
    kw = dict(write_req_capacity=bs + int(rng.integers(0, 7)), swa_window_size=W)
    if W or seed % 3 == 2:
        lut = rng.integers(1, 4 * L, 4 * L)
        lut[rng.random(4 * L) < 0.05] = 0
        kw["full_to_swa_index_mapping"] = _idx(rng, lut, dt)
    if seed % 2 == 0:
        Cp = L + 2
        kw["req_to_verify_expected_tokens"] = _idx(rng, rng.integers(0, 50000, (R, Cp)).ravel(), dt).reshape(R, Cp)
        kw["req_to_verify_expected_tokens_valid_lens"] = _idx(rng, rng.integers(0, Cp + 3, bs), dt)
        kw["kv_token_id_vs_position_offset"] = seed % 3 - 1
    live = rps != 0
    vlen = np.where(live, np.maximum(P - (np.maximum(P - W, 0) if W else 0), 0), 0)
    total = int(vlen.sum())
    fits = name in ("plan_big", "plan_flat")
    kw["verify_capacity"] = max(1, total + int(rng.integers(0, 9))) if fits else max(1, total - 1 - seed)
    r2t = _idx(rng, table.ravel(), dt).reshape(R, L)
    if name == "plan_flat":  # each row's segment, 0..7 slots apart, the next start rounded up to 16
        lens = np.minimum(P, L) + rng.integers(0, 8, bs)
        starts = np.concatenate([[0], np.cumsum(lens + (-lens % 16))[:-1]])
        N = int(starts[-1] + lens[-1])
        odd = rng.random(bs) < 0.02
        starts[odd] = rng.choice([-3, N - 2, N + 7], int(odd.sum()))
        kw["row_starts"] = _idx(rng, starts, dt)
        r2t = _idx(rng, rng.integers(1, 4 * L, N), dt)
    args = (_idx(rng, rps, dt), _idx(rng, P, dt), _idx(rng, E, dt), r2t)
    return _case("plan", name, seed, args, kw)


# ---- SCATTER ------------------------------------------------------------------------------------

def _scatter(name, seed, scale):
    z, rng = _SIZES[scale], _rng(name, seed, scale)
    dt = ("i32", "i64", "mixed")[seed % 3]
    bs, Rp, Cp = z["scatter_bs"], z["scatter_Rp"], z["scatter_Cp"]
    lens = rng.integers(0, Cp + 10, bs)
    offs = np.concatenate([[0], np.cumsum(lens)])
    total = int(offs[-1]) - int(rng.integers(0, 5))
    if seed % 2:
        bad = rng.random(bs + 1) < 0.05
        offs[bad] = rng.integers(-5, total + 5, int(bad.sum()))
    rps = rng.integers(0, Rp, bs)
    rps[rng.random(bs) < 0.03] = -1
    rps[rng.random(bs) < 0.03] = Rp
    pool_dt = np.int64 if seed % 2 else np.int32
    pool = rng.integers(-2**31, 2**31 - 1, (Rp, Cp)).astype(pool_dt)
    ids = rng.integers(-2**31, 2**31 - 1, max(total, 0))
    args = (pool, _idx(rng, ids, dt), _idx(rng, offs, dt), _idx(rng, rps, dt))
    return _case("scatter_req_token_ids", name, seed, args, {})


def stress_case(name: str, seed: int, scale: str = "emu") -> dict:
    if name.startswith("write"):
        return _write(name, seed, scale)
    if name.startswith("verify"):
        return _verify(name, seed, scale)
    if name.startswith("plan"):
        return _plan(name, seed, scale)
    return _scatter(name, seed, scale)
