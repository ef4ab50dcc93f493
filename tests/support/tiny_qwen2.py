"""A tiny Qwen2 model directory for sglang-jax's HTTP server, written locally (nothing downloaded).

``write_tiny_qwen2(path)`` writes what ``python -m sgl_jax.launch_server --model-path path`` loads:

- ``config.json``: Qwen2ForCausalLM, float32, 2 layers, hidden 512, 4 heads of 128 (sglang-jax's
  main branch pads head_dim to 128 and needs at least 2 KV heads for its CPU backend), 2 KV heads,
  vocabulary of ``VOCAB_SIZE``, bos 1, eos 2;
- ``model.safetensors``: seeded random weights under the Hugging Face Qwen2 names (``[out, in]``),
  so that different prompts give different, repeatable answers (the ``dummy`` loader's zeros give
  every prompt the same empty text);
- ``tokenizer.json`` / ``tokenizer_config.json``: a byte-level BPE tokenizer trained here on a
  fixed text, with ``<s>``/``</s>``/``<pad>`` and a chat template.

Usage: ``python -m tests.support.tiny_qwen2 DIR`` (from the repository root), or import it.
Needs ``numpy``, ``safetensors`` and ``tokenizers`` (all installed with sglang-jax).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

VOCAB_SIZE = 512
HIDDEN = 512
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 512
CONTEXT = 4096

CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB_SIZE, "max_position_embeddings": CONTEXT,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "float32",
    "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0, "use_sliding_window": False, "sliding_window": None,
}

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]      # ids 0, 1, 2
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")

TRAINING_TEXT = """\
The key value cache holds the keys and values of every token a request has seen. A serving engine
pages it: each token gets a slot, a table maps each request and position to its slot, and the
prefix cache shares the slots of a common prompt between requests. When the table points at the
wrong slot, or a slot is freed while a cached prefix still uses it, the model attends to somebody
else's tokens and answers wrong, and nothing reports an error. A canary record per slot holds the
token, its position, a hash chained from the slot before it and a fingerprint of the bytes, and
every step checks the slots it is about to read. Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 2048,
words like alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu, questions such as
what is the capital of france, how many tokens fit in a page, why did the server answer wrong.
"""


def train_tokenizer():
    """A byte-level BPE ``tokenizers.Tokenizer`` of at most ``VOCAB_SIZE`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([TRAINING_TEXT] * 4, trainer=trainer)
    return tok


def random_weights(seed: int = 0, scale: float = 0.08) -> dict:
    """float32 weights under the Hugging Face Qwen2 names, ``[out, in]``; norms are ones."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    out = {"model.embed_tokens.weight": w(VOCAB_SIZE, HIDDEN),
           "model.norm.weight": np.ones(HIDDEN, np.float32),
           "lm_head.weight": w(VOCAB_SIZE, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = w(HEADS * HEAD_DIM, HIDDEN)
        out[p + "self_attn.q_proj.bias"] = w(HEADS * HEAD_DIM)
        out[p + "self_attn.k_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
        out[p + "self_attn.k_proj.bias"] = w(KV_HEADS * HEAD_DIM)
        out[p + "self_attn.v_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
        out[p + "self_attn.v_proj.bias"] = w(KV_HEADS * HEAD_DIM)
        out[p + "self_attn.o_proj.weight"] = w(HIDDEN, HEADS * HEAD_DIM)
        out[p + "mlp.gate_proj.weight"] = w(INTERMEDIATE, HIDDEN)
        out[p + "mlp.up_proj.weight"] = w(INTERMEDIATE, HIDDEN)
        out[p + "mlp.down_proj.weight"] = w(HIDDEN, INTERMEDIATE)
        out[p + "input_layernorm.weight"] = np.ones(HIDDEN, np.float32)
        out[p + "post_attention_layernorm.weight"] = np.ones(HIDDEN, np.float32)
    return out


def write_tiny_qwen2(path: str, *, seed: int = 0) -> str:
    """Write the model directory (created if needed); returns ``path``."""
    return write_model(path, CONFIG, random_weights(seed))


def write_model(path: str, config: dict, weights: dict) -> str:
    """A model directory of ``config``, ``weights`` (names to arrays) and this module's tokenizer;
    returns ``path``."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    save_file(weights, os.path.join(path, "model.safetensors"))
    train_tokenizer().save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                   "eos_token": "</s>", "pad_token": "<pad>", "unk_token": None,
                   "model_max_length": CONTEXT, "add_bos_token": False,
                   "chat_template": CHAT_TEMPLATE}, f, indent=1)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, f)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.support.tiny_qwen2 DIR")
    print(write_tiny_qwen2(sys.argv[1]))
