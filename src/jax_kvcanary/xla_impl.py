"""Pure-JAX backend (``impl="xla"``): plan / write / verify / scatter_req_token_ids in jax.numpy and lax.

Bit-identical to the native handlers (format.md §3-§9) on every backend, with ``jax_enable_x64`` off or on.
Arguments were validated by ``ops.py`` at trace time; nothing here re-validates.

Representation. Every 64-bit quantity (record fields, hashes, ring columns, counters) is a pair
``(lo, hi)`` of uint32 arrays (``_u64``); records and rows are bitcast to/from uint8. Index inputs
keep their dtype (int32, or int64 with x64 on) for comparisons and are widened (sign-extended) into
pairs when stored.

Structure.
- verify: fully vectorised over entries (no loops, no control flow).
- write: everything is vectorised except the hash chain, which is inherently serial per request.
  The chain runs as a ``while_loop`` over the entry index *within* a request with all requests
  vectorised (depth = longest request). That is exact unless a request's seed slot was written by an
  earlier request of the same launch (§7.4, a caller error in practice); a vectorised detector finds
  that case and ``lax.cond`` switches to an exact sequential ``while_loop`` over the flat entries.
  Stores are one scatter of each slot's last writer (flat order = (request, entry) order), so
  duplicate slots resolve deterministically ("later wins"). The scatter is made to data-depend on
  the updated log, so that under donation XLA can order it after earlier readers of the canary (a
  verify just before) and needs no copy of the canary.
- ring append (§5.1): per-item row counts, an inclusive cumsum, and for each ring row the item found by
  binary search; each op's per-entry fields are gathered for those ``capacity`` items only and
  selected into the ring.
- plan: saturating scan of the verify lengths + binary search for the owning batch row.
No host callbacks anywhere. Loop carries are marked varying under ``jax.shard_map`` (``_vary``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from . import _u64 as U
from . import consts
from .state import ViolationLog
from .inputs import VerifyPlan, WritePlan

I32 = jnp.int32
U32 = jnp.uint32
INT32_MAX = 2**31 - 1

# Testing hook, read at trace time: always take write's sequential chain path (normally taken only
# when a seed slot was written earlier in the same launch). The results must not depend on it.
FORCE_SEQUENTIAL_WRITE = False
_K = consts.IndexKind
# The fail bits of ring column 7 (consts.FailReason), as the plain ints jnp.where takes.
_CHAIN_HASH = int(consts.FailReason.VERIFY_CHAIN_HASH_MISMATCH)
_POSITION = int(consts.FailReason.VERIFY_POSITION_MISMATCH)
_REAL_KV_HASH = int(consts.FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
_WRITE_TOKEN = int(consts.FailReason.WRITE_TOKEN_MISMATCH)
_WRITE_POSITION = int(consts.FailReason.WRITE_POSITION_MISMATCH)
_TOKEN = int(consts.FailReason.VERIFY_TOKEN_MISMATCH)
_OOB = int(consts.FailReason.INDEX_OUT_OF_RANGE)


# ---- small helpers ------------------------------------------------------------------------------

def _iota(n):
    return jnp.arange(n, dtype=I32)


def _pc(value: int, shape):
    return U.const(int(value), shape)


def _pi(x):
    return U.from_int(x)


def _i32(x):
    return lax.convert_element_type(x, I32)


def _searchsorted(a, v, side):
    # 'scan': a fixed-trip-count loop of log2(len(a)) vectorised gather steps. (The unrolled variant
    # compiles very slowly on XLA:CPU for long arrays: seconds per call at 2**18 elements.)
    return _i32(jnp.searchsorted(a, v, side=side, method="scan"))


def _vma(x):
    """Manual mesh axes ``x`` varies over inside ``jax.shard_map`` (empty outside)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)                     # older jax
    if vma is None:
        mat = getattr(aval, "manual_axis_type", None)    # jax >= 0.10
        vma = getattr(mat, "varying", None)
    return frozenset(vma or ())


def _vary(tree, refs):
    """Under ``jax.shard_map`` (check_vma): mark the loop carries in ``tree`` as varying over every
    manual axis that any of ``refs`` varies over, so a loop's carry types match its body's outputs.
    A no-op outside shard_map."""
    axes = frozenset()
    for r in jax.tree_util.tree_leaves(refs):
        axes |= _vma(r)
    if not axes:
        return tree

    def cast(x):
        missing = tuple(sorted(axes - _vma(x)))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree_util.tree_map(cast, tree)


def _counter_add(counters, tag: int, delta):
    """counters[tag] += delta (little-endian int64, wrap mod 2**64); delta: int32 scalar >= 0.

    Every row is rebuilt (adding 0 to the others) rather than row ``tag`` updated in place: from jax
    0.11 XLA copies the whole array around a one-row update, once per update, while the rebuilt array
    costs one copy per step at most, into the donated output."""
    p = U.from_bytes(counters)                                                   # pair of [T, 1]
    row = lax.broadcasted_iota(I32, p[0].shape, 0) == tag
    lo = jnp.where(row, lax.bitcast_convert_type(_i32(delta), U32), jnp.uint32(0))
    p = U.add(p, (lo, jnp.zeros_like(lo)))
    return U.to_bytes(p[0], p[1])


def _gather(fields, item):
    """Every per-entry array of ``fields`` (a pytree of [n] arrays and (lo, hi) pairs) at ``item``."""
    return jax.tree_util.tree_map(lambda a: a[item], fields)


def _stack_cols(cols):
    return jnp.stack([c[0] for c in cols], -1), jnp.stack([c[1] for c in cols], -1)


def _select_cols(kind, options):
    """options: list (by kind) of 8-column pair lists; select by ``kind`` (int32 [n])."""
    out = options[-1]
    for k in range(len(options) - 2, -1, -1):
        out = [U.where(kind == k, a, b) for a, b in zip(options[k], out)]
    return out


def _nth_set(q, masks):
    """Index of the q-th (0-based) set mask among ``masks`` (in order); q < sum(masks) assumed."""
    kind = jnp.full(q.shape, len(masks) - 1, I32)
    acc = jnp.zeros(q.shape, I32)
    found = jnp.zeros(q.shape, bool)
    for k, m in enumerate(masks):
        acc = acc + m.astype(I32)
        hit = (~found) & (q < acc)
        kind = jnp.where(hit, k, kind)
        found = found | hit
    return kind


def _append(log: ViolationLog, counts, build_rows):
    """Deterministic fill-once ring append (format.md §5.1).

    counts: int32 [M], rows contributed by item m (items in output order).
    build_rows(item, q) -> list of 8 pairs [cap]: the q-th row of each item.
    Returns (ring, write_index).
    """
    ring = log.ring
    cap = ring.shape[0]
    m = counts.shape[0]
    n = jnp.sum(counts, dtype=I32)
    base = log.write_index[0]
    j = _iota(cap)
    k = j - base                              # int32 wrap only when j - base >= 2**31: rejected below
    valid = (j >= base) & (k >= 0) & (k < n)
    incl = jnp.cumsum(counts, dtype=I32)
    item = jnp.clip(_searchsorted(incl, k, "right"), 0, m - 1)
    q = k - (incl[item] - counts[item])
    cols = build_rows(item, q)
    lo, hi = _stack_cols(cols)
    rows = U.to_bytes(lo, hi)                 # [cap, 64]
    ring = jnp.where(valid[:, None], rows, ring)
    write_index = jnp.where(base > INT32_MAX - n, INT32_MAX, base + n).astype(I32).reshape(1)
    return ring, write_index


def _read_records(canary, slots_clamped):
    """Record fields (token, position, prev_hash, real_kv_hash) of int32 slots in [0, S): 4 pairs."""
    lo, hi = U.from_bytes(canary[slots_clamped, : consts.CANARY_SLOT_BYTES])
    return [(lo[..., f], hi[..., f]) for f in range(consts.CANARY_FIELDS_PER_SLOT)]


# ---- real-KV sources (format.md §4.4) ----------------------------------------------------------------

def _source_words(arr):
    """The array's row-major memory image as uint32 words: [rows, row_bytes // 4]."""
    rows = arr.shape[0]
    dt = np.dtype(arr.dtype)
    if dt == np.bool_:
        arr = arr.astype(jnp.uint8)
        dt = np.dtype(np.uint8)
    if dt.kind == "c":
        arr = jnp.stack([jnp.real(arr), jnp.imag(arr)], axis=-1)
        dt = np.dtype(arr.dtype)
    isz = dt.itemsize
    per_row = int(np.prod(arr.shape[1:], dtype=np.int64))   # elements per row (explicit: rows may be 0)
    flat = arr.reshape(rows, per_row)
    if isz == 1 or isz == 2:
        return lax.bitcast_convert_type(flat.reshape(rows, per_row * isz // 4, 4 // isz), U32)
    if isz == 4:
        return lax.bitcast_convert_type(flat, U32)
    if isz == 8:
        return lax.bitcast_convert_type(flat, U32).reshape(rows, per_row * 2)
    raise TypeError(f"kv-canary: internal: unsupported real-KV element size {isz}")


class _Src:
    def __init__(self, src, mode: int):
        self.words = _source_words(src.array)
        self.rows = int(src.array.shape[0])
        self.ps = int(src.page_size)
        self.wpt = int(src.num_bytes_per_token) // 4       # words per token slot
        self.off = int(src.offset_bytes) // 4              # the strip's first word inside the slot
        eff = consts.REAL_KV_PARTIAL_BYTES if mode == int(consts.RealKvHashMode.PARTIAL) else int(src.read_bytes)
        self.chunks = eff // consts.REAL_KV_CHUNK_BYTES


def _prep_sources(sources, mode):
    if mode == int(consts.RealKvHashMode.NONE) or not sources:
        return []
    return [_Src(s, mode) for s in sources]


def _rkv_address(srcs, sc):
    """First unaddressable source of int32 slots sc >= 0: (k or -1, row value, bound); all -1 / 0
    when there are no sources."""
    first = jnp.full(sc.shape, -1, I32)
    rowval = jnp.zeros(sc.shape, I32)
    bound = jnp.zeros(sc.shape, I32)
    for k in range(len(srcs) - 1, -1, -1):      # reverse, so the lowest failing index wins
        s = srcs[k]
        row = sc // s.ps
        fail = row >= s.rows
        first = jnp.where(fail, k, first)
        rowval = jnp.where(fail, row, rowval)
        bound = jnp.where(fail, s.rows, bound)
    return first, rowval, bound


def _fold_one(s: _Src, sc):
    acc = U.zeros(sc.shape)
    if s.rows == 0:
        return acc
    rc = jnp.clip(sc // s.ps, 0, s.rows - 1)[:, None]
    col = ((sc % s.ps) * s.wpt + s.off)[:, None] + _iota(4)[None, :]

    def chunk(mi, acc):
        w = s.words[rc, col + 4 * mi]                      # [n, 4]
        acc = U.splitmix64(U.xor(acc, (w[:, 0], w[:, 1])))
        return U.splitmix64(U.xor(acc, (w[:, 2], w[:, 3])))

    if s.chunks <= 4:
        for mi in range(s.chunks):
            acc = chunk(mi, acc)
        return acc
    return lax.fori_loop(0, s.chunks, chunk, _vary(acc, (s.words, sc)))


def _rkv_hash(srcs, sc):
    acc = U.zeros(sc.shape)
    for s in srcs:
        acc = U.splitmix64(U.xor(acc, _fold_one(s, sc)))
    return acc


# ---- VERIFY (format.md §8) ---------------------------------------------------------------------------

def verify(canary, log, verify_plan, *, tag: int, check_verify_expected_token: bool,
           real_kv_sources: tuple, real_kv_hash_mode: int) -> ViolationLog:
    tag = int(tag)
    check = bool(check_verify_expected_token)
    vp = verify_plan
    S = int(canary.shape[0])
    V = int(vp.slot_indices.shape[0])
    srcs = _prep_sources(real_kv_sources, int(real_kv_hash_mode))

    kernel = _counter_add(log.kernel_run_counters, tag, 1)
    enabled = vp.enable[0] != 0
    active = jnp.where(enabled, jnp.clip(vp.num_valid[0], 0, V), 0).astype(I32)
    slot_ctr = _counter_add(log.slot_run_counters, tag, active)

    # -- everything about every entry (the canary is read once, here: the rows gather from these)
    e = _iota(V)
    n = e.shape
    act = e < active
    slot = vp.slot_indices
    prev = vp.prev_slot_indices
    slot_oob = act & (slot != 0) & ((slot < 0) | (slot >= S))
    live = act & (slot > 0) & (slot < S)
    sc = _i32(jnp.clip(slot, 0, S - 1))
    st_tok, st_pos, st_chain, st_rkv = _read_records(canary, sc)
    prev_oob = live & (prev >= S)
    epos = _pi(vp.expected_positions)
    etok = _pi(vp.expected_tokens) if check else _pc(-1, n)
    rk_first, rk_row, rk_bound = _rkv_address(srcs, sc)
    rkv_oob = live & (rk_first >= 0)
    chain_checked = live & (prev != 0) & (prev < S)
    pc = _i32(jnp.clip(prev, 0, S - 1))
    p_tok, p_pos, p_chain, _ = _read_records(canary, pc)
    succ = U.where(prev < 0, U.anchor_hash(n), U.mix3(p_chain, p_tok, p_pos))
    exp_chain = U.where(chain_checked, succ, st_chain)
    if check:
        tok_bad = (vp.expected_tokens != -1) & U.ne(st_tok, etok)
    else:
        tok_bad = jnp.zeros(n, bool)
    exp_rkv = _rkv_hash(srcs, sc) if srcs else U.zeros(n)
    bits = (jnp.where(chain_checked & U.ne(st_chain, exp_chain), _CHAIN_HASH, 0)
            | jnp.where(tok_bad, _TOKEN, 0)
            | jnp.where(U.ne(st_pos, epos), _POSITION, 0)
            | jnp.where((~rkv_oob) & U.ne(st_rkv, exp_rkv), _REAL_KV_HASH, 0)).astype(I32)
    bits = jnp.where(live, bits, 0)
    masks = (slot_oob | prev_oob, rkv_oob, bits != 0)
    all_f = dict(masks=masks, slot=slot, prev=prev, slot_oob=slot_oob, epos=epos, etok=etok,
                 st_tok=st_tok, st_pos=st_pos, st_chain=st_chain, exp_chain=exp_chain, bits=bits,
                 rk_first=rk_first, rk_row=rk_row, rk_bound=rk_bound)
    counts = sum(m.astype(I32) for m in masks)

    def build_rows(item, q):
        f = _gather(all_f, item)
        n = item.shape
        kind = _nth_set(q, f["masks"])
        tagp = _pc(tag, n)
        slot = _pi(f["slot"])
        m1 = _pc(-1, n)
        so = f["slot_oob"]
        oob_idx = [tagp, slot, f["epos"], m1,
                   U.where(so, slot, _pi(f["prev"])),
                   _pi(jnp.where(so, int(_K.VERIFY_SLOT), int(_K.VERIFY_PREV)).astype(I32)),
                   _pc(S, n), _pc(_OOB, n)]
        oob_rkv = [tagp, slot, f["epos"], m1, _pi(f["rk_row"]),
                   _pi(int(_K.REAL_KV_SOURCE_0) + f["rk_first"]), _pi(f["rk_bound"]), _pc(_OOB, n)]
        check_row = [tagp, slot, f["st_pos"], f["st_tok"], f["etok"], f["st_chain"], f["exp_chain"],
                     _pi(f["bits"])]
        return _select_cols(kind, [oob_idx, oob_rkv, check_row])

    ring, write_index = _append(log, counts, build_rows)
    return ViolationLog(ring=ring, write_index=write_index, kernel_run_counters=kernel,
                        slot_run_counters=slot_ctr,
                        enable_chain_position_assert=log.enable_chain_position_assert)


# ---- WRITE (format.md §7) ----------------------------------------------------------------------------
#
# write() runs its parts in this order: the requests (_write_requests) and the flat entries
# (_write_entries) from the plan, the writers sorted by slot (_writers_by_slot), the hash chain
# (_write_chain: vectorised over requests, or sequential when a seed was written in this launch), the
# checks of every entry (_write_checks) and their ring rows (_write_row_builder), then the records'
# real-KV fingerprints (_write_fingerprints) and one scatter of each slot's last writer
# (_store_records).

class _Requests(NamedTuple):
    """The launch's requests (format.md §7.3): their ranges of the flat entries and their seeds.
    ``C`` = write_req_capacity; pairs are ``(lo, hi)`` uint32 (``_u64``)."""

    o: jax.Array             # int32 [C + 1]: offsets clamped to [0, N], monotone, padded past the active requests
    o_end: jax.Array         # int32 []: end of the last active request's range
    r_lo: jax.Array          # int32 [C]: first flat entry of each request
    r_hi: jax.Array          # int32 [C]: one past its last
    seeds: jax.Array         # [C]: the plan's seed slots, as given
    seed_oob: jax.Array      # bool [C]: a non-empty request whose seed slot is >= S
    has_seed: jax.Array      # bool [C]: a non-empty request whose seed slot is in [0, S)
    do_pos: jax.Array        # bool [C]: the chain-position assert checks this request
    seed_c: jax.Array        # int32 [C]: the seed slot clamped to [0, S)
    seed_hash0: tuple        # pair [C]: the chain hash the request starts from (seed record's successor, or the anchor)
    seed_pos0: tuple         # pair [C]: the position the chain-position assert starts from


class _Entries(NamedTuple):
    """Every flat entry ``i`` in ``[0, N)``: its request and what it writes."""

    i: jax.Array             # int32 [N]: the entry index
    req: jax.Array           # int32 [N]: its request (clamped to [0, C))
    active: jax.Array        # bool [N]: inside an active request's range
    in_range: jax.Array      # bool [N]: active, slot in [0, S)
    tok: tuple               # pair [N]: input_ids
    pos: tuple               # pair [N]: positions


def _write_requests(canary, log, wp, N: int) -> _Requests:
    """The request ranges (a monotone clamp ``cummax(clip(offsets, 0, N))``) and each request's seed,
    read from the canary before anything is written."""
    S = int(canary.shape[0])
    C = int(wp.seed_slot_indices.shape[0])
    active = jnp.clip(wp.num_valid_reqs[0], 0, C).astype(I32)
    ks = _iota(C + 1)
    o = lax.cummax(_i32(jnp.clip(wp.offsets, 0, N)), axis=0)
    o_end = o[active]
    o = jnp.where(ks <= active, o, o_end)
    r_lo, r_hi = o[:C], o[1:]
    nonempty = r_hi > r_lo

    seeds = wp.seed_slot_indices
    seed_oob = nonempty & (seeds >= S)
    has_seed = nonempty & (seeds >= 0) & (seeds < S)
    chain_on = log.enable_chain_position_assert[0] != 0
    do_pos = has_seed & chain_on
    seed_c = _i32(jnp.clip(seeds, 0, S - 1))
    s_tok, s_pos, s_chain, _ = _read_records(canary, seed_c)
    seed_hash0 = U.where(has_seed, U.mix3(s_chain, s_tok, s_pos), U.anchor_hash((C,)))
    seed_pos0 = U.where(do_pos, s_pos, U.zeros((C,)))
    return _Requests(o, o_end, r_lo, r_hi, seeds, seed_oob, has_seed, do_pos, seed_c, seed_hash0, seed_pos0)


def _write_entries(req: _Requests, input_ids, positions, out_cache_loc, S: int) -> _Entries:
    """Each flat entry's request (binary search of the clamped offsets) and whether it writes."""
    N = int(input_ids.shape[0])
    C = int(req.r_lo.shape[0])
    i_all = _iota(N)
    req_all = jnp.clip(_searchsorted(req.o[1:], i_all, "right"), 0, C - 1)
    ent_act = (i_all >= req.o[0]) & (i_all < req.o_end)
    nonskip_all = ent_act & (out_cache_loc >= 0)
    in_range_all = nonskip_all & (out_cache_loc < S)
    return _Entries(i_all, req_all, ent_act, in_range_all, _pi(input_ids), _pi(positions))


def _lex_lower_bound(sk, si, s, t, n):
    """First p in [0, n] with (sk[p], si[p]) >= (s, t) lexicographically; vectorised over s, t."""
    def step(_, lh):
        lo, hi = lh
        mid = (lo + hi) // 2
        mc = jnp.clip(mid, 0, n - 1)
        kv = sk[mc]
        iv = si[mc]
        less = (kv < s) | ((kv == s) & (iv < t))
        open_ = lo < hi
        return jnp.where(open_ & less, mid + 1, lo), jnp.where(open_ & ~less, mid, hi)

    init = _vary((jnp.zeros(s.shape, I32), jnp.full(s.shape, n, I32)), (sk, si, s, t))
    return lax.fori_loop(0, max(1, int(n).bit_length()), step, init)[0]


def _writers_by_slot(req: _Requests, ent: _Entries, out_cache_loc, S: int):
    """The writing entries sorted by (slot, flat index), and each request's seed conflict.

    Returns ``(sk, si, writer, conflict)``: ``sk`` int32 [N] the sorted slots (``S`` for entries that
    write nothing), ``si`` int32 [N] their flat indices; ``writer`` int32 [C] the last entry before the
    request that wrote its seed slot in this launch (-1: none); ``conflict`` bool [] any such request
    (always True under ``FORCE_SEQUENTIAL_WRITE``)."""
    N = int(ent.i.shape[0])
    key = jnp.where(ent.in_range, _i32(jnp.clip(out_cache_loc, 0, S - 1)), S).astype(I32)
    sk, si = lax.sort((key, ent.i), num_keys=2)
    seed_key = jnp.where(req.has_seed, req.seed_c, -1)
    p = _lex_lower_bound(sk, si, seed_key, req.r_lo, N)
    pm = jnp.clip(p - 1, 0, N - 1)
    writer = jnp.where(req.has_seed & (p > 0) & (sk[pm] == seed_key), si[pm], -1)
    conflict = jnp.any(writer >= 0)
    if FORCE_SEQUENTIAL_WRITE:
        conflict = jnp.asarray(True)
    return sk, si, writer, conflict


def _chain_by_request(req: _Requests, input_ids, positions, out_cache_loc, loop_refs):
    """The chain with every request in parallel: a ``while_loop`` over the entry index within a
    request (depth = the longest request). Exact unless a seed was written earlier in the launch.
    Returns uint32 [N, 4]: each entry's running hash and chain-assert expected position (pairs)."""
    N = int(input_ids.shape[0])
    lengths = req.r_hi - req.r_lo
    lmax = jnp.max(lengths)

    def body(state):
        j, run, last, buf = state
        i = req.r_lo + j
        ic = jnp.clip(i, 0, N - 1)
        ns = (i < req.r_hi) & (out_cache_loc[ic] >= 0)
        tok = _pi(input_ids[ic])
        pos = _pi(positions[ic])
        exp = U.add_small(last, 1)
        upd = jnp.stack([run[0], run[1], exp[0], exp[1]], -1)
        buf = buf.at[jnp.where(ns, i, N)].set(upd, mode="drop")
        run = U.where(ns, U.mix3(run, tok, pos), run)
        last = U.where(ns, pos, last)
        return j + 1, run, last, buf

    init = _vary((jnp.zeros((), I32), req.seed_hash0, req.seed_pos0, jnp.zeros((N, 4), U32)), loop_refs)
    return lax.while_loop(lambda st: st[0] < lmax, body, init)[3]


def _chain_in_order(req: _Requests, ent: _Entries, writer, input_ids, positions, out_cache_loc, loop_refs):
    """The chain in exact §7.3 order, one flat entry per iteration. A seed written earlier in this
    launch reads the record its last writer stored: (token, position, running hash) of that entry,
    whose successor hash is the running hash *after* it (columns 4-5 of the carry). Returns what
    ``_chain_by_request`` does."""
    N = int(input_ids.shape[0])

    def body(i, state):
        run, last, buf = state
        r = ent.req[i]
        start = i == req.r_lo[r]
        w = writer[r]
        wc = jnp.clip(w, 0, N - 1)
        has_w = w >= 0
        s_hash = U.where(has_w, (buf[wc, 4], buf[wc, 5]), (req.seed_hash0[0][r], req.seed_hash0[1][r]))
        s_p = U.where(has_w & req.do_pos[r], _pi(positions[wc]), (req.seed_pos0[0][r], req.seed_pos0[1][r]))
        run = U.where(start, s_hash, run)
        last = U.where(start, s_p, last)
        ns = out_cache_loc[i] >= 0
        pos = _pi(positions[i])
        exp = U.add_small(last, 1)
        nxt = U.mix3(run, _pi(input_ids[i]), pos)
        buf = buf.at[i].set(jnp.stack([run[0], run[1], exp[0], exp[1], nxt[0], nxt[1]]))
        run = U.where(ns, nxt, run)
        last = U.where(ns, pos, last)
        return run, last, buf

    init = _vary((U.zeros(()), U.zeros(()), jnp.zeros((N, 6), U32)), loop_refs)
    return lax.fori_loop(req.o[0], req.o_end, body, init)[2][:, :4]


def _write_chain(req: _Requests, ent: _Entries, writer, conflict, input_ids, positions, out_cache_loc,
                 loop_refs):
    """The hash chain: ``(running, expected)``, pairs [N]: the chain hash stored at each entry and the
    position the chain-position assert expects there. ``lax.cond`` takes the in-order loop only when
    a seed conflict makes the parallel one inexact."""
    def fast(_):
        return _chain_by_request(req, input_ids, positions, out_cache_loc, loop_refs)

    def slow(_):
        return _chain_in_order(req, ent, writer, input_ids, positions, out_cache_loc, loop_refs)

    buf = lax.cond(conflict, slow, fast, None)
    return (buf[:, 0], buf[:, 1]), (buf[:, 2], buf[:, 3])


def _write_checks(req: _Requests, ent: _Entries, running, expected, srcs, input_ids, positions, out_cache_loc,
                  input_assert: bool, expected_input_tokens, expected_input_positions, S: int) -> dict:
    """Every flat entry's checks (format.md §7.4): its four row masks, in row order (seed out of
    range at the request's first entry, slot or source out of range, input assert, chain-position
    assert), and every field the rows gather."""
    n = ent.i.shape
    slot = out_cache_loc
    nonskip = ent.active & (slot >= 0)
    in_range = nonskip & (slot < S)
    m0 = ent.active & (ent.i == req.r_lo[ent.req]) & req.seed_oob[ent.req]
    sc = _i32(jnp.clip(slot, 0, S - 1))
    rk_first, rk_row, rk_bound = _rkv_address(srcs, sc)
    rkv_oob = in_range & (rk_first >= 0)
    slot_oob = nonskip & (slot >= S)
    m1 = slot_oob | rkv_oob
    if input_assert:
        ibits = (jnp.where(input_ids != expected_input_tokens, _WRITE_TOKEN, 0)
                 | jnp.where(positions != expected_input_positions, _WRITE_POSITION, 0)).astype(I32)
        m2 = nonskip & (ibits != 0)
        et, ep = _pi(expected_input_tokens), _pi(expected_input_positions)
    else:
        ibits = jnp.zeros(n, I32)
        m2 = jnp.zeros(n, bool)
        et = ep = U.zeros(n)
    m3 = nonskip & req.do_pos[ent.req] & U.ne(ent.pos, expected)
    return dict(masks=(m0, m1, m2, m3), req=ent.req, slot=slot, slot_oob=slot_oob, tok=ent.tok, pos=ent.pos,
                running=running, exp=expected, et=et, ep=ep, ibits=ibits, in_range=in_range,
                rkv_oob=rkv_oob, rk_first=rk_first, rk_row=rk_row, rk_bound=rk_bound, sc=sc,
                nonskip=nonskip)


def _write_row_builder(all_f: dict, seeds, tag: int, S: int):
    """``build_rows(item, q)`` for ``_append``: the q-th row of entry ``item``, of the kind its masks
    select (seed, out-of-range, input assert, chain-position assert)."""
    def build_rows(item, q):
        f = _gather(all_f, item)
        n = item.shape
        kind = _nth_set(q, f["masks"])
        tagp = _pc(tag, n)
        slot = _pi(f["slot"])
        seed = _pi(seeds[f["req"]])
        m1 = _pc(-1, n)
        so = f["slot_oob"]
        seed_row = [tagp, seed, m1, m1, seed, _pc(int(_K.WRITE_SEED), n), _pc(S, n), _pc(_OOB, n)]
        oob_row = [tagp, slot, f["pos"], f["tok"],
                   U.where(so, slot, _pi(f["rk_row"])),
                   _pi(jnp.where(so, int(_K.WRITE_SLOT), int(_K.REAL_KV_SOURCE_0) + f["rk_first"]).astype(I32)),
                   U.where(so, _pc(S, n), _pi(f["rk_bound"])), _pc(_OOB, n)]
        input_row = [tagp, slot, f["pos"], f["tok"], f["et"], f["running"], f["ep"], _pi(f["ibits"])]
        chain_row = [tagp, slot, f["pos"], f["tok"], f["tok"], f["running"], f["exp"], _pc(_WRITE_POSITION, n)]
        return _select_cols(kind, [seed_row, oob_row, input_row, chain_row])
    return build_rows


def _write_fingerprints(srcs, all_f: dict, N: int):
    """The real-KV field of each entry's record (pair [N]): the fold of its slot's bytes over the
    sources; 0 without sources or where a source cannot address the slot."""
    if not srcs:
        return U.zeros((N,))
    rkv = _rkv_hash(srcs, all_f["sc"])
    return U.where(all_f["rkv_oob"], U.zeros((N,)), rkv)


def _store_records(canary, sk, si, fields, write_index):
    """Store the 32-byte records ``fields`` (4 pairs [N]: token, position, prev_hash, real_kv_hash,
    in flat order) of each slot's last writer (the largest flat index) in one deterministic scatter.

    The in-place store is made to data-depend on the updated ``write_index``, so it is ordered after
    every earlier reader of this canary (e.g. a verify just before this write): a verify reads the
    canary only for its checks, whose fail bits flow into the row count and so into write_index (its
    rows gather those reads, see verify's all_f). Without this XLA cannot order the two and copies the
    (donated) canary. The ring itself is not read here: reading any element of it made XLA recompute
    that element from the ring parameter beside the in-place ring update, and copy the ring."""
    S = int(canary.shape[0])
    rec_lo = jnp.stack([f[0] for f in fields], -1)
    rec_hi = jnp.stack([f[1] for f in fields], -1)
    nxt = jnp.concatenate([sk[1:], jnp.full((1,), -1, I32)])
    is_last = (sk < S) & (sk != nxt)
    dst = jnp.where(is_last, sk, S)
    dep = S + (write_index[0] & 0x7F)   # >= S, so min() is a no-op on the values
    dst = jnp.minimum(dst, dep)
    rec = U.to_bytes(rec_lo[si], rec_hi[si])                   # [N, 32] in sorted order
    if canary.shape[1] == consts.CANARY_SLOT_BYTES:
        return canary.at[dst].set(rec, mode="drop")
    return canary.at[dst, : consts.CANARY_SLOT_BYTES].set(rec, mode="drop")


def write(canary, log, write_plan, input_ids, positions, out_cache_loc, *, tag: int,
          enable_write_input_assert: bool, expected_input_tokens, expected_input_positions,
          real_kv_sources: tuple, real_kv_hash_mode: int):
    """Pure-JAX write (format.md §7); arguments as ``ops.write`` normalised them. Returns
    ``(canary, log)``."""
    tag = int(tag)
    input_assert = bool(enable_write_input_assert)
    wp = write_plan
    S = int(canary.shape[0])
    N = int(input_ids.shape[0])
    srcs = _prep_sources(real_kv_sources, int(real_kv_hash_mode))

    kernel = _counter_add(log.kernel_run_counters, tag, 1)
    if N == 0:   # every range clamps to empty: only the kernel counter moves (§7.5)
        return canary, ViolationLog(log.ring, log.write_index, kernel, log.slot_run_counters,
                                    log.enable_chain_position_assert)

    req = _write_requests(canary, log, wp, N)
    ent = _write_entries(req, input_ids, positions, out_cache_loc, S)
    sk, si, writer, conflict = _writers_by_slot(req, ent, out_cache_loc, S)
    loop_refs = (canary, log, wp, input_ids, positions, out_cache_loc)
    running, expected = _write_chain(req, ent, writer, conflict, input_ids, positions, out_cache_loc, loop_refs)
    all_f = _write_checks(req, ent, running, expected, srcs, input_ids, positions, out_cache_loc, input_assert,
                          expected_input_tokens, expected_input_positions, S)
    counts = sum(m.astype(I32) for m in all_f["masks"])
    written = jnp.sum(all_f["nonskip"], dtype=I32)
    ring, write_index = _append(log, counts, _write_row_builder(all_f, req.seeds, tag, S))

    rkv = _write_fingerprints(srcs, all_f, N)
    canary = _store_records(canary, sk, si, (ent.tok, ent.pos, running, rkv), write_index)
    slot_ctr = _counter_add(log.slot_run_counters, tag, written)
    return canary, ViolationLog(ring=ring, write_index=write_index, kernel_run_counters=kernel,
                                slot_run_counters=slot_ctr,
                                enable_chain_position_assert=log.enable_chain_position_assert)


# ---- PLAN (format.md §9) -----------------------------------------------------------------------------

def plan(req_pool_indices, prefix_lens, extend_seq_lens, req_to_token, *, verify_capacity: int,
         write_req_capacity: int, swa_window_size: int, full_to_swa_index_mapping,
         req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens,
         kv_token_id_vs_position_offset: int, row_starts=None, report_evicted_in_window=False):
    x64 = U.x64_enabled()
    D = jnp.int64 if x64 else I32
    dmax = 2**63 - 1 if x64 else INT32_MAX
    Vc = int(verify_capacity)
    Wc = int(write_req_capacity)
    W = int(swa_window_size)
    off = int(kv_token_id_vs_position_offset)
    lut = full_to_swa_index_mapping
    pool = req_to_verify_expected_tokens
    vlens = req_to_verify_expected_tokens_valid_lens

    bs = int(req_pool_indices.shape[0])
    rp = req_pool_indices.astype(D)
    P = prefix_lens.astype(D)
    E = extend_seq_lens.astype(D)
    live = rp != consts.REQ_POOL_IDX_PADDING
    starts = None if row_starts is None else row_starts.astype(D)

    def rt(start, rpv, pos):
        """The slot of ``pos`` for the batch rows of ``start`` (their row_starts) and ``rpv``."""
        if starts is not None:  # the flat table [N], read at start + pos
            N = int(req_to_token.shape[0])
            if N == 0:
                return jnp.full(pos.shape, -1, D)
            # A wrapping int64 sum with x64 on. With x64 off both terms are int32 and only pos >= 0
            # is read, so the sum wraps exactly when it is >= 2**31 (> N), and then to a negative
            # value: the range check below rejects it either way.
            idx = start + pos
            ok = (pos >= 0) & (idx >= 0) & (idx < N)
            return jnp.where(ok, req_to_token[jnp.clip(idx, 0, N - 1)].astype(D), -1)
        R, L = (int(d) for d in req_to_token.shape)
        if R == 0 or L == 0:
            return jnp.full(pos.shape, -1, D)
        ok = (rpv >= 0) & (rpv < R) & (pos >= 0) & (pos < L)
        v = req_to_token[jnp.clip(rpv, 0, R - 1), jnp.clip(pos, 0, L - 1)].astype(D)
        return jnp.where(ok, v, -1)

    def T(x):
        if lut is None:
            return x
        n = int(lut.shape[0])
        ok = (x >= 0) & (x < n)
        return jnp.where(ok, lut[jnp.clip(x, 0, n - 1)].astype(D), -1)

    # int64 wrap-around semantics (format.md §9.3; the native core uses add_wrap/sub_wrap). With x64 off
    # the inputs are int32 and the guarded forms below equal the int64 results exactly.
    if W > 0:
        if x64:
            d = P - jnp.asarray(min(W, dmax), D)
            ws = jnp.where(d > 0, d, 0)
        elif W >= INT32_MAX:
            ws = jnp.zeros_like(P)
        else:
            ws = jnp.where(P > W, P - W, 0)
    else:
        ws = jnp.zeros_like(P)
    span = P - ws
    vlen = jnp.where(live & (span > 0), span, 0)
    wlen = jnp.where(live & (E > 0), E, 0)
    seed = jnp.where(live & (P > 0) & (wlen > 0), T(rt(starts, rp, P - 1)), -1)

    # write plan
    offsets = jnp.zeros((Wc + 1,), I32)
    seeds_out = jnp.zeros((Wc,), I32)
    if bs:
        offsets = offsets.at[1:bs + 1].set(_i32(jnp.cumsum(wlen, dtype=D)))
        seeds_out = seeds_out.at[:bs].set(_i32(seed))
    write_plan = WritePlan(offsets=offsets, seed_slot_indices=seeds_out,
                           num_valid_reqs=jnp.full((1,), bs, I32))

    # verify plan: saturating inclusive scan of the lengths (cap Vc + 1), binary search per entry
    zeros_v = jnp.zeros((Vc,), I32)
    if bs == 0:
        vplan = VerifyPlan(slot_indices=zeros_v, expected_tokens=zeros_v, expected_positions=zeros_v,
                           prev_slot_indices=zeros_v, num_valid=jnp.zeros((1,), I32),
                           enable=jnp.ones((1,), I32))
        return vplan, write_plan
    cap1 = Vc + 1                                      # <= 2**31: fits uint32, sums never wrap
    vl_u = jnp.minimum(lax.convert_element_type(jnp.clip(vlen, 0, min(cap1, dmax)), U32), np.uint32(cap1))

    def sat_add(a, b):
        return jnp.where(a > np.uint32(cap1) - b, np.uint32(cap1), a + b)

    incl = lax.associative_scan(sat_add, vl_u)
    total_sat = incl[-1]
    if x64:
        total = jnp.sum(vlen, dtype=jnp.int64)         # wrapping, as the native loop
        enable = total <= Vc
        num_valid = jnp.minimum(total, Vc)
    else:
        enable = total_sat <= np.uint32(Vc)
        num_valid = jnp.minimum(total_sat, np.uint32(Vc))
    e = jnp.arange(Vc, dtype=U32)
    filled = enable & ((e.astype(jnp.int64) < total) if x64 else (e < total_sat))
    r = jnp.clip(_searchsorted(incl, e, "right"), 0, bs - 1)
    j = lax.convert_element_type(e - (incl[r] - vl_u[r]), D)
    rpr = rp[r]
    sr = None if starts is None else starts[r]
    pos = ws[r] + j
    full = rt(sr, rpr, pos)
    slot = T(full)
    if report_evicted_in_window:                       # evicted while the window reads it: -1
        slot = jnp.where((slot == 0) & (full > 0), -1, slot)
    prev = jnp.where(pos > 0, T(rt(sr, rpr, pos - 1)), -1)
    if pool is not None:
        Rp, Cp = (int(d) for d in pool.shape)
        s = pos + jnp.asarray(off, D)
        vl = vlens.astype(D)[r]
        ok = (s >= 0) & (s < vl) & (s < Cp) & (rpr >= 0) & (rpr < Rp)
        if Rp == 0 or Cp == 0:
            tok = jnp.full(pos.shape, -1, D)
        else:
            tok = jnp.where(ok, pool[jnp.clip(rpr, 0, Rp - 1), jnp.clip(s, 0, Cp - 1)].astype(D), -1)
    else:
        tok = jnp.full(pos.shape, -1, D)

    def out(x):
        return jnp.where(filled, _i32(x), 0)

    vplan = VerifyPlan(slot_indices=out(slot), expected_tokens=out(tok), expected_positions=out(pos),
                       prev_slot_indices=out(prev),
                       num_valid=_i32(num_valid).reshape(1), enable=enable.astype(I32).reshape(1))
    return vplan, write_plan


# ---- scatter_req_token_ids (format.md §9.5) ----------------------------------------------------------

def scatter_req_token_ids(pool, flat_ids, offsets, req_pool_indices):
    x64 = U.x64_enabled()
    D = jnp.int64 if x64 else I32
    Rp, Cp = (int(d) for d in pool.shape)
    bs = int(req_pool_indices.shape[0])
    total = int(flat_ids.shape[0])
    if bs == 0 or Rp == 0 or Cp == 0 or total == 0:
        return pool
    start = offsets[:bs].astype(D)
    end = offsets[1:bs + 1].astype(D)
    rp = req_pool_indices.astype(D)
    if x64:
        n = jnp.minimum(end - start, Cp)               # wrap-around, as the native core
    else:
        diff = lax.bitcast_convert_type(end, U32) - lax.bitcast_convert_type(start, U32)
        n = jnp.where(end > start, _i32(jnp.minimum(diff, np.uint32(Cp))), 0)
    ok = (n > 0) & (rp >= 0) & (rp < Rp)
    c = _iota(Cp)[None, :]
    src = start[:, None] + c.astype(D)                 # wraps only when the true value is >= 2**31
    cell = ok[:, None] & (c < n[:, None]) & (src >= 0) & (src < total)
    # later row wins: per group of rows sharing a pool row, the max r that writes each column
    r = _iota(bs)
    srt = jnp.sort(rp)
    grp = _searchsorted(srt, rp, "left")
    cand = jnp.where(cell, r[:, None], -1)
    win = jnp.full((bs, Cp), -1, I32).at[jnp.broadcast_to(grp[:, None], (bs, Cp)),
                                          jnp.broadcast_to(c, (bs, Cp))].max(cand)
    is_win = cell & (win[grp] == r[:, None])
    vals = flat_ids[jnp.clip(src, 0, total - 1)].astype(pool.dtype)
    dst_r = jnp.where(is_win, _i32(jnp.clip(rp, 0, Rp - 1))[:, None], Rp)
    return pool.at[dst_r, jnp.broadcast_to(c, (bs, Cp))].set(vals, mode="drop")
