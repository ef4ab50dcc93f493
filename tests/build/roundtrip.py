"""Run by check_wheel_compat.sh in a venv with the installed wheel (not collected by pytest: no
``test_`` prefix). Checks that the native CPU handlers are registered and chosen by ``impl=None``, then
runs plan + write + verify (a clean verify, then one after a corrupted slot, so the violation ring
is filled) and scatter, jitted, with ``impl="ffi"`` and ``impl="xla"``, and compares every output
byte for byte. Prints one summary line; exits non-zero on any difference.
"""

import sys

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

import jax_kvcanary as kvc
from jax_kvcanary import LaunchTag, RealKvHashMode, _ffi, backend


def run(impl):
    num_slots, row = 64, 16  # one 16-byte real-KV row per slot
    k_cache = jnp.arange(num_slots * row, dtype=jnp.int32).astype(jnp.uint8).reshape(num_slots, row)
    src = lambda k: (kvc.RealKvSource(k, 1, row, row),)  # noqa: E731
    req_to_token = jnp.asarray(np.arange(3 * 16, dtype=np.int32).reshape(3, 16) + 1)

    @jax.jit
    def step(canary, log, rpi, prefix, extend, input_ids, positions, out_cache_loc, k):
        vp, wp = kvc.plan(rpi, prefix, extend, req_to_token, verify_capacity=32, write_req_capacity=4,
                          impl=impl)
        log = kvc.verify(canary, log, vp, tag=LaunchTag.TAIL_K_FULL, real_kv_sources=src(k),
                         real_kv_hash_mode=RealKvHashMode.PARTIAL, impl=impl)
        canary, log = kvc.write(canary, log, wp, input_ids, positions, out_cache_loc, tag=LaunchTag.TAIL_K_FULL,
                                real_kv_sources=src(k), real_kv_hash_mode=RealKvHashMode.PARTIAL, impl=impl)
        return canary, log, vp, wp

    i32 = lambda *x: jnp.asarray(x, jnp.int32)  # noqa: E731
    canary = kvc.new_canary_buffer(num_slots)
    log = kvc.ViolationLog.create(ring_capacity=16)
    outs = []
    # prefill rows 1 and 2 (3 and 2 tokens), then a decode step of one token each
    canary, log, vp, wp = step(canary, log, i32(1, 2), i32(0, 0), i32(3, 2), i32(11, 12, 13, 21, 22),
                               i32(0, 1, 2, 0, 1), i32(17, 18, 19, 33, 34), k_cache)
    outs += [canary, vp.slot_indices, wp.offsets]
    canary, log, vp, wp = step(canary, log, i32(1, 2), i32(3, 2), i32(1, 1), i32(14, 23), i32(3, 2), i32(20, 35),
                               k_cache)
    outs += [canary, vp.slot_indices, vp.num_valid, wp.seed_slot_indices]
    # corrupt a prefix slot's record and the real KV of another: the next verify reports both
    canary = canary.at[18, 0].set(canary[18, 0] ^ 0xFF)
    canary, log, vp, wp = step(canary, log, i32(1, 2), i32(4, 3), i32(1, 1), i32(15, 24), i32(4, 3), i32(21, 36),
                               k_cache.at[33, 0].set(7))
    outs += [canary, log.ring, log.write_index, log.kernel_run_counters, log.slot_run_counters]
    pool = kvc.scatter_req_token_ids(jnp.zeros((3, 8), jnp.int32), i32(5, 6, 7, 8, 9), i32(0, 2, 5), i32(1, 2),
                                     impl=impl)
    outs.append(pool)
    return [np.asarray(x) for x in outs], log


def main():
    assert "cpu" in _ffi.NATIVE_PLATFORMS, (
        f"native CPU handlers not registered: refused={_ffi.REFUSED} import errors={_ffi.IMPORT_ERRORS}")
    assert backend.describe("cpu") == ("ffi", None), backend.describe("cpu")
    ffi, log = run("ffi")
    auto, _ = run(None)
    xla, _ = run("xla")
    for i, (a, b, c) in enumerate(zip(ffi, auto, xla)):
        assert a.dtype == c.dtype and a.shape == c.shape and a.tobytes() == c.tobytes(), f"output {i}: ffi != xla"
        assert a.tobytes() == b.tobytes(), f"output {i}: impl=None != ffi"
    total = log.total()
    assert total >= 2, f"expected the corrupted slots to be reported, got {total} violations"
    nbytes = sum(a.nbytes for a in ffi)
    print(f"roundtrip ok: python {sys.version.split()[0]} jax {jax.__version__} jaxlib {jaxlib.__version__} "
          f"built against XLA FFI API {'.'.join(map(str, _ffi._kvcanary.build_info()['ffi_api']))}; "
          f"native {sorted(_ffi.NATIVE_PLATFORMS)}, impl=None -> ffi; plan+write+verify+scatter: "
          f"{len(ffi)} outputs, {nbytes} bytes, {total} violations, ffi == xla byte for byte")


if __name__ == "__main__":
    main()
