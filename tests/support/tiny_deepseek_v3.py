"""A tiny DeepseekV3 (MLA attention) model directory for sglang-jax's HTTP server, written locally.

The tiny Qwen2's sizes and tokenizer (``tiny_qwen2``) with MLA attention: no query LoRA, latent KV
rank 128, query/key heads of 64 + 64 (no rope part + rope part), value heads of 64, dense MLPs
(``first_k_dense_replace`` covers both layers). With ``--attention-backend native`` sglang-jax
decompresses the latent KV into a plain MHA pool (``MHATokenToKVPool``); with ``fa`` it keeps the
latent rows (``MLATokenToKVPool``, TPU kernels only).

Usage: ``python -m tests.support.tiny_deepseek_v3 DIR`` (from the repository root), or import it.
"""

from __future__ import annotations

import sys

import numpy as np

from tests.support.pool_models import MODELS
from tests.support.tiny_qwen2 import CONFIG, HEADS, HIDDEN, INTERMEDIATE, LAYERS, VOCAB_SIZE, \
    write_model

MLA = MODELS["deepseek_v3"]
QK = MLA["qk_nope_head_dim"] + MLA["qk_rope_head_dim"]


def random_weights(seed: int = 0, scale: float = 0.08) -> dict:
    """float32 weights under the Hugging Face DeepseekV3 names, ``[out, in]``; norms are ones."""
    rng = np.random.default_rng(seed)
    rank, rope, v = MLA["kv_lora_rank"], MLA["qk_rope_head_dim"], MLA["v_head_dim"]

    def w(*shape):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    out = {"model.embed_tokens.weight": w(VOCAB_SIZE, HIDDEN),
           "model.norm.weight": np.ones(HIDDEN, np.float32),
           "lm_head.weight": w(VOCAB_SIZE, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = w(HEADS * QK, HIDDEN)
        out[p + "self_attn.kv_a_proj_with_mqa.weight"] = w(rank + rope, HIDDEN)
        out[p + "self_attn.kv_a_layernorm.weight"] = np.ones(rank, np.float32)
        out[p + "self_attn.kv_b_proj.weight"] = w(HEADS * (MLA["qk_nope_head_dim"] + v), rank)
        out[p + "self_attn.o_proj.weight"] = w(HIDDEN, HEADS * v)
        out[p + "mlp.gate_proj.weight"] = w(INTERMEDIATE, HIDDEN)
        out[p + "mlp.up_proj.weight"] = w(INTERMEDIATE, HIDDEN)
        out[p + "mlp.down_proj.weight"] = w(HIDDEN, INTERMEDIATE)
        out[p + "input_layernorm.weight"] = np.ones(HIDDEN, np.float32)
        out[p + "post_attention_layernorm.weight"] = np.ones(HIDDEN, np.float32)
    return out


def write_tiny_deepseek_v3(path: str, *, seed: int = 0) -> str:
    """Write the model directory (created if needed); returns ``path``."""
    return write_model(path, dict(CONFIG, **MLA), random_weights(seed))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.support.tiny_deepseek_v3 DIR")
    print(write_tiny_deepseek_v3(sys.argv[1]))
