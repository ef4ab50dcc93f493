"""The toy serving engine: scheduler, jitted steps with the canary, sweeps, faults, overhead replay.

One ``iterate()`` is one serving step:

Faults are injected by ``faults.FaultInjectorMixin``; the jitted functions live in ``steps``; the
optional offload tier (``EngineConfig.offload``) in ``hosttier``.

1. schedule (host): admit arrivals (prefix-cache match; with the offload tier, offloaded matched
   nodes are reloaded first), give each running request a prefill
   chunk or one decode token, allocate slots (and SWA slots + LUT entries), fill ``req_to_token``;
2. the jitted, donated step: canary HEAD -> model forward (writes K/V) -> canary TAIL;
3. read the sampled tokens (the scheduler needs them), append outputs, cache finished prompts
   (remapping duplicate slots to the cached donor slot), free finished requests, evict SWA slots
   that left every window; with the offload tier, move cold cached nodes to the host;
4. every ``sweep_interval`` steps a SWEEP of the prefix cache;
5. ``monitor.step(state)``: lagged readback of the canary (reports step T's rows after step T+1).

Shapes are static (batch rows, tokens, tables and pools are padded to fixed sizes), so each
jitted function compiles once.
"""

from __future__ import annotations

import dataclasses
import time
from typing import List

import jax
import jax.numpy as jnp
import numpy as np

from ..runtime.config import CanaryConfig
from ..runtime.endpoints import CanaryEndpoints, set_chain_position_assert
from ..runtime.monitor import Monitor
from ..runtime.multidevice import device_mesh, replicate, shard_leading, stack_for_devices
from ..runtime.sweep import build_group_sweep_plans
from . import model as M
from . import steps
from .faults import FaultInjectorMixin
from .hosttier import HostTier
from .kvpool import PrefixCache, SlotAllocator
from .workload import Request, make_workload


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static sizes of the toy engine. ``devices > 1`` splits attention heads (and so each
    layer's KV) over that many devices; each device has its own canary state and ring.
    ``offload`` adds the host offload tier (one device, canary on)."""

    requests: int = 8
    batch_rows: int = 8
    token_budget: int = 64
    chunk_size: int = 16
    max_seq_len: int = 64
    page_size: int = 16
    swa: bool = True
    swa_window: int = 16
    devices: int = 1
    seed: int = 0
    vocab: int = 256
    offload: bool = False


class ToyEngine(FaultInjectorMixin):
    """Serves ``make_workload(cfg.requests)`` with the canary configured by ``canary``."""

    def __init__(self, cfg: EngineConfig, canary: CanaryConfig, *, record: bool = False,
                 logger=None):
        self.cfg, self.canary = cfg, canary
        self.requests = make_workload(cfg.requests, vocab=cfg.vocab, max_seq_len=cfg.max_seq_len,
                                      seed=cfg.seed)
        self.mcfg = M.ModelConfig(vocab=cfg.vocab, layers=("full", "swa") if cfg.swa else ("full", "full"),
                                  swa_window=cfg.swa_window, page_size=cfg.page_size,
                                  max_seq_len=cfg.max_seq_len, tp=cfg.devices)
        need = sum(len(r.prompt) + r.max_new for r in self.requests) + cfg.page_size
        self.num_slots = -(-need // cfg.page_size) * cfg.page_size
        self.R = cfg.batch_rows + 2                 # row 0 = padding, row R-1 = warm-up row
        self.L = cfg.max_seq_len
        self.alloc = SlotAllocator(self.num_slots)
        self.swa_alloc = SlotAllocator(self.num_slots)
        self.cache = PrefixCache()
        self.req_to_token = np.zeros((self.R, self.L), np.int32)
        self.token_table = np.zeros((self.R, self.L), np.int32)
        self.lut = np.zeros((self.num_slots,), np.int32)
        self.slot_pos = {}                          # live full slot -> position it holds
        self.free_rows = list(range(self.R - 2, 0, -1))
        self.waiting: List[Request] = list(self.requests)
        self.running: List[Request] = []
        self.step_no = 0
        self.tokens_prefill = self.tokens_decode = self.tokens_cached = self.remaps = 0
        self.sweeps = self.sweep_entries = 0
        self.record = record
        self.trace = []                             # (device batch, sweep plans or None) per step
        self.fault = None                           # (step, Fault) once injected
        self._armed = None                          # (kind, step, group, device)
        self._rng = np.random.default_rng(cfg.seed + 1)

        self.groups = ("FULL", "SWA") if cfg.swa else ("FULL",)
        self.endpoints = CanaryEndpoints(
            canary, num_slots=self.num_slots, write_req_capacity=cfg.batch_rows,
            verify_capacity=cfg.batch_rows * self.L, swa_num_slots=self.num_slots,
            swa_verify_capacity=cfg.batch_rows * cfg.swa_window)
        self.mesh = device_mesh(cfg.devices) if cfg.devices > 1 else None
        rep, sh = M.init_params(self.mcfg, cfg.seed)
        self.rep, self.sh = self._place_params(rep, sh)
        self.kv = self._fresh_kv()
        self.cstate = self._fresh_canary() if canary.enabled else None
        self.step_on = self._build_step(canary.enabled)
        self.step_off = self._build_step(False)
        self.sweep_fn = self._build_sweep() if canary.enabled else None
        self.monitor = Monitor.from_config(canary, logger=logger) if canary.enabled else None
        if cfg.offload and (cfg.devices != 1 or not canary.enabled):
            raise ValueError("toy engine: the offload tier needs one device and the canary on")
        self.tier = HostTier(self) if cfg.offload else None
        self._host_found = []                       # violations the host checks reported this step

    # -- placement ------------------------------------------------------------------------------
    def _place_params(self, rep, sh):
        if self.mesh is None:
            return (jax.tree.map(jnp.asarray, rep), jax.tree.map(lambda x: jnp.asarray(x[0]), sh))
        return replicate(rep, self.mesh), shard_leading(sh, self.mesh)

    def _fresh_kv(self):
        kv = M.init_kv(self.mcfg, self.num_slots, self.num_slots)
        return kv if self.mesh is None else stack_for_devices(kv, self.mesh)

    def _fresh_canary(self):
        st = self.endpoints.init_state()
        return st if self.mesh is None else stack_for_devices(st, self.mesh)

    def _device_batch(self, b):
        arrs = {k: jnp.asarray(v) for k, v in b.items()}
        return arrs if self.mesh is None else replicate(arrs, self.mesh)

    # -- jitted functions (shared by engines of the same static shape: compile once) --------
    def _build_step(self, on: bool):
        return steps.step_fn(self.mcfg, steps.step_key(self.canary), on, self._endpoint_sizes(),
                             self.cfg.devices)

    def _build_sweep(self):
        return steps.sweep_fn(self.mcfg, steps.step_key(self.canary), self._endpoint_sizes(),
                              self.cfg.devices)

    def _endpoint_sizes(self):
        return (self.num_slots, self.cfg.batch_rows, self.cfg.batch_rows * self.L,
                self.cfg.batch_rows * self.cfg.swa_window)

    # -- warm-up --------------------------------------------------------------------------------
    def warmup_batch(self):
        """A synthetic batch (row R-1 -> slot 0 only, prefix 4, synthetic positions): compiles the
        step; only the padding slot 0 is touched."""
        b = self._empty_batch()
        B = self.cfg.batch_rows
        b["req_pool_indices"][0], b["prefix_lens"][0], b["extend_seq_lens"][0] = self.R - 1, 4, 4
        b["input_ids"][:4] = [1, 2, 3, 4]
        b["expected_input_tokens"][:4] = [1, 2, 3, 4]
        b["positions"][:4] = b["expected_input_positions"][:4] = np.arange(4, 8)
        b["token_rp"][:4] = self.R - 1
        b["last_index"][:B] = 3
        b["token_valid_lens"][0] = 8
        return b

    def warmup(self, chain_assert_during_warmup: bool = False):
        """Compile and run both steps on the warm-up batch. The chain-position assert is off while
        warming up (the synthetic positions break its +1 rule) and on afterwards; it is a buffer,
        so switching it does not recompile."""
        db = self._device_batch(self.warmup_batch())
        if self.cstate is not None:
            self.cstate = set_chain_position_assert(self.cstate, chain_assert_during_warmup)
            self.kv, self.cstate, nt = self.step_on(self.rep, self.sh, self.kv, self.cstate, db)
            self.cstate = set_chain_position_assert(self.cstate, True)
        self.kv, _, nt = self.step_off(self.rep, self.sh, self.kv, None, db)
        jax.block_until_ready((self.kv, self.cstate, nt))

    # -- scheduling -----------------------------------------------------------------------------
    def _empty_batch(self):
        """A padded batch (int32 numpy): rows ``[B]`` (req_pool_indices, prefix_lens,
        extend_seq_lens, last_index, token_valid_lens), tokens ``[N]`` (input_ids, positions,
        out_cache_loc, token_rp, expected_input_tokens/positions), tables (req_to_token, lut,
        token_pool)."""
        B, N = self.cfg.batch_rows, self.cfg.token_budget
        z = lambda n: np.zeros((n,), np.int32)  # noqa: E731
        return {"req_pool_indices": z(B), "prefix_lens": z(B), "extend_seq_lens": z(B),
                "input_ids": z(N), "positions": z(N), "out_cache_loc": z(N), "token_rp": z(N),
                "last_index": z(B), "expected_input_tokens": z(N), "expected_input_positions": z(N),
                "req_to_token": self.req_to_token.copy(), "lut": self.lut.copy(),
                "token_pool": self.token_table.copy(), "token_valid_lens": z(B)}

    def _admit(self):
        while (self.waiting and self.waiting[0].arrival <= self.step_no
               and len(self.running) < self.cfg.batch_rows and self.free_rows):
            req = self.waiting[0]
            nodes = self.cache.match(req.prompt[:-1])
            offloaded = [n for n in nodes if n.host_slot is not None]
            need = len(req.prompt) + req.max_new - len(nodes) + len(offloaded)
            if self.alloc.num_free < need or self.swa_alloc.num_free < need:
                break
            self.waiting.pop(0)
            if offloaded:
                self._host_found += self.tier.reload(offloaded)
            req.rp = self.free_rows.pop()
            for n in nodes:
                n.ref += 1
            req.nodes = list(nodes)
            req.slots = [n.slot for n in nodes]
            req.kv_len = req.cached_tokens = len(nodes)
            self.req_to_token[req.rp, :len(nodes)] = req.slots
            self.token_table[req.rp, :len(nodes)] = req.prompt[:len(nodes)]
            self.tokens_cached += len(nodes)
            self.running.append(req)

    def schedule(self):
        """Build this step's batch: ``(rows, batch)`` with ``rows = [(req, P, E)]``."""
        self._admit()
        budget = self.cfg.token_budget
        ext = {}
        for r in self.running:                      # decode tokens first, then prefill chunks
            if r.prefilled:
                ext[r.rid] = 1
                budget -= 1
        for r in self.running:
            if not r.prefilled:
                e = min(self.cfg.chunk_size, len(r.prompt) - r.kv_len, budget)
                if e > 0:
                    ext[r.rid] = e
                    budget -= e
        rows, off = [], 0
        tok_arrays = []
        for r in self.running:
            e = ext.get(r.rid, 0)
            if e == 0:
                continue
            p = r.kv_len
            new = self.alloc.alloc(e)
            if self.cfg.swa:
                self.lut[new] = self.swa_alloc.alloc(e)
            if r.prefilled:
                toks, truth = [r.pending], [r.oracle]
            else:
                toks = truth = r.prompt[p:p + e]
            r.slots.extend(new)
            r.own.update(new)
            self.req_to_token[r.rp, p:p + e] = new
            self.token_table[r.rp, p:p + e] = toks
            for i, s in enumerate(new):
                self.slot_pos[s] = p + i
            tok_arrays.append((r, p, e, off, new, toks, truth))
            rows.append((r, p, e))
            off += e
        b = self._empty_batch()
        for i, (r, p, e, o, new, toks, truth) in enumerate(tok_arrays):
            b["req_pool_indices"][i], b["prefix_lens"][i], b["extend_seq_lens"][i] = r.rp, p, e
            b["last_index"][i] = o + e - 1
            b["token_valid_lens"][i] = p + e
            sl = slice(o, o + e)
            b["input_ids"][sl], b["expected_input_tokens"][sl] = toks, truth
            b["positions"][sl] = b["expected_input_positions"][sl] = np.arange(p, p + e)
            b["out_cache_loc"][sl], b["token_rp"][sl] = new, r.rp
            if r.prefilled:
                self.tokens_decode += e
            else:
                self.tokens_prefill += e
        return rows, b

    # -- after the step -------------------------------------------------------------------------
    def _free_full(self, slots):
        slots = [int(s) for s in slots]
        if self.cfg.swa:
            sw = [int(self.lut[s]) for s in slots if self.lut[s] != 0]
            self.swa_alloc.free(sw)
            self.lut[slots] = 0
        for s in slots:
            self.slot_pos.pop(s, None)
        self.alloc.free(slots)

    def _cache_prompt(self, r: Request):
        n_prompt = len(r.prompt)
        nodes = self.cache.insert(r.prompt, r.slots[:n_prompt])
        held = {id(n) for n in r.nodes}
        for p, n in enumerate(nodes):
            if id(n) not in held:
                n.ref += 1
            mine = r.slots[p]
            if n.host_slot is not None:             # the equal node is offloaded: it takes this slot
                self.tier.adopt(n, mine)
                r.own.discard(mine)
            elif n.slot != mine:                    # an equal slot is cached: remap to the donor
                r.slots[p] = n.slot
                self.req_to_token[r.rp, p] = n.slot
                r.own.discard(mine)
                self._free_full([mine])
                self.remaps += 1
            else:
                r.own.discard(mine)                 # the cache owns it now
        r.nodes = nodes

    def _finish(self, r: Request):
        for n in r.nodes:
            n.ref -= 1
        self._free_full(sorted(r.own))
        r.own.clear()
        self.req_to_token[r.rp] = 0
        self.token_table[r.rp] = 0
        self.free_rows.append(r.rp)
        self.running.remove(r)
        r.done = True

    def _evict_swa(self):
        if not self.cfg.swa:
            return
        for r in self.running:
            upto = r.kv_len - self.cfg.swa_window   # positions < upto left every future window
            for p in range(r.swa_evicted, max(upto, r.swa_evicted)):
                s = r.slots[p]
                if s in r.own and self.lut[s] != 0:
                    self.swa_alloc.free([int(self.lut[s])])
                    self.lut[s] = 0
            r.swa_evicted = max(r.swa_evicted, upto)

    def postprocess(self, rows, tokens, truth):
        for i, (r, p, e) in enumerate(rows):
            was_prefilled = r.prefilled
            r.kv_len = p + e
            if not r.prefilled:
                continue
            if not was_prefilled:
                self._cache_prompt(r)
            r.outputs.append(int(tokens[i]))
            r.pending, r.oracle = int(tokens[i]), int(truth[i])
            if len(r.outputs) >= r.max_new:
                self._finish(r)
        self._evict_swa()

    # -- one serving step -----------------------------------------------------------------------
    def iterate(self):
        """One serving step; returns the violations the monitor (and the offload tier's host
        checks) reported after it."""
        self.step_no += 1
        self._host_found = []
        rows, b = self.schedule()
        self._inject_pre(rows, b)
        db = self._device_batch(b)
        self.kv, cs, nt = self.step_on(self.rep, self.sh, self.kv, self.cstate, db)
        self.cstate = cs
        self._inject_post_forward(rows)
        truth = np.asarray(nt).copy()               # the scheduler needs the sampled tokens
        tokens = self._inject_post_sample(rows, truth.copy())
        self.postprocess(rows, tokens, truth)
        if self.tier is not None:
            self._host_found += self.tier.offload_cold()
        plans = None
        si = self.canary.sweep_interval if self.canary.enabled else 0
        if si and self.step_no % si == 0:
            self._inject_pre_sweep()
            chains = self.cache.chains()
            plans = build_group_sweep_plans(chains, self.groups, lut=self.lut if self.cfg.swa else None)
            if self.mesh is not None:
                plans = replicate(plans, self.mesh)
            self.cstate = self.sweep_fn(self.kv, self.cstate, plans)
            self.sweeps += 1
            self.sweep_entries += len(chains)
        if self.record:
            self.trace.append((db, plans))
        if self.monitor is None:
            return []
        return self._host_found + self.monitor.step(self.cstate)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    # -- overhead -------------------------------------------------------------------------------
    def measure_overhead(self, rounds: int = 2):
        """Replay the recorded steps with a fresh cache through the canary-off and the canary-on
        step (plus its sweeps), interleaved, timing each call to completion. Returns per-step
        ``(on_seconds, off_seconds)`` arrays (the minimum over ``rounds``)."""
        if not self.trace or self.cstate is None:
            raise RuntimeError("measure_overhead needs a recorded run (record=True) with the canary on")
        n = len(self.trace)
        on, off = np.full(n, np.inf), np.full(n, np.inf)
        for _ in range(rounds):
            kv_off, kv_on, cs = self._fresh_kv(), self._fresh_kv(), self._fresh_canary()
            for i, (db, plans) in enumerate(self.trace):
                t0 = time.perf_counter()
                kv_off, _, nt = self.step_off(self.rep, self.sh, kv_off, None, db)
                nt.block_until_ready()
                t1 = time.perf_counter()
                kv_on, cs, nt = self.step_on(self.rep, self.sh, kv_on, cs, db)
                if plans is not None:
                    cs = self.sweep_fn(kv_on, cs, plans)
                jax.block_until_ready((nt, cs))
                t2 = time.perf_counter()
                off[i], on[i] = min(off[i], t1 - t0), min(on[i], t2 - t1)
        return on, off
