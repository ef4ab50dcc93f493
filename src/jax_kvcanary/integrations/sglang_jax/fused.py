"""One XLA program per step: the canary's launch traced into sglang-jax's own jitted model call.

sglang-jax main's ``ModelRunner.initialize_jit`` defines ``jitted_run_model`` (a ``jax.jit`` of
the model call that donates ``memory_pools``) and sets the runner's ``jitted_run_model`` attribute
to ``run_model_wrapper``, a closure that calls it with the model's graph and state (sglang-jax
0.0.2 the same, donating ``token_to_kv_pool``). ``engine_jit`` finds, in that closure, the
function the engine jits (before ``jax.jit``: ``__wrapped__``) and the arguments it passes;
``fused_step`` jits that function and the canary's check as one program, the KV pool and the
canary state both donated, so a guarded step dispatches as many programs as an unguarded one and
the model's part is the engine's own trace.

Where the closure is not that shape (the opt-in ``SGLANG_JAX_AOT_DISPATCH`` path of sglang-jax
main, which runs an ahead-of-time executable of the engine's program; a runner whose
``jitted_run_model`` is not sglang-jax's wrapper), ``engine_jit`` says why and the canary keeps
its separate launch after the engine's call.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Tuple

import jax

from .layout import step_arrays


class EngineJit(NamedTuple):
    """What ``run_model_wrapper`` calls: the engine's model-call function before ``jax.jit``
    (``fn(model_def, model_state_def, model_state_leaves, forward_batch, pool,
    logits_metadata)``), the graph and state definition it passes, and ``leaves()``, the model
    state's leaves it passes now (main reads the runner's attribute at each call: LoRA rebinds it;
    0.0.2 closes over its own)."""

    fn: Callable
    model_def: object
    model_state_def: object
    leaves: Callable


def engine_jit(run_model) -> Tuple[Optional[EngineJit], str]:
    """``(EngineJit, "")`` for sglang-jax's ``run_model_wrapper``, else ``(None, why)``."""
    code, cells = getattr(run_model, "__code__", None), getattr(run_model, "__closure__", None)
    if code is None or not cells:
        return None, f"the runner's jitted_run_model ({run_model!r}) is not a closure"
    free = dict(zip(code.co_freevars, (c.cell_contents for c in cells)))
    jitted = free.get("jitted_run_model")
    fn = getattr(jitted, "__wrapped__", None)
    if fn is None or not {"model_def", "model_state_def"} <= set(free):
        return None, ("the runner's jitted_run_model does not call a jax.jit of the model with "
                      f"model_def and model_state_def (it closes over {sorted(free)}; e.g. "
                      "SGLANG_JAX_AOT_DISPATCH)")
    if "model_state_leaves" in free:
        leaves = free["model_state_leaves"]
        return EngineJit(fn, free["model_def"], free["model_state_def"], lambda: leaves), ""
    runner = free.get("self")
    if not hasattr(runner, "model_state_leaves"):
        return None, "the runner's jitted_run_model passes no model_state_leaves it can be read from"
    return EngineJit(fn, free["model_def"], free["model_state_def"],
                     lambda: runner.model_state_leaves), ""


def fused_step(engine: EngineJit, check: Callable, step_kvs: Callable, *, draft: bool,
               state_sharding=None):
    """The jitted ``step(model_state_leaves, forward_batch, pool, logits_metadata, cstate, extra)
    -> (engine outputs, cstate, counter snapshot)``: the engine's function, then
    ``check(cstate, arrays, kvs, decode=...)`` on the batch's ``step_arrays`` (with ``extra``:
    the SWA map, the token pool) and the KV the forward left (``step_kvs(outputs)``).
    ``pool`` (what the engine donates: ``memory_pools``, or 0.0.2's ``token_to_kv_pool``) and
    ``cstate`` are donated; ``state_sharding`` (single-device state) pins
    where the new state lives."""
    model_def, model_state_def = engine.model_def, engine.model_state_def

    def step(model_state_leaves, forward_batch, pool, logits_metadata, cstate, extra):
        outputs = engine.fn(model_def, model_state_def, model_state_leaves, forward_batch,
                            pool, logits_metadata)
        arrays = dict(step_arrays(forward_batch, from_attention=draft), **extra)
        decode = not draft and bool(forward_batch.forward_mode.is_decode())
        cstate, snapshot, _ = check(cstate, arrays, step_kvs(outputs), decode=decode)
        if state_sharding is not None:
            cstate = jax.lax.with_sharding_constraint(cstate, state_sharding)
        return outputs, cstate, snapshot

    return jax.jit(step, donate_argnames=("pool", "cstate"))
