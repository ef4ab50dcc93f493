"""HiCache (sglang-jax main's host KV tier, ``--hicache-storage none``) guarded in sglang-jax's own
HTTP server: the canary records travel with every backup and load back (``hicache``).

sglang-jax loads pages back with a Pallas kernel that runs on TPUs only; these servers run the
launcher with the CPU stand-in of that kernel (``tests/support/cpu_stand_ins.py``, started by
``tests.support.launch_with_stand_ins``), the stock server included.

The workload is a fixed sequence of prompts (token ids) on a 512-slot device pool: the first is
backed up to the host when it is hit, evicted from the device by the long ones, and loaded back
into new device slots when it comes again while the device has room (``RELOADS``).
"""

import re
import time

import pytest

from tests.support.sglang_server import STAND_INS, TINY_ENGINE_ARGS, Server, installed_sglang_jax

pytestmark = pytest.mark.integration
if installed_sglang_jax() != "main":
    pytest.skip("these tests need sglang-jax's main branch (BUILD.md)", allow_module_level=True)

from tests.support.tiny_qwen2 import write_tiny_qwen2  # noqa: E402

HICACHE_ARGS = ("--max-total-tokens", "512", "--hicache-storage", "none", "--hicache-ratio", "8",
                "--chunked-prefill-size", "512", "--precompile-token-paddings", "64", "512")
#: (prompt, length): A is backed up when it is hit again, evicted by B, loaded back at its last two
SEQUENCE = (("A", 60), ("A", 60), ("C", 60), ("B", 440), ("D", 60), ("D", 60), ("A", 60),
            ("B", 440), ("D", 60), ("A", 60), ("B", 440), ("C", 60), ("A", 60))
LOADED = r"kv-canary: HiCache load of (\d+) page\(s\)"


def prompt_ids(name: str, n: int) -> list:
    return [(ord(name) * 7919 + i * 31) % 1000 + 10 for i in range(n)]


def run_sequence(srv, replies: bool = False) -> list:
    """The output token ids of ``SEQUENCE`` (or the whole replies), one request at a time."""
    out = []
    for name, n in SEQUENCE:
        r = srv.post("/generate", {"input_ids": prompt_ids(name, n),
                                   "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        out.append(r if replies else r["output_ids"])
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_qwen2(str(tmp_path_factory.mktemp("tiny-qwen2")))


def hicache_server(model_dir, tmp_path, name, *args, env=None):
    return Server(["--model-path", model_dir, *TINY_ENGINE_ARGS, *HICACHE_ARGS, *args],
                  str(tmp_path / f"{name}.log"), module=STAND_INS, env=env)


def loads(srv) -> int:
    """Pages the canary saw loaded back (its ``HiCache load`` lines)."""
    return sum(int(n) for n in re.findall(LOADED, srv.log()))


def hicache_metrics(srv, imported: int, timeout: float = 15.0) -> dict:
    """``kv_canary_hicache_pages_total`` from ``/metrics`` by ``what``, once the server has gone
    idle (when the canary brings its metrics up to date) and they show ``imported`` pages (or
    what they show after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        text = srv.get("/metrics")
        counts = {k: int(float(v)) for k, v in re.findall(
            r'kv_canary_hicache_pages_total\{what="(\w+)"\} (\S+)', text)}
        if counts.get("imported") == imported or time.monotonic() > deadline:
            return counts
        time.sleep(0.5)


@pytest.fixture(scope="module")
def stock(model_dir, tmp_path_factory):
    """The stock server's answers to ``SEQUENCE`` (with the stand-in, HiCache write_through)."""
    with hicache_server(model_dir, tmp_path_factory.mktemp("stock"), "stock",
                        "--kv-canary", "none") as srv:
        answers = run_sequence(srv)
    assert answers[0] == answers[1] == answers[6]     # A answers alike, hit or not
    return answers


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_hicache_reloads_are_guarded_with_the_stock_tokens(model_dir, stock, tmp_path, policy):
    """Every write policy, the overlap scheduler: the stock answers, pages loaded back with their
    records, no report (host copies checked, reloaded prefixes verified)."""
    with hicache_server(model_dir, tmp_path, policy, "--hicache-write-policy", policy,
                        "--kv-canary", "log", "--kv-canary-write-input-assert",
                        "--kv-canary-token-check", "--enable-metrics") as srv:
        answers = run_sequence(srv)
        counts = hicache_metrics(srv, loads(srv))
        log = srv.log()
        assert srv.reports() == [], srv.log_tail()
    assert "HiCache host records" in log and "Traceback" not in log
    assert loads(srv) >= 59, "nothing was loaded back: the workload no longer reaches a reload"
    assert answers == stock
    assert counts["imported"] == loads(srv) and counts["exported"] >= counts["imported"], counts


def test_hicache_with_tensor_parallelism(model_dir, stock, tmp_path):
    """``--tp-size 2``: each device's records travel as a block of their own; its heads of the
    host copy are checked against them."""
    with hicache_server(model_dir, tmp_path, "tp2", "--tp-size", "2", "--kv-canary", "log",
                        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}) as srv:
        answers = run_sequence(srv)
        assert srv.reports() == [], srv.log_tail()
        assert "tensor parallel over 2 devices" in srv.log()
    assert loads(srv) >= 59
    assert answers == stock


@pytest.mark.parametrize("kind,pages_re,mode", [
    ("hicache_reload_swap", r"each other's device pages \((\d+), (\d+)\)", "abort"),
    ("hicache_stale_page", r"device page (\d+) keeps its old KV", "log")])
def test_a_load_back_that_misplaces_or_skips_a_page_is_reported(model_dir, tmp_path, kind,
                                                                pages_re, mode):
    """The KV of two pages scattered into each other's device pages (mode abort), or one page not
    scattered at all (mode log), in a load back, the records where the load's page list says:
    the step that reads the prefix reports those slots (``verify_real_kv_hash`` at TAIL); the log
    names the request, or the request ends with the canary's abort and the server serves on."""
    args = ("--kv-canary", "log") if mode == "log" else ("--kv-canary", "abort")
    with hicache_server(model_dir, tmp_path, kind, *args, "--kv-canary-inject", kind,
                        "--kv-canary-inject-step", "1") as srv:
        replies = run_sequence(srv, replies=True)
        injected = srv.injected()
        assert injected is not None and injected[0] == kind, srv.log_tail()
        damaged = {int(p) for p in re.search(pages_re, srv.log()).groups()}
        hits = {slot for tag, why, slot, pumped in srv.reports()
                if tag == "TAIL_K_FULL" and "verify_real_kv_hash" in why.split("+")
                and pumped <= injected[1] + 2}
        after = srv.generate("a request after the fault", 4)
        log = srv.log()
    assert hits and hits <= damaged, (hits, damaged)
    assert after["meta_info"]["finish_reason"]["type"] != "abort" and "Traceback" not in log
    if mode == "log":
        assert re.search(r"kv-canary: request rid=\S+ read KV that failed the canary", log)
    else:
        aborted = [r for r in replies if r["meta_info"]["finish_reason"]["type"] == "abort"]
        assert aborted and all("kv-canary: request aborted" in
                               r["meta_info"]["finish_reason"]["message"] for r in aborted)


def test_a_host_copy_damaged_in_transit_is_reported_by_the_host_check(model_dir, tmp_path):
    """One byte of a page's host copy flipped after the device-to-host copy: the host check reports
    it at once (``HOST_BACKUP_K_FULL verify_real_kv_hash``), naming the device slot it was copied
    from; the device KV is intact, so nothing else is reported."""
    with hicache_server(model_dir, tmp_path, "flip", "--kv-canary", "log",
                        "--kv-canary-inject", "hicache_host_flip",
                        "--kv-canary-inject-step", "1") as srv:
        first = srv.post("/generate", {"input_ids": prompt_ids("A", 60),
                                       "sampling_params": {"max_new_tokens": 8,
                                                           "temperature": 0}})
        assert srv.injected() is None and srv.reports() == []     # a miss: nothing backed up
        srv.post("/generate", {"input_ids": prompt_ids("A", 60),  # a hit: A is backed up
                               "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        injected = srv.wait_for_log(r"kv-canary: injected hicache_host_flip", 30)
        assert injected, srv.log_tail()
        assert srv.wait_for_log(r"launch_tag=HOST_BACKUP_K_FULL", 30), srv.log_tail()
        reports = srv.reports()
    assert first["output_ids"]
    assert [(tag, why) for tag, why, _, _ in reports] == [("HOST_BACKUP_K_FULL",
                                                           "verify_real_kv_hash")], reports
    assert reports[0][2] == 1              # the device slot of A's position 0 (slot 0: padding)


def test_loaded_pages_freed_while_in_use_are_reported_and_the_request_aborted(model_dir, tmp_path):
    """The device pages of a load back put on the free list while the tree and the request use
    them (the class of #1618): the next allocation writes new records there, the
    step that reads them reports those slots, and a request reading them is aborted. As with the
    real bug, sglang-jax's idle memory check then finds the pages counted twice and ends the
    server: the sequence stops at the first request it no longer answers. The requests ignore the
    end token: one that ends at its first token has read only intact KV, and the step that finds
    the freed pages written must find their reader still running."""
    replies = []
    with hicache_server(model_dir, tmp_path, "revive", "--kv-canary", "abort",
                        "--kv-canary-inject", "hicache_revive_free",
                        "--kv-canary-inject-step", "1") as srv:
        for name, n in SEQUENCE:
            try:
                replies.append(srv.post("/generate", {
                    "input_ids": prompt_ids(name, n),
                    "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                        "ignore_eos": True}}))
            except OSError:                       # the server ended (its memory check)
                break
        injected = srv.injected()
        assert injected is not None and injected[0] == "hicache_revive_free", srv.log_tail()
        freed = {int(p) for p in re.search(r"device pages \[([\d, ]+)\]", srv.log())
                 .group(1).split(",")}            # page size 1: the pages are the slots
        reports = srv.reports()
        log = srv.log()
    assert reports and {slot for _, _, slot, _ in reports} <= freed, reports
    assert any("verify_position" in why.split("+") for _, why, _, _ in reports), reports
    aborted = [r for r in replies if r["meta_info"]["finish_reason"]["type"] == "abort"]
    assert aborted and all("kv-canary: request aborted" in
                           r["meta_info"]["finish_reason"]["message"] for r in aborted), replies
    steps = [int(n) for n in re.findall(r"kv-canary: aborting request rid=\S+ at step (\d+)", log)]
    assert steps and steps[0] <= injected[1] + 2, (injected, steps)   # the gate, before the log
