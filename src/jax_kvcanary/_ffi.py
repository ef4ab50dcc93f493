"""The native backend: FFI target registration and ``jax.ffi.ffi_call`` builders.

This is the only module that calls ``jax.ffi``. Functions here receive arguments already validated
and normalised by ``ops.py`` (the real-KV pair is either ``((), NONE)`` or ``(1..4 sources, PARTIAL|ALL)``)
and never check anything themselves (the native handlers check shapes and attributes again, for
callers that reach the targets without ``ops.py``: docs/design.md §5). Attributes are normalised to one exact numpy type each, so a
Python ``1``, ``True`` and ``np.int32(1)`` share a compile-cache entry.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import jaxlib.version
import numpy as np

from . import consts
from .inputs import VerifyPlan, WritePlan
from .state import ViolationLog

#: Why a native module is missing, by device platform (``"cpu"``, ``"gpu"``): the ImportError text.
#: The ops still run there through the pure-JAX backend (see ``backend.py``).
IMPORT_ERRORS: dict = {}
#: Why a native module that imported was not registered, by device platform (``build_mismatch``).
REFUSED: dict = {}

try:
    from . import _kvcanary
except ImportError as e:
    _kvcanary = None
    IMPORT_ERRORS["cpu"] = f"{type(e).__name__}: {e}"
try:
    from . import _kvcanary_cuda
except ImportError as e:
    _kvcanary_cuda = None
    IMPORT_ERRORS["gpu"] = f"{type(e).__name__}: {e}"

VERIFY_TARGET = "kvcanary_verify"
WRITE_TARGET = "kvcanary_write"
PLAN_TARGET = "kvcanary_plan"
SCATTER_TARGET = "kvcanary_scatter"

#: Device platforms (as ``jax.Device.platform`` names them) that have a registered native handler.
NATIVE_PLATFORMS: frozenset = frozenset()

#: Every ffi_call maps over a vmapped batch one element at a time (``lax.map``): each batch element
#: is an independent launch on its own state, the semantics of the pure-JAX backend under vmap.
VMAP_METHOD = "sequential"


def _version(text: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:4])


def running_ffi_api() -> tuple | None:
    """``(major, minor)`` XLA FFI API version of the running jaxlib, or None if unknown.

    Read from the headers that jaxlib ships with its build (``jax.ffi.include_dir()``, the same
    XLA commit as its runtime); no backend is started.
    """
    try:
        with open(os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")) as f:
            text = f.read()
    except (OSError, RuntimeError, AttributeError):
        return None
    found = [re.search(rf"^#define XLA_FFI_API_{part}\s+(\d+)", text, re.M) for part in ("MAJOR", "MINOR")]
    return (int(found[0].group(1)), int(found[1].group(1))) if all(found) else None


_REBUILD = ("rebuild it: pip install --force-reinstall --no-deps <jax_kvcanary source> (an isolated "
            "build compiles against the oldest supported jaxlib's headers, which every newer jaxlib "
            "accepts), or, for a jaxlib older than that, pip install --no-build-isolation "
            "--force-reinstall --no-deps <jax_kvcanary source> in this environment (BUILD.md, "
            "Troubleshooting)")


def build_mismatch(build_info: dict, running_api: tuple | None, running_jaxlib: str) -> str | None:
    """Why a native module must not be registered with the running jaxlib, or None.

    XLA accepts FFI handlers compiled against its own XLA FFI API version or an older minor version
    of the same major version. A handler of a newer API version is refused when the CPU client
    starts, which breaks every JAX computation on that platform, not only this package's ops. So the
    module is refused when the running API (``running_ffi_api()``) is older than the one it was
    compiled against, or of another major version. When the running API is unknown, the jaxlib
    versions stand in for it (the API version never decreases from one jaxlib to the next).
    """
    built = tuple(build_info["ffi_api"])
    built_jaxlib = build_info["jaxlib"]
    compiled = (f"the native module was compiled against XLA FFI API {built[0]}.{built[1]} "
                f"(jaxlib {built_jaxlib}'s headers)")
    if running_api is None:
        if _version(built_jaxlib) and _version(built_jaxlib) <= _version(running_jaxlib):
            return None
        return (f"{compiled}, and the running jaxlib {running_jaxlib} ships no XLA FFI headers to tell "
                f"its API version by, so it may refuse the handlers; {_REBUILD}")
    running = tuple(running_api)
    if running[0] == built[0] and running[1] >= built[1]:
        return None
    why = "another major version" if running[0] != built[0] else "older"
    return (f"{compiled}, and the running jaxlib {running_jaxlib} has XLA FFI API "
            f"{running[0]}.{running[1]} ({why}), which refuses handlers of a newer or another major "
            f"API version; {_REBUILD}")


def expected_constants() -> dict:
    """Every constant and enum member of ``consts.py`` under the names a native module's
    ``constants()`` gives them (``csrc/registrations.h``)."""
    out = {k: v for k, v in vars(consts).items() if k.isupper() and isinstance(v, int)}
    out.update({f"SPLITMIX64_SHIFT{i + 1}": shift for i, shift in enumerate(consts.SPLITMIX64_SHIFTS)})
    for enum in (consts.FailReason, consts.LaunchTag, consts.RealKvHashMode, consts.IndexKind):
        out.update({f"{enum.__name__}.{m.name}": int(m) for m in enum})
    return out


def constants_mismatch(native: dict) -> str | None:
    """Why a native module's compiled constants disagree with ``consts.py`` (a build from other
    sources), or None."""
    expected = expected_constants()
    diff = sorted(k for k in expected.keys() | native.keys() if expected.get(k) != native.get(k))
    if not diff:
        return None
    shown = ", ".join(f"{k}: compiled {native.get(k)}, consts.py {expected.get(k)}" for k in diff[:3])
    return f"its compiled constants differ from consts.py ({shown}); {_REBUILD}"


def _register() -> frozenset:
    platforms = set()
    running_api = running_ffi_api()
    for module, platform, name in ((_kvcanary, "cpu", "cpu"), (_kvcanary_cuda, "CUDA", "gpu")):
        if module is None:
            continue
        why = (build_mismatch(module.build_info(), running_api, jaxlib.version.__version__)
               or constants_mismatch(module.constants()))
        if why is not None:
            REFUSED[name] = why
            continue
        for target, capsule in module.registrations().items():
            jax.ffi.register_ffi_target(target, capsule, platform=platform)
        platforms.add(name)
    return frozenset(platforms)


NATIVE_PLATFORMS = _register()


def set_cpu_threads(n: int | None = None) -> None:
    """Cap the threads each native CPU launch (verify, write, plan) may use; ``None`` or 0 removes the
    cap (the default: the size of XLA's intra-op thread pool), 1 runs every launch on one thread.

    Launches of fewer than 16384 entries run on one thread whatever the cap; results are the same
    bytes for every setting. The cap is read when a launch runs (no recompile) and applies to the
    whole process. Raises ``RuntimeError`` without the native CPU module.
    """
    if _kvcanary is None:
        raise RuntimeError("kv-canary: set_cpu_threads needs the native CPU module: "
                           + IMPORT_ERRORS.get("cpu", "not built"))
    n = 0 if n is None else int(n)
    if n < 0:
        raise ValueError(f"kv-canary: set_cpu_threads needs n >= 0 or None, got {n}")
    _kvcanary.set_max_threads(n)


def cpu_threads() -> int | None:
    """The cap set by ``set_cpu_threads`` (None: no cap)."""
    if _kvcanary is None:
        return None
    return _kvcanary.max_threads() or None


def _sds(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _source_attrs(real_kv_sources, real_kv_hash_mode) -> dict:
    """Static geometry of the sources, padded to 4 entries (buffers carry rows and row bytes)."""
    pad = consts.MAX_REAL_KV_SOURCES - len(real_kv_sources)

    def field(name):
        return np.array([getattr(s, name) for s in real_kv_sources] + [0] * pad, dtype=np.int64)

    return dict(mode=np.int32(real_kv_hash_mode), page_size=field("page_size"),
                bytes_per_token=field("num_bytes_per_token"), read_bytes=field("read_bytes"),
                offset_bytes=field("offset_bytes"))


def _log_outputs(log: ViolationLog):
    return (_sds(log.ring), _sds(log.write_index), _sds(log.kernel_run_counters), _sds(log.slot_run_counters))


def _call(target, results, operands, attrs, *, aliases=None, scratch=None):
    """``jax.ffi.ffi_call`` of ``target``, returning ``results``. ``scratch`` (verify, write, plan):
    ``(sizer, *dims)`` of the CUDA kernels' device scratch, ``uint8[n]`` with ``n`` from the CUDA
    module's launch geometry (``cuda/cuda_kernels.h``). The CUDA lowering appends it to the results,
    so XLA allocates it with the call's other buffers and it stays valid when the call is recorded
    into a command buffer (CUDA graph) and replayed; the CPU lowering has none."""
    def lowering(with_scratch):
        def run(*xs):
            extra = ()
            if with_scratch:
                sizer, *dims = scratch
                extra = (jax.ShapeDtypeStruct((int(getattr(_kvcanary_cuda, sizer)(*dims)),), jnp.uint8),)
            call = jax.ffi.ffi_call(target, tuple(results) + extra, input_output_aliases=aliases,
                                    vmap_method=VMAP_METHOD)
            return tuple(call(*xs, **attrs))[:len(results)]
        return run

    if scratch is None or "gpu" not in NATIVE_PLATFORMS:
        return lowering(False)(*operands)
    return jax.lax.platform_dependent(*operands, cpu=lowering(False), cuda=lowering(True))


def verify(canary, log, verify_plan, *, tag, check_verify_expected_token, real_kv_sources, real_kv_hash_mode):
    """Native verify. Returns the updated ``ViolationLog`` (ring, write_index, counters aliased)."""
    p = verify_plan
    ring, write_index, kernel_counters, slot_counters = _call(
        VERIFY_TARGET, _log_outputs(log),
        (canary, log.ring, log.write_index, log.kernel_run_counters, log.slot_run_counters,
         p.slot_indices, p.expected_tokens, p.expected_positions, p.prev_slot_indices, p.num_valid, p.enable,
         *[s.array for s in real_kv_sources]),
        dict(tag=np.int64(tag), check_token=np.bool_(check_verify_expected_token),
             **_source_attrs(real_kv_sources, real_kv_hash_mode)),
        aliases={1: 0, 2: 1, 3: 2, 4: 3}, scratch=("verify_scratch_bytes", p.slot_indices.shape[0]))
    return ViolationLog(ring, write_index, kernel_counters, slot_counters, log.enable_chain_position_assert)


def write(canary, log, write_plan, input_ids, positions, out_cache_loc, *, tag, enable_write_input_assert,
          expected_input_tokens, expected_input_positions, real_kv_sources, real_kv_hash_mode):
    """Native write. Returns ``(canary, log)``, both aliased to their inputs."""
    if not enable_write_input_assert:  # never read: zero-length placeholders
        expected_input_tokens = expected_input_positions = jnp.zeros((0,), jnp.int32)
    wp = write_plan
    canary, ring, write_index, kernel_counters, slot_counters = _call(
        WRITE_TARGET, (_sds(canary),) + _log_outputs(log),
        (canary, log.ring, log.write_index, log.kernel_run_counters, log.slot_run_counters,
         log.enable_chain_position_assert, wp.offsets, wp.seed_slot_indices, wp.num_valid_reqs,
         input_ids, positions, out_cache_loc, expected_input_tokens, expected_input_positions,
         *[s.array for s in real_kv_sources]),
        dict(tag=np.int64(tag), input_assert=np.bool_(enable_write_input_assert),
             **_source_attrs(real_kv_sources, real_kv_hash_mode)),
        aliases={0: 0, 1: 1, 2: 2, 3: 3, 4: 4},
        scratch=("write_scratch_bytes", wp.seed_slot_indices.shape[0], input_ids.shape[0]))
    return canary, ViolationLog(ring, write_index, kernel_counters, slot_counters,
                                log.enable_chain_position_assert)


def plan(req_pool_indices, prefix_lens, extend_seq_lens, req_to_token, *, verify_capacity, write_req_capacity,
         swa_window_size, full_to_swa_index_mapping, req_to_verify_expected_tokens,
         req_to_verify_expected_tokens_valid_lens, kv_token_id_vs_position_offset, row_starts,
         report_evicted_in_window=False):
    """Native plan. Returns fresh int32 ``(VerifyPlan, WritePlan)``."""
    has_lut = full_to_swa_index_mapping is not None
    has_pool = req_to_verify_expected_tokens is not None
    has_row_starts = row_starts is not None
    empty = jnp.zeros((0,), jnp.int32)
    lut = full_to_swa_index_mapping if has_lut else empty
    starts = row_starts if has_row_starts else empty
    pool = req_to_verify_expected_tokens if has_pool else jnp.zeros((0, 0), jnp.int32)
    valid_lens = req_to_verify_expected_tokens_valid_lens if has_pool else empty
    i32 = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32)  # noqa: E731
    vc, wc = verify_capacity, write_req_capacity
    bs = min(req_pool_indices.shape[0], wc)
    slots, tokens, positions, prevs, num_valid, enable, offsets, seeds, num_valid_reqs = _call(
        PLAN_TARGET, (i32(vc), i32(vc), i32(vc), i32(vc), i32(1), i32(1), i32(wc + 1), i32(wc), i32(1)),
        (req_pool_indices, prefix_lens, extend_seq_lens, req_to_token, lut, pool, valid_lens, starts),
        dict(window=np.int64(swa_window_size), token_offset=np.int64(kv_token_id_vs_position_offset),
             has_lut=np.bool_(has_lut), has_pool=np.bool_(has_pool), has_row_starts=np.bool_(has_row_starts),
             report_evicted=np.bool_(report_evicted_in_window)),
        scratch=("plan_scratch_bytes", bs))
    return (VerifyPlan(slots, tokens, positions, prevs, num_valid, enable),
            WritePlan(offsets, seeds, num_valid_reqs))


def scatter_req_token_ids(pool, flat_ids, offsets, req_pool_indices):
    """Native scatter of per-request id lists into the token pool (aliased)."""
    call = jax.ffi.ffi_call(SCATTER_TARGET, _sds(pool), input_output_aliases={0: 0}, vmap_method=VMAP_METHOD)
    return call(pool, flat_ids, offsets, req_pool_indices)
