"""The hybrid linear pool (``HybridLinearKVPool``: the full-attention layers' KV of a model whose
other layers are linear attention with a recurrent state per request, e.g. Qwen3.5's Gated
DeltaNet) in sglang-jax's own HTTP server: guarded with the stock tokens, its faults reported, and
the recurrent state said to be unchecked.

The model is a tiny Qwen3.5 (``tests/support/tiny_qwen3_5.py``: layers linear, full, linear,
full). The servers run with the CPU stand-in ``serve_hybrid_linear_pool_on_cpu``
(``tests/support/cpu_stand_ins.py``: the native backend's write path, which this pool lacks),
started by ``tests.support.launch_with_stand_ins``, the stock server included, so that both serve
the same engine. sglang-jax refuses a hybrid linear model with its plain radix cache: the servers
run with ``--disable-radix-cache``, or ``--enable-unified-radix-tree`` (page size 1 only).
"""

import pytest

from tests.support.sglang_server import (STAND_INS, TINY_ENGINE_ARGS, Server, check_acted_on,
                                        installed_sglang_jax)

pytestmark = pytest.mark.integration
if installed_sglang_jax() != "main":
    pytest.skip("these tests need sglang-jax's main branch (BUILD.md)", allow_module_level=True)

from jax_kvcanary.integrations.sglang_jax.pools import RECURRENT_NOTICE  # noqa: E402
from tests.support.tiny_qwen3_5 import CPU_ARGS, write_tiny_qwen3_5  # noqa: E402

PROMPTS = ["the key value cache holds the keys and values of every token a request has seen",
           "alpha beta gamma delta", "what is the capital of france"]
NEW = 40
NO_RADIX = ("--disable-radix-cache",)
UNIFIED = ("--enable-unified-radix-tree",)
TOKEN_FLAGS = ("--kv-canary-write-input-assert", "--kv-canary-token-check")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_qwen3_5(str(tmp_path_factory.mktemp("tiny-qwen3_5")))


def server(model_dir, tmp_path, *args, name):
    return Server(["--model-path", model_dir, *TINY_ENGINE_ARGS, *CPU_ARGS, *args],
                  str(tmp_path / f"{name}.log"), module=STAND_INS)


def answers(srv, batch: bool) -> list:
    """Token ids (greedy, EOS ignored): each prompt alone, the first again, then (``batch``) the
    last two in one ``/generate``."""
    out = [srv.generate(p, NEW, ignore_eos=True) for p in PROMPTS + PROMPTS[:1]]
    if batch:
        out += srv.generate(PROMPTS[1:], NEW, ignore_eos=True)
    return [r["output_ids"] for r in out]


@pytest.fixture(scope="module")
def stock(model_dir, tmp_path_factory):
    """The stock server's answers (no canary, no radix cache)."""
    with server(model_dir, tmp_path_factory.mktemp("stock"), "--kv-canary", "none", *NO_RADIX,
                name="stock") as srv:
        return answers(srv, batch=True)


@pytest.mark.parametrize("page_size, cache", [
    pytest.param(1, NO_RADIX, id="page1"), pytest.param(4, NO_RADIX, id="page4"),
    pytest.param(1, UNIFIED, id="page1-unified-radix", marks=pytest.mark.slow)])
def test_the_hybrid_linear_pool_is_guarded_with_the_stock_tokens(model_dir, stock, tmp_path,
                                                                  page_size, cache):
    """The canary (log, write-input assert, token check) on the full-attention layers' KV: the
    stock tokens, no report, and the line that says the recurrent state is not checked. At page
    size 4 one request at a time (the native backend's batched page-4 read, README). The repeated
    prompt is no prefix hit here: sglang-jax reports 0 cached tokens for it with either cache."""
    batch = page_size == 1
    with server(model_dir, tmp_path, "--kv-canary", "log", *TOKEN_FLAGS, *cache, "--page-size",
                str(page_size), name=f"guarded-{page_size}-{cache[0][2:]}") as srv:
        got, reports, log = answers(srv, batch=batch), srv.reports(), srv.log()
    assert "kv-canary: installed" in log and RECURRENT_NOTICE in log, log[-3000:]
    assert reports == [] and "Traceback" not in log, log[-3000:]
    assert got == (stock if batch else stock[:len(got)])


#: kind: (mode, extra flags, expected tag prefix, reason); CI runs the first two (``slow``: the rest)
FAULTS = {
    "real_kv_used": ("abort", (), "TAIL_K_FULL", "verify_real_kv_hash"),
    "req_to_token_swap": ("log", (), "HEAD_", "verify_position"),
    "slot_double_free": ("log", (), "HEAD_", "verify_position"),
    "wrong_position": ("abort", (), "HEAD_", "write_position"),
    "cache_loc_off_by_one": ("log", (), "HEAD_", "verify_position"),
    "future_token_ring_wrap": ("log", ("--kv-canary-write-input-assert",), "HEAD_",
                               "write_token"),
}


@pytest.mark.parametrize("kind", [k if i < 2 else pytest.param(k, marks=pytest.mark.slow)
                                  for i, k in enumerate(FAULTS)])
def test_faults_in_the_full_attention_layers_kv_are_reported(model_dir, tmp_path, kind):
    """Each kind planted in the hybrid model's server: reported within two steps, the request
    aborted (abort) or named (log). ``future_token_ring_wrap`` needs a decode batch of two."""
    mode, extra, tag, reason = FAULTS[kind]
    with server(model_dir, tmp_path, "--kv-canary", mode, *extra, *NO_RADIX,
                "--kv-canary-inject", kind, "--kv-canary-inject-step", "6", name=kind) as srv:
        if kind == "future_token_ring_wrap":
            reply = srv.generate(PROMPTS[1:], 24, ignore_eos=True)[0]
        else:
            reply = srv.generate(PROMPTS[0], 24, ignore_eos=True)
        injected, reports, log = srv.injected(), srv.reports(), srv.log()
    assert injected is not None and injected[0] == kind, log[-3000:]
    hits = [p for t, why, _, p in reports if t.startswith(tag) and reason in why.split("+")]
    assert hits and min(hits) <= injected[1] + 2, reports
    if kind != "future_token_ring_wrap":
        check_acted_on(mode, reply, log)
    assert "Traceback" not in log, log[-3000:]
