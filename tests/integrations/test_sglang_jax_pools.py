"""Every KV pool class of sglang-jax main is either guarded or refused before start, decided by
pool class and attention backend; and MLA served by the native backend (its decompressed K/V in
an MHA pool) is guarded in sglang-jax's own HTTP server.

The pool tests read model configs only (``tests/support/pool_models.py``); the MLA tests serve a
tiny DeepseekV3 with seeded random weights (``tests/support/tiny_deepseek_v3.py``).
"""

import logging
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from tests.support.sglang_server import LAUNCHER, TINY_ENGINE_ARGS, Server, installed_sglang_jax

pytestmark = pytest.mark.integration
if installed_sglang_jax() != "main":
    pytest.skip("these tests need sglang-jax's main branch (BUILD.md)", allow_module_level=True)

from sgl_jax.srt.mem_cache import memory_pool  # noqa: E402
from sgl_jax.srt.server_args import ServerArgs  # noqa: E402

from jax_kvcanary.integrations.sglang_jax import pools, server  # noqa: E402
from jax_kvcanary.runtime import CanaryConfig  # noqa: E402
from tests.support.pool_models import write_model_config  # noqa: E402
from tests.support.sglang_fakes import (fake_runner, forward_batch, kv_pool,  # noqa: E402
                                        serving_runner)
from tests.support.tiny_deepseek_v3 import write_tiny_deepseek_v3  # noqa: E402

PROMPTS = ["what is the capital of france", "the key value cache holds the keys",
           "alpha beta gamma delta"]


def subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from subclasses(sub)


def test_every_kv_pool_class_of_the_engine_is_guarded_or_refused_with_a_reason():
    classes = {c.__name__ for c in subclasses(memory_pool.KVCache)}
    assert {"MHATokenToKVPool", "SWAKVPool", "MLATokenToKVPool", "HybridLinearKVPool"} <= classes
    for name in sorted(classes):
        assert (name in pools.GUARDED) != (name in pools.UNGUARDED), name
        line = pools.refusal(name)
        assert line is None if name in pools.GUARDED else line.startswith(
            f"kv-canary: the KV pool {name} is not supported: {pools.UNGUARDED[name][0]}; ")


@pytest.mark.parametrize("kind, args, pool", [
    ("qwen2", ["--attention-backend", "native"], "MHATokenToKVPool"),
    ("qwen2", ["--attention-backend", "fa"], "MHATokenToKVPool"),
    ("gemma2", ["--attention-backend", "native"], "SWAKVPool"),
    ("gemma2", ["--attention-backend", "native", "--disable-hybrid-swa-memory"],
     "MHATokenToKVPool"),
    ("deepseek_v3", ["--attention-backend", "fa"], "MLATokenToKVPool"),
    ("deepseek_v3", ["--attention-backend", "dsa_sparse"], "MLATokenToKVPool"),   # DSA
    ("deepseek_v3", ["--attention-backend", "native"], "MHATokenToKVPool"),
    ("qwen3_5", ["--attention-backend", "native"], "HybridLinearKVPool/MHATokenToKVPool"),
    ("kimi_linear", ["--attention-backend", "native"], "HybridLinearKVPool/MHATokenToKVPool"),
    ("kimi_linear", ["--attention-backend", "fa"], "HybridLinearKVPool/MLATokenToKVPool"),
])
def test_the_pool_the_engine_builds_decides_the_refusal(tmp_path, kind, args, pool):
    """``pool``: the classes the runner builds, outermost first (the hybrid linear pool wraps an
    MHA or an MLA pool); the first refused one refuses the server."""
    from sgl_jax.srt.configs.model_config import ModelConfig

    path = write_model_config(str(tmp_path / kind), kind)
    server_args = ServerArgs.from_cli(["--model-path", path, "--device", "cpu", *args])
    built = pools.engine_pools(server_args, ModelConfig.from_server_args(server_args))
    assert "/".join(built) == pool
    refused = [pools.refusal(c) for c in built if c not in pools.GUARDED][:1]
    if refused and len(built) > 1:
        refused = [refused[0] + f" (inside the {built[0]})"]
    assert server.model_refusals(server_args) == refused


def test_a_fault_aimed_at_the_swa_group_needs_the_hybrid_swa_pool(tmp_path):
    from jax_kvcanary.integrations.sglang_jax.inject import InjectSpec

    log = CanaryConfig(mode="log")
    for kind, args, refused in (("qwen2", [], True), ("gemma2", [], False),
                                ("gemma2", ["--disable-hybrid-swa-memory"], True)):
        path = write_model_config(str(tmp_path / kind), kind)
        server_args = ServerArgs.from_cli(["--model-path", path, "--device", "cpu",
                                           "--attention-backend", "native", *args])
        got = server.model_refusals(server_args, log, InjectSpec("real_kv_used", group="SWA"))
        assert got == ([] if not refused else [
            "kv-canary: --kv-canary-inject real_kv_used on the SWA group is not supported with "
            "the KV pool MHATokenToKVPool: that fault is planted in a hybrid SWA pool's SWA "
            "group; serve a sliding-window model without --disable-hybrid-swa-memory"]), got


def test_data_parallel_attention_is_guarded_with_the_mha_pool_only(tmp_path):
    for kind, refused in (("qwen2", False), ("gemma2", True)):
        path = write_model_config(str(tmp_path / kind), kind)
        server_args = ServerArgs.from_cli(["--model-path", path, "--device", "cpu", "--attention-"
                                           "backend", "native", "--tp-size", "2", "--dp-size", "2"])
        got = server.model_refusals(server_args, CanaryConfig(mode="log"))
        assert got == ([] if not refused else [
            "kv-canary: --dp-size 2 with the KV pool SWAKVPool is not supported: data-parallel "
            "attention is guarded with the MHA KV pool; run with --dp-size 1, or run with "
            "--kv-canary none"]), got


def test_a_hybrid_swa_model_with_what_its_guard_lacks_is_refused_before_start(tmp_path):
    """The hybrid SWA pool is guarded with one device and the native backend; the rest is refused
    before anything starts (it once started and ran without the canary)."""
    path = write_model_config(str(tmp_path / "gemma2"), "gemma2")
    r = subprocess.run([sys.executable, "-m", LAUNCHER, "--kv-canary", "log", "--model-path", path,
                        "--device", "cpu", "--attention-backend", "fa", "--tp-size", "2",
                        "--kv-canary-sweep-interval", "4", "--port", "1"],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("kv-canary:")]
    assert r.returncode == 2 and len(lines) == 2, r.stderr[-2000:]
    for line, setting in zip(lines, ("--tp-size 2", "--attention-backend fa")):
        assert line.startswith(f"kv-canary: {setting} with a hybrid SWA pool is not supported: ")
        assert line.endswith("--disable-hybrid-swa-memory (one MHA pool)")


def test_a_pool_found_unguarded_in_the_scheduler_ends_the_server(caplog):
    """Behind the refusals: a scheduler whose runner holds a pool the canary does not guard
    raises (sglang-jax then ends the server) with the refusal in the log; it never serves
    unguarded."""
    runner = fake_runner(np.zeros((9, 1, 4, 1, 8), np.float32),
                         token_to_kv_pool=kv_pool(np.zeros((9, 1, 4, 1, 8)), "NextYearsKVPool"))
    scheduler = types.SimpleNamespace(
        tp_worker=types.SimpleNamespace(get_model_runner=lambda: runner), tree_cache=None,
        server_args=types.SimpleNamespace(enable_metrics=False), token_to_kv_pool_allocator=None)
    with caplog.at_level(logging.ERROR), pytest.raises(server.GuardError) as e:
        server.attach(scheduler, server.Guard(CanaryConfig(mode="log")), precompile=False,
                      logger=logging.getLogger("kvc-test"))
    assert str(e.value).startswith(pools.refusal("NextYearsKVPool"))
    assert "the server does not start without the canary" in str(e.value)
    assert str(e.value) in caplog.text


def test_an_engine_error_in_its_own_precompile_is_not_reported_as_the_canary_s(caplog):
    """A model call of the engine's precompile that fails inside the engine (e.g. a pool whose
    CPU write path sglang-jax lacks) ends the server with a line that says so, not with
    "compiling the canary failed" and a hint to serve unguarded."""
    runner = serving_runner()
    runner.jitted_run_model = lambda fb, lm: (_ for _ in ()).throw(
        AttributeError("'HybridLinearKVPool' object has no attribute 'set_kv_buffer_legacy'"))
    mesh = runner.mesh

    def run_precompile():
        runner.jitted_run_model(forward_batch(
            mesh, bid=0, decode=True, req_pool_indices=[1], seq_lens=[1], cache_loc=[1],
            input_ids=[5], positions=[0], out_cache_loc=[1]), None)

    scheduler = types.SimpleNamespace(
        tp_worker=types.SimpleNamespace(get_model_runner=lambda: runner,
                                        run_precompile=run_precompile,
                                        forward_batch_generation=print),
        tree_cache=None, spec_algorithm=None, run_batch=print, process_batch_result=print,
        server_args=types.SimpleNamespace(enable_metrics=False), token_to_kv_pool_allocator=None)
    with caplog.at_level(logging.ERROR), pytest.raises(server.GuardError) as e:
        server.attach(scheduler, server.Guard(CanaryConfig(mode="log", health_interval=0)),
                      precompile=True, logger=logging.getLogger("kvc-test"))
    assert str(e.value).startswith("kv-canary: sglang-jax's own model call failed in its "
                                   "precompile (AttributeError: 'HybridLinearKVPool' object has "
                                   "no attribute 'set_kv_buffer_legacy'), before the canary's "
                                   "step ran"), str(e.value)
    assert "compiling the canary failed" not in caplog.text


# -- MLA, native backend: the decompressed K/V in an MHA pool, guarded ---------------------------
@pytest.fixture(scope="module")
def mla_model(tmp_path_factory):
    return write_tiny_deepseek_v3(str(tmp_path_factory.mktemp("tiny-deepseek-v3")))


def mla_server(model_dir, tmp_path, name, *args):
    """The launcher with the non-overlap scheduler: with the overlap one, sglang-jax main on the
    CPU can hand a batched step another batch's page table (README, the twin runs)."""
    return Server(["--model-path", model_dir, *TINY_ENGINE_ARGS, "--disable-overlap-schedule",
                   *args], str(tmp_path / f"{name}.log"))


def answers(srv):
    """Each prompt alone, then all three in one batch: their generated token ids."""
    alone = [srv.generate(p, 12)["output_ids"] for p in PROMPTS]
    return alone, [r["output_ids"] for r in srv.generate(PROMPTS, 12)]


@pytest.fixture(scope="module")
def mla_stock(mla_model, tmp_path_factory):
    """The stock server's answers (``answers``) for the tiny DeepseekV3."""
    tmp = tmp_path_factory.mktemp("mla-stock")
    with mla_server(mla_model, tmp, "stock", "--kv-canary", "none") as srv:
        stock = answers(srv)
    assert len({tuple(a) for a in stock[0]}) == 3                  # the prompts answer differently
    return stock


def test_mla_on_the_native_backend_is_guarded_with_the_stock_tokens(mla_model, mla_stock,
                                                                      tmp_path):
    with mla_server(mla_model, tmp_path, "guarded", "--kv-canary", "log",
                    "--kv-canary-write-input-assert", "--kv-canary-token-check") as srv:
        guarded = answers(srv)
        log = srv.log()
        assert srv.reports() == []
    assert "kv-canary: installed (mode=log" in log and "Traceback" not in log
    assert guarded == mla_stock


def test_mla_on_the_native_backend_page_size_4_clean_then_a_planted_fault(mla_model, mla_stock,
                                                                           tmp_path):
    """Page size 4, one request at a time (a batch at page size 4 is where the native backend
    misreads the page table: ``test_page_size_4``): the stock answer and no report, then a fault
    planted at step 20 reported within two steps."""
    with mla_server(mla_model, tmp_path, "inject", "--kv-canary", "log", "--page-size", "4",
                    "--kv-canary-inject", "real_kv_used",
                    "--kv-canary-inject-step", "20") as srv:
        assert srv.generate(PROMPTS[1], 12)["output_ids"] == mla_stock[0][1]
        assert srv.reports() == [] and srv.injected() is None
        srv.generate(PROMPTS[0], 24)
        injected = srv.injected()
        assert injected is not None and injected[0] == "real_kv_used", srv.log_tail()
        hits = [pumped for tag, why, _, pumped in srv.reports()
                if tag == "TAIL_K_FULL" and "verify_real_kv_hash" in why.split("+")]
        assert hits and hits[0] <= injected[1] + 2, (injected, srv.reports())
