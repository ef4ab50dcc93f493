"""Faults planted in a live sglang-jax server, to see the canary report them (a testing aid).

``--kv-canary-inject KIND --kv-canary-inject-step N`` (``launch_server``) damages sglang-jax's
own structures once, at the first batch from the ``N``-th on that has a target, and logs
``kv-canary: injected KIND at step S: ...``. The report follows in the server log within two steps
(upstream's ``kv_canary violation: ...`` line). Kinds:

- ``req_to_token_swap``: two prefix entries of a request's ``req_to_token`` row swapped (scheduler
  thread, before the batch's page table is built): attention reads them crosswise;
  ``verify_position`` + ``verify_chain_hash`` at HEAD.
- ``slot_double_free``: a slot of a running request's cached prefix put back at the head of the
  allocator's free list (its last free entry dropped, so that the free count sglang-jax checks
  when idle stays balanced); the next allocation takes it while the prefix still uses it:
  ``verify_position`` + ``verify_chain_hash`` when the request reads its prefix again.
- ``real_kv_used``: one byte of layer 0's K bytes of a slot a running request attends to flipped
  (forward thread, before the step): ``verify_real_kv_hash`` at TAIL.
- ``real_kv_unused_cache``: the same in a slot the prefix cache holds that no running request uses:
  ``verify_real_kv_hash`` at SWEEP (needs ``--kv-canary-sweep-interval``).
- ``wrong_position``: the position of a request's token fed to the forward off by one:
  ``write_position`` at HEAD and TAIL.
- ``cache_loc_off_by_one``: one entry of the step's page table (``forward_batch.cache_loc``) points
  at the next slot: attention reads the wrong slot; ``verify_position`` at HEAD and TAIL.
- ``future_token_ring_wrap``: in a DECODE step of two or more requests, batch row 0's input
  token replaced by another row's (a different token): a request's next input token taken from
  another request's, the effect of sglang-jax's future-token ring wrapping around (its #1487).
  The KV records alone cannot see it (the token the forward consumed is the one written); the
  write-input assert does: ``write_token`` at HEAD and TAIL (needs
  ``--kv-canary-write-input-assert``).

- ``hicache_reload_swap`` (HiCache): the first load back of two or more pages from the host tier
  scatters two pages' KV into each other's device pages, while the load's page list (and the
  records, which follow it) say otherwise: the request reading the prefix reads the wrong KV at
  those positions; ``verify_real_kv_hash`` at TAIL on both slots.
- ``hicache_stale_page`` (HiCache): the first load back of two or more pages leaves the second
  page's device slots as they were (the engine skips its scatter, yet points the prefix at them),
  while its records are imported: ``verify_real_kv_hash`` at TAIL on that page's slots in the
  step that reads the prefix.
- ``hicache_host_flip`` (HiCache): one byte of layer 0's K of the first page backed up to the host
  flipped in the host copy (a copy damaged in transit): ``verify_real_kv_hash`` at
  ``HOST_BACKUP_K_FULL`` (the host check, logged at once) naming the device slot
  the page was copied from; if the page is loaded back later, also at TAIL in the step that reads
  it.
- ``hicache_revive_free`` (HiCache): the device pages of the first load back of two or more
  pages put back on the allocator's free list right after the load, while the radix tree and the
  request that asked for them still use them (the class of sglang-jax #1618, where the slots a
  revived node adopted were freed): the next allocations write other KV and records there;
  ``verify_position`` (and chain, fingerprint) on those slots in the step that reads the prefix.
  As with the real bug, sglang-jax's own idle-time memory check then finds the pages counted
  twice and ends the server at its first idle moment.

- ``pd_zero_slot`` (PD decode server): the first transferred request with two or more prompt
  tokens has its position-1 slot of layer 0's KV left all zeros after the engine writes the
  pulled KV (as in SGLang #38586): ``verify_real_kv_hash`` at TAIL on that slot in the first
  decode step of the request.
- ``pd_page_shift`` (PD decode server): the pulled KV of the first transferred request is written
  one page past the slots the decode server allocated for it (the records go where the page list
  says): the request's prompt slots hold other KV; ``verify_real_kv_hash`` at TAIL on them in its
  first decode step.
- ``pd_early_reuse`` (PD decode server): the slots of the second transferred request also receive
  the KV of the first, after its own (a transfer finishing into pages the decode server had
  already reused, as in SGLang #24527): ``verify_real_kv_hash`` at TAIL on the overwritten
  prompt slots in its first decode step.

- ``swa_evicted_in_window`` (hybrid SWA pool): in a DECODE step, the full-to-SWA map entry of batch
  row 0's last prefix position (inside its sliding window) set to 0, as if the engine had evicted
  the SWA KV attention still reads (the class of sglang-jax #1355 / SGLang #30845): attention
  reads the SWA pool's padding slot there; ``index_out_of_range`` (slot -1, the plan's
  ``report_evicted_in_window``) at HEAD and TAIL of the SWA group. The entry is put back at the
  next step, so the engine frees that SWA slot as usual.
- ``swa_map_stale`` (hybrid SWA pool): in a DECODE step, the same map entry pointed at the SWA slot
  of the position before it (a stale full-to-SWA mapping, SGLang #25385): attention reads the
  other position's sliding-window KV; ``verify_position`` + ``verify_chain_hash`` at HEAD and TAIL
  of the SWA group. Put back at the next step too.

``--kv-canary-inject-group DRAFT`` (EAGLE / EAGLE3) aims two kinds at the draft model's pool,
before a draft step (step = the draft canary's step count), the target's KV and ``req_to_token``
intact: ``real_kv_used`` flips byte 0 of the draft's layer-0 KV of batch row 0's position 0
(``verify_real_kv_hash`` at ``TAIL_K_FULL`` in the draft canary's report, ``draft model:``);
``req_to_token_swap`` swaps batch row 0's first two pages in the draft step's page table (the
draft's view of ``req_to_token``: the ``fa`` metadata its kernel reads), so the draft reads its
positions 0 and one page on crosswise (``verify_position`` + ``verify_chain_hash`` at HEAD and
TAIL). Two kinds always aim there, each changing one entry of a draft step's page table:

- ``draft_pool_short``: batch row 0's first page pointed past the end of the draft pool (the class
  of sglang-jax #1066, a draft pool smaller than the slot range the target hands out): the step
  reads there; ``index_out_of_range`` at HEAD and TAIL.
- ``spec_rejected_foreign_write`` (page size 1): in a DRAFT_EXTEND of two or more requests, the
  slot of batch row 0's last entry (a rejected draft token's, in the usual case) replaced by batch
  row 1's last prefix slot, so the kernel writes row 0's draft KV into row 1's prefix (sglang-jax
  #1063, where a rejected token's ``accept_index`` of -1 did so): ``verify_position`` +
  ``verify_chain_hash`` on that slot when row 1 reads it, in the same step.

``spec_accept_overcount`` (needs ``--kv-canary-token-check``) changes a target verify's result:
the first batch row that rejected a draft token commits one token more than it verified, so the
position of its first rejected draft token is committed while its KV still holds that draft
token, and the request holds the target's token there; ``verify_token`` when the request's next
verify reads it (the slot's record is the rejected token's own: only the token check sees it).

``--kv-canary-inject-group SWA`` (a hybrid SWA pool) aims the existing kinds at the SWA group:
``real_kv_used`` flips byte 0 of the SWA slot of batch row 0's last prefix position in the first
sliding layer's KV (``verify_real_kv_hash`` at ``TAIL_K_SWA``; the FULL group intact);
``slot_double_free`` puts the SWA slot of a running request's position ``n - 2`` back at the head
of the SWA allocator's free list (``verify_position`` on the SWA group once the next allocation
takes it; the FULL group intact); ``req_to_token_swap`` swaps positions ``n - 3`` and ``n - 2``
and ``cache_loc_off_by_one`` moves the entry of batch row 0's last prefix position, inside the
window, so both groups read them crosswise (``verify_position`` on both); ``wrong_position`` and
``future_token_ring_wrap`` damage the token both groups record (``write_position`` /
``write_token`` on both). ``real_kv_unused_cache`` is refused with it (the SWA group is not
swept), and so are the HiCache and PD kinds (refused with the SWA pool). The ``swa_*`` kinds
always aim at the SWA group.

Scheduler-side kinds run in the scheduler's thread before a batch is launched (step = the batch's
launch count); forward-side kinds run where the forward runs, right before the step (step = the
canary's step count). After precompile both count from 1.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from typing import Optional

import jax
import numpy as np

from .canary import LOGGER, radix_chains
from .layout import batch_lengths, step_arrays, token_table
from .request_guard import section_on_host
from .speculative import first_positions

SCHEDULER_KINDS = ("req_to_token_swap", "slot_double_free", "real_kv_unused_cache")
FORWARD_KINDS = ("real_kv_used", "wrong_position", "cache_loc_off_by_one",
                 "future_token_ring_wrap")
#: kinds planted in the HiCache host pool's copies (need --hicache-storage none)
HICACHE_KINDS = ("hicache_reload_swap", "hicache_stale_page", "hicache_host_flip",
                 "hicache_revive_free")
#: kinds planted in a PD decode server's receive (need --disaggregation-mode decode)
PD_KINDS = ("pd_zero_slot", "pd_page_shift", "pd_early_reuse")
#: kinds planted in a hybrid SWA pool's full-to-SWA map (need an SWAKVPool)
SWA_KINDS = ("swa_evicted_in_window", "swa_map_stale")
#: kinds planted in an EAGLE draft model's page table (need --speculative-algorithm)
DRAFT_KINDS = ("draft_pool_short", "spec_rejected_foreign_write")
#: kinds planted in a speculative verify's result (need --speculative-algorithm; found by the
#: token check)
VERIFY_KINDS = ("spec_accept_overcount",)
KINDS = (SCHEDULER_KINDS + FORWARD_KINDS + HICACHE_KINDS + PD_KINDS + SWA_KINDS + DRAFT_KINDS
         + VERIFY_KINDS)
#: kinds found by the write-input assert only
TOKEN_KINDS = ("future_token_ring_wrap",)
#: groups a fault can be aimed at (``--kv-canary-inject-group``): DRAFT is an EAGLE draft
#: model's pool (``speculative``)
GROUPS = ("FULL", "SWA", "DRAFT")
#: kinds that cannot be aimed at the SWA group
NOT_ON_SWA = ("real_kv_unused_cache",) + HICACHE_KINDS + PD_KINDS + DRAFT_KINDS + VERIFY_KINDS
#: kinds that can be aimed at an EAGLE draft model's pool
ON_DRAFT = ("real_kv_used", "req_to_token_swap") + DRAFT_KINDS
#: kinds that change a draft step's page table there (``_plant_in_draft_pages``)
DRAFT_PAGE_KINDS = ("req_to_token_swap",) + DRAFT_KINDS


@dataclasses.dataclass(frozen=True)
class InjectSpec:
    """One fault: its ``kind`` (one of ``KINDS``), the first ``step`` (>= 1) it may go in at, and
    the ``group`` it is aimed at (``FULL``, ``SWA`` with a hybrid SWA pool, ``DRAFT`` the draft
    model's pool with EAGLE) and, on a server of several nodes, the ``node`` whose devices' KV it
    changes (``real_kv_used``: the other nodes' schedulers plant nothing)."""

    kind: str
    step: int = 8
    group: str = "FULL"
    node: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kv-canary: --kv-canary-inject must be one of {', '.join(KINDS)}, "
                             f"got {self.kind!r}")
        if int(self.step) < 1:
            raise ValueError(f"kv-canary: --kv-canary-inject-step must be >= 1, got {self.step}")
        if self.group not in GROUPS:
            raise ValueError(f"kv-canary: --kv-canary-inject-group must be one of "
                             f"{', '.join(GROUPS)}, got {self.group!r}")
        if self.group == "SWA" and self.kind in NOT_ON_SWA:
            raise ValueError(f"kv-canary: --kv-canary-inject {self.kind} cannot be aimed at the "
                             "SWA group (--kv-canary-inject-group SWA): "
                             + ("the SWA group is not swept" if self.kind == "real_kv_unused_cache"
                                else "it is planted in speculative decoding"
                                if self.kind in DRAFT_KINDS + VERIFY_KINDS
                                else "HiCache and PD are refused with a hybrid SWA pool"))
        if self.group == "DRAFT" and self.kind not in ON_DRAFT:
            raise ValueError(f"kv-canary: --kv-canary-inject {self.kind} cannot be aimed at the "
                             f"draft model's pool (--kv-canary-inject-group DRAFT): use "
                             f"{', '.join(ON_DRAFT)}")

    @property
    def on_swa(self) -> bool:
        """Whether the fault is aimed at the SWA group (the ``swa_*`` kinds always are)."""
        return self.group == "SWA" or self.kind in SWA_KINDS

    @property
    def on_draft(self) -> bool:
        """Whether the fault is aimed at an EAGLE draft model's pool (the ``DRAFT_KINDS``
        always are)."""
        return self.group == "DRAFT" or self.kind in DRAFT_KINDS


def add_inject_args(parser) -> None:
    """``--kv-canary-inject KIND`` and ``--kv-canary-inject-step N`` (a testing aid)."""
    g = parser.add_argument_group("kv-canary fault injection (testing aid)")
    g.add_argument("--kv-canary-inject", choices=KINDS, default=None, metavar="KIND",
                   help=f"plant one fault in the live server: {', '.join(KINDS)}")
    g.add_argument("--kv-canary-inject-step", type=int, default=8, metavar="N",
                   help="at the first batch from the N-th on that has a target (default 8)")
    g.add_argument("--kv-canary-inject-group", choices=GROUPS, default="FULL",
                   help="the group the fault is aimed at: FULL (default), SWA (a hybrid SWA "
                        "pool's sliding layers) or DRAFT (the EAGLE draft model's pool)")
    g.add_argument("--kv-canary-inject-node", type=int, default=0, metavar="R",
                   help="with --nnodes above 1: the node whose devices' KV real_kv_used changes "
                        "(default 0)")


def spec_from_args(ns) -> Optional[InjectSpec]:
    kind = getattr(ns, "kv_canary_inject", None)
    return None if kind is None else InjectSpec(kind, int(getattr(ns, "kv_canary_inject_step", 8)),
                                                getattr(ns, "kv_canary_inject_group", "FULL"),
                                                int(getattr(ns, "kv_canary_inject_node", 0)))


def _running(batch):
    """``[(req, seq_len)]`` of the live requests of a ScheduleBatch, in batch order."""
    out = []
    for info in getattr(batch, "reqs_info", None) or [batch]:
        reqs = getattr(info, "reqs", None) or []
        lens = getattr(info, "seq_lens", None)
        if lens is None:
            continue
        out.extend((r, int(n)) for r, n in zip(reqs, np.asarray(lens)))
    return out


def _edit_kv_row(layout, slot: int, edit, group: str = "FULL", node: int = 0) -> bool:
    """Apply ``edit`` to ``slot``'s token row of ``group``'s fingerprinted layer (layer 0 without
    SWA), as bytes (every K and V head). When the buffer spans several processes' devices, only
    process ``node`` edits, its own shards (their heads); returns whether this process edited."""
    kv = layout.kv(group)
    if getattr(kv, "is_fully_addressable", True):
        arr = np.array(kv)
        edit(arr.reshape(layout.geometries[group].num_slots, -1).view(np.uint8)[slot])
        layout.set_kv(jax.device_put(arr, kv.sharding), group)
        return True
    if jax.process_index() != node:
        return False
    page_size, blocks = layout.page_size, []
    for shard in kv.addressable_shards:
        arr = np.array(shard.data)
        at = slot - int(shard.index[0].start or 0) * page_size   # the shard's own token rows
        if 0 <= at < arr.shape[0] * page_size:
            edit(arr.reshape(arr.shape[0] * page_size, -1).view(np.uint8)[at])
        blocks.append(jax.device_put(arr, shard.device))
    layout.set_kv(jax.make_array_from_single_device_arrays(kv.shape, kv.sharding, blocks), group)
    return True


def _flip_byte(layout, slot: int, group: str = "FULL", node: int = 0) -> bool:
    """XOR the first byte of ``slot``'s token row (K head 0) of ``group``'s fingerprinted layer
    with 0xFF (``_edit_kv_row``); returns whether this process changed it."""
    return _edit_kv_row(layout, slot, lambda row: row.__setitem__(0, row[0] ^ 0xFF), group, node)


def _zero_slot(layout, slot: int) -> None:
    """Zero ``slot``'s token row of layer 0's KV (every K and V head)."""
    _edit_kv_row(layout, slot, lambda row: row.fill(0))


def _free_in_use(alloc, pages) -> None:
    """Put ``pages`` (page ids; slots at page size 1) back at the head of the allocator's free
    list while they are in use. As many free entries are dropped from its tail, so that the free
    count stays what sglang-jax's own idle-time memory check expects (else it ends the server)."""
    attr = "free_slots" if getattr(alloc, "free_slots", None) is not None else "free_pages"
    free = getattr(alloc, attr)[0]
    getattr(alloc, attr)[0] = np.concatenate([np.asarray(pages, free.dtype),
                                              free[:len(free) - len(pages)]])


def _replace(array, values):
    return jax.device_put(np.asarray(values, dtype=array.dtype), array.sharding)


class FaultInjector:
    """Plants ``spec`` once into the server of ``canary`` (installed by ``install_into_scheduler``
    on ``scheduler``): register ``before_launch`` and ``before_step`` as the canary's hooks."""

    def __init__(self, spec: InjectSpec, canary, scheduler, logger: Optional[logging.Logger] = None):
        if spec.kind == "real_kv_unused_cache" and not canary.config.sweep_interval:
            raise ValueError("kv-canary: --kv-canary-inject real_kv_unused_cache needs "
                             "--kv-canary-sweep-interval N > 0 (the fault is found by a sweep)")
        if spec.kind in TOKEN_KINDS and not canary.config.write_input_assert:
            raise ValueError(f"kv-canary: --kv-canary-inject {spec.kind} needs "
                             "--kv-canary-write-input-assert (the fault is found by it)")
        self.spec = spec
        self.canary = canary
        self.scheduler = scheduler
        self.logger = logger or LOGGER
        if spec.kind == "spec_rejected_foreign_write" and canary.layout.page_size != 1:
            raise ValueError("kv-canary: --kv-canary-inject spec_rejected_foreign_write needs "
                             "--page-size 1 (it moves one slot of a draft step's page table)")
        if spec.on_swa and "SWA" not in canary.layout.groups:
            what = spec.kind if spec.kind in SWA_KINDS else f"{spec.kind} on the SWA group"
            raise ValueError(f"kv-canary: --kv-canary-inject {what} needs a hybrid SWA pool "
                             "(a sliding-window model without --disable-hybrid-swa-memory)")
        self.done = False
        self._queued_slot = None             # real_kv_unused_cache: chosen here, flipped there
        self._restore = None                 # SWA kinds: (full slot, planted, original) map entry
        if spec.kind in HICACHE_KINDS:
            self._hook_host_pool(getattr(getattr(scheduler, "tree_cache", None), "host_pool",
                                         None))
        if spec.kind in PD_KINDS:
            self._hook_receive(scheduler)
        if spec.kind in VERIFY_KINDS:
            if not canary.config.token_check:
                raise ValueError(f"kv-canary: --kv-canary-inject {spec.kind} needs "
                                 "--kv-canary-token-check (the fault is found by it)")
            self._hook_verify(scheduler.draft_worker)

    def _log(self, step: int, what: str) -> None:
        self.done = True
        self.logger.warning("kv-canary: injected %s at step %d: %s", self.spec.kind, step, what)

    # -- scheduler thread -------------------------------------------------------------------------
    def before_launch(self, batch) -> None:
        """Scheduler-side kinds, before ``batch`` is launched (its page table not yet built)."""
        step = self.canary.launches
        if self.done or self.spec.kind not in SCHEDULER_KINDS or step < self.spec.step:
            return
        if self._queued_slot is not None:
            return
        rtt = self.scheduler.req_to_token_pool.req_to_token
        swa = self.spec.on_swa
        if self.spec.kind == "req_to_token_swap":
            for req, n in _running(batch):
                if n >= 3:
                    row, (a, b) = req.req_pool_idx, ((n - 3, n - 2) if swa else (0, 1))
                    rtt[row, [a, b]] = rtt[row, [b, a]]
                    self._log(step, f"req_to_token[{row}, {a}:{b + 1}] swapped (slots "
                                    f"{rtt[row, b]}, {rtt[row, a]}), request {req.rid}")
                    return
        elif self.spec.kind == "slot_double_free":
            alloc = self.scheduler.token_to_kv_pool_allocator
            for req, n in _running(batch):
                if n < 3:
                    continue
                if not swa:
                    slot = int(rtt[req.req_pool_idx, 0])
                    _free_in_use(alloc, [slot // int(getattr(alloc, "page_size", 1))])
                    self._log(step, f"slot {slot} (position 0 of request {req.rid}, in the prefix "
                                    "cache) put back at the head of the free list")
                    return
                full = int(rtt[req.req_pool_idx, n - 2])
                slot = int(self.canary.layout.swa_map()[full])
                if slot > 0:
                    swa_alloc = alloc.swa_attn_allocator
                    _free_in_use(swa_alloc, [slot // int(getattr(swa_alloc, "page_size", 1))])
                    self._log(step, f"SWA slot {slot} (position {n - 2} of request {req.rid}, "
                                    "inside its window) put back at the head of the SWA free list")
                    return
        elif self.spec.kind == "real_kv_unused_cache":
            used = set()
            for req, n in _running(batch):
                used.update(int(s) for s in rtt[req.req_pool_idx, :n])
            for slot in radix_chains(self.canary.tree_cache)[0][:, 0]:
                if int(slot) > 0 and int(slot) not in used:
                    self._queued_slot = (step, int(slot))
                    return

    # -- forward thread -------------------------------------------------------------------------
    def before_step(self, forward_batch) -> None:
        """Forward-side kinds (and the queued KV flip), right before the canary's step."""
        if self._restore is not None:                     # an SWA map entry planted last step
            full, planted, original = self._restore
            swa_map = self.canary.layout.swa_map()
            if int(swa_map[full]) == planted:
                swa_map[full] = original
            self._restore = None
        if self.done:
            return
        step = self.canary.steps
        layout = self.canary.layout
        if self._queued_slot is not None:
            chosen, slot = self._queued_slot
            _flip_byte(layout, slot)
            self._log(chosen, f"flipped byte 0 of slot {slot} in layer 0's KV (cached by the "
                              "prefix cache, used by no running request)")
            return
        if self.spec.kind in SWA_KINDS and step >= self.spec.step:
            self._plant_in_swa_map(step, forward_batch)
            return
        if self.spec.on_draft and self.spec.kind in DRAFT_PAGE_KINDS and step >= self.spec.step:
            self._plant_in_draft_pages(step, forward_batch)
            return
        if self.spec.kind not in FORWARD_KINDS or step < self.spec.step:
            return
        fb = forward_batch
        # batch row 0 is rank 0's first row (data-parallel attention: rank 0's section; on
        # several nodes every process reads it, and --kv-canary-inject-node plants it)
        host = lambda a: section_on_host(a, 0, self.canary.dp).astype(np.int64)
        draft = self.canary.draft                 # an EAGLE draft model's canary
        arrays = step_arrays(fb, from_attention=draft)   # as the canary plans the step
        _, seq, prefixes, _ = batch_lengths(
            arrays, decode=not draft and bool(fb.forward_mode.is_decode()), get=host, xp=np)
        if seq.shape[0] == 0 or seq[0] < 3:
            return                                        # batch row 0 has no prefix to damage
        prefix = int(prefixes[0])
        loc = np.array(token_table(arrays, layout.page_size, host, np))
        # the position aimed at: 0 / 1, or with the SWA group the last prefix position (inside
        # the window; batch row 0's segment of cache_loc starts at 0)
        swa = self.spec.on_swa
        if self.spec.kind == "real_kv_used":
            if prefix < 1:
                return                                    # position 0 is written by this step
            pos = prefix - 1 if swa else 0
            slot = int(layout.swa_map()[int(loc[pos])]) if swa else int(loc[pos])
            if slot <= 0:
                return
            if not _flip_byte(layout, slot, "SWA" if swa else "FULL", self.spec.node):
                self.done = True                          # another node's scheduler plants it
                return
            self._log(step, f"flipped byte 0 of {'SWA ' if swa else ''}slot {slot} (position "
                            f"{pos} of batch row 0) in "
                            + ("the first sliding layer's KV" if swa else
                               "the draft model's layer 0 KV" if draft else "layer 0's KV"))
        elif self.spec.kind == "wrong_position":
            pos = np.array(fb.positions)
            pos[0] += 1
            fb.positions = _replace(fb.positions, pos)
            self._log(step, f"position of the first token fed to the forward set to {pos[0]} "
                            f"(was {pos[0] - 1})")
        elif self.spec.kind == "cache_loc_off_by_one":
            pos = prefix - 1 if swa else 1
            if pos < 1:
                return                                    # no prefix position in the window
            loc[pos] += 1
            fb.cache_loc = _replace(fb.cache_loc, loc)
            self._log(step, f"cache_loc entry of batch row 0, position {pos} set to slot "
                            f"{loc[pos]} (was {loc[pos] - 1})")
        elif self.spec.kind == "future_token_ring_wrap":
            if not fb.forward_mode.is_decode():
                return
            ids = np.array(fb.input_ids)
            rows = np.asarray(fb.req_pool_indices)
            other = [j for j in range(1, min(len(ids), len(rows), len(seq)))
                     if rows[j] >= 0 and seq[j] > 0 and ids[j] != ids[0]]
            if not other:
                return                                    # no other request's token differs
            was, ids[0] = ids[0], ids[other[0]]
            fb.input_ids = _replace(fb.input_ids, ids)
            slot = int(np.asarray(fb.out_cache_loc)[0])
            self._log(step, f"input token of batch row 0 (pool row {rows[0]}, written to slot "
                            f"{slot}) set to {ids[0]}, the token of batch row {other[0]} (pool "
                            f"row {rows[other[0]]}); it was {was}")

    def _plant_in_draft_pages(self, step: int, fb) -> None:
        """``draft_pool_short`` / ``spec_rejected_foreign_write`` / ``req_to_token_swap``: one
        or two entries of the draft step's page table (its ``fa`` metadata, which the kernel and
        the canary read) changed."""
        md = fb.attn_backend.forward_metadata
        host = lambda a: np.asarray(a).astype(np.int64)
        live, seq, prefix, _ = batch_lengths(step_arrays(fb, from_attention=True), decode=False,
                                             get=host, xp=np)
        starts, pages = host(md.cu_kv_lens)[:-1], np.array(md.page_indices)
        ps = self.canary.layout.page_size
        if self.spec.kind == "req_to_token_swap":
            if not live[0] or prefix[0] < 2 * ps:
                return                                    # batch row 0 reads < 2 prefix pages
            at = int(starts[0]) // ps
            pages[[at, at + 1]] = pages[[at + 1, at]]
            what = (f"batch row 0's pages {pages[at + 1]} and {pages[at]} (its positions 0 and "
                    f"{ps}) swapped in the draft step's page table")
        elif self.spec.kind == "draft_pool_short":
            if not live[0] or prefix[0] < 1:
                return                                    # batch row 0 reads no prefix here
            past = -(-self.canary.num_slots // ps)
            at = int(starts[0]) // ps
            was, pages[at] = int(pages[at]), past
            what = (f"batch row 0's first page {was} pointed at page {past}, past the draft "
                    f"pool's {self.canary.num_slots} slots")
        else:
            if (not fb.forward_mode.is_draft_extend() or live.sum() < 2 or not live[1]
                    or prefix[1] < 1):
                return                                    # no second request's prefix here
            last, victim = int(starts[0] + seq[0] - 1), int(starts[1] + prefix[1] - 1)
            was, pages[last] = int(pages[last]), int(pages[victim])
            what = (f"batch row 0's last draft token (KV position {int(seq[0]) - 1}) written to "
                    f"slot {pages[last]} (was {was}), batch row 1's prefix position "
                    f"{int(prefix[1]) - 1}")
        md.page_indices = _replace(md.page_indices, pages)
        self._log(step, what)

    def _plant_in_swa_map(self, step: int, fb) -> None:
        """``swa_evicted_in_window`` / ``swa_map_stale``: batch row 0's last prefix position."""
        seq = np.asarray(fb.seq_lens)
        if (not fb.forward_mode.is_decode() or seq.shape[0] == 0 or seq[0] < 3
                or int(np.asarray(fb.req_pool_indices)[0]) < 0):
            return
        loc = np.asarray(fb.cache_loc)
        full, before = int(loc[seq[0] - 2]), int(loc[seq[0] - 3])   # batch row 0 starts at 0
        swa_map = self.canary.layout.swa_map()
        original = int(swa_map[full])
        planted = 0 if self.spec.kind == "swa_evicted_in_window" else int(swa_map[before])
        if original == 0 or planted == original or (planted == 0) != (
                self.spec.kind == "swa_evicted_in_window"):
            return                                        # nothing there to damage
        swa_map[full] = planted
        self._restore = (full, planted, original)
        self._log(step, f"full_to_swa_index_mapping[{full}] (position {seq[0] - 2} of batch row "
                        f"0, inside its window) set to {planted} (was {original}; put back at the "
                        "next step)")

    # -- a speculative verify's result (the scheduler's thread) ----------------------------------
    def _hook_verify(self, worker) -> None:
        """``spec_accept_overcount``: after a verify from the step on, the first batch row that
        rejected a draft token commits that token as if accepted, then the target's token one
        position later (its ``accept_lens`` one more, its tokens shifted): the KV of the rejected
        token stays at a position the request now holds it at, which the target never verified.
        The canary's record of the verify (``speculative.record_verified_tokens``) is taken
        before this, as the verify returned it."""
        verify = worker.verify
        draft_tokens = int(worker.speculative_num_draft_tokens)

        def verify_overcounted(model_worker_batch, *args, **kwargs):
            out = verify(model_worker_batch, *args, **kwargs)
            step = self.canary.steps
            if self.done or step < self.spec.step:
                return out
            rp = np.asarray(model_worker_batch.req_pool_indices)
            lens, ids = np.array(out.accept_lens), np.array(out.next_token_ids)
            rows = [r for r in range(min(len(rp), len(lens)))
                    if rp[r] >= 0 and 0 < lens[r] < draft_tokens]
            if not rows:
                return out
            r = rows[0]
            a, at = int(lens[r]), r * draft_tokens + int(lens[r])
            drafted = int(np.asarray(model_worker_batch.input_ids)[at])   # the verify's input
            position = int(first_positions(model_worker_batch.positions, len(lens))[r]) + a
            ids[at], ids[at - 1] = ids[at - 1], drafted
            lens[r] += 1
            out.accept_lens, out.next_token_ids = lens, ids
            self._log(step, f"batch row {r} (pool row {rp[r]}) commits its rejected draft token "
                            f"{drafted} at position {position}, where the target verified "
                            f"{ids[at]} (accept length {a} -> {a + 1})")
            return out

        worker.verify = verify_overcounted

    # -- the HiCache host pool (the scheduler's thread and the engine's D2H worker) --------------
    def _hook_host_pool(self, pool) -> None:
        """Wrap the engine's own copies (inside the canary's wrappers of ``hicache``)."""
        if pool is None:
            raise ValueError(f"kv-canary: --kv-canary-inject {self.spec.kind} needs HiCache "
                             "(--hicache-storage none)")
        if self.spec.kind in ("hicache_reload_swap", "hicache_stale_page"):
            flush_load = pool.flush_load

            def flush_load_damaged(host_buffer_ids, device_indices):
                step = self.canary.launches
                ids, pages = list(host_buffer_ids), list(device_indices)
                if self.done or step < self.spec.step or len(pages) < 2:
                    return flush_load(ids, pages)
                if self.spec.kind == "hicache_reload_swap":
                    pages[0], pages[1] = pages[1], pages[0]
                    self._log(step, f"the KV of host pages {ids[0]} and {ids[1]} scattered into "
                                    f"each other's device pages ({int(pages[1])}, "
                                    f"{int(pages[0])})")
                    return flush_load(ids, pages)
                self._log(step, f"host page {ids[1]} not scattered: device page "
                                f"{int(pages[1])} keeps its old KV")
                return flush_load(ids[:1] + ids[2:], pages[:1] + pages[2:])

            pool.flush_load = flush_load_damaged
        elif self.spec.kind == "hicache_revive_free":
            flush_load = pool.flush_load

            def flush_load_freed(host_buffer_ids, device_indices):
                out = flush_load(host_buffer_ids, device_indices)
                step = self.canary.launches
                pages = [int(p) for p in device_indices]
                if self.done or step < self.spec.step or len(pages) < 2:
                    return out
                _free_in_use(self.scheduler.token_to_kv_pool_allocator, pages)
                self._log(step, f"device pages {pages} of a load back put on the free list "
                                "while the radix tree serves them")
                return out

            pool.flush_load = flush_load_freed
        else:
            flush_backup = pool.flush_backup

            def flush_backup_flipped(host_buffer_ids):
                flush_backup(host_buffer_ids)
                step = self.canary.launches
                if self.done or step < self.spec.step or not host_buffer_ids:
                    return
                bid = int(host_buffer_ids[0])
                with pool._lock:
                    slot = pool._slots[bid]
                    if slot is None:
                        return
                    host = np.array(slot)
                    host[0].reshape(-1).view(np.uint8)[0] ^= 0xFF
                    pool._slots[bid] = jax.device_put(host, slot.sharding)
                self._log(step, f"flipped byte 0 of layer 0 in host page {bid} after its copy "
                                "from the device")

            pool.flush_backup = flush_backup_flipped

    # -- a PD decode server's receive (the scheduler's thread) -----------------------------------
    def _hook_receive(self, scheduler) -> None:
        """Wrap the engine's write of a pulled request's KV (the canary's ``pd`` wrapper, installed
        later, calls this one once it has taken its records off the pulled arrays)."""
        if getattr(scheduler.server_args, "disaggregation_mode", "null") != "decode":
            raise ValueError(f"kv-canary: --kv-canary-inject {self.spec.kind} needs a PD decode "
                             "server (--disaggregation-mode decode)")
        install = scheduler._install_received_kv
        earlier = []                                   # pd_early_reuse: (prompt, pulled KV)

        def install_damaged(req, kv_indices, kv):
            step = self.canary.launches
            prompt = list(req.origin_input_ids)
            if self.done or step < self.spec.step or len(prompt) < 2:
                return install(req, kv_indices, kv)
            indices = np.asarray(kv_indices)
            if self.spec.kind == "pd_page_shift":
                ps = int(self.canary.layout.page_size)
                last = int(indices[len(prompt) - 1])
                shift = ps if last + ps < self.canary.layout.geometry.num_slots else -ps
                install(req, indices + shift, kv)
                self._log(step, f"the pulled KV of request {req.rid} written one page off "
                                f"({shift:+d} slots) from its slots {int(indices[0])}..{last}")
                return
            install(req, kv_indices, kv)
            if self.spec.kind == "pd_zero_slot":
                slot = int(indices[1])
                _zero_slot(self.canary.layout, slot)
                self._log(step, f"slot {slot} (position 1 of request {req.rid}) left all zeros "
                                "in layer 0's KV after the transfer")
            elif not earlier:
                earlier.append((prompt, kv))
            else:
                first, first_kv = earlier[0]
                n = min(len(first), len(prompt))
                late = types.SimpleNamespace(rid=req.rid, origin_input_ids=first[:n])
                scheduler._write_kv_to_pool(late, kv_indices, first_kv)
                self._log(step, f"the KV of an earlier transfer written over slots "
                                f"{int(indices[0])}..{int(indices[n - 1])} of request {req.rid}")

        scheduler._install_received_kv = install_damaged
