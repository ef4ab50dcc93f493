"""sglang-jax's KV pool classes: which one its model runner builds for a model and the server's
arguments, and which ones the canary guards.

The launcher refuses, before anything starts, a server whose pool the canary does not guard
(``refusal``); the install in the scheduler checks the pool it finds against the same list
(``install_refusal``), so no pool class runs without the canary the user asked for. The latent
pool of absorbed MLA and DSA (``LATENT``) is the one difference: the install guards it (its
adapter is tested on the CPU against a pool with known contents), the launcher still refuses it
until a TPU, the only device its kernels run on, has served it guarded.
"""

from __future__ import annotations

from typing import Optional

#: the pool classes the canary guards: one fused K/V buffer per layer, indexed by slot; the
#: hybrid sliding-window pool (two such pools and a full-to-SWA slot map: FULL and SWA groups);
#: and the hybrid linear pool's token KV (one such pool for the full-attention layers; the
#: linear-attention layers' recurrent state, held per request in another pool, is not checked)
GUARDED = ("MHATokenToKVPool", "SWAKVPool", "HybridLinearKVPool")

#: the line that says what the canary does not check with the hybrid linear pool
RECURRENT_NOTICE = ("kv-canary: the recurrent state of the model's linear-attention layers "
                    "(RecurrentStatePool, one slot per request) is not checked: the canary guards "
                    "the full-attention layers' KV only")

#: why each pool class sglang-jax main has (``mem_cache/memory_pool.py``) is not guarded, and what
#: serves the same model with a guarded pool
UNGUARDED = {
    "MLATokenToKVPool": ("its kernels (absorbed MLA, DSA) run on TPUs only, and the canary's "
                         "latent-row adapter (compressed KV, rope part, DSA indexer keys) has "
                         "been tested on the CPU, not yet served on a TPU",
                         "use --attention-backend native (MLA with decompressed K/V in an MHA "
                         "pool)"),
}


#: pools the install guards and the launcher still refuses (see the module's text)
LATENT = ("MLATokenToKVPool",)


def is_latent(pool) -> bool:
    """Whether ``pool`` is sglang-jax's absorbed-MLA latent pool (one latent row per slot)."""
    return type(pool).__name__ in LATENT


def is_recurrent(pool) -> bool:
    """Whether ``pool`` is sglang-jax's hybrid linear pool (the full-attention layers' MHA pool
    inside; the linear-attention layers keep a recurrent state per request elsewhere)."""
    return type(pool).__name__ == "HybridLinearKVPool"


def is_swa(pool) -> bool:
    """Whether ``pool`` is sglang-jax's hybrid sliding-window pool (two MHA pools and a map)."""
    return type(pool).__name__ == "SWAKVPool"


def refusal(pool_class: str) -> Optional[str]:
    """The ``kv-canary:`` line refusing ``pool_class``, or None when the canary guards it."""
    if pool_class in GUARDED:
        return None
    why, fix = UNGUARDED.get(pool_class, ("the canary knows only " + ", ".join(GUARDED), None))
    return (f"kv-canary: the KV pool {pool_class} is not supported: {why}; "
            + (f"{fix}, or run with --kv-canary none" if fix else "run with --kv-canary none"))


def install_refusal(pool_class: str) -> Optional[str]:
    """``refusal`` as the install in the scheduler decides it: the latent pool is guarded."""
    return None if pool_class in LATENT else refusal(pool_class)


#: what the canary does not guard yet with the hybrid sliding-window pool: (setting, why, fix)
def swa_refusals(server_args) -> list:
    """``(setting, why, fix)`` of each server setting the canary refuses with ``SWAKVPool``."""
    a, out = server_args, []
    keep = "or add --disable-hybrid-swa-memory (one MHA pool)"
    if a.tp_size > 1:
        out.append((f"--tp-size {a.tp_size} with a hybrid SWA pool",
                    "the SWA group is not sharded per tensor-parallel device yet", keep))
    if a.attention_backend != "native":
        out.append((f"--attention-backend {a.attention_backend} with a hybrid SWA pool",
                    "the SWA group is checked as the native backend reads it", keep))
    if getattr(a, "disaggregation_mode", "null") not in (None, "null"):
        out.append((f"--disaggregation-mode {a.disaggregation_mode} with a hybrid SWA pool",
                    "SWA records do not travel with a PD transfer yet", keep))
    if getattr(a, "hicache_storage", "disable") not in (None, "disable"):
        out.append((f"--hicache-storage {a.hicache_storage} with a hybrid SWA pool",
                    "SWA records do not travel to the host tier yet", keep))
    return out


def engine_pools(server_args, model_config) -> list:
    """The classes of the token KV pool sglang-jax main's ``ModelRunner`` builds for
    ``model_config`` (its ``ModelConfig``) under ``server_args``, outermost first (the hybrid
    linear pool wraps an inner pool): the decision of ``ModelRunner.initialize`` (hybrid SWA) and
    of ``_init_pools`` / ``_maybe_wrap_hybrid_kv_pool`` (``model_runner_kv_cache_mixin.py``), read
    from the model's config (nothing is loaded)."""
    from sgl_jax.srt.configs.model_config import AttentionArch

    window = getattr(model_config, "sliding_window", None)
    if (not _linear_recurrent(model_config.hf_config) and not server_args.disable_hybrid_swa_memory
            and window is not None and window > 0):
        return ["SWAKVPool"]
    inner = ("MLATokenToKVPool" if model_config.attention_arch == AttentionArch.MLA
             and server_args.attention_backend in ("fa", "dsa_sparse") else "MHATokenToKVPool")
    return ["HybridLinearKVPool", inner] if _linear_recurrent(model_config.hf_config) else [inner]


def _linear_recurrent(hf_config) -> bool:
    """Whether sglang-jax sees linear-attention (recurrent) layers in the model: its
    ``ModelRunner.linear_recurrent_config``, from the same config readers."""
    from sgl_jax.srt.configs.bailing_hybrid import get_bailing_hybrid_config
    from sgl_jax.srt.configs.kimi_linear import get_kimi_linear_config
    from sgl_jax.srt.configs.qwen3_5 import get_qwen3_5_hybrid_config

    return any(read(hf_config) is not None for read in (
        get_kimi_linear_config, get_qwen3_5_hybrid_config, get_bailing_hybrid_config))
