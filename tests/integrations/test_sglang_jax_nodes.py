"""sglang-jax's HTTP server on two nodes (two local processes, gloo), guarded: each process reads
back its own devices' blocks of the canary state and reports what they found, naming itself; every
process decides on the rows of all of them at the same step (the launch adds them up), so none is
left waiting in the next step's collective (``tests.support.sglang_nodes``).

Without the canary the same two processes serve (the README's two-node command); with it they
must serve the same answers as one process and report nothing, a fault planted in node 1's KV is
reported by node 1 only, and in mode ``raise`` it ends both nodes and the client gets an error,
not a hang."""

import re
import time

import pytest

from tests.support.sglang_nodes import Nodes
from tests.support.sglang_server import (PROMPTS, TINY_ENGINE_ARGS, installed_sglang_jax,
                                         mixed_requests, scrape)

pytestmark = pytest.mark.integration
if installed_sglang_jax() != "main":
    pytest.skip("several nodes need sglang-jax's main branch (BUILD.md)", allow_module_level=True)
import sgl_jax.launch_server  # noqa: E402,F401  (a broken install fails here, it does not skip)

NON_OVERLAP = ("--disable-overlap-schedule",)
DEVICE_RE = re.compile(r"^  device=(\d+) .*process=(\d+)", re.M)
INJECT = ("--kv-canary-inject", "real_kv_used", "--kv-canary-inject-step", "4",
          "--kv-canary-inject-node", "1")


def workload(srv):
    return [r["output_ids"] for r in mixed_requests(srv)]


def nodes(tiny_qwen2, tmp_path, *args, tp=2, devices=1, env=None):
    return Nodes(["--model-path", tiny_qwen2, *TINY_ENGINE_ARGS, *NON_OVERLAP, "--tp-size", str(tp),
                  *args], str(tmp_path), devices=devices, env=env)


def test_two_nodes_guarded_answer_as_one_process_with_no_row(tiny_qwen2, tmp_path, unguarded_tiny):
    """``--nnodes 2 --tp-size 2`` (one device per process; sweeps on): the answers of one
    process, no report on either node."""
    with nodes(tiny_qwen2, tmp_path, "--kv-canary", "log", "--kv-canary-sweep-interval",
               "4") as n:
        outs = workload(n.head)
        time.sleep(1.0)                       # the idle report
        logs = n.logs()
    assert outs == unguarded_tiny
    for log in logs:
        assert "kv-canary: installed" in log and "kv_canary violation" not in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]


def test_a_fault_on_node_1_in_mode_raise_ends_both_nodes_with_an_error_to_the_client(
        tiny_qwen2, tmp_path):
    """``real_kv_used`` planted in node 1's KV shard: node 1's device reports it (``process=1``),
    node 0 says another process's devices recorded rows; both end at that step, and the client
    gets an error within seconds instead of waiting on a server stuck in a collective."""
    with nodes(tiny_qwen2, tmp_path, "--kv-canary", "raise", *INJECT) as n:
        t0 = time.monotonic()
        with pytest.raises(Exception):
            n.head.generate(PROMPTS[0], 24)
        answered = time.monotonic() - t0
        codes = n.wait(60)
        head, worker = n.logs()
    assert answered < 60 and None not in codes, (answered, codes)
    assert "kv-canary: injected real_kv_used at step 4" in worker, worker[-3000:]
    assert "kv-canary: injected" not in head
    assert {p for _, p in DEVICE_RE.findall(worker)} == {"1"}, worker[-3000:]
    assert "kv_canary violation" not in head
    assert "violation rows recorded on another process's devices" in head, head[-3000:]


def test_a_fault_on_node_1_in_mode_abort_aborts_its_request_on_both_nodes(tiny_qwen2, tmp_path,
                                                                          unguarded_tiny):
    """Mode ``abort``: node 1 finds the fault, both nodes get its rows at the same gate and
    abort the same request (node 0's client gets the canary's abort); both serve on, the next
    request answers as one process."""
    with nodes(tiny_qwen2, tmp_path, "--kv-canary", "abort", *INJECT) as n:
        reply = n.head.generate(PROMPTS[0], 24)
        after = n.head.generate(PROMPTS[1], 10)
        head, worker = n.logs()
    finish = reply["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and finish["message"].startswith(
        "kv-canary: request aborted: its KV slot(s) 1 failed"), finish
    assert after["output_ids"] == unguarded_tiny[1]
    rid = reply["meta_info"]["id"]
    for log in (head, worker):
        assert f"kv-canary: aborting request rid={rid}" in log, log[-3000:]
        assert "Traceback" not in log
    assert {p for _, p in DEVICE_RE.findall(worker)} == {"1"} and "kv_canary violation" not in head


@pytest.mark.slow
def test_a_fault_on_node_1_in_mode_log_is_reported_by_node_1_only(tiny_qwen2, tmp_path,
                                                                    unguarded_tiny):
    """Mode ``log``, ``--enable-metrics``: node 1 reports the fault, both nodes name its request
    and serve on, and node 0's ``/metrics`` counts every node's rows and slots (node 0's own
    devices found nothing)."""
    with nodes(tiny_qwen2, tmp_path, "--kv-canary", "log", "--enable-metrics", *INJECT) as n:
        reply = n.head.generate(PROMPTS[0], 24)
        after = n.head.generate(PROMPTS[1], 10)
        n.head.generate(PROMPTS[2], 40)          # past the 64th step: the counters are shared
        time.sleep(1.0)
        head, worker = n.logs()
        metrics = scrape(n.head)
    rows = metrics.get(("kv_canary_violations_total",
                        (("reason", "verify_real_kv_hash"), ("tag", "TAIL_K_FULL"))), 0)
    assert rows >= 1, metrics
    assert metrics[("kv_canary_slots_written_total", (("tag", "HEAD_K_FULL"),))] > 0, metrics
    assert reply["meta_info"]["finish_reason"]["type"] == "length"
    assert after["output_ids"] == unguarded_tiny[1]
    assert {p for _, p in DEVICE_RE.findall(worker)} == {"1"}, worker[-3000:]
    assert "kv_canary violation" not in head and "Traceback" not in head + worker
    for log in (head, worker):               # both nodes name it (they share their rows)
        assert re.search(rf"kv-canary: request rid={reply['meta_info']['id']} read KV", log)


@pytest.mark.slow
def test_two_nodes_of_two_devices_with_data_parallel_attention(tiny_qwen2, tmp_path,
                                                               cpu_dp_fixed_env, unguarded_tiny):
    """``--tp-size 4 --dp-size 2``, two devices per process, on the build whose CPU DP path is
    rank-correct (``test_sglang_jax_dp_server``): the answers of one process, no report."""
    with nodes(tiny_qwen2, tmp_path, "--kv-canary", "log", "--kv-canary-sweep-interval", "4",
               "--dp-size", "2", tp=4, devices=2, env=cpu_dp_fixed_env) as n:
        outs = workload(n.head)
        time.sleep(1.0)
        logs = n.logs()
    assert outs == unguarded_tiny
    for log in logs:
        assert "data parallel over 2 ranks of 2 device(s)" in log, log[-3000:]
        assert "kv_canary violation" not in log and "Traceback" not in log, log[-3000:]


@pytest.mark.slow
def test_data_parallel_nodes_report_a_fault_on_the_node_of_its_rank(tiny_qwen2, tmp_path,
                                                                    cpu_dp_fixed_env):
    """The same two nodes with ``real_kv_used`` in batch row 0's KV (rank 0, on node 0's
    devices): node 0's device of that head reports it and names the request; node 1 (rank 1)
    reports nothing; both serve on."""
    with nodes(tiny_qwen2, tmp_path, "--kv-canary", "log", "--dp-size", "2", "--kv-canary-inject",
               "real_kv_used", "--kv-canary-inject-step", "4", "--kv-canary-inject-node", "0",
               tp=4, devices=2, env=cpu_dp_fixed_env) as n:
        reply = n.head.generate(PROMPTS[0], 24)
        n.head.generate(PROMPTS[1], 10)
        time.sleep(1.0)
        head, worker = n.logs()
    assert {p for _, p in DEVICE_RE.findall(head)} == {"0"}, head[-3000:]
    assert "dp_rank=0" in head and "kv_canary violation" not in worker
    assert re.search(rf"kv-canary: request rid={reply['meta_info']['id']} read KV", head)
    assert "Traceback" not in head + worker
