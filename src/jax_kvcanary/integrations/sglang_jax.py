"""The canary inside sglang-jax (the JAX backend of SGLang), installed into a running engine.

    import jax_kvcanary.integrations.sglang_jax as kvc_sgl
    from jax_kvcanary.runtime import CanaryConfig

    canary = kvc_sgl.install(model_runner, CanaryConfig(mode="log", sweep_interval=8),
                             tree_cache=scheduler.tree_cache)
    # or: kvc_sgl.install_into_scheduler(scheduler, config)
    # flags: kvc_sgl.add_cli_args(parser); config = kvc_sgl.config_from_args(parser.parse_args())

Nothing in sglang-jax's source is edited. Tested against sglang-jax 0.0.2 (the release on PyPI);
``install`` checks the surfaces below and refuses, with a ``kv-canary:`` error, an engine that
does not have them (for example the newer ``memory_pools`` model runner of sglang-jax's main branch).

**What is wrapped, and why.** Exactly one thing, on the one ``ModelRunner`` instance passed in:

- ``model_runner.jitted_run_model``: the instance attribute that ``ModelRunner.initialize_jit`` sets
  to a Python wrapper around the runner's ``jax.jit``-compiled model call
  (``model(forward_batch, token_to_kv_pool, logits_metadata)``, KV pool donated), and that
  ``ModelRunner._forward`` calls once per step. It is the one place where the step's batch
  (``ForwardBatch``), the KV pool before the forward and the per-layer KV buffers after it are all
  inside one compiled program. ``install`` replaces it by a wrapper around this module's own
  ``jax.jit`` function, which runs canary HEAD (plan, then verify + write per half), the same model
  call, then canary TAIL (verify + write with real-KV fingerprints of layer 0's K and V after the
  forward), donating both the KV pool and the canary state. It returns what the original returned
  (the logits output, the list of per-layer fused KV buffers, the callback flags), so
  ``ModelRunner._forward``, ``_set_kv_cache_after_forward``, sampling and the scheduler run
  unchanged. ``uninstall()`` puts the original back. After the step the wrapper starts the canary's
  one-step-lag readback (``Monitor``), and every ``sweep_interval`` steps it first runs a SWEEP of
  the prefix cache. When the monitor raises (mode ``raise``, or a failed health check) the step has
  already donated the KV pool, so the wrapper first stores the new buffers with the runner's own
  ``_set_kv_cache_after_forward`` and then raises: the engine is left with live KV buffers.

Read (never written) on the host: ``model_runner.req_to_token_pool.req_to_token`` (the rows of the
step's batch, copied each step: JAX may read a numpy argument after the call returns, and the
scheduler mutates this table in place), and for sweeps the scheduler's ``RadixCache``
(``tree_cache.root_node``: each node's ``value`` holds its slots).

**The engine's arrays, as the canary addresses them.**

- KV: ``model_runner.token_to_kv_pool`` is an ``MHATokenToKVPool``; ``kv_buffer`` is a list with one
  fused array per layer, ``[size + page_size, 2 * kv_heads, head_dim]``, heads interleaved
  ``K0, V0, K1, V1, ...``; slot ``s`` (a token index, whatever the page size) is row ``s``, and slot
  0 is the allocator's padding slot (its free list starts at 1). The TAIL sources are layer 0's
  buffer after the forward. PARTIAL: K folds the first 16 bytes of the slot's row (K head 0)
  straight from the fused array (``RealKvSource(kv0, 1, row_bytes, row_bytes)``, no copy), V the
  first 16 bytes of V head 0 (``kv0[:, 1, :16 bytes]``, a 16-byte-per-slot slice). ALL: both halves
  fold the whole fused row, every K and V head of the slot, from the fused array itself (splitting
  the interleaved heads would copy a layer's worth of KV every step), so a flipped V byte is
  reported by TAIL_K and TAIL_V alike.
- ``req_to_token``: numpy ``int32[max_running_requests + 1, context_len + 4]``. Its row 0 is a
  real request's row (the pool's free list starts at 0), and a padded batch row has
  ``req_pool_indices = -1``; the canary's plan reserves row 0 for padding. So the step passes the
  batch's own rows, ``req_to_token[req_pool_indices]``, as a table ``[B + 1, L]`` whose row 0 is
  zeros, and batch row ``r`` is canary row ``r + 1`` (0 for a padding row).
- Batch: ``ForwardBatch.input_ids / positions / out_cache_loc`` (padded tokens: id 0, position 0,
  ``out_cache_loc = -1``, which the canary's write skips); EXTEND: ``extend_prefix_lens`` /
  ``extend_seq_lens`` (0 on padding rows); DECODE: prefix ``seq_lens - 1`` and one token per row
  with ``seq_lens > 0`` (padding rows have ``seq_lens = 0``). The verify capacity is the length of
  ``cache_loc`` (the engine's own bucket, >= the sum of the sequence lengths) and the write
  capacity the batch bucket, so the canary adds no shape of its own: it compiles with the engine's
  buckets and never per step.

**Not covered.** Layers other than 0 are not fingerprinted (a byte flipped only in layer 1's KV is
not seen); attention's own gather (``forward_batch.cache_loc``, built on the host from the same
``req_to_token`` rows) is not checked separately from ``req_to_token``; the overlap scheduler (a
``req_to_token`` row can be changed for the next batch while this one is launched), tensor
parallelism (``tp_size > 1``: the KV buffer is sharded over heads), MLA, speculative decoding and
the newer ``memory_pools`` runner are refused or untested. Install after sglang-jax's warm-up /
precompile (its synthetic batches would leave records and rows), or call ``reset()`` after it.
"""

from __future__ import annotations

import argparse
import logging
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..consts import RealKvHashMode
from ..inputs import RealKvSource
from ..runtime.config import CanaryConfig
from ..runtime.endpoints import CanaryBatch, CanaryEndpoints
from ..runtime.monitor import Monitor, counter_snapshot
from ..runtime.sweep import build_group_sweep_plans

LOGGER = logging.getLogger("jax_kvcanary")

TESTED_VERSIONS = ("0.0.2",)
REAL_DATA_CHOICES = ("none", "partial", "all")


# -- flags -------------------------------------------------------------------------------------------
def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the upstream flags ``--kv-canary none|log|raise``, ``--kv-canary-real-data
    none|partial|all`` and ``--kv-canary-sweep-interval N`` to ``parser`` (returned)."""
    g = parser.add_argument_group("kv-canary")
    g.add_argument("--kv-canary", choices=("none", "log", "raise"), default="none",
                   help="KV-cache canary: none (off), log each violation, or raise on the first")
    g.add_argument("--kv-canary-real-data", choices=REAL_DATA_CHOICES, default="partial",
                   help="fingerprint of layer 0's real KV bytes at TAIL and SWEEP")
    g.add_argument("--kv-canary-sweep-interval", type=int, default=0, metavar="N",
                   help="verify every slot held by the prefix cache every N steps (0 = never)")
    return parser


def config_from_args(ns: argparse.Namespace, **overrides) -> CanaryConfig:
    """The ``CanaryConfig`` of parsed flags (see ``add_cli_args``); ``overrides`` set other fields."""
    real = getattr(ns, "kv_canary_real_data", "partial")
    if real not in REAL_DATA_CHOICES:
        raise ValueError(f"kv-canary: --kv-canary-real-data must be one of {REAL_DATA_CHOICES}, "
                         f"got {real!r}")
    return CanaryConfig(mode=getattr(ns, "kv_canary", "none"), real_kv_hash_mode=real.upper(),
                        sweep_interval=getattr(ns, "kv_canary_sweep_interval", 0), **overrides)


# -- the engine's structures --------------------------------------------------------------------------
def _check_runner(runner) -> None:
    def need(ok, what):
        if not ok:
            raise TypeError(f"kv-canary: this sglang-jax model runner has no {what}; the sglang-jax "
                            f"integration supports the ModelRunner of sglang-jax "
                            f"{', '.join(TESTED_VERSIONS)}")
    need(not hasattr(runner, "memory_pools"), "token_to_kv_pool-only layout (it has memory_pools)")
    need(callable(getattr(runner, "jitted_run_model", None)), "jitted_run_model")
    need(callable(getattr(runner, "_set_kv_cache_after_forward", None)),
         "_set_kv_cache_after_forward")
    need(getattr(runner, "model", None) is not None, "model")
    pool = getattr(runner, "token_to_kv_pool", None)
    need(isinstance(getattr(pool, "kv_buffer", None), list), "token_to_kv_pool.kv_buffer list")
    rtp = getattr(runner, "req_to_token_pool", None)
    need(isinstance(getattr(rtp, "req_to_token", None), np.ndarray),
         "req_to_token_pool.req_to_token numpy table")
    if getattr(runner, "use_mla_backend", False):
        raise ValueError("kv-canary: the sglang-jax integration does not support MLA KV pools")
    if int(getattr(runner, "tp_size", 1)) != 1:
        raise ValueError("kv-canary: the sglang-jax integration supports tp_size=1 only (the fused "
                         f"KV buffer is sharded over heads with tp_size={runner.tp_size})")
    kv0 = pool.kv_buffer[0]
    if kv0.ndim != 3 or kv0.shape[1] % 2:
        raise ValueError("kv-canary: expected layer 0's fused KV buffer [slots, 2 * kv_heads, "
                         f"head_dim], got shape {tuple(kv0.shape)}")
    if (kv0.shape[2] * np.dtype(kv0.dtype).itemsize) % 16:
        raise ValueError("kv-canary: a KV head must be a multiple of 16 bytes, got head_dim="
                         f"{kv0.shape[2]} x {np.dtype(kv0.dtype).itemsize} bytes")


def real_kv_sources(kv0, mode: RealKvHashMode) -> dict:
    """``{'K': RealKvSource, 'V': RealKvSource}`` over layer 0's fused buffer ``kv0``
    ``[slots, 2 * kv_heads, head_dim]`` (heads interleaved K0, V0, K1, V1, ...).

    PARTIAL: K folds the first 16 bytes of the slot's row (K head 0) from the fused array itself;
    V the first 16 bytes of V head 0 (a 16-byte-per-slot slice). ALL: both halves fold the whole
    fused row (every K and V head of the slot) from the fused array itself, so that no step copies
    a layer's worth of KV to split the interleaved heads."""
    isz = np.dtype(kv0.dtype).itemsize
    row = int(np.prod(kv0.shape[1:])) * isz
    whole = RealKvSource(kv0, 1, row, row)          # the fused array itself: no copy
    if mode == RealKvHashMode.ALL:
        return {"K": whole, "V": whole}
    return {"K": whole, "V": RealKvSource(kv0[:, 1, : 16 // isz], 1, 16, 16)}


def canary_batch(forward_batch, rows) -> CanaryBatch:
    """The ``CanaryBatch`` of an sglang-jax ``ForwardBatch`` (inside the jit). ``rows`` is the
    ``[B + 1, L]`` table made by ``batch_rows`` (row 0 zeros, row r + 1 = batch row r's slots)."""
    fb = forward_batch
    rp = fb.req_pool_indices
    B = rp.shape[0]
    live = rp >= 0
    canary_rp = jnp.where(live, jnp.arange(1, B + 1, dtype=jnp.int32), 0)
    if fb.forward_mode.is_decode():
        has = live & (fb.seq_lens > 0)
        prefix = jnp.where(has, fb.seq_lens - 1, 0).astype(jnp.int32)
        extend = has.astype(jnp.int32)
    elif fb.extend_seq_lens is not None and fb.extend_prefix_lens is not None:
        prefix = jnp.where(live, fb.extend_prefix_lens, 0).astype(jnp.int32)
        extend = jnp.where(live, fb.extend_seq_lens, 0).astype(jnp.int32)
    else:
        raise ValueError(f"kv-canary: forward mode {fb.forward_mode!r} without extend lengths is "
                         "not supported by the sglang-jax integration")
    return CanaryBatch(canary_rp, prefix, extend, rows, fb.input_ids.astype(jnp.int32),
                       fb.positions.astype(jnp.int32), fb.out_cache_loc.astype(jnp.int32))


def batch_rows(req_to_token: np.ndarray, req_pool_indices: np.ndarray) -> np.ndarray:
    """``[B + 1, L]`` int32, a fresh array: row 0 zeros, row r + 1 = ``req_to_token[rp_r]`` (zeros
    for a padding row, ``rp_r < 0``)."""
    rp = np.asarray(req_pool_indices)
    out = np.zeros((rp.shape[0] + 1, req_to_token.shape[1]), np.int32)
    live = rp >= 0
    out[1:][live] = req_to_token[rp[live]]
    return out


def radix_chains(tree_cache) -> np.ndarray:
    """``int64[n, 3]`` ``(slot, position, prev_slot)`` of every slot an sglang-jax ``RadixCache``
    holds (position = depth; prev = the previous slot on the path, -1 at the root)."""
    out = []
    stack = [(tree_cache.root_node, 0, -1)]
    while stack:
        node, depth, prev = stack.pop()
        for child in list(node.children.values()):
            val = child.value
            if val is None or len(val) == 0:
                continue
            slots = np.asarray(val, np.int64)
            n = slots.shape[0]
            ch = np.empty((n, 3), np.int64)
            ch[:, 0] = slots
            ch[:, 1] = np.arange(depth, depth + n)
            ch[0, 2] = prev
            ch[1:, 2] = slots[:-1]
            out.append(ch)
            stack.append((child, depth + n, int(slots[-1])))
    return np.concatenate(out) if out else np.zeros((0, 3), np.int64)


# -- the installed canary -----------------------------------------------------------------------------
class SglangJaxCanary:
    """The canary installed into one sglang-jax ``ModelRunner`` (made by ``install``).

    Attributes: ``config``, ``state`` (the ``CanaryState``, donated by every step), ``monitor``
    (``Monitor``: ``monitor.violations`` holds what was reported), ``steps``, ``sweeps``.
    """

    def __init__(self, runner, config: CanaryConfig, *, tree_cache=None,
                 logger: Optional[logging.Logger] = None):
        if not isinstance(config, CanaryConfig):
            raise TypeError(f"kv-canary: config must be a CanaryConfig, got {type(config).__name__}")
        if not config.enabled:
            raise ValueError("kv-canary: mode 'none' installs nothing (do not call install)")
        if tuple(config.groups) != ("FULL",):
            raise ValueError("kv-canary: the sglang-jax integration watches the FULL group only")
        if config.token_check or config.write_input_assert:
            raise ValueError("kv-canary: token_check and write_input_assert need oracle inputs the "
                             "sglang-jax integration does not have")
        if config.sweep_interval and tree_cache is None:
            raise ValueError("kv-canary: sweep_interval > 0 needs the scheduler's tree_cache "
                             "(install(..., tree_cache=scheduler.tree_cache))")
        if config.sweep_interval and not hasattr(tree_cache, "root_node"):
            raise ValueError("kv-canary: sweeps walk a RadixCache; this tree_cache is a "
                             f"{type(tree_cache).__name__} (radix cache disabled?): use "
                             "sweep_interval=0")
        _check_runner(runner)
        self.runner = runner
        self.config = config
        self.tree_cache = tree_cache
        self.logger = logger or LOGGER
        self.num_slots = int(runner.token_to_kv_pool.kv_buffer[0].shape[0])
        self._original = self._model = None          # taken by install()
        self._step_fn = self._build_step()
        self._sweep_fn = self._build_sweep()
        self.steps = self.sweeps = 0
        self.state = None
        self.monitor = None
        self.reset()

    # -- lifecycle ------------------------------------------------------------------------------
    def _endpoints(self, write_req_capacity: int, verify_capacity: int) -> CanaryEndpoints:
        return CanaryEndpoints(self.config, num_slots=self.num_slots,
                               write_req_capacity=max(1, int(write_req_capacity)),
                               verify_capacity=max(1, int(verify_capacity)))

    def reset(self) -> None:
        """Fresh canary state (zero records, empty ring) and a fresh monitor; e.g. after
        sglang-jax's warm-up, whose synthetic batches would otherwise leave records behind."""
        # placed as the step's outputs are (replicated over the runner's mesh), so that the first
        # step of each bucket compiles the same program as every later one
        from jax.sharding import NamedSharding, PartitionSpec

        self.state = jax.device_put(self._endpoints(1, 1).init_state(),
                                    NamedSharding(self.runner.mesh, PartitionSpec()))
        self.monitor = Monitor.from_config(self.config, logger=self.logger)
        self.steps = self.sweeps = 0

    def install(self) -> "SglangJaxCanary":
        """Wrap the runner's ``jitted_run_model`` (again, after the engine re-ran
        ``initialize_jit``, e.g. for new weights: the model's current weights are taken here)."""
        if not self.installed:
            self._original = self.runner.jitted_run_model
            self._model = self._split_model()
            self.runner.jitted_run_model = self._run_model
        return self

    def uninstall(self) -> None:
        """Put the runner's original ``jitted_run_model`` back."""
        if self.installed:
            self.runner.jitted_run_model = self._original

    @property
    def installed(self) -> bool:
        """True while the runner's ``jitted_run_model`` is this canary's wrapper."""
        return self.runner.jitted_run_model == self._run_model

    # -- the jitted functions -------------------------------------------------------------------
    def _split_model(self):
        from flax import nnx

        model_def, model_state = nnx.split(self.runner.model)
        leaves, state_def = jax.tree_util.tree_flatten(model_state)
        return model_def, state_def, leaves

    def _build_step(self):
        from flax import nnx

        mode = self.config.real_kv_hash_mode

        def step(model_def, model_state_def, model_state_leaves, forward_batch, token_to_kv_pool,
                 logits_metadata, cstate, rows):
            model = nnx.merge(model_def, jax.tree_util.tree_unflatten(model_state_def,
                                                                      model_state_leaves))
            ep = self._endpoints(forward_batch.req_pool_indices.shape[0],
                                 forward_batch.cache_loc.shape[0])
            cstate, ctx = ep.head(cstate, canary_batch(forward_batch, rows))
            output, layers_kv_fused, flags = model(forward_batch, token_to_kv_pool, logits_metadata)
            sources = real_kv_sources(layers_kv_fused[0], mode) if mode else {}
            cstate = ep.tail(cstate, ctx, {"FULL": sources})
            return output, layers_kv_fused, flags, cstate, counter_snapshot(cstate)

        return jax.jit(step, donate_argnames=("token_to_kv_pool", "cstate"),
                       static_argnames=("model_state_def",))

    def _build_sweep(self):
        mode = self.config.real_kv_hash_mode
        ep = self._endpoints(1, 1)

        def sweep(kv0, cstate, plans):
            sources = real_kv_sources(kv0, mode) if mode else {}
            return ep.sweep(cstate, plans, {"FULL": sources})

        return jax.jit(sweep, donate_argnums=(1,))

    # -- per step -------------------------------------------------------------------------------
    def sweep_now(self) -> int:
        """Verify every slot the prefix cache holds against the TAIL canaries (SWEEP tags) on the
        current layer-0 KV; returns the number of slots swept."""
        chains = radix_chains(self.tree_cache)
        plans = build_group_sweep_plans(chains, ("FULL",))
        kv0 = self.runner.token_to_kv_pool.kv_buffer[0]
        self.state = self._sweep_fn(kv0, self.state, plans)
        self.sweeps += 1
        return int(chains.shape[0])

    def _run_model(self, forward_batch, logits_metadata):
        self.steps += 1
        si = self.config.sweep_interval
        if si and self.steps % si == 0:
            self.sweep_now()
        rows = batch_rows(self.runner.req_to_token_pool.req_to_token,
                          np.asarray(forward_batch.req_pool_indices))
        model_def, state_def, leaves = self._model
        output, layers_kv_fused, flags, self.state, snapshot = self._step_fn(
            model_def, state_def, leaves, forward_batch, self.runner.token_to_kv_pool,
            logits_metadata, self.state, rows)
        try:
            self.monitor.step(self.state, snapshot=snapshot)
        except BaseException:
            # mode 'raise' (or a health failure): the step has donated the KV pool already, so
            # hand the engine its new buffers before raising, as its own forward would have
            self.runner._set_kv_cache_after_forward(layers_kv_fused, forward_batch)
            raise
        return output, layers_kv_fused, flags

    def flush(self):
        """Report what the last step's readback holds (blocks on it); returns new violations."""
        return self.monitor.flush()


def install(model_runner, config: CanaryConfig, *, tree_cache=None,
            logger: Optional[logging.Logger] = None) -> Optional[SglangJaxCanary]:
    """Install the canary into a running sglang-jax ``ModelRunner`` (see the module docstring).

    Args:
      model_runner: ``sgl_jax.srt.model_executor.model_runner.ModelRunner`` (after it initialised).
      config: the ``CanaryConfig`` (e.g. ``config_from_args``); mode ``'none'`` installs nothing.
      tree_cache: the scheduler's ``RadixCache``; needed when ``config.sweep_interval > 0``.
      logger: where reports go (default ``logging.getLogger('jax_kvcanary')``).

    Returns:
      The installed ``SglangJaxCanary`` (``uninstall()`` restores the runner), or None for mode
      ``'none'``.

    Raises:
      TypeError, ValueError: ``kv-canary:`` messages for an unsupported runner or config.
    """
    if not isinstance(config, CanaryConfig):
        raise TypeError(f"kv-canary: config must be a CanaryConfig, got {type(config).__name__}")
    if not config.enabled:
        return None
    return SglangJaxCanary(model_runner, config, tree_cache=tree_cache, logger=logger).install()


def install_into_scheduler(scheduler, config: CanaryConfig, **kw) -> Optional[SglangJaxCanary]:
    """``install`` on an sglang-jax ``Scheduler``: its model runner and its ``tree_cache``.

    Raises:
      ValueError: the scheduler runs the overlap schedule (the next batch's ``req_to_token``
        rows are written while this one is launched; start it with ``--disable-overlap-schedule``).
    """
    if getattr(scheduler, "enable_overlap", False):
        raise ValueError("kv-canary: the sglang-jax integration needs the non-overlap scheduler "
                         "(--disable-overlap-schedule): with the overlap schedule the next batch's "
                         "req_to_token rows are written while this batch is launched")
    runner = scheduler.tp_worker.get_model_runner()
    return install(runner, config, tree_cache=getattr(scheduler, "tree_cache", None), **kw)
