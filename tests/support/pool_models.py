"""Model directories whose configs make sglang-jax main build each of its KV pool classes: the
tiny Qwen2's config (``tiny_qwen2.CONFIG``) with the keys that decide the pool changed (a sliding
window, MLA, linear-attention layers). Config only: the launcher's refusals read the model's
config before anything starts, and nothing here is served."""

from __future__ import annotations

import json
import os

from tests.support.tiny_qwen2 import CONFIG

_MLA = dict(kv_lora_rank=128, q_lora_rank=None, qk_nope_head_dim=64, qk_rope_head_dim=64,
            v_head_dim=64, n_routed_experts=None, first_k_dense_replace=2, num_key_value_heads=4)

#: the config keys of each model kind, over the tiny Qwen2's
MODELS = {
    "qwen2": {},
    "gemma2": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", sliding_window=64,
                   head_dim=128, query_pre_attn_scalar=128),
    "deepseek_v3": dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", **_MLA),
    "qwen3_5": dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5", head_dim=128,
                    layer_types=["linear_attention", "full_attention"]),
    "kimi_linear": dict(architectures=["KimiLinearForCausalLM"], model_type="kimi_linear",
                        linear_attn_config={"kda_layers": [1], "full_attn_layers": [2]}),
}


def write_model_config(path: str, kind: str) -> str:
    """Write ``path/config.json`` of model ``kind`` (a key of ``MODELS``); returns ``path``."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(CONFIG, **MODELS[kind]), f, indent=1)
    return path
