"""``--kv-canary abort``: a violation ends only the requests that read the slots it names, those
slots leave the prefix cache, and the server keeps serving everyone else.

``RequestAborter`` is fed the canary's new violations (``on_violations``, from whichever thread
decoded the readback) and acts in the scheduler's own thread, right before the scheduler forms its
next batch (``before_schedule``, hooked on ``Scheduler.get_next_batch_to_run``), where its
requests and its radix tree are consistent:

1. every running request whose KV row (``req_to_token`` up to the KV it holds) contains a named
   slot gets sglang-jax's own abort, ``req.to_finish = FINISH_ABORT(message)``: the scheduler
   finishes it after its current step, frees its KV as for any finished request, and the HTTP
   client gets a finished response whose ``finish_reason`` is ``{"type": "abort", "message":
   "kv-canary: ..."}``;
2. a named slot stays quarantined until it is neither in a running request nor in the prefix
   cache: every radix-tree node holding it is evicted with its subtree (its tokens are recomputed
   by the next request that needs them) as soon as no request holds a lock on it. Eviction runs
   before the scheduler matches new requests against the tree, so a request that arrives after
   the abort never reuses a named slot.

A violation that names no running request (e.g. a prefix-cache sweep) only evicts.
"""

from __future__ import annotations

import logging
import threading
from typing import Dict, List, Sequence

import numpy as np

#: how many named slots one abort message lists
MESSAGE_SLOTS = 4


def running_requests(scheduler) -> List:
    """The unfinished requests of the scheduler's running batch and of the batch it launched last
    (as ``Scheduler.abort_request`` enumerates them)."""
    reqs, seen = [], set()
    for batch in (getattr(scheduler, "running_batch", None), getattr(scheduler, "cur_batch", None)):
        for info in getattr(batch, "reqs_info", None) or ():
            for req in info.reqs or ():
                if id(req) not in seen and not req.finished():
                    seen.add(id(req))
                    reqs.append(req)
    return reqs


def request_slots(req, req_to_token: np.ndarray) -> np.ndarray:
    """The KV slots a request holds: its ``req_to_token`` row up to the KV allocated to it."""
    if req.req_pool_idx is None:
        return np.zeros((0,), np.int64)
    n = max(int(getattr(req, "kv_allocated_len", 0) or 0), int(req.kv_committed_len or 0))
    return np.asarray(req_to_token[req.req_pool_idx, :min(n, req_to_token.shape[1])])


def tree_nodes_holding(tree_cache, slots: set) -> List:
    """The radix-tree nodes whose KV slots include one of ``slots`` (outermost first: a node's
    subtree is not listed again)."""
    out, stack = [], [tree_cache.root_node]
    while stack:
        node = stack.pop()
        for child in list(node.children.values()):
            val = child.value
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


class RequestAborter:
    """Aborts the requests a violation names and quarantines the named slots (module docstring).

    Args:
      scheduler: the sglang-jax ``Scheduler`` (its running batches, ``req_to_token_pool`` and
        ``tree_cache``).
      logger: where the aborts and evictions are logged.

    Attributes: ``quarantined`` (slot -> the report that named it), ``aborted`` (rids),
    ``evicted`` (slots freed from the prefix cache).
    """

    def __init__(self, scheduler, logger: logging.Logger):
        self.scheduler = scheduler
        self.logger = logger
        self.quarantined: Dict[int, str] = {}
        self.aborted: List[str] = []
        self.evicted = 0
        self._new: Dict[int, str] = {}
        self._lock = threading.Lock()

    def on_violations(self, violations: Sequence) -> None:
        """Note the slots of new violations (any thread); acted on by ``before_schedule``."""
        with self._lock:
            for v in violations:
                slot = int(v.slot)
                if slot > 0:                       # slot 0 is sglang-jax's padding slot
                    self._new.setdefault(slot, f"{v.tag_name} {'+'.join(v.reasons)}")

    def before_schedule(self) -> None:
        """Abort and evict (the scheduler's thread, before it forms a batch)."""
        with self._lock:
            new, self._new = self._new, {}
        for slot, why in new.items():
            self.quarantined.setdefault(slot, why)
        if not self.quarantined:
            return
        bad = set(self.quarantined)
        held = self._abort_running(bad)
        held |= self._evict(bad)
        for slot in bad - held:
            del self.quarantined[slot]

    def _abort_running(self, bad: set) -> set:
        """Abort the running requests holding a quarantined slot; returns the slots they hold."""
        from sgl_jax.srt.managers.schedule_batch import FINISH_ABORT

        table = self.scheduler.req_to_token_pool.req_to_token
        held = set()
        for req in running_requests(self.scheduler):
            hit = bad.intersection(request_slots(req, table).tolist())
            if not hit:
                continue
            held |= hit
            if req.to_finish is not None:
                continue
            named = sorted(hit)
            what = "KV slot(s) {} failed the KV-cache canary ({})".format(
                ", ".join(map(str, named[:MESSAGE_SLOTS]))
                + (f" and {len(named) - MESSAGE_SLOTS} more" if len(named) > MESSAGE_SLOTS else ""),
                self.quarantined[named[0]])
            req.to_finish = FINISH_ABORT(f"kv-canary: request aborted: its {what}; the server "
                                         "log has the report", None, "KVCanaryViolation")
            self.aborted.append(req.rid)
            self.logger.warning("kv-canary: aborting request rid=%s: its %s", req.rid, what)
        return held

    def _evict(self, bad: set) -> set:
        """Evict the unlocked radix-tree nodes holding a quarantined slot (and their subtrees);
        returns the slots still held by locked nodes."""
        tree = self.scheduler.tree_cache
        if getattr(tree, "root_node", None) is None:
            return set()
        held = set()
        for node in tree_nodes_holding(tree, bad):
            slots = bad.intersection(np.asarray(node.value).tolist())
            if node.lock_ref > 0:
                held |= slots
                continue
            n = evict_subtree(tree, node)
            self.evicted += n
            self.logger.warning("kv-canary: evicted %d cached token(s) holding slot(s) %s from "
                                "the prefix cache", n, ", ".join(map(str, sorted(slots))))
        return held


def install_aborter(scheduler, canary, logger: logging.Logger) -> RequestAborter:
    """Feed ``canary``'s violations to a ``RequestAborter`` acting before each of the scheduler's
    batches (``get_next_batch_to_run``); returns it."""
    aborter = RequestAborter(scheduler, logger)
    canary.violation_hooks.append(aborter.on_violations)
    get_next = scheduler.get_next_batch_to_run

    def get_next_batch_to_run(*args, **kwargs):
        aborter.before_schedule()
        return get_next(*args, **kwargs)

    scheduler.get_next_batch_to_run = get_next_batch_to_run
    return aborter

