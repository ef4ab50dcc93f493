"""Which backend runs an op (``jax_kvcanary.backend``): with ``impl=None`` the choice is made per
lowering platform, the fallback to the pure-JAX backend warns once, and every op maps over a vmapped
batch one launch per element, on every backend."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcanary as kvc
from jax_kvcanary import _ffi, backend
from tests.support import hlo
from tests.support.cases import (STATIC_KWARGS, compare, make_case, run_impl, run_reference, to_jax, to_numpy,
                                 x64_scope)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALL = 'custom_call_target="kvcanary_'
needs_cpu_module = pytest.mark.skipif("cpu" not in _ffi.NATIVE_PLATFORMS, reason="no native CPU module")


def _step_inputs(S=256):
    i32 = lambda *v: jnp.asarray(v, jnp.int32)  # noqa: E731
    return dict(canary=kvc.new_canary_buffer(S), log=kvc.ViolationLog.create(32), pool=jnp.zeros((4, 32), jnp.int32),
                rpi=i32(1, 2, 3), prefix=i32(4, 9, 0), extend=i32(1, 1, 3),
                r2t=jnp.arange(4 * 32, dtype=jnp.int32).reshape(4, 32), ids=i32(7, 8, 9, 10, 11),
                pos=i32(4, 9, 0, 1, 2), loc=i32(30, 70, 100, 101, 102), kv=jnp.ones((S, 4, 8), jnp.bfloat16),
                flat=i32(*range(16)), offsets=i32(0, 5, 10, 16))


def _step(impl):
    """plan -> verify -> write -> scatter: one launch of every op."""
    def step(canary, log, pool, rpi, prefix, extend, r2t, ids, pos, loc, kv, flat, offsets):
        src = (kvc.RealKvSource(kv, 1, 64, 64),)
        vp, wp = kvc.plan(rpi, prefix, extend, r2t, verify_capacity=64, write_req_capacity=4, impl=impl)
        log = kvc.verify(canary, log, vp, tag=2, real_kv_sources=src, real_kv_hash_mode=kvc.RealKvHashMode.ALL,
                         impl=impl)
        canary, log = kvc.write(canary, log, wp, ids, pos, loc, tag=2, real_kv_sources=src,
                                real_kv_hash_mode=kvc.RealKvHashMode.ALL, impl=impl)
        pool = kvc.scatter_req_token_ids(pool, flat, offsets, rpi, impl=impl)
        return canary, log, pool
    return step


def _leaves(out):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(out)]


@needs_cpu_module
def test_default_impl_compiles_to_the_native_calls_in_place():
    """impl=None lowered for the CPU: the four custom calls and nothing of the pure-JAX backend; with
    the state donated, no state buffer is copied; the bytes equal impl='ffi'."""
    x = _step_inputs()
    donate = jax.jit(_step(None), donate_argnums=(0, 1, 2))
    text = donate.lower(*x.values()).compile().as_text()
    for op in ("plan", "verify", "write", "scatter"):
        assert text.count(CALL + op + '"') == 1, op
    assert " while(" not in text and "conditional(" not in text
    state = [x["canary"], x["pool"], *jax.tree_util.tree_leaves(x["log"])]
    assert hlo.state_copies("ffi", text, state) == []
    got = _leaves(jax.jit(_step(None))(*x.values()))
    want = _leaves(jax.jit(_step("ffi"))(*_step_inputs().values()))
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


def _export(platforms):
    x = _step_inputs()
    checks = [jax.export.DisabledSafetyCheck.custom_call(f"kvcanary_{op}")
              for op in ("plan", "verify", "write", "scatter")]
    exp = jax.export.export(jax.jit(_step(None)), platforms=platforms, disabled_checks=checks)(*x.values())
    return exp, exp.mlir_module(), x


@needs_cpu_module
def test_export_for_several_platforms_chooses_per_platform():
    """One function exported for cpu and cuda: a conditional on the platform, the native call in the
    CPU branch; the CUDA branch is native too only when the CUDA module is built. Run on the CPU, the
    exported function gives the native bytes."""
    exp, text, x = _export(("cpu", "cuda"))
    assert "custom_call @kvcanary_verify" in text and "stablehlo.case" in text
    if "gpu" not in _ffi.NATIVE_PLATFORMS:
        assert "stablehlo.while" in text  # the pure-JAX write's loop, in the CUDA branch
    got = _leaves(exp.call(*x.values()))
    want = _leaves(jax.jit(_step("ffi"))(*_step_inputs().values()))
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_lowering_for_a_platform_without_handlers_uses_the_pure_jax_backend():
    _, text, _ = _export(("tpu",))
    assert "custom_call @kvcanary" not in text and "stablehlo.while" in text


@pytest.mark.parametrize("impl", ["ffi", pytest.param("xla", marks=pytest.mark.slow), None])
# Sources here hold integer bytes: inside a loop (vmap's lax.map) XLA:CPU may canonicalise the NaN
# payloads of random-byte 16-bit float arrays before the kernel sees them (see docs/format.md §4.4).
@pytest.mark.parametrize("op,config", [("write", "w3_i32_partial"), ("write", "w2_i64_none_srcs"),
                                       ("verify", "v8_i32_rows"), ("verify", "v6_i64_none_nosrc"),
                                       ("plan", "p4_i32_swa"), ("plan", "p2_i64_pool"),
                                       ("plan", "p9d_i32_rows_swa_pool"), ("plan", "p9b_i64_rows_pool_lut"),
                                       ("scatter_req_token_ids", "s1_i32"),
                                       ("scatter_req_token_ids", "s8_i64_into_i32")])
def test_vmap_is_one_launch_per_batch_element(op, config, impl):
    """vmap over a leading batch axis of three cases (same config, different seeds): each element
    equals the reference run on that case alone."""
    if impl == "ffi" and "cpu" not in _ffi.NATIVE_PLATFORMS:
        pytest.skip("no native CPU module")
    cases = [make_case(op, config, seed) for seed in (11, 12, 13)]
    with x64_scope(cases[0]):
        args = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *[c["args"] for c in cases])
        statics = {k: v for c in cases for k, v in c["kwargs"].items() if k in STATIC_KWARGS}
        dyn = jax.tree_util.tree_map(lambda *xs: np.stack(xs),
                                     *[{k: v for k, v in c["kwargs"].items() if k not in statics} for c in cases])
        fn = getattr(kvc, op)
        out = jax.vmap(lambda a, d: fn(*a, impl=impl, **statics, **d))(to_jax(args), to_jax(dyn))
        out = to_numpy(out)
        for b, case in enumerate(cases):
            got = jax.tree_util.tree_map(lambda x: x[b], out)
            assert not compare(op, run_reference(case), got), f"batch element {b}"


@needs_cpu_module
@pytest.mark.parametrize("op,config", [("write", "w4_i32_all3"), ("verify", "v8_i32_rows"), ("plan", "p3_i32_lut_nowin"),
                                       ("plan", "p9c_mixed_rows_swa"), ("scatter_req_token_ids", "s4_i32_into_i64")])
@pytest.mark.parametrize("jit", [False, True])
def test_default_impl_matches_reference(op, config, jit):
    case = make_case(op, config, 5)
    with x64_scope(case):
        assert not compare(op, run_reference(case), run_impl(case, None, jit=jit))


_FALLBACK_SCRIPT = textwrap.dedent("""
    import sys, warnings
    sys.modules["jax_kvcanary._kvcanary"] = None      # as if the native module failed to import
    import jax, jax.numpy as jnp
    import jax_kvcanary as kvc
    from jax_kvcanary import _ffi, backend
    assert "cpu" not in _ffi.NATIVE_PLATFORMS
    canary, log = kvc.new_canary_buffer(16), kvc.ViolationLog.create(4)
    plan = lambda impl: kvc.plan(jnp.array([1], jnp.int32), jnp.array([2], jnp.int32), jnp.array([1], jnp.int32),
                                 jnp.arange(16, dtype=jnp.int32).reshape(2, 8), verify_capacity=4,
                                 write_req_capacity=1, impl=impl)
    with warnings.catch_warnings(record=True) as explicit:
        warnings.simplefilter("always")
        vp, wp = plan("xla")
        kvc.verify(canary, log, vp, tag=0, impl="xla").write_index.block_until_ready()
    print("EXPLICIT", len(explicit))
    with warnings.catch_warnings(record=True) as auto:
        warnings.simplefilter("always")
        vp, wp = plan(None)
        log = kvc.verify(canary, log, vp, tag=0)
        jax.jit(lambda c, l: kvc.verify(c, l, vp, tag=1))(canary, log)
    ours = [w for w in auto if issubclass(w.category, backend.NativeBackendWarning)]
    print("AUTO", len(ours))
    print("MESSAGE", ours[0].message if ours else "")
    print("ROWS", log.total())
    print("DESCRIBE", backend.describe())
""")


def test_missing_native_module_warns_once_and_still_checks():
    r = subprocess.run([sys.executable, "-c", _FALLBACK_SCRIPT], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in r.stdout.strip().splitlines())
    assert out["EXPLICIT"] == "0"
    assert out["AUTO"] == "1"
    assert "pure-JAX backend" in out["MESSAGE"] and "jax_kvcanary._kvcanary" in out["MESSAGE"]
    assert "pip install ." in out["MESSAGE"] and "impl='xla'" in out["MESSAGE"]
    assert out["ROWS"] == "2"  # two zero slots planned as chain entries: both reported
    assert out["DESCRIBE"].startswith("('xla', 'jax_kvcanary._kvcanary (CPU handlers)")


def test_describe_reports_the_native_backend_here():
    impl, reason = backend.describe("cpu")
    if "cpu" in _ffi.NATIVE_PLATFORMS and not os.environ.get(backend.IMPL_ENV):
        assert (impl, reason) == ("ffi", None)
    assert backend.describe("tpu")[0] == "xla"


def test_build_mismatch_refuses_only_an_older_or_other_major_running_ffi_api():
    info = {"jaxlib": "0.8.3", "ffi_api": (0, 2)}
    assert _ffi.build_mismatch(info, (0, 2), "0.8.3") is None        # the build's own API
    assert _ffi.build_mismatch(info, (0, 3), "0.10.2") is None       # newer minor: accepted
    assert _ffi.build_mismatch(info, (0, 5), "0.12.0.1") is None
    why = _ffi.build_mismatch(info, (0, 1), "0.7.2")
    assert "XLA FFI API 0.2 (jaxlib 0.8.3's headers)" in why and "running jaxlib 0.7.2" in why
    assert "API 0.1 (older)" in why and "--no-build-isolation" in why
    why = _ffi.build_mismatch(info, (1, 0), "1.0.0")
    assert "API 1.0 (another major version)" in why
    newer = {"jaxlib": "0.12.0.1", "ffi_api": (0, 5)}               # e.g. built with the env's headers
    assert "API 0.2 (older)" in _ffi.build_mismatch(newer, (0, 2), "0.8.3")


def test_build_mismatch_without_the_running_api_compares_jaxlib_versions():
    info = {"jaxlib": "0.8.3", "ffi_api": (0, 2)}
    assert _ffi.build_mismatch(info, None, "0.8.3") is None
    assert _ffi.build_mismatch(info, None, "0.12.0.1") is None
    assert "ships no XLA FFI headers" in _ffi.build_mismatch(info, None, "0.8.2")
    assert "ships no XLA FFI headers" in _ffi.build_mismatch({"jaxlib": "unknown", "ffi_api": (0, 2)}, None, "0.9")


def test_the_running_ffi_api_is_read_from_jaxlibs_headers():
    api = _ffi.running_ffi_api()
    with open(os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")) as f:
        text = f.read()
    assert api is not None and len(api) == 2
    assert f"#define XLA_FFI_API_MAJOR {api[0]}" in text and f"#define XLA_FFI_API_MINOR {api[1]}" in text


def test_this_build_records_an_ffi_api_the_running_jaxlib_accepts():
    import jaxlib.version

    if _ffi._kvcanary is None:
        pytest.skip("no native CPU module")
    info = _ffi._kvcanary.build_info()
    running = _ffi.running_ffi_api()
    assert len(info["ffi_api"]) == 2 and info["ffi_api"][0] == running[0] and info["ffi_api"][1] <= running[1]
    # the pinned oldest jaxlib's headers, or this environment's when it is not newer than the pin
    assert _ffi._version(info["jaxlib"]) <= _ffi._version(jaxlib.version.__version__)
    assert _ffi.build_mismatch(info, running, jaxlib.version.__version__) is None


_OLDER_JAXLIB_SCRIPT = textwrap.dedent("""
    import os, tempfile, warnings
    import jax, jax.numpy as jnp
    import jaxlib.version
    # as if an older jaxlib were running: its version and the XLA FFI API of the headers it ships
    fake_dir = tempfile.TemporaryDirectory()
    fake = fake_dir.name
    os.makedirs(os.path.join(fake, "xla", "ffi", "api"))
    with open(os.path.join(fake, "xla", "ffi", "api", "c_api.h"), "w") as f:
        f.write("#define XLA_FFI_API_MAJOR 0\\n#define XLA_FFI_API_MINOR 0\\n")
    jax.ffi.include_dir = lambda: fake
    jaxlib.version.__version__ = "0.0.1"
    import jax_kvcanary as kvc
    from jax_kvcanary import _ffi, backend
    print("NATIVE", sorted(_ffi.NATIVE_PLATFORMS))
    with warnings.catch_warnings(record=True) as auto:
        warnings.simplefilter("always")
        vp, wp = kvc.plan(jnp.array([1], jnp.int32), jnp.array([2], jnp.int32), jnp.array([1], jnp.int32),
                          jnp.arange(16, dtype=jnp.int32).reshape(2, 8), verify_capacity=4, write_req_capacity=1)
    ours = [w for w in auto if issubclass(w.category, backend.NativeBackendWarning)]
    print("MESSAGE", ours[0].message if ours else "")
    print("SUM", int(jnp.arange(4).sum()))            # the rest of JAX is unaffected
""")


def test_an_older_running_jaxlib_gets_the_pure_jax_backend_and_a_warning():
    if _ffi._kvcanary is None:
        pytest.skip("no native CPU module")
    r = subprocess.run([sys.executable, "-c", _OLDER_JAXLIB_SCRIPT], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in r.stdout.strip().splitlines())
    assert out["NATIVE"] == "[]"
    assert "was not registered" in out["MESSAGE"] and "running jaxlib 0.0.1 has XLA FFI API 0.0" in out["MESSAGE"]
    assert out["SUM"] == "6"
