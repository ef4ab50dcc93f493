"""Speculative decoding (EAGLE3) in sglang-jax's own HTTP server on the CPU: what the canary's
EAGLE guard will be tested on. The canary refuses speculative decoding before start today
(``test_sglang_jax_unit.test_refusals_name_the_setting_and_the_fix``); this module checks the
serving it will guard.

The servers keep the ``fa`` backend with the CPU stand-ins (``tests/support/cpu_stand_ins.py``:
its attention kernel, and speculative decoding's greedy verify kernel in Pallas' interpret mode)
and the test-only patch of sglang-jax's EAGLE slot leak at page size 1
(``tests/support/engine_patches.py``: without it every EAGLE server ends at its first idle check),
all started by ``tests.support.launch_with_stand_ins``. The target is the tiny Qwen2 as a Llama
model, the draft a one-layer EAGLE3 head (``tests/support/tiny_eagle3.py``); the non-fused
speculative path runs (``SGL_JAX_DISABLE_FUSED_*``: the fused ones call the model inside jits of
their own) without the overlap scheduler (which has no non-fused EAGLE3 decode).
"""

import pytest

from tests.support.sglang_server import (PREFIX_HIT, PROMPTS, STAND_INS, Server, engine_args,
                                        installed_sglang_jax)

pytestmark = pytest.mark.integration
if installed_sglang_jax() != "main":
    pytest.skip("these tests need sglang-jax's main branch (BUILD.md)", allow_module_level=True)

from tests.support.tiny_eagle3 import write_tiny_eagle3_draft, write_tiny_llama_target  # noqa: E402

EAGLE3 = ("--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
          "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
          "--disable-overlap-schedule")
NOT_FUSED = {"SGL_JAX_DISABLE_FUSED_EAGLE3_RECURRENT_DRAFT": "1",
             "SGL_JAX_DISABLE_FUSED_SPEC_PREFILL": "1"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("eagle3")
    target = write_tiny_llama_target(str(base / "target"))
    return target, write_tiny_eagle3_draft(str(base / "draft"), target)


def server(models, tmp_path, *args, name, env=None):
    return Server(["--model-path", models[0], *engine_args("fa"), "--page-size", "1", "--kv-canary", "none",
                   *args], str(tmp_path / f"{name}.log"), module=STAND_INS, env=env)


def answers(srv) -> list:
    """Output ids: one request at a time (the second a prefix hit), then a batch of four."""
    out = [srv.generate(PROMPTS[0], 12)["output_ids"], srv.generate(PREFIX_HIT, 8)["output_ids"]]
    return out + [r["output_ids"] for r in srv.generate(PROMPTS, 10)]


def test_eagle3_serves_the_target_s_own_tokens_and_survives_idle(models, tmp_path):
    """EAGLE3 (top-k 1, 3 steps, 4 draft tokens) gives the tokens of the target served alone,
    greedy; and with the leak patch the server passes sglang-jax's idle-time memory checks
    between requests (the stock one ends at the first)."""
    with server(models, tmp_path, name="plain") as srv:
        plain = answers(srv)
    with server(models, tmp_path, *EAGLE3, "--speculative-draft-model-path", models[1],
                name="eagle3", env=NOT_FUSED) as srv:
        got = answers(srv)                          # the server idles between these requests
        again = srv.generate(PROMPTS[0], 12)["output_ids"]
        log = srv.log()
    assert "[SPEC_DECODE] Precompile finished" in log and "accept-len" in log, log[-3000:]
    assert "memory leak detected" not in log, log[-3000:]
    assert got == plain and again == plain[0], log[-3000:]
    assert "Traceback" not in log, log[-3000:]
