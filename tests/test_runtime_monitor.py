"""Monitor logic on fabricated logs: one-step lag, each row once, raise mode, overflow,
multi-device labels, health check and stats. No canary op runs here."""

import logging

import numpy as np
import pytest

from jax_kvcanary.consts import LaunchTag as T
from jax_kvcanary.runtime import (CanaryHealthError, CanaryViolationError, HealthCheck, Monitor,
                                  parse_first_line)
from jax_kvcanary.state import ViolationLog

ROW_A = [2, 17, 42, 111, -1, 5, 6, 4]
ROW_B = [0, 3, 1, 7, 9, 5, 1, 8]


class FakeLog:
    """Builds ViolationLog arrays (host numpy) as a device would leave them."""

    def __init__(self, cap=8, num_tags=12, devices=None):
        self.cap, self.devices = cap, devices
        lead = () if devices is None else (devices,)
        self.ring = np.zeros(lead + (cap, 8), np.int64)
        self.wi = np.zeros(lead + (1,), np.int32)
        self.kr = np.zeros(lead + (num_tags,), np.int64)
        self.sr = np.zeros(lead + (num_tags,), np.int64)

    def add(self, row, device=None):
        ring = self.ring if device is None else self.ring[device]
        wi = self.wi if device is None else self.wi[device]
        if wi[0] < self.cap:
            ring[wi[0]] = row
        wi[0] += 1

    def tick(self, tags, n=2, device=None):
        kr = self.kr if device is None else self.kr[device]
        for t in tags:
            kr[int(t)] += n

    def log(self):
        lead = self.ring.shape[:-2]
        flag = np.ones(lead + (1,), np.int32)
        return ViolationLog(self.ring.view(np.uint8).reshape(lead + (self.cap, 64)).copy(),
                            self.wi.copy(), self.kr.view(np.uint8).reshape(lead + (-1, 8)).copy(),
                            self.sr.view(np.uint8).reshape(lead + (-1, 8)).copy(), flag)


def test_one_step_lag_and_each_row_once(caplog):
    f, mon = FakeLog(), Monitor("log")
    with caplog.at_level(logging.WARNING, logger="jax_kvcanary"):
        assert mon.step(f.log()) == []          # step 1: nothing pending yet
        f.add(ROW_A)                            # violation recorded in step 2
        assert mon.step(f.log()) == []          # step 2: decodes step 1's copy (clean)
        vs = mon.step(f.log())                  # step 3: reports step 2's row
        assert [list(v.row) for v in vs] == [ROW_A] and vs[0].step == 3 and vs[0].index == 0
        assert mon.step(f.log()) == []          # not reported twice
        f.add(ROW_B)
        f.add(ROW_A)
        mon.step(f.log())
        vs = mon.step(f.log())
    assert [list(v.row) for v in vs] == [ROW_B, ROW_A]
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 3 and all(parse_first_line(m) for m in msgs)
    assert mon.by_tag_reason[("TAIL_K_FULL", "verify_real_kv_hash")] == 2
    assert mon.total == 3


def test_raise_mode_carries_rows_then_stops():
    f, mon = FakeLog(), Monitor("raise")
    mon.step(f.log())
    f.add(ROW_A)
    f.add(ROW_B)
    mon.step(f.log())
    with pytest.raises(CanaryViolationError) as e:
        mon.step(f.log())
    assert isinstance(e.value, RuntimeError)
    assert e.value.rows.tolist() == [ROW_A, ROW_B]
    assert str(e.value) == "\n".join(v.report for v in e.value.violations)
    assert str(e.value).count("kv_canary violation: ") == 2
    f.add(ROW_A)
    assert mon.step(f.log()) == [] and mon.step(f.log()) == []   # reports nothing more


def test_overflow_and_flush():
    f, mon = FakeLog(cap=2), Monitor("log")
    mon.step(f.log())
    for _ in range(5):
        f.add(ROW_A)
    mon.step(f.log())
    vs = mon.flush()
    assert len(vs) == 2 and all("total_violations=5 ring_overflow=True" in v.report for v in vs)
    assert mon.flush() == []


def test_ring_not_read_when_counter_did_not_move():
    class NoRead:
        """A ring whose bytes must not be pulled (only its shape may be looked at)."""

        def __init__(self, arr):
            self.shape, self.dtype, self.ndim = arr.shape, arr.dtype, arr.ndim

        def __array__(self, *a, **k):
            raise AssertionError("ring read without a counter move")

    f, mon = FakeLog(), Monitor("log")
    base = f.log()
    log = ViolationLog(NoRead(base.ring), base.write_index, base.kernel_run_counters,
                       base.slot_run_counters, base.enable_chain_position_assert)
    for _ in range(3):
        assert mon.step(log) == []


def test_multi_device_labels():
    f, mon = FakeLog(devices=3), Monitor("log")
    mon.step(f.log())
    f.add(ROW_A, device=2)
    f.add(ROW_B, device=0)
    mon.step(f.log())
    vs = mon.step(f.log())
    assert [(v.device, list(v.row)) for v in vs] == [(0, ROW_B), (2, ROW_A)]
    for v in vs:
        lines = v.report.split("\n")
        assert len(lines) == 8 and lines[-1] == f"  device={v.device}"


def test_health_check_fires_when_a_tag_stops():
    tags = (T.HEAD_K_FULL, T.TAIL_K_FULL)
    f, mon = FakeLog(), Monitor("log", health_interval=2, expected_tags=tags)
    for _ in range(4):
        f.tick(tags)
        mon.step(f.log())
    with pytest.raises(CanaryHealthError) as e:   # TAIL skipped from here on
        for k in range(4):                            # interval 2, plus the one-step lag
            f.tick([T.HEAD_K_FULL])
            mon.step(f.log())
    assert k == 3
    assert e.value.missing_tags == (T.TAIL_K_FULL,)
    assert "TAIL_K_FULL did not move in the last 2 steps" in str(e.value)
    assert "dead-code-eliminated" in str(e.value)


def test_health_check_per_device():
    h = HealthCheck(1, [T.HEAD_K_FULL])
    h.observe(1, np.zeros((2, 12), np.int64))
    runs = np.zeros((2, 12), np.int64)
    runs[0, 0] = 2
    with pytest.raises(CanaryHealthError, match="HEAD_K_FULL@device1"):
        h.observe(2, runs)


def test_health_check_per_device_through_the_monitor():
    """The steps between full decodes read each device's write_index only; a health step reads
    the kernel-run counters of every device, and a row arriving on a health step is reported."""
    tags = (T.HEAD_K_FULL,)
    f, mon = FakeLog(devices=2), Monitor("log", health_interval=2, expected_tags=tags)
    for k in range(5):
        f.tick(tags, device=0)
        f.tick(tags, device=1)
        if k == 3:
            f.add(ROW_A, device=1)
        vs = mon.step(f.log())
        assert [list(v.row) for v in vs] == ([ROW_A] if k == 4 else [])
    assert mon.health.checks >= 1
    with pytest.raises(CanaryHealthError, match="HEAD_K_FULL@device1"):
        for _ in range(4):
            f.tick(tags, device=0)
            mon.step(f.log())


def test_refresh_counters_decodes_the_last_readback():
    """Between full decodes only write_index is read; refresh_counters decodes the counters of
    the last readback (once), e.g. for the metrics when the server goes idle."""
    tags = (T.HEAD_K_FULL,)
    f, mon = FakeLog(), Monitor("log")
    for _ in range(4):
        f.tick(tags)
        mon.step(f.log())
    assert int(mon.counters.kernel_runs[0, T.HEAD_K_FULL]) == 2   # the first readback's
    assert mon.refresh_counters() and not mon.refresh_counters()
    assert int(mon.counters.kernel_runs[0, T.HEAD_K_FULL]) == 6   # step 3's (one step behind)


def test_stats_line(caplog):
    tags = (T.HEAD_K_FULL,)
    f, mon = FakeLog(), Monitor("log", stats_interval=2, expected_tags=tags)
    with caplog.at_level(logging.INFO, logger="jax_kvcanary"):
        for _ in range(3):
            f.tick(tags)
            mon.step(f.log())
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert lines == ["kv_canary stats: steps=2 violations=0 HEAD_K_FULL=runs:4,verified:0,written:0"]


def test_bad_mode_and_input():
    with pytest.raises(ValueError, match="Monitor mode"):
        Monitor("warn")
    with pytest.raises(TypeError, match="CanaryState or a ViolationLog"):
        Monitor("log").step(object())
    assert Monitor("none").step(object()) == []


def test_snapshot_made_inside_the_step_reads_the_same():
    """counter_snapshot(state) returned by a jitted step gives the monitor the same counters and
    rows as the snapshot it dispatches itself."""
    import jax

    from jax_kvcanary.runtime import counter_snapshot

    step = jax.jit(lambda log: (log, counter_snapshot(log)))
    f, own, given = FakeLog(), Monitor("log"), Monitor("log")
    for rows in ([], [ROW_A], [], [ROW_B, ROW_A], []):
        for r in rows:
            f.add(r)
        f.tick([T.HEAD_K_FULL, T.TAIL_V_FULL])
        log, snap = step(f.log())
        a, b = own.step(f.log()), given.step(log, snapshot=snap)
        assert [list(v.row) for v in a] == [list(v.row) for v in b]
    assert [list(v.row) for v in own.flush()] == [list(v.row) for v in given.flush()]
    assert np.array_equal(own.counters.kernel_runs, given.counters.kernel_runs)
    assert own.total == given.total == 3


def test_all_processes_decide_on_the_rows_of_every_process():
    """A state spanning several processes: each snapshot row ends with the rows of every
    process's devices (``all_processes``). Rows recorded only elsewhere mark the ring as holding
    rows (so every process resets it at the same gate), and in mode raise stop this process too,
    with a message that says where they are; rows of its own are reported as usual."""
    import jax.numpy as jnp

    from jax_kvcanary.runtime.monitor import counter_snapshot

    def snap(f, everywhere):
        own = counter_snapshot(f.log())
        return jnp.concatenate([own, jnp.asarray(np.array([[everywhere]], "<i4").view(np.uint8)
                                                 .reshape(1, 4).repeat(own.shape[0], 0))], axis=-1)

    f = FakeLog(devices=2)
    mon = Monitor("log", all_processes=True)
    for everywhere in (0, 0, 3, 3):                 # 3 rows on another process's devices
        assert mon.step(f.log(), snapshot=snap(f, everywhere)) == []
    assert mon.everywhere == 3 and mon.ring_has_rows and mon.violations == []
    f.add(ROW_A, device=1)                          # and one of this process's own
    mon.step(f.log(), snapshot=snap(f, 4))
    assert [v.device for v in mon.flush()] == [1]

    f, mon = FakeLog(devices=2), Monitor("raise", all_processes=True)
    mon.step(f.log(), snapshot=snap(f, 0))
    with pytest.raises(CanaryViolationError, match="recorded on another process's devices"):
        mon.step(f.log(), snapshot=snap(f, 2))
        mon.step(f.log(), snapshot=snap(f, 2))
    assert mon.stopped
