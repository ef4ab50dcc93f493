"""check_host_copy (format.md §14.2): every backend byte-identical to the numpy reference on
adversarial cases, a clean host copy of device-written records is silent, a flipped host byte is
reported with the device slot and position, and the trace-time errors."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_kvcanary as kvc
from jax_kvcanary import hashing
from jax_kvcanary.consts import HostCheckTag, RealKvHashMode
from jax_kvcanary.runtime import hostcheck as H
from jax_kvcanary.runtime.offload import export_records
from tests.support import runtime_reference
from tests.support.impls import COMPARED_IMPLS


def _case(seed, mode, offsets=False):
    """Two host sources (float32 pages of 4 slots x 64 B; bfloat16 pages, fewer rows), records with
    correct fingerprints except a few, slots with padding, out-of-range, repeated and slot 0. With
    ``offsets`` the strips start inside the slots (offset_bytes 32 and 16, the largest allowed)."""
    rng = np.random.default_rng(seed)
    kv = H.aligned_host_array((8, 4, 16), np.float32)
    kv[:] = rng.standard_normal(kv.shape)
    kv2 = rng.standard_normal((6, 4, 32)).astype(ml_dtypes.bfloat16)
    if offsets:
        srcs = (kvc.RealKvSource(kv, 4, 64, 32, offset_bytes=32), kvc.RealKvSource(kv2, 4, 64, 48, offset_bytes=16))
    else:
        srcs = (kvc.RealKvSource(kv, 4, 64, 64), kvc.RealKvSource(kv2, 4, 64, 32))
    n = 24
    slots = rng.integers(-2, 35, n)
    slots[[3, 4, 5]] = [0, 7, 7]
    good = hashing.to_i64(hashing.slot_real_kv_hash(srcs, np.clip(slots, 0, 23), mode))
    rec = np.stack([rng.integers(0, 1000, n), rng.integers(0, 1 << 40, n), rng.integers(-9, 9, n), good], 1)
    rec[[0, 3, 4, 9], 3] ^= 1 << (seed % 64)
    return srcs, rec.astype(np.int64).view(np.uint8).reshape(n, 32), slots.astype(np.int32)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", [RealKvHashMode.PARTIAL, RealKvHashMode.ALL])
@pytest.mark.parametrize("offsets", [False, True], ids=["offset0", "offsets"])
def test_every_backend_matches_the_reference(seed, mode, offsets):
    srcs, records, slots = _case(seed, mode, offsets)
    names = slots + 1000
    want = runtime_reference.host_check(srcs, records, slots, real_kv_hash_mode=mode, tag=13, report_slots=names)
    assert len(want) and set(want[:, 7]) <= {4, 64}
    for impl in COMPARED_IMPLS:
        got = H.check_host_copy(srcs, records, slots, real_kv_hash_mode=mode, tag=13,
                                report_slots=names, impl=impl)
        assert np.array_equal(got.rows, want), impl
        assert got.checked == int(np.sum((slots >= 0) & (slots < 24)))


def _device_round(mode=RealKvHashMode.ALL):
    """A TAIL_K_FULL write of 6 tokens into slots 9..14 of a paged device KV (pages of 4)."""
    kv = jnp.asarray(np.random.default_rng(7).standard_normal((5, 4, 2, 8)).astype(np.float32))
    src = kvc.RealKvSource(kv, 4, 64, 64)
    slots = jnp.arange(9, 15, dtype=jnp.int32)
    wp = kvc.WritePlan(jnp.asarray([0, 6], jnp.int32), jnp.asarray([-1], jnp.int32), jnp.asarray([1], jnp.int32))
    canary, log = kvc.write(kvc.new_canary_buffer(20), kvc.ViolationLog.create(), wp,
                            jnp.arange(100, 106, dtype=jnp.int32), jnp.arange(6, dtype=jnp.int32), slots,
                            tag=kvc.LaunchTag.TAIL_K_FULL, real_kv_sources=(src,), real_kv_hash_mode=mode)
    assert log.total() == 0
    records, _ = export_records(canary, slots)
    # the host tier: host slots 2..7 of a pinned pool (pages of 2), copied slot by slot
    host = H.aligned_host_array((6, 2, 2, 8), np.float32)
    host_slots = np.arange(2, 8, dtype=np.int32)
    flat = host.reshape(12, 2, 8)
    flat[host_slots] = np.asarray(kv).reshape(20, 2, 8)[np.asarray(slots)]
    return host, host_slots, np.asarray(records), np.asarray(slots)


def test_clean_host_copy_is_silent_and_a_flipped_byte_names_the_device_slot():
    host, host_slots, records, dev_slots = _device_round()
    src = kvc.RealKvSource(host, 2, 64, 64)
    res = H.check_host_copy(src, records, host_slots, real_kv_hash_mode=RealKvHashMode.ALL,
                            tag=HostCheckTag.HOST_BACKUP_K_FULL, report_slots=dev_slots)
    assert res.ok and res.checked == 6
    host.view(np.uint8).reshape(6, -1)[2, 64 + 17] ^= 0x10      # host slot 5 = position 3, byte 17
    res = H.check_host_copy(src, records, host_slots, real_kv_hash_mode=RealKvHashMode.ALL,
                            tag=HostCheckTag.HOST_BACKUP_K_FULL, report_slots=dev_slots)
    (v,) = res.violations()
    assert (v.tag, v.reasons, v.slot, v.position, v.stored_token) == (
        "HOST_BACKUP_K_FULL", ("verify_real_kv_hash",), 12, 3, 103)
    assert res.reports(step=4)[0].splitlines()[:3] == [
        "kv_canary violation: launch_tag=HOST_BACKUP_K_FULL fail_reason=verify_real_kv_hash slot_idx=12 "
        f"position=3 stored_token=103 expected_token=-1 stored_chain_hash={v.stored_chain_hash:#018x} "
        f"expected_aux={v.stored_chain_hash:#018x}",
        "KV cache canary violation detected (kernel_kind=HOST_BACKUP_K_FULL, slot_idx=12, position=3)",
        "canary_kind:       host_backup_k_full"]
    # PARTIAL folds only the first 16 bytes of a slot: byte 17 is outside, byte 3 inside
    p_host, p_slots, p_records, p_dev = _device_round(RealKvHashMode.PARTIAL)
    p_src = kvc.RealKvSource(p_host, 2, 64, 64)
    p_host.view(np.uint8).reshape(6, -1)[2, 64 + 17] ^= 0x10
    assert H.check_host_copy(p_src, p_records, p_slots, real_kv_hash_mode=1, tag=12).ok
    p_host.view(np.uint8).reshape(6, -1)[2, 64 + 3] ^= 0x10
    assert [r[1] for r in H.check_host_copy(p_src, p_records, p_slots, real_kv_hash_mode=1, tag=12).rows] == [5]


def test_host_check_with_offset_bytes():
    """A fused device KV (each slot [K 32 B, V 32 B]): the V fingerprint reads the V half in place
    through offset_bytes, on the device and on the host copy; a flipped K byte is outside it."""
    rng = np.random.default_rng(3)
    kv = jnp.asarray(rng.standard_normal((5, 4, 2, 8)).astype(np.float32))     # pages of 4 slots x 64 B
    slots = jnp.arange(9, 15, dtype=jnp.int32)
    wp = kvc.WritePlan(jnp.asarray([0, 6], jnp.int32), jnp.asarray([-1], jnp.int32), jnp.asarray([1], jnp.int32))
    for mode in (RealKvHashMode.PARTIAL, RealKvHashMode.ALL):
        v_half = kvc.RealKvSource(kv, 4, 64, 32, offset_bytes=32)
        canary, log = kvc.write(kvc.new_canary_buffer(20), kvc.ViolationLog.create(), wp,
                                jnp.arange(100, 106, dtype=jnp.int32), jnp.arange(6, dtype=jnp.int32), slots,
                                tag=kvc.LaunchTag.TAIL_V_FULL, real_kv_sources=(v_half,), real_kv_hash_mode=mode)
        assert log.total() == 0
        records, _ = export_records(canary, slots)
        records = np.asarray(records)
        host = H.aligned_host_array((6, 2, 2, 8), np.float32)        # host pages of 2 slots
        host_slots = np.arange(2, 8, dtype=np.int32)
        host.reshape(12, 2, 8)[host_slots] = np.asarray(kv).reshape(20, 2, 8)[np.asarray(slots)]
        src = kvc.RealKvSource(host, 2, 64, 32, offset_bytes=32)
        for impl in COMPARED_IMPLS:
            res = H.check_host_copy(src, records, host_slots, real_kv_hash_mode=mode, tag=13, report_slots=slots,
                                    impl=impl)
            assert res.ok and res.checked == 6, impl
        b = host.view(np.uint8).reshape(6, -1)
        b[2, 64 + 5] ^= 0x10                                          # host slot 5: K byte 5, outside
        b[3, 32 + 3] ^= 0x10                                          # host slot 6: V byte 3, inside
        want = runtime_reference.host_check((src,), records, host_slots, real_kv_hash_mode=mode, tag=13,
                                    report_slots=np.asarray(slots))
        assert [r[1] for r in want] == [13]                           # device slot of host slot 6
        for impl in COMPARED_IMPLS:
            got = H.check_host_copy(src, records, host_slots, real_kv_hash_mode=mode, tag=13, report_slots=slots,
                                    impl=impl)
            assert np.array_equal(got.rows, want), impl


def test_host_source_may_be_a_cpu_jax_array_and_aligned_arrays_are_read_in_place():
    host, host_slots, records, _ = _device_round()
    cpu = jax.devices("cpu")[0]
    assert jax.device_put(host, cpu).unsafe_buffer_pointer() == host.ctypes.data
    src = kvc.RealKvSource(jax.device_put(host, cpu), 2, 64, 64)
    assert H.check_host_copy(src, records, host_slots, real_kv_hash_mode=2, tag=12).ok


@pytest.mark.parametrize("kwargs, text", [
    (dict(real_kv_hash_mode=0, tag=12), "kv-canary: check_host_copy needs at least one RealKvSource and "
                                        "real_kv_hash_mode PARTIAL or ALL, got 0 with 1 source(s)"),
    (dict(real_kv_hash_mode=2, tag=20), "kv-canary: tag must be in [0, num_tags=20), got 20"),
    (dict(real_kv_hash_mode=2, tag=12, report_slots=np.zeros(2, np.int32)),
     "kv-canary: report_slots length must be 6, got 2"),
])
def test_errors(kwargs, text):
    host, host_slots, records, _ = _device_round()
    with pytest.raises(ValueError, match=re.escape(text) + "$"):
        H.check_host_copy(kvc.RealKvSource(host, 2, 64, 64), records, host_slots, **kwargs)
    with pytest.raises(ValueError, match=re.escape("kv-canary: records must have shape (len(slots), 32) = "
                                                   "(5, 32), got (6, 32)")):
        H.check_host_copy(kvc.RealKvSource(host, 2, 64, 64), records, host_slots[:5], real_kv_hash_mode=2, tag=12)


def test_monitor_reports_host_rows_in_its_mode():
    from jax_kvcanary.runtime import CanaryViolationError, Monitor
    host, host_slots, records, dev_slots = _device_round()
    host.view(np.uint8).reshape(6, -1)[1, 0] ^= 1                 # host slot 2: device slot 9, position 0
    res = H.check_host_copy(kvc.RealKvSource(host, 2, 64, 64), records, host_slots, real_kv_hash_mode=2,
                            tag=HostCheckTag.HOST_BACKUP_K_FULL, report_slots=dev_slots)
    logged = []
    mon = Monitor("log", logger=type("L", (), {"warning": lambda self, m: logged.append(m)})())
    (v,) = mon.report_rows(res.rows)
    assert (v.tag_name, v.slot, v.position, mon.total) == ("HOST_BACKUP_K_FULL", 9, 0, 1)
    assert logged == res.reports()
    mon = Monitor("raise")
    with pytest.raises(CanaryViolationError, match="^kv_canary violation: launch_tag=HOST_BACKUP_K_FULL "
                                                   "fail_reason=verify_real_kv_hash slot_idx=9 position=0 "):
        mon.report_rows(res.rows)
    assert mon.report_rows(res.rows) == []                          # nothing more after raising


def test_host_check_tags_follow_the_upstream_twelve():
    from jax_kvcanary.consts import LaunchTag, tag_name
    from jax_kvcanary.runtime.report import canary_kind
    assert len(LaunchTag) == 12 and [int(t) for t in HostCheckTag] == list(range(12, 20))
    assert H.host_tag("TRANSFER", "V", "SWA") == HostCheckTag.HOST_TRANSFER_V_SWA == 19
    assert (tag_name(11), tag_name(12), tag_name(19), tag_name(20)) == (
        "SWEEP_V_SWA", "HOST_BACKUP_K_FULL", "HOST_TRANSFER_V_SWA", "unknown(20)")
    assert (canary_kind(2), canary_kind(17), canary_kind(20)) == (
        "per_forward_tail_k_full", "host_backup_v_swa", "unknown(20)")
