"""The requests a violation concerns, found before their step's results are processed
(``request_guard``), without sglang-jax: a real canary on a stand-in runner and scheduler
(``tests.support.sglang_fakes``). One test per way a damaged request escaped mode ``abort``:

- a request finished before the readback of the step that damaged it (the readback lagged):
  the gate decodes each step before its results are processed, with both schedulers;
- rows past a full ring were never seen: the ring is emptied after each step with rows, and a
  step whose rows overflow it names every request of that step;
- rows named slots, and every request holding a named slot was aborted, innocent sharers too:
  rows name requests by what the step read and wrote;
- a rate-limited log: the guard gets every row whatever the log shows.
"""

import logging

import numpy as np
import pytest

from jax_kvcanary.integrations import sglang_jax as kvc_sgl
from jax_kvcanary.integrations.sglang_jax.request_guard import (install_request_guard,
                                                                  named_batch_rows)
from jax_kvcanary.runtime import CanaryConfig
from tests.support.sglang_fakes import FakeReq, FakeScheduler, forward_batch, serving_runner

pytestmark = pytest.mark.integration

QUIET = logging.getLogger("kvc-guard-quiet")
QUIET.disabled = True


def guarded(overlap=False, abort=True, ring_capacity=1024, episodes=True):
    """A canary in a stand-in scheduler of two requests (pool rows 1 and 2, 3 tokens each)."""
    runner = serving_runner()
    table = np.zeros((4, 16), np.int32)
    table[1, :3] = [1, 2, 3]
    table[2, :3] = [4, 5, 6]
    reqs = [FakeReq("a", 1, 3), FakeReq("b", 2, 3)]
    sched = FakeScheduler(runner, reqs, table, overlap=overlap)
    config = CanaryConfig(mode="log", health_interval=0, ring_capacity=ring_capacity)
    canary = kvc_sgl.install_into_scheduler(sched, config, logger=QUIET, episodes=episodes)
    guard = install_request_guard(sched, canary, QUIET, abort=abort,
                                  finish_abort=lambda message: ("abort", message))
    return runner, sched, canary, guard, reqs


def prefill(runner, bid=1):
    """Both requests' first two tokens: slots 1, 2 (row 1) and 4, 5 (row 2)."""
    return forward_batch(runner.mesh, bid=bid, decode=False, req_pool_indices=[1, 2],
                         seq_lens=[2, 2], extend_prefix_lens=[0, 0], extend_seq_lens=[2, 2],
                         cache_loc=[1, 2, 4, 5], input_ids=[11, 12, 21, 22],
                         positions=[0, 1, 0, 1], out_cache_loc=[1, 2, 4, 5])


def decode(runner, bid, b_table=(4, 5, 6)):
    """One decode step of both; ``b_table``: the page table row 2's attention reads."""
    return forward_batch(runner.mesh, bid=bid, decode=True, req_pool_indices=[1, 2],
                         seq_lens=[3, 3], cache_loc=[1, 2, 3, *b_table], input_ids=[13, 23],
                         positions=[2, 2], out_cache_loc=[3, 6])


def step(runner, sched, fb):
    runner.jitted_run_model(fb, None)
    sched.process_batch_result(sched.batch, type("R", (), {"bid": fb.bid})())
    return sched.seen[-1]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_damaged_request_is_aborted_before_its_step_s_results_are_processed(overlap):
    """Row 2 reads slot 2 (row 1's position 1) as its position 0: the step that read it is
    decoded before its results are processed, so request b finishes there with the abort;
    a, which holds slot 2 at its own position, is not named."""
    runner, sched, canary, guard, _ = guarded(overlap=overlap)
    assert step(runner, sched, prefill(runner)) == {"a": None, "b": None}
    seen = step(runner, sched, decode(runner, 2, b_table=(2, 5, 6)))
    assert seen["a"] is None
    assert seen["b"][0] == "abort" and "KV slot(s) 2, 5 failed the KV-cache canary" in seen["b"][1]
    assert guard.named == ["b"]
    assert sched.resolved == (2 if overlap else 0)


def test_mode_log_names_each_damaged_request_once(caplog):
    runner, sched, canary, guard, _ = guarded(abort=False)
    step(runner, sched, prefill(runner))
    for bid in (2, 3):
        assert step(runner, sched, decode(runner, bid, b_table=(2, 5, 6))) == {"a": None,
                                                                              "b": None}
    assert guard.named == ["b"]


def test_the_ring_is_emptied_after_each_step_so_late_rows_still_name_requests():
    """A ring of 8 rows, and steps that record 8 rows each: without emptying it, every step after
    the first would lose its rows (a full ring keeps its first rows), and the guard see none."""
    runner, sched, canary, guard, reqs = guarded(ring_capacity=8, episodes=False)
    step(runner, sched, prefill(runner))
    for bid in range(2, 6):
        reqs[1].to_finish = None                    # b carries on, damaged again each step
        assert step(runner, sched, decode(runner, bid, b_table=(2, 5, 6)))["b"][0] == "abort"
    assert canary.monitor.rows_lost == 0
    assert len(canary.monitor.violations) == canary.monitor.total == 4 * 8
    assert sorted({v.launch_step for v in canary.monitor.violations}) == [2, 3, 4, 5]


def test_rows_past_a_full_ring_name_every_request_of_their_step():
    """A ring of 2 rows and a step with 6: the lost rows could name any request of the step."""
    runner, sched, canary, guard, _ = guarded(ring_capacity=2, episodes=False)
    step(runner, sched, prefill(runner))
    seen = step(runner, sched, decode(runner, 2, b_table=(2, 5, 6)))
    assert canary.monitor.rows_lost > 0 and canary.monitor.lost_steps == [2]
    assert seen["b"][0] == "abort"
    assert seen["a"][0] == "abort" and "overflowed the ring" in seen["a"][1]


def test_the_guard_gets_every_row_whatever_the_log_s_rate_limit():
    """Episodes rate-limit what the log shows; the guard is fed every decoded row."""
    runner, sched, canary, guard, _ = guarded(abort=False)
    got = []
    canary.violation_hooks.append(got.extend)
    step(runner, sched, prefill(runner))
    step(runner, sched, decode(runner, 2, b_table=(2, 5, 6)))
    assert len(got) == len(canary.monitor.violations) > 0


def test_named_batch_rows_follow_the_step_s_own_table():
    """verify rows name the batch row whose segment holds the slot at that position; write rows
    the batch row that wrote the slot; page-aligned segments when the backend reads them so."""
    arrays = dict(req_pool_indices=np.array([1, 2, -1]), seq_lens=np.array([3, 3, 0]),
                  cache_loc=np.array([1, 2, 3, 2, 5, 6, 0, 0]), out_cache_loc=np.array([3, 6, -1]),
                  positions=np.array([2, 2, 0]), extend_seq_lens=None)
    row = lambda slot, pos, bits, tag=0, kind=0: np.array([tag, slot, pos, 0, 0, kind, 0, bits],
                                                          np.int64)
    rows = np.stack([
        row(2, 1, 2 | 1),      # slot 2 stored at position 1, read elsewhere: row 2 (at 0)
        row(2, 1, 1),          # a chain row of slot 2 read at its stored position: row 1
        row(6, 2, 8),          # write_token of slot 6 at position 2: row 2 wrote it
        row(9, 0, 2),          # a slot no entry has
        row(2, 1, 2, tag=4),   # a sweep row: left to the running requests' tables
        row(5, 1, 64, kind=3),  # out of range, at the expected position 1: row 2
    ])
    got = named_batch_rows(rows, arrays, decode=True, page_size=1, aligned=False)
    assert got == {1: [0, 2, 5], 0: [1]}
    aligned = dict(arrays, cache_loc=np.array([1, 2, 3, 0, 2, 5, 6, 0]))
    got = named_batch_rows(rows[:2], aligned, decode=True, page_size=4, aligned=True)
    assert got == {1: [0], 0: [1]}


def test_named_batch_rows_of_the_swa_group_follow_the_map_and_the_window():
    """SWA rows name SWA slots (the step's full-to-SWA map), read in the last ``swa_window``
    positions; an evicted-in-window row (slot -1, expected position p) names the requests whose
    position p inside their window maps to 0, not one whose position p left its window."""
    lut = np.zeros(16, np.int64)
    lut[[1, 2, 3, 4, 7, 8]] = [11, 12, 13, 14, 17, 18]      # full 5 and 6 evicted
    arrays = dict(req_pool_indices=np.array([1, 2]), seq_lens=np.array([4, 4]),
                  cache_loc=np.array([1, 5, 3, 4, 6, 7, 8, 2]), out_cache_loc=np.array([4, 2]),
                  positions=np.array([3, 3]), extend_seq_lens=None, swa_lut=lut)
    row = lambda tag, slot, pos, bits, kind=0: np.array([tag, slot, pos, 0, 0, kind, 0, bits],
                                                        np.int64)
    HEAD_K_SWA, TAIL_K_FULL = 6, 2
    rows = np.stack([
        row(HEAD_K_SWA, -1, 1, 64, kind=3),  # position 1 of row 0 evicted inside its window (3)
        row(HEAD_K_SWA, -1, 0, 64, kind=3),  # position 0 of row 1: evicted, outside its window
        row(HEAD_K_SWA, 13, 2, 1),           # SWA slot 13 = full 3, position 2 of row 0
        row(HEAD_K_SWA, 12, 3, 8),           # a write of SWA slot 12 (full 2) by row 1
        row(TAIL_K_FULL, 13, 2, 1),          # a FULL row naming full slot 13: nobody
    ])
    got = named_batch_rows(rows, arrays, decode=True, page_size=1, aligned=False, swa_window=3)
    assert got == {0: [0, 2], 1: [3]}


@pytest.mark.parametrize("abort", [False, True])
def test_an_engine_error_after_a_damaged_step_still_reports_it(abort, caplog):
    """The engine's own error ends the scheduler's loop after a damaged step was launched and
    before its results are processed (sglang-jax #1355 on the CPU: its "Out of memory" right
    after a step read KV never written): the canary decodes that step first, names its request
    (in either mode: no answer is left to abort) and says the engine's error ends the server;
    the engine's error is the one raised."""
    runner = serving_runner()
    table = np.zeros((4, 16), np.int32)
    table[1, :3], table[2, :3] = [1, 2, 3], [4, 5, 6]
    sched = FakeScheduler(runner, [FakeReq("a", 1, 3), FakeReq("b", 2, 3)], table)

    def event_loop_normal():
        step(runner, sched, prefill(runner))
        runner.jitted_run_model(decode(runner, 2, b_table=(2, 5, 6)), None)
        raise RuntimeError("Out of memory. Try to lower your batch size.")

    sched.event_loop_normal = event_loop_normal
    logger = logging.getLogger(f"kvc-guard-engine-error-{abort}")
    canary = kvc_sgl.install_into_scheduler(sched, CanaryConfig(mode="log", health_interval=0),
                                            logger=logger, episodes=True)
    guard = install_request_guard(sched, canary, logger, abort=abort,
                                  finish_abort=lambda message: ("abort", message))
    with caplog.at_level(logging.WARNING, logger=logger.name), \
            pytest.raises(RuntimeError, match="Out of memory"):
        sched.event_loop_normal()
    assert guard.named == ["b"] and sched.seen == [{"a": None, "b": None}]
    named = [m for m in caplog.messages if m.startswith("kv-canary: request rid=b ")]
    assert len(named) == 1 and "at step 2: its KV slot(s) 2, 5 failed" in named[0]
    assert named[0].endswith("the engine's own error ends the server before it answers")
    assert caplog.messages[-1].startswith("kv-canary: the engine's scheduler raised RuntimeError; "
                                          "the canary's last steps are reported above")


def test_the_canary_s_own_error_is_not_reported_as_the_engine_s(caplog):
    """Mode ``raise`` and a failed health check end the loop with the canary's own error, whose
    report is made already: no "the engine's scheduler raised" line."""
    from jax_kvcanary.runtime.errors import CanaryHealthError

    runner = serving_runner()
    sched = FakeScheduler(runner, [], np.zeros((4, 16), np.int32))

    def event_loop_normal():
        raise CanaryHealthError("kv-canary: health check failed at step 17")

    sched.event_loop_normal = event_loop_normal
    logger = logging.getLogger("kvc-guard-own-error")
    kvc_sgl.install_into_scheduler(sched, CanaryConfig(mode="log", health_interval=0),
                                   logger=logger)
    with caplog.at_level(logging.WARNING, logger=logger.name), \
            pytest.raises(CanaryHealthError):
        sched.event_loop_normal()
    assert caplog.messages == []
