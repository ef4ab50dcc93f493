"""The native targets called directly through ``jax.ffi.ffi_call``, past the Python checks (as
exported HLO or another library would): every bad attribute or shape is refused by the handler
with an ``InvalidArgument`` error and a ``kv-canary: <target>: ...`` message, never a fault."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvcanary import _ffi, consts

pytestmark = pytest.mark.skipif("cpu" not in _ffi.NATIVE_PLATFORMS,
                                reason="the native CPU module is not built")

TAGS = consts.NUM_LAUNCH_TAGS


def i32(*shape):
    return jnp.zeros(shape, jnp.int32)


def u8(*shape):
    return jnp.zeros(shape, jnp.uint8)


def sds(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def geometry_attrs(mode=0, geometry=()):
    """The real-KV attributes: ``mode`` and four rows of (page_size, bytes_per_token, read_bytes,
    offset_bytes), one per source, zero-padded."""
    g = np.zeros((consts.MAX_REAL_KV_SOURCES, 4), np.int64)
    if len(geometry):
        g[:len(geometry)] = geometry
    return dict(mode=np.int32(mode), page_size=g[:, 0], bytes_per_token=g[:, 1], read_bytes=g[:, 2],
                offset_bytes=g[:, 3])


def log_buffers(ring=(16, 64), tags=TAGS, slot_tags=None):
    return [u8(*ring), i32(1), u8(tags, 8), u8(TAGS if slot_tags is None else slot_tags, 8)]


def verify(canary=(64, 32), ring=(16, 64), tags=TAGS, slots=i32(4), tokens=i32(4), positions=i32(4),
           prevs=i32(4), num_valid=i32(1), enable=i32(1), sources=(), tag=0, mode=0, geometry=(), attrs=None):
    """``attrs``: the call's attributes as given, instead of those of ``tag``, ``mode`` and ``geometry``."""
    if attrs is None:
        attrs = dict(tag=np.int64(tag), check_token=np.bool_(False), **geometry_attrs(mode, geometry))
    log = log_buffers(ring, tags, tags)
    call = jax.ffi.ffi_call(_ffi.VERIFY_TARGET, tuple(map(sds, log)) + (sds(u8(0)),),
                            input_output_aliases={1: 0, 2: 1, 3: 2, 4: 3})
    return call(u8(*canary), *log, slots, tokens, positions, prevs, num_valid, enable, *sources, **attrs)


def write(canary=(64, 32), ring=(16, 64), chain=i32(1), offsets=i32(3), seeds=i32(2), valid=i32(1),
          ids=i32(5), positions=i32(5), locs=i32(5), exp_tokens=i32(0), exp_positions=i32(0),
          sources=(), tag=0, input_assert=False, mode=0, geometry=()):
    log = log_buffers(ring)
    c = u8(*canary)
    call = jax.ffi.ffi_call(_ffi.WRITE_TARGET, (sds(c),) + tuple(map(sds, log)) + (sds(u8(0)),),
                            input_output_aliases={0: 0, 1: 1, 2: 2, 3: 3, 4: 4})
    return call(c, *log, chain, offsets, seeds, valid, ids, positions, locs, exp_tokens,
                exp_positions, *sources, tag=np.int64(tag), input_assert=np.bool_(input_assert),
                **geometry_attrs(mode, geometry))


def plan(rpi=i32(2), prefix=i32(2), extend=i32(2), r2t=i32(4, 8), lut=i32(0), pool=i32(0, 0),
         valid_lens=i32(0), row_starts=i32(0), vcap=8, wcap=2, offsets_len=None, window=0,
         token_offset=0, has_lut=False, has_pool=False, has_row_starts=False, report_evicted=False, attrs=None):
    if attrs is None:
        attrs = dict(window=np.int64(window), token_offset=np.int64(token_offset), has_lut=np.bool_(has_lut),
                     has_pool=np.bool_(has_pool), has_row_starts=np.bool_(has_row_starts),
                     report_evicted=np.bool_(report_evicted))
    outs = (sds(i32(vcap)),) * 4 + (sds(i32(1)),) * 2 + (
        sds(i32(wcap + 1 if offsets_len is None else offsets_len)), sds(i32(wcap)), sds(i32(1)),
        sds(u8(0)))
    call = jax.ffi.ffi_call(_ffi.PLAN_TARGET, outs)
    return call(rpi, prefix, extend, r2t, lut, pool, valid_lens, row_starts, **attrs)


def scatter(pool=i32(4, 8), flat=i32(6), offsets=i32(3), rpi=i32(2)):
    call = jax.ffi.ffi_call(_ffi.SCATTER_TARGET, sds(pool), input_output_aliases={0: 0})
    return call(pool, flat, offsets, rpi)


OPS = {"verify": verify, "write": write, "plan": plan, "scatter": scatter}

K_ROWS = jnp.zeros((64, 64), jnp.uint8)           # a real-KV source: 64 rows of 64 bytes

BAD = [
    ("verify", dict(tag=10**6), "kvcanary_verify: tag must be in [0, 12), got 1000000"),
    ("verify", dict(tag=-1), "kvcanary_verify: tag must be in [0, 12), got -1"),
    ("verify", dict(canary=(64, 24)),
     "kvcanary_verify: canary slot stride must be a multiple of 8 bytes and at least 32, got 24"),
    ("verify", dict(canary=(64, 36)), "canary slot stride must be a multiple of 8 bytes"),
    ("verify", dict(canary=(0, 32)), "kvcanary_verify: canary must have at least 1 slot, got 0"),
    ("verify", dict(ring=(16, 32)), "kvcanary_verify: log.ring must be [capacity >= 1, 64] bytes, got [16, 32]"),
    ("verify", dict(tags=3, tag=2, ring=(16, 64)), None),          # fewer tags, tag inside: fine
    ("verify", dict(tags=3, tag=5), "kvcanary_verify: tag must be in [0, 3), got 5"),
    ("verify", dict(slots=jnp.zeros(4, jnp.float32)),
     "kvcanary_verify: slot_indices must have dtype int32 or int64"),
    ("verify", dict(slots=jnp.zeros(4, jnp.int16)), "slot_indices must have dtype int32 or int64"),
    ("verify", dict(slots=i32(0), tokens=i32(0), positions=i32(0), prevs=i32(0)),
     "kvcanary_verify: verify capacity must be positive, got 0"),
    ("verify", dict(tokens=i32(3)), "kvcanary_verify: expected_tokens length must be 4, got 3"),
    ("verify", dict(prevs=i32(4, 1)), "kvcanary_verify: prev_slot_indices must be 1-D, got rank 2"),
    ("verify", dict(num_valid=i32(2)), "kvcanary_verify: num_valid must hold 1 element(s), got 2"),
    ("verify", dict(mode=5), "kvcanary_verify: mode must be 0 (NONE), 1 (PARTIAL) or 2 (ALL), got 5"),
    ("verify", dict(sources=(K_ROWS,) * 5, mode=1, geometry=[(1, 64, 16, 0)] * 4),
     "kvcanary_verify: at most 4 real-KV sources, got 5"),
    ("verify", dict(sources=(K_ROWS,), mode=2, geometry=[(1, 64, 64, 0)]), None),
    ("verify", dict(sources=(K_ROWS,), mode=2, geometry=[(1, 128, 128, 0)]),
     "kvcanary_verify: real-KV source 0 geometry (page_size 1, bytes_per_token 128, read 128 bytes "
     "at offset 0) does not fit its rows of 64 bytes"),
    ("verify", dict(sources=(K_ROWS,), mode=1, geometry=[(2, 64, 16, 0)]), "does not fit its rows"),
    ("verify", dict(sources=(K_ROWS,), mode=1, geometry=[(1, 64, 16, 56)]), "does not fit its rows"),
    ("verify", dict(sources=(K_ROWS,), mode=2, geometry=[(1, 64, 24, 0)]), "does not fit its rows"),
    ("write", dict(tag=10**6), "kvcanary_write: tag must be in [0, 12), got 1000000"),
    ("write", dict(canary=(64, 16)), "kvcanary_write: canary slot stride must be"),
    ("write", dict(offsets=i32(2)), "kvcanary_write: offsets length must be 3, got 2"),
    ("write", dict(chain=i32(0)), "kvcanary_write: enable_chain_position_assert must hold 1 element(s), got 0"),
    ("write", dict(positions=i32(4)), "kvcanary_write: positions length must be 5, got 4"),
    ("write", dict(locs=jnp.zeros(5, jnp.uint32)), "kvcanary_write: out_cache_loc must have dtype int32 or int64"),
    ("write", dict(input_assert=True),
     "kvcanary_write: expected_input_tokens length must be 5, got 0"),
    ("write", dict(input_assert=True, exp_tokens=i32(5), exp_positions=i32(5)), None),
    ("write", dict(sources=(K_ROWS,), mode=1, geometry=[(1, 0, 16, 0)]),
     "kvcanary_write: real-KV source 0 geometry"),
    ("plan", dict(prefix=i32(3)), "kvcanary_plan: prefix_lens length must be 2, got 3"),
    ("plan", dict(r2t=i32(32)), "kvcanary_plan: req_to_token must be 2-D, got rank 1"),
    ("plan", dict(has_row_starts=True), "kvcanary_plan: req_to_token (a flat table with row_starts) must be 1-D"),
    ("plan", dict(has_row_starts=True, r2t=i32(32), row_starts=i32(1)),
     "kvcanary_plan: row_starts length must be 2, got 1"),
    ("plan", dict(has_row_starts=True, r2t=i32(32), row_starts=i32(2)), None),
    ("plan", dict(wcap=1), "kvcanary_plan: bs=2 exceeds the write request results' 1"),
    ("plan", dict(offsets_len=2), "kvcanary_plan: the offsets result must hold 3 entries, got 2"),
    ("plan", dict(has_pool=True), "kvcanary_plan: req_to_verify_expected_tokens_valid_lens length must be 2"),
    ("plan", dict(has_pool=True, pool=i32(8), valid_lens=i32(2)),
     "kvcanary_plan: req_to_verify_expected_tokens must be 2-D, got rank 1"),
    ("plan", dict(has_lut=True), "kvcanary_plan: full_to_swa_index_mapping length must be >= 1, got 0"),
    ("plan", dict(window=4), "kvcanary_plan: a window > 0 needs full_to_swa_index_mapping (has_lut)"),
    ("plan", dict(window=-1), "kvcanary_plan: window must be >= 0, got -1"),
    ("plan", dict(report_evicted=True), "kvcanary_plan: report_evicted needs full_to_swa_index_mapping (has_lut)"),
    ("plan", dict(token_offset=2**40), "kvcanary_plan: token_offset must fit in int32"),
    ("plan", dict(rpi=jnp.zeros(2, jnp.float32)), "kvcanary_plan: req_pool_indices must have dtype int32 or int64"),
    ("scatter", dict(offsets=i32(2)), "kvcanary_scatter: offsets length must be 3, got 2"),
    ("scatter", dict(pool=i32(32)), "kvcanary_scatter: pool must be 2-D, got rank 1"),
    ("scatter", dict(flat=jnp.zeros(6, jnp.float32)), "kvcanary_scatter: flat_ids must have dtype int32 or int64"),
]


def test_log_results_of_another_shape_than_their_inputs_are_refused():
    """Without input_output_aliases a caller chooses the result shapes; the launcher writes the results,
    so a counter result smaller than the input counters the tag was checked against is refused."""
    log = log_buffers()
    results = (sds(log[0]), sds(log[1]), sds(u8(2, 8)), sds(log[3]))
    call = jax.ffi.ffi_call(_ffi.VERIFY_TARGET, results)
    with pytest.raises(Exception, match=re.escape(
            "kv-canary: kvcanary_verify: the canary and log results must have the shapes of the inputs they alias")):
        jax.block_until_ready(call(u8(64, 32), *log, i32(4), i32(4), i32(4), i32(4), i32(1), i32(1),
                                   tag=np.int64(5), check_token=np.bool_(False), **geometry_attrs()))


@pytest.mark.parametrize("op", sorted(OPS))
def test_good_arguments_run(op):
    jax.block_until_ready(OPS[op]())


@pytest.mark.parametrize("op, kw, message", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_arguments_are_refused_by_the_handler(op, kw, message):
    if message is None:                                   # a variant that must still run
        jax.block_until_ready(OPS[op](**kw))
        return
    with pytest.raises(Exception, match=re.escape("kv-canary: " if message.startswith("kvcanary_")
                                                  else "") + re.escape(message)):
        jax.block_until_ready(OPS[op](**kw))


def _good_verify_attrs():
    return dict(tag=np.int64(0), check_token=np.bool_(False), **geometry_attrs())


BAD_ATTRS = [
    ("missing", lambda a: a.pop("check_token"), "Wrong number of attributes: expected 7 attributes but got 6"),
    ("extra", lambda a: a.update(extra=np.int64(1)), "Wrong number of attributes: expected 7 attributes but got 8"),
    ("renamed", lambda a: a.update(tagg=a.pop("tag")), "Attribute name mismatch: tagg vs tag"),
    # (a value other than the good call's: jax's cache takes np.int32(0) for the np.int64(0) it saw)
    ("wrong_dtype", lambda a: a.update(tag=np.int32(1)), "Wrong scalar data type: expected S64 but got S32"),
    ("scalar_for_array", lambda a: a.update(page_size=np.int64(1)), "Wrong attribute type"),
]


@pytest.mark.parametrize("change, message", [b[1:] for b in BAD_ATTRS], ids=[b[0] for b in BAD_ATTRS])
def test_attributes_of_another_name_count_or_type_are_refused(change, message):
    """The attributes decode by their sorted positions (csrc/ffi_attrs.h): a missing,
    extra, renamed or mistyped one is an error naming it, never a value read from another attribute."""
    attrs = _good_verify_attrs()
    jax.block_until_ready(verify(attrs=attrs))
    change(attrs)
    with pytest.raises(Exception, match=re.escape(message)):
        jax.block_until_ready(verify(attrs=attrs))


def test_plan_attributes_of_the_wrong_type_are_refused():
    # (2, not 0 or 1: jax's cache takes np.int64(1) for the np.bool_(True) another case passed)
    attrs = dict(window=np.int64(0), token_offset=np.int64(0), has_lut=np.int64(2), has_pool=np.bool_(False),
                 has_row_starts=np.bool_(False), report_evicted=np.bool_(False))
    with pytest.raises(Exception, match=re.escape("Wrong scalar data type: expected PRED but got S64")):
        jax.block_until_ready(plan(attrs=attrs))
