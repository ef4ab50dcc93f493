"""Tests specific to the pure-JAX backend (``jax_kvcanary.xla_impl``, ``impl="xla"``).

The generic byte-for-byte comparison of every op against the numpy reference lives in
``test_property.py`` (every impl). This file covers what only this backend has:

* the uint32-pair u64 arithmetic (``_u64``) against numpy uint64 (x64 off), and the native-uint64
  path (x64 on) against the same values;
* identical bytes with x64 off and on (int32 and int64 inputs), in subprocesses, on a scenario that
  takes write's sequential (seed-conflict) path, the real-KV fold loop and many source dtypes;
* no host callback / custom call in the lowered or compiled program of any op;
* working with the native module absent (import blocked in a subprocess);
* ``jax.jit`` with donated state: the compiled module aliases every state buffer and copies none;
* ``jax.shard_map`` over 4 simulated CPU devices: each device's shard equals running it alone;
* write's vectorised chain path and its sequential fallback agree on random inputs, and both match
  the reference (conflict-heavy, long requests, odd source dtypes, ring edge cases).

Subprocess scenarios are this module run as a script: ``python test_xla_impl.py SCENARIO [ARGS]``;
their tests are marked ``slow``.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve()
MASK64 = (1 << 64) - 1


# =================================================================================================
# Scenario code (also run as a script in subprocesses): imports jax lazily so that the environment
# (JAX_ENABLE_X64, XLA_FLAGS, a blocked native module) is set before jax loads.
# =================================================================================================

def _digest(tree) -> str:
    import jax
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(tree):
        a = np.asarray(leaf)
        if a.dtype.kind in "iu" and a.dtype != np.uint8:
            a = a.astype(np.int64)  # index outputs: compare values, not width
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _sources(rng, S):
    """Real-KV sources of several dtypes; some rows short (unaddressable slots)."""
    import jax.numpy as jnp
    import ml_dtypes
    import jax_kvcanary as kvc
    raw = lambda rows, nbytes: rng.integers(0, 256, (rows, nbytes), dtype=np.uint8)  # noqa: E731
    c64 = raw(S, 32).view(np.complex64).reshape(S, 2, 2)             # 32 B rows
    return (
        kvc.RealKvSource(jnp.asarray(raw(S, 96).view(np.int8).reshape(S, 2, 2, 24)), 1, 96, 96),  # 6 chunks
        kvc.RealKvSource(jnp.asarray(raw(S // 2, 64).view(ml_dtypes.bfloat16)), 2, 32, 32),
        kvc.RealKvSource(jnp.asarray(c64), 1, 32, 16, offset_bytes=16),  # the strip's second half
        kvc.RealKvSource(jnp.asarray(raw(S // 4 - 1, 80).view(np.float32).reshape(-1, 4, 5)), 4, 16, 16),
    )


def scenario_x64(index_dtype: str) -> str:
    """plan -> verify -> write (seed conflict) -> write (malformed) -> verify, scatter, SWA plan."""
    import jax
    import jax.numpy as jnp
    import jax_kvcanary as kvc

    idx = lambda v: jnp.asarray(np.asarray(v, dtype=np.int64), dtype=index_dtype)  # noqa: E731
    i32 = lambda v: jnp.asarray(np.asarray(v, dtype=np.int32))  # noqa: E731
    rng = np.random.default_rng(11)
    S = 40
    srcs = _sources(rng, S)
    canary = jnp.asarray(rng.integers(0, 256, (S, 40), dtype=np.uint8))
    log = kvc.ViolationLog.create(6)
    out = []

    pool = idx(rng.integers(-1000, 1000, (5, 12)))
    pool = kvc.scatter_req_token_ids(pool, idx(rng.integers(0, 99, 20)), idx([0, 7, 5, 19, 40]),
                                     idx([1, 2, 1, 4]), impl="xla")
    out.append(pool)
    r2t = idx(rng.integers(1, S, (5, 12)))
    vp, wp = kvc.plan(idx([1, 0, 2, 3]), idx([4, 9, 0, 12]), idx([3, 5, 2, 1]), r2t, verify_capacity=24,
                      write_req_capacity=5, req_to_verify_expected_tokens=pool,
                      req_to_verify_expected_tokens_valid_lens=idx([12, 3, 5, 7]),
                      kv_token_id_vs_position_offset=1, impl="xla")
    out += [vp, wp]
    lut = idx(rng.integers(-2, S, 50))
    out += list(kvc.plan(idx([1, 2, 3]), idx([9, 3, 12]), idx([1, 1, 0]), r2t, verify_capacity=16,
                         write_req_capacity=3, swa_window_size=4, full_to_swa_index_mapping=lut,
                         impl="xla"))
    out += list(kvc.plan(idx([1, 2, 3, 4]), idx([9, 3, 12, 2]), idx([1, 1, 0, 1]), r2t.reshape(-1), verify_capacity=32,
                         write_req_capacity=4, swa_window_size=4, full_to_swa_index_mapping=lut,
                         req_to_verify_expected_tokens=pool, req_to_verify_expected_tokens_valid_lens=idx([12, 3, 5, 7]),
                         row_starts=idx([12, -2, 50, 2**31 - 3]), impl="xla"))
    log = kvc.verify(canary, log, vp, tag=4, check_verify_expected_token=True, real_kv_sources=srcs,
                     real_kv_hash_mode=kvc.RealKvHashMode.ALL, impl="xla")
    out.append(log)
    # request 1's seed (slot 5) is written by request 0 in the same launch: sequential path
    wp2 = kvc.WritePlan(offsets=idx([0, 3, 6, 6, 9]), seed_slot_indices=idx([-1, 5, 41, 7]),
                        num_valid_reqs=i32([4]))
    ids = idx([10, 11, 12, 13, 14, 15, 16, 17, 18])
    pos = idx([0, 1, 2, 3, 4, 6, 1, 2, 3])
    loc = idx([4, 5, 5, 6, -1, 39, 2, 45, 2])
    canary, log = kvc.write(canary, log, wp2, ids, pos, loc, tag=2, enable_write_input_assert=True,
                            expected_input_tokens=ids, expected_input_positions=idx([0, 1, 2, 3, 4, 5, 1, 2, 4]),
                            real_kv_sources=srcs, real_kv_hash_mode=kvc.RealKvHashMode.ALL, impl="xla")
    out += [canary, log]
    wp3 = kvc.WritePlan(offsets=idx([0, 5, 3, 8]), seed_slot_indices=idx([-1, -1, 6]), num_valid_reqs=i32([3]))
    canary, log = kvc.write(canary, log, wp3, ids[:6], pos[:6], loc[:6], tag=3, real_kv_sources=srcs[1:3],
                            real_kv_hash_mode=kvc.RealKvHashMode.PARTIAL, impl="xla")
    out += [canary, log]
    vp2 = kvc.VerifyPlan(slot_indices=idx([4, 5, 6, 0, -3, 44, 39, 2]),
                         expected_tokens=idx([10, -1, 99, 0, 0, 0, 15, 18]),
                         expected_positions=idx([0, 1, 3, 0, 0, 0, 6, 3]),
                         prev_slot_indices=idx([-1, 4, 50, 0, 1, 1, 0, 5]), num_valid=i32([8]), enable=i32([1]))
    log = kvc.verify(canary, log, vp2, tag=8, check_verify_expected_token=True, real_kv_sources=srcs,
                     real_kv_hash_mode=kvc.RealKvHashMode.PARTIAL, impl="xla")
    out.append(log)
    jax.block_until_ready(out)
    return _digest(out)


def scenario_no_native() -> str:
    """Block the native module, then run every op with impl='xla' and check format goldens (docs/format.md §12)."""
    import importlib.abc

    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "jax_kvcanary._kvcanary":
                raise ImportError("native module blocked by test")
            return None

    sys.meta_path.insert(0, _Block())
    import jax
    import jax.numpy as jnp
    import jax_kvcanary as kvc
    from jax_kvcanary import xla_impl

    assert "jax_kvcanary._kvcanary" not in sys.modules
    try:
        import jax_kvcanary._kvcanary  # noqa: F401
        raise AssertionError("the block did not work")
    except ImportError:
        pass
    i32 = lambda v: jnp.asarray(np.asarray(v, np.int32))  # noqa: E731
    # §12.5 Example A, through the public op and through the backend directly (jitted)
    canary, log = kvc.new_canary_buffer(8), kvc.ViolationLog.create(4)
    wp = kvc.WritePlan(offsets=i32([0, 3]), seed_slot_indices=i32([-1]), num_valid_reqs=i32([1]))
    c1, l1 = kvc.write(canary, log, wp, i32([42, 99, 43]), i32([0, 1, 1]), i32([3, -1, 5]), tag=0, impl="xla")
    f = jax.jit(lambda c, l, w, a, b, d: xla_impl.write(
        c, l, w, a, b, d, tag=0, enable_write_input_assert=False, expected_input_tokens=None,
        expected_input_positions=None, real_kv_sources=(), real_kv_hash_mode=0))
    c2, l2 = f(canary, log, wp, i32([42, 99, 43]), i32([0, 1, 1]), i32([3, -1, 5]))
    fl = kvc.canary_fields(c1)
    assert fl[3].tolist() == [42, 0, -2414019407054260458, 0], fl[3]
    assert fl[5].tolist() == [43, 1, 1979760175908667849, 0], fl[5]
    assert np.array_equal(np.asarray(c1), np.asarray(c2))
    assert l1.slot_runs()[0] == 2 and l1.kernel_runs()[0] == 1 and l1.total() == 0
    # §12.7 row layout golden
    can = np.zeros((8, 32), np.uint8)
    can[5, :24] = np.array([33, 0, -2414019407054260458], "<i8").view(np.uint8)
    vp = kvc.VerifyPlan(slot_indices=i32([5]), expected_tokens=i32([-1]), expected_positions=i32([99]),
                        prev_slot_indices=i32([-1]), num_valid=i32([1]), enable=i32([1]))
    lv = kvc.verify(jnp.asarray(can), kvc.ViolationLog.create(4), vp, tag=0, impl="xla")
    assert lv.rows().tolist() == [[0, 5, 0, 33, -1, -2414019407054260458, -2414019407054260458, 2]]
    # §12.8 first plan golden
    r2t = i32(np.arange(64).reshape(4, 16))      # req_to_token[rp][pos] = rp*16 + pos
    vpl, wpl = kvc.plan(i32([1, 2, 3]), i32([0, 4, 7]), i32([3, 1, 1]), r2t, verify_capacity=64,
                        write_req_capacity=4, impl="xla")
    assert int(vpl.num_valid[0]) == 11 and np.asarray(wpl.offsets).tolist() == [0, 3, 4, 5, 0]
    assert np.asarray(wpl.seed_slot_indices).tolist() == [-1, 35, 54, 0]
    pool = kvc.scatter_req_token_ids(i32(np.zeros((3, 4))), i32([1, 2, 3]), i32([0, 2, 3]), i32([1, 2]),
                                     impl="xla")
    assert np.asarray(pool).tolist() == [[0, 0, 0, 0], [1, 2, 0, 0], [3, 0, 0, 0]]
    assert "jax_kvcanary._kvcanary" not in sys.modules
    return "ok"


def scenario_shard_map() -> str:
    """4 simulated devices, each with its own canary / log shard; compare with per-shard runs."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    import jax_kvcanary as kvc

    D, S, C, N, cap, R, L = 4, 24, 3, 8, 6, 4, 12
    assert len(jax.devices()) == D, jax.devices()
    rng = np.random.default_rng(5)

    def step(canary, ring, wi, kc, sc, flag, kv, rp, pre, ext, r2t, ids, loc):
        log = kvc.ViolationLog(ring=ring, write_index=wi, kernel_run_counters=kc, slot_run_counters=sc,
                               enable_chain_position_assert=flag)
        src = (kvc.RealKvSource(kv, 2, 16, 16),)
        vp, wp = kvc.plan(rp, pre, ext, r2t.reshape(R, L), verify_capacity=16, write_req_capacity=C, impl="xla")
        log = kvc.verify(canary, log, vp, tag=2, real_kv_sources=src, real_kv_hash_mode=1, impl="xla")
        pos = jnp.arange(N, dtype=jnp.int32) % 5
        canary, log = kvc.write(canary, log, wp, ids, pos, loc, tag=2, real_kv_sources=src,
                                real_kv_hash_mode=1, impl="xla")
        log = kvc.verify(canary, log, vp, tag=3, real_kv_sources=src, real_kv_hash_mode=1, impl="xla")
        return (canary, log.ring, log.write_index, log.kernel_run_counters, log.slot_run_counters,
                log.enable_chain_position_assert, vp.slot_indices, wp.offsets)

    shards = []
    for d in range(D):
        shards.append([
            rng.integers(0, 256, (S, 32), dtype=np.uint8),                   # canary
            np.zeros((cap, 64), np.uint8), np.array([d], np.int32),          # ring, write_index
            np.zeros((12, 8), np.uint8), np.zeros((12, 8), np.uint8), np.array([1], np.int32),
            rng.integers(0, 256, (S // 2 - 1, 64), dtype=np.uint8),          # kv: slots 22, 23 unaddressable
            np.array([1, 2, 0], np.int32), rng.integers(0, 6, C).astype(np.int32),
            rng.integers(0, 4, C).astype(np.int32),
            rng.integers(-1, S + 2, R * L).astype(np.int32),
            rng.integers(0, 1000, N).astype(np.int32), rng.integers(-1, S + 1, N).astype(np.int32),
        ])
    stacked = [np.concatenate([s[k] for s in shards], axis=0) for k in range(len(shards[0]))]

    mesh = Mesh(np.array(jax.devices()), ("d",))
    sm = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("d"),) * len(stacked), out_specs=P("d")))
    got = sm(*[jnp.asarray(a) for a in stacked])
    alone = jax.jit(step)
    for d in range(D):
        ref = alone(*[jnp.asarray(a) for a in shards[d]])
        for k, (g, r) in enumerate(zip(got, ref)):
            n = r.shape[0]
            gd = np.asarray(g)[d * n:(d + 1) * n]
            assert np.array_equal(gd, np.asarray(r)), (d, k)
    # something actually happened on every device
    wi = np.asarray(got[2])
    kc = np.asarray(got[3]).reshape(D, 12, 8)
    assert (kc[:, 2, 0] == 2).all() and (kc[:, 3, 0] == 1).all(), kc[:, :4, 0]   # verify+write, verify
    assert (wi > np.arange(D)).any(), wi
    return "ok"


# =================================================================================================
# pytest part
# =================================================================================================

def _run_script(*args, env_extra=None, timeout=600):
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, str(HERE), *args], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout.strip().splitlines()[-1]


if __name__ != "__main__":
    import jax
    import jax.numpy as jnp
    import pytest

    import jax_kvcanary as kvc
    from jax_kvcanary import _u64 as U
    from jax_kvcanary import reference, xla_impl

    # ---- u64 arithmetic --------------------------------------------------------------------------

    def _np_pair(x):
        x = np.asarray(x, np.uint64)
        return (jnp.asarray((x & np.uint64(0xFFFFFFFF)).astype(np.uint32)),
                jnp.asarray((x >> np.uint64(32)).astype(np.uint32)))

    def _np_val(p):
        return np.asarray(p[0]).astype(np.uint64) | (np.asarray(p[1]).astype(np.uint64) << np.uint64(32))

    def _np_splitmix(x):
        with np.errstate(over="ignore"):
            x = (x ^ (x >> np.uint64(30))) * np.uint64(kvc.consts.SPLITMIX64_MUL1)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(kvc.consts.SPLITMIX64_MUL2)
            return x ^ (x >> np.uint64(31))

    def _rand_u64(rng, n):
        x = rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False)
        edge = np.array([0, 1, 2**32 - 1, 2**32, 2**63, 2**64 - 1, 0xFFFF, 0x10000, 0xFFFF0000FFFF0000,
                         0x8000000080000000], np.uint64)
        x[:len(edge)] = edge
        return x

    def test_u64_pair_ops_match_numpy():
        with jax.enable_x64(False):   # the uint32-pair arithmetic is what x64 off runs
            _check_u64_pair_ops()

    def _check_u64_pair_ops():
        rng = np.random.default_rng(0)
        a, b = _rand_u64(rng, 4096), _rand_u64(rng, 4096)[::-1].copy()
        pa, pb = _np_pair(a), _np_pair(b)
        with np.errstate(over="ignore"):
            assert np.array_equal(_np_val(U.mul(pa, pb)), a * b)
            assert np.array_equal(_np_val(U.add(pa, pb)), a + b)
            assert np.array_equal(_np_val(U.add_small(pa, 1)), a + np.uint64(1))
            for c in (kvc.consts.SPLITMIX64_MUL1, kvc.consts.SPLITMIX64_MUL2, 1, 0xFFFFFFFF, 2**64 - 1):
                assert np.array_equal(_np_val(U.mul_const(pa, c)), a * np.uint64(c)), hex(c)
        lo32 = (a & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        hi32 = (b & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        assert np.array_equal(_np_val(U.mul32_wide(jnp.asarray(lo32), jnp.asarray(hi32))),
                              lo32.astype(np.uint64) * hi32.astype(np.uint64))
        for n in (1, 27, 30, 31):
            assert np.array_equal(_np_val(U.shr(pa, n)), a >> np.uint64(n))
        assert np.array_equal(_np_val(U.xor(pa, pb)), a ^ b)
        assert np.array_equal(np.asarray(U.eq(pa, pb)), a == b)
        assert np.array_equal(np.asarray(U.ne(pa, pa)), np.zeros(a.shape, bool))

    def test_u64_hashes_match_numpy_and_pins():
        rng = np.random.default_rng(1)
        a, b, c = (_rand_u64(rng, 2048) for _ in range(3))
        for native in (False, None):   # None: x64 is off, so the pair path again (default)
            assert np.array_equal(_np_val(U.splitmix64(_np_pair(a), native=native)), _np_splitmix(a))
            want = _np_splitmix(_np_splitmix(_np_splitmix(a) ^ b) ^ c)
            assert np.array_equal(_np_val(U.mix3(_np_pair(a), _np_pair(b), _np_pair(c), native=native)), want)
        pins = {0: 0, 1: 0x5692161D100B05E5, 0x9E3779B97F4A7C15: 0xE220A8397B1DCDAF,
                0xDEADBEEFCAFEBABE: 0x7AD6664F09FFE52C, 2**64 - 1: 0xB4D055FCF2CBBD7B,
                2**63: 0x25C26EA579CEA98A, kvc.CANARY_CHAIN_ANCHOR: kvc.CANARY_ANCHOR_HASH}
        x = np.array(list(pins), np.uint64)
        assert _np_val(U.splitmix64(_np_pair(x))).tolist() == list(pins.values())
        h0 = kvc.CANARY_ANCHOR_HASH
        for (aa, bb, cc), want in {(h0, 42, 0): 0x1b798564098041c9, (h0, -1, 5): 0xa655cdb26a444c27,
                                   (0x1234567890ABCDEF, 100, 5): 0x0ea63d7d0f5ac3d5,
                                   (2**64 - 1, 0xFFFF, 0xFFFF): 0xfcbd57ff526292ff}.items():
            got = U.mix3(U.const(aa), U.const(bb), U.const(cc))
            assert int(_np_val(got)) == want

    def test_u64_native_path_under_x64_matches():
        rng = np.random.default_rng(2)
        a, b, c = (_rand_u64(rng, 512) for _ in range(3))
        want = _np_splitmix(_np_splitmix(_np_splitmix(a) ^ b) ^ c)
        with jax.enable_x64(True):
            got = U.mix3(_np_pair(a), _np_pair(b), _np_pair(c), native=True)
            assert np.array_equal(_np_val(got), want)
            got = U.mix3(_np_pair(a), _np_pair(b), _np_pair(c), native=False)
            assert np.array_equal(_np_val(got), want)

    def test_u64_widen_and_bytes():
        v = np.array([0, 1, -1, 5, -2**31, 2**31 - 1, 123456789, -987654321], np.int32)
        p = U.from_int(jnp.asarray(v))
        assert np.array_equal(_np_val(p).view(np.int64), v.astype(np.int64))
        b = np.asarray(U.to_bytes(p[0], p[1]))
        assert b.shape == (64,) and np.array_equal(b.view("<i8"), v.astype(np.int64))
        lo, hi = U.from_bytes(jnp.asarray(b.reshape(2, 32)))
        assert np.array_equal(_np_val((lo, hi)).view(np.int64).reshape(-1), v.astype(np.int64))
        with jax.enable_x64(True):
            w = np.array([-2**63, 2**63 - 1, -1, 2**40 + 7, -2**33], np.int64)
            p = U.from_int(jnp.asarray(w))
            assert np.array_equal(_np_val(p).view(np.int64), w)

    # ---- x64 off / on --------------------------------------------------------------------------

    @pytest.mark.slow
    def test_same_bytes_x64_off_and_on():
        off = _run_script("x64", "int32", env_extra={"JAX_ENABLE_X64": "0"})
        on32 = _run_script("x64", "int32", env_extra={"JAX_ENABLE_X64": "1"})
        on64 = _run_script("x64", "int64", env_extra={"JAX_ENABLE_X64": "1"})
        assert off == on32 == on64

    # ---- no host callbacks -----------------------------------------------------------------------

    def _i32(v):
        return jnp.asarray(np.asarray(v, np.int32))

    def _all_op_fns():
        rng = np.random.default_rng(3)
        S = 16
        canary = jnp.zeros((S, 32), jnp.uint8)
        log = kvc.ViolationLog.create(8)
        kv = jnp.asarray(rng.integers(0, 256, (S, 4, 32), dtype=np.uint8)).view(jnp.bfloat16)
        srcs = (kvc.RealKvSource(kv, 1, 64, 64), kvc.RealKvSource(kv, 2, 32, 16))
        vp = kvc.VerifyPlan(*(_i32(rng.integers(-1, S, 10)) for _ in range(4)), _i32([10]), _i32([1]))
        wp = kvc.WritePlan(_i32([0, 4, 8]), _i32([-1, 3]), _i32([2]))
        ids, pos, loc = (_i32(rng.integers(0, S, 8)) for _ in range(3))
        pool = _i32(np.zeros((4, 8)))
        return {
            "verify": (lambda c, l, v: kvc.verify(c, l, v, tag=1, check_verify_expected_token=True,
                                                  real_kv_sources=srcs, real_kv_hash_mode=2, impl="xla"),
                       (canary, log, vp)),
            "write": (lambda c, l, w, a, b, d: kvc.write(c, l, w, a, b, d, tag=1, enable_write_input_assert=True,
                                                         expected_input_tokens=a, expected_input_positions=b,
                                                         real_kv_sources=srcs, real_kv_hash_mode=2, impl="xla"),
                      (canary, log, wp, ids, pos, loc)),
            "plan": (lambda a, b, c, t, lut, p, vl: kvc.plan(
                a, b, c, t, verify_capacity=16, write_req_capacity=4, swa_window_size=3,
                full_to_swa_index_mapping=lut, req_to_verify_expected_tokens=p,
                req_to_verify_expected_tokens_valid_lens=vl, kv_token_id_vs_position_offset=1, impl="xla"),
                     (_i32([1, 2]), _i32([3, 5]), _i32([1, 1]), _i32(np.arange(32).reshape(4, 8)),
                      _i32(np.arange(40)), pool, _i32([8, 8]))),
            "scatter": (lambda p, f, o, r: kvc.scatter_req_token_ids(p, f, o, r, impl="xla"),
                        (pool, _i32([1, 2, 3, 4]), _i32([0, 2, 4]), _i32([1, 1]))),
        }

    @pytest.mark.parametrize("op", ["verify", "write", "plan", "scatter"])
    def test_no_host_callback_or_custom_call(op):
        fn, args = _all_op_fns()[op]
        lowered = jax.jit(fn).lower(*args)
        text = lowered.as_text(debug_info=False)
        # host callbacks (pure_callback, io_callback, debug.print, ...) lower to custom calls
        for bad in ("custom_call", "python_cpu_callback", "python_gpu_callback", "infeed", "outfeed",
                    "stablehlo.send", "stablehlo.recv"):
            assert bad not in text, f"{op}: '{bad}' in the lowered program"
        compiled = lowered.compile().as_text()
        for bad in ("custom-call(", "custom_call_target", "infeed(", "outfeed(", " send(", " recv("):
            assert bad not in compiled, f"{op}: '{bad}' in the compiled program"
        # and the check has teeth: a program with a callback is caught
        cb = jax.jit(lambda x: jax.pure_callback(lambda v: v, jax.ShapeDtypeStruct((2,), jnp.int32), x))
        assert "custom_call" in cb.lower(_i32([1, 2])).as_text(debug_info=False)

    # ---- jit with donation ---------------------------------------------------------------------

    def _alias_params(hlo_text):
        """Parameter numbers that the compiled module aliases to an output."""
        import re
        line = next((ln for ln in hlo_text.splitlines() if "input_output_alias" in ln), "")
        return {int(m) for m in re.findall(r"\(\s*(\d+)\s*,\s*\{[^}]*\}\s*,\s*(?:may|must)-alias", line)}

    def _copies_of(hlo_text, shapes):
        bad = []
        for ln in hlo_text.splitlines():
            if " copy(" in ln or "copy-start" in ln:
                if any(s in ln.split("=")[1].split("copy")[0] for s in shapes):
                    bad.append(ln.strip())
        return bad

    def test_jit_donation_aliases_state_without_copies():
        S, stride, cap = 37, 40, 19          # unusual shapes, easy to spot in the HLO
        rng = np.random.default_rng(4)
        kv = jnp.asarray(rng.integers(0, 256, (S, 32), dtype=np.uint8))
        srcs = (kvc.RealKvSource(kv, 1, 32, 32),)

        def fresh():
            return (jnp.asarray(rng.integers(0, 256, (S, stride), dtype=np.uint8)),
                    kvc.ViolationLog.create(cap))

        wp = kvc.WritePlan(_i32([0, 3, 6]), _i32([-1, 2]), _i32([2]))
        ids, pos, loc = _i32([5, 6, 7, 8, 9, 10]), _i32([0, 1, 2, 3, 9, 5]), _i32([1, 2, 3, 4, 5, 40])

        def step(canary, log, wp, ids, pos, loc):
            vp = kvc.VerifyPlan(loc, ids, pos, loc - 1, _i32([6]), _i32([1]))
            log = kvc.verify(canary, log, vp, tag=2, real_kv_sources=srcs, real_kv_hash_mode=2, impl="xla")
            return kvc.write(canary, log, wp, ids, pos, loc, tag=2, real_kv_sources=srcs,
                             real_kv_hash_mode=2, impl="xla")

        canary, log = fresh()
        ref_c, ref_l = jax.jit(step)(canary, log, wp, ids, pos, loc)
        fn = jax.jit(step, donate_argnums=(0, 1))
        compiled = fn.lower(canary, log, wp, ids, pos, loc).compile()
        text = compiled.as_text()
        aliased = _alias_params(text)
        assert {0, 1, 2, 3, 4} <= aliased, (aliased, [ln for ln in text.splitlines() if "alias" in ln][:2])
        copies = _copies_of(text, (f"u8[{S},{stride}]", f"u8[{cap},64]"))
        assert not copies, copies
        c2, l2 = fn(canary, log, wp, ids, pos, loc)
        assert canary.is_deleted() and log.ring.is_deleted()
        assert np.array_equal(np.asarray(c2), np.asarray(ref_c))
        for a, b in zip(jax.tree_util.tree_leaves(l2), jax.tree_util.tree_leaves(ref_l)):
            assert np.array_equal(np.asarray(a), np.asarray(b))
        assert l2.total() > 0    # the step did record rows (slot 40 is out of range)

        # scatter: the pool is aliased too
        pool = _i32(np.zeros((7, 9)))
        sc = jax.jit(lambda p, f, o, r: kvc.scatter_req_token_ids(p, f, o, r, impl="xla"), donate_argnums=0)
        t = sc.lower(pool, _i32([1, 2, 3]), _i32([0, 1, 3]), _i32([2, 2])).compile().as_text()
        assert 0 in _alias_params(t) and not _copies_of(t, ("s32[7,9]",))

    # ---- shard_map / native module absent (subprocesses) ---------------------------------------

    @pytest.mark.slow
    def test_shard_map_four_devices():
        assert _run_script("shard_map", env_extra={
            "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip(),
            "JAX_ENABLE_X64": "0"}) == "ok"

    @pytest.mark.slow
    def test_works_without_native_module():
        assert _run_script("no_native", env_extra={"JAX_ENABLE_X64": "0"}) == "ok"

    # ---- fast chain path vs sequential fallback, both vs the reference ------------------------

    def _rand_write_case(rng, S=20, C=5, N=24, cap=6, stride=32, assert_on=True, srcs=()):
        canary = rng.integers(0, 256, (S, stride), dtype=np.uint8)
        canary[rng.random(S) < 0.3, :32] = 0
        ring = rng.integers(0, 256, (cap, 64), dtype=np.uint8)
        wi = int(rng.choice([0, 0, 2, cap - 1, cap, 3 * cap, 2**31 - 2, 2**31 - 1, -1, -4]))
        kc = rng.integers(0, 256, (12, 8), dtype=np.uint8)
        sc = rng.integers(0, 256, (12, 8), dtype=np.uint8)
        if rng.random() < 0.3:
            sc[:] = 0xFF
        flag = int(rng.choice([1, 1, 0, 3]))
        log = kvc.ViolationLog(ring, np.array([wi], np.int32), kc, sc, np.array([flag], np.int32))
        lens = rng.integers(0, 9, C)
        offs = np.concatenate([[0], np.cumsum(lens)]).clip(0, N)
        if rng.random() < 0.2:
            offs = rng.integers(-3, N + 4, C + 1)
        loc = rng.integers(-2, S + 3, N)
        written = []
        seeds = np.full(C, -1)
        for r in range(C):
            lo, hi = int(np.clip(offs[r], 0, N)), int(np.clip(offs[r + 1], 0, N))
            u = rng.random()
            if written and u < 0.5:
                seeds[r] = rng.choice(written)          # seed written by an earlier request
            elif u < 0.7:
                seeds[r] = rng.integers(-3, S + 3)
            for i in range(lo, hi):
                if written and rng.random() < 0.25:
                    loc[i] = rng.choice(written)       # duplicates within / across requests
                if 0 <= loc[i] < S:
                    written.append(int(loc[i]))
        pos = rng.integers(0, 12, N)
        ids = rng.integers(-2, 1000, N)
        nvr = int(rng.choice([C, C, C - 1, 0, -2, C + 5]))
        wp = kvc.WritePlan(offs.astype(np.int32), seeds.astype(np.int32), np.array([nvr], np.int32))
        kwargs = dict(tag=7, real_kv_sources=srcs, real_kv_hash_mode=2 if srcs else 0)
        if assert_on:
            et = np.where(rng.random(N) < 0.8, ids, rng.integers(0, 1000, N))
            ep = np.where(rng.random(N) < 0.8, pos, rng.integers(0, 12, N))
            kwargs.update(enable_write_input_assert=True, expected_input_tokens=et.astype(np.int32),
                          expected_input_positions=ep.astype(np.int32))
        return (canary, log, wp, ids.astype(np.int32), pos.astype(np.int32), loc.astype(np.int32)), kwargs

    def _to_jax(tree):
        return jax.tree_util.tree_map(lambda x: jnp.asarray(x) if isinstance(x, np.ndarray) else x, tree)

    def _same(a, b):
        la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
        return len(la) == len(lb) and all(np.asarray(x).tobytes() == np.asarray(y).tobytes()
                                          and np.asarray(x).dtype == np.asarray(y).dtype for x, y in zip(la, lb))

    @pytest.mark.parametrize("srcs_kind", ["none", "dtypes"])
    def test_write_fast_and_sequential_paths_match_reference(srcs_kind):
        rng = np.random.default_rng(10 if srcs_kind == "none" else 11)
        S = 20
        srcs = () if srcs_kind == "none" else _sources(np.random.default_rng(3), S)
        fns = {}
        conflicts = 0
        for seed in range(48):
            args, kwargs = _rand_write_case(rng, S=S, srcs=srcs)
            static = {k: kwargs[k] for k in ("tag", "enable_write_input_assert", "real_kv_hash_mode")
                      if k in kwargs}
            dyn = {k: v for k, v in kwargs.items() if k not in static}
            ref = reference.write(*args, **kwargs)
            for seq in (False, True):
                key = (tuple(sorted(static.items())), seq)
                if key not in fns:
                    xla_impl.FORCE_SEQUENTIAL_WRITE = seq
                    try:
                        f = jax.jit(lambda a, d, _s=dict(static): kvc.write(*a, impl="xla", **_s, **d))
                        # trace now, while the flag is set
                        fns[key] = f.lower(_to_jax(args), _to_jax(dyn)).compile()
                    finally:
                        xla_impl.FORCE_SEQUENTIAL_WRITE = False
                got = fns[key](_to_jax(args), _to_jax(dyn))
                assert _same(got, ref), (seed, seq)
            # count launches that needed the fallback (a seed written earlier in the launch)
            wp = args[2]
            conflicts += int(any(s in set(args[5][:max(0, int(wp.offsets[r]))]) for r, s in
                                 enumerate(wp.seed_slot_indices) if s >= 0))
        assert conflicts >= 3    # the generator does exercise the fallback

    def test_write_long_requests_and_ring_saturation():
        """One long request (deep chain loop), a full ring and write_index at the int32 limit."""
        S, N = 300, 256
        rng = np.random.default_rng(12)
        canary = np.zeros((S, 32), np.uint8)
        for wi in (0, 5, 2**31 - 3, 2**31 - 1):
            log = kvc.ViolationLog(np.zeros((4, 64), np.uint8), np.array([wi], np.int32),
                                   np.zeros((12, 8), np.uint8), np.zeros((12, 8), np.uint8),
                                   np.array([1], np.int32))
            wp = kvc.WritePlan(np.array([0, 200, 256], np.int32), np.array([-1, 7], np.int32),
                               np.array([2], np.int32))
            ids = rng.integers(0, 50000, N).astype(np.int32)
            pos = np.arange(N, dtype=np.int32)
            pos[::17] += 3                                   # chain-position rows
            loc = rng.permutation(S)[:N].astype(np.int32)
            loc[::29] = S + 1                                # WRITE_SLOT rows
            args = (canary, log, wp, ids, pos, loc)
            ref = reference.write(*args, tag=9)
            got = kvc.write(*_to_jax(args), tag=9, impl="xla")
            assert _same(got, ref), wi
            n = int(ref[1].write_index[0]) - wi
            if wi == 2**31 - 1:
                assert n == 0                                # saturated
            else:
                assert n > 0
            if wi >= 4:
                assert np.array_equal(np.asarray(got[1].ring), log.ring)   # full ring: rows dropped

    def test_verify_and_plan_extremes_vs_reference():
        rng = np.random.default_rng(13)
        S = 20
        srcs = _sources(np.random.default_rng(3), S)
        for seed in range(6):
            canary = rng.integers(0, 256, (S, 32), dtype=np.uint8)
            V = 24
            slots = rng.integers(-2, S + 3, V)
            slots[rng.random(V) < 0.2] = 0
            prevs = np.where(rng.random(V) < 0.5, slots - 1, rng.integers(-2, S + 3, V))
            vp = kvc.VerifyPlan(slots.astype(np.int32), rng.integers(-1, 3, V).astype(np.int32),
                                rng.integers(0, 3, V).astype(np.int32), prevs.astype(np.int32),
                                np.array([rng.choice([V, V - 3, 0, -1, 99])], np.int32),
                                np.array([rng.choice([1, 1, 0, 7])], np.int32))
            log = kvc.ViolationLog(rng.integers(0, 256, (5, 64), dtype=np.uint8),
                                   np.array([rng.choice([0, 2, 5, 2**31 - 2, -3])], np.int32),
                                   np.full((12, 8), 0xFF, np.uint8), rng.integers(0, 256, (12, 8), dtype=np.uint8),
                                   np.array([1], np.int32))
            for mode in (1, 2):
                kw = dict(tag=6, check_verify_expected_token=bool(seed % 2), real_kv_sources=srcs,
                          real_kv_hash_mode=mode)
                ref = reference.verify(canary, log, vp, **kw)
                got = kvc.verify(*_to_jax((canary, log, vp)), impl="xla", **kw)
                assert _same(got, ref), (seed, mode)
        # plan with int32 extremes: lengths near 2**31 (saturating totals), huge window, offsets
        big = 2**31 - 1
        for P, E, W, koff, Vc in [([big, big, 5], [big, -big - 1, 1], 0, big, 7),
                                  ([big, 3, -big - 1], [1, 1, 1], 2**31 + 5, -big - 1, 7),
                                  ([big - 2, 6, 4], [0, 2, 3], 3, 1, 9),
                                  ([4, 6, 2], [1, 1, 1], 2, 0, big // 2 ** 26)]:
            args = (np.array([1, 2, 3], np.int32), np.array(P, np.int32), np.array(E, np.int32),
                    rng.integers(-2, 30, (4, 8)).astype(np.int32))
            kw = dict(verify_capacity=Vc, write_req_capacity=4, swa_window_size=W,
                      full_to_swa_index_mapping=rng.integers(-1, 30, 25).astype(np.int32),
                      req_to_verify_expected_tokens=rng.integers(0, 99, (4, 8)).astype(np.int32),
                      req_to_verify_expected_tokens_valid_lens=np.array([big, 3, -1], np.int32),
                      kv_token_id_vs_position_offset=koff)
            ref = reference.plan(*args, **kw)
            got = kvc.plan(*_to_jax(args), impl="xla", **_to_jax(kw))
            assert _same(got, ref), (P, E, W, koff, Vc)
            # the same from a flat table, with starts whose int32 sums with those positions wrap
            for starts in ([0, 8, 16], [big, 5, -big - 1], [-3, big - 2, 2**30]):
                fargs = args[:3] + (args[3].reshape(-1),)
                fkw = dict(kw, row_starts=np.array(starts, np.int32))
                ref = reference.plan(*fargs, **fkw)
                got = kvc.plan(*_to_jax(fargs), impl="xla", **_to_jax(fkw))
                assert _same(got, ref), (P, E, W, koff, Vc, starts)


if __name__ == "__main__":
    which = sys.argv[1]
    if which == "x64":
        print(scenario_x64(sys.argv[2]))
    elif which == "no_native":
        print(scenario_no_native())
    elif which == "shard_map":
        print(scenario_shard_map())
    else:
        raise SystemExit(f"unknown scenario {which!r}")
    # The result is printed; skip interpreter teardown (an intermittent SIGSEGV during jax/XLA
    # shutdown was seen once on a heavily loaded machine, after the digest had been printed).
    sys.stdout.flush()
    os._exit(0)
