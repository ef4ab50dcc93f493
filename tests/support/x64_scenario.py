"""A fixed plan -> verify -> write -> verify sequence, printed as one SHA-256 of every output byte.

Run as a script (``python x64_scenario.py IMPL INDEX_DTYPE``) by tests/test_x64.py under x64 off and
on: the digests must agree, whatever the index dtype.
"""

import hashlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvcanary as kvc


def run(impl: str, index_dtype: str) -> str:
    idx = lambda v: jnp.asarray(np.asarray(v), dtype=index_dtype)  # noqa: E731
    rng = np.random.default_rng(7)
    req_to_token = idx(np.arange(4 * 16).reshape(4, 16) + 1)
    pool = idx(rng.integers(0, 1000, (4, 16)))
    kv = jnp.asarray(rng.standard_normal((80, 2, 8)).astype(np.float32)).astype(jnp.bfloat16)
    sources = (kvc.RealKvSource(kv, 1, 32, 32), kvc.RealKvSource(kv, 1, 32, 16),
               kvc.RealKvSource(kv, 1, 32, 16, offset_bytes=16))
    canary, log = kvc.new_canary_buffer(80, 40), kvc.ViolationLog.create(8)
    out = []

    @jax.jit
    def step(canary, log, pool, prefix, extend, ids, pos, loc):
        pool = kvc.scatter_req_token_ids(pool, ids, idx([0, 3, 5, 6]), idx([1, 2, 3]), impl=impl)
        vp, wp = kvc.plan(idx([1, 2, 3]), prefix, extend, req_to_token, verify_capacity=64, write_req_capacity=4,
                          req_to_verify_expected_tokens=pool, req_to_verify_expected_tokens_valid_lens=idx([16, 2, 9]),
                          impl=impl)
        log = kvc.verify(canary, log, vp, tag=2, check_verify_expected_token=True, real_kv_sources=sources,
                         real_kv_hash_mode=kvc.RealKvHashMode.ALL, impl=impl)
        canary, log = kvc.write(canary, log, wp, ids, pos, loc, tag=2, real_kv_sources=sources,
                                real_kv_hash_mode=kvc.RealKvHashMode.PARTIAL, enable_write_input_assert=True,
                                expected_input_tokens=ids, expected_input_positions=pos + 1, impl=impl)
        # the same batch from the flat table: row 3's start is near 2**31 (its int32 sums would wrap)
        flat = kvc.plan(idx([1, 2, 3]), prefix, extend, req_to_token.reshape(-1), verify_capacity=64,
                        write_req_capacity=4, row_starts=idx([16, 30, 2**31 - 2]), impl=impl)
        return canary, log, pool, vp, wp, flat

    prefix = idx([0, 0, 0])
    for t in range(3):
        extend = idx([3, 2, 1]) if t == 0 else idx([1, 1, 1])
        n = int(np.asarray(extend).sum())
        ids = idx(rng.integers(-5, 1 << 20, n))
        pos = idx(np.concatenate([np.arange(p, p + e) for p, e in zip(np.asarray(prefix), np.asarray(extend))]))
        loc = idx(np.concatenate([np.asarray(req_to_token)[r, p:p + e]
                                  for r, p, e in zip([1, 2, 3], np.asarray(prefix), np.asarray(extend))]))
        canary, log, pool, vp, wp, flat = step(canary, log, pool, prefix, extend, ids, pos, loc)
        out += [canary, log, pool, vp, wp, flat]
        prefix = idx(np.asarray(prefix) + np.asarray(extend))
    digest = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(out):
        a = np.asarray(leaf)
        if a.dtype.kind in "iu" and a.dtype.itemsize > 1 and a.dtype != np.uint8:
            a = a.astype(np.int64)  # pool / index outputs: compare values, not width
        digest.update(a.tobytes())
    return digest.hexdigest()


if __name__ == "__main__":
    print(run(sys.argv[1], sys.argv[2]))
