"""The endpoint bundle: HEAD / TAIL / SWEEP canary launches inside the user's jitted step.

Usage inside a jitted, donated serving step (format.md §11)::

    state, ctx = endpoints.head(state, batch)          # plan, then verify + write per group / half
    kv = model_forward(...)                            # attention writes this step's K/V
    state = endpoints.tail(state, ctx, real_kv)        # verify + write with real-KV fingerprints

Everything here is pure JAX (no callbacks, no host reads). The state is threaded as a value, so a
step that donates it updates every canary buffer in place.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import consts
from ..consts import RealKvHashMode
from ..inputs import RealKvSource, VerifyPlan, WritePlan
from ..state import ViolationLog, new_canary_buffer
from .config import CanaryConfig, launch_tag


def _kvc():
    import jax_kvcanary as kvc  # late: the ops module registers FFI targets on import
    return kvc


@jax.tree_util.register_pytree_node_class
class CanaryState:
    """All device-side canary state of one serving engine (one device).

      canaries   dict: HEAD/TAIL tag name (e.g. 'TAIL_K_SWA') -> uint8[num_slots_g, stride]
      log        ViolationLog shared by every launch
      written    uint32[num_tags, 2]: slots written per tag, as (lo, hi) words of a u64
                 (runtime statistics; verified = slot_runs - written)
    """

    def __init__(self, canaries, log, written):
        self.canaries = canaries
        self.log = log
        self.written = written

    def tree_flatten(self):
        return (self.canaries, self.log, self.written), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        del aux
        return cls(*children)

    def replace(self, **kw) -> "CanaryState":
        d = dict(canaries=self.canaries, log=self.log, written=self.written)
        d.update(kw)
        return CanaryState(**d)

    def __repr__(self):
        return f"CanaryState(canaries={sorted(self.canaries)}, log={self.log!r})"


class CanaryBatch(NamedTuple):
    """The step's batch metadata, as the engine has it (int32 or int64 arrays).

      req_pool_indices   [B]      pool row per batch row; 0 = padding row
      prefix_lens        [B]      tokens already in the KV cache
      extend_seq_lens    [B]      tokens written this step
      req_to_token       [R, L]   full-pool slot of (pool row, position); or, with
                                  ``req_to_token_row_starts``, the step's flat page table [T]
      input_ids          [N]      token per flat entry (rows concatenated in batch order)
      positions          [N]      position per flat entry
      out_cache_loc      [N]      full-pool slot written per flat entry
      full_to_swa_index_mapping  [S_full] or None   full slot -> SWA slot (0 = evicted); SWA only
      expected_input_tokens / expected_input_positions  [N] or None   oracle values (write assert)
      token_pool         [R, Cp] or None   ground-truth tokens per (pool row, position) (token check)
      token_valid_lens   [B] or None       valid prefix of each batch row's pool row
      req_to_token_row_starts  [B] or None  with a flat ``req_to_token``: where each batch row's
                         segment starts (``plan(..., row_starts=...)``). The table is then what
                         attention reads this step, this step's own tokens included, and the
                         endpoints verify every entry of it after the write (``head``).
    """

    req_pool_indices: Any
    prefix_lens: Any
    extend_seq_lens: Any
    req_to_token: Any
    input_ids: Any
    positions: Any
    out_cache_loc: Any
    full_to_swa_index_mapping: Any = None
    expected_input_tokens: Any = None
    expected_input_positions: Any = None
    token_pool: Any = None
    token_valid_lens: Any = None
    req_to_token_row_starts: Any = None

    @property
    def is_page_table(self) -> bool:
        """True when ``req_to_token`` is the step's flat page table (``req_to_token_row_starts``)."""
        return self.req_to_token_row_starts is not None


class GroupPlan(NamedTuple):
    """One group's plans for a step, computed by ``head`` and reused by ``tail``.

    For a page-table batch (``CanaryBatch.is_page_table``) the verify plan covers every entry of
    each row's segment, this step's tokens included (positions ``[0, prefix + extend)``), and is
    run after the write; otherwise it covers the prefix and runs before the write (upstream's
    order)."""

    verify_plan: VerifyPlan
    write_plan: WritePlan
    loc: Any  # [N] canary slot per flat entry (SWA: LUT-translated, -1 = skip)


def translate_slots(lut, x):
    """``lut[x]`` where ``0 <= x < len(lut)``, else -1 (format.md §9.3 rule ``T``). Same dtype as ``x``."""
    n = lut.shape[0]
    ok = (x >= 0) & (x < n)
    return jnp.where(ok, jnp.take(lut, jnp.clip(x, 0, n - 1)).astype(x.dtype), jnp.asarray(-1, x.dtype))


def _add_u64_pairs(pairs, row, count):
    """``pairs`` uint32[T, 2] (lo, hi); add the uint32 ``count`` to row ``row`` with carry."""
    lo = pairs[row, 0]
    new_lo = lo + count
    hi = pairs[row, 1] + (new_lo < lo).astype(jnp.uint32)
    return pairs.at[row].set(jnp.stack([new_lo, hi]))


def _written_count(write_plan, loc):
    """Entries ``write`` counts in ``slot_run`` for a plan-made ``write_plan``: loc >= 0 in range."""
    n = loc.shape[0]
    cap = write_plan.seed_slot_indices.shape[0]
    active = jnp.clip(write_plan.num_valid_reqs[0], 0, cap)
    end = jnp.clip(jnp.take(write_plan.offsets, active), 0, n)
    return jnp.sum((jnp.arange(n) < end) & (loc >= 0)).astype(jnp.uint32)


def set_chain_position_assert(state: CanaryState, enabled: bool) -> CanaryState:
    """The same state with the log's chain-position assert flag set (a buffer value: no recompile).

    Switch it off while warming up / compiling (synthetic positions break the +1 rule) and on for
    serving. Works for a single-device state (flag ``int32[1]``) and a stacked multi-device state
    (flag ``int32[D, 1]``); the new flag is placed like the old one, so a jitted step that takes
    the state does not recompile.
    """
    log = state.log
    flag = log.enable_chain_position_assert
    if tuple(flag.shape) == (1,) and not getattr(flag, "committed", False):
        return state.replace(log=log.with_chain_position_assert(enabled))
    new = jax.device_put(np.full(flag.shape, 1 if enabled else 0, np.int32), flag.sharding)
    return state.replace(log=ViolationLog(log.ring, log.write_index, log.kernel_run_counters,
                                          log.slot_run_counters, new))


class CanaryEndpoints:
    """The canary endpoints of one engine: its static shape, and the functions that run inside the
    engine's jitted step (``head`` before attention, ``tail`` after the forward, ``sweep``).

    Args:
      config: the ``CanaryConfig``.
      num_slots: slots of the FULL KV pool (one canary record each).
      write_req_capacity: the batch-row bucket ``B`` of the engine's compiled step (>= 1).
      verify_capacity: verify entries per FULL plan; ``B * max_seq_len`` never overflows (a step with
        more entries skips its verify, counted, and still writes).
      swa_num_slots: slots of the SWA pool; required when ``config.groups`` has ``'SWA'``.
      swa_verify_capacity: verify entries per SWA plan (default ``B * swa_window_size``).
      slot_stride_bytes: bytes per canary record (>= 32, a multiple of 8).

    Raises:
      TypeError, ValueError: a ``kv-canary:`` message for a bad config or size.

    State: ``init_state()`` returns the ``CanaryState`` (one ``uint8[num_slots, stride]`` canary per
    watched HEAD/TAIL tag, the shared ``ViolationLog``, and the written-slot counters) that the step
    threads through ``head`` / ``tail`` / ``sweep``; donate it with the KV cache so nothing is copied.
    """

    def __init__(self, config: CanaryConfig, *, num_slots: int, write_req_capacity: int,
                 verify_capacity: int, swa_num_slots: Optional[int] = None,
                 swa_verify_capacity: Optional[int] = None,
                 slot_stride_bytes: int = consts.CANARY_SLOT_BYTES):
        if not isinstance(config, CanaryConfig):
            raise TypeError(f"kv-canary: config must be a CanaryConfig, got {type(config).__name__}")
        self.config = config
        self.write_req_capacity = int(write_req_capacity)
        self.slot_stride_bytes = int(slot_stride_bytes)
        self.num_slots = {"FULL": int(num_slots)}
        self.verify_capacity = {"FULL": int(verify_capacity)}
        self.window = {"FULL": 0}
        if "SWA" in config.groups:
            if swa_num_slots is None:
                raise ValueError("kv-canary: CanaryEndpoints needs swa_num_slots when the config "
                                 "watches the SWA group")
            self.num_slots["SWA"] = int(swa_num_slots)
            self.window["SWA"] = config.swa_window_size
            self.verify_capacity["SWA"] = int(
                swa_verify_capacity if swa_verify_capacity is not None
                else self.write_req_capacity * config.swa_window_size)
        for g, n in self.num_slots.items():
            if n < 1:
                raise ValueError(f"kv-canary: num_slots of group {g} must be >= 1, got {n}")
        if self.write_req_capacity < 1:
            raise ValueError("kv-canary: write_req_capacity must be >= 1, got "
                             f"{self.write_req_capacity}")

    # -- tags ---------------------------------------------------------------------------------
    @property
    def groups(self):
        return self.config.groups if self.config.enabled else ()

    @property
    def halves(self):
        return self.config.halves

    def tags(self, stage: str):
        return self.config.tags(stage) if self.config.enabled else ()

    def expected_tags(self):
        return self.config.expected_tags()

    # -- state ----------------------------------------------------------------------------------
    def init_state(self) -> CanaryState:
        """Fresh state: zero canaries for every HEAD/TAIL endpoint, an empty log (flag on)."""
        canaries = {}
        for g in self.groups:
            for h in self.halves:
                for stage in ("HEAD", "TAIL"):
                    canaries[launch_tag(stage, h, g).name] = new_canary_buffer(
                        self.num_slots[g], self.slot_stride_bytes)
        log = ViolationLog.create(ring_capacity=self.config.ring_capacity,
                                  num_tags=consts.NUM_LAUNCH_TAGS)
        written = jnp.zeros((consts.NUM_LAUNCH_TAGS, 2), jnp.uint32)
        return CanaryState(canaries, log, written)

    # -- in-step functions ----------------------------------------------------------------------
    def plan(self, batch: CanaryBatch) -> dict:
        """Plans per watched group: ``{group: GroupPlan}``."""
        kvc = _kvc()
        cfg = self.config
        if cfg.token_check and (batch.token_pool is None or batch.token_valid_lens is None):
            raise ValueError("kv-canary: CanaryConfig.token_check=True needs batch.token_pool and "
                             "batch.token_valid_lens")
        plans = {}
        for g in self.groups:
            lut = None
            if g == "SWA":
                lut = batch.full_to_swa_index_mapping
                if lut is None:
                    raise ValueError("kv-canary: the SWA group needs batch.full_to_swa_index_mapping")
            def plan_of(prefix_lens, extend_seq_lens, verify_capacity):
                return kvc.plan(
                    batch.req_pool_indices, prefix_lens, extend_seq_lens, batch.req_to_token,
                    verify_capacity=verify_capacity, write_req_capacity=self.write_req_capacity,
                    swa_window_size=self.window[g], full_to_swa_index_mapping=lut,
                    req_to_verify_expected_tokens=batch.token_pool if cfg.token_check else None,
                    req_to_verify_expected_tokens_valid_lens=(batch.token_valid_lens
                                                              if cfg.token_check else None),
                    row_starts=batch.req_to_token_row_starts,
                    report_evicted_in_window=lut is not None)

            if batch.is_page_table:
                # the write plan alone (a 1-entry verify capacity overflows, so no verify entry is
                # filled), then the verify plan of every segment entry: the prefix and this step's
                # tokens, which the write has stamped by the time it runs
                _, wp = plan_of(batch.prefix_lens, batch.extend_seq_lens, 1)
                seq_lens = batch.prefix_lens + jnp.maximum(batch.extend_seq_lens, 0)
                vp, _ = plan_of(seq_lens, jnp.zeros_like(batch.extend_seq_lens),
                                self.verify_capacity[g])
            else:
                vp, wp = plan_of(batch.prefix_lens, batch.extend_seq_lens, self.verify_capacity[g])
            loc = batch.out_cache_loc if lut is None else translate_slots(lut, batch.out_cache_loc)
            plans[g] = GroupPlan(vp, wp, loc)
        return plans

    def _verify_write(self, state, stage, g, plan, batch, sources):
        kvc = _kvc()
        cfg = self.config
        mode = cfg.real_kv_hash_mode if stage == "TAIL" else RealKvHashMode.NONE
        canaries = dict(state.canaries)
        log, written = state.log, state.written
        wia = cfg.write_input_assert
        if wia and (batch.expected_input_tokens is None or batch.expected_input_positions is None):
            raise ValueError("kv-canary: CanaryConfig.write_input_assert=True needs "
                             "batch.expected_input_tokens and batch.expected_input_positions")
        for h in self.halves:
            tag = launch_tag(stage, h, g)
            srcs = tuple(sources.get(h, ())) if stage == "TAIL" else ()
            c = canaries[tag.name]

            def verify(log):
                return kvc.verify(c, log, plan.verify_plan, tag=int(tag),
                                  check_verify_expected_token=cfg.token_check,
                                  real_kv_sources=srcs, real_kv_hash_mode=mode)

            if not batch.is_page_table:
                log = verify(log)
            c, log = kvc.write(c, log, plan.write_plan, batch.input_ids, batch.positions, plan.loc,
                               tag=int(tag), enable_write_input_assert=wia,
                               expected_input_tokens=batch.expected_input_tokens if wia else None,
                               expected_input_positions=(batch.expected_input_positions if wia
                                                         else None),
                               real_kv_sources=srcs, real_kv_hash_mode=mode)
            if batch.is_page_table:
                log = verify(log)
            canaries[tag.name] = c
            written = _add_u64_pairs(written, int(tag), _written_count(plan.write_plan, plan.loc))
        return CanaryState(canaries, log, written)

    def head(self, state: CanaryState, batch: CanaryBatch):
        """Before attention: plan, then per group and half a HEAD verify + write (no real-KV);
        for a page-table batch the write comes first and the verify checks every entry attention
        will read (``CanaryBatch.req_to_token_row_starts``).

        Args:
          state: the ``CanaryState``.
          batch: the step's ``CanaryBatch`` (int32/int64 arrays: ``req_pool_indices [B]``,
            ``prefix_lens [B]``, ``extend_seq_lens [B]``, ``req_to_token [R, L]``, ``input_ids [N]``,
            ``positions [N]``, ``out_cache_loc [N]``, and the optional token pool / LUT fields).

        Returns:
          ``(state, ctx)``; pass ``ctx`` to ``tail``. With mode ``'none'`` nothing runs.
        """
        ctx = (self.plan(batch), batch)
        for g in self.groups:
            state = self._verify_write(state, "HEAD", g, ctx[0][g], batch, {})
        return state, ctx

    def tail(self, state: CanaryState, ctx, real_kv: Optional[Mapping] = None) -> CanaryState:
        """After the forward: per group and half a TAIL verify + write on the tail canary (write
        first for a page-table batch, as in ``head``).

        Args:
          state: the ``CanaryState`` returned by ``head``.
          ctx: the ``ctx`` returned by ``head``.
          real_kv: ``{group: {half: source}}``: a ``RealKvSource`` or a tuple of up to 4, addressing
            the post-forward KV arrays (e.g. layer 0's K and V of the group), fingerprinted with
            ``config.real_kv_hash_mode``. Missing entries mean no fingerprint for that half.

        Returns:
          The updated ``CanaryState``.
        """
        plans, batch = ctx
        real_kv = real_kv or {}
        for g in self.groups:
            sources = self._sources(real_kv, g, "TAIL")
            state = self._verify_write(state, "TAIL", g, plans[g], batch, sources)
        return state

    def sweep(self, state: CanaryState, plans: Mapping, real_kv: Optional[Mapping] = None
              ) -> CanaryState:
        """A SWEEP of cached slots against the tail canaries (SWEEP tags, real-KV, no token check).

        Args:
          state: the ``CanaryState``.
          plans: ``{group: VerifyPlan}``, e.g. from ``sweep.build_group_sweep_plans``: the groups
            it names are swept (e.g. only FULL, whose slots a radix cache holds as they are).
          real_kv: as for ``tail``.

        Returns:
          The updated ``CanaryState``.

        Raises:
          ValueError: ``plans`` names a group these endpoints do not have.
        """
        kvc = _kvc()
        real_kv = real_kv or {}
        unknown = sorted(set(plans) - set(self.groups))
        if unknown:
            raise ValueError(f"kv-canary: sweep plans must name groups of {list(self.groups)}, "
                             f"got {unknown}")
        log = state.log
        for g in (g for g in self.groups if g in plans):
            sources = self._sources(real_kv, g, "SWEEP")
            for h in self.halves:
                tag = launch_tag("SWEEP", h, g)
                log = kvc.verify(state.canaries[launch_tag("TAIL", h, g).name], log, plans[g],
                                 tag=int(tag), check_verify_expected_token=False,
                                 real_kv_sources=tuple(sources.get(h, ())),
                                 real_kv_hash_mode=self.config.real_kv_hash_mode)
        return state.replace(log=log)

    def _sources(self, real_kv, g, stage):
        got = dict(real_kv.get(g, {}))
        out = {}
        for h in self.halves:
            srcs = got.get(h, ())
            if isinstance(srcs, RealKvSource):
                srcs = (srcs,)
            srcs = tuple(srcs)
            if not srcs and self.config.real_kv_hash_mode != RealKvHashMode.NONE:
                raise ValueError(
                    f"kv-canary: real_kv_hash_mode={self.config.real_kv_hash_mode.name} but no "
                    f"real-KV source was given for {stage}_{h}_{g} (pass real_kv[{g!r}][{h!r}])")
            out[h] = srcs
        return out
