"""The requests a violation concerns, named before their step's results are processed: in mode
``abort`` they end with an abort (and the slots named leave the prefix cache), in mode ``log``
each is named in the log.

The promise of mode ``abort``: a request whose KV a violation concerns never answers as if nothing
happened. Mode ``log`` names every such request once (``kv-canary: request rid=... read KV that
failed the canary ...``), so an operator knows which answers not to trust.

1. **Before a step's results are processed** (``SglangJaxCanary.gate``, hooked in front of the
   scheduler's ``process_batch_result``), the canary decodes what that step's launch found. So
   no request can finish, and no client get its answer, before the checks of every step it took
   part in have been read; and no rate limit, episode folding or readback lag of the log decides
   which rows reach the aborter (it gets every row).
2. **Each row names requests by what the step read and wrote** (``named_batch_rows``, from the
   step's own arrays, the ones its launch planned from): a verify row (slot ``s``, position ``p``)
   names the batch rows whose page-table segment holds ``s`` at ``p``; a write row names the
   batch row whose new token was written to ``s``; a sweep row (a cached slot) names the running
   requests whose ``req_to_token`` row holds ``s`` at ``p``. A request that merely shares a slot a
   row names, at another position (the row's reader had a wrong page table), is not aborted.
3. Every named request that has not finished gets sglang-jax's own abort,
   ``req.to_finish = FINISH_ABORT(message)``, before the step's results are processed (mode
   ``log``: one line naming it, the first time a row concerns it): it
   finishes there, its KV is freed as for any finished request, and the HTTP client gets a
   finished response whose ``finish_reason`` is ``{"type": "abort", "message": "kv-canary:
   ..."}``.
4. A step whose rows overflowed the ring (``Monitor.lost_steps``: rows counted, not kept): every
   live request of that step is aborted, since its lost rows could name any of them.
5. A named slot stays quarantined until it is neither in a running request nor in the prefix
   cache: every radix-tree node holding it is evicted with its subtree (its tokens are recomputed
   by the next request that needs them) as soon as no request holds a lock on it. Eviction runs
   before the scheduler matches new requests against the tree (``before_schedule``).
6. With data-parallel attention, slot ids are rank-local: a row of a device of rank ``r`` names
   requests of rank ``r`` only (from rank ``r``'s section of the step's arrays, ``rank_section``),
   and a slot is quarantined and evicted on its rank (``(dp_rank, slot)``).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ...consts import FailReason, IndexKind, LaunchTag
from .layout import (REPLICATED_ARRAYS, batch_lengths, entry_rows, row_starts, token_table,
                     written_slots)

#: how many named slots one abort message lists
MESSAGE_SLOTS = 4

_WRITE_BITS = int(FailReason.WRITE_TOKEN_MISMATCH | FailReason.WRITE_POSITION_MISMATCH)
_OUT_OF_RANGE = int(FailReason.INDEX_OUT_OF_RANGE)
_POSITION_BIT = int(FailReason.VERIFY_POSITION_MISMATCH)
_SWEEP_TAGS = (int(LaunchTag.SWEEP_K_FULL), int(LaunchTag.SWEEP_V_FULL))
_WRITE_INDEX_KINDS = (int(IndexKind.WRITE_SLOT), int(IndexKind.WRITE_SEED))
_VERIFY_INDEX_KINDS = (int(IndexKind.VERIFY_SLOT), int(IndexKind.VERIFY_PREV))
_SWA_TAGS = frozenset(int(t) for t in LaunchTag if t.name.endswith("_SWA"))


def swa_slots(lut: np.ndarray, full: np.ndarray, *, evicted: bool) -> np.ndarray:
    """Full-pool slots as the SWA group's plan addresses them: through the full-to-SWA map (-1
    outside it); with ``evicted``, a live slot the map sends to 0 is -1, as the plan's
    ``report_evicted_in_window`` makes it."""
    ok = (full >= 0) & (full < lut.shape[0])
    out = np.where(ok, lut[np.clip(full, 0, lut.shape[0] - 1)], -1)
    return np.where(evicted & (out == 0) & (full > 0), -1, out)


def dp_rank_of(obj) -> int:
    """The data-parallel rank of a request or a radix-tree key (its ``dp_rank``; 0 without data
    parallelism)."""
    rank = getattr(obj, "dp_rank", None)
    return 0 if rank is None else int(rank)


def rank_section(arrays: dict, rank: int, dp: int, replicated=()) -> dict:
    """Rank ``rank``'s section of a step's arrays, on the host (``section_on_host``): each
    array is ``dp`` equal sections, one per rank, as sglang-jax lays out a data-parallel batch
    (``dp`` 1: the whole array); ``replicated`` keys are kept whole."""
    out = {}
    for k, a in arrays.items():
        out[k] = a if a is None or k in replicated else section_on_host(a, rank, dp)
    return out


def section_on_host(a, rank: int, dp: int) -> np.ndarray:
    """Section ``rank`` of ``dp`` equal sections of ``a``'s first dimension, as numpy. An array
    that spans several processes' devices is gathered from all of them (a collective: every
    process calls this for the same arrays in the same order, which the canary's shared rows
    ensure, ``SglangJaxCanary._share_rows``)."""
    n = a.shape[0] // dp
    if getattr(a, "is_fully_addressable", True):
        host = np.asarray(a)
    else:
        from jax.experimental import multihost_utils

        host = np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return host[rank * n:(rank + 1) * n]


def running_requests(scheduler) -> List:
    """The unfinished requests of the scheduler's running batch and of the batch it launched last
    (as ``Scheduler.abort_request`` enumerates them)."""
    reqs, seen = [], set()
    for batch in (getattr(scheduler, "running_batch", None), getattr(scheduler, "cur_batch", None)):
        for req in batch_requests(batch):
            if id(req) not in seen and not req.finished():
                seen.add(id(req))
                reqs.append(req)
    return reqs


def _by_pool_row(reqs) -> dict:
    """``{pool row: request}`` of the unfinished requests among ``reqs`` (the first one per row)."""
    out = {}
    for req in reqs:
        if not req.finished() and req.req_pool_idx is not None:
            out.setdefault(int(req.req_pool_idx), req)
    return out


def batch_requests(batch) -> list:
    """The requests of an sglang-jax ``ScheduleBatch``, in batch order (main keeps them per
    data-parallel rank in ``reqs_info``, 0.0.2 in ``reqs``)."""
    return [req for info in getattr(batch, "reqs_info", None) or [batch]
            for req in getattr(info, "reqs", None) or []]


def request_slots(req, req_to_token: np.ndarray) -> np.ndarray:
    """The KV slots a request holds: its ``req_to_token`` row up to the KV allocated to it."""
    if req.req_pool_idx is None:
        return np.zeros((0,), np.int64)
    n = max(int(getattr(req, "kv_allocated_len", 0) or 0), int(req.kv_committed_len or 0))
    return np.asarray(req_to_token[req.req_pool_idx, :min(n, req_to_token.shape[1])])


def row_kind(row: np.ndarray) -> str:
    """``'sweep'``, ``'write'``, ``'verify'`` or ``'either'`` (an out-of-range row of a real-KV
    source, which write and verify both read): which of a launch's entries a ring row is about."""
    if int(row[0]) in _SWEEP_TAGS:
        return "sweep"
    bits = int(row[7])
    if bits == _OUT_OF_RANGE:
        kind = int(row[5])
        return ("write" if kind in _WRITE_INDEX_KINDS else
                "verify" if kind in _VERIFY_INDEX_KINDS else "either")
    return "write" if bits & _WRITE_BITS else "verify"


def read_at(row: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Which reads of a verify (or sweep) row's slot, at ``positions``, could have recorded it.
    An out-of-range row holds the position the read expected; a check row holds the slot's
    *stored* position (docs/format.md §8.3): reads at another position recorded it when it has
    ``verify_position``, reads at that position otherwise."""
    stored = int(row[2])
    if int(row[7]) == _OUT_OF_RANGE or not int(row[7]) & _POSITION_BIT:
        return positions == stored
    return positions != stored


def named_batch_rows(rows: np.ndarray, arrays: dict, *, decode: bool, page_size: int,
                     aligned: bool, swa_window: int = 0,
                     kv_positions: bool = False) -> Dict[int, List[int]]:
    """The batch rows a launch's ring rows name: ``{batch row: [indices into rows]}``; a row
    that names no batch row (a sweep row, or one whose slot no entry of the step has) is left out.
    A write row names the batch row whose entry wrote its slot with its position; a verify row
    the batch rows whose segment holds its slot at a position that could have recorded it
    (``read_at``). Two requests reading one slot at the same position are both named by a chain
    row of that slot, even if only one of them had a wrong predecessor.

    Args:
      rows: ``int64[k, 8]``, ring rows recorded by the launch.
      arrays: the step's arrays as the launch read them (``layout.step_arrays``; host or device).
      decode, page_size, aligned: as the launch planned them (``layout.page_table_batch``).
      swa_window: with a hybrid SWA pool (``arrays["swa_lut"]``), the window the SWA group
        verifies: its rows name SWA slots read in the last ``swa_window`` positions.
      kv_positions: the launch recorded each new token at the KV position it is written to (an
        EAGLE draft model's: ``layout.page_table_batch``), not at its input position.
    """
    host = lambda a: np.asarray(a).astype(np.int64)
    get = lambda k: None if arrays.get(k) is None else host(arrays[k])
    rp, lut = get("req_pool_indices"), get("swa_lut")
    live, seq, prefix, ext = batch_lengths(arrays, decode=decode, get=host, xp=np)
    loc = token_table(arrays, page_size, host, np)
    starts = np.asarray(row_starts(arrays, seq, page_size, aligned, host)).astype(np.int64)
    out = written_slots(arrays, loc, starts, live, prefix, host, np)
    pos = get("positions")
    if arrays.get("cu_q_lens") is not None:          # each token's row and KV position
        entry_row, at, _ = entry_rows(arrays, live, prefix, host, np)
        pos = at if kv_positions else pos
    else:
        entry_row = np.repeat(np.arange(rp.shape[0]), ext)[:out.shape[0]]
    out, pos = out[:entry_row.shape[0]], pos[:entry_row.shape[0]]
    group_slots = {False: (out, loc)}                # per group: written slots, page table
    if lut is not None:                               # the SWA group's rows name SWA slots
        group_slots[True] = (swa_slots(lut, out, evicted=False), swa_slots(lut, loc, evicted=True))
    named: Dict[int, List[int]] = {}
    for k, row in enumerate(np.asarray(rows, np.int64).reshape(-1, 8)):
        kind, slot, p = row_kind(row), int(row[1]), int(row[2])
        swa = lut is not None and int(row[0]) in _SWA_TAGS
        written, table = group_slots[swa]
        hit = set()
        if kind in ("write", "either"):
            hit.update(entry_row[(written == slot) & ((pos == p) | (kind == "either"))].tolist())
        if kind in ("verify", "either"):
            for r in np.flatnonzero(live):
                seg = table[starts[r]:starts[r] + seq[r]]
                at = np.flatnonzero(seg == slot)
                if swa:
                    at = at[at >= seq[r] - swa_window]
                if read_at(row, at).any():
                    hit.add(int(r))
        for r in hit:
            named.setdefault(int(r), []).append(k)
    return named


def node_slots(node):
    """The device KV slots of a radix-tree node: ``value`` of sglang-jax's ``RadixCache`` nodes;
    the full-attention component's value of its ``UnifiedRadixCache`` nodes (None for a
    tombstone whose KV is on the host only)."""
    if hasattr(node, "value"):
        return node.value
    from sgl_jax.srt.mem_cache.unified_cache_components.tree_component import (
        BASE_COMPONENT_TYPE)

    return node.component_data[BASE_COMPONENT_TYPE].value


def tree_nodes_holding(tree_cache, slots: set, rank: Optional[int] = None) -> List:
    """The radix-tree nodes whose KV slots include one of ``slots`` (outermost first: a node's
    subtree is not listed again); with ``rank``, only nodes of that data-parallel rank (their
    keys' ``dp_rank``: slot ids are rank-local)."""
    out, stack = [], [tree_cache.root_node]
    while stack:
        node = stack.pop()
        for child in list(node.children.values()):
            if rank is not None and dp_rank_of(child.key) != rank:
                continue
            val = node_slots(child)
            if val is not None and len(val) and not slots.isdisjoint(np.asarray(val).tolist()):
                out.append(child)
            else:
                stack.append(child)
    return out


def evict_subtree(tree_cache, node) -> int:
    """Free the KV of ``node`` and of everything below it and delete them from the radix tree (the
    tree's own ``_delete_leaf`` and allocator ``free``, leaves first); returns the slots freed.
    The caller checks ``node.lock_ref == 0`` (a locked descendant locks its ancestors)."""
    order, stack = [], [node]
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(n.children.values())
    freed = 0
    for n in reversed(order):                      # children before their parent
        dp = n.key.dp_rank if n.key is not None and n.key.dp_rank is not None else 0
        tree_cache.token_to_kv_pool_allocator.free(n.value, dp_rank=dp)
        freed += len(n.value)
        tree_cache._delete_leaf(n)
    return freed


def sglang_finish_abort(message: str):
    """sglang-jax's abort of a running request, carrying ``message`` to its client."""
    from sgl_jax.srt.managers.schedule_batch import FINISH_ABORT

    return FINISH_ABORT(message, None, "KVCanaryViolation")


def describe(violations: Sequence, pool: str = "", rank: Optional[int] = None) -> str:
    """``KV slot(s) 1, 2 ... failed the KV-cache canary (TAG reasons)`` for an abort message
    (``pool``: whose KV, e.g. ``draft model's ``; ``rank``: the data-parallel rank whose
    rank-local slots they are)."""
    slots = sorted({int(v.slot) for v in violations})
    first = violations[0]
    return pool + "KV slot(s) {}{} failed the KV-cache canary ({} {})".format(
        ", ".join(map(str, slots[:MESSAGE_SLOTS]))
        + (f" and {len(slots) - MESSAGE_SLOTS} more" if len(slots) > MESSAGE_SLOTS else ""),
        "" if rank is None else f" of dp_rank {rank}", first.tag_name, "+".join(first.reasons))


class RequestGuard:
    """Names the requests a violation concerns; aborts them and quarantines the named slots in
    mode ``abort`` (module docstring).

    Args:
      scheduler: the sglang-jax ``Scheduler`` (its running batches, ``req_to_token_pool`` and
        ``tree_cache``).
      canary: the ``SglangJaxCanary`` whose rows it acts on (its ``records`` and layout).
      logger: where the named requests, aborts and evictions are logged.
      abort: abort the named requests (mode ``abort``), else name them in the log (mode ``log``).
      finish_abort: makes the ``req.to_finish`` value of an abort from its message (default
        sglang-jax's ``FINISH_ABORT``).

    Attributes: ``named`` (rids named, in order), ``quarantined`` (``(dp_rank, slot)`` -> the
    report that named it), ``evicted`` (slots freed from the prefix cache).
    """

    def __init__(self, scheduler, canary, logger: logging.Logger, abort: bool,
                 finish_abort: Optional[Callable[[str], object]] = None):
        self.scheduler = scheduler
        self.finish_abort = finish_abort or sglang_finish_abort
        self.canary = canary
        self.logger = logger
        self.abort = bool(abort)
        self.quarantined: Dict[Tuple[int, int], str] = {}
        self.dp = int(getattr(canary, "dp", 1))
        self.named: List[str] = []
        self.evicted = 0
        self._rows: List = []                      # violations not yet acted on
        self._lost_seen = 0                        # Monitor.lost_steps already acted on
        self._named_rids = set()                   # mode log: rids already named
        self._pool = "draft model's " if getattr(canary, "draft", False) else ""
        self._lock = threading.Lock()

    def on_violations(self, violations: Sequence) -> None:
        """Keep new violations (any thread); acted on by ``after_gate``."""
        with self._lock:
            self._rows.extend(violations)

    def after_gate(self, batch, step: int) -> None:
        """The scheduler's thread, once the canary has decoded launch ``step`` (the launch of
        ``batch``) and before ``batch``'s results are processed: abort every request the rows of
        launches up to ``step`` name, and every request of a launch whose rows were lost."""
        if not self._rows and self._lost_seen == len(self.canary.monitor.lost_steps):
            return                                 # nothing to act on (most gates)
        with self._lock:
            due = [v for v in self._rows if (v.launch_step or 0) <= step]
            self._rows = [v for v in self._rows if (v.launch_step or 0) > step]
        lost = self.canary.monitor.lost_steps[self._lost_seen:]
        lost = [s for s in lost if s <= step]
        self._lost_seen += len(lost)
        if not due and not lost:
            return
        by_rp = _by_pool_row(batch_requests(batch) + running_requests(self.scheduler))
        if self.abort:
            for v in due:                          # full-pool slots (SWA rows name SWA slots,
                if v.slot > 0 and int(v.tag) not in _SWA_TAGS:   # which the tree does not hold)
                    self.quarantined.setdefault((self._rank(v), int(v.slot)),
                                                f"{v.tag_name} {'+'.join(v.reasons)}")
        for req, first, vs in self._named(due, by_rp):
            self._act(req, first, self._describe(vs))
        for s in lost:
            record = self.canary.records.get(s)
            rps = [] if record is None else section_on_host(
                record.arrays["req_pool_indices"], 0, 1).tolist()
            why = (f"step's violations overflowed the ring ({self.canary.monitor.rows_lost} rows "
                   "lost so far), so every request of that step is named")
            for rp in rps:
                if rp in by_rp:
                    self._act(by_rp[rp], s, why)

    def before_engine_error(self) -> None:
        """The engine's own error is ending the server (``SglangJaxCanary.report_before_engine_
        error`` has decoded the last launches): name in the log every request the rows not acted
        on yet name, in either mode (there is no answer left to abort)."""
        with self._lock:
            due, self._rows = self._rows, []
        for req, first, vs in self._named(due, _by_pool_row(running_requests(self.scheduler))):
            if req.rid not in self._named_rids:
                self._named_rids.add(req.rid)
                self.named.append(req.rid)
                self.logger.warning("kv-canary: request rid=%s read KV that failed the canary at "
                                    "step %d: its %s; the engine's own error ends the server "
                                    "before it answers", req.rid, first, self._describe(vs))

    def _rank(self, violation) -> int:
        """The data-parallel rank of the device that recorded ``violation``."""
        if self.dp == 1 or violation.device is None:
            return 0
        return int(violation.device) // int(self.canary.tp)

    def _describe(self, violations: Sequence) -> str:
        return describe(violations, self._pool,
                        self._rank(violations[0]) if self.dp > 1 else None)

    def _named(self, due: list, by_rp: dict) -> list:
        """``(request, first launch step, [violations])`` of each request the rows ``due`` name
        (``by_rp``: the candidate requests by pool row)."""
        named: Dict[int, list] = {}
        for s in sorted({v.launch_step or 0 for v in due}):
            self._name(s, [v for v in due if (v.launch_step or 0) == s], by_rp, named)
        return [(req, min(v.launch_step or 0 for v in vs), vs) for req, vs in named.values()]

    def _name(self, step: int, violations: list, by_rp: dict, named: dict) -> None:
        """Add the requests ``violations`` (rows of launch ``step``) name to ``named``
        (``id(req) -> (req, [violations])``)."""
        for rank in sorted({self._rank(v) for v in violations}):
            self._name_on_rank(step, rank, [v for v in violations if self._rank(v) == rank],
                               by_rp, named)

    def _name_on_rank(self, step: int, rank: int, violations: list, by_rp: dict,
                      named: dict) -> None:
        """``_name`` for the rows of one data-parallel rank's devices (rank-local slots)."""
        record = self.canary.records.get(step)
        layout = self.canary.layout
        sweep = [v for v in violations if row_kind(v.row) == "sweep"]
        rows = [v for v in violations if row_kind(v.row) != "sweep"]
        if rows and record is not None:
            arrays = rank_section(record.arrays, rank, self.dp, replicated=REPLICATED_ARRAYS)
            hits = named_batch_rows(np.stack([v.row for v in rows]), arrays,
                                    decode=record.decode, page_size=layout.page_size,
                                    aligned=layout.aligned_segments,
                                    swa_window=layout.swa_window,
                                    kv_positions=getattr(self.canary, "draft", False))
            rps = np.asarray(arrays["req_pool_indices"]).tolist()
            for r, ks in hits.items():
                req = by_rp.get(int(rps[r]))
                if req is not None:
                    named.setdefault(id(req), (req, []))[1].extend(rows[k] for k in ks)
        elif rows:                                 # the launch's arrays are no longer kept
            sweep += rows
        if sweep:
            table = self.scheduler.req_to_token_pool.req_to_token
            for req in by_rp.values():
                if dp_rank_of(req) != rank:
                    continue
                held = request_slots(req, table)
                hit = [v for v in sweep
                       if read_at(v.row, np.flatnonzero(held == v.slot)).any()]
                if hit:
                    named.setdefault(id(req), (req, []))[1].extend(hit)

    def _act(self, req, step: int, what: str) -> None:
        """Abort ``req`` (mode ``abort``) or name it in the log (mode ``log``), once. On a PD
        server the line says which side (``on the PD decode server``)."""
        transfer = getattr(self.canary, "transfer", None)
        side = f" on the PD {transfer.role} server" if transfer is not None else ""
        if not self.abort:
            if req.rid not in self._named_rids:
                self._named_rids.add(req.rid)
                self.named.append(req.rid)
                self.logger.warning("kv-canary: request rid=%s read KV that failed the canary at "
                                    "step %d%s: its %s; %s", req.rid, step, side, what,
                                    "the target's verify decided its tokens, but the engine's KV "
                                    "bookkeeping failed on its slots" if self._pool else
                                    "its answer may be wrong")
            return
        if req.to_finish is not None or req.finished():
            return
        req.to_finish = self.finish_abort(f"kv-canary: request aborted{side}: its {what}; the "
                                          "server log has the report")
        self.named.append(req.rid)
        self.logger.warning("kv-canary: aborting request rid=%s at step %d%s: its %s", req.rid,
                            step, side, what)

    def before_schedule(self) -> None:
        """Evict the quarantined slots from the prefix cache (the scheduler's thread, before it
        forms a batch); a slot stays quarantined while a running request or a locked radix-tree
        node still holds it."""
        if not self.quarantined:
            return
        bad = set(self.quarantined)
        table = self.scheduler.req_to_token_pool.req_to_token
        held = set()
        for req in running_requests(self.scheduler):
            rank = dp_rank_of(req)
            held |= bad.intersection((rank, s) for s in request_slots(req, table).tolist())
        for rank in sorted({r for r, _ in bad}):
            held |= {(rank, s) for s in self._evict({s for r, s in bad if r == rank}, rank)}
        for key in bad - held:
            del self.quarantined[key]

    def _evict(self, bad: set, rank: int) -> set:
        """Evict the unlocked radix-tree nodes of ``rank`` holding a quarantined slot of that rank
        (and their subtrees); returns the slots still held by locked nodes."""
        tree = self.scheduler.tree_cache
        if getattr(tree, "root_node", None) is None:
            return set()
        held = set()
        for node in tree_nodes_holding(tree, bad, rank if self.dp > 1 else None):
            slots = bad.intersection(np.asarray(node_slots(node)).tolist())
            if not hasattr(node, "value") or not hasattr(node, "lock_ref"):
                # sglang-jax's UnifiedRadixCache (HiCache) and SWARadixCache (hybrid SWA pool):
                # their nodes carry host copies, per-pool locks, tombstones and LRU lists the
                # canary does not unwind; the prefix stays cached, and every request that reads
                # it is checked (and aborted) like any other
                self.logger.warning("kv-canary: slot(s) %s stay in the prefix cache (a %s is not "
                                    "evicted by the canary); requests reading them are checked "
                                    "as any other", ", ".join(map(str, sorted(slots))),
                                    type(tree).__name__)
                continue
            if node.lock_ref > 0:
                held |= slots
                continue
            n = evict_subtree(tree, node)
            self.evicted += n
            self.logger.warning("kv-canary: evicted %d cached token(s) holding slot(s) %s%s "
                                "from the prefix cache", n, ", ".join(map(str, sorted(slots))),
                                f" of dp_rank {rank}" if self.dp > 1 else "")
        return held


def install_request_guard(scheduler, canary, logger: logging.Logger, abort: bool,
                          **kw) -> RequestGuard:
    """Feed ``canary``'s violations to a ``RequestGuard`` that acts at the canary's gate (before
    each batch's results are processed) and, in mode ``abort``, evicts before each of the
    scheduler's batches (``get_next_batch_to_run``); returns it (``kw``: ``RequestGuard``'s).
    Needs the scheduler gate of ``install_into_scheduler``."""
    if not canary.gated:
        raise ValueError("kv-canary: naming requests needs the canary installed into the "
                         "scheduler (install_into_scheduler), whose gate runs before each "
                         "batch's results")
    guard = RequestGuard(scheduler, canary, logger, abort, **kw)
    canary.violation_hooks.append(guard.on_violations)
    canary.gate_hooks.append(guard.after_gate)
    canary.end_hooks.append(guard.before_engine_error)
    if abort:
        get_next = scheduler.get_next_batch_to_run

        def get_next_batch_to_run(*args, **kwargs):
            guard.before_schedule()
            return get_next(*args, **kwargs)

        scheduler.get_next_batch_to_run = get_next_batch_to_run
    return guard
