"""``SglangJaxCanary``: the canary installed into one sglang-jax ``ModelRunner``.

**What is wrapped, and why.** Exactly one thing, on the one ``ModelRunner`` instance passed in:
``model_runner.jitted_run_model``, the instance attribute that ``ModelRunner.initialize_jit`` sets
to a Python wrapper around the runner's ``jax.jit``-compiled model call and that
``ModelRunner._forward`` calls once per step. ``install`` replaces it by a wrapper that runs the
engine's model call and the canary's launch on what the step read and wrote. Where the engine's
wrapper is sglang-jax's (main and 0.0.2), the two are one program (``fused``): the function the
engine jits, traced as it is, then the launch, jitted together with the KV pool and the canary
state donated, so a guarded step dispatches as many programs as an unguarded one and the model's
numbers are the same. Elsewhere (sglang-jax's opt-in AOT dispatcher) the engine's own call runs
unchanged and one jitted canary launch follows it. Either way the wrapper returns what the
original returned, so ``_forward``, sampling and the scheduler run unchanged; ``uninstall()``
puts the original back. Both are dispatched asynchronously, as the model call is.

**What the launch checks.** The plan is made on the device from the step's own page table
(``forward_batch.cache_loc``, the slots attention read: ``layout.page_table_batch``), so nothing is
copied to the device per step and nothing is read back inside the step. HEAD stamps the records of
the step's new slots (``out_cache_loc``) with their tokens, positions and chain hashes, then
verifies every entry of every request's segment, the step's own tokens included: a wrong
``cache_loc`` entry, a ``req_to_token`` entry that points at another slot, or a slot that was
reallocated while a cached prefix still uses it is a violation of the step that read it. TAIL does
the same on the tail canaries with fingerprints of layer 0's real KV bytes as the forward left
them. (Upstream runs HEAD before the forward; here both run in one launch after it, which checks
the same records with one dispatch per step instead of two.)

**Tensor and data parallelism** (``tp > 1``: the fused KV buffer's heads sharded over the mesh's
``tensor`` axis; ``dp > 1``, data-parallel attention: its slots over the ``data`` axis, one
section of ``size / dp`` slots and a padding page per rank, addressed by rank-local slot ids):
the canary state has one block per device of the ``(data, tensor)`` mesh and the launch runs
under ``jax.shard_map`` (``_per_device``), each device on its own state, its own KV shard (its
rank's slots, its heads) and its rank's section of the batch arrays (the engine places them
``P("data")``, equal sections per rank), so no KV is gathered across devices and each rank's
plan sees rank-local slot ids; the monitor labels each row with its device and ``dp_rank``.

**Intended tokens** (``config.write_input_assert`` / ``config.token_check``, sglang-jax main):
the runner's ``jitted_sampler`` is wrapped too, and the launch reads the ``tokens.TokenMirror``
that it and the scheduler hook fill (see ``tokens``).

**Sweeps** of the prefix cache (``config.sweep_interval``) are collected on the host where the
scheduler's radix tree is consistent (``request_sweep``, called by the scheduler hook of
``install_into_scheduler`` before it launches a batch, or by the wrapper itself when there is no
scheduler hook) and run by the next step as a program of their own (one more program every
``sweep_interval`` steps), on layer 0's KV as the forward before it left it (after the forward
with the separate launch).

**Reporting.** After each step the wrapper starts the canary's one-step-lag readback
(``Monitor``): mode ``log`` logs each new violation (``logging.getLogger('jax_kvcanary')``),
mode ``raise`` hands the engine the step's KV buffers (``store_kv``, so it is not left holding
donated arrays) and raises ``CanaryViolationError``.

**Compiles.** ``precompile(engine_precompile)`` runs the engine's own precompile with the canary
installed (so the step is compiled for each of the engine's buckets), compiles the sweep for
every capacity bucket, then starts from a fresh state: no compile is left for the request path.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ...runtime.config import CanaryConfig, launch_tag
from ...runtime.endpoints import CanaryEndpoints
from ...runtime.episodes import EpisodeLog
from ...runtime.errors import CanaryHealthError, CanaryViolationError
from ...runtime.monitor import Monitor, Violation, counter_snapshot
from ...runtime.multidevice import global_view, local_view
from ...runtime.sweep import DEFAULT_MIN_CAPACITY, bucket_capacity, build_group_sweep_plans
from ...state import ViolationLog
from .request_guard import batch_requests, dp_rank_of
from .layout import (REPLICATED_ARRAYS, LegacyRunner, page_table_batch, replicated,
                     runner_layout, step_arrays, table_entries)
from .fused import engine_jit, fused_step
from .metrics import COUNTERS_INTERVAL, CanaryTotals, PrometheusCounters
from .tokens import TokenMirror, with_intended_tokens

LOGGER = logging.getLogger("jax_kvcanary")


def intended_tokens(runner, layout, config: CanaryConfig) -> Optional[TokenMirror]:
    """The ``TokenMirror`` the write-input assert and the token check read (None when both are
    off); they need sglang-jax main (its sampler and its batch ids)."""
    if not (config.write_input_assert or config.token_check):
        return None
    if isinstance(layout, LegacyRunner) or not callable(getattr(runner, "jitted_sampler", None)):
        raise ValueError("kv-canary: the write-input assert and the token check need sglang-jax "
                         "main (its jitted_sampler and batch ids); this is a 0.0.2 model runner")
    rows, cols = np.shape(runner.req_to_token_pool.req_to_token)
    return TokenMirror(rows, cols, runner.mesh)


def radix_chains(tree_cache, dp: int = 1) -> list:
    """Per data-parallel rank (``dp`` of them; a node's rank is its key's ``dp_rank``), the
    ``int64[n, 3]`` ``(slot, position, prev_slot)`` of every slot an sglang-jax ``RadixCache``
    holds for that rank (rank-local slots; position = depth; prev = the previous slot on the
    path, -1 at the root)."""
    out = [[] for _ in range(dp)]
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
            out[dp_rank_of(getattr(child, "key", None))].append(ch)
            stack.append((child, depth + n, int(slots[-1])))
    return [np.concatenate(c) if c else np.zeros((0, 3), np.int64) for c in out]


#: the groups a sweep of the radix cache checks: its nodes hold their tokens' full-pool slots (a
#: hybrid SWA pool's tree too, tombstoned nodes included); SWA slots live inside the requests'
#: windows, where every step checks them
SWEPT_GROUPS = ("FULL",)

#: the engine's tensor-parallel mesh axis (sglang-jax shards the fused KV buffer's heads over it)
TP_AXIS = "tensor"
#: the engine's data-parallel attention axis (slots and batch sections per rank, ``--dp-size``)
DP_AXIS = "data"

#: elements of the ``cost_hint`` reduction: XLA:CPU runs a program it estimates at fewer than
#: 1000 flops in the thread that dispatches it, and it cannot cost custom calls
COST_HINT_ELEMENTS = 1024


def cost_hint(cstate):
    """Inside the launch: a reduction over ``COST_HINT_ELEMENTS`` bytes of the ring, returned (and
    dropped by the caller), so that XLA's cost model sees the launch as more than trivial and the
    CPU runtime runs it asynchronously, like the model call, instead of in the engine's thread
    (the launch's real work is in custom calls, which XLA counts as free)."""
    ring = cstate.log.ring
    return jnp.max(ring.reshape(-1)[:COST_HINT_ELEMENTS])


class StepRecord(NamedTuple):
    """A launch as the canary planned it: the batch id of its step, the step's arrays
    (``layout.step_arrays``: device arrays, read on the host only when the launch recorded rows,
    to find the batch rows they name: ``request_guard.named_batch_rows``) and whether it was a DECODE
    step."""

    bid: Optional[int]
    arrays: dict
    decode: bool


#: launches whose ``StepRecord`` is kept (the readback runs at most a few steps behind)
KEPT_STEP_RECORDS = 16
#: with a gate per batch, readbacks left for the gates to decode (more are decoded by the step)
GATED_PENDING = 4
#: how long the report before an engine error waits for the batch last handed to the forward
#: (the overlap scheduler's forward thread) to reach the canary's launch, in seconds
LAUNCH_WAIT_S = 3.0


class IdleReporter:
    """A daemon thread that reports while the serving steps have stopped (``touch`` marks a step).

    Two stages, so that what the last steps found is reported while the server is idle instead of
    with the next request's steps, without cutting a fault's episode in pieces on a server whose
    steps are slow: ``report(close=False)`` once no step came for ``idle_s`` seconds (decode the
    pending readbacks), then ``report(close=True)`` once none came for ``close_s`` seconds and for
    4 times the median of the last 8 intervals between steps (also end the open episodes).
    ``report`` returns False when it cannot report without waiting (a long step is still
    running on the device: the server is not idle); that stage is then tried again. An exception
    ``report`` raises (a ``CanaryViolationError`` in mode ``raise``) goes to ``on_error``, else
    it is logged."""

    def __init__(self, report: Callable[[bool], Optional[bool]], *, idle_s: float = 0.25,
                 close_s: float = 1.0, on_error: Optional[Callable[[BaseException], None]] = None,
                 logger: Optional[logging.Logger] = None):
        self.report = report
        self.idle_s = float(idle_s)
        self.close_s = float(close_s)
        self.on_error = on_error
        self.logger = logger or LOGGER
        self._last = time.monotonic()
        self._intervals = collections.deque(maxlen=8)
        self._stage = 2                          # 0: steps ran; 1: reported; 2: closed
        self._stepped = False
        threading.Thread(target=self._loop, name="kv-canary-idle", daemon=True).start()

    def touch(self) -> None:
        now = time.monotonic()
        if self._stepped:
            self._intervals.append(now - self._last)
        self._stepped = True
        self._last = now
        self._stage = 0

    def _loop(self) -> None:
        while True:
            time.sleep(self.idle_s / 2)
            idle = time.monotonic() - self._last
            if self._stage == 0 and idle >= self.idle_s:
                self._run(1, close=False)
            elif self._stage == 1 and idle >= max(self.close_s, 4 * self._typical_interval()):
                self._run(2, close=True)

    def _typical_interval(self) -> float:
        """The median of the last 8 intervals between steps (0 before the second step)."""
        return float(np.median(self._intervals)) if self._intervals else 0.0

    def _run(self, stage: int, close: bool) -> None:
        self._stage = stage
        try:
            if self.report(close) is False and self._stage == stage:
                self._stage = stage - 1                  # not done: try this stage again
        except BaseException as e:
            if self.on_error is not None:
                self.on_error(e)
            else:
                self.logger.error("kv-canary: %s", e)


class HostTime:
    """Seconds per step of some canary work, the last ``window`` steps kept. The canary measures
    its host work per step with ``time.thread_time`` (CPU time of the thread running it): the
    model wrapper's own code on the engine's forward thread, the engine's call excluded, plus the
    scheduler hooks' (``charged``) on the scheduler's thread; waits (for the GIL held by another
    thread, for the device) are not work and not counted."""

    def __init__(self, window: int = 1024):
        self.recent = collections.deque(maxlen=window)
        self.total = 0.0
        self.steps = 0

    def add(self, seconds: float) -> None:
        self.recent.append(seconds)
        self.total += seconds
        self.steps += 1

    def summary(self) -> str:
        """``median M us, p90 P us, mean A us`` of the recent steps."""
        if not self.recent:
            return "no steps"
        us = np.asarray(self.recent) * 1e6
        return (f"median {np.median(us):.1f} us, p90 {np.percentile(us, 90):.1f} us, "
                f"mean {us.mean():.1f} us")


class SglangJaxCanary:
    """The canary installed into one sglang-jax ``ModelRunner`` (made by ``install``).

    Args:
      runner: the engine's ``ModelRunner`` (sglang-jax 0.0.2 or main; ``layout.runner_layout``).
      config: the ``CanaryConfig``; mode ``'none'`` is refused (install nothing instead).
      tree_cache: the scheduler's ``RadixCache``; needed when ``config.sweep_interval > 0``.
      logger: where reports go (default ``logging.getLogger('jax_kvcanary')``).
      episodes: report one episode per fault (``runtime.EpisodeLog``) instead of every row.
      metrics: ``PrometheusCounters`` to keep up to date (None: no metrics).
      protected_tokens: returns the KV slots in use, for the stats line and the metrics.
      draft: the runner is an EAGLE draft model's (``speculative.install_draft_canary``): every
        step is planned from its attention metadata, and records hold KV positions.

    Attributes: ``config``, ``tp`` / ``dp`` (devices of the ``tensor`` / ``data`` axis),
    ``devices`` (``dp * tp``), ``state`` (the ``CanaryState``, donated by every step;
    ``[devices, ...]`` blocks, rank-major, when ``devices > 1``), ``num_slots`` (per rank), ``monitor``
    (``Monitor``: ``monitor.violations`` holds what was reported), ``steps``, ``sweeps``,
    ``layout`` (the runner adapter).

    Raises:
      TypeError, ValueError: a ``kv-canary:`` message for a runner or a setting it cannot cover.
    """

    def __init__(self, runner, config: CanaryConfig, *, tree_cache=None,
                 logger: Optional[logging.Logger] = None, episodes: bool = False,
                 metrics: Optional[PrometheusCounters] = None,
                 protected_tokens: Optional[Callable[[], int]] = None, draft: bool = False):
        if not isinstance(config, CanaryConfig):
            raise TypeError(f"kv-canary: config must be a CanaryConfig, got {type(config).__name__}")
        if not config.enabled:
            raise ValueError("kv-canary: mode 'none' installs nothing (do not call install)")
        if tuple(config.groups) != ("FULL",):
            raise ValueError("kv-canary: the sglang-jax integration watches the FULL group only")
        if config.sweep_interval and tree_cache is None:
            raise ValueError("kv-canary: sweep_interval > 0 needs the scheduler's tree_cache "
                             "(install(..., tree_cache=scheduler.tree_cache))")
        if config.sweep_interval and not hasattr(tree_cache, "root_node"):
            raise ValueError("kv-canary: sweeps walk a RadixCache; this tree_cache is a "
                             f"{type(tree_cache).__name__} (radix cache disabled?): use "
                             "sweep_interval=0")
        self.layout = runner_layout(runner)
        if "SWA" in self.layout.groups:              # a hybrid sliding-window pool: both groups
            if int(dict(runner.mesh.shape).get(TP_AXIS, 1)) > 1:
                raise ValueError("kv-canary: a hybrid SWA pool is guarded with --tp-size 1 "
                                 "(pools.swa_refusals)")
            config = dataclasses.replace(config, groups=self.layout.groups,
                                         swa_window_size=self.layout.swa_window)
        self.runner = runner
        self.draft = bool(draft)          # an EAGLE draft model's runner (``speculative``)
        self.tokens = intended_tokens(runner, self.layout, config)
        self.config = config
        self.tree_cache = tree_cache
        self.logger = logger or LOGGER
        self.episodes = bool(episodes)
        self.tp = int(dict(runner.mesh.shape).get(TP_AXIS, 1))   # tensor-parallel devices
        self.dp = self.layout.dp                                 # data-parallel attention ranks
        self.devices = self.dp * self.tp
        # several processes (sglang-jax's --nnodes): each reads back its own devices' blocks
        self.processes = len({getattr(d, "process_index", 0)
                              for d in np.asarray(runner.mesh.devices).reshape(-1)})
        self.num_slots = self.layout.geometry.num_slots // self.dp   # each rank's, padding incl.
        self._original = None                        # taken by install()
        self._original_sampler = None
        self._fused = None                           # (EngineJit, jitted step): install()
        self.fused_reason = "not installed"          # why the launch is not fused, else ""
        self._step_rows = None                       # the last step's (req_pool_indices, seq_lens)
        self._launch_tokens = None                   # host tokens of the batch being launched
        self._check_fn = self._build_check()
        self._sweep_fn = self._build_sweep()
        self._reset_ring_fn = self._build_ring_reset()
        self._pending_sweep = None                   # plans collected on the host, run by a step
        self._held = []                              # several processes: rows for the next gate
        self._sweep_lock = threading.Lock()
        self.sweeps_from_wrapper = True              # False once a scheduler hook requests them
        self.launch_hooks = []                       # f(schedule_batch), before each launch
        self.step_hooks = []                         # f(forward_batch), before each step
        self.violation_hooks = []                    # f(new violations), after each readback
        self.gate_hooks = []                         # f(batch, step), after gate()
        self.end_hooks = []                          # f(), when the engine's error ends the server
        self.gated = False                           # a scheduler hook calls gate() per batch
        self.host_tier = None                        # hicache.HostRecords, with HiCache
        self.transfer = None                         # pd.TransferRecords, on a PD server
        self.records = {}                            # monitor step -> StepRecord
        self._bid_steps = {}                         # batch id -> monitor step of its launch
        self.launches = 0                            # batches the scheduler hook has seen
        self._forwarded_bid = None                   # the batch id last handed to the forward
        self.steps = self.sweeps = 0
        self.warming = False                         # inside precompile: nothing is reported
        self.host_time = HostTime()                  # the canary's own time in each step
        self.hook_time = HostTime()                  # the scheduler hooks' part of it
        self._hooks_seconds = 0.0                    # the scheduler hooks' since the last step
        self._charge_lock = threading.Lock()
        self.metrics = metrics
        self.protected_tokens = protected_tokens or (lambda: -1)
        self._monitor_lock = threading.RLock()         # the steps and the idle reporter
        self.idle = IdleReporter(self._on_idle, logger=self.logger)
        self.state = None
        self.monitor = None
        self.reset()

    # -- lifecycle ------------------------------------------------------------------------------
    def _endpoints(self, write_req_capacity: int, verify_capacity: int) -> CanaryEndpoints:
        rows, entries = max(1, int(write_req_capacity)), max(1, int(verify_capacity))
        swa = {}
        if "SWA" in self.layout.groups:              # each row verifies its window at most
            swa = dict(swa_num_slots=self.layout.geometries["SWA"].num_slots,
                       swa_verify_capacity=min(entries, rows * self.layout.swa_window))
        return CanaryEndpoints(self.config, num_slots=self.num_slots, write_req_capacity=rows,
                               verify_capacity=entries, **swa)

    @property
    def _device_axes(self) -> tuple:
        """The mesh axes the canary state has a block per device of (rank-major)."""
        return tuple(a for a, n in ((DP_AXIS, self.dp), (TP_AXIS, self.tp)) if n > 1)

    def _state_sharding(self):
        """Where the canary state lives: replicated over the runner's mesh, or one block per
        device of its ``data`` and ``tensor`` axes (``runtime.multidevice``)."""
        axes = self._device_axes
        spec = PartitionSpec(axes if len(axes) > 1 else axes[0]) if axes else PartitionSpec()
        return NamedSharding(self.runner.mesh, spec)

    def device_names(self) -> list:
        """Each canary device's label in reports: its ``dp_rank`` (with data-parallel attention),
        its tensor-parallel index and the JAX device, in the state's block order."""
        mesh = self.runner.mesh
        names, devs = tuple(mesh.axis_names), np.asarray(mesh.devices)
        if devs.size == self.devices and {DP_AXIS, TP_AXIS} <= set(names):
            devs = np.moveaxis(devs, (names.index(DP_AXIS), names.index(TP_AXIS)),
                               (0, 1)).reshape(self.dp, self.tp)
            where = lambda r, t: ((f"process={devs[r, t].process_index} "
                                   if self.processes > 1 else "") + f"({devs[r, t]})")
        else:                                       # a mesh of other axes: no device to name
            where = lambda r, t: ""
        return [((f"dp_rank={r} " if self.dp > 1 else "") + (f"tensor={t} " if self.tp > 1
                                                             else "") + where(r, t)).strip()
                for r in range(self.dp) for t in range(self.tp)]

    def reset(self) -> None:
        """Fresh canary state (zero records, empty ring) and a fresh monitor; e.g. after
        sglang-jax's warm-up, whose synthetic batches would otherwise leave records behind.
        """
        # placed as the launches' outputs are, so that every step of a bucket runs the program
        # compiled for it
        init = self._endpoints(1, 1).init_state()
        if self.devices > 1:
            init = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x)[None],
                                                          (self.devices,) + x.shape).copy(), init)
        self.state = jax.device_put(init, self._state_sharding())
        c = self.config
        # the stats line is the canary's own (``stats``); the monitor decodes the counters for it
        unswept = {launch_tag("SWEEP", h, g) for g in c.groups if g not in SWEPT_GROUPS
                   for h in c.halves}
        self.monitor = Monitor(c.mode, health_interval=c.health_interval,
                               expected_tags=[t for t in c.expected_tags() if t not in unswept],
                               logger=self.logger,
                               episodes=EpisodeLog() if self.episodes else None,
                               device_names=self.device_names() if self.devices > 1 else None,
                               all_processes=self.processes > 1,
                               counters_interval=c.stats_interval or (
                                   COUNTERS_INTERVAL if self.metrics is not None else 0))
        self._seen_counters = None
        self.steps = self.sweeps = self.launches = 0
        self.records.clear()
        self._bid_steps.clear()
        self.host_time, self.hook_time = HostTime(), HostTime()
        with self._charge_lock:
            self._hooks_seconds = 0.0
        with self._sweep_lock:
            self._pending_sweep = None
        if self.tokens is not None:
            self.tokens.reset()

    def install(self) -> "SglangJaxCanary":
        """Wrap the runner's ``jitted_run_model`` (again after the engine re-ran
        ``initialize_jit``, which sets a new one)."""
        if not self.installed:
            self._original = self.runner.jitted_run_model
            self._fused = self._build_fused()
            self.runner.jitted_run_model = self._run_model
            if self.tokens is not None:
                self._original_sampler = self.runner.jitted_sampler
                self.runner.jitted_sampler = self._sample
        return self

    def uninstall(self) -> None:
        """Put the runner's original ``jitted_run_model`` back."""
        if self.installed:
            self.runner.jitted_run_model = self._original
            if self._original_sampler is not None:
                self.runner.jitted_sampler = self._original_sampler

    @property
    def fused(self) -> bool:
        """True when each step's checks run in the engine's own program (``fused``)."""
        return self._fused is not None

    @property
    def installed(self) -> bool:
        """True while the runner's ``jitted_run_model`` is this canary's wrapper."""
        return self.runner.jitted_run_model == self._run_model

    def precompile(self, engine_precompile: Optional[Callable[[], None]] = None) -> None:
        """Compile everything the request path runs, then start from a fresh state.

        Args:
          engine_precompile: the engine's own precompile (e.g. ``tp_worker.run_precompile``), run
            with the canary installed so that the step is compiled for each of the engine's
            batch and token buckets; None to compile the sweeps only. Its synthetic batches
            report nothing and leave nothing behind.
        """
        self.install()
        self.warming = True
        try:
            if engine_precompile is not None:
                engine_precompile()
            if self.config.sweep_interval:
                cap = bucket_capacity(self.num_slots)
                for c in (1 << k for k in range(DEFAULT_MIN_CAPACITY.bit_length() - 1,
                                                cap.bit_length())):
                    plans = self._sweep_plans([np.zeros((0, 3), np.int64)] * self.dp, c)
                    self.state, _ = self._sweep_fn(self.state, plans, {"FULL": self.layout.fingerprinted()})
            if self.tokens is not None:
                self.tokens.precompile()
            self.state = self._reset_ring_fn(self.state)
            jax.block_until_ready(self.state)
        finally:
            self.warming = False
            self.reset()

    # -- the jitted functions -------------------------------------------------------------------
    def _build_check(self):
        """The jitted launch after the engine's model call (where it is not fused into the
        engine's program: ``fused``), the canary state donated."""
        check = self._check_body()
        if self.devices > 1:
            return jax.jit(check, donate_argnums=(0,), static_argnames=("decode",))
        return jax.jit(check, donate_argnums=(0,), static_argnames=("decode",),
                       out_shardings=self._state_sharding())

    def _build_fused(self):
        """The engine's model call and the canary's check as one jitted program
        (``fused.fused_step``), or None (with ``self.fused_reason``) where the runner's
        ``jitted_run_model`` is not sglang-jax's wrapper of its jit."""
        engine, self.fused_reason = engine_jit(self._original)
        if engine is None:
            return None
        return engine, fused_step(engine, self._check_body(), self.layout.step_kvs,
                                  draft=self.draft, state_sharding=None if self.devices > 1
                                  else self._state_sharding())

    def _check_body(self):
        """The launch's function ``check(cstate, arrays, kvs, decode=...) -> (cstate, counter
        snapshot, cost hint)``: HEAD then TAIL on one plan, the counter snapshot for the monitor
        computed in the same launch; per device under ``jax.shard_map`` on several devices."""
        mode = self.config.real_kv_hash_mode
        layout = self.layout
        page_size, aligned, mesh = layout.page_size, layout.aligned_segments, self.runner.mesh
        everywhere_axes = tuple(mesh.axis_names)

        def check(cstate, arrays, kvs, decode, mesh=mesh):
            ep = self._endpoints(arrays["seq_lens"].shape[0], table_entries(arrays, page_size))
            batch = page_table_batch(arrays, decode=decode, page_size=page_size, aligned=aligned,
                                     mesh=mesh, kv_positions=self.draft)
            if "swa_lut" in arrays:
                batch = batch._replace(full_to_swa_index_mapping=arrays["swa_lut"])
            if "token_pool" in arrays:
                batch = with_intended_tokens(batch, arrays["token_pool"],
                                             replicated(mesh)(arrays["req_pool_indices"]))
            hint = cost_hint(cstate)
            cstate, ctx = ep.head(cstate, batch)
            sources = layout.sources(kvs, mode) if mode else {}
            cstate = ep.tail(cstate, ctx, sources)
            snapshot = counter_snapshot(cstate)
            if self.processes > 1:               # every process's rows, for its monitor
                everywhere = jax.lax.psum(cstate.log.write_index.reshape(()), everywhere_axes)
                snapshot = jnp.concatenate([snapshot, jax.lax.bitcast_convert_type(
                    everywhere.astype(jnp.int32), jnp.uint8)])
            return cstate, snapshot, hint

        return self._per_device(check, static=("decode",)) if self.devices > 1 else check

    def _per_device(self, fn, static=()):
        """``fn(cstate, arrays, kv0, **static)`` under ``jax.shard_map`` over the runner's mesh:
        each device runs it on its own canary state (its block), on its own shard of the KV (its
        rank's slots and its heads: the real-KV fingerprints are of the device's own heads,
        nothing is gathered across devices) and on its rank's section of the batch arrays
        (``P("data")``; replicated without data parallelism, and for ``REPLICATED_ARRAYS``);
        the outputs get the device axis back."""
        kv_spec = getattr(getattr(self.layout.kv(), "sharding", None), "spec", PartitionSpec())
        mesh, state_spec = self.runner.mesh, self._state_sharding().spec
        section = PartitionSpec(DP_AXIS) if self.dp > 1 else PartitionSpec()

        def run(cstate, arrays, kvs, **kw):
            def body(cs, arr, kv):
                out = fn(local_view(cs), arr, kv, mesh=None, **kw)
                return global_view(out)

            specs = {k: PartitionSpec() if k in REPLICATED_ARRAYS else section for k in arrays}
            arrays = {k: jax.tree.map(lambda x, s=specs[k]: jax.sharding.reshard(
                x, NamedSharding(mesh, s)), v) for k, v in arrays.items()}
            return jax.shard_map(body, mesh=mesh, in_specs=(state_spec, specs, jax.tree.map(
                lambda _: kv_spec, kvs)), out_specs=state_spec)(cstate, arrays, kvs)

        return run

    def _build_sweep(self):
        mode, layout = self.config.real_kv_hash_mode, self.layout
        ep = self._endpoints(1, 1)

        def sweep(cstate, plans, kvs, mesh=None):
            sources = layout.sources(kvs, mode) if mode else {}
            if self.dp > 1:                          # inside shard_map: the rank's own plans
                plans = local_view(plans)
            return ep.sweep(cstate, plans, sources), cost_hint(cstate)

        if self.devices > 1:
            sweep = self._per_device(sweep)
            return jax.jit(sweep, donate_argnums=(0,))
        return jax.jit(sweep, donate_argnums=(0,), out_shardings=self._state_sharding())

    def _build_ring_reset(self):
        """The jitted ``write_index`` reset of the violation ring (every device's), the state
        donated: once the host has decoded every row, the ring takes new rows from row 0 again, so
        that it never fills up over a server's life (``_recycle_ring``)."""

        def reset(cstate):
            log = cstate.log
            return cstate.replace(log=ViolationLog(
                log.ring, jnp.zeros_like(log.write_index), log.kernel_run_counters,
                log.slot_run_counters, log.enable_chain_position_assert))

        return jax.jit(reset, donate_argnums=(0,), out_shardings=self._state_sharding())

    # -- sweeps ---------------------------------------------------------------------------------
    def request_sweep(self) -> int:
        """Collect the chains of every slot the prefix cache holds, for the next step to verify
        against the tail canaries (SWEEP tags, on that step's layer-0 KV). Call it where the radix
        tree is consistent (the scheduler's thread, between batches); returns the slots collected."""
        chains = radix_chains(self.tree_cache, self.dp)
        plans = self._sweep_plans(chains)
        with self._sweep_lock:
            self._pending_sweep = plans
        return sum(int(c.shape[0]) for c in chains)

    def _sweep_plans(self, chains: list, min_capacity: int = DEFAULT_MIN_CAPACITY):
        """The sweep's plans of each rank's chains (``radix_chains``): one rank's as they are;
        with data parallelism stacked ``[dp, ...]`` at one capacity (the launch gives each rank
        its own)."""
        if self.dp == 1:
            return build_group_sweep_plans(chains[0], SWEPT_GROUPS, min_capacity=min_capacity)
        cap = max(bucket_capacity(c.shape[0], min_capacity) for c in chains)
        per_rank = [build_group_sweep_plans(c, SWEPT_GROUPS, min_capacity=cap) for c in chains]
        return jax.tree.map(lambda *x: np.stack(x), *per_rank)

    def before_launch(self, batch) -> None:
        """The scheduler hook (``install_into_scheduler``): called with each ``ScheduleBatch``
        before it is launched; requests a sweep every ``sweep_interval`` launches and runs the
        ``launch_hooks``; with the write-input assert or the token check, collects an EXTEND
        batch's intended tokens (``tokens.TokenMirror.host_tokens``) for ``before_forward``."""
        self.launches += 1
        if self.tokens is not None and batch.forward_mode.is_extend():
            self._launch_tokens = self.tokens.host_tokens(batch_requests(batch))
        si = self.config.sweep_interval
        if si and self.launches % si == 0:
            self.request_sweep()
        for hook in self.launch_hooks:
            hook(batch)

    def before_forward(self, model_worker_batch) -> None:
        """The tp worker hook (``install_into_scheduler``), in the scheduler's thread: the batch
        being launched has got its batch id (kept: ``report_before_engine_error`` waits for its
        launch); the step with that id applies its host tokens."""
        self._forwarded_bid = getattr(model_worker_batch, "bid", None)
        chunks, self._launch_tokens = self._launch_tokens, None
        if chunks is not None:
            self.tokens.expect(model_worker_batch.bid, chunks)

    def _run_pending_sweep(self, kvs) -> None:
        with self._sweep_lock:
            plans, self._pending_sweep = self._pending_sweep, None
        if plans is not None:
            self.state, _ = self._sweep_fn(self.state, plans, kvs)
            self.sweeps += 1

    def sweep_now(self) -> int:
        """Collect and run a sweep at once on the engine's current layer-0 KV (between steps, in
        the scheduler's thread without the overlap schedule); returns the slots swept."""
        n = self.request_sweep()
        with self._monitor_lock:
            self._run_pending_sweep({"FULL": self.layout.fingerprinted()})
        return n

    # -- per step -------------------------------------------------------------------------------
    def _run_model(self, forward_batch, logits_metadata):
        self.steps += 1
        if not self.warming:
            for hook in self.step_hooks:               # fault injection (not canary work)
                hook(forward_batch)
        t0 = time.thread_time()
        si = self.config.sweep_interval
        if self.sweeps_from_wrapper and si and self.steps % si == 0 and not self.warming:
            self.request_sweep()                       # the caller's thread: its radix tree
        swa_lut = self._swa_map_snapshot()
        engine_s = 0.0                                 # the engine's call is not canary time
        if self._fused is None:                        # the engine's program, then the launch
            t = time.thread_time()
            outputs = self._engine_call(self._original, forward_batch, logits_metadata)
            engine_s = time.thread_time() - t
        # held from the launch (which donates the canary state) to the readback, so that the
        # idle reporter never reads a state a launch has donated
        with self._monitor_lock:
            extra = self._step_extra(forward_batch, swa_lut)
            if self._fused is not None:                # one program: the engine's and the check
                if self._pending_sweep is not None:    # set by the scheduler's thread
                    self._run_pending_sweep({"FULL": self.layout.fingerprinted()})
                engine, step = self._fused
                t = time.thread_time()
                outputs, self.state, snapshot = self._engine_call(
                    step, engine.leaves(), forward_batch, self.layout.donated_pool(),
                    logits_metadata, self.state, extra)
                engine_s = time.thread_time() - t
            try:
                arrays = step_arrays(forward_batch, from_attention=self.draft)
                if extra:
                    arrays.update(extra)
                decode = not self.draft and bool(forward_batch.forward_mode.is_decode())
                if self._fused is None:
                    kvs = self.layout.step_kvs(outputs)    # the KV as the forward left it
                    self._run_pending_sweep({"FULL": kvs["FULL"]})
                    self.state, snapshot, _ = self._check_fn(self.state, arrays, kvs,
                                                             decode=decode)
                if self.warming:
                    return outputs
                # gated, each readback is decoded by its batch's gate, not polled here
                new = self.monitor.step(self.state, snapshot=snapshot, wait=False,
                                        keep=GATED_PENDING if self.gated else 1)
                self._remember(StepRecord(getattr(forward_batch, "bid", None), arrays, decode))
                if not self.gated:
                    new += self._recycle_ring()
                self._after_readback(new)
            except BaseException:
                # mode 'raise' (or a health failure): the step has donated the KV pool already,
                # so hand the engine its new buffers before raising, as its own forward would
                self.layout.store_kv(outputs, forward_batch)
                raise
            finally:
                if not self.warming:
                    self.idle.touch()
        with self._charge_lock:
            hooks, self._hooks_seconds = self._hooks_seconds, 0.0
        self.host_time.add(time.thread_time() - t0 - engine_s + hooks)
        self.hook_time.add(hooks)
        si = self.config.stats_interval
        if si and self.steps % si == 0:
            self.logger.info("%s; canary time per step over the last %d steps: %s (of which "
                             "scheduler hooks: %s)",
                             CanaryTotals.read(self).stats_line(self.protected_tokens()),
                             len(self.host_time.recent), self.host_time.summary(),
                             self.hook_time.summary())
        return outputs

    def charged(self, fn, *args):
        """``fn(*args)``, canary work done outside the model wrapper (the scheduler hooks of
        ``install_into_scheduler``, on the scheduler's thread), its CPU time added to the next
        step's host time."""
        t = time.thread_time()
        try:
            return fn(*args)
        finally:
            spent = time.thread_time() - t
            with self._charge_lock:
                self._hooks_seconds += spent

    @staticmethod
    def _engine_call(fn, *args):
        """``fn(*args)``: the engine's model call (alone, or fused with the check); an error it
        raises is marked as the engine's (``server.guard_engine`` says so)."""
        try:
            return fn(*args)
        except Exception as e:
            e.kv_canary_engine_error = True
            raise

    def _step_extra(self, forward_batch, swa_lut) -> dict:
        """The step arrays that are not the batch's own: the SWA map snapshot, and with the
        write-input assert or the token check the token pool, its host tokens applied."""
        extra = {}
        if swa_lut is not None:
            extra["swa_lut"] = swa_lut
        if self.tokens is not None:
            self.tokens.before_step(getattr(forward_batch, "bid", None))
            extra["token_pool"] = self.tokens.pool
            # a verify samples nothing (speculative.record_verified_tokens)
            self._step_rows = (None if forward_batch.forward_mode.is_target_verify()
                               else (forward_batch.req_pool_indices, forward_batch.seq_lens))
        return extra

    def _swa_map_snapshot(self):
        """With a hybrid SWA pool: the full-to-SWA map as this step's attention reads it, copied
        to the device before the model call (the engine's allocator edits its host array in
        place; the engine's own call copies it at the same point), else None."""
        if "SWA" not in self.layout.groups:
            return None
        return jax.device_put(np.array(self.layout.swa_map(), np.int32),
                              NamedSharding(self.runner.mesh, PartitionSpec()))

    def _remember(self, record: StepRecord) -> None:
        """Keep the ``StepRecord`` of the launch just pumped (the monitor's current step), and
        drop the one ``KEPT_STEP_RECORDS`` steps older (monitor steps count up by one)."""
        step = self.monitor.steps
        self.records[step] = record
        if record.bid is not None:
            self._bid_steps[int(record.bid)] = step
        old = self.records.pop(step - KEPT_STEP_RECORDS, None)
        if old is not None and old.bid is not None:
            self._bid_steps.pop(int(old.bid), None)

    def _recycle_ring(self) -> list:
        """If rows were recorded since the ring's last reset: decode every pending readback (blocks
        on the last launch), then reset the device ring, so that it never fills up. Returns the
        rows decoded. The monitor's lock is held."""
        if not self.monitor.ring_has_rows or self.monitor.stopped:
            return []
        new = self.monitor.flush(close_episodes=False)
        self.state = self._reset_ring_fn(self.state)
        self.monitor.ring_recycled()
        return new

    def gate(self, batch, bid: Optional[int]) -> Optional[int]:
        """What the launch of batch ``bid`` found, before the scheduler acts on that batch's
        results (called by the scheduler hook of ``install_into_scheduler``, once the launch has
        been dispatched): decode the readbacks up to that launch (blocks on it), recycle the ring
        if it holds rows, hand new rows to the ``violation_hooks``, then call the ``gate_hooks``
        with ``(batch, step)``. Returns the launch's monitor step, or None when no launch of
        the canary had that batch id (nothing to wait for)."""
        step = None if bid is None else self._bid_steps.get(int(bid))
        return None if step is None else self.gate_through(batch, step)

    def gate_through(self, batch, step: int) -> Optional[int]:
        """``gate`` for the launches up to monitor step ``step`` (e.g. ``monitor.steps``, the
        last one: an EAGLE draft model's steps, all launched by the batch's own
        ``run_batch``); returns ``step``, or None while the canary warms up."""
        with self._monitor_lock:
            if self.warming:
                return None
            new = self.monitor.flush_through(step)
            if self.processes > 1:
                new = self._share_rows(new)
                every = self.monitor.counters_interval
                if self.metrics is not None and every and step % every == 0:
                    # every process's counters of this step, summed on every process (node 0
                    # serves them on /metrics)
                    self.metrics.update(CanaryTotals.everywhere(self), self.protected_tokens())
            new += self._recycle_ring()
            self._after_readback(new, shared=True)
        for hook in self.gate_hooks:
            hook(batch, step)
        return step

    def _share_rows(self, new: list) -> list:
        """With several processes, at a gate: the rows this process has decoded and not handed on
        yet (``new`` and the ones held by ``_after_readback``), with every other process's, so
        that every process's ``violation_hooks`` (the request guard) get the same rows at the same
        gate. Two collectives, run when the launch's total of every device's rows (the same
        number on every process at this gate) says there are rows; without rows anywhere, only
        this process's held rows (none) are returned."""
        held, self._held = self._held + list(new), []
        if self.monitor.everywhere == 0:
            return held
        from jax.experimental import multihost_utils

        mine = np.array([[*v.row, -1 if v.device is None else v.device, v.launch_step or 0]
                         for v in held], np.int64).reshape(-1, 10)
        counts = np.asarray(multihost_utils.process_allgather(
            np.array([mine.shape[0]], np.int64))).reshape(-1)
        padded = np.zeros((max(1, int(counts.max())), 10), np.int64)
        padded[:mine.shape[0]] = mine
        every = np.asarray(multihost_utils.process_allgather(padded))
        others = [Violation(r[:8].copy(), "", self.monitor.steps, i, 0, 0, int(r[8]), int(r[9]))
                  for p in range(every.shape[0]) if p != jax.process_index()
                  for i, r in enumerate(every[p, :int(counts[p])])]
        return held + others

    def report_host_rows(self, rows) -> list:
        """Report rows found on the host (a check of KV that left the device, e.g. the HiCache
        host copy: ``hicache``) in the scheduler's thread, as the monitor reports them (log, or
        raise in mode ``raise``); returns the new violations."""
        with self._monitor_lock:
            if self.warming:
                return []
            return self.monitor.report_rows(rows)

    def _sample(self, *args, **kwargs):
        """The engine's sampler, then its tokens stored as the requests' next inputs (the
        write-input assert and the token check: ``tokens.TokenMirror.after_sample``)."""
        out = self._original_sampler(*args, **kwargs)
        rows, self._step_rows = self._step_rows, None
        if rows is not None:
            self.tokens.after_sample(*rows, out[0])
        return out

    def _after_readback(self, new, shared: bool = False) -> None:
        """After a readback (the monitor's lock held): hand its new violations to the
        ``violation_hooks``, and bring the metrics up to date if the counters were read. With
        several processes, rows decoded outside a gate are held for the next gate's
        ``_share_rows`` (``shared``: these are a gate's shared rows)."""
        if self.processes > 1 and not shared:
            self._held += list(new)
            new = []
        if new:
            for hook in self.violation_hooks:
                hook(new)
        if (self.metrics is not None and self.processes == 1
                and self.monitor.counters is not self._seen_counters):
            self._seen_counters = self.monitor.counters
            self.metrics.update(CanaryTotals.read(self), self.protected_tokens())

    def _on_idle(self, close: bool) -> bool:
        """No step for a while (``IdleReporter``): report what the last steps found now, rather
        than with the next request's steps; ``close``: the server has stayed idle, end the open
        episodes too. Returns False, doing nothing, while the last step still runs on the device
        (a long prefill is not an idle server, and waiting on it here, holding the lock, would
        stall the next step's launch)."""
        return self._report_pending(close, wait=False)

    def _report_pending(self, close: bool, wait: bool) -> bool:
        """Decode the pending readbacks and hand their rows on (``_after_readback``); ``close``:
        end the open episodes too. Without ``wait``, returns False, doing nothing, while the last
        step still runs on the device."""
        with self._monitor_lock:
            if self.warming or self.monitor is None:
                return True
            if not wait and not self.monitor.ready:
                return False
            new = self.monitor.flush(close_episodes=False) if self.monitor.pending else []
            # with several processes the ring is reset only at a gate, where every process
            # decides at the same step (the reset is a launch over all of them)
            new += self._recycle_ring() if self.processes == 1 else []
            if self.metrics is not None:           # the metrics as of the last step
                self.monitor.refresh_counters()
            self._after_readback(new)
            if close:
                self.monitor.close_episodes()
            return True

    def report_before_engine_error(self, error: BaseException) -> None:
        """The engine's scheduler loop raised ``error``, which ends the server: report what the
        canary's last steps found first (waiting on their readback, ending the open episodes),
        so that a KV fault that led to the engine's own error is not lost with the process. A
        failure here is logged; it never replaces the engine's error."""
        try:
            bid, deadline = self._forwarded_bid, time.monotonic() + LAUNCH_WAIT_S
            while (bid is not None and int(bid) not in self._bid_steps
                   and time.monotonic() < deadline):
                time.sleep(0.01)               # the overlap forward thread has yet to launch it
            if self.warming or self.monitor is None:
                return
            self._report_pending(close=True, wait=True)
            for hook in self.end_hooks:
                hook()
            self.logger.error("kv-canary: the engine's scheduler raised %s; the canary's last "
                              "steps are reported above (%d violation row(s) since start)",
                              type(error).__name__, CanaryTotals.read(self).total_violations)
        except Exception as e:  # noqa: BLE001 (the engine's error is the one that ends the server)
            self.logger.error("kv-canary: reporting the last steps before the engine's error "
                              "failed (%s: %s)", type(e).__name__, e)

    def flush(self):
        """Report what the last step's readback holds (blocks on it); returns new violations."""
        with self._monitor_lock:
            new = self.monitor.flush()
            return new + self._recycle_ring()


def install(model_runner, config: CanaryConfig, *, tree_cache=None,
            logger: Optional[logging.Logger] = None, episodes: bool = False,
            metrics: Optional[PrometheusCounters] = None,
            protected_tokens: Optional[Callable[[], int]] = None,
            draft: bool = False) -> Optional[SglangJaxCanary]:
    """Install the canary into a running sglang-jax ``ModelRunner`` (see the module docstring).

    Args:
      model_runner: ``sgl_jax.srt.model_executor.model_runner.ModelRunner`` (after it initialised).
      config: the ``CanaryConfig`` (e.g. ``config_from_args``); mode ``'none'`` installs nothing.
      tree_cache: the scheduler's ``RadixCache``; needed when ``config.sweep_interval > 0``.
      logger: where reports go (default ``logging.getLogger('jax_kvcanary')``).
      episodes: log one report per episode (a fault's rows, counted: ``runtime.EpisodeLog``)
        instead of one per row.
      metrics: ``PrometheusCounters`` to keep up to date (None: no metrics).
      protected_tokens: returns the KV slots in use, for the stats line and the metrics.
      draft: ``model_runner`` is an EAGLE draft model's (``SglangJaxCanary``).

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
    return SglangJaxCanary(model_runner, config, tree_cache=tree_cache, logger=logger,
                           episodes=episodes, metrics=metrics,
                           protected_tokens=protected_tokens, draft=draft).install()


def install_into_scheduler(scheduler, config: CanaryConfig, **kw) -> Optional[SglangJaxCanary]:
    """``install`` on an sglang-jax ``Scheduler``: its model runner and its ``tree_cache``, and a
    hook on its ``run_batch`` that collects the prefix-cache sweeps in the scheduler's thread
    (the overlap scheduler runs the forward in a thread of its own while this one prepares the
    next batch). Call it after the engine's warm-up, or call ``precompile`` with the engine's
    precompile. Returns None for mode ``'none'``."""
    runner = scheduler.tp_worker.get_model_runner()
    canary = install(runner, config, tree_cache=getattr(scheduler, "tree_cache", None), **kw)
    if canary is None:
        return None
    canary.sweeps_from_wrapper = False
    run_batch = scheduler.run_batch

    def run_batch_with_canary(batch, *args, **kwargs):
        canary.charged(canary.before_launch, batch)
        return run_batch(batch, *args, **kwargs)

    scheduler.run_batch = run_batch_with_canary
    for name in ("event_loop_normal", "event_loop_overlap"):
        loop = getattr(scheduler, name, None)
        if loop is not None:
            setattr(scheduler, name, reporting_before_errors(loop, canary))
    gate_before_results(scheduler, canary)
    worker = scheduler.tp_worker
    forward_batch_generation = worker.forward_batch_generation

    def forward_batch_generation_with_canary(model_worker_batch, *args, **kwargs):
        canary.charged(canary.before_forward, model_worker_batch)
        return forward_batch_generation(model_worker_batch, *args, **kwargs)

    worker.forward_batch_generation = forward_batch_generation_with_canary
    return canary


def reporting_before_errors(loop, canary: SglangJaxCanary):
    """The scheduler's event loop ``loop``, reporting the canary's last steps when the engine's
    own error ends it (the canary's errors, mode ``raise`` and a failed health check, come with
    their report already)."""
    def event_loop(*args, **kwargs):
        try:
            return loop(*args, **kwargs)
        except (CanaryViolationError, CanaryHealthError):
            raise
        except BaseException as e:
            canary.report_before_engine_error(e)
            raise

    return event_loop


def gate_before_results(scheduler, canary: SglangJaxCanary) -> None:
    """Hook the scheduler so that ``canary.gate`` runs for every batch after its launch was
    dispatched and before its results are processed (before any of its requests can finish and
    answer its client): at the start of ``process_batch_result`` with the non-overlap scheduler
    (``run_batch`` ran the step), and right after ``tp_worker.resolve_last_batch_result`` with the
    overlap one (the forward thread has dispatched the step once it hands over the results)."""
    process = scheduler.process_batch_result
    overlap = bool(getattr(scheduler, "enable_overlap", False))
    worker = scheduler.tp_worker
    waiting = []                                   # (batch, bid) whose results are being resolved

    def process_batch_result_with_canary(batch, result, *args, **kwargs):
        bid = getattr(result, "bid", None)
        if not overlap:
            canary.charged(canary.gate, batch, bid)
            return process(batch, result, *args, **kwargs)
        waiting.append((batch, bid))
        try:
            return process(batch, result, *args, **kwargs)
        finally:
            waiting.clear()

    scheduler.process_batch_result = process_batch_result_with_canary
    if overlap:
        resolve = worker.resolve_last_batch_result

        def resolve_last_batch_result_with_canary(*args, **kwargs):
            out = resolve(*args, **kwargs)
            if waiting:
                canary.charged(canary.gate, *waiting.pop())
            return out

        worker.resolve_last_batch_result = resolve_last_batch_result_with_canary
    canary.gated = True
