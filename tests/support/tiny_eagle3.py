"""A tiny EAGLE3 pair for sglang-jax's speculative decoding, written locally (nothing downloaded).

- ``write_tiny_llama_target(path)``: the tiny Qwen2 (``tiny_qwen2``: its tokenizer, its seeded
  weights) as a ``LlamaForCausalLM`` (the same layers; Qwen2's q/k/v biases kept, a zero o_proj
  bias added). sglang-jax main's Qwen2 model cannot be an EAGLE3 target (it has no
  ``set_eagle3_layers_to_capture``, which the model runner calls for EAGLE3); its Llama can.
  ``eagle_config`` names the target layer whose hidden state the draft reads.
- ``write_tiny_eagle3_draft(path, target_dir)``: a one-layer ``LlamaForCausalLMEagle3`` draft
  with the target's hidden size and vocabulary (``d2t`` all zeros: every draft token is its own
  target token), seeded random weights under the names sglang-jax's ``llama_eagle3`` loads. Its
  guesses are random: the target rejects nearly all of them, so every round runs the verify's
  reject path.

Usage: ``python -m tests.support.tiny_eagle3 TARGET_DIR DRAFT_DIR`` (from the repository root).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from tests.support import tiny_qwen2


def write_tiny_llama_target(path: str, *, seed: int = 0) -> str:
    """The tiny Qwen2 as a Llama model directory; returns ``path``."""
    config = {k: v for k, v in tiny_qwen2.CONFIG.items()
              if k not in ("use_sliding_window", "sliding_window")}
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=True,
                  head_dim=tiny_qwen2.HEAD_DIM, mlp_bias=False,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": [0]})
    weights = tiny_qwen2.random_weights(seed)
    for i in range(tiny_qwen2.LAYERS):
        weights[f"model.layers.{i}.self_attn.o_proj.bias"] = np.zeros(tiny_qwen2.HIDDEN,
                                                                      np.float32)
    return tiny_qwen2.write_model(path, config, weights)


def write_tiny_eagle3_draft(path: str, target_dir: str, *, seed: int = 1,
                            scale: float = 0.08) -> str:
    """A one-layer EAGLE3 draft for the model at ``target_dir``; returns ``path``."""
    with open(os.path.join(target_dir, "config.json")) as f:
        target = json.load(f)
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    heads, kv_heads = target["num_attention_heads"], target["num_key_value_heads"]
    head_dim = target.get("head_dim") or hidden // heads
    inter = target["intermediate_size"]
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": 1,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
              "vocab_size": vocab, "draft_vocab_size": vocab, "target_hidden_size": hidden,
              "max_position_embeddings": target["max_position_embeddings"],
              "rms_norm_eps": target["rms_norm_eps"], "rope_theta": target["rope_theta"],
              "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
              "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    def ones():
        return np.ones(hidden, np.float32)

    m = "midlayer."
    weights = {"fc.weight": w(hidden, 3 * hidden), "d2t": np.zeros(vocab, np.int64),
               "lm_head.weight": w(vocab, hidden), "norm.weight": ones(),
               m + "hidden_norm.weight": ones(), m + "input_layernorm.weight": ones(),
               m + "post_attention_layernorm.weight": ones(),
               m + "self_attn.q_proj.weight": w(heads * head_dim, 2 * hidden),
               m + "self_attn.k_proj.weight": w(kv_heads * head_dim, 2 * hidden),
               m + "self_attn.v_proj.weight": w(kv_heads * head_dim, 2 * hidden),
               m + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
               m + "mlp.gate_proj.weight": w(inter, hidden), m + "mlp.up_proj.weight": w(inter, hidden),
               m + "mlp.down_proj.weight": w(hidden, inter)}
    return tiny_qwen2.write_model(path, config, weights)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m tests.support.tiny_eagle3 TARGET_DIR DRAFT_DIR")
    print(write_tiny_llama_target(sys.argv[1]), write_tiny_eagle3_draft(sys.argv[2], sys.argv[1]))
