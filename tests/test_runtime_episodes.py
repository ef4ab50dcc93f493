"""Episodes: a fault's rows reported once with a count (``EpisodeLog``), alone and in the Monitor."""

import logging

import pytest

from jax_kvcanary.consts import FailReason as F
from jax_kvcanary.consts import LaunchTag as T
from jax_kvcanary.runtime import CanaryViolationError, EpisodeLog, Monitor
from jax_kvcanary.runtime.report import format_report
from tests.test_runtime_monitor import FakeLog

KV = int(F.VERIFY_REAL_KV_HASH_MISMATCH)
POS = int(F.VERIFY_POSITION_MISMATCH)


def row(tag, slot, bits, pos=0):
    return [int(tag), slot, pos, 7, -1, 0, 0, bits]


class V:
    """A violation as the monitor makes it (only what episodes read)."""

    def __init__(self, tag, slot, bits, step=1):
        self.tag, self.slot, self.bits = int(tag), slot, bits
        self.report = format_report(row(tag, slot, bits), total=1, ring_capacity=8, step=step)


def test_one_flipped_byte_read_by_many_steps_is_one_episode():
    eps = EpisodeLog(quiet_steps=3)
    lines = eps.add([V(T.TAIL_K_FULL, 5, KV)], step=1)
    assert len(lines) == 1 and lines[0].startswith("kv_canary violation: launch_tag=TAIL_K_FULL ")
    assert "episode 1: launch_tag=TAIL_K_FULL fail_reason=verify_real_kv_hash slots=5 " in lines[0]
    for step in range(2, 15):
        assert eps.add([V(T.TAIL_K_FULL, 5, KV)], step) == []
        assert eps.end_quiet(step) == []
    assert eps.end_quiet(16) == []
    (end,) = eps.end_quiet(17)
    assert end == ("kv_canary episode 1 ended: launch_tag=TAIL_K_FULL "
                   "fail_reason=verify_real_kv_hash slots=5 rows=14 steps=1..14")


def test_adjacent_slots_share_an_episode_other_tags_and_reasons_do_not():
    eps = EpisodeLog()
    lines = eps.add([V(T.HEAD_K_FULL, s, POS) for s in (7, 8, 9, 30)]
                    + [V(T.HEAD_V_FULL, 8, POS), V(T.HEAD_K_FULL, 8, KV)], step=4)
    assert len(lines) == 4                       # 7..9, 30, HEAD_V 8, HEAD_K 8 other reason
    assert eps.add([V(T.HEAD_K_FULL, 10, POS)], step=5) == []      # grows 7..9 to 7..10
    ends = eps.close()
    assert "slots=7..10 rows=4 steps=4..5" in ends[0] and eps.open == {}
    assert len(eps.closed) == 4


def test_new_episode_reports_are_rate_limited_and_the_rest_counted():
    now = [0.0]
    eps = EpisodeLog(max_reports_per_s=2, slot_gap=0, clock=lambda: now[0])
    lines = eps.add([V(T.TAIL_K_FULL, s, KV) for s in range(0, 10, 2)], step=1)
    assert len(lines) == 2 and eps.count == 5 and eps.suppressed == 3
    now[0] = 1.5
    assert len(eps.add([V(T.TAIL_K_FULL, 50, KV)], step=2)) == 1
    ends = eps.close()
    assert len(ends) == 7 and ends[-1].startswith("kv-canary: 3 new episode report(s) held back")


def test_monitor_with_episodes_logs_once_and_keeps_every_row(caplog):
    f, mon = FakeLog(), Monitor("log", episodes=EpisodeLog(quiet_steps=2))
    mon.step(f.log())
    with caplog.at_level(logging.WARNING, logger="jax_kvcanary"):
        for _ in range(4):
            f.add(row(T.TAIL_K_FULL, 9, KV))
            mon.step(f.log())
        for _ in range(4):
            mon.step(f.log())
        mon.flush()
    texts = [r.getMessage() for r in caplog.records]
    assert sum(t.startswith("kv_canary violation: ") for t in texts) == 1
    assert sum(t.startswith("kv_canary episode 1 ended:") and "rows=4" in t for t in texts) == 1
    assert len(mon.violations) == 4


def test_monitor_with_episodes_raises_one_clear_report():
    f, mon = FakeLog(), Monitor("raise", episodes=EpisodeLog())
    mon.step(f.log())
    for s in (3, 4, 5):
        f.add(row(T.HEAD_K_FULL, s, POS))
    mon.step(f.log())
    with pytest.raises(CanaryViolationError) as e:
        mon.step(f.log())
    text = str(e.value)
    assert text.count("kv_canary violation: ") == 1
    assert text.endswith("and 2 more row(s) in this step: HEAD_K_FULL verify_position x2")
    assert len(e.value.violations) == 3
