"""A tiny Gemma2 model directory (sliding-window attention) for sglang-jax's HTTP server, written
locally (nothing downloaded).

``write_tiny_gemma2(path)`` writes what ``python -m sgl_jax.launch_server --model-path path`` loads:
the tiny Qwen2's tokenizer and vocabulary (``tiny_qwen2``) with a Gemma2 config and seeded random
weights under the Hugging Face Gemma2 names (``[out, in]``; the norms are zeros, which Gemma's
``1 + weight`` norms read as ones; the output layer is the tied embedding):

- 4 layers, alternating as Gemma2's (``layer_types``): layers 0 and 2 ``sliding_attention``, layers
  1 and 3 ``full_attention``;
- ``sliding_window`` ``WINDOW`` (32 tokens), so that a request of a few hundred tokens runs far
  past it. sglang-jax reads it as ``ModelConfig.sliding_window`` and gives it to the sliding
  layers' ``RadixAttention`` (``sliding_window_size``); without ``--disable-hybrid-swa-memory`` its
  model runner then keeps the sliding layers' KV in a second, smaller pool (``SWAKVPool``) and frees
  the slots of tokens that fell out of the window;
- hidden 256, 4 query heads and 2 KV heads of 128 (sglang-jax pads head_dim to 128 and needs at
  least 2 KV heads for its CPU backend), float32.

Usage: ``python -m tests.support.tiny_gemma2 DIR`` (from the repository root), or import it.
"""

from __future__ import annotations

import sys

import numpy as np

from tests.support.tiny_qwen2 import CONFIG as QWEN2, write_model

VOCAB_SIZE = QWEN2["vocab_size"]
HIDDEN = 256
LAYERS = 4
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 128
INTERMEDIATE = 512
CONTEXT = QWEN2["max_position_embeddings"]
#: the sliding window, in tokens
WINDOW = 32
#: Gemma2's alternation: even layers slide, odd layers attend to everything
LAYER_TYPES = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(LAYERS)]

CONFIG = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": CONTEXT, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "torch_dtype": "float32", "tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": HEAD_DIM,
    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "attention_bias": False,
    "attention_dropout": 0.0, "sliding_window": WINDOW, "layer_types": LAYER_TYPES,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}


def random_weights(seed: int = 0, scale: float = 0.08, embed_scale: float = 0.01) -> dict:
    """float32 weights under the Hugging Face Gemma2 names, ``[out, in]``; norms are zeros (Gemma's
    norms scale by ``1 + weight``). The embedding is small next to what the layers add to the
    residual (Gemma2 normalises each sublayer's output): with the tied output layer, a large one
    makes the greedy answer repeat its last token whatever the context."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    def norm():
        return np.zeros(HIDDEN, np.float32)

    out = {"model.embed_tokens.weight": w(VOCAB_SIZE, HIDDEN) * (embed_scale / scale),
           "model.norm.weight": norm()}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = w(HEADS * HEAD_DIM, HIDDEN)
        out[p + "self_attn.k_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
        out[p + "self_attn.v_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
        out[p + "self_attn.o_proj.weight"] = w(HIDDEN, HEADS * HEAD_DIM)
        out[p + "mlp.gate_proj.weight"] = w(INTERMEDIATE, HIDDEN)
        out[p + "mlp.up_proj.weight"] = w(INTERMEDIATE, HIDDEN)
        out[p + "mlp.down_proj.weight"] = w(HIDDEN, INTERMEDIATE)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            out[p + name + ".weight"] = norm()
    return out


def write_tiny_gemma2(path: str, *, seed: int = 0) -> str:
    """Write the model directory (created if needed); returns ``path``."""
    return write_model(path, CONFIG, random_weights(seed))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.support.tiny_gemma2 DIR")
    print(write_tiny_gemma2(sys.argv[1]))
