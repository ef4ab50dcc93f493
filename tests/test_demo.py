"""The demo CLI: a clean default run (under 60 s), every --inject kind detected as specified,
--mode raise exits non-zero, and argument errors."""

import os
import re
import subprocess
import sys
import time

import pytest

from jax_kvcanary import demo

DETECTED = re.compile(r"^  detected           step (\d+) \((\d+) steps? after the fault\): (\S+) (\S+) ",
                      re.M)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, timeout=300):
    """Runs the demo as the README says: ``python -m jax_kvcanary.demo`` from the repository root."""
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "jax_kvcanary.demo", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    return p, time.perf_counter() - t


@pytest.mark.slow
def test_from_the_repository_root_the_demo_runs_the_native_backend():
    """The source tree (src/ layout) cannot shadow the installed package, whose native module the
    demo must use: the header names the backend."""
    p, _ = run_cli("--steps", "4", "--no-overhead")
    assert p.returncode == 0, p.stderr[-3000:]
    header = next(line for line in p.stdout.splitlines() if line.startswith("  canary  "))
    assert header.endswith(" impl=ffi"), header
    assert "NativeBackendWarning" not in p.stderr


def test_default_run_is_clean_and_fast():
    p, wall = run_cli()
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    assert wall < 60, wall
    assert "\n  violations         0\n" in out
    assert "40/40 steps" in p.stderr                          # the progress bar
    assert re.search(r"^  tokens served      \d+ \(prefill \d+, decode \d+\); [1-9]\d* prompt tokens "
                     r"from the prefix cache", out, re.M)
    assert re.search(r"^  canary overhead    \d+\.\d\dx step time", out, re.M)
    for tag in ("HEAD_K_FULL", "TAIL_V_SWA", "SWEEP_K_SWA"):
        assert re.search(rf"^    {tag} +[1-9]\d* +[1-9]\d* +\d+$", out, re.M), tag
    assert "kv_canary violation" not in p.stderr


@pytest.mark.slow
def test_raise_mode_exits_non_zero():
    p, _ = run_cli("--mode", "raise", "--inject", "real_kv_used", "--steps", "24")
    assert p.returncode == 1, (p.stdout[-2000:], p.stderr[-2000:])
    assert "CanaryViolationError at step " in p.stdout
    assert "kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=verify_real_kv_hash " in p.stdout


@pytest.mark.parametrize("kind, group, tag, reason, lag", [
    ("req_to_token_swap", "full", "HEAD_K_FULL", "verify_chain_hash", 1),
    ("real_kv_used", "full", "TAIL_K_FULL", "verify_real_kv_hash", 1),
    ("real_kv_unused_cache", "full", "SWEEP_K_FULL", "verify_real_kv_hash", 1),
    ("real_kv_post_forward", "swa", "TAIL_K_SWA", "verify_real_kv_hash", 2),
    ("next_token_swap", "full", "HEAD_K_FULL", "write_token", 2),
    ("swa_evicted_in_window", "swa", "HEAD_K_SWA", "index_out_of_range", 1),
])
def test_each_inject_kind_is_detected(capsys, kind, group, tag, reason, lag):
    rc = demo.main(["--inject", kind, "--inject-group", group, "--steps", "20",
                    "--inject-step", "10", "--sweep-interval", "4", "--no-overhead"])
    out = capsys.readouterr().out
    assert rc == 0, out
    m = DETECTED.search(out)
    assert m, out
    assert int(m.group(2)) == lag <= 2
    assert m.group(3) == tag and reason in m.group(4).split("+")
    assert f"  fault injected     step {int(m.group(1)) - lag}: {kind} on {group.upper()}" in out


@pytest.mark.parametrize("kind", demo.cli.FAULT_KINDS)
def test_every_inject_kind_with_the_readme_defaults_finds_a_target_and_is_detected(capsys, kind):
    """``python -m jax_kvcanary.demo --inject KIND`` (with ``--offload`` for the offload kinds), as
    the README gives it: a target is found, the fault is detected, and in log mode the progress
    bar's last count is the summary's."""
    from jax_kvcanary.runtime import perturb

    offload = ["--offload"] if kind in perturb.OFFLOAD_KINDS else []
    rc = demo.main([*offload, "--inject", kind, "--no-overhead"])
    cap = capsys.readouterr()
    assert rc == 0, cap.out
    assert DETECTED.search(cap.out), cap.out
    bar = re.findall(r"steps  tokens \d+  violations (\d+)", cap.err)
    summary = re.search(r"^  violations         (\d+)", cap.out, re.M)
    assert bar and summary and bar[-1] == summary.group(1), (bar, summary)


def test_main_raise_returns_one(capsys):
    rc = demo.main(["--mode", "raise", "--inject", "next_token_swap", "--steps", "16",
                    "--inject-step", "8", "--no-overhead", "--no-swa"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "launch_tag=HEAD_K_FULL fail_reason=write_token" in out


@pytest.mark.parametrize("argv, text", [
    (["--inject", "real_kv_used", "--real-kv", "none"], "use --real-kv partial|all"),
    (["--inject", "real_kv_unused_cache", "--sweep-interval", "0"], "use --sweep-interval N > 0"),
    (["--inject-group", "swa", "--no-swa"], "needs the SWA layer"),
    (["--steps", "0"], "must be >= 1"),
    (["--inject", "bogus"], "invalid choice"),
])
def test_argument_errors(capsys, argv, text):
    with pytest.raises(SystemExit) as e:
        demo.parse_args(argv)
    assert e.value.code == 2
    assert text in capsys.readouterr().err


def test_help_states_every_exit_status(capsys):
    from jax_kvcanary.demo.cli import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "Exit status: 0 clean" in out and "1 a ``CanaryViolationError``" in out
    assert "2 an injected fault" in out and "3 a failed health check" in out.replace("\n", " ")
