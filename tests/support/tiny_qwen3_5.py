"""A tiny Qwen3.5 model directory (a hybrid of Gated DeltaNet linear-attention layers and
full-attention layers) for sglang-jax's HTTP server, written locally (nothing downloaded).

``write_tiny_qwen3_5(path)`` writes what ``python -m sgl_jax.launch_server --model-path path``
loads: the tiny Qwen2's tokenizer and vocabulary (``tiny_qwen2``) with a dense Qwen3.5 config
(``Qwen3_5ForConditionalGeneration``, the text model's fields under ``text_config``) and seeded
random weights under the Hugging Face names (``model.language_model.*``, ``[out, in]``; the norms
are zeros, which Qwen3.5's ``1 + weight`` norms read as ones):

- 4 layers, ``layer_types`` linear, full, linear, full: sglang-jax's model runner then builds a
  ``HybridLinearKVPool`` (an MHA pool for the two full-attention layers) beside a
  ``RecurrentStatePool`` (each request's Gated DeltaNet state and convolution window);
- full attention: 2 query heads and 2 KV heads of 128 (gated output), partial rotary;
- linear attention: 2 key and 2 value heads of 32, convolution kernel 4; float32.

On the CPU, sglang-jax serves it with ``--gdn-prefill-impl chunked_jax`` (its default prefill
kernel runs on TPUs only) and ``--disable-radix-cache`` or ``--enable-unified-radix-tree`` (it
refuses a hybrid linear model with the plain radix cache), and the native backend's write path for
this pool comes from the test stand-in ``cpu_stand_ins.serve_hybrid_linear_pool_on_cpu``.

Usage: ``python -m tests.support.tiny_qwen3_5 DIR`` (from the repository root), or import it.
"""

from __future__ import annotations

import sys

import numpy as np

from tests.support.tiny_qwen2 import CONFIG as QWEN2, write_model

VOCAB_SIZE = QWEN2["vocab_size"]
HIDDEN = 128
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
HEADS = KV_HEADS = 2
HEAD_DIM = 128
INTERMEDIATE = 256
LINEAR_HEADS, LINEAR_HEAD_DIM, CONV_KERNEL = 2, 32, 4

TEXT_CONFIG = {
    "vocab_size": VOCAB_SIZE, "hidden_size": HIDDEN, "num_hidden_layers": len(LAYER_TYPES),
    "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
    "hidden_act": "silu", "max_position_embeddings": QWEN2["max_position_embeddings"],
    "rms_norm_eps": 1e-6, "attn_output_gate": True, "layer_types": LAYER_TYPES,
    "full_attention_interval": 2, "linear_conv_kernel_dim": CONV_KERNEL,
    "linear_key_head_dim": LINEAR_HEAD_DIM, "linear_value_head_dim": LINEAR_HEAD_DIM,
    "linear_num_key_heads": LINEAR_HEADS, "linear_num_value_heads": LINEAR_HEADS,
    "intermediate_size": INTERMEDIATE, "tie_word_embeddings": False, "eos_token_id": 2,
    "rope_parameters": {"rope_type": "default", "mrope_section": [6, 5, 5],
                        "mrope_interleaved": True, "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.25},
    "torch_dtype": "float32", "dtype": "float32",
}
CONFIG = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
    "text_config": TEXT_CONFIG, "tie_word_embeddings": False, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
#: the server arguments this model needs on the CPU (see the module docstring)
CPU_ARGS = ("--gdn-prefill-impl", "chunked_jax")


def random_weights(seed: int = 0, scale: float = 0.08) -> dict:
    """float32 weights under the Hugging Face Qwen3.5 names, ``[out, in]``; norms are zeros."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    def zeros(*shape):
        return np.zeros(shape, np.float32)

    m = "model.language_model."
    out = {m + "embed_tokens.weight": w(VOCAB_SIZE, HIDDEN), m + "norm.weight": zeros(HIDDEN),
           "lm_head.weight": w(VOCAB_SIZE, HIDDEN)}
    kd = vd = LINEAR_HEADS * LINEAR_HEAD_DIM
    for i, kind in enumerate(LAYER_TYPES):
        p = f"{m}layers.{i}."
        out[p + "input_layernorm.weight"] = zeros(HIDDEN)
        out[p + "post_attention_layernorm.weight"] = zeros(HIDDEN)
        out[p + "mlp.gate_proj.weight"] = w(INTERMEDIATE, HIDDEN)
        out[p + "mlp.up_proj.weight"] = w(INTERMEDIATE, HIDDEN)
        out[p + "mlp.down_proj.weight"] = w(HIDDEN, INTERMEDIATE)
        if kind == "full_attention":
            a = p + "self_attn."
            out[a + "q_proj.weight"] = w(2 * HEADS * HEAD_DIM, HIDDEN)      # query and its gate
            out[a + "k_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
            out[a + "v_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
            out[a + "o_proj.weight"] = w(HIDDEN, HEADS * HEAD_DIM)
            out[a + "q_norm.weight"] = zeros(HEAD_DIM)
            out[a + "k_norm.weight"] = zeros(HEAD_DIM)
        else:
            a = p + "linear_attn."
            out[a + "in_proj_qkv.weight"] = w(2 * kd + vd, HIDDEN)
            out[a + "in_proj_z.weight"] = w(vd, HIDDEN)
            out[a + "in_proj_b.weight"] = w(LINEAR_HEADS, HIDDEN)
            out[a + "in_proj_a.weight"] = w(LINEAR_HEADS, HIDDEN)
            out[a + "conv1d.weight"] = w(2 * kd + vd, 1, CONV_KERNEL)
            out[a + "A_log"] = np.log(rng.uniform(1, 16, LINEAR_HEADS)).astype(np.float32)
            out[a + "dt_bias"] = np.ones(LINEAR_HEADS, np.float32)
            out[a + "norm.weight"] = np.ones(LINEAR_HEAD_DIM, np.float32)
            out[a + "out_proj.weight"] = w(HIDDEN, vd)
    return out


def write_tiny_qwen3_5(path: str, *, seed: int = 0) -> str:
    """Write the model directory (created if needed); returns ``path``."""
    return write_model(path, CONFIG, random_weights(seed))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.support.tiny_qwen3_5 DIR")
    print(write_tiny_qwen3_5(sys.argv[1]))
