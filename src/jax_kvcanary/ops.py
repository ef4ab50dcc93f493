"""The public ops: trace-time checks (in the order of format §7.2, §8.2, §9.4, §9.5), then dispatch
to a backend (``backend.py``: the native custom calls of ``_ffi.py``, the pure-JAX ``xla_impl.py``, or
the choice per lowering platform). Every backend receives the same normalised arguments, so the
checks live here once. All ops are functional and jit-compatible; mutating ops alias their state
inputs to their outputs.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

import jax

from . import backend, checks
from .consts import LaunchTag, RealKvHashMode
from .errors import KvCanaryTypeError
from .inputs import RealKvSource, VerifyPlan, WritePlan
from .state import ViolationLog

#: ``real_kv_sources``: up to ``MAX_REAL_KV_SOURCES`` sources, a tuple or a list.
RealKvSources = Union[tuple[RealKvSource, ...], list[RealKvSource]]
#: ``impl``: the native custom call, the pure-JAX backend, or None (chosen per lowering platform).
Impl = Optional[Literal["ffi", "xla"]]


def verify(canary: jax.Array, log: ViolationLog, verify_plan: VerifyPlan, *, tag: Union[LaunchTag, int],
           check_verify_expected_token: bool = False, real_kv_sources: RealKvSources = (),
           real_kv_hash_mode: Union[RealKvHashMode, int] = RealKvHashMode.NONE, impl: Impl = None) -> ViolationLog:
    """Check every active plan entry against the canary records (docs/format.md §8).

    Each active entry checks one chain link: the slot's stored position (and token, if asked)
    against the plan, its stored ``prev_hash`` against its predecessor's successor hash, and, with
    real-KV sources, its stored fingerprint against the live KV bytes. Mismatches become rows of
    ``log.ring`` in entry order. The canary is only read.

    Args:
      canary: ``uint8[num_slots, stride]``, ``stride >= 32`` and a multiple of 8.
      log: the step's ``ViolationLog``.
      verify_plan: ``VerifyPlan`` with entry arrays int32/int64 ``[V]`` (``V >= 1``) and
        ``num_valid`` / ``enable`` int32 ``[1]``; usually the first result of ``plan``.
      tag: the launch tag (``LaunchTag`` or int in ``[0, num_tags)``), stamped into every row and
        selecting the counter row. Static.
      check_verify_expected_token: also compare stored tokens with ``expected_tokens`` (-1 = skip
        the entry's token check). Static.
      real_kv_sources: up to 4 ``RealKvSource``; empty for no fingerprint check.
      real_kv_hash_mode: ``RealKvHashMode`` (NONE, PARTIAL: 16 bytes per source, ALL: ``read_bytes``).
        Static.
      impl: ``"ffi"``, ``"xla"`` or None (the native handler where there is one, else the pure-JAX
        backend, chosen per lowering platform; ``JAX_KVCANARY_IMPL`` sets the default).

    Returns:
      The updated ``ViolationLog`` (``ring``, ``write_index`` and the counters aliased to the
      inputs, so a donating ``jax.jit`` updates them in place).

    Raises:
      TypeError, ValueError: at trace time, with a ``kv-canary:`` message naming the argument, the
        expected and the actual value (type and dtype errors are ``KvCanaryTypeError``, which is
        both). Data never raises: out-of-range indices become ``INDEX_OUT_OF_RANGE`` rows.
    """
    sources, mode = checks.real_kv(real_kv_sources, real_kv_hash_mode)
    choice = backend.resolve(impl, canary)
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
    if check_token and not vp.has_expected_tokens:
        raise ValueError("kv-canary: check_verify_expected_token=True needs a verify plan with "
                         "expected tokens; this one was planned without "
                         "req_to_verify_expected_tokens (every expected token is -1, nothing would "
                         "be checked)")
    return backend.op("verify", choice)(canary, log, vp, tag=tag, check_verify_expected_token=check_token,
                                    real_kv_sources=sources, real_kv_hash_mode=mode)


def write(canary: jax.Array, log: ViolationLog, write_plan: WritePlan, input_ids: jax.Array, positions: jax.Array,
          out_cache_loc: jax.Array, *, tag: Union[LaunchTag, int], enable_write_input_assert: bool = False,
          expected_input_tokens: Optional[jax.Array] = None, expected_input_positions: Optional[jax.Array] = None,
          real_kv_sources: RealKvSources = (), real_kv_hash_mode: Union[RealKvHashMode, int] = RealKvHashMode.NONE,
          impl: Impl = None) -> tuple[jax.Array, ViolationLog]:
    """Stamp the records of the slots this step fills (docs/format.md §7).

    Requests run in order, each over its range of the flat token arrays: every entry with a slot
    ``>= 0`` gets ``(token, position, prev_hash, real_kv_hash)``, the chain hash advancing from the
    request's seed. The optional asserts compare the inputs with an oracle (input assert) and each
    position with the previous one + 1 (chain-position assert, on while
    ``log.enable_chain_position_assert`` is non-zero).

    Args:
      canary: ``uint8[num_slots, stride]``.
      log: the step's ``ViolationLog``.
      write_plan: ``WritePlan``: ``offsets`` int32/int64 ``[C + 1]``, ``seed_slot_indices``
        int32/int64 ``[C]`` (``C >= 1``; negative = no prefix), ``num_valid_reqs`` int32 ``[1]``;
        usually the second result of ``plan``.
      input_ids: int32/int64 ``[N]``, the token of each flat entry.
      positions: int32/int64 ``[N]``.
      out_cache_loc: int32/int64 ``[N]``, the canary slot of each entry (SWA groups: already
        translated); negative = skip the entry.
      tag: the launch tag. Static.
      enable_write_input_assert: compare ``input_ids`` / ``positions`` with the expected arrays.
        Static.
      expected_input_tokens, expected_input_positions: int32/int64 ``[N]`` when the input assert
        is on, else None.
      real_kv_sources: up to 4 ``RealKvSource`` whose bytes are fingerprinted into each record.
      real_kv_hash_mode: ``RealKvHashMode``. Static.
      impl: ``"ffi"``, ``"xla"`` or None (see ``verify``).

    Returns:
      ``(canary, log)``, both aliased to the inputs.

    Raises:
      TypeError, ValueError: at trace time, with a ``kv-canary:`` message (see ``verify``),
        including the option pairs (``enable_write_input_assert=True`` needs both expected arrays).
    """
    sources, mode = checks.real_kv(real_kv_sources, real_kv_hash_mode)
    choice = backend.resolve(impl, canary)
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
    return backend.op("write", choice)(
        canary, log, wp, input_ids, positions, out_cache_loc, tag=tag, enable_write_input_assert=assert_on,
        expected_input_tokens=expected_input_tokens, expected_input_positions=expected_input_positions,
        real_kv_sources=sources, real_kv_hash_mode=mode)


def plan(req_pool_indices: jax.Array, prefix_lens: jax.Array, extend_seq_lens: jax.Array, req_to_token: jax.Array,
         *, verify_capacity: int, write_req_capacity: int, swa_window_size: int = 0,
         full_to_swa_index_mapping: Optional[jax.Array] = None,
         req_to_verify_expected_tokens: Optional[jax.Array] = None,
         req_to_verify_expected_tokens_valid_lens: Optional[jax.Array] = None,
         kv_token_id_vs_position_offset: int = 0, row_starts: Optional[jax.Array] = None,
         report_evicted_in_window: bool = False, impl: Impl = None) -> tuple[VerifyPlan, WritePlan]:
    """Turn the batch metadata of a step into its verify and write work lists (docs/format.md §9).

    Every live batch row (``req_pool_indices != 0``) verifies its prefix (positions
    ``[0, prefix_len)``, or the last ``swa_window_size`` of them) and writes ``extend_seq_len``
    tokens, seeded by the slot of position ``prefix_len - 1``.

    The slot of position ``pos`` of batch row ``r`` is read from ``req_to_token[rp, pos]``
    (``rp = req_pool_indices[r]``), or, with ``row_starts``, from the flat page table at
    ``req_to_token[row_starts[r] + pos]`` (an int64 sum, wrapping; the page table that attention
    reads in the step, such as sglang-jax's ``cache_loc``). A read outside the table gives -1.

    Args:
      req_pool_indices: int32/int64 ``[bs]``, each batch row's row of ``req_to_token`` (and of the
        token pool); 0 = padding.
      prefix_lens: int32/int64 ``[bs]``, tokens already in the KV cache.
      extend_seq_lens: int32/int64 ``[bs]``, tokens written this step.
      req_to_token: int32/int64 ``[R, L]``, the full-pool slot of ``(row, position)``; with
        ``row_starts``, the flat page table ``[N]``.
      verify_capacity: ``V``, the length of the verify entry arrays (``1 <= V < 2**31``). Static.
        A step with more entries skips its verify (``enable = 0``) but still writes.
      write_req_capacity: ``C``, the number of write requests (``bs <= C < 2**31``). Static.
      swa_window_size: ``W``; 0 for a FULL group. Static.
      full_to_swa_index_mapping: int32/int64 ``[Llut]``, the full-to-SWA slot map (0 = evicted);
        required when ``W > 0``.
      req_to_verify_expected_tokens: int32/int64 ``[Rp, Cp]`` ground-truth token pool, or None.
      req_to_verify_expected_tokens_valid_lens: int32/int64 ``[bs]``, the valid length of each batch
        row's pool row; given iff the pool is.
      kv_token_id_vs_position_offset: added to the position before indexing the pool (0, or +1 for
        EAGLE draft pools). Static.
      row_starts: int32/int64 ``[bs]``, where each batch row's segment starts in the flat
        ``req_to_token``, or None (the default: ``req_to_token`` is the 2-D table).
      report_evicted_in_window: a verify entry whose table slot is live (``> 0``) but which the
        LUT maps to 0 (evicted from the SWA pool while the window still reads it) gets slot -1,
        which verify reports (a ``VERIFY_SLOT`` row), instead of 0, which verify skips. Needs
        ``full_to_swa_index_mapping``. Static; default False (upstream's rule).
      impl: ``"ffi"``, ``"xla"`` or None (see ``verify``).

    Returns:
      ``(VerifyPlan, WritePlan)`` of fresh int32 arrays: entries ``[V]``, ``num_valid`` / ``enable``
      ``[1]``; ``offsets [C + 1]``, ``seed_slot_indices [C]``, ``num_valid_reqs [1]``.

    Raises:
      TypeError, ValueError: at trace time, with a ``kv-canary:`` message (see ``verify``).
    """
    window = checks.static_int(swa_window_size, "swa_window_size")
    if window < 0:
        raise ValueError(f"kv-canary: swa_window_size must be >= 0, got {window}")
    if window > 0 and full_to_swa_index_mapping is None:
        raise ValueError("kv-canary: launch_canary_plan_kernels requires full_to_swa_index_mapping when "
                         "swa_window_size > 0")
    report_evicted = checks.static_bool(report_evicted_in_window, "report_evicted_in_window")
    if report_evicted and full_to_swa_index_mapping is None:
        raise ValueError("kv-canary: report_evicted_in_window=True requires "
                         "full_to_swa_index_mapping, got None")
    choice = backend.resolve(impl, req_to_token)
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
    if row_starts is None:
        checks.index_matrix(req_to_token, "req_to_token")
    else:
        checks.index_array(row_starts, "row_starts", bs)
        checks.flat_table(req_to_token, "req_to_token", "row_starts is given")
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
    vp, wp = backend.op("plan", choice)(
        req_pool_indices, prefix_lens, extend_seq_lens, req_to_token, verify_capacity=vcap,
        write_req_capacity=wcap, swa_window_size=window, full_to_swa_index_mapping=full_to_swa_index_mapping,
        req_to_verify_expected_tokens=pool, req_to_verify_expected_tokens_valid_lens=valid_lens,
        kv_token_id_vs_position_offset=offset, row_starts=row_starts,
        report_evicted_in_window=report_evicted)
    if pool is None:
        vp = VerifyPlan(*(getattr(vp, f) for f in VerifyPlan._FIELDS), has_expected_tokens=False)
    return vp, wp


def scatter_req_token_ids(pool: jax.Array, flat_ids: jax.Array, offsets: jax.Array, req_pool_indices: jax.Array,
                          *, impl: Impl = None) -> jax.Array:
    """Fill the ground-truth token pool from flattened per-request id lists (docs/format.md §9.5).

    Batch row ``r`` copies ``flat_ids[offsets[r]:offsets[r + 1]]`` (at most ``Cp`` ids) to the start
    of pool row ``req_pool_indices[r]``; a later row wins where two rows share a pool row.

    Args:
      pool: int32/int64 ``[Rp, Cp]``, the ``req_to_verify_expected_tokens`` of ``plan``.
      flat_ids: int32/int64 ``[total]``, every row's prompt + output ids, concatenated.
      offsets: int32/int64 ``[bs + 1]``.
      req_pool_indices: int32/int64 ``[bs]``.
      impl: ``"ffi"``, ``"xla"`` or None (see ``verify``).

    Returns:
      The pool, aliased to the input (ids narrowed to its dtype).

    Raises:
      TypeError, ValueError: at trace time, with a ``kv-canary:`` message.
    """
    checks.scatter_args(pool, flat_ids, offsets, req_pool_indices)
    choice = backend.resolve(impl, pool)
    return backend.op("scatter_req_token_ids", choice)(pool, flat_ids, offsets, req_pool_indices)
