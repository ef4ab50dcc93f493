"""The hybrid sliding-window KV pool (``SWAKVPool``: sliding layers' KV in a second, smaller pool
reached through a full-to-SWA slot map) in sglang-jax's own HTTP server: served on the CPU, then
guarded (FULL and SWA groups) with the stock tokens, and its faults reported.

sglang-jax serves this pool on TPUs only; the servers here run with the CPU stand-in of that path
(``tests/support/cpu_stand_ins.py``, ``serve_swa_pool_on_cpu``), started by
``tests.support.launch_with_stand_ins``. The model is a tiny Gemma2 (sliding layers 0 and 2, window
``WINDOW``); the reference answers are the same model's with ``--disable-hybrid-swa-memory`` (every
layer's KV in one full pool).
"""

import re

import pytest

from tests.support.sglang_server import (STAND_INS, TINY_ENGINE_ARGS, Server, check_acted_on,
                                        installed_sglang_jax)

pytestmark = pytest.mark.integration
if installed_sglang_jax() != "main":
    pytest.skip("these tests need sglang-jax's main branch (BUILD.md)", allow_module_level=True)

from tests.support.tiny_gemma2 import WINDOW, write_tiny_gemma2  # noqa: E402

PROMPT = "the key value cache holds the keys and values of every token a request has seen"
PAIR = ["what is the capital of france and how many tokens fit in a page",
        "alpha beta gamma delta epsilon zeta eta theta"]
#: tokens each request generates: every request runs past twice the window
NEW = 120
#: the SWA pool's share of the full pool's slots: a pool of 195 slots, fewer than the requests
#: hold, so that its allocator hands out freed slots again (the full-to-SWA map is no identity)
RATIO = ["--swa-full-tokens-ratio", "0.05"]
SWA_POOL_RE = re.compile(r"Use Sliding window memory pool\. full_layer_tokens=(\d+), "
                         r"swa_layer_tokens=(\d+)")
DECODE_RE = re.compile(r"Decode batch\. #running-req: \d+, #full token: (\d+), "
                       r"full token usage: [\d.]+, #swa token: (\d+)")
STATS_RE = re.compile(r"kv_canary stats: .* HEAD_K_SWA=verified:(\d+),written:(\d+)")
SWEPT_RE = re.compile(r"kv_canary stats: .* SWEEP_K_FULL=verified:(\d+)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_gemma2(str(tmp_path_factory.mktemp("tiny-gemma2")))


def server(model_dir, tmp_path, *args, name):
    return Server(["--model-path", model_dir, *TINY_ENGINE_ARGS, *args],
                  str(tmp_path / f"{name}.log"), module=STAND_INS)


def answers(srv, batch: bool = True) -> list:
    """Replies (greedy, EOS ignored), one request at a time: a prompt, the same prompt again (a
    prefix hit), then two prompts in one ``/generate`` (a batch; with ``batch=False`` one after
    the other)."""
    out = [srv.generate(PROMPT, NEW, ignore_eos=True), srv.generate(PROMPT, NEW, ignore_eos=True)]
    if batch:
        return out + srv.generate(PAIR, NEW, ignore_eos=True)
    return out + [srv.generate(p, NEW, ignore_eos=True) for p in PAIR]


def ids(replies) -> list:
    return [r["output_ids"] for r in replies]


@pytest.fixture(scope="module")
def full_pool(model_dir, tmp_path_factory):
    """The stock server's replies with one full pool (``--disable-hybrid-swa-memory``)."""
    with server(model_dir, tmp_path_factory.mktemp("full"), "--kv-canary", "none",
                "--disable-hybrid-swa-memory", name="full") as srv:
        replies, log = answers(srv), srv.log()
    assert SWA_POOL_RE.search(log) is None, log[-3000:]
    return replies


def check_swa_run(replies, log) -> None:
    """The hybrid pool served these replies, and its SWA slots were freed behind the window and
    handed out again."""
    pool = SWA_POOL_RE.search(log)
    assert pool, log[-3000:]
    held = [r["meta_info"]["prompt_tokens"] + len(r["output_ids"]) for r in replies]
    assert min(held) > 2 * WINDOW and int(pool.group(2)) < sum(held)
    assert replies[1]["meta_info"]["cached_tokens"] > 0                # the prefix hit
    usage = [(int(f), int(s)) for f, s in DECODE_RE.findall(log)]
    assert any(s < f for f, s in usage), usage


def test_the_swa_pool_stand_in_answers_as_one_full_pool(model_dir, full_pool, tmp_path):
    """The stock server on the hybrid pool with the stand-in: the full pool's tokens, while the SWA
    pool frees the slots of tokens that left the window."""
    with server(model_dir, tmp_path, "--kv-canary", "none", *RATIO, name="swa") as srv:
        replies, log = answers(srv), srv.log()
    check_swa_run(replies, log)
    assert ids(replies) == ids(full_pool)


@pytest.mark.parametrize("page_size", [1, 4])
def test_the_hybrid_swa_pool_is_guarded_with_the_stock_tokens(model_dir, full_pool, tmp_path,
                                                              page_size):
    """The canary on the hybrid pool, with the write-input assert, the token check and sweeps:
    both groups checked every step (the SWA group in its own slot space, through the step's map,
    its window's positions required to be in the SWA pool), the SWA radix cache's full-pool slots
    swept (the FULL group only), the stock tokens, no report. At page size
    4 the pair goes one request at a time: a batch there is where sglang-jax's native backend reads
    the page-aligned table at unaligned offsets, which the canary reports (README;
    ``test_sglang_jax_server.test_page_size_4``)."""
    with server(model_dir, tmp_path, "--kv-canary", "log", "--kv-canary-stats-interval", "50",
                "--kv-canary-write-input-assert", "--kv-canary-token-check", *RATIO,
                "--kv-canary-sweep-interval", "16", "--page-size", str(page_size),
                name=f"swa-guarded-{page_size}") as srv:
        replies, reports, log = answers(srv, batch=page_size == 1), srv.reports(), srv.log()
    assert f"FULL and SWA groups (hybrid SWA pool, window {WINDOW})" in log, log[-3000:]
    assert reports == [] and "Traceback" not in log, log[-3000:]
    stats = STATS_RE.findall(log)
    assert stats and int(stats[-1][0]) > 0 and int(stats[-1][1]) > 0, log[-3000:]
    swept = SWEPT_RE.findall(log)
    assert swept and int(swept[-1]) > 0 and "SWEEP_K_SWA" not in log, log[-3000:]
    check_swa_run(replies, log)
    assert ids(replies) == ids(full_pool)


#: kind: (mode, reason of the SWA rows, whether the FULL group stays intact); every kind but the
#: swa_* ones is aimed at the SWA group with --kv-canary-inject-group SWA. CI runs the faults of
#: the SWA group alone (``slow``: those that damage both groups' reads)
SWA_FAULTS = {
    "swa_evicted_in_window": ("abort", "index_out_of_range", True),
    "swa_map_stale": ("log", "verify_position", True),
    "real_kv_used": ("abort", "verify_real_kv_hash", True),
    "slot_double_free": ("log", "verify_position", True),
    "req_to_token_swap": ("log", "verify_position", False),
    "cache_loc_off_by_one": ("abort", "verify_position", False),
    "wrong_position": ("log", "write_position", False),
}


@pytest.mark.parametrize("kind", [k if SWA_FAULTS[k][2] else pytest.param(k, marks=pytest.mark.slow)
                                  for k in SWA_FAULTS])
def test_faults_aimed_at_the_swa_group_are_reported(model_dir, tmp_path, kind):
    """A map entry inside a request's window zeroed (evicted too early) or pointed at another SWA
    slot (stale), and the existing kinds aimed at the SWA group (a sliding layer's KV bytes, the
    SWA allocator, positions inside the window): reported on the SWA group within two steps, and
    the request that read it ends with the canary's abort (mode log names it instead)."""
    mode, reason, full_intact = SWA_FAULTS[kind]
    group = [] if kind.startswith("swa_") else ["--kv-canary-inject-group", "SWA"]
    with server(model_dir, tmp_path, "--kv-canary", mode, *RATIO, "--kv-canary-inject", kind,
                *group, "--kv-canary-inject-step", "20", name=kind) as srv:
        reply = srv.generate(PROMPT, 60, ignore_eos=True)
        injected, reports, log = srv.injected(), srv.reports(), srv.log()
    assert injected is not None and injected[0] == kind, log[-3000:]
    assert "on the SWA group" in log or not group, log[-3000:]
    swa = [r for r in reports if r[0].endswith("_SWA") and reason in r[1].split("+")]
    assert swa and min(p for _, _, _, p in swa) <= injected[1] + 2, reports
    if full_intact:
        assert all(r[0].endswith("_SWA") for r in reports), reports
    check_acted_on(mode, reply, log)
    assert "Traceback" not in log, log[-3000:]


def test_a_flipped_byte_in_a_cached_prefix_is_found_by_a_sweep_of_the_swa_radix_cache(model_dir,
                                                                                       tmp_path):
    """``real_kv_unused_cache`` on the hybrid pool: a byte of a slot the SWA radix cache holds and
    no running request reads, flipped in the first full layer's KV; the sweep of the SWA radix
    cache (its FULL group) reports it within two steps."""
    with server(model_dir, tmp_path, "--kv-canary", "log", *RATIO, "--kv-canary-sweep-interval",
                "1", "--kv-canary-inject", "real_kv_unused_cache", "--kv-canary-inject-step", "20",
                name="unused-cache") as srv:
        srv.generate(PAIR[1], 8, ignore_eos=True)                  # a cached prefix, unused later
        srv.generate(PROMPT, 40, ignore_eos=True)
        injected, reports, log = srv.injected(), srv.reports(), srv.log()
    assert injected is not None and injected[0] == "real_kv_unused_cache", log[-3000:]
    swept = [p for t, why, _, p in reports
             if t == "SWEEP_K_FULL" and "verify_real_kv_hash" in why.split("+")]
    assert swept and min(swept) <= injected[1] + 2, reports
    assert "Traceback" not in log, log[-3000:]
