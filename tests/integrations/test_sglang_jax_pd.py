"""PD disaggregation (sglang-jax main's ``--disaggregation-mode prefill|decode``, ``jax_transfer``
on one host) guarded: the canary records of each request travel with its pulled KV (``pd``).

Four real processes on this host (``tests.support.pd_cluster``): bootstrap, prefill and decode
servers (the kv-canary launcher with the CPU stand-in of sglang-jax's TPU-only KV scatter), and
sglang-jax's mini load balancer, which takes every request here.
"""

import re
import time

import pytest

from tests.support.sglang_server import installed_sglang_jax

pytestmark = pytest.mark.integration
if installed_sglang_jax() != "main":
    pytest.skip("these tests need sglang-jax's main branch (BUILD.md)", allow_module_level=True)

from tests.support.pd_cluster import PDCluster  # noqa: E402
from tests.support.tiny_qwen2 import write_tiny_qwen2  # noqa: E402

PROMPTS = ("what is the capital of france", "the key value cache holds the keys",
           "alpha beta gamma delta")


def run_prompts(pd) -> list:
    """The replies to ``PROMPTS`` through the router, one request at a time."""
    return [pd.router.generate(text, 12) for text in PROMPTS]


def pd_metrics(srv, requests: int, timeout: float = 15.0) -> dict:
    """``kv_canary_pd_{requests,slots}_total`` of one side from its ``/metrics``, once the server
    has gone idle (when the canary brings its metrics up to date) and they show ``requests``
    requests (or what they show after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        text = srv.get("/metrics")
        counts = {(what, side): int(float(v)) for what, side, v in re.findall(
            r'kv_canary_pd_(requests|slots)_total\{side="(\w+)"\} (\S+)', text)}
        done = any(what == "requests" and v == requests for (what, _), v in counts.items())
        if (len(counts) == 2 and done) or time.monotonic() > deadline:
            return counts
        time.sleep(0.5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_qwen2(str(tmp_path_factory.mktemp("tiny-qwen2")))


@pytest.fixture(scope="module")
def stock(model_dir, tmp_path_factory):
    """The output ids of the unguarded PD servers (``--kv-canary none`` on both sides)."""
    with PDCluster(model_dir, tmp_path_factory.mktemp("stock"), ["--kv-canary", "none"],
                   ["--kv-canary", "none"], name="stock") as pd:
        return [r["output_ids"] for r in run_prompts(pd)]


def test_pd_is_guarded_with_the_stock_tokens(model_dir, stock, tmp_path):
    """Both sides guarded (log mode, write-input assert, token check): the stock tokens, every
    request's records sent by prefill and imported by decode (the metrics count them), no report
    on either side."""
    args = ["--kv-canary", "log", "--kv-canary-write-input-assert", "--kv-canary-token-check",
            "--enable-metrics"]
    with PDCluster(model_dir, tmp_path, args, args) as pd:
        replies = run_prompts(pd)
        sent, received = (pd_metrics(pd.prefill, len(PROMPTS)),
                              pd_metrics(pd.decode, len(PROMPTS)))
        logs = {side: srv.log() for side, srv in (("prefill", pd.prefill), ("decode", pd.decode))}
        reports = pd.prefill.reports() + pd.decode.reports()
    assert reports == [], logs["decode"][-3000:]
    assert [r["output_ids"] for r in replies] == stock
    assert "PD prefill records" in logs["prefill"] and "PD decode records" in logs["decode"]
    assert not any("Traceback" in log for log in logs.values())
    assert sent[("requests", "prefill")] == received[("requests", "decode")] == len(PROMPTS)
    assert sent[("slots", "prefill")] == received[("slots", "decode")] > len(PROMPTS)


@pytest.mark.parametrize("kind,mode", [("pd_zero_slot", "abort"),
                                       pytest.param("pd_page_shift", "abort",
                                                    marks=pytest.mark.slow),
                                       ("pd_early_reuse", "log")])
def test_kv_damaged_in_a_transfer_is_reported_on_the_decode_side(model_dir, stock, tmp_path,
                                                                 kind, mode):
    """A slot left zero (SGLang #38586), the KV written one page off, or an earlier transfer landing
    on reused slots (SGLang #24527), planted in the decode server's receive: its first decode step
    reports the damaged prompt slots (``verify_real_kv_hash`` at TAIL) and names the request and
    the side, or ends it with the canary's abort; the other requests keep the stock tokens."""
    with PDCluster(model_dir, tmp_path, ["--kv-canary", "log"],
                   ["--kv-canary", mode, "--kv-canary-inject", kind,
                    "--kv-canary-inject-step", "1"], name=kind) as pd:
        replies = run_prompts(pd)
        injected = pd.decode.injected()
        reports = pd.decode.reports()
        log = pd.decode.log()
        assert pd.prefill.reports() == []
    assert injected is not None and injected[0] == kind, log[-3000:]
    assert reports and {(tag, why) for tag, why, _, _ in reports} <= {
        ("TAIL_K_FULL", "verify_real_kv_hash"), ("TAIL_V_FULL", "verify_real_kv_hash")}, reports
    assert min(pumped for *_, pumped in reports) <= injected[1] + 2, (injected, reports)
    rid = re.search(r"of request (\w+)", log[log.index("kv-canary: injected"):]).group(1)
    damaged, = [k for k, r in enumerate(replies) if r["meta_info"]["id"] == rid]
    if mode == "log":
        assert re.search(rf"kv-canary: request rid={rid} read KV that failed the canary at step "
                         r"\d+ on the PD decode server", log), log[-3000:]
        assert replies[damaged]["meta_info"]["finish_reason"]["type"] == "length"
    else:
        reason = replies[damaged]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["message"].startswith(
            "kv-canary: request aborted on the PD decode server"), reason
        assert f"kv-canary: aborting request rid={rid}" in log
    assert [r["output_ids"] for k, r in enumerate(replies) if k != damaged] == \
        [ids for k, ids in enumerate(stock) if k != damaged]
    assert "Traceback" not in log


def test_a_decode_server_whose_prefill_peer_has_no_canary_aborts_and_serves_on(model_dir,
                                                                                tmp_path):
    """A guarded decode server behind a prefill server without the canary: the pull brings no
    records and fails; the canary's wrapper raises before the engine writes anything (a
    ``kv-canary:`` line saying why), the engine releases the request and aborts it, and the decode
    server stays up: no request is served from an unchecked prompt, and none takes it down."""
    with PDCluster(model_dir, tmp_path, ["--kv-canary", "none"], ["--kv-canary", "log"],
                   name="mixed") as pd:
        replies = run_prompts(pd)
        alive = pd.decode.proc.poll() is None and pd.decode.get("/health") is not None
        log = pd.decode.log()
    assert alive
    assert [r["meta_info"]["finish_reason"]["type"] for r in replies] == ["abort"] * len(PROMPTS)
    assert log.count("kv-canary: the KV pulled for request") == len(PROMPTS), log[-3000:]
