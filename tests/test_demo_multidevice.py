"""Multi-device: under jax.shard_map each of 4 (virtual CPU) devices owns its KV shard, canary
buffers and ring; the monitor gathers rows from all devices and labels them with the device.

Runs in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=4 (the flag must be set
before JAX starts its CPU backend), from a directory outside the source tree so that it imports the
installed package (with its native module), as a user's process would."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(r"""
    import json, re
    import jax, numpy as np
    from jax_kvcanary.consts import LaunchTag as T
    from jax_kvcanary.runtime import CanaryConfig
    from jax_kvcanary.demo import EngineConfig, ToyEngine

    assert len(jax.devices()) == 4, jax.devices()
    ccfg = CanaryConfig(groups=("FULL", "SWA"), swa_window_size=16, sweep_interval=4,
                        write_input_assert=True)
    eng = ToyEngine(EngineConfig(devices=4), ccfg)
    eng.warmup()
    out = {}
    ring = eng.cstate.log.ring
    out["ring_shape"] = list(ring.shape)
    out["ring_shards"] = sorted((s.device.id, list(s.data.shape)) for s in ring.addressable_shards)
    canary = eng.cstate.canaries["TAIL_K_FULL"]
    out["canary_devices"] = sorted(s.device.id for s in canary.addressable_shards)
    kv0 = eng.kv["k"][0]
    out["kv_shard_shape"] = list(kv0.addressable_shards[0].data.shape)

    db = eng._device_batch(eng.warmup_batch())
    hlo = eng.step_on.lower(eng.rep, eng.sh, eng.kv, eng.cstate, db).compile().as_text()
    out["targets"] = sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)))

    clean = []
    for _ in range(7):
        clean += eng.iterate()
    out["clean"] = len(clean)
    eng.arm("real_kv_used", 8, group="FULL", device=2)
    first = []
    for _ in range(4):
        first += eng.iterate()
    out["fault1"] = [eng.fault[0], eng.fault[1].slot]
    out["first"] = sorted({(v.step, v.device, v.tag_name, v.slot, v.reasons[0]) for v in first})
    out["first_last_line"] = first[0].report.split("\n")[-1] if first else None
    out["first_lines"] = len(first[0].report.split("\n")) if first else 0
    eng.arm("next_token_swap", 12)
    second = []
    for _ in range(4):
        second += eng.iterate()
    second += eng.monitor.flush()
    out["fault2"] = eng.fault[0]
    out["second"] = sorted({(v.step, v.device, v.reasons) for v in second
                            if v.reasons == ("write_token",)})
    runs = eng.monitor.counters.kernel_runs
    out["runs_equal"] = bool((runs == runs[0]).all())
    out["runs_head"] = int(runs[0, T.HEAD_K_FULL])
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.slow
def test_four_devices_own_state_and_labels(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                       timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    r = json.loads(line[len("RESULT "):])
    assert r["ring_shape"] == [4, 1024, 64]
    assert r["ring_shards"] == [[d, [1, 1024, 64]] for d in range(4)]   # one ring per device
    assert r["canary_devices"] == [0, 1, 2, 3]
    assert r["kv_shard_shape"][-2] == 1                                 # 4 heads / 4 devices
    assert all(t.startswith("kvcanary_") for t in r["targets"]) and r["targets"]
    assert r["clean"] == 0
    fstep, slot = r["fault1"]
    # only device 2's KV was corrupted: only device 2 reports (labelled), from the next step on
    rows = [tuple(x) for x in r["first"]]
    assert {d for _, d, _, _, _ in rows} == {2}
    assert {(sl, why) for _, _, _, sl, why in rows} == {(slot, "verify_real_kv_hash")}
    assert min(s for s, *_ in rows) == fstep + 1
    assert (fstep + 1, 2, "TAIL_K_FULL", slot, "verify_real_kv_hash") in rows
    assert r["first_last_line"] == "  device=2" and r["first_lines"] == 8
    # a next-token swap is seen by every device
    assert {d for s, d, _ in r["second"]} == {0, 1, 2, 3}
    assert {s for s, d, _ in r["second"]} == {r["fault2"] + 2}
    assert r["runs_equal"] and r["runs_head"] > 0
