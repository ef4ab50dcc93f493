"""The native CPU launchers on several threads (csrc/cpu_parallel.h): launches large enough to be cut
into chunks give the reference's bytes, the same as with one thread (``set_cpu_threads(1)``), with
rows in every chunk, rows past the ring, and writes whose requests are not independent (a slot in two
requests, a seed written in the same launch: the sequential fallback). The small-chunk paths are also
fuzzed natively (tests/native/fuzz_driver.cc). Also the write launchers' seed hashes taken a block of
requests ahead (cpu_launchers.h): exact when an earlier request of the block rewrote the seed."""

import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcanary as kvc
from jax_kvcanary import _ffi, hashing, reference
from tests.support.cases import compare

pytestmark = pytest.mark.skipif("cpu" not in _ffi.NATIVE_PLATFORMS, reason="no native CPU module")

N = 3 * 8192 + 123  # entries: several chunks of the 8192-entry minimum


@pytest.fixture(params=[None, 1], ids=["pool", "one_thread"])
def threads(request):
    kvc.set_cpu_threads(request.param)
    yield request.param
    kvc.set_cpu_threads(None)


def _log(cap):
    log = kvc.ViolationLog.create(cap)
    return kvc.ViolationLog(log.ring, jnp.asarray([3], jnp.int32), log.kernel_run_counters,
                            log.slot_run_counters, log.enable_chain_position_assert)


def _chain_canary(rng, num_slots, slots, tokens):
    """A canary holding one chain over `slots`, with a few records corrupted (rows in every chunk)."""
    c = np.zeros((num_slots, 32), np.uint8)
    prev, _ = hashing.chain(tokens, range(len(tokens)))
    rec = np.stack([tokens, np.arange(len(tokens)), [hashing.to_i64(h) for h in prev], np.zeros(len(tokens))], 1)
    c[slots] = rec.astype("<i8").view(np.uint8)
    bad = rng.choice(len(slots), 40, replace=False)
    c[slots[bad], 8] ^= 1                                     # wrong stored positions
    return c


@pytest.mark.parametrize("cap", [4096, 16])                  # rows stored in the ring / mostly dropped
def test_verify_in_chunks(threads, cap):
    rng = np.random.default_rng(1)
    S = N + 1000
    slots = rng.permutation(np.arange(1, S))[:N].astype(np.int32)
    tokens = rng.integers(0, 32000, N)
    canary = _chain_canary(rng, S, slots, tokens)
    prevs = np.concatenate([[-1], slots[:-1]]).astype(np.int32)
    prevs[rng.choice(N, 30)] = S + 5                         # VERIFY_PREV rows too
    vp = kvc.VerifyPlan(slots, np.full(N, -1, np.int32), np.arange(N, dtype=np.int32), prevs,
                        np.array([N], np.int32), np.array([1], np.int32))
    log = _log(cap)
    want = reference.verify(canary, jax_to_np(log), vp, tag=2)
    got = kvc.verify(jnp.asarray(canary), log, jax_tree(vp), tag=2, impl="ffi")
    assert want.total() > 100
    assert not compare("verify", want, got)


def _write_batch(rng, reqs, per_req, S):
    n = reqs * per_req
    perm = rng.permutation(np.arange(1, S)).astype(np.int32)
    loc = perm[:n].copy()
    pos = np.tile(np.arange(10, 10 + per_req), reqs).astype(np.int32)
    pos[rng.choice(n, 25, replace=False)] += 7               # chain-position rows in many requests
    ids = rng.integers(0, 32000, n).astype(np.int32)
    offsets = np.arange(0, n + 1, per_req).astype(np.int32)
    seeds = perm[n:n + reqs].copy()                          # slots the launch does not write
    seeds[::7] = -1                                          # some requests start a chain
    return offsets, seeds, ids, pos, loc


@pytest.mark.parametrize("conflict", [None, "slot_in_two_requests", "seed_written_in_launch"])
@pytest.mark.parametrize("cap", [4096, 8])
def test_write_in_chunks(threads, conflict, cap):
    rng = np.random.default_rng(2)
    reqs, per_req = 60, 450
    S = reqs * per_req + 2000
    offsets, seeds, ids, pos, loc = _write_batch(rng, reqs, per_req, S)
    if conflict == "slot_in_two_requests":
        loc[5 * per_req + 3] = loc[40 * per_req + 100]       # a later request rewrites it
    elif conflict == "seed_written_in_launch":
        seeds[50] = loc[10 * per_req + per_req - 1]          # seed = the last slot of request 10
    canary = rng.integers(0, 256, (S, 32), dtype=np.uint8)   # seeds read garbage records
    wp = kvc.WritePlan(offsets, seeds, np.array([reqs], np.int32))
    log = _log(cap)
    want = reference.write(canary, jax_to_np(log), wp, ids, pos, loc, tag=5)
    got = kvc.write(jnp.asarray(canary), log, jax_tree(wp), jnp.asarray(ids), jnp.asarray(pos),
                    jnp.asarray(loc), tag=5, impl="ffi")
    assert want[1].total() > 20
    assert not compare("write", want, got)


@pytest.mark.parametrize("per_req", [1, 3])
def test_write_seed_rewritten_by_earlier_request(threads, per_req):
    """Decode-like launches whose requests chain through each other: request r's seed is a slot that
    request r - k (k = 1, 5, 17: inside one 16-request block and across blocks) writes in the same
    launch, so the seed hash taken ahead is stale and must not be used; some seeds are repeated."""
    rng = np.random.default_rng(4)
    reqs = 80
    n = reqs * per_req
    S = n + 500
    loc = rng.permutation(np.arange(1, S))[:n].astype(np.int32)
    ids = rng.integers(0, 32000, n).astype(np.int32)
    pos = np.tile(np.arange(5, 5 + per_req), reqs).astype(np.int32)
    offsets = np.arange(0, n + 1, per_req).astype(np.int32)
    seeds = rng.integers(1, S, reqs).astype(np.int32)
    for r in range(reqs):
        k = (1, 5, 17, 0)[r % 4]
        if k and r >= k:
            seeds[r] = loc[(r - k) * per_req + per_req - 1]     # the last slot request r - k writes
    seeds[[30, 31]] = seeds[29]                                  # one seed for three requests
    canary = rng.integers(0, 256, (S, 32), dtype=np.uint8)
    wp = kvc.WritePlan(offsets, seeds, np.array([reqs], np.int32))
    log = _log(4096)
    want = reference.write(canary, jax_to_np(log), wp, ids, pos, loc, tag=5)
    got = kvc.write(jnp.asarray(canary), log, jax_tree(wp), jnp.asarray(ids), jnp.asarray(pos),
                    jnp.asarray(loc), tag=5, impl="ffi")
    assert want[1].total() > 0
    assert not compare("write", want, got)


def test_plan_in_chunks(threads):
    rng = np.random.default_rng(3)
    bs, L = 48, 2048
    r2t = rng.integers(1, 100000, (bs + 1, L)).astype(np.int32)
    rpi = np.arange(1, bs + 1).astype(np.int32)
    rpi[[3, 17]] = 0                                         # padding rows
    prefix = rng.integers(0, L, bs).astype(np.int32)
    prefix[[5, 6, 7]] = 0                                    # empty rows between full ones
    extend = rng.integers(0, 4, bs).astype(np.int32)
    vcap = int(prefix.sum()) + 3000                          # zero tail after the entries
    want = reference.plan(rpi, prefix, extend, r2t, verify_capacity=vcap, write_req_capacity=64)
    got = kvc.plan(jnp.asarray(rpi), jnp.asarray(prefix), jnp.asarray(extend), jnp.asarray(r2t),
                   verify_capacity=vcap, write_req_capacity=64, impl="ffi")
    assert vcap > 4 * 8192
    assert not compare("plan", want, got)


def test_thread_cap_setting():
    kvc.set_cpu_threads(3)
    assert kvc.cpu_threads() == 3
    kvc.set_cpu_threads(None)
    assert kvc.cpu_threads() is None
    with pytest.raises(ValueError, match="kv-canary: set_cpu_threads needs n >= 0 or None, got -1"):
        kvc.set_cpu_threads(-1)


def jax_to_np(log):
    return kvc.ViolationLog(*[np.asarray(getattr(log, f)) for f in kvc.ViolationLog._FIELDS])


def jax_tree(plan):
    return type(plan)(*[jnp.asarray(getattr(plan, f)) for f in plan._FIELDS])
