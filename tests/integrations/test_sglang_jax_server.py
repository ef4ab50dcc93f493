"""sglang-jax's own HTTP server guarded by the launcher, end to end, against sglang-jax main.

Each test starts ``python -m jax_kvcanary.integrations.sglang_jax.launch_server`` on 127.0.0.1
with a tiny Qwen2 written at test time (config, seeded random weights in safetensors, a locally
trained tokenizer) and talks to it over HTTP: ``/generate`` single and batched,
``/v1/completions``, a prefix-cache hit, a chunked prefill (a prompt longer than
``--chunked-prefill-size``), with the overlap scheduler on and off. The canary must not change a
single output token, must compile nothing on the request path (sglang-jax's own
``cache_miss_count`` stays 0), must report nothing on clean runs, and must report every fault the
launcher plants (``--kv-canary-inject``) in the server's log within two steps. Servers are stopped
by their process group.
"""

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from tests.support.sglang_server import (LAUNCHER, PREFIX_HIT, PROMPTS, TINY_ENGINE_ARGS, Server,
                                         free_port, installed_sglang_jax, scrape)
from tests.support import program_count
from tests.support.tiny_qwen2 import write_tiny_qwen2

pytestmark = pytest.mark.integration
if installed_sglang_jax() is None:
    pytest.skip("sglang-jax is not installed; BUILD.md says how to install its main branch",
                allow_module_level=True)
if installed_sglang_jax() != "main":
    pytest.skip("this sglang-jax is the 0.0.2 release, whose HTTP server cannot serve on the CPU; "
                "these tests need sglang-jax's main branch", allow_module_level=True)
import sgl_jax.launch_server  # noqa: E402,F401  (a broken install fails here, it does not skip)

LONG = " ".join(["a canary record per slot holds the token, its position and a hash"] * 10)
CHUNK = 64
ABORT_TOKENS = 24
#: the write-input assert and the token check (the scheduler's intended tokens, on the device)
TOKEN_FLAGS = ("--kv-canary-write-input-assert", "--kv-canary-token-check")
#: the launcher with each engine step's XLA programs counted (``tests.support.program_count``)
COUNTING_LAUNCHER = "tests.support.launch_counting_programs"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_qwen2(str(tmp_path_factory.mktemp("tiny-qwen2")))


def server(model_dir, tmp_path, *args, name="server", env=None):
    """An unstarted ``Server`` of the launcher with the tiny engine and ``args``."""
    return Server(["--model-path", model_dir, *TINY_ENGINE_ARGS, *args],
                  str(tmp_path / f"{name}.log"), env=env)


def sequential(srv, pause: float = 0.0):
    """One request at a time: ``(outputs, meta)``: the generated token ids (the completion's text)
    of each request in order, and each ``/generate`` response's ``meta_info``. ``pause``: seconds
    between requests (the overlap scheduler may still hold a request whose reply has been sent
    when the next one arrives: that is a batch of two, see ``batched``)."""
    outs, metas = [], []

    def keep(r):
        outs.append(r["output_ids"])
        metas.append(r["meta_info"])
        time.sleep(pause)

    keep(srv.generate(PROMPTS[0], 16))
    outs.append(srv.completions(PROMPTS[3], 10)["choices"][0]["text"])
    time.sleep(pause)
    keep(srv.generate(PREFIX_HIT, 8))                               # prefix-cache hit
    keep(srv.generate(LONG, 6))                                     # chunked prefill
    return outs, metas


def batched(srv):
    """Two prompts in one ``/generate``: ``(outputs, meta)`` as ``sequential``."""
    rs = srv.generate(PROMPTS[1:3], 12)
    return [r["output_ids"] for r in rs], [r["meta_info"] for r in rs]


def assert_clean(srv, outs, metas, reference):
    assert outs == reference
    assert [m["cache_miss_count"] for m in metas] == [0] * len(metas)   # nothing compiled
    log = srv.log()
    assert "kv-canary: installed (mode=" in log
    assert srv.reports() == []
    assert "Traceback" not in log


class CountedSteps:
    """A server of the launcher that counts each engine step's XLA programs
    (``tests.support.program_count``): ``start()`` / ``stop()`` counting, ``steps()`` read."""

    def __init__(self, model_dir, tmp_path, *args, name):
        self.path = str(tmp_path / f"{name}-steps.jsonl")
        self.server = Server(["--model-path", model_dir, *TINY_ENGINE_ARGS, *args],
                             str(tmp_path / f"{name}.log"), module=COUNTING_LAUNCHER,
                             env={program_count.PATH_ENV: self.path})

    def start(self):
        open(self.path + ".on", "w").close()

    def stop(self):
        os.remove(self.path + ".on")

    def steps(self) -> list:
        with open(self.path) as f:
            return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    """The stock server (``--kv-canary none``, the non-overlap scheduler): the outputs of the
    sequential and the batched requests, and each of their steps' programs and model outputs."""
    counted = CountedSteps(model_dir, tmp_path_factory.mktemp("stock"), "--kv-canary", "none",
                           "--disable-overlap-schedule", name="stock")
    with counted.server as srv:
        counted.start()
        seq, seq_meta = sequential(srv)
        counted.stop()
        both, both_meta = batched(srv)
        alone = [srv.generate(p, ABORT_TOKENS)["output_ids"] for p in PROMPTS[:3]]
        log = srv.log()
    assert "kv-canary" not in log and "kv_canary" not in log        # exactly the stock server
    assert seq_meta[1]["cached_tokens"] > 0                         # the prefix hit
    assert seq_meta[2]["prompt_tokens"] > 2 * CHUNK                 # chunked prefill
    assert [m["cache_miss_count"] for m in seq_meta + both_meta] == [0] * 5
    return {"sequential": seq, "batched": both, "alone": alone, "steps": counted.steps()}


def test_one_program_per_step_with_the_same_model_outputs(model_dir, tmp_path, reference):
    """Guarded, the checks run in the engine's own step program: every step of the sequential
    requests (prefills, a prefix hit, chunks, decodes) executes as many XLA programs as the stock
    server's same step, and its next-token logits and sampled ids are the same bytes. (Sweeps,
    off here, are one more program every sweep interval. The batched requests are not counted:
    whether their prompts reach the scheduler in one batch or two is a matter of timing.)"""
    counted = CountedSteps(model_dir, tmp_path, "--kv-canary", "log",
                           "--disable-overlap-schedule", name="guarded")
    with counted.server as srv:
        counted.start()
        outs, metas = sequential(srv)
        counted.stop()
        assert_clean(srv, outs, metas, reference["sequential"])
        outs, metas = batched(srv)
        assert_clean(srv, outs, metas, reference["batched"])
        assert "checks in the engine's step program" in srv.log()
    steps, stock = counted.steps(), reference["steps"]
    assert [s["mode"] for s in stock].count("DECODE") >= 30 and all(
        s["programs"] > 0 for s in stock)
    assert steps == stock


def test_overlap_scheduler_same_text_no_violation(model_dir, tmp_path, reference):
    """The overlap scheduler (sglang-jax's default), one request at a time, with the write-input
    assert and the token check. (Concurrent requests under it:
    ``test_overlap_scheduler_page_table_race_is_reported``.)"""
    with server(model_dir, tmp_path, "--kv-canary", "log", "--kv-canary-sweep-interval", "4",
                *TOKEN_FLAGS) as srv:
        outs, metas = sequential(srv, pause=0.5)
        assert_clean(srv, outs, metas, reference["sequential"])
        assert "disable_overlap_schedule=False" in srv.log()
        assert ", write-input assert, token check" in srv.log()


def test_non_overlap_single_process_aot_dispatch_same_text(model_dir, tmp_path, reference):
    """The non-overlap scheduler in the launcher's own process, sglang-jax's AOT dispatcher
    (``SGLANG_JAX_AOT_DISPATCH=1``, which the wrapped model call and sampler go through),
    real-data ``all``, the write-input assert and the token check."""
    with server(model_dir, tmp_path, "--kv-canary", "log", "--kv-canary-real-data", "all",
                *TOKEN_FLAGS,
                "--disable-overlap-schedule", "--enable-single-process",
                env={"SGLANG_JAX_AOT_DISPATCH": "1"}) as srv:
        outs, metas = sequential(srv)
        assert_clean(srv, outs, metas, reference["sequential"])
        outs, metas = batched(srv)
        assert_clean(srv, outs, metas, reference["batched"])
        assert "[aot-dispatch:run_model]" in srv.log()


def test_page_size_4(model_dir, tmp_path, reference):
    """Page size 4: the same text one request at a time, without a report. A batch of two is where
    sglang-jax's native attention backend reads the page-aligned ``cache_loc`` at unaligned
    offsets: the second request attends to the wrong slots, answers differently than alone, and
    the canary reports it."""
    with server(model_dir, tmp_path, "--kv-canary", "log", "--page-size", "4",
                "--disable-overlap-schedule") as srv:
        outs, metas = sequential(srv)
        assert_clean(srv, outs, metas, reference["sequential"])
        alone = [srv.generate(p, 12)["output_ids"] for p in PROMPTS[1:3]]
        assert alone == reference["batched"]
        assert srv.reports() == []
        both, _ = batched(srv)
        srv.generate(PROMPTS[0], 4)                                 # more steps: the readback
    assert both[0] == alone[0] and both[1] != alone[1]
    reasons = {why for _, why, _, _ in srv.reports()}
    assert any("verify_position" in why for why in reasons), reasons


INJECT_CASES = {
    # kind: (extra launcher flags, expected (tag prefix, reason) of the first report)
    "req_to_token_swap": ((), ("HEAD_", "verify_position")),
    "slot_double_free": ((), ("HEAD_", "verify_position")),
    "real_kv_used": ((), ("TAIL_K_FULL", "verify_real_kv_hash")),
    "real_kv_unused_cache": (("--kv-canary-sweep-interval", "1"), ("SWEEP_K_FULL",
                                                                   "verify_real_kv_hash")),
    "wrong_position": ((), ("HEAD_", "write_position")),
    "cache_loc_off_by_one": ((), ("HEAD_", "verify_position")),
}


def tensor_parallel(tp: int) -> dict:
    """The launcher arguments and environment of ``--tp-size tp`` on forced host devices."""
    if tp == 1:
        return dict(args=(), env=None)
    return dict(args=("--tp-size", str(tp)),
                env={"XLA_FLAGS": f"--xla_force_host_platform_device_count={tp}"})


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_same_text_no_violation(model_dir, tmp_path, reference, tp):
    """``--tp-size 2`` and ``4`` (the fused KV buffer's heads sharded over the devices; each
    device checks its own heads with a canary state of its own)."""
    par = tensor_parallel(tp)
    with server(model_dir, tmp_path, "--kv-canary", "log", "--kv-canary-sweep-interval", "4",
                *TOKEN_FLAGS, *par["args"], env=par["env"]) as srv:
        outs, metas = sequential(srv, pause=0.5)
        assert_clean(srv, outs, metas, reference["sequential"])
        assert f"tensor parallel over {tp} devices" in srv.log()


#: kinds CI also runs with --tp-size 2 (``slow``: the others there)
TP2_IN_CI = ("real_kv_used", "req_to_token_swap")


@pytest.mark.parametrize("kind, tp", [
    pytest.param(kind, tp, marks=() if tp == 1 or kind in TP2_IN_CI else pytest.mark.slow)
    for kind in sorted(INJECT_CASES) for tp in (1, 2)])
def test_injected_fault_is_reported_within_two_steps(model_dir, tmp_path, kind, tp):
    extra, (tag, reason) = INJECT_CASES[kind]
    par = tensor_parallel(tp)
    with server(model_dir, tmp_path, "--kv-canary", "log", "--kv-canary-inject", kind,
                "--kv-canary-inject-step", "4", *extra, *par["args"], env=par["env"]) as srv:
        srv.generate(PROMPTS[3], 4)                                 # a cached prefix, unused later
        srv.generate(PROMPTS[0], 24)                                # ~25 steps
        injected = srv.injected()
        assert injected is not None and injected[0] == kind, srv.log_tail()
        step = injected[1]
        reports = srv.reports()
        hits = [(t, why, pumped) for t, why, _, pumped in reports
                if t.startswith(tag) and reason in why.split("+")]
        assert hits, f"no {tag}* {reason} report after the {kind} at step {step}:\n{srv.log_tail()}"
        assert hits[0][2] <= step + 2, (step, hits[0])
        if tp > 1:                                        # rows say which device found them
            assert re.search(r"\n  device=\d tensor=\d \(", srv.log()), srv.log_tail()
        # one report per episode: no (tag, reasons, slot) is reported twice; once the server is
        # idle, each episode's summary gives its rows and steps
        seen = [(t, why, slot) for t, why, slot, _ in reports]
        assert len(seen) == len(set(seen)), seen
        assert srv.wait_for_log(r"kv_canary episode \d+ ended: launch_tag=\S+ ", timeout=10.0)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_request_fed_another_request_s_token_is_a_write_token_violation(model_dir, tmp_path,
                                                                          tp):
    """``future_token_ring_wrap`` (the effect of sglang-jax #1487: a DECODE step's input token is
    another request's) under the overlap scheduler: the KV records alone cannot see it, the
    write-input assert reports the entry the step wrote with it (the token it consumed, the one
    sampled for that request)."""
    par = tensor_parallel(tp)
    with server(model_dir, tmp_path, "--kv-canary", "log", *TOKEN_FLAGS,
                "--kv-canary-inject", "future_token_ring_wrap", "--kv-canary-inject-step", "4",
                *par["args"], env=par["env"]) as srv:
        batched(srv)                                     # two requests decode in one batch
        srv.generate(PROMPTS[3], 2)                      # more steps: the readback
        injected = srv.injected()
        assert injected is not None and injected[0] == "future_token_ring_wrap", srv.log_tail()
        slot, fed, was = re.search(r"injected future_token_ring_wrap at step \d+: .*written to "
                                   r"slot (\d+)\) set to (\d+), .*it was (\d+)",
                                   srv.log()).groups()
        # once idle, each episode is summed up (even one whose first report the rate limit held
        # back: a batch of two under the overlap scheduler may have reported the page-table race
        # the README describes just before): the entry the step wrote with the wrong token
        for tag in ("HEAD_K_FULL", "TAIL_K_FULL"):
            ended = srv.wait_for_log(rf"kv_canary episode \d+ ended: launch_tag={tag} "
                                     rf"fail_reason=write_token\S* slots={slot} .*", timeout=10.0)
            assert ended, srv.log_tail()
        first = re.search(rf"kv_canary episode \d+ ended: launch_tag=HEAD_K_FULL "
                          rf"fail_reason=write_token\S* slots={slot} rows=\d+ steps=(\d+)",
                          srv.log())
        assert int(first.group(1)) <= injected[1] + 2, (injected, first.group(0))  # readback lag
        full = re.search(rf"fail_reason=write_token\S* slot_idx={slot} position=\d+ "
                         rf"stored_token=(\d+) expected_token=(\d+) ", srv.log())
        if full:                               # the token it consumed, the one sampled for it
            assert full.groups() == (fed, was), full.group(0)
        assert "disable_overlap_schedule=False" in srv.log()


def test_a_violation_of_the_last_step_before_idle_is_reported_within_a_second(model_dir,
                                                                            tmp_path):
    """The readback lags one step; when the server goes idle after the step that found a
    violation, the report must not wait for the next request."""
    import time

    with server(model_dir, tmp_path, "--kv-canary", "log", "--kv-canary-inject", "wrong_position",
                "--kv-canary-inject-step", "5") as srv:
        srv.generate(PROMPTS[3], 4)                   # steps 1-4: prefill + 3 decodes
        srv.generate(PROMPTS[0], 1)                   # step 5: a prefill, the last step
        done = time.monotonic()
        assert srv.injected() == ("wrong_position", 5), srv.log_tail()
        while not srv.reports() and time.monotonic() - done < 1.0:
            time.sleep(0.05)
        assert srv.reports(), f"no report within 1 s of idling:\n{srv.log_tail()}"
        assert any("write_position" in why for _, why, _, _ in srv.reports())


def test_metrics_endpoint_and_stats_line(model_dir, tmp_path):
    """With ``--enable-metrics`` the canary's counters are on sglang-jax's own ``/metrics``
    (written by the scheduler process, aggregated by the HTTP process); with
    ``--kv-canary-stats-interval`` the log has upstream's stats line."""
    import time

    with server(model_dir, tmp_path, "--kv-canary", "log", "--enable-metrics",
                "--kv-canary-stats-interval", "8", "--kv-canary-sweep-interval", "4",
                "--kv-canary-inject", "wrong_position", "--kv-canary-inject-step", "6") as srv:
        srv.generate(PROMPTS[3], 4)
        srv.generate(PROMPTS[0], 24)
        # idle: the last readback is decoded, and after a pause the episodes end
        assert srv.wait_for_log(r"kv_canary episode \d+ ended: ", timeout=10.0), srv.log_tail()
        time.sleep(0.5)
        m = scrape(srv)
        log = srv.log()
    steps = m[("kv_canary_steps_total", ())]
    assert steps >= 28, m
    verified = {dict(k[1])["tag"]: v for k, v in m.items()
                if k[0] == "kv_canary_slots_verified_total"}
    written = {dict(k[1])["tag"]: v for k, v in m.items() if k[0] == "kv_canary_slots_written_total"}
    assert verified.get("HEAD_K_FULL", 0) > steps and written.get("HEAD_K_FULL", 0) >= 28, m
    assert written.get("TAIL_K_FULL", 0) >= 28 and m[("kv_canary_sweeps_total", ())] >= 5, m
    bad = {(dict(k[1])["tag"], dict(k[1])["reason"]): v for k, v in m.items()
           if k[0] == "kv_canary_violations_total"}
    ended = re.findall(r"kv_canary episode \d+ ended: launch_tag=(\S+) fail_reason=(\S+) "
                       r"slots=\S+ rows=(\d+)", log)
    assert ended, log[-3000:]
    for tag, reasons, rows in ended:                  # every row the log counted is counted here
        for reason in reasons.split("+"):
            assert bad.get((tag, reason), 0) >= int(rows), (tag, reason, rows, bad)
    assert m[("kv_canary_health_ok", ())] == 1 and m[("kv_canary_health_checks_total", ())] >= 1
    assert m[("kv_canary_protected_tokens", ())] > 0
    line = re.search(r"kv_canary stats: step=16 protected_tokens=(\d+) sweep_passes=(\d+) "
                     r"violations=(\d+) .*HEAD_K_FULL=verified:\d+,written:\d+.*; canary time per "
                     r"step over the last 16 steps: median", log)
    assert line and int(line.group(1)) > 0 and int(line.group(2)) >= 3, log[-3000:]


def test_abort_mode_ends_only_the_request_that_read_the_bad_slot(model_dir, tmp_path, reference):
    """``--kv-canary abort``: of three concurrent requests, the one whose KV slot was damaged ends
    with an abort carrying the report; the others answer as in a clean run; the damaged slot
    leaves the prefix cache, so the same prompt again is recomputed (no cache hit, no report) and
    answers as in a clean run; the server stays up. (Non-overlap scheduler: concurrent requests
    under the overlap one are ``test_overlap_scheduler_page_table_race_is_reported``'s matter.)"""
    import time

    with server(model_dir, tmp_path, "--kv-canary", "abort", "--disable-overlap-schedule",
                "--kv-canary-inject", "real_kv_used", "--kv-canary-inject-step", "4") as srv:
        replies = [None] * 3

        def request(i):
            replies[i] = srv.generate(PROMPTS[i], ABORT_TOKENS)

        threads = [threading.Thread(target=request, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert srv.injected() is not None, srv.log_tail()
        reasons = [r["meta_info"]["finish_reason"] for r in replies]
        aborted = [i for i, f in enumerate(reasons) if f["type"] == "abort"]
        assert len(aborted) == 1, (reasons, srv.log_tail())
        (bad,) = aborted
        assert reasons[bad]["message"].startswith("kv-canary: request aborted: its KV slot"), reasons
        assert "TAIL_K_FULL verify_real_kv_hash" in reasons[bad]["message"], reasons
        assert len(replies[bad]["output_ids"]) < ABORT_TOKENS
        for i in set(range(3)) - {bad}:
            assert reasons[i]["type"] == "length"
            assert replies[i]["output_ids"] == reference["alone"][i], i
        log = srv.log()
        assert f"kv-canary: aborting request rid={replies[bad]['meta_info']['id']}" in log, log[-3000:]
        assert re.search(r"kv-canary: evicted \d+ cached token\(s\) holding slot", log), log[-3000:]
        time.sleep(1.0)                                   # idle: every readback decoded
        seen = len(srv.reports())
        again = srv.generate(PROMPTS[bad], ABORT_TOKENS)
        assert again["meta_info"]["cached_tokens"] == 0       # recomputed, not the evicted KV
        assert again["output_ids"] == reference["alone"][bad]
        assert again["meta_info"]["finish_reason"]["type"] == "length"
        time.sleep(1.0)
        assert len(srv.reports()) == seen, srv.log_tail()
        assert srv.proc.poll() is None and "Traceback" not in srv.log()


def test_raise_mode_ends_the_server_with_the_report(model_dir, tmp_path):
    srv = server(model_dir, tmp_path, "--kv-canary", "raise", "--kv-canary-inject", "real_kv_used",
                 "--kv-canary-inject-step", "3").start()
    try:
        failed = []

        def request():
            try:
                srv.generate(PROMPTS[0], 40)
            except Exception as e:                  # the reply is cut off, never a hang
                failed.append(e)

        t = threading.Thread(target=request)
        t.start()
        code = srv.wait(timeout=120)
        t.join(timeout=60)
        assert code is not None and code != 0, srv.log_tail()
        assert not t.is_alive() and failed
        assert any(tag == "TAIL_K_FULL" and "verify_real_kv_hash" in why
                   for tag, why, _, _ in srv.reports()), srv.log_tail()
    finally:
        srv.stop()


@pytest.mark.parametrize("args, refused", [
    (["--dp-size", "2", "--tp-size", "2", "--kv-canary-token-check"],
     "kv-canary: --kv-canary-write-input-assert / --kv-canary-token-check with --dp-size 2 is "
     "not supported"),
    (["--kv-canary-inject", "real_kv_unused_cache"],
     "kv-canary: --kv-canary-inject real_kv_unused_cache without sweeps is not supported"),
    (["--attention-backend", "fa_mha"], "kv-canary: --attention-backend fa_mha is not supported"),
])
def test_unsupported_settings_are_refused_before_start(model_dir, args, refused):
    cmd = [sys.executable, "-m", LAUNCHER, "--kv-canary", "log", "--model-path", model_dir,
           "--device", "cpu", "--port", "1", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("kv-canary:")]
    assert len(lines) == 1 and lines[0].startswith(refused), r.stderr[-2000:]


def test_two_nodes_with_what_their_guard_lacks_are_refused_before_either_process_starts(
        model_dir):
    """``--nnodes 2`` with the overlap scheduler (several nodes are guarded with the non-overlap
    one: ``test_sglang_jax_nodes``): the two processes of a two-node server (one forced host
    device each, as the stock server serves it) are each refused before anything starts, with
    one ``kv-canary:`` line, rather than failing on their first request."""
    import signal

    init = free_port()
    procs = []
    try:
        for rank in (0, 1):
            cmd = [sys.executable, "-m", LAUNCHER, "--kv-canary", "abort", "--model-path", model_dir,
                   *TINY_ENGINE_ARGS, "--tp-size", "2", "--nnodes", "2", "--node-rank", str(rank),
                   "--dist-init-addr", f"127.0.0.1:{init}", "--host", "127.0.0.1",
                   "--port", str(free_port())]
            env = dict(os.environ, JAX_PLATFORMS="cpu",
                       XLA_FLAGS="--xla_force_host_platform_device_count=1")
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, env=env, start_new_session=True))
        for rank, proc in enumerate(procs):
            _, err = proc.communicate(timeout=300)
            lines = [ln for ln in err.splitlines() if ln.startswith("kv-canary:")]
            assert proc.returncode == 2, (rank, err[-2000:])
            assert len(lines) == 1 and lines[0].startswith(
                "kv-canary: the overlap scheduler (add --disable-overlap-schedule) with --nnodes 2 "
                "is not supported"), (rank, err[-2000:])
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_bad_canary_flags_exit_2(model_dir):
    for args in (["--kv-canary", "warn"], ["--kv-canary-inject", "nope"],
                 ["--kv-canary", "none", "--kv-canary-inject", "real_kv_used"]):
        r = subprocess.run([sys.executable, "-m", LAUNCHER, *args, "--model-path", model_dir],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2, (args, r.stderr[-1000:])
