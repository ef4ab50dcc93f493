"""Every trace-time argument error (format.md §4.4, §7.2, §8.2, §9.4, §9.5): class and exact message.

Each case is also run under ``jax.jit`` tracing where it applies, to show the error is raised while
tracing, before anything reaches a native handler.
"""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_kvcanary as kvc
from jax_kvcanary.errors import KvCanaryTypeError


def i32(*v):
    return jnp.array(v, jnp.int32)


def good_log(cap=4, tags=12):
    return kvc.ViolationLog.create(cap, tags)


def good_wp(cap=2):
    return kvc.WritePlan(jnp.zeros(cap + 1, jnp.int32), jnp.full(cap, -1, jnp.int32), i32(1))


def good_vp(cap=3):
    z = jnp.zeros(cap, jnp.int32)
    return kvc.VerifyPlan(z, z, z, z, i32(1), i32(1))


CANARY = kvc.new_canary_buffer(8)
TOK = jnp.zeros(3, jnp.int32)


def raises(exc, msg):
    """The exact message; under jit JAX may append a traceback-filtering note on a new line."""
    return pytest.raises(exc, match="^" + re.escape(msg) + r"(\n|$)")


def write(**over):
    args = dict(canary=CANARY, log=good_log(), write_plan=good_wp(), input_ids=TOK, positions=TOK,
                out_cache_loc=TOK)
    kw = dict(tag=0)
    for k, v in over.items():
        (args if k in args else kw)[k] = v
    return kvc.write(*args.values(), **kw)


def verify(**over):
    args = dict(canary=CANARY, log=good_log(), verify_plan=good_vp())
    kw = dict(tag=0)
    for k, v in over.items():
        (args if k in args else kw)[k] = v
    return kvc.verify(*args.values(), **kw)


def plan(**over):
    args = dict(req_pool_indices=i32(1, 2), prefix_lens=i32(0, 1), extend_seq_lens=i32(1, 1),
                req_to_token=jnp.zeros((4, 16), jnp.int32))
    kw = dict(verify_capacity=8, write_req_capacity=4)
    for k, v in over.items():
        (args if k in args else kw)[k] = v
    return kvc.plan(*args.values(), **kw)


# ---- RealKvSource constructor (format.md §4.4) -------------------------------------------------------
U8 = jnp.zeros((4, 64), jnp.uint8)


@pytest.mark.parametrize("args, exc, msg", [
    ((U8, 1.5, 16, 16), TypeError, "kv-canary: RealKvSource.page_size must be an int, got float"),
    ((U8, 1, "16", 16), TypeError, "kv-canary: RealKvSource.num_bytes_per_token must be an int, got str"),
    ((U8, 1, 16, None), TypeError, "kv-canary: RealKvSource.read_bytes must be an int, got NoneType"),
    ((U8, 0, 16, 16), ValueError, "kv-canary: RealKvSource.page_size must be >= 1, got 0"),
    ((U8, 1, 24, 16), ValueError,
     "kv-canary: RealKvSource.num_bytes_per_token must be a positive multiple of 16, got 24"),
    ((U8, 1, 0, 16), ValueError,
     "kv-canary: RealKvSource.num_bytes_per_token must be a positive multiple of 16, got 0"),
    ((U8, 1, 32, 48), ValueError,
     "kv-canary: RealKvSource.read_bytes must be a positive multiple of 16 in (0, num_bytes_per_token=32], got 48"),
    ((U8, 1, 32, 8), ValueError,
     "kv-canary: RealKvSource.read_bytes must be a positive multiple of 16 in (0, num_bytes_per_token=32], got 8"),
    (([1, 2], 1, 16, 16), TypeError, "kv-canary: RealKvSource.array must be a jax.Array, got list"),
    ((jnp.zeros(64, jnp.uint8), 1, 16, 16), ValueError,
     "kv-canary: RealKvSource.array must be at least 2-D, got shape (64,)"),
    ((jnp.zeros((4, 64), ml_dtypes.int4), 1, 16, 16), TypeError,
     "kv-canary: RealKvSource.array dtype int4 is not supported: elements narrower than 8 bits have no "
     "defined byte layout"),
    ((jnp.zeros((4, 3, 2), jnp.float32), 1, 16, 16), ValueError,
     "kv-canary: RealKvSource.array row stride must be a multiple of 16 bytes, got 24 bytes "
     "(shape=(4, 3, 2), dtype=float32)"),
    ((U8, 4, 32, 16), ValueError,
     "kv-canary: RealKvSource row is too narrow for its slot layout: a row is 64 bytes but page_size=4 x "
     "num_bytes_per_token=32 needs 128"),
    # offset_bytes (format.md §4.4: its type with the other ints, then 4a and 4b before the array)
    ((U8, 1, 32, 16, 1.0), TypeError, "kv-canary: RealKvSource.offset_bytes must be an int, got float"),
    ((U8, 1, 32, 16, "16"), TypeError, "kv-canary: RealKvSource.offset_bytes must be an int, got str"),
    ((U8, 1, 32, 16, -16), ValueError,
     "kv-canary: RealKvSource.offset_bytes must be a non-negative multiple of 16, got -16"),
    ((U8, 1, 32, 16, 8), ValueError,
     "kv-canary: RealKvSource.offset_bytes must be a non-negative multiple of 16, got 8"),
    ((U8, 1, 32, 16, 32), ValueError,
     "kv-canary: RealKvSource.offset_bytes + read_bytes must be <= num_bytes_per_token=32, got 32 + 16"),
    ((U8, 1, 64, 48, 32), ValueError,
     "kv-canary: RealKvSource.offset_bytes + read_bytes must be <= num_bytes_per_token=64, got 32 + 48"),
    # order: the int checks come first (offset type before page_size's value), and the offset's
    # value checks before the array's
    ((U8, 0, 16, 16, None), TypeError, "kv-canary: RealKvSource.offset_bytes must be an int, got NoneType"),
    ((U8, 1, 32, 48, 16), ValueError,
     "kv-canary: RealKvSource.read_bytes must be a positive multiple of 16 in (0, num_bytes_per_token=32], got 48"),
    (([1, 2], 1, 32, 16, 8), ValueError,
     "kv-canary: RealKvSource.offset_bytes must be a non-negative multiple of 16, got 8"),
    ((jnp.zeros(64, jnp.uint8), 1, 32, 16, 32), ValueError,
     "kv-canary: RealKvSource.offset_bytes + read_bytes must be <= num_bytes_per_token=32, got 32 + 16"),
])
def test_real_kv_source_errors(args, exc, msg):
    with raises(exc, msg):
        kvc.RealKvSource(*args)


def test_real_kv_source_offset_keyword_and_limits():
    assert kvc.RealKvSource(U8, 1, 16, 16).offset_bytes == 0
    src = kvc.RealKvSource(U8, 1, 64, 16, offset_bytes=np.int64(48))   # the largest allowed
    assert src.offset_bytes == 48 and type(src.offset_bytes) is int
    assert "offset_bytes=48" in repr(src)
    # the row-width check still bounds every read: page_size * num_bytes_per_token fills the row
    assert kvc.RealKvSource(U8, 2, 32, 16, 16).offset_bytes == 16
    with raises(ValueError, "kv-canary: RealKvSource row is too narrow for its slot layout: a row is 64 "
                "bytes but page_size=2 x num_bytes_per_token=48 needs 96"):
        kvc.RealKvSource(U8, 2, 48, 16, 32)


def test_type_errors_are_also_value_errors():
    with pytest.raises(ValueError):
        kvc.RealKvSource(U8, 1.5, 16, 16)
    assert issubclass(KvCanaryTypeError, TypeError) and issubclass(KvCanaryTypeError, ValueError)


def test_real_kv_source_pytree_bypasses_checks():
    src = kvc.RealKvSource(U8, 4, 16, 16)
    leaves, tree = jax.tree_util.tree_flatten(src)
    again = jax.tree_util.tree_unflatten(tree, [object()])
    assert again.page_size == 4 and again.read_bytes == 16 and again.offset_bytes == 0


def test_real_kv_source_offset_is_static_aux():
    src = kvc.RealKvSource(U8, 1, 64, 16, offset_bytes=32)
    leaves, tree = jax.tree_util.tree_flatten(src)
    assert len(leaves) == 1 and leaves[0] is U8
    again = jax.tree_util.tree_unflatten(tree, leaves)
    assert (again.page_size, again.num_bytes_per_token, again.read_bytes, again.offset_bytes) == (1, 64, 16, 32)
    # a different offset is a different treedef (a different compile), the same offset the same one
    assert tree != jax.tree_util.tree_structure(kvc.RealKvSource(U8, 1, 64, 16, offset_bytes=16))
    assert tree == jax.tree_util.tree_structure(kvc.RealKvSource(U8, 1, 64, 16, offset_bytes=32))


# ---- shared blocks via write and verify ---------------------------------------------------------
SRC = kvc.RealKvSource(U8, 1, 16, 16)
BAD_LOGS = [
    (lambda: "log", TypeError, "kv-canary: log must be a ViolationLog, got str"),
    (lambda: kvc.ViolationLog(jnp.zeros((4, 64), jnp.int8), i32(0), jnp.zeros((12, 8), jnp.uint8),
                              jnp.zeros((12, 8), jnp.uint8), i32(1)),
     TypeError, "kv-canary: log.ring must have dtype uint8, got int8"),
    (lambda: kvc.ViolationLog(jnp.zeros((256,), jnp.uint8), i32(0), jnp.zeros((12, 8), jnp.uint8),
                              jnp.zeros((12, 8), jnp.uint8), i32(1)),
     ValueError, "kv-canary: log.ring must be 2-D, got shape (256,)"),
    (lambda: kvc.ViolationLog(jnp.zeros((4, 8), jnp.uint8), i32(0), jnp.zeros((12, 8), jnp.uint8),
                              jnp.zeros((12, 8), jnp.uint8), i32(1)),
     ValueError, "kv-canary: log.ring must have 64 bytes per row (8 little-endian int64), got shape (4, 8)"),
    (lambda: kvc.ViolationLog(jnp.zeros((0, 64), jnp.uint8), i32(0), jnp.zeros((12, 8), jnp.uint8),
                              jnp.zeros((12, 8), jnp.uint8), i32(1)),
     ValueError, "kv-canary: ViolationLog ring_capacity must be positive, got 0"),
    (lambda: kvc.ViolationLog(jnp.zeros((4, 64), jnp.uint8), jnp.zeros(1, jnp.uint32),
                              jnp.zeros((12, 8), jnp.uint8), jnp.zeros((12, 8), jnp.uint8), i32(1)),
     TypeError, "kv-canary: log.write_index must have dtype int32, got uint32"),
    (lambda: kvc.ViolationLog(jnp.zeros((4, 64), jnp.uint8), i32(0, 0), jnp.zeros((12, 8), jnp.uint8),
                              jnp.zeros((12, 8), jnp.uint8), i32(1)),
     ValueError, "kv-canary: log.write_index must have shape (1,), got (2,)"),
    (lambda: kvc.ViolationLog(jnp.zeros((4, 64), jnp.uint8), i32(0), jnp.zeros((12, 8), jnp.int32),
                              jnp.zeros((12, 8), jnp.uint8), i32(1)),
     TypeError, "kv-canary: log.kernel_run_counters must have dtype uint8, got int32"),
    (lambda: kvc.ViolationLog(jnp.zeros((4, 64), jnp.uint8), i32(0), jnp.zeros((12,), jnp.uint8),
                              jnp.zeros((12, 8), jnp.uint8), i32(1)),
     ValueError, "kv-canary: log.kernel_run_counters must have shape (num_tags, 8), got (12,)"),
    (lambda: kvc.ViolationLog(jnp.zeros((4, 64), jnp.uint8), i32(0), jnp.zeros((0, 8), jnp.uint8),
                              jnp.zeros((0, 8), jnp.uint8), i32(1)),
     ValueError, "kv-canary: ViolationLog num_tags must be positive, got 0"),
    (lambda: kvc.ViolationLog(jnp.zeros((4, 64), jnp.uint8), i32(0), jnp.zeros((12, 8), jnp.uint8),
                              jnp.zeros((11, 8), jnp.uint8), i32(1)),
     ValueError, "kv-canary: log.slot_run_counters must have shape (12, 8), got (11, 8)"),
    (lambda: kvc.ViolationLog(jnp.zeros((4, 64), jnp.uint8), i32(0), jnp.zeros((12, 8), jnp.uint8),
                              jnp.zeros((12, 8), jnp.int8), i32(1)),
     TypeError, "kv-canary: log.slot_run_counters must have dtype uint8, got int8"),
    (lambda: kvc.ViolationLog(jnp.zeros((4, 64), jnp.uint8), i32(0), jnp.zeros((12, 8), jnp.uint8),
                              jnp.zeros((12, 8), jnp.uint8), jnp.ones(1, jnp.float32)),
     TypeError, "kv-canary: log.enable_chain_position_assert must have dtype int32, got float32"),
    (lambda: kvc.ViolationLog(jnp.zeros((4, 64), jnp.uint8), i32(0), jnp.zeros((12, 8), jnp.uint8),
                              jnp.zeros((12, 8), jnp.uint8), jnp.ones((1, 1), jnp.int32)),
     ValueError, "kv-canary: log.enable_chain_position_assert must have shape (1,), got (1, 1)"),
]
BAD_CANARIES = [
    ("canary", TypeError, "kv-canary: canary must be a jax.Array, got str"),
    (jnp.zeros((8, 32), jnp.int8), TypeError, "kv-canary: canary must have dtype uint8, got int8"),
    (jnp.zeros((256,), jnp.uint8), ValueError, "kv-canary: canary must be 2-D, got shape (256,)"),
    (jnp.zeros((0, 32), jnp.uint8), ValueError, "kv-canary: canary must have at least 1 slot, got shape (0, 32)"),
    (jnp.zeros((8, 24), jnp.uint8), ValueError,
     "kv-canary: canary slot stride must hold at least 32 bytes per slot, got 24"),
    (jnp.zeros((8, 36), jnp.uint8), ValueError, "kv-canary: canary slot stride must be a multiple of 8 bytes, got 36"),
]
SHARED = [
    (dict(real_kv_sources=SRC), TypeError, "kv-canary: real_kv_sources must be a tuple of RealKvSource, got RealKvSource"),
    (dict(real_kv_sources=(SRC,) * 5, canary="not even an array"), ValueError,
     "kv-canary: at most 4 RealKvSource entries supported by the CUDA ABI, got 5"),
    (dict(real_kv_sources=(SRC, U8)), TypeError, "kv-canary: real_kv_sources[1] must be a RealKvSource, got ArrayImpl"),
    (dict(real_kv_hash_mode=3), ValueError, "kv-canary: real_kv_hash_mode must be 0 (NONE), 1 (PARTIAL) or 2 (ALL), got 3"),
    (dict(real_kv_hash_mode="ALL"), ValueError,
     "kv-canary: real_kv_hash_mode must be 0 (NONE), 1 (PARTIAL) or 2 (ALL), got 'ALL'"),
    (dict(impl="cuda"), ValueError, "kv-canary: impl must be 'ffi' or 'xla', got 'cuda'"),
    (dict(tag=1.0), TypeError, "kv-canary: tag must be an int or LaunchTag, got float"),
    (dict(tag=12), ValueError, "kv-canary: tag must be in [0, num_tags=12), got 12"),
    (dict(tag=-1), ValueError, "kv-canary: tag must be in [0, num_tags=12), got -1"),
] + [(dict(canary=c), e, m) for c, e, m in BAD_CANARIES] + [(dict(log=f), e, m) for f, e, m in BAD_LOGS]


@pytest.mark.parametrize("op", [write, verify])
@pytest.mark.parametrize("over, exc, msg", SHARED)
def test_shared_blocks(op, over, exc, msg):
    over = {k: (v() if callable(v) else v) for k, v in over.items()}
    with raises(exc, msg):
        op(**over)


def test_tag_checked_against_log_num_tags():
    with raises(ValueError, "kv-canary: tag must be in [0, num_tags=3), got 3"):
        write(log=good_log(4, 3), tag=kvc.LaunchTag.TAIL_V_FULL)


def test_impl_env(monkeypatch):
    monkeypatch.setenv("JAX_KVCANARY_IMPL", "gpu")
    with raises(ValueError, "kv-canary: JAX_KVCANARY_IMPL must be 'ffi' or 'xla', got 'gpu'"):
        write()


def test_impl_ffi_without_handler(monkeypatch):
    from jax_kvcanary import _ffi
    monkeypatch.setattr(_ffi, "NATIVE_PLATFORMS", frozenset())
    with raises(ValueError, "kv-canary: impl='ffi' has no native handler for platform 'cpu'; use impl='xla'"):
        write(impl="ffi")


# ---- write-specific (format.md §7.2 steps 5-12) ------------------------------------------------------
WRITE_CASES = [
    (dict(write_plan=good_vp()), TypeError, "kv-canary: write_plan must be a WritePlan, got VerifyPlan"),
    (dict(write_plan=kvc.WritePlan(i32(0, 0), [1], i32(1))), TypeError,
     "kv-canary: write_plan.seed_slot_indices must be a jax.Array, got list"),
    (dict(write_plan=kvc.WritePlan(i32(0, 0), jnp.zeros(1, jnp.uint32), i32(1))), TypeError,
     "kv-canary: write_plan.seed_slot_indices must have dtype int32 or int64, got uint32"),
    (dict(write_plan=kvc.WritePlan(i32(0, 0), jnp.zeros((1, 1), jnp.int32), i32(1))), ValueError,
     "kv-canary: write_plan.seed_slot_indices must be 1-D, got shape (1, 1)"),
    (dict(write_plan=kvc.WritePlan(i32(0), jnp.zeros(0, jnp.int32), i32(1))), ValueError,
     "kv-canary: WritePlan write_req_capacity must be positive, got 0"),
    (dict(write_plan=kvc.WritePlan(i32(0, 0), i32(-1, -1), i32(1))), ValueError,
     "kv-canary: write_plan.offsets length must be write_req_capacity + 1 = 3, got 2"),
    (dict(write_plan=kvc.WritePlan(jnp.zeros(3, jnp.float32), i32(-1, -1), i32(1))), TypeError,
     "kv-canary: write_plan.offsets must have dtype int32 or int64, got float32"),
    (dict(write_plan=kvc.WritePlan(i32(0, 0, 0), i32(-1, -1), jnp.ones(1, jnp.uint8))), TypeError,
     "kv-canary: write_plan.num_valid_reqs must have dtype int32, got uint8"),
    (dict(write_plan=kvc.WritePlan(i32(0, 0, 0), i32(-1, -1), i32(1, 1))), ValueError,
     "kv-canary: write_plan.num_valid_reqs must have shape (1,), got (2,)"),
    (dict(input_ids=np.zeros(3, np.float64)), TypeError, "kv-canary: input_ids must have dtype int32 or int64, got float64"),
    (dict(input_ids=(1, 2, 3)), TypeError, "kv-canary: input_ids must be a jax.Array, got tuple"),
    (dict(positions=jnp.zeros(2, jnp.int32)), ValueError, "kv-canary: positions length must be 3, got 2"),
    (dict(out_cache_loc=jnp.zeros((3, 1), jnp.int32)), ValueError, "kv-canary: out_cache_loc must be 1-D, got shape (3, 1)"),
    (dict(enable_write_input_assert=2), TypeError, "kv-canary: enable_write_input_assert must be a static bool, got int"),
    (dict(enable_write_input_assert="yes"), TypeError,
     "kv-canary: enable_write_input_assert must be a static bool, got str"),
    (dict(enable_write_input_assert=True), ValueError,
     "kv-canary: expected input tensors are required when enable_write_input_assert=True"),
    (dict(enable_write_input_assert=True, expected_input_tokens=TOK), ValueError,
     "kv-canary: expected input tensors are required when enable_write_input_assert=True"),
    (dict(expected_input_positions=TOK), ValueError,
     "kv-canary: expected input tensors must be None when enable_write_input_assert=False"),
    (dict(enable_write_input_assert=True, expected_input_tokens=jnp.zeros(2, jnp.int32),
          expected_input_positions=TOK), ValueError, "kv-canary: expected_input_tokens length must be 3, got 2"),
    (dict(enable_write_input_assert=True, expected_input_tokens=TOK,
          expected_input_positions=jnp.zeros(3, jnp.int16)), TypeError,
     "kv-canary: expected_input_positions must have dtype int32 or int64, got int16"),
]


@pytest.mark.parametrize("over, exc, msg", WRITE_CASES)
def test_write_errors(over, exc, msg):
    with raises(exc, msg):
        write(**over)


def test_write_input_assert_pair_errors_exact_upstream_text():
    with pytest.raises(ValueError) as e:
        write(enable_write_input_assert=True, expected_input_positions=TOK)
    assert str(e.value) == "kv-canary: expected input tensors are required when enable_write_input_assert=True"


# ---- verify-specific (format.md §8.2 steps 5-9) ------------------------------------------------------
def vp(**over):
    p = good_vp()
    for k, v in over.items():
        setattr(p, k, v)
    return p


VERIFY_CASES = [
    (dict(verify_plan=good_wp()), TypeError, "kv-canary: verify_plan must be a VerifyPlan, got WritePlan"),
    (dict(verify_plan=vp(slot_indices=jnp.zeros(0, jnp.int32))), ValueError,
     "kv-canary: VerifyPlan verify_capacity must be positive, got 0"),
    (dict(verify_plan=vp(slot_indices=jnp.zeros(3, jnp.uint8))), TypeError,
     "kv-canary: verify_plan.slot_indices must have dtype int32 or int64, got uint8"),
    (dict(verify_plan=vp(expected_tokens=jnp.zeros(2, jnp.int32))), ValueError,
     "kv-canary: verify_plan.expected_tokens length must be 3, got 2"),
    (dict(verify_plan=vp(expected_positions=None)), TypeError,
     "kv-canary: verify_plan.expected_positions must be a jax.Array, got NoneType"),
    (dict(verify_plan=vp(prev_slot_indices=jnp.zeros((3, 1), jnp.int32))), ValueError,
     "kv-canary: verify_plan.prev_slot_indices must be 1-D, got shape (3, 1)"),
    (dict(verify_plan=vp(num_valid=jnp.ones(1, jnp.uint32))), TypeError,
     "kv-canary: verify_plan.num_valid must have dtype int32, got uint32"),
    (dict(verify_plan=vp(enable=jnp.ones((), jnp.int32))), ValueError,
     "kv-canary: verify_plan.enable must have shape (1,), got ()"),
    (dict(check_verify_expected_token=None), TypeError,
     "kv-canary: check_verify_expected_token must be a static bool, got NoneType"),
    (dict(check_verify_expected_token=True, verify_plan=vp(has_expected_tokens=False)), ValueError,
     "kv-canary: check_verify_expected_token=True needs a verify plan with expected tokens; this "
     "one was planned without req_to_verify_expected_tokens (every expected token is -1, nothing "
     "would be checked)"),
]


def test_option_pairs_that_would_check_nothing_are_refused():
    """A real-KV mode without sources, and the token check on a plan made without a token pool."""
    for mode in ("PARTIAL", "ALL"):
        with raises(ValueError, f"kv-canary: real_kv_hash_mode={mode} needs at least one "
                                "RealKvSource in real_kv_sources, got none (nothing would be "
                                "fingerprinted); pass the KV arrays or real_kv_hash_mode=NONE"):
            verify(real_kv_hash_mode=getattr(kvc.RealKvHashMode, mode))
        with pytest.raises(ValueError, match=f"^kv-canary: real_kv_hash_mode={mode} needs"):
            write(real_kv_hash_mode=getattr(kvc.RealKvHashMode, mode))
    rp = jnp.array([1], jnp.int32)
    table = jnp.arange(8, dtype=jnp.int32).reshape(2, 4)
    no_pool, _ = kvc.plan(rp, rp, rp, table, verify_capacity=4, write_req_capacity=1)
    pool, _ = kvc.plan(rp, rp, rp, table, verify_capacity=4, write_req_capacity=1,
                       req_to_verify_expected_tokens=table, req_to_verify_expected_tokens_valid_lens=rp)
    assert not no_pool.has_expected_tokens and pool.has_expected_tokens
    with pytest.raises(ValueError, match="^kv-canary: check_verify_expected_token=True needs a "):
        verify(verify_plan=no_pool, check_verify_expected_token=True)
    assert jax.jit(lambda: kvc.plan(rp, rp, rp, table, verify_capacity=4,
                                    write_req_capacity=1)[0])().has_expected_tokens is False


@pytest.mark.parametrize("over, exc, msg", VERIFY_CASES)
def test_verify_errors(over, exc, msg):
    with raises(exc, msg):
        verify(**over)


def test_traced_flag_is_rejected_inside_jit():
    @jax.jit
    def step(flag):
        return verify(check_verify_expected_token=flag).write_index

    with pytest.raises(TypeError, match="check_verify_expected_token must be a static bool"):
        step(True)


def test_errors_raise_while_tracing_before_any_native_call():
    called = []

    @jax.jit
    def step(canary, log):
        called.append(1)
        return kvc.write(canary, log, good_wp(), TOK, TOK, TOK[:2], tag=0)

    with raises(ValueError, "kv-canary: out_cache_loc length must be 3, got 2"):
        step(CANARY, good_log())
    assert called == [1]  # traced once, failed during tracing


# ---- plan (format.md §9.4) ---------------------------------------------------------------------------
PLAN_CASES = [
    (dict(swa_window_size=1.0), TypeError, "kv-canary: swa_window_size must be an int, got float"),
    (dict(swa_window_size=-1), ValueError, "kv-canary: swa_window_size must be >= 0, got -1"),
    (dict(swa_window_size=4, impl="bogus"), ValueError,
     "kv-canary: launch_canary_plan_kernels requires full_to_swa_index_mapping when swa_window_size > 0"),
    (dict(impl="bogus", verify_capacity=0), ValueError, "kv-canary: impl must be 'ffi' or 'xla', got 'bogus'"),
    (dict(verify_capacity="8"), TypeError, "kv-canary: verify_capacity must be an int, got str"),
    (dict(verify_capacity=0), ValueError, "kv-canary: VerifyPlan verify_capacity must be positive, got 0"),
    (dict(verify_capacity=2**31), ValueError, "kv-canary: verify_capacity must be < 2**31, got 2147483648"),
    (dict(write_req_capacity=None), TypeError, "kv-canary: write_req_capacity must be an int, got NoneType"),
    (dict(write_req_capacity=-2), ValueError, "kv-canary: WritePlan write_req_capacity must be positive, got -2"),
    (dict(write_req_capacity=2**40), ValueError, "kv-canary: write_req_capacity must be < 2**31, got 1099511627776"),
    (dict(kv_token_id_vs_position_offset=0.5), TypeError,
     "kv-canary: kv_token_id_vs_position_offset must be an int, got float"),
    (dict(kv_token_id_vs_position_offset=2**31), ValueError,
     "kv-canary: kv_token_id_vs_position_offset must fit in int32, got 2147483648"),
    (dict(req_pool_indices=jnp.zeros((2, 1), jnp.int32)), ValueError,
     "kv-canary: req_pool_indices must be 1-D, got shape (2, 1)"),
    (dict(prefix_lens=i32(1, 2, 3)), ValueError, "kv-canary: prefix_lens length must be 2, got 3"),
    (dict(extend_seq_lens=jnp.zeros(2, jnp.float32)), TypeError,
     "kv-canary: extend_seq_lens must have dtype int32 or int64, got float32"),
    (dict(write_req_capacity=1), ValueError, "kv-canary: bs=2 exceeds write_req_capacity=1"),
    (dict(req_to_token=jnp.zeros((4, 16), jnp.uint32)), TypeError,
     "kv-canary: req_to_token must have dtype int32 or int64, got uint32"),
    (dict(req_to_token=jnp.zeros(16, jnp.int32)), ValueError, "kv-canary: req_to_token must be 2-D, got shape (16,)"),
    (dict(row_starts=i32(0, 16)), ValueError,
     "kv-canary: req_to_token must be 1-D when row_starts is given, got shape (4, 16)"),
    (dict(row_starts=i32(0), req_to_token=jnp.zeros(64, jnp.int32)), ValueError,
     "kv-canary: row_starts length must be 2, got 1"),
    (dict(row_starts=[0, 16], req_to_token=jnp.zeros(64, jnp.int32)), TypeError,
     "kv-canary: row_starts must be a jax.Array, got list"),
    (dict(row_starts=jnp.zeros(2, jnp.uint32), req_to_token=jnp.zeros(64, jnp.int32)), TypeError,
     "kv-canary: row_starts must have dtype int32 or int64, got uint32"),
    (dict(row_starts=jnp.zeros((2, 1), jnp.int32), req_to_token=jnp.zeros(64, jnp.int32)), ValueError,
     "kv-canary: row_starts must be 1-D, got shape (2, 1)"),
    (dict(row_starts=i32(0), req_to_token=jnp.zeros((4, 16), jnp.int32)), ValueError,  # row_starts first
     "kv-canary: row_starts length must be 2, got 1"),
    (dict(row_starts=i32(0, 16), req_to_token=jnp.zeros(64, jnp.float32)), TypeError,
     "kv-canary: req_to_token must have dtype int32 or int64, got float32"),
    (dict(row_starts=i32(0, 16), req_to_token=None), TypeError,
     "kv-canary: req_to_token must be a jax.Array, got NoneType"),
    (dict(row_starts=i32(0, 16), req_to_token=jnp.zeros((1, 4, 16), jnp.int32)), ValueError,
     "kv-canary: req_to_token must be 1-D when row_starts is given, got shape (1, 4, 16)"),
    (dict(row_starts=i32(0, 16), req_to_token=jnp.zeros(64, jnp.int32), write_req_capacity=1), ValueError,
     "kv-canary: bs=2 exceeds write_req_capacity=1"),  # step 8 before step 9
    (dict(row_starts=i32(0, 16), req_to_token=jnp.zeros(64, jnp.int32),
          full_to_swa_index_mapping=jnp.zeros(0, jnp.int32)), ValueError,
     "kv-canary: full_to_swa_index_mapping length must be >= 1, got 0"),  # step 10 after step 9
    (dict(full_to_swa_index_mapping=jnp.zeros(0, jnp.int32)), ValueError,
     "kv-canary: full_to_swa_index_mapping length must be >= 1, got 0"),
    (dict(full_to_swa_index_mapping=jnp.zeros((2, 2), jnp.int32)), ValueError,
     "kv-canary: full_to_swa_index_mapping must be 1-D, got shape (2, 2)"),
    (dict(req_to_verify_expected_tokens=jnp.zeros((4, 16), jnp.int32)), ValueError,
     "kv-canary: launch_canary_plan_kernels requires req_to_verify_expected_tokens_valid_lens when "
     "req_to_verify_expected_tokens is set"),
    (dict(req_to_verify_expected_tokens_valid_lens=i32(1, 1)), ValueError,
     "kv-canary: req_to_verify_expected_tokens_valid_lens must be None when req_to_verify_expected_tokens is None"),
    (dict(req_to_verify_expected_tokens=jnp.zeros(16, jnp.int32), req_to_verify_expected_tokens_valid_lens=i32(1, 1)),
     ValueError, "kv-canary: req_to_verify_expected_tokens must be 2-D, got shape (16,)"),
    (dict(req_to_verify_expected_tokens=jnp.zeros((4, 4), jnp.int32), req_to_verify_expected_tokens_valid_lens=i32(1)),
     ValueError, "kv-canary: req_to_verify_expected_tokens_valid_lens length must be 2, got 1"),
]


@pytest.mark.parametrize("over, exc, msg", PLAN_CASES)
def test_plan_errors(over, exc, msg):
    with raises(exc, msg):
        plan(**over)


def test_plan_allows_empty_batch_and_zero_sized_table():
    vplan, wplan = plan(req_pool_indices=i32(), prefix_lens=i32(), extend_seq_lens=i32(),
                        req_to_token=jnp.zeros((0, 0), jnp.int32))
    assert int(vplan.num_valid[0]) == 0 and int(wplan.num_valid_reqs[0]) == 0


def test_plan_row_starts_allows_empty_batch_and_empty_table():
    vplan, wplan = plan(req_pool_indices=i32(), prefix_lens=i32(), extend_seq_lens=i32(),
                        req_to_token=jnp.zeros(0, jnp.int32), row_starts=i32())
    assert int(vplan.num_valid[0]) == 0 and int(wplan.num_valid_reqs[0]) == 0
    vplan, wplan = plan(req_to_token=jnp.zeros(0, jnp.int32), row_starts=i32(5, -7))
    assert np.asarray(vplan.slot_indices)[:1].tolist() == [-1] and np.asarray(wplan.seed_slot_indices).tolist() == [
        -1, -1, 0, 0]


# ---- scatter (format.md §9.5) ------------------------------------------------------------------------
POOL = jnp.zeros((4, 8), jnp.int32)
SCATTER_CASES = [
    ((None, i32(1), i32(0, 1), i32(1)), TypeError,
     "kv-canary: scatter_req_token_ids pool must be a jax.Array, got NoneType"),
    ((POOL, [1], i32(0, 1), i32(1)), TypeError, "kv-canary: scatter_req_token_ids flat_ids must be a jax.Array, got list"),
    ((POOL[0], i32(1), i32(0, 1), i32(1)), ValueError,
     "kv-canary: scatter_req_token_ids pool must be 2-D, got shape (8,)"),
    ((POOL, i32(1), jnp.zeros((2, 1), jnp.int32), i32(1)), ValueError,
     "kv-canary: scatter_req_token_ids offsets must be 1-D, got shape (2, 1)"),
    ((POOL, i32(1), i32(0, 1), jnp.zeros(1, jnp.uint32)), TypeError,
     "kv-canary: scatter_req_token_ids req_pool_indices must be int32 or int64, got uint32"),
    ((POOL.astype(jnp.float32), i32(1), i32(0, 1), i32(1)), TypeError,
     "kv-canary: scatter_req_token_ids pool must be int32 or int64, got float32"),
    ((POOL, i32(1), i32(0, 1, 2), i32(1)), ValueError,
     "kv-canary: scatter_req_token_ids offsets length 3 != bs+1 (2)"),
    ((POOL, i32(1), i32(0, 1), i32(1)), "impl", "kv-canary: impl must be 'ffi' or 'xla', got 'x'"),
]


@pytest.mark.parametrize("args, exc, msg", SCATTER_CASES)
def test_scatter_errors(args, exc, msg):
    kwargs = {}
    if exc == "impl":
        exc, kwargs = ValueError, dict(impl="x")
    with raises(exc, msg):
        kvc.scatter_req_token_ids(*args, **kwargs)


# ---- state constructors -------------------------------------------------------------------------
def test_state_constructor_errors():
    with raises(ValueError, "kv-canary: ViolationLog ring_capacity must be positive, got 0"):
        kvc.ViolationLog.create(0)
    with raises(ValueError, "kv-canary: ViolationLog num_tags must be positive, got 0"):
        kvc.ViolationLog.create(4, 0)
    with raises(ValueError, "kv-canary: canary slot stride must be a multiple of 8 bytes, got 36"):
        kvc.new_canary_buffer(4, 36)
    with raises(TypeError, "kv-canary: num_slots must be an int, got float 2.5"):
        kvc.new_canary_buffer(2.5)
    with raises(TypeError, "kv-canary: slot_stride_bytes must be an int, got bool"):
        kvc.new_canary_buffer(4, True)
    with raises(TypeError, "kv-canary: ViolationLog ring_capacity must be an int, got float 2.5"):
        kvc.ViolationLog.create(2.5)
    with raises(TypeError, "kv-canary: ViolationLog num_tags must be an int, got str '12'"):
        kvc.ViolationLog.create(4, "12")
    assert kvc.new_canary_buffer(np.int64(4)).shape == (4, 32)      # numpy ints are ints
