"""The public ops: trace-time checks (in the spec's order), then dispatch to a backend.

Backends: ``_ffi`` (native custom calls) and ``xla_impl`` (pure jax.numpy). Both receive the same
normalised arguments, so the checks live here once. All ops are functional and jit-compatible;
mutating ops alias their state inputs to their outputs.
"""

from __future__ import annotations

import jax

from . import checks, consts
from .errors import KvCanaryTypeError
from .inputs import VerifyPlan, WritePlan


# Static (compile-time) options of each op: the pure-JAX backend is called through one cached
# jax.jit per op, so eager calls compile once per shape instead of dispatching op by op.
_STATIC = {
    "verify": ("tag", "check_verify_expected_token", "real_kv_hash_mode"),
    "write": ("tag", "enable_write_input_assert", "real_kv_hash_mode"),
    "plan": ("verify_capacity", "write_req_capacity", "swa_window_size", "kv_token_id_vs_position_offset"),
    "scatter_req_token_ids": (),
}


class _JittedXla:
    def __getattr__(self, name):
        from . import xla_impl
        fn = jax.jit(getattr(xla_impl, name), static_argnames=_STATIC[name])
        setattr(self, name, fn)
        return fn


_XLA = _JittedXla()


def _backend(name: str):
    if name == "ffi":
        from . import _ffi
        return _ffi
    return _XLA


def verify(canary, log, verify_plan, *, tag, check_verify_expected_token=False, real_kv_sources=(),
           real_kv_hash_mode=consts.RealKvHashMode.NONE, impl=None):
    """Check every active plan entry against the canary records; returns the updated ``ViolationLog``.

    canary: uint8[num_slots, stride] (read only). verify_plan: VerifyPlan (entries int32/int64[V],
    num_valid/enable int32[1]). Rows go to ``log.ring`` in entry order (spec §8).
    """
    sources, mode = checks.real_kv(real_kv_sources, real_kv_hash_mode)
    backend = checks.impl(impl, canary)
    checks.canary(canary)
    num_tags = checks.log(log)
    tag = checks.tag(tag, num_tags)
    if not isinstance(verify_plan, VerifyPlan):
        raise KvCanaryTypeError(f"kv-canary: verify_plan must be a VerifyPlan, got {type(verify_plan).__name__}")
    vp = verify_plan
    cap = checks.index_array(vp.slot_indices, "verify_plan.slot_indices")
    if cap == 0:
        raise ValueError("kv-canary: VerifyPlan verify_capacity must be positive, got 0")
    for name in ("expected_tokens", "expected_positions", "prev_slot_indices"):
        checks.index_array(getattr(vp, name), f"verify_plan.{name}", cap)
    checks.scalar_i32(vp.num_valid, "verify_plan.num_valid")
    checks.scalar_i32(vp.enable, "verify_plan.enable")
    check_token = checks.static_bool(check_verify_expected_token, "check_verify_expected_token")
    return _backend(backend).verify(canary, log, vp, tag=tag, check_verify_expected_token=check_token,
                                    real_kv_sources=sources, real_kv_hash_mode=mode)


def write(canary, log, write_plan, input_ids, positions, out_cache_loc, *, tag, enable_write_input_assert=False,
          expected_input_tokens=None, expected_input_positions=None, real_kv_sources=(),
          real_kv_hash_mode=consts.RealKvHashMode.NONE, impl=None):
    """Stamp the records of the slots this step fills; returns ``(canary, log)`` (both aliased).

    input_ids / positions / out_cache_loc: int32/int64[N]; out_cache_loc < 0 skips an entry.
    write_plan: WritePlan (offsets [C+1], seeds [C], num_valid_reqs int32[1]). Spec §7.
    """
    sources, mode = checks.real_kv(real_kv_sources, real_kv_hash_mode)
    backend = checks.impl(impl, canary)
    checks.canary(canary)
    num_tags = checks.log(log)
    tag = checks.tag(tag, num_tags)
    if not isinstance(write_plan, WritePlan):
        raise KvCanaryTypeError(f"kv-canary: write_plan must be a WritePlan, got {type(write_plan).__name__}")
    wp = write_plan
    cap = checks.index_array(wp.seed_slot_indices, "write_plan.seed_slot_indices")
    if cap == 0:
        raise ValueError("kv-canary: WritePlan write_req_capacity must be positive, got 0")
    checks.index_array(wp.offsets, "write_plan.offsets", cap + 1, f"write_req_capacity + 1 = {cap + 1}")
    checks.scalar_i32(wp.num_valid_reqs, "write_plan.num_valid_reqs")
    n = checks.index_array(input_ids, "input_ids")
    checks.index_array(positions, "positions", n)
    checks.index_array(out_cache_loc, "out_cache_loc", n)
    assert_on = checks.static_bool(enable_write_input_assert, "enable_write_input_assert")
    if assert_on and (expected_input_tokens is None or expected_input_positions is None):
        raise ValueError("kv-canary: expected input tensors are required when enable_write_input_assert=True")
    if not assert_on and (expected_input_tokens is not None or expected_input_positions is not None):
        raise ValueError("kv-canary: expected input tensors must be None when enable_write_input_assert=False")
    if assert_on:
        checks.index_array(expected_input_tokens, "expected_input_tokens", n)
        checks.index_array(expected_input_positions, "expected_input_positions", n)
    return _backend(backend).write(
        canary, log, wp, input_ids, positions, out_cache_loc, tag=tag, enable_write_input_assert=assert_on,
        expected_input_tokens=expected_input_tokens, expected_input_positions=expected_input_positions,
        real_kv_sources=sources, real_kv_hash_mode=mode)


def plan(req_pool_indices, prefix_lens, extend_seq_lens, req_to_token, *, verify_capacity, write_req_capacity,
         swa_window_size=0, full_to_swa_index_mapping=None, req_to_verify_expected_tokens=None,
         req_to_verify_expected_tokens_valid_lens=None, kv_token_id_vs_position_offset=0, impl=None):
    """Turn batch metadata into ``(VerifyPlan, WritePlan)`` of fresh int32 arrays (spec §9).

    req_pool_indices / prefix_lens / extend_seq_lens: int32/int64[bs]; req_to_token: int32/int64[R, L].
    """
    window = checks.static_int(swa_window_size, "swa_window_size")
    if window < 0:
        raise ValueError(f"kv-canary: swa_window_size must be >= 0, got {window}")
    if window > 0 and full_to_swa_index_mapping is None:
        raise ValueError("kv-canary: launch_canary_plan_kernels requires full_to_swa_index_mapping when "
                         "swa_window_size > 0")
    backend = checks.impl(impl, req_to_token)
    vcap = checks.capacity(verify_capacity, "verify_capacity", "VerifyPlan verify_capacity")
    wcap = checks.capacity(write_req_capacity, "write_req_capacity", "WritePlan write_req_capacity")
    offset = checks.static_int(kv_token_id_vs_position_offset, "kv_token_id_vs_position_offset")
    if not -(2**31) <= offset < 2**31:
        raise ValueError(f"kv-canary: kv_token_id_vs_position_offset must fit in int32, got {offset}")
    bs = checks.index_array(req_pool_indices, "req_pool_indices")
    checks.index_array(prefix_lens, "prefix_lens", bs)
    checks.index_array(extend_seq_lens, "extend_seq_lens", bs)
    if bs > wcap:
        raise ValueError(f"kv-canary: bs={bs} exceeds write_req_capacity={wcap}")
    checks.index_matrix(req_to_token, "req_to_token")
    if full_to_swa_index_mapping is not None:
        if checks.index_array(full_to_swa_index_mapping, "full_to_swa_index_mapping") == 0:
            raise ValueError("kv-canary: full_to_swa_index_mapping length must be >= 1, got 0")
    pool, valid_lens = req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens
    if pool is not None and valid_lens is None:
        raise ValueError("kv-canary: launch_canary_plan_kernels requires req_to_verify_expected_tokens_valid_lens "
                         "when req_to_verify_expected_tokens is set")
    if pool is None and valid_lens is not None:
        raise ValueError("kv-canary: req_to_verify_expected_tokens_valid_lens must be None when "
                         "req_to_verify_expected_tokens is None")
    if pool is not None:
        checks.index_matrix(pool, "req_to_verify_expected_tokens")
        checks.index_array(valid_lens, "req_to_verify_expected_tokens_valid_lens", bs)
    return _backend(backend).plan(
        req_pool_indices, prefix_lens, extend_seq_lens, req_to_token, verify_capacity=vcap,
        write_req_capacity=wcap, swa_window_size=window, full_to_swa_index_mapping=full_to_swa_index_mapping,
        req_to_verify_expected_tokens=pool, req_to_verify_expected_tokens_valid_lens=valid_lens,
        kv_token_id_vs_position_offset=offset)


def scatter_req_token_ids(pool, flat_ids, offsets, req_pool_indices, *, impl=None):
    """Fill the ground-truth token pool int32/int64[Rp, Cp] from flattened per-request id lists.

    flat_ids: int[total]; offsets: int[bs + 1]; req_pool_indices: int[bs]. Returns the pool (aliased).
    """
    checks.scatter_args(pool, flat_ids, offsets, req_pool_indices)
    backend = checks.impl(impl, pool)
    return _backend(backend).scatter_req_token_ids(pool, flat_ids, offsets, req_pool_indices)
