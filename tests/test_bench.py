"""Smoke tests of the benchmark harness (bench/): timing logic on a fake clock, the native baselines'
equivalence with the ops, the scenario matrix, the acceptance logic, and a whole tiny run writing
JSON + Markdown + PNG + README snippet (~25 s, marked ``slow``); no timing assertion."""

import json
import os
import shutil
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)  # after the installed package: `bench` lives only in the tree

from bench import harness  # noqa: E402


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_measure_interleaves_and_ratios_are_per_round(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(harness.time, "perf_counter", clock)
    calls = []

    def work(name, cost):
        def fn():
            calls.append(name)
            clock.t += cost
            return None
        return fn

    cs = [harness.Contender("a", work("a", 2e-3)), harness.Contender("b", work("b", 1e-3), kind="baseline"),
          harness.Contender("c", work("c", 4e-3), max_reps=1)]
    res = harness.measure(cs, rounds=5, target_s=0.01, warmup=2)
    assert res["a"].reps == 5 and res["b"].reps == 10 and res["c"].reps == 1
    assert res["a"].median == pytest.approx(2e-3) and res["b"].median == pytest.approx(1e-3)
    assert len(res["a"].times) == 5
    # a has half b's throughput; c a quarter
    assert harness.ratio(res, "a", "b") == pytest.approx(0.5)
    assert harness.ratio(res, "c", "b") == pytest.approx(0.25)
    assert harness.ratio(res, "a", "missing") is None
    # rotation: each round starts with a different contender
    timed = calls[3 * 3:]  # after warm-up (2) + calibration (1) per contender
    starts, i = [], 0
    for r in range(5):
        starts.append(timed[i])
        i += sum({"a": 5, "b": 10, "c": 1}.values())
    assert starts == ["a", "b", "c", "a", "b"]


def test_fit_line():
    slope, icpt = harness.fit_line([1, 2, 4, 8], [3.0 + 2 * x for x in (1, 2, 4, 8)])
    assert slope == pytest.approx(2.0) and icpt == pytest.approx(3.0)


def test_matrix_modes():
    from bench import modes
    full = [n for n, _ in modes.matrix("full")]
    assert sum(n.startswith("decode ") for n in full) == 16
    assert sum(n.startswith("prefill ") for n in full) == 3
    assert any("swa w=128" in n for n in full)
    for mode in ("partial", "all"):
        for k in (1, 4):
            assert f"realkv {mode} x{k} decode bs=32 prefix=1024" in full
    assert "realkv none decode bs=32 prefix=1024" in full
    quick = [n for n, _ in modes.matrix("quick")]
    medium = [n for n, kw in modes.matrix("medium")]
    assert set(quick) <= set(medium) <= set(full)
    assert all(kw["bs"] * max(kw["prefix"], 1) <= 1 << 20 for _, kw in modes.matrix("medium"))


def test_acceptance_logic():
    from bench import report

    def rec(op, n, ratios):
        return {"op": op, "entries": n, "scenario": {"name": "x"}, "ratios": {"ffi": ratios}, "contenders": {}}
    out = {"meta": {"mode": "medium"},
           "sweep": [rec("verify", 4096, {"vs_gather": 0.1, "vs_c_read": 0.1}),
                     rec("verify", 65536, {"vs_gather": 1.5, "vs_c_read": 0.4}),
                     rec("write", 65536, {"vs_c_write_chain": 0.8})],
           "matrix": [rec("verify", 1 << 20, {"vs_c_read": 1.2}), rec("verify", 1 << 19, {"vs_c_read": 0.2}),
                      rec("write", 1 << 20, {"vs_c_write_chain": 0.1})]}
    acc = report.acceptance(out, "cpu")
    got = {c["what"]: c["ok"] for c in acc["checks"]}
    assert got == {"verify n=65536: ffi / jitted gather >= 1": True,
                   "verify n=65536: ffi / native C read loop >= 0.5": False,
                   "write n=65536: ffi / native C chain loop >= 0.5": True,
                   "verify n=1048576 (x): ffi / native C read loop >= 1.0": True}
    assert acc["all_ok"] is False


def test_acceptance_of_the_serving_path_targets():
    from bench import report
    step = dict(bs=8, prefix=512, violations_recorded=0)
    out = {"meta": {"mode": "medium"},
           "targets": [{"target": "write_chain", "tokens": 1 << 20, "ffi_over_c": 0.79, "violations_recorded": 0},
                       {"target": "write_decode", "requests": 256, "ffi_over_c": 0.85, "violations_recorded": 0},
                       {"target": "verify_scaling", "entries": 1 << 20, "cpu_count": 2, "speedup": 1.75,
                        "violations_recorded": 0},
                       {"target": "verify_scaling", "entries": 99, "cpu_count": 1, "speedup": 1.0,
                        "violations_recorded": 3}],
           "step": [dict(step, model={"layers": 4, "d_model": 256}, on_over_off=1.20),
                    dict(step, model={"layers": 8, "d_model": 1024}, on_over_off=1.04),
                    dict(step, model={"layers": 8, "d_model": 2048}, on_over_off=1.06)]}
    got = {c["what"]: c["ok"] for c in report.acceptance(out, "cpu")["checks"]}
    assert got == {
        "write 1 x 1048576 tokens: ffi / native C chain loop >= 0.8": False,
        "write 256 decode requests (cost inside jit): ffi / native C chain loop >= 0.9": False,
        "verify 1048576 entries: thread pool / one thread >= 1.7": True,        # 1 core: no scaling check
        "clean path in verify_scaling": False,
        "serving step 8x1024 bs=8 prefix=512: canary on / off <= 1.05": True,   # the toy size is not judged
        "serving step 8x2048 bs=8 prefix=512: canary on / off <= 1.05": False,
        "clean path: no violation row recorded while timing": True}


def _native_or_skip():
    from bench import native
    nat, why = native.load()
    if nat is None:
        pytest.skip(why)
    return nat


def test_native_baselines_do_the_same_work():
    """The C verify loop finds the populated canary clean, and the C chain loop stores exactly the
    records the op stores."""
    import jax.numpy as jnp

    from bench import opbench, scenarios

    nat = _native_or_skip()
    sc = scenarios.build("t", 4, 40, 1)
    vp = sc.verify_plan
    assert nat.verify_mismatches(sc.canary, vp.slot_indices, vp.expected_positions, vp.prev_slot_indices,
                                 sc.verify_entries) == 0
    sc = scenarios.build("t", 3, 20, 17)
    env = opbench.Env("cpu", ["ffi"], nat, ref_cap=0, xla_cap=0, notes=[])
    cs = {c.name: c for c in opbench.write_contenders(sc, env)}
    before = np.array(cs["c_write_chain"].fn.buffer).copy()
    cs["c_write_chain"].fn()
    after_c = np.array(jnp.array(cs["c_write_chain"].fn.buffer))
    assert not np.array_equal(before, after_c)
    assert np.array_equal(after_c, np.array(cs["c_write_chain"].fn.expected))


@pytest.mark.slow
def test_smoke_run_writes_every_output(tmp_path):
    import bench

    out = bench.run(["--smoke", "--no-xla", "--out", str(tmp_path), "--tag", "smoke"])
    stem = f"cpu-{out['meta']['date']}-smoke"
    files = sorted(os.listdir(tmp_path))
    assert f"{stem}.json" in files and f"{stem}.md" in files and "README_snippet.md" in files
    if shutil.which("cc") or shutil.which("gcc"):
        assert "native_baselines" in out["meta"]
    try:
        import matplotlib  # noqa: F401
        assert os.path.getsize(tmp_path / f"{stem}.png") > 1000
    except ImportError:
        pass
    data = json.loads((tmp_path / f"{stem}.json").read_text())
    for key in ("meta", "sweep", "matrix", "dispatch", "step", "offload", "acceptance", "copy_bandwidth"):
        assert key in data
    assert {r["mode"] for r in data["offload"]} == {"ALL", "PARTIAL"}
    assert all(r["check_over_memcpy"] > 0 and r["bytes_per_s"]["host_check"] > 0 for r in data["offload"])
    assert {r["op"] for r in data["sweep"]} == {"verify", "write", "plan"}
    for r in data["sweep"] + data["matrix"]:
        assert r["contenders"]["ffi"]["entries_per_s"] > 0
        assert r["ratios"]["ffi"][f"vs_{r['baseline']}"] > 0
        assert all(v == 0 for v in r.get("violations_recorded", {}).values())
        assert r.get("c_write_chain_records_match_ffi", True)
    assert all(s["violations_recorded"] == 0 for s in data["step"])
    assert data["step"][0]["on_over_off"] > 0
    # the steps ran in a child process of their own (bench/step_process.py), which set its allocator
    assert data["meta"]["step_host_allocator"]
    assert set(data["dispatch"]["ops"]) >= {"verify[ffi]", "write[ffi]", "plan[ffi]", "xla_op"}
    md = (tmp_path / f"{stem}.md").read_text()
    assert "Serving steps timed in a process of their own" in md
    assert "## Per-op throughput" in md and "## Scenario matrix" in md and "on/off" in md
    assert "## Host check of an offloaded copy vs memcpy" in md
    assert "python -m bench --smoke" in (tmp_path / "README_snippet.md").read_text()


def test_step_profile_charges_each_sample_to_the_innermost_canary_or_engine_frame():
    from bench.canary_step_profile import aggregate

    sched = 'process 1:"launcher";process 2:"sglang::scheduler";thread (2): MainThread'
    engine_call = (f"{sched};run (sgl_jax/srt/managers/scheduler.py:10);"
                   "SglangJaxCanary._run_model (jax_kvcanary/integrations/sglang_jax/canary.py:530);"
                   "ModelRunner.initialize_jit.<locals>.run_model_wrapper (model_runner.py:361);"
                   "cache_miss (jax/_src/pjit.py:300) 7")
    canary_dispatch = (f"{sched};run (sgl_jax/srt/managers/scheduler.py:10);"
                       "SglangJaxCanary._run_model (jax_kvcanary/integrations/sglang_jax/canary.py:544);"
                       "cache_miss (jax/_src/pjit.py:300) 3")
    fused_step = (f"{sched};run (sgl_jax/srt/managers/scheduler.py:10);"
                  "SglangJaxCanary._run_model (jax_kvcanary/integrations/sglang_jax/canary.py:530);"
                  "SglangJaxCanary._engine_call (jax_kvcanary/integrations/sglang_jax/canary.py:700);"
                  "cache_miss (jax/_src/pjit.py:300) 5")
    other = 'process 3:"detokenizer";thread (3): MainThread;loop (sgl_jax/x.py:1) 50'
    cut_short = f"{sched};run (sgl_jax/srt/managers/scheduler.py:10);(logging/__init__.py:16);"
    threads, canary = aggregate("\n".join([engine_call, canary_dispatch, fused_step, other,
                                           cut_short]))
    assert dict(threads) == {"thread (2): MainThread": {"engine": 12, "canary": 3}}
    assert dict(canary) == {
        "jax_kvcanary/integrations/sglang_jax/canary.py:SglangJaxCanary._run_model": 3}


def test_server_bench_summary_ratios_spread_and_targets(tmp_path):
    """The server bench's per-point summary: per-round on/off ratios (median and spread), host
    work medians over the rounds, each target judged at each point; the report names them."""
    from bench import sglang_jax_server as S

    def run(mode, rnd, toks, step, med=None, p90=None, clients=8):
        r = {"mode": mode, "context": 256, "clients": clients, "requests_per_client": 3,
             "round": rnd, "tokens_per_s": toks, "decode_step_ms": step, "first_request_s": 0.2,
             "violations": 0}
        if med is not None:
            r.update(host_median_us=med, host_p90_us=p90)
        return r

    runs = [run("none", 0, 100.0, 10.0), run("log", 0, 98.0, 10.1, 90.0, 140.0),
            run("none", 1, 100.0, 10.0), run("log", 1, 99.0, 10.1, 80.0, 120.0),
            run("none", 2, 100.0, 10.0), run("log", 2, 90.0, 10.5, 95.0, 200.0),
            run("none", 0, 50.0, 20.0, clients=32), run("log", 0, 40.0, 25.0, 300.0, 900.0,
                                                        clients=32)]
    rows = S.summarize(runs)
    by = {r["clients"]: r for r in rows}
    r8 = by[8]
    assert r8["rounds"] == 3 and r8["toks_ratio"] == {"median": 0.98, "min": 0.9, "max": 0.99}
    assert abs(r8["step_ratio"]["median"] - 1.01) < 1e-12 and r8["step_ratio"]["max"] == 1.05
    assert r8["host_median_us"]["median"] == 90.0 and r8["host_p90_us"]["median"] == 140.0
    assert all(r8["ok"].values())
    assert not any(by[32]["ok"].values())
    meta = {"date": "d", "argv": [], "sglang_jax": "x", "jax": "y", "cpu": "c", "cores": 2,
            "max_new_tokens": 64}
    text = S.markdown(rows, meta)
    assert "| 256 | 8 | 24 | 3 | 100.0 | 98.0 | 0.980 (0.900-0.990) |" in text
    assert "- host work p90 <= 150 us: 256x8 PASS, 256x32 FAIL" in text
    pytest.importorskip("matplotlib")
    assert S.plot(rows, str(tmp_path / "p.png")) and (tmp_path / "p.png").stat().st_size > 0


def test_server_bench_merge_keeps_each_files_rounds(tmp_path):
    """``--merge`` reports the runs of several outputs together: a point measured by two
    invocations (rounds 0.. in each) counts every round."""
    from bench import sglang_jax_server as S

    meta = {"date": "d", "argv": [], "sglang_jax": "x", "jax": "y", "cpu": "c", "cores": 2,
            "max_new_tokens": 64}
    paths = []
    for i in range(2):
        runs = [{"mode": m, "context": 256, "clients": 8, "requests_per_client": 3, "round": 0,
                 "tokens_per_s": 100.0 - i * (m == "log"), "decode_step_ms": 10.0,
                 "first_request_s": 0.2, "violations": 0, "host_median_us": 90.0,
                 "host_p90_us": 120.0} for m in ("none", "log")]
        paths.append(str(tmp_path / f"{i}.json"))
        with open(paths[-1], "w") as f:
            json.dump({"meta": meta, "runs": runs}, f)
    assert S.main(["--merge", *paths, "--out", str(tmp_path)]) == 0
    out = json.load(open(next(tmp_path.glob("sglang-jax-server-*-merged.json"))))
    assert [r["rounds"] for r in out["summary"]] == [2]
    assert out["summary"][0]["toks_ratio"] == {"median": 0.995, "min": 0.99, "max": 1.0}
