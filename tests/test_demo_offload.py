"""The demo's offload tier (--offload): a clean run offloads and reloads and records no violation,
each offload inject kind is detected in raise mode with the expected tag, reason, slot and position
within two steps, the default engine has no tier, and the argument errors."""

import re

import pytest

from jax_kvcanary import demo
from jax_kvcanary.consts import HostCheckTag
from jax_kvcanary.demo import EngineConfig, ToyEngine
from jax_kvcanary.runtime import CanaryConfig, CanaryViolationError

DETECTED = re.compile(r"^  detected           step (\d+) \((\d+) steps? after the fault\): (\S+) (\S+) "
                      r"slot_idx=(-?\d+) position=(-?\d+)", re.M)


def make(mode="log"):
    ccfg = CanaryConfig(mode=mode, groups=("FULL", "SWA"), swa_window_size=16, sweep_interval=4,
                        write_input_assert=True)
    eng = ToyEngine(EngineConfig(swa=True, offload=True), ccfg)
    eng.warmup()
    return eng


def test_clean_run_with_offload_is_silent():
    eng = make()
    vs = []
    for _ in range(40):
        vs += eng.iterate()
    vs += eng.monitor.flush()
    assert vs == [] and eng.monitor.total == 0 and eng.done
    t = eng.tier
    assert t.offloaded > 0 and t.reloaded > 0 and t.checked > 0    # both ways, every group and half checked
    assert eng.sweeps == 10 and eng.remaps > 0 and eng.tokens_cached > 0
    assert ToyEngine(EngineConfig(), eng.canary).tier is None      # the default engine has no tier


@pytest.mark.parametrize("kind, tag, reason, lag", [
    ("offload_byte_flip", "HOST_BACKUP_K_FULL", "verify_real_kv_hash", 0),
    ("reload_wrong_slot", "HEAD_K_FULL", "verify_position", 1),
    ("transfer_byte_flip", "HOST_TRANSFER_K_FULL", "verify_real_kv_hash", 0),
])
def test_each_offload_kind_is_detected_in_raise_mode(capsys, kind, tag, reason, lag):
    rc = demo.main(["--offload", "--inject", kind, "--inject-step", "4", "--steps", "20", "--mode", "raise",
                    "--no-overhead"])
    out = capsys.readouterr().out
    assert rc == 1, out
    m = DETECTED.search(out)
    assert m, out
    fstep, got_lag = int(m.group(1)) - int(m.group(2)), int(m.group(2))
    assert got_lag == lag <= 2 and m.group(3) == tag and reason in m.group(4).split("+")
    fault = re.search(rf"^  fault injected     step {fstep}: {kind} on FULL: (.*)$", out, re.M)
    assert fault, out
    if kind != "reload_wrong_slot":   # the report names the slot and position the fault changed
        slot = re.search(r"\((?:device|sender) slot (\d+), position (\d+)", fault.group(1))
        assert (m.group(5), m.group(6)) == slot.groups(), (fault.group(1), m.group(0))
    assert f"kv_canary violation: launch_tag={tag} " in out and "CanaryViolationError at step" in out


def test_engine_raise_carries_the_host_rows():
    eng = make(mode="raise")
    eng.arm("transfer_byte_flip", 4)
    with pytest.raises(CanaryViolationError) as e:
        for _ in range(20):
            eng.iterate()
    fstep, fault = eng.fault
    assert eng.step_no == fstep
    (v,) = e.value.violations
    assert (v.tag, v.slot, v.position, v.reasons) == (int(HostCheckTag.HOST_TRANSFER_K_FULL), fault.slot,
                                                      fault.position, ("verify_real_kv_hash",))


@pytest.mark.parametrize("argv, text", [
    (["--inject", "reload_wrong_slot"], "needs the offload tier (--offload)"),
    (["--offload", "--inject", "offload_byte_flip", "--inject-group", "swa"], "targets the full group"),
    (["--offload", "--inject", "transfer_byte_flip", "--real-kv", "none"], "use --real-kv partial|all"),
    (["--offload", "--devices", "2"], "--offload runs on one device"),
])
def test_argument_errors(capsys, argv, text):
    with pytest.raises(SystemExit) as e:
        demo.parse_args(argv)
    assert e.value.code == 2
    assert text in capsys.readouterr().err
