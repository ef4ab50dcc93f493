"""Data-parallel attention on sglang-jax's own HTTP server, guarded (``--dp-size 2`` carved out
of ``--tp-size 2`` or ``4`` on forced host devices; the non-overlap scheduler).

sglang-jax main's CPU path of data-parallel attention is wrong as vendored: its native attention
backend writes and reads every rank's KV through the whole buffer with rank-local slot ids, so
rank 1's KV lands in rank 0's rows (``replay/patches/fix-cpu-dp-rank-slots.patch`` says how). The
clean runs use the build with that fixed (``replay.builds``, the replay suite's fixed build of
bug ``cpu-dp``), which answers as ``--dp-size 1``; the stock runs show what the canary reports of
the engine as it is. ``python -m tests.integrations.replay --bugs cpu-dp`` replays it in full.
"""

import re

import pytest

from tests.support.sglang_server import (PROMPTS, TINY_ENGINE_ARGS, Server, installed_sglang_jax,
                                         mixed_requests)

pytestmark = pytest.mark.integration
if installed_sglang_jax() != "main":
    pytest.skip("data-parallel attention needs sglang-jax's main branch (BUILD.md)",
                allow_module_level=True)
import sgl_jax.launch_server  # noqa: E402,F401  (a broken install fails here, it does not skip)

NON_OVERLAP = ("--disable-overlap-schedule",)
DEVICE_RE = re.compile(r"^  device=(\d+) dp_rank=(\d+)", re.M)
NAMED_RE = re.compile(r"kv-canary: (?:aborting request|request) rid=(\S+) ")


def dp_server(tiny_qwen2, tmp_path, name, *args, tp=2, env=None):
    devices = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={tp}"}
    return Server(["--model-path", tiny_qwen2, *TINY_ENGINE_ARGS, *NON_OVERLAP, "--tp-size",
                   str(tp), "--dp-size", "2", *args], str(tmp_path / f"{name}.log"),
                  env=dict(devices, **(env or {})))


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_dp_guarded_answers_as_dp1_with_no_row(tiny_qwen2, tmp_path, cpu_dp_fixed_env,
                                               unguarded_tiny, tp):
    """Each rank's slots, batch sections and prefix cache (sweeps) checked on its own devices:
    the same answers as ``--dp-size 1``, no row, no abort."""
    with dp_server(tiny_qwen2, tmp_path, f"dp2-tp{tp}", "--kv-canary", "abort",
                   "--kv-canary-sweep-interval", "4", tp=tp, env=cpu_dp_fixed_env) as srv:
        replies = mixed_requests(srv)
        srv.generate(PROMPTS[3], 4)                    # after the last batch's sweep
        log = srv.log()
    assert [r["output_ids"] for r in replies] == unguarded_tiny
    assert srv.reports() == [] and "aborting request" not in log, log[-3000:]
    assert f"data parallel over 2 ranks of {tp // 2} device(s)" in log


def test_dp_planted_fault_is_reported_by_its_rank_and_aborts_its_request(
        tiny_qwen2, tmp_path, cpu_dp_fixed_env, unguarded_tiny):
    """``real_kv_used`` flips a byte of batch row 0's KV (rank 0's first request): reported by
    rank 0's device, that request aborted, the other answers right."""
    with dp_server(tiny_qwen2, tmp_path, "dp2-inject", "--kv-canary", "abort",
                   "--kv-canary-inject", "real_kv_used", "--kv-canary-inject-step", "4",
                   env=cpu_dp_fixed_env) as srv:
        reply = srv.generate(PROMPTS[0], 16)
        after = srv.generate(PROMPTS[1], 10)
        log = srv.log()
    finish = reply["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and "of dp_rank 0 failed the KV-cache canary" in \
        finish["message"], finish
    assert after["output_ids"] == unguarded_tiny[1]
    assert {rank for _, rank in DEVICE_RE.findall(log)} == {"0"}, log[-3000:]
    assert any(tag == "TAIL_K_FULL" and "verify_real_kv_hash" in why
               for tag, why, _, _ in srv.reports())


@pytest.mark.parametrize("mode", [pytest.param("log", marks=pytest.mark.slow), "abort"])
def test_stock_cpu_dp_cross_rank_writes_are_reported_on_the_rank_they_land_in(
        tiny_qwen2, tmp_path, unguarded_tiny, mode):
    """sglang-jax as vendored: rank 1's KV written into rank 0's rows. Rank 0's devices report
    its changed KV (no other rank's device reports anything), and every request the canary names
    (mode log) or aborts (mode abort) is one whose answer differs from ``--dp-size 1``.
    Rank 1's requests, which read through the same wrong addressing, are not named: the canary
    checks rank 1's own rows, which this path never writes (README, data parallelism)."""
    with dp_server(tiny_qwen2, tmp_path, f"stock-{mode}", "--kv-canary", mode) as srv:
        replies = mixed_requests(srv)
        log = srv.log()
    ranks = {rank for _, rank in DEVICE_RE.findall(log)}
    assert ranks == {"0"}, log[-3000:]
    assert all(why == "verify_real_kv_hash" for _, why, _, _ in srv.reports())
    named = set(NAMED_RE.findall(log))
    assert named, log[-3000:]
    wrong = {r["meta_info"]["id"] for r, ref in zip(replies, unguarded_tiny)
             if r["output_ids"] != ref}
    assert named <= wrong, (named, wrong)
    if mode == "abort":
        aborted = {r["meta_info"]["id"] for r in replies
                   if r["meta_info"]["finish_reason"]["type"] == "abort"}
        assert aborted == named
