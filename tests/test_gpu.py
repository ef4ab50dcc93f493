"""CUDA handlers vs the CPU handlers vs the numpy reference, byte for byte (needs a CUDA GPU).

Every test here carries the ``gpu`` marker (tests/conftest.py skips them without a GPU). The same
case runs on ``jax.devices('gpu')[0]`` and ``jax.devices('cpu')[0]`` (inputs committed there with
``jax.device_put``), with ``impl='ffi'``:

* tests/support/cases.py's configs (every sentinel, OOB rows, malformed plans, int32 / int64 / mixed index
  arrays, 0..4 real-KV sources of several dtypes): GPU == reference and GPU == CPU;
* tests/support/gpu_cases.py's stress cases at GPU scale (multi-block verify with rows in every block,
  ring overflow, long and many requests, duplicate slots and seeds written in the same launch,
  big plans and scatters): GPU == CPU; at the emulation scale also GPU == reference;
* the ops chained inside one jitted, donated step; and the same under XLA command buffers
  (CUDA graphs), in a subprocess so that its XLA_FLAGS apply.

``KVC_GPU_SEEDS`` (default 6) sets the seeds per cases.py config.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_kvcanary as kvc
from jax_kvcanary import _ffi

from tests.support import gpu_cases
from tests.support.cases import CONFIGS, OPS, STATIC_KWARGS, compare, describe_case, make_case, run_reference, x64_scope

pytestmark = pytest.mark.gpu

SEEDS = int(os.environ.get("KVC_GPU_SEEDS", "6"))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dev(platform):
    return jax.devices(platform)[0]


def _put(tree, dev):
    return jax.tree_util.tree_map(lambda x: jax.device_put(x, dev) if isinstance(x, np.ndarray) else x, tree,
                                  is_leaf=lambda x: x is None)


def _to_numpy(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


_JIT = {}


def run_on(case, platform, *, jit=True):
    """Run the case's op with impl='ffi' on the first device of `platform`; numpy outputs."""
    dev = _dev(platform)
    args, kwargs = _put(case["args"], dev), _put(case["kwargs"], dev)
    fn = getattr(kvc, case["op"])
    if not jit:
        out = fn(*args, impl="ffi", **kwargs)
    else:
        static = tuple(sorted((k, v if isinstance(v, bool) else int(v))
                              for k, v in kwargs.items() if k in STATIC_KWARGS))
        dyn = {k: v for k, v in kwargs.items() if k not in STATIC_KWARGS}
        key = (case["op"], static)
        if key not in _JIT:
            st = dict(static)
            _JIT[key] = jax.jit(lambda a, d, _fn=fn, _st=st: _fn(*a, impl="ffi", **_st, **d))
        out = _JIT[key](args, dyn)
    out = jax.block_until_ready(out)
    leaves = jax.tree_util.tree_leaves(out)
    assert all(next(iter(x.devices())).platform == platform for x in leaves), "ran on the wrong device"
    return _to_numpy(out)


def _fail(case, what, diffs):
    return f"{what}: " + describe_case(case) + "\n  " + "\n  ".join(diffs)


def test_cuda_module_is_registered():
    assert _ffi._kvcanary_cuda is not None, "jax_kvcanary._kvcanary_cuda was not built/installed"
    assert "gpu" in _ffi.NATIVE_PLATFORMS
    assert set(_ffi._kvcanary_cuda.registrations()) == {
        "kvcanary_verify", "kvcanary_write", "kvcanary_plan", "kvcanary_scatter"}


OP_CONFIGS = [(op, cfg) for op in OPS for cfg in CONFIGS[op]]


@pytest.mark.parametrize("op,config", OP_CONFIGS, ids=[f"{o}-{c}" for o, c in OP_CONFIGS])
def test_gpu_matches_cpu_and_reference(op, config):
    failures = []
    for seed in range(SEEDS):
        case = make_case(op, config, seed)
        ref = run_reference(case)
        with x64_scope(case):
            got = run_on(case, "gpu", jit=seed % 2 == 0)
            cpu = run_on(case, "cpu")
        d = compare(op, ref, got)
        if d:
            failures.append(_fail(case, "gpu vs reference", d))
        d = compare(op, cpu, got)
        if d:
            failures.append(_fail(case, "gpu vs cpu", d))
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures[:4])


STRESS = gpu_cases.stress_names()


@pytest.mark.parametrize("name", STRESS)
def test_gpu_stress_matches_cpu(name):
    """GPU scale: many blocks, rows in every block, overflow, conflicts (the in-order write path)."""
    for seed in range(3):
        case = gpu_cases.stress_case(name, seed, scale="gpu")
        with x64_scope(case):
            got = run_on(case, "gpu")
            cpu = run_on(case, "cpu")
        d = compare(case["op"], cpu, got)
        assert not d, _fail(case, "gpu vs cpu", d)
        if name.startswith("write_conflict"):
            assert gpu_cases.has_write_conflict(case)


@pytest.mark.parametrize("name", STRESS)
def test_gpu_stress_small_matches_reference(name):
    for seed in range(2):
        case = gpu_cases.stress_case(name, seed, scale="emu")
        ref = run_reference(case)
        with x64_scope(case):
            got = run_on(case, "gpu")
        d = compare(case["op"], ref, got)
        assert not d, _fail(case, "gpu vs reference", d)


def test_ring_order_many_violations_across_blocks():
    """Every entry of a 300k-entry verify violates: rows must be in entry order, none lost."""
    case = gpu_cases.stress_case("verify_heavy", 0, scale="gpu")
    with x64_scope(case):
        got = run_on(case, "gpu")
        cpu = run_on(case, "cpu")
    assert not compare("verify", cpu, got)
    rows = got.ring.view("<i8")[: int(got.write_index[0])]
    assert rows.shape[0] > 100_000
    slots = np.asarray(case["args"][2].slot_indices).astype(np.int64)
    # rows follow the plan's entry order: their slot column is a subsequence (with repeats: an entry
    # owns up to 3 consecutive rows) of the plan's slots
    pos = 0
    for s in rows[:, 1]:
        while pos < slots.shape[0] and slots[pos] != s:
            pos += 1
        assert pos < slots.shape[0], "ring rows are not in entry order"


def _serving_inputs(bs=64, prefix=96, extend=4, S=1 << 15, seed=0):
    rng = np.random.default_rng(seed)
    L = prefix + 8 * extend + 8
    req_to_token = rng.permutation(np.arange(1, S))[: bs * L].reshape(bs, L).astype(np.int32)
    req_to_token = np.concatenate([np.zeros((1, L), np.int32), req_to_token])
    rpi = np.arange(1, bs + 1, dtype=np.int32)
    P = np.full(bs, prefix, np.int32)
    E = np.full(bs, extend, np.int32)
    pos = (P[:, None] + np.arange(extend)[None, :]).reshape(-1).astype(np.int32)
    loc = req_to_token[rpi[:, None], pos.reshape(bs, extend)].reshape(-1).astype(np.int32)
    ids = rng.integers(0, 32000, bs * extend).astype(np.int32)
    kv = rng.integers(0, 256, (S, 128), dtype=np.uint8)
    return dict(S=S, req_to_token=req_to_token, rpi=rpi, P=P, E=E, pos=pos, loc=loc, ids=ids, kv=kv)


def _step(canary, log, kv, rpi, P, E, r2t, ids, pos, loc, *, vcap, wcap):
    """plan -> HEAD verify + write -> TAIL verify (with real-KV) -> TAIL write: one serving step."""
    src = (kvc.RealKvSource(kv, 1, 128, 64),)
    vp, wp = kvc.plan(rpi, P, E, r2t, verify_capacity=vcap, write_req_capacity=wcap, impl="ffi")
    log = kvc.verify(canary, log, vp, tag=kvc.LaunchTag.HEAD_K_FULL, impl="ffi")
    canary, log = kvc.write(canary, log, wp, ids, pos, loc, tag=kvc.LaunchTag.HEAD_K_FULL, impl="ffi")
    log = kvc.verify(canary, log, vp, tag=kvc.LaunchTag.TAIL_K_FULL, real_kv_sources=src,
                     real_kv_hash_mode=kvc.RealKvHashMode.ALL, impl="ffi")
    canary, log = kvc.write(canary, log, wp, ids, pos, loc, tag=kvc.LaunchTag.TAIL_K_FULL, real_kv_sources=src,
                            real_kv_hash_mode=kvc.RealKvHashMode.ALL, impl="ffi")
    return canary, log


def _run_steps(platform, steps=3):
    d = _serving_inputs()
    dev = _dev(platform)
    put = lambda x: jax.device_put(x, dev)  # noqa: E731
    canary = put(np.zeros((d["S"], 32), np.uint8))
    log = jax.device_put(kvc.ViolationLog.create(256), dev)
    step = jax.jit(lambda c, lg, *a: _step(c, lg, *a, vcap=64 * 128, wcap=64), donate_argnums=(0, 1))
    P, pos, loc = d["P"], d["pos"], d["loc"]
    for k in range(steps):
        canary, log = step(canary, log, put(d["kv"]), put(d["rpi"]), put(P), put(d["E"]),
                           put(d["req_to_token"]), put(d["ids"]), put(pos), put(loc))
        P = P + d["E"]
        pos = pos + 4
        loc = d["req_to_token"][d["rpi"][:, None], pos.reshape(-1, 4)].reshape(-1).astype(np.int32)
    return _to_numpy((canary, log))


def test_jitted_donated_step_matches_cpu():
    got = _run_steps("gpu")
    cpu = _run_steps("cpu")
    assert not compare("write", cpu, got)
    # the first step's HEAD verify sees empty prefixes (every record zero): rows are expected;
    # both backends must agree on every one of them.
    assert int(got[1].write_index[0]) > 0


_CMDBUF_SCRIPT = textwrap.dedent("""
    import os, sys, numpy as np
    sys.path[:0] = [os.environ["KVC_ROOT"]]
    import jax
    from tests import test_gpu
    cpu = test_gpu._run_steps("cpu", steps=4)
    gpu = test_gpu._run_steps("gpu", steps=4)
    from tests.support.cases import compare
    d = compare("write", cpu, gpu)
    print("DIFFS", len(d))
    for x in d[:4]:
        print(x)
    sys.exit(1 if d else 0)
""")


def test_command_buffers_match_cpu():
    """The same step with XLA command buffers (CUDA graphs) enabled for custom calls."""
    env = dict(os.environ, KVC_ROOT=ROOT,
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                          " --xla_gpu_graph_min_graph_size=1").strip())
    r = subprocess.run([sys.executable, "-c", _CMDBUF_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_eager_and_jit_agree_on_gpu():
    case = make_case("write", "w5_mixed_all4", 1)
    with x64_scope(case):
        a = run_on(case, "gpu", jit=False)
        b = run_on(case, "gpu", jit=True)
    assert not compare("write", a, b)


def test_int32_and_int64_inputs_give_identical_bytes():
    """The same values as int32 and as int64 index arrays (x64 on): identical outputs on the GPU."""
    base = gpu_cases.stress_case("write_long", 0, scale="emu")  # int32 case
    assert not base["x64"]
    wide = dict(base)
    conv = lambda x: x.astype(np.int64) if isinstance(x, np.ndarray) and x.dtype == np.int32 and x.ndim == 1 \
        else x  # noqa: E731
    canary, log, wp, ids, pos, loc = base["args"]
    wp64 = kvc.WritePlan(conv(np.asarray(wp.offsets)), conv(np.asarray(wp.seed_slot_indices)),
                         np.asarray(wp.num_valid_reqs))
    wide["args"] = (canary, log, wp64, conv(ids), conv(pos), conv(loc))
    wide["kwargs"] = {k: conv(v) for k, v in base["kwargs"].items()}
    wide["x64"] = True
    a = run_on(base, "gpu")
    with x64_scope(wide):
        b = run_on(wide, "gpu")
    assert not compare("write", a, b)


def test_large_verify_and_write_smoke():
    """Production sizes once: a 16M-entry verify plan, a 4096-token prefill write with 4 sources."""
    S = 1 << 22
    gpu = _dev("gpu")
    canary = jax.device_put(jnp.zeros((S, 32), jnp.uint8), gpu)
    log = jax.device_put(kvc.ViolationLog.create(1024), gpu)
    V = 1 << 24
    vp = kvc.VerifyPlan(jnp.arange(V, dtype=jnp.int32) % (S - 1) + 1, jnp.full((V,), -1, jnp.int32),
                        jnp.zeros((V,), jnp.int32), jnp.full((V,), -1, jnp.int32), jnp.array([V], jnp.int32),
                        jnp.array([1], jnp.int32))
    out = jax.block_until_ready(kvc.verify(canary, log, jax.device_put(vp, gpu), tag=0, impl="ffi"))
    # every entry's stored prev_hash (0) differs from the anchor hash: V rows, the first 1024 kept
    assert int(np.asarray(out.write_index)[0]) == V
    assert out.slot_runs()[0] == V
    np.testing.assert_array_equal(out.rows()[:, 1], np.arange(1024) + 1)

    rng = np.random.default_rng(0)
    N = 4096
    span = 1 << 18  # slots written by the prefill (sources cover them: 64 MiB each)
    kv = [rng.integers(0, 256, (span // 16, 16 * 256), dtype=np.uint8) for _ in range(4)]
    loc = rng.permutation(span)[:N].astype(np.int32)
    case = dict(op="write", config="prefill4096", seed=0, x64=False, kwargs=dict(
        tag=2, real_kv_hash_mode=kvc.RealKvHashMode.ALL), args=(np.zeros((S, 32), np.uint8), kvc.ViolationLog.create(1024),
              kvc.WritePlan(np.array([0, N], np.int32), np.array([-1], np.int32), np.array([1], np.int32)),
              rng.integers(0, 32000, N).astype(np.int32), np.arange(N, dtype=np.int32), loc))
    case["args"] = _to_numpy(case["args"])
    case["kwargs"]["real_kv_sources"] = tuple(kvc.RealKvSource(a, 16, 256, 256) for a in kv)
    got, cpu = run_on(case, "gpu"), run_on(case, "cpu")
    assert not compare("write", cpu, got)
    assert int(got[1].write_index[0]) == 0
