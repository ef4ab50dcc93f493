"""The canary in sglang-jax's own server: refusals before start, and the scheduler it runs.

``refusals(server_args, config, inject)`` lists the settings the canary cannot cover (checked in
the launching process, before anything starts). ``guard_engine(config, inject)`` makes sglang-jax's
``launch_server`` start every scheduler with the canary:

- the scheduler process (multiprocessing ``spawn``): ``engine.run_scheduler_process`` becomes a
  ``functools.partial`` of ``run_guarded_scheduler_process`` here, which pickles by reference, so
  the child imports this module, swaps in ``GuardedScheduler`` and calls sglang-jax's own
  ``run_scheduler_process``;
- ``--enable-single-process``: the scheduler module's ``Scheduler`` is swapped in this process.

``GuardedScheduler`` is sglang-jax's ``Scheduler`` whose construction defers the engine's
precompile until the canary is installed, then runs it through ``SglangJaxCanary.precompile``, so
the canary's step is compiled for the engine's buckets before the first request.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
from typing import List, Optional

from ...runtime.config import CanaryConfig
from ...runtime.errors import CanaryHealthError, CanaryViolationError
from . import pools, speculative
from .canary import LOGGER, install_into_scheduler
from .hicache import install_host_records
from .pd import install_transfer_records
from .request_guard import install_request_guard
from .inject import (HICACHE_KINDS, PD_KINDS, SWA_KINDS, TOKEN_KINDS, VERIFY_KINDS, FaultInjector,
                     InjectSpec)
from .layout import ATTENTION_BACKENDS
from .metrics import PrometheusCounters, protected_tokens


def refusals(server_args, config: CanaryConfig, inject: Optional[InjectSpec] = None
             ) -> List[str]:
    """The ``kv-canary:`` lines of every setting the canary cannot cover (empty: it can start).

    Args:
      server_args: sglang-jax's parsed ``ServerArgs``.
      config: the canary's ``CanaryConfig`` (mode ``'none'`` refuses nothing).
      inject: the fault to plant, or None.
    """
    if not config.enabled:
        return []
    out = []

    def refuse(setting, why, fix):
        out.append(f"kv-canary: {setting} is not supported: {why}; {fix}")

    off = "or run with --kv-canary none"
    a = server_args
    for setting, why in node_refusals(a, config, inject):
        refuse(f"{setting} with --nnodes {a.nnodes}", why, f"serve from one node (--nnodes 1), "
               f"{off}")
    for setting, why in dp_refusals(a, config, inject):
        refuse(f"{setting} with --dp-size {a.dp_size}", why, f"run with --dp-size 1, {off}")
    for setting, why, fix in speculative.refusals(a, config, inject):
        refuse(setting, why, f"{fix}, {off}")
    if a.enable_lora:
        refuse("--enable-lora", "LoRA batches change the model call the canary wraps",
               f"drop it, {off}")
    if getattr(a, "multimodal", False):
        refuse("--multimodal", "the multimodal server has schedulers of its own", off)
    if getattr(a, "disaggregation_mode", "null") not in (None, "null"):
        for flag, name in (("disaggregation_use_raiden", "--disaggregation-use-raiden"),
                           ("disaggregation_enable_d2h", "--disaggregation-enable-d2h")):
            if getattr(a, flag, False):
                refuse(f"{name} with --disaggregation-mode {a.disaggregation_mode}",
                       "the canary's records travel with the jax_transfer pull from device "
                       "memory only (not run here otherwise)", f"drop {name}, {off}")
        if int(a.tp_size) != 1:
            refuse(f"--tp-size {a.tp_size} with --disaggregation-mode {a.disaggregation_mode}",
                   "PD with tensor parallelism has not run here", f"use --tp-size 1, {off}")
    if getattr(a, "pd_disaggregation", ""):
        refuse(f"--pd-disaggregation {a.pd_disaggregation}",
               "its fused forward_and_sample path bypasses the wrapped model call", off)
    if getattr(a, "hicache_storage", "disable") not in (None, "disable", "none"):
        refuse(f"--hicache-storage {a.hicache_storage}",
               "records do not travel to the L3 storage tier (the host tier is guarded)",
               f"use --hicache-storage none, {off}")
    if a.attention_backend not in ATTENTION_BACKENDS:
        refuse(f"--attention-backend {a.attention_backend}",
               "the canary reads the page table as the native and fa backends do",
               f"use --attention-backend native, {off}")
    if config.sweep_interval and a.disable_radix_cache:
        refuse(f"--kv-canary-sweep-interval {config.sweep_interval} with --disable-radix-cache",
               "sweeps walk the radix cache", "use --kv-canary-sweep-interval 0")
    if config.sweep_interval and getattr(a, "enable_unified_radix_tree", False):
        refuse(f"--kv-canary-sweep-interval {config.sweep_interval} with "
               "--enable-unified-radix-tree", "sweeps walk the plain radix cache",
               "use --kv-canary-sweep-interval 0")
    checks_tokens = config.write_input_assert or config.token_check
    if checks_tokens and getattr(a, "enable_mixed_chunk", False):
        refuse("--kv-canary-write-input-assert / --kv-canary-token-check with --enable-mixed-chunk",
               "a mixed batch's decode tokens are not in its requests' host state",
               "drop --enable-mixed-chunk")
    if (inject is not None and inject.kind in HICACHE_KINDS
            and getattr(a, "hicache_storage", "disable") != "none"):
        refuse(f"--kv-canary-inject {inject.kind} without HiCache",
               "that fault is planted in the host tier's copies", "add --hicache-storage none")
    if (inject is not None and inject.kind in PD_KINDS
            and getattr(a, "disaggregation_mode", "null") != "decode"):
        refuse(f"--kv-canary-inject {inject.kind} without --disaggregation-mode decode",
               "that fault is planted in a PD decode server's receive", "start it on the decode "
               "server")
    if inject is not None and inject.kind in TOKEN_KINDS and not config.write_input_assert:
        refuse(f"--kv-canary-inject {inject.kind} without --kv-canary-write-input-assert",
               "that fault is found by the write-input assert",
               "add --kv-canary-write-input-assert")
    if inject is not None and inject.kind == "real_kv_unused_cache" and not config.sweep_interval:
        refuse("--kv-canary-inject real_kv_unused_cache without sweeps",
               "that fault is found by a sweep", "add --kv-canary-sweep-interval N")
    if (inject is not None and (inject.on_draft or inject.kind in VERIFY_KINDS)
            and not speculative.is_speculative(a)):
        refuse(("--kv-canary-inject-group DRAFT" if inject.group == "DRAFT" else
                f"--kv-canary-inject {inject.kind}") + " without --speculative-algorithm",
               "there is no draft model" if inject.group == "DRAFT" else
               "that fault is planted in speculative decoding",
               "add --speculative-algorithm EAGLE3 (or EAGLE)")
    if inject is not None and inject.kind in VERIFY_KINDS and not config.token_check:
        refuse(f"--kv-canary-inject {inject.kind} without --kv-canary-token-check",
               "that fault is found by the token check", "add --kv-canary-token-check")
    return out


#: the faults planted with data-parallel attention (batch row 0: rank 0's first request) and on
#: several nodes (in the KV shards of ``--kv-canary-inject-node``)
SCALE_INJECT_KINDS = ("real_kv_used",)


def _not_guarded_at_scale(a, config: CanaryConfig, inject: Optional[InjectSpec],
                          where: str) -> List[tuple]:
    """``(setting, why)`` of the features not guarded ``where`` (with data-parallel attention,
    on several nodes) yet."""
    out = []
    if config.write_input_assert or config.token_check:
        out.append(("--kv-canary-write-input-assert / --kv-canary-token-check",
                    f"the intended tokens are not kept {where}"))
    if speculative.is_speculative(a):
        out.append((f"--speculative-algorithm {a.speculative_algorithm}",
                    f"the draft model's canary has not run {where}"))
    if getattr(a, "hicache_storage", "disable") not in (None, "disable"):
        out.append((f"--hicache-storage {a.hicache_storage}",
                    f"the host tier's records are not kept {where}"))
    if getattr(a, "disaggregation_mode", "null") not in (None, "null"):
        out.append((f"--disaggregation-mode {a.disaggregation_mode}", f"PD has not run {where}"))
    if inject is not None and (inject.kind not in SCALE_INJECT_KINDS or inject.group != "FULL"):
        out.append((f"--kv-canary-inject {inject.kind}"
                    + (f" --kv-canary-inject-group {inject.group}" if inject.group != "FULL"
                       else ""), f"the faults planted {where} are {', '.join(SCALE_INJECT_KINDS)}"))
    return out


def node_refusals(a, config: CanaryConfig, inject: Optional[InjectSpec]) -> List[tuple]:
    """``(setting, why)`` of what is not guarded on several nodes (``--nnodes`` > 1, one process
    each) yet: every mode is, each process reading back its own devices and every process
    deciding on the rows of all of them at the same step (``canary``)."""
    if int(getattr(a, "nnodes", 1) or 1) == 1:
        return []
    out = []
    if not getattr(a, "disable_overlap_schedule", False):
        out.append(("the overlap scheduler (add --disable-overlap-schedule)",
                    "it has not run guarded on several nodes"))
    return out + _not_guarded_at_scale(a, config, inject, "on several nodes")


def dp_refusals(a, config: CanaryConfig, inject: Optional[InjectSpec]) -> List[tuple]:
    """``(setting, why)`` of what is not guarded with data-parallel attention (``--dp-size`` >
    1) yet; each rank's slots, batch sections and sweeps are (``canary``)."""
    if int(a.dp_size) == 1:
        return []
    return _not_guarded_at_scale(a, config, inject, "with data-parallel attention")


def model_refusals(server_args, config: Optional[CanaryConfig] = None,
                   inject: Optional[InjectSpec] = None) -> List[str]:
    """Refusals that need the model's config (read from ``--model-path``; nothing is loaded): the
    KV pool class sglang-jax would build for it (``pools``), and with the hybrid sliding-window
    pool the settings not guarded with it yet (``pools.swa_refusals``)."""
    from sgl_jax.srt.configs.model_config import ModelConfig

    try:
        cfg = ModelConfig.from_server_args(server_args)
    except Exception:  # the stock server reports a model it cannot read
        return []
    built = pools.engine_pools(server_args, cfg)
    for line in map(pools.refusal, built):
        if line:
            return [line + (f" (inside the {built[0]})" if len(built) > 1 else "")]
    pool = built[0]
    if int(getattr(server_args, "dp_size", 1) or 1) > 1 and built != ["MHATokenToKVPool"]:
        return [f"kv-canary: --dp-size {server_args.dp_size} with the KV pool "
                f"{' around '.join(built)} is not supported: data-parallel attention is guarded "
                "with the MHA KV pool; run with --dp-size 1, or run with --kv-canary none"]
    if inject is not None and inject.on_swa and pool != "SWAKVPool":
        what = inject.kind if inject.kind in SWA_KINDS else f"{inject.kind} on the SWA group"
        return [f"kv-canary: --kv-canary-inject {what} is not supported with the KV pool "
                f"{pool}: that fault is planted in a hybrid SWA pool's SWA group; serve a "
                "sliding-window model without --disable-hybrid-swa-memory"]
    if pool == "SWAKVPool":
        return [f"kv-canary: {setting} is not supported: {why}; {fix}"
                for setting, why, fix in pools.swa_refusals(server_args)]
    return []


# -- the scheduler ----------------------------------------------------------------------------------
def engine_precompile(scheduler) -> None:
    """sglang-jax's own precompile, as ``Scheduler.__init__`` runs it."""
    if getattr(scheduler, "pd", None):
        return
    spec = getattr(scheduler, "spec_algorithm", None)
    if spec is None or spec.is_none():
        scheduler.tp_worker.run_precompile()
    else:
        scheduler.draft_worker.run_spec_decode_precompile()
    if getattr(scheduler.tree_cache, "hicache_enabled", False):
        scheduler.tree_cache.precompile_hicache_transfers()


def end_server(scheduler, logger, error: BaseException) -> None:
    """What the canary does with an error it finds between steps: a violation in mode ``raise``
    (of the last step before the server went idle) or a failed health check ends the server the
    way sglang-jax's own threads do on a fatal error, with SIGQUIT to the process that launched
    the scheduler (itself with ``--enable-single-process``), which ends the whole process tree;
    any other error of the idle report is logged and the server serves on."""
    if not isinstance(error, (CanaryViolationError, CanaryHealthError)):
        logger.error("kv-canary: the idle-time report failed (%s: %s); serving goes on",
                     type(error).__name__, error)
        return
    logger.error("kv-canary: ending the server: %s", error)
    single = getattr(scheduler.server_args, "enable_single_process", False)
    os.kill(os.getpid() if single else os.getppid(), signal.SIGQUIT)


@dataclasses.dataclass(frozen=True)
class Guard:
    """What the launcher installs in each scheduler (pickled into spawned scheduler processes).

    Attributes:
      config: the canary's ``CanaryConfig``.
      inject: the fault to plant (``--kv-canary-inject``), or None.
      abort: mode ``abort``: a violation aborts the requests it concerns
        (``request_guard.RequestGuard``; in mode ``log`` it names them in the log).
    """

    config: CanaryConfig
    inject: Optional[InjectSpec] = None
    abort: bool = False


class GuardError(RuntimeError):
    """The canary could not be installed in a scheduler: the server ends before it serves."""


def _unguarded(logger, message: str) -> GuardError:
    """Log why the server will not start guarded, and the error that ends it."""
    message += ("; the server does not start without the canary it was asked for (run with "
                "--kv-canary none to serve unguarded)")
    logger.error("%s", message)
    return GuardError(message)


def attach(scheduler, guard: Guard, precompile: bool, logger: Optional[logging.Logger] = None):
    """Install the canary into a constructed scheduler, then run the engine's precompile with it
    (when ``precompile``). A server never runs without the canary it was asked for: a failure to
    install or to compile it (a setting the refusals before start missed) is logged and raised as
    ``GuardError``, which ends the scheduler, and with it the server, before it serves."""
    logger = logger or LOGGER
    config, inject = guard.config, guard.inject
    try:
        metrics = (PrometheusCounters() if getattr(scheduler.server_args, "enable_metrics", False)
                   else None)
        canary = install_into_scheduler(
            scheduler, config, logger=logger, episodes=True, metrics=metrics,
            protected_tokens=functools.partial(protected_tokens,
                                               scheduler.token_to_kv_pool_allocator))
        spec = speculative.is_speculative(scheduler.server_args)
        draft = speculative.install_draft_canary(scheduler, config, logger) if spec else None
        if guard.abort or config.mode == "log":
            for c in (canary, draft):
                if c is not None:
                    install_request_guard(scheduler, c, logger, abort=guard.abort)
        if spec:                 # before an injector changes what a verify returns
            speculative.record_verified_tokens(scheduler, canary)
        if inject is not None:
            aimed = draft if inject.on_draft else canary
            injector = FaultInjector(inject, aimed, scheduler, logger=logger)
            aimed.launch_hooks.append(injector.before_launch)
            aimed.step_hooks.append(injector.before_step)
    except (TypeError, ValueError) as e:
        raise _unguarded(logger, str(e)) from e
    if spec:
        speculative.guard_spec_worker(scheduler, canary, draft)
    run_precompile = functools.partial(engine_precompile, scheduler) if precompile else None
    for c in (canary, draft):
        if c is not None:
            c.idle.on_error = functools.partial(end_server, scheduler, logger)
    if draft is not None:            # the engine's precompile runs both models
        run_precompile = functools.partial(draft.precompile, run_precompile)
    try:
        canary.precompile(run_precompile)
    except Exception as e:
        if getattr(e, "kv_canary_engine_error", False):
            message = (f"kv-canary: sglang-jax's own model call failed in its precompile "
                       f"({type(e).__name__}: {e}), before the canary's step ran: the engine "
                       "cannot serve this setting here (see whether --kv-canary none starts)")
            logger.error("%s", message)
            raise GuardError(message) from e
        raise _unguarded(logger, f"kv-canary: compiling the canary failed ({type(e).__name__}: "
                                 f"{e})") from e
    try:
        host = install_host_records(canary, getattr(scheduler, "tree_cache", None))
        transfer = install_transfer_records(canary, scheduler)
    except (TypeError, ValueError) as e:
        raise _unguarded(logger, str(e)) from e
    logger.info("kv-canary: installed (mode=%s, real data=%s, sweep interval=%d, %s runner, "
                "%s attention, page size %d%s)%s", "abort" if guard.abort else config.mode,
                config.real_kv_hash_mode.name.lower(),
                config.sweep_interval, type(canary.layout).__name__, canary.layout.attention_backend,
                canary.layout.page_size,
                "".join([f", FULL and SWA groups (hybrid SWA pool, window {canary.layout.swa_window})"
                         if "SWA" in canary.layout.groups else "",
                         f", data parallel over {canary.dp} ranks of {canary.tp} device(s)"
                         if canary.dp > 1 else
                         f", tensor parallel over {canary.tp} devices" if canary.tp > 1 else "",
                         ", write-input assert" if config.write_input_assert else "",
                         ", token check" if config.token_check else "",
                         f", {scheduler.server_args.speculative_algorithm} target and draft "
                         "models" if spec else "",
                         ", HiCache host records" if host is not None else "",
                         f", PD {transfer.role} records" if transfer is not None else "",
                         ", metrics on /metrics" if metrics is not None else "",
                         ", checks in the engine's step program" if canary.fused else
                         f", checks in a launch of their own ({canary.fused_reason})"]),
                (f"; fault to inject: {inject.kind} from step {inject.step}"
                 + (" on the SWA group" if inject.on_swa else "")) if inject else "")
    if canary.layout.recurrent:
        logger.warning(pools.RECURRENT_NOTICE)
    return canary


def guarded_scheduler_class(guard: Guard):
    """A subclass of the scheduler module's current ``Scheduler`` that installs the canary."""
    from sgl_jax.srt.managers import scheduler as sched

    base = sched.Scheduler

    class GuardedScheduler(base):
        """sglang-jax's ``Scheduler`` with the canary installed before its precompile."""

        def __init__(self, server_args, *args, **kwargs):
            precompile = not server_args.disable_precompile
            server_args.disable_precompile = True           # run below, with the canary in
            try:
                super().__init__(server_args, *args, **kwargs)
            finally:
                server_args.disable_precompile = not precompile
            self.kv_canary = attach(self, guard, precompile)

    GuardedScheduler.__qualname__ = GuardedScheduler.__name__ = base.__name__
    return GuardedScheduler


def use_guarded_scheduler(guard: Guard) -> None:
    """Swap the scheduler module's ``Scheduler`` for the guarded one (in this process)."""
    from sgl_jax.srt.managers import scheduler as sched

    if not getattr(sched.Scheduler, "_kv_canary_guarded", False):
        sched.Scheduler = guarded_scheduler_class(guard)
        sched.Scheduler._kv_canary_guarded = True


def run_guarded_scheduler_process(guard: Guard, *args, **kwargs):
    """The scheduler process's entry point: sglang-jax's ``run_scheduler_process`` with the
    guarded ``Scheduler`` (the child imports this module to unpickle it)."""
    from sgl_jax.srt.managers import scheduler as sched

    use_guarded_scheduler(guard)
    return sched.run_scheduler_process(*args, **kwargs)


def guard_engine(config: CanaryConfig, inject: Optional[InjectSpec] = None,
                 abort: bool = False) -> None:
    """Make sglang-jax's ``launch_server`` start its scheduler with the canary (both in a spawned
    scheduler process and with ``--enable-single-process``); ``abort``: mode ``abort``."""
    from sgl_jax.srt.entrypoints import engine

    guard = Guard(config, inject, abort)
    engine.run_scheduler_process = functools.partial(run_guarded_scheduler_process, guard)
    use_guarded_scheduler(guard)
