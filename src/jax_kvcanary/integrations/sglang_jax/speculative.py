"""Speculative decoding (EAGLE, EAGLE3) in sglang-jax's server: what is guarded, what is refused,
and the health check that no speculative batch runs a model call the canary did not see.

sglang-jax's non-fused EAGLE path (``BaseSpecWorker.forward_batch_speculative_generation``) calls
the target model through its runner's ``jitted_run_model``, the call the canary wraps, in two
forward modes: EXTEND (the prefill, an ordinary extend) and TARGET_VERIFY (the verified token and
the draft tokens of each request, written at KV positions ``[seq_len - q_len, seq_len)`` of the
attention metadata: ``layout.attention_arrays``). Every slot a verify reads is verified after its
new records are stamped; a rejected draft token's slot is freed and stamped again by the step
that reuses it, so it is never reported.

The draft model's pool has a canary of its own (``install_draft_canary``: its own state, sized to
the draft pool, its own jits), on the draft runner's ``jitted_run_model``. Its steps (the prefill
EXTEND, the DECODE steps that propose draft tokens, the DRAFT_EXTEND after each verify) are all
planned from the ``fa`` attention metadata (the draft's DECODE batch arrays are placeholders),
and its records hold the KV position each token is written to: sglang-jax's draft writes input
position ``p`` at KV position ``p`` in its prefill and ``p + 1`` at ``p`` in its DECODE and
DRAFT_EXTEND steps, and a DRAFT_EXTEND writes every draft token's entry of a request, the
rejected ones too (they are written again before a committed read). Its reports are prefixed
``draft model:``. Its gate runs before each batch's results are processed, as the target's
(``gate_draft_before_results``), and the requests its rows name are aborted in mode abort
(named in mode log) like the target's: the target's verify decides every token served, so a
fault in the draft's KV alone lowers the acceptance rate, not the answer; but it is the engine's
KV bookkeeping failing on that request's slots (which the draft shares with the target), and the
canary serves no request past a failed check.

With the write-input assert and the token check (``tokens``), the target's intended tokens are
its prompt, its sampled first token and, after each verify, the tokens the verify committed
(``record_verified_tokens``): a verify's draft tokens are no request's intended tokens until
accepted, so the positions they are written to are unknown until then (the write-input assert
compares each verify's first token, the token check every committed position it reads). The
draft canary runs neither: the draft's inputs are the target's tokens shifted by one position,
and what it writes decides no token served.

The fused paths (EAGLE3's fused verify with its recurrent draft, the overlap scheduler's
speculative steps) call the model inside jits of their own: ``refusals`` refuses them before
start, naming the switch that turns them off, and ``guard_spec_worker`` ends the server if a
speculative batch still runs without a target model call the canary saw.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import List, Mapping, Optional, Tuple

import numpy as np

from ...runtime.config import CanaryConfig
from ...runtime.errors import CanaryHealthError
from .canary import SglangJaxCanary, install, reporting_before_errors

#: the algorithms whose non-fused path the canary guards
GUARDED_ALGORITHMS = ("EAGLE", "EAGLE3")
#: inject kinds planted in a speculative server (``inject``; the draft pool's with
#: ``--kv-canary-inject-group DRAFT`` or the draft kinds), tested there
SPEC_INJECT_KINDS = ("real_kv_used", "req_to_token_swap", "draft_pool_short",
                     "spec_rejected_foreign_write", "spec_accept_overcount")
#: the environment switch that keeps EAGLE3 off its fused verify and recurrent draft
FUSED_EAGLE3_SWITCH = "SGL_JAX_DISABLE_FUSED_EAGLE3_RECURRENT_DRAFT"

#: how the draft canary's report lines start
DRAFT_PREFIX = "draft model: "


def is_speculative(server_args) -> bool:
    return bool(getattr(server_args, "speculative_algorithm", None))


def fused_eagle3_verify(server_args, environ: Mapping[str, str]) -> bool:
    """Whether sglang-jax would run EAGLE3's fused verify (``BaseSpecWorker``'s condition)."""
    a = server_args
    return (a.speculative_algorithm == "EAGLE3" and int(a.speculative_eagle_topk) == 1
            and int(a.speculative_num_steps) > 1
            and int(a.speculative_num_draft_tokens) == int(a.speculative_num_steps) + 1
            and a.attention_backend == "fa" and environ.get(FUSED_EAGLE3_SWITCH) != "1")


def refusals(server_args, config, inject=None,
             environ: Optional[Mapping[str, str]] = None) -> List[Tuple[str, str, str]]:
    """``(setting, why, fix)`` of each speculative-decoding setting the canary cannot cover
    (empty without ``--speculative-algorithm``)."""
    a = server_args
    if not is_speculative(a):
        return []
    environ = os.environ if environ is None else environ
    alg = a.speculative_algorithm
    if alg not in GUARDED_ALGORITHMS:
        return [(f"--speculative-algorithm {alg}", "the canary guards EAGLE and EAGLE3 only",
                 "use EAGLE or EAGLE3")]
    out = []
    if int(a.speculative_eagle_topk) != 1:
        out.append((f"--speculative-eagle-topk {a.speculative_eagle_topk}",
                    "a tree of draft tokens (top-k > 1) is not guarded yet",
                    "use --speculative-eagle-topk 1"))
    if not a.disable_overlap_schedule:
        out.append((f"--speculative-algorithm {alg} with the overlap scheduler",
                    "its speculative steps run fused, the model called inside sglang-jax's own "
                    "jits instead of the model call the canary wraps",
                    "add --disable-overlap-schedule"))
    elif fused_eagle3_verify(a, environ):
        out.append((f"--speculative-algorithm {alg} with its fused verify",
                    "EAGLE3's fused verify and recurrent draft call the model inside jits of "
                    "their own", f"set {FUSED_EAGLE3_SWITCH}=1 in the server's environment"))
    if a.attention_backend != "fa":
        out.append((f"--speculative-algorithm {alg} with --attention-backend "
                    f"{a.attention_backend}", "sglang-jax's EAGLE steps need the fa backend",
                    "use --attention-backend fa"))
    if int(a.tp_size) != 1:
        out.append((f"--speculative-algorithm {alg} with --tp-size {a.tp_size}",
                    "speculative decoding with tensor parallelism has not run here",
                    "use --tp-size 1"))
    tiers = (getattr(a, "disaggregation_mode", "null") not in (None, "null"),
             getattr(a, "hicache_storage", "disable") not in (None, "disable"))
    if any(tiers):
        out.append((f"--speculative-algorithm {alg} with HiCache or PD",
                    "speculative decoding with a KV tier has not run here",
                    "drop --hicache-storage / --disaggregation-mode"))
    if inject is not None and inject.kind not in SPEC_INJECT_KINDS:
        out.append((f"--kv-canary-inject {inject.kind} with --speculative-algorithm {alg}",
                    "that fault has not been planted in a speculative server",
                    f"use one of {', '.join(SPEC_INJECT_KINDS)}"))
    return out


class _Prefixed(logging.LoggerAdapter):
    """The server's logger, each message prefixed (the draft canary's reports)."""

    def process(self, msg, kwargs):
        return f"{self.extra['prefix']}{msg}", kwargs


def draft_runner(scheduler):
    """The EAGLE draft model's ``ModelRunner`` of an sglang-jax scheduler."""
    return scheduler.draft_worker.draft_worker.draft_model_runner


def install_draft_canary(scheduler, config: CanaryConfig,
                         logger: logging.Logger) -> SglangJaxCanary:
    """The canary of the draft model's pool (see the module docstring): installed on the draft
    runner's ``jitted_run_model``, with the scheduler's radix tree for its sweeps (the draft pool
    uses the target's slot ids), reporting through ``logger`` with ``DRAFT_PREFIX``; without the
    write-input assert and the token check."""
    config = dataclasses.replace(config, write_input_assert=False, token_check=False)
    draft = install(draft_runner(scheduler), config,
                    tree_cache=getattr(scheduler, "tree_cache", None),
                    logger=_Prefixed(logger, {"prefix": DRAFT_PREFIX}), episodes=True, draft=True)
    gate_draft_before_results(scheduler, draft)
    return draft


def gate_draft_before_results(scheduler, draft: SglangJaxCanary) -> None:
    """Run the draft canary's gate (``SglangJaxCanary.gate_through`` its last step) before each
    batch's results are processed, as the target's: a speculative batch's ``run_batch`` has
    launched every draft step of that batch (the overlap scheduler is refused), so no request
    answers before the draft steps it took part in are checked (and a ``RequestGuard`` on the
    draft canary has acted on them)."""
    process = scheduler.process_batch_result

    def process_batch_result_with_draft_canary(batch, result, *args, **kwargs):
        draft.gate_through(batch, draft.monitor.steps)
        return process(batch, result, *args, **kwargs)

    scheduler.process_batch_result = process_batch_result_with_draft_canary
    loop = getattr(scheduler, "event_loop_normal", None)
    if loop is not None:                 # the engine's own error: the draft's last steps too
        scheduler.event_loop_normal = reporting_before_errors(loop, draft)
    draft.gated = True


def guard_spec_worker(scheduler, canary, draft: Optional[SglangJaxCanary] = None) -> None:
    """Make every speculative batch prove that the canaries saw its model calls: sglang-jax's
    non-fused entry ``forward_batch_speculative_generation`` must run the target canary's wrapped
    model call at least once (the prefill or the verify), and the draft canary's (``draft``) at
    least once, else ``CanaryHealthError`` (a fused path ran a model out of the canary's sight);
    the overlap scheduler's fused entries raise it at once. The scheduler's event loop ends the
    server with it."""
    worker = scheduler.draft_worker
    entry = worker.forward_batch_speculative_generation
    watched = [("target", canary)] + ([("draft", draft)] if draft is not None else [])

    def forward_batch_speculative_generation(model_worker_batch, *args, **kwargs):
        before = [c.steps for _, c in watched]
        out = entry(model_worker_batch, *args, **kwargs)
        for (model, c), steps in zip(watched, before):
            if c.steps == steps:
                raise CanaryHealthError(
                    f"kv-canary: a speculative {model_worker_batch.forward_mode.name} batch ran "
                    f"without a {model} model call the canary saw (a fused path of sglang-jax's "
                    "speculative decoding?); the server ends rather than serve unguarded")
        return out

    worker.forward_batch_speculative_generation = forward_batch_speculative_generation
    for name in ("forward_batch_speculative_decode_overlap",
                 "forward_batch_speculative_prefill_overlap"):
        if callable(getattr(worker, name, None)):
            setattr(worker, name, _unseen(name))


def _unseen(name: str):
    def refuse(*args, **kwargs):
        raise CanaryHealthError(f"kv-canary: sglang-jax called {name}, a fused speculative path "
                                "the canary does not see; the server ends rather than serve "
                                "unguarded")
    return refuse


def first_positions(positions, batch_size: int) -> np.ndarray:
    """Each batch row's first verified position ``P`` (its verify's first entry, whose token is
    the one committed last round), from a verify's ``positions`` as it leaves them: gathered in
    accept order, ``num_steps + 1`` per row, the first always accepted."""
    pos = np.asarray(positions, np.int64).reshape(-1)
    return pos[::max(pos.shape[0] // max(batch_size, 1), 1)][:batch_size]


def verified_cells(req_pool_indices, positions, next_token_ids, accept_lens,
                   draft_tokens: int) -> np.ndarray:
    """The ``tokens.TokenMirror`` cells of a verify's result (``[3, n]``: pool row + 1,
    position, token): each live row's committed tokens, at the positions after its first
    verified one (``TokenMirror.commit`` makes the positions after them unknown).

    Args:
      req_pool_indices: ``[B]``, the batch rows' request pool rows (-1: padding).
      positions: the verify's ``positions`` as it leaves them (``first_positions``).
      next_token_ids: ``[B * draft_tokens]``, the target's token after each verify entry; row
        ``r`` commits its first ``accept_lens[r]`` at positions ``P + 1, ...``.
      accept_lens: ``[B]``, tokens committed per row (the accepted draft tokens and one more).
    """
    acc = np.asarray(accept_lens, np.int64).reshape(-1)
    rp = np.asarray(req_pool_indices, np.int64).reshape(-1)[:acc.shape[0]]
    ids = np.asarray(next_token_ids, np.int64).reshape(-1)[:acc.shape[0] * draft_tokens]
    ids = ids.reshape(acc.shape[0], draft_tokens)   # (sampling leaves one more at the end)
    j = np.arange(draft_tokens)
    take = (rp >= 0)[:, None] & (j[None, :] < acc[:, None])
    cols = first_positions(positions, acc.shape[0])[:, None] + 1 + j[None, :]
    rows = np.broadcast_to(rp[:, None] + 1, take.shape)
    return np.stack([rows[take], cols[take], ids[take]])


def record_verified_tokens(scheduler, canary: SglangJaxCanary) -> None:
    """With the write-input assert or the token check: each verify's committed tokens stored in
    the target canary's ``TokenMirror`` once it has run (``verified_cells``), and every new
    request's first draft positions made unknown (``TokenMirror.lookahead``)."""
    mirror = canary.tokens
    if mirror is None:
        return
    worker = scheduler.draft_worker
    draft_tokens = int(worker.speculative_num_draft_tokens)
    mirror.lookahead = draft_tokens
    verify = worker.verify

    def verify_recorded(model_worker_batch, *args, **kwargs):
        out = verify(model_worker_batch, *args, **kwargs)
        mirror.commit(verified_cells(model_worker_batch.req_pool_indices,
                                     model_worker_batch.positions, out.next_token_ids,
                                     out.accept_lens, draft_tokens))
        return out

    worker.verify = verify_recorded
