"""Readable numpy reference of every op (format.md §7, §8, §9): the test oracle. Host only.

Written from docs/format.md, loop for loop, so that it can be read next to the pseudocode:

* :func:`write`   — §7.3 (with the §7.4 sequential request order and the §7.5 edge cases)
* :func:`verify`  — §8.3
* :func:`plan`    — §9.3 (outputs per §9.2)
* :func:`scatter_req_token_ids` — §9.5

The signatures are the public ones (docs/design.md §3) without ``impl``. Arguments are assumed valid (the
public ops check them at trace time); every *data-dependent* rule is implemented here. Inputs may be
numpy or jax arrays; they are never mutated. Results have numpy leaves:

* ``write``   -> ``(canary: uint8[S, stride] copy, ViolationLog)``
* ``verify``  -> ``ViolationLog``
* ``plan``    -> ``(VerifyPlan, WritePlan)``, all int32 arrays
* ``scatter_req_token_ids`` -> a copy of ``pool`` (same dtype)

A returned ``ViolationLog`` has numpy leaves with the §3.3 dtypes and shapes: ``ring`` uint8[cap, 64],
``write_index`` int32[1], both counters uint8[T, 8], ``enable_chain_position_assert`` int32[1].

Arithmetic: every value read from an index array is widened to int64 (Python int); int64 arithmetic
wraps (:func:`_w64`); hashes are u64 Python ints, stored as their i64 reinterpretation.
"""

from __future__ import annotations

import numpy as np

from . import consts, hashing
from .consts import FailReason, IndexKind, RealKvHashMode
from .inputs import VerifyPlan, WritePlan
from .state import ViolationLog

_OOB = int(FailReason.INDEX_OUT_OF_RANGE)


# ---- small helpers ------------------------------------------------------------------------------

def _w64(x: int) -> int:
    """Wrap a Python int to int64 (two's complement)."""
    return hashing.to_i64(int(x))


def _ints(a) -> list:
    """An index array (int32/int64, numpy or jax) -> list of Python ints (widened)."""
    return np.asarray(a).astype(np.int64).reshape(-1).tolist()


def _clamp(x: int, lo: int, hi: int) -> int:
    return min(max(x, lo), hi)


class _Log:
    """Mutable host copy of a ViolationLog (numpy leaves), with the §5.1 / §6 update rules."""

    def __init__(self, log):
        self.ring = np.array(np.asarray(log.ring), dtype=np.uint8, copy=True)
        self.write_index = np.array(np.asarray(log.write_index), dtype=np.int32, copy=True)
        self.kernel = np.array(np.asarray(log.kernel_run_counters), dtype=np.uint8, copy=True)
        self.slot = np.array(np.asarray(log.slot_run_counters), dtype=np.uint8, copy=True)
        self.flag = np.array(np.asarray(log.enable_chain_position_assert), dtype=np.int32, copy=True)

    @staticmethod
    def _add(counters: np.ndarray, tag: int, delta: int) -> None:
        """``counters[tag] += delta`` as a little-endian int64, mod 2**64."""
        old = int(counters[tag].view("<u8")[0])
        counters[tag] = np.frombuffer(((old + delta) & hashing.MASK64).to_bytes(8, "little"),
                                      dtype=np.uint8)

    def bump_kernel(self, tag: int) -> None:
        self._add(self.kernel, tag, 1)

    def bump_slots(self, tag: int, n: int) -> None:
        self._add(self.slot, tag, n)

    def append(self, rows: list) -> None:
        """§5.1: fill-once ring, saturating write_index."""
        n = len(rows)
        if n == 0:
            return
        cap = self.ring.shape[0]
        base = int(self.write_index[0])
        for k, row in enumerate(rows):
            if 0 <= base + k < cap:
                self.ring[base + k] = np.array([_w64(v) for v in row], dtype="<i8").view(np.uint8)
        self.write_index[0] = min(base + n, consts.WRITE_INDEX_MAX)

    def result(self) -> ViolationLog:
        return ViolationLog(ring=self.ring, write_index=self.write_index,
                            kernel_run_counters=self.kernel, slot_run_counters=self.slot,
                            enable_chain_position_assert=self.flag)


def _load_record(canary: np.ndarray, s: int):
    """(token, position, prev_hash, real_kv_hash) of slot ``s`` as Python ints (i64 values)."""
    return tuple(int(v) for v in canary[s, :consts.CANARY_SLOT_BYTES].copy().view("<i8"))


def _store_record(canary: np.ndarray, s: int, tok: int, pos: int, prev: int, rkv: int) -> None:
    rec = np.array([_w64(tok), _w64(pos), _w64(prev), _w64(rkv)], dtype="<i8")
    canary[s, :consts.CANARY_SLOT_BYTES] = rec.view(np.uint8)


def _successor_hash(canary: np.ndarray, s: int) -> int:
    """§4.3 on the current buffer (u64). ``s < num_slots`` is the caller's job."""
    if s < 0:
        return hashing.ANCHOR_HASH
    tok, pos, prev, _ = _load_record(canary, s)
    return hashing.mix3(prev, tok, pos)


class _RealKv:
    """Real-KV fingerprints for one launch (§4.4). Source bytes do not change during an op, so the
    fold of every needed slot is computed up front, vectorised; the per-entry logic then only looks
    it up. ``active`` is False for mode NONE or no sources: nothing is read and no OOB check runs."""

    def __init__(self, sources, mode, slots):
        self.sources = tuple(sources)
        self.mode = int(mode)
        self.active = self.mode != RealKvHashMode.NONE and len(self.sources) > 0
        self._hash = {}
        if not self.active:
            return
        self.bounds = [(int(src.page_size), int(np.shape(src.array)[0])) for src in self.sources]
        want = sorted({s for s in slots if s >= 0 and self.first_bad(s) is None})
        if want:
            arr = np.array(want, dtype=np.int64)
            strips = [hashing.slot_strip(src, arr, self.mode, hashing.source_row_image(src))
                      for src in self.sources]
            self._hash = dict(zip(want, (int(v) for v in hashing.real_kv_hash(strips))))

    def first_bad(self, slot: int):
        """The first source k with ``slot // page_size_k >= rows_k`` (slot >= 0), or None."""
        for k, (ps, rows) in enumerate(self.bounds):
            if slot // ps >= rows:
                return k
        return None

    def oob_row(self, tag, slot, pos, tok, k):
        ps, rows = self.bounds[k]
        return [tag, slot, pos, tok, slot // ps, int(IndexKind.REAL_KV_SOURCE_0) + k, rows, _OOB]

    def hash(self, slot: int) -> int:
        return self._hash[slot]


# ---- WRITE (§7.3) -------------------------------------------------------------------------------

def write(canary, log, write_plan, input_ids, positions, out_cache_loc, *,
          tag, enable_write_input_assert=False,
          expected_input_tokens=None, expected_input_positions=None,
          real_kv_sources=(), real_kv_hash_mode=RealKvHashMode.NONE):
    """Stamp the records of this step's slots (§7.3). Returns ``(canary copy, ViolationLog)``."""
    tag = int(tag)
    canary = np.array(np.asarray(canary), dtype=np.uint8, copy=True)
    L = _Log(log)
    S = canary.shape[0]
    offsets = _ints(write_plan.offsets)
    seeds = _ints(write_plan.seed_slot_indices)
    nvr = _ints(write_plan.num_valid_reqs)[0]
    ids, poss, locs = _ints(input_ids), _ints(positions), _ints(out_cache_loc)
    C, N = len(seeds), len(ids)
    assert_on = bool(enable_write_input_assert)
    if assert_on:
        exp_tok, exp_pos = _ints(expected_input_tokens), _ints(expected_input_positions)

    L.bump_kernel(tag)  # always, first
    active = _clamp(nvr, 0, C)
    # monotone clamp of the offsets (identity for well-formed plans)
    o = [_clamp(offsets[0], 0, N)]
    for k in range(1, active + 1):
        o.append(_clamp(offsets[k], o[k - 1], N))
    chain_assert_on = int(L.flag[0]) != 0  # read once per launch

    rkv = _RealKv(real_kv_sources, real_kv_hash_mode,
                  [locs[i] for i in range(o[0], o[active]) if 0 <= locs[i] < S])

    rows = []
    written = 0
    for r in range(active):  # request order (§7.4)
        lo, hi = o[r], o[r + 1]
        if hi == lo:
            continue  # empty request: no seed read, no rows
        seed = seeds[r]
        if seed >= S:
            rows.append([tag, seed, -1, -1, seed, int(IndexKind.WRITE_SEED), S, _OOB])
            seed = -1  # then exactly like "no prefix"
        running = _successor_hash(canary, seed)  # reads the CURRENT buffer
        do_pos = seed >= 0 and chain_assert_on
        last_pos = _load_record(canary, seed)[1] if do_pos else 0
        for i in range(lo, hi):  # flat order
            slot = locs[i]
            if slot < 0:
                continue  # skip: no store, no count, no chain step, last_pos kept
            written += 1
            tok, pos = ids[i], poss[i]
            in_range = slot < S
            fp = 0
            if not in_range:
                rows.append([tag, slot, pos, tok, slot, int(IndexKind.WRITE_SLOT), S, _OOB])
            elif rkv.active:
                k = rkv.first_bad(slot)
                if k is None:
                    fp = rkv.hash(slot)  # live bytes
                else:
                    rows.append(rkv.oob_row(tag, slot, pos, tok, k))
            if assert_on:
                et, ep = exp_tok[i], exp_pos[i]
                bits = ((int(FailReason.WRITE_TOKEN_MISMATCH) if tok != et else 0)
                        | (int(FailReason.WRITE_POSITION_MISMATCH) if pos != ep else 0))
                if bits:
                    rows.append([tag, slot, pos, tok, et, running, ep, bits])
            if do_pos:
                exp = _w64(last_pos + 1)
                if pos != exp:
                    rows.append([tag, slot, pos, tok, tok, running, exp,
                                 int(FailReason.WRITE_POSITION_MISMATCH)])
                last_pos = pos  # updated on mismatch too
            if in_range:
                _store_record(canary, slot, tok, pos, running, fp)
            running = hashing.mix3(running, tok, pos)  # actual values, never expected ones
    L.bump_slots(tag, written)
    L.append(rows)
    return canary, L.result()


# ---- VERIFY (§8.3) ------------------------------------------------------------------------------

def verify(canary, log, verify_plan, *, tag, check_verify_expected_token=False,
           real_kv_sources=(), real_kv_hash_mode=RealKvHashMode.NONE):
    """Check every active plan entry against the records (§8.3). Returns the updated ViolationLog;
    the canary is only read."""
    tag = int(tag)
    canary = np.asarray(canary)
    L = _Log(log)
    S = canary.shape[0]
    check = bool(check_verify_expected_token)

    L.bump_kernel(tag)  # always
    if _ints(verify_plan.enable)[0] == 0:
        return L.result()  # nothing else changes
    slots = _ints(verify_plan.slot_indices)
    V = len(slots)
    active = _clamp(_ints(verify_plan.num_valid)[0], 0, V)
    L.bump_slots(tag, active)  # includes slot-0 and OOB entries
    slots = slots[:active]
    epos_all = _ints(verify_plan.expected_positions)[:active]
    prev_all = _ints(verify_plan.prev_slot_indices)[:active]
    etok_all = _ints(verify_plan.expected_tokens)[:active] if check else [-1] * active

    rkv = _RealKv(real_kv_sources, real_kv_hash_mode, [s for s in slots if 0 < s < S])
    rows = []
    for e in range(active):  # entry order
        slot, epos, prev, etok = slots[e], epos_all[e], prev_all[e], etok_all[e]
        if slot == consts.TOKEN_TO_KV_SLOT_PADDING:
            continue  # padding: no loads, no rows
        if slot < 0 or slot >= S:
            rows.append([tag, slot, epos, -1, slot, int(IndexKind.VERIFY_SLOT), S, _OOB])
            continue
        st_tok, st_pos, st_chain, st_rkv = _load_record(canary, slot)
        chain_checked = prev != 0
        if prev >= S:
            rows.append([tag, slot, epos, -1, prev, int(IndexKind.VERIFY_PREV), S, _OOB])
            chain_checked = False
        exp_chain = hashing.to_i64(_successor_hash(canary, prev)) if chain_checked else st_chain
        rkv_checked, exp_rkv = True, 0
        if rkv.active:
            k = rkv.first_bad(slot)
            if k is None:
                exp_rkv = hashing.to_i64(rkv.hash(slot))
            else:
                rows.append(rkv.oob_row(tag, slot, epos, -1, k))
                rkv_checked = False
        bits = 0
        if chain_checked and st_chain != exp_chain:
            bits |= int(FailReason.VERIFY_CHAIN_HASH_MISMATCH)
        if check and etok != -1 and st_tok != etok:
            bits |= int(FailReason.VERIFY_TOKEN_MISMATCH)
        if st_pos != epos:
            bits |= int(FailReason.VERIFY_POSITION_MISMATCH)
        if rkv_checked and st_rkv != exp_rkv:
            bits |= int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
        if bits:
            rows.append([tag, slot, st_pos, st_tok, etok, st_chain, exp_chain, bits])
    L.append(rows)
    return L.result()


# ---- PLAN (§9.3) --------------------------------------------------------------------------------

def _narrow32(values, n: int) -> np.ndarray:
    """int64 values (Python ints) -> int32[n] keeping the low 32 bits; missing tail elements are 0."""
    out = np.zeros(n, dtype=np.int64)
    out[:len(values)] = np.array([_w64(v) for v in values], dtype=np.int64)
    return out.astype(np.int32)  # C cast: keeps the low 32 bits


def plan(req_pool_indices, prefix_lens, extend_seq_lens, req_to_token, *,
         verify_capacity, write_req_capacity,
         swa_window_size=0, full_to_swa_index_mapping=None,
         req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None,
         kv_token_id_vs_position_offset=0, row_starts=None, report_evicted_in_window=False):
    """Turn batch metadata into a (VerifyPlan, WritePlan) (§9.3). Every output element is defined
    (tails zero, §9.2); values are narrowed to int32 by their low 32 bits. With ``row_starts``,
    ``req_to_token`` is the flat page table and batch row r reads it at ``row_starts[r] + pos``."""
    Vc, Wc, W = int(verify_capacity), int(write_req_capacity), int(swa_window_size)
    koff = int(kv_token_id_vs_position_offset)
    rps, Ps, Es = _ints(req_pool_indices), _ints(prefix_lens), _ints(extend_seq_lens)
    bs = len(rps)
    table = np.asarray(req_to_token).astype(np.int64)
    starts = None if row_starts is None else _ints(row_starts)
    lut = None if full_to_swa_index_mapping is None else _ints(full_to_swa_index_mapping)
    pool = None
    if req_to_verify_expected_tokens is not None:
        pool = np.asarray(req_to_verify_expected_tokens).astype(np.int64)
        Rp, Cp = pool.shape
        valid_lens = _ints(req_to_verify_expected_tokens_valid_lens)

    def rt(r, rp, pos):  # the slot of position pos of batch row r; out-of-table read -> -1
        if pos < 0:
            return -1
        if starts is not None:  # flat table [N]: a wrapping int64 sum
            idx = _w64(starts[r] + pos)
            return int(table[idx]) if 0 <= idx < table.shape[0] else -1
        R, Lt = table.shape
        return int(table[rp, pos]) if 0 <= rp < R and pos < Lt else -1

    def T(x):  # LUT translation; outside [0, Llut) -> -1
        if lut is None:
            return x
        return lut[x] if 0 <= x < len(lut) else -1

    def pool_tok(r, rp, s):
        if pool is not None and 0 <= s < valid_lens[r] and s < Cp and 0 <= rp < Rp:
            return int(pool[rp, s])
        return -1

    live = [rp != consts.REQ_POOL_IDX_PADDING for rp in rps]
    ws = [max(_w64(P - W), 0) if W > 0 else 0 for P in Ps]
    vlen = [max(_w64(Ps[r] - ws[r]), 0) if live[r] else 0 for r in range(bs)]
    wlen = [max(Es[r], 0) if live[r] else 0 for r in range(bs)]
    total = 0
    for v in vlen:
        total = _w64(total + v)
    num_valid = min(total, Vc)
    enable = 1 if total <= Vc else 0

    slots, toks, poss, prevs = [], [], [], []
    if enable:
        for r in range(bs):  # row by row, positions ascending, until `total` entries
            rp = rps[r]
            for j in range(vlen[r]):
                if len(slots) >= total:
                    break
                pos = _w64(ws[r] + j)
                full = rt(r, rp, pos)
                slot = T(full)
                if report_evicted_in_window and slot == 0 and full > 0:
                    slot = -1  # evicted while the window still reads it: reported, not skipped
                slots.append(slot)
                prevs.append(T(rt(r, rp, pos - 1)) if pos > 0 else -1)  # SWA does not reset the chain
                toks.append(pool_tok(r, rp, _w64(pos + koff)))
                poss.append(pos)

    offsets = [0]
    for r in range(bs):
        offsets.append(_w64(offsets[r] + wlen[r]))
    seeds = [T(rt(r, rps[r], Ps[r] - 1)) if (live[r] and Ps[r] > 0 and wlen[r] > 0) else -1
             for r in range(bs)]

    vp = VerifyPlan(slot_indices=_narrow32(slots, Vc), expected_tokens=_narrow32(toks, Vc),
                    expected_positions=_narrow32(poss, Vc), prev_slot_indices=_narrow32(prevs, Vc),
                    num_valid=_narrow32([num_valid], 1), enable=_narrow32([enable], 1))
    wp = WritePlan(offsets=_narrow32(offsets, Wc + 1), seed_slot_indices=_narrow32(seeds, Wc),
                   num_valid_reqs=_narrow32([bs], 1))
    return vp, wp


# ---- scatter_req_token_ids (§9.5) ---------------------------------------------------------------

def scatter_req_token_ids(pool, flat_ids, offsets, req_pool_indices):
    """Fill the ground-truth token pool from flattened per-request id lists (§9.5). Returns a copy of
    ``pool`` (same dtype); later batch rows win; ids past the pool width are truncated."""
    out = np.array(np.asarray(pool), copy=True)
    Rp, Cp = out.shape
    ids = np.asarray(flat_ids).astype(np.int64)
    total = ids.shape[0]
    offs, rps = _ints(offsets), _ints(req_pool_indices)
    for r in range(len(rps)):  # in order: the later r wins
        start, end, rp = offs[r], offs[r + 1], rps[r]
        n = min(_w64(end - start), Cp)
        if n <= 0 or rp < 0 or rp >= Rp:
            continue
        for c in range(n):
            if 0 <= start + c < total:
                out[rp, c] = ids[start + c].astype(out.dtype)  # narrowed to the pool dtype
    return out
