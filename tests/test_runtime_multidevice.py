"""Multi-device with the runtime alone: under jax.shard_map each of 4 (virtual CPU) devices runs the
HEAD/TAIL endpoints on its own KV shard, canary buffers and ring; a KV byte flipped on one device is
reported for that device only, with its device= line, and the counters of every device move.

Runs in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=4 (the flag must be set
before JAX starts its CPU backend). The demo's engine in the same mode: tests/test_demo_multidevice.py."""

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(r"""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    import jax_kvcanary as kvc
    from jax_kvcanary.consts import LaunchTag as T
    from jax_kvcanary.runtime import CanaryBatch, CanaryConfig, CanaryEndpoints, Monitor
    from jax_kvcanary.runtime.multidevice import (AXIS, device_mesh, global_view, local_view, replicate,
                                                  shard_leading, stack_for_devices)

    D, S = 4, 32
    mesh = device_mesh(D)
    ep = CanaryEndpoints(CanaryConfig(real_kv_hash_mode="ALL"), num_slots=S, write_req_capacity=2,
                         verify_capacity=16)
    i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))
    r2t = np.zeros((2, 16), np.int32)
    r2t[1, :8] = np.arange(8) + 3                 # request 1's slots: 3, 4, ..., 10

    def batch(t):                                 # step t writes position t of request 1
        return CanaryBatch(i32([1]), i32([t]), i32([1]), i32(r2t), i32([100 + t]), i32([t]), i32([3 + t]))

    def body(state, kv, b):
        state, kv = local_view(state), local_view(kv)
        src = {"FULL": {h: kvc.RealKvSource(kv, 1, 64, 64) for h in ("K", "V")}}
        state, ctx = ep.head(state, b)
        return global_view(ep.tail(state, ctx, src))

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), P(AXIS), P()), out_specs=P(AXIS)),
                   donate_argnums=0)
    state = stack_for_devices(ep.init_state(), mesh)
    kv_host = np.arange(D * S * 16, dtype=np.float32).reshape(D, S, 16)   # each device's own KV shard
    kv = shard_leading(jnp.asarray(kv_host), mesh)
    mon = Monitor("log")
    out = {"ring_shards": sorted((s.device.id, list(s.data.shape)) for s in state.log.ring.addressable_shards)}
    for t in range(4):
        state = step(state, kv, replicate(batch(t), mesh))
        mon.step(state)
    out["clean"] = len(mon.violations)
    kv_host[2, 4, 0] += 1.0                       # device 2: the KV of slot 4 (position 1) changes
    kv = shard_leading(jnp.asarray(kv_host), mesh)
    for t in range(4, 6):
        state = step(state, kv, replicate(batch(t), mesh))
        mon.step(state)
    found = mon.flush()
    out["found"] = sorted({(v.device, v.tag_name, v.slot, v.reasons) for v in found})
    out["last_line"] = found[0].report.split("\n")[-1] if found else None
    out["runs"] = mon.counters.kernel_runs[:, T.TAIL_K_FULL].tolist()
    print("RESULT", json.dumps(out))
""")


def test_each_device_owns_its_state_and_rows_are_labelled():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert out["ring_shards"] == [[d, [1, 1024, 64]] for d in range(4)]
    assert out["clean"] == 0
    # TAIL verify of the prefix at steps 4 and 5 sees slot 4's changed bytes, on device 2 only
    assert out["found"] == [[2, "TAIL_K_FULL", 4, ["verify_real_kv_hash"]],
                            [2, "TAIL_V_FULL", 4, ["verify_real_kv_hash"]]]
    assert out["last_line"] == "  device=2"
    assert out["runs"] == [12, 12, 12, 12]   # 6 steps x (verify + write) on every device
