"""Benchmark inputs that look like a real serving step.

A paged KV pool of ``num_slots`` slots (``page_size`` slots per page, page 0 reserved: slot 0 is the
padding slot). Each request owns whole pages drawn from a random permutation of the pool, so its
slots are contiguous within a page and scattered across the pool from page to page (what a paged
allocator hands out after a while). The pool has ``slack`` times the slots the requests need.

The canary is populated by a real ``write`` of every prefix token (the same op the step runs), so a
step's ``verify`` takes the clean path: every entry is checked and no row is recorded. The step
itself is ``plan(prefix_lens=P, extend_seq_lens=E)``: verify entries are the prefix slots (the SWA
window only, for SWA) and write entries the ``E`` new tokens per request, seeded by the slot at P-1.

SWA: a LUT maps every full-pool slot to an SWA-pool slot through a second random page permutation
(no eviction in the window, so the window's chain links are all checkable); the canary then lives in
the SWA slot space. Real-KV: ``num_sources`` random uint8 KV arrays ``[canary_slots, kv_bytes]``
(page_size 1, e.g. one layer's K of one KV head x 128 dims x bf16 = 256 bytes); the prefix records
carry their fingerprints, so TAIL-style verifies are clean too.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvcanary as kvc
from jax_kvcanary import RealKvHashMode

PAGE_SIZE = 16
SLACK = 1.25
KV_BYTES = 256
TOKEN_VOCAB = 32000
TAG = int(kvc.LaunchTag.TAIL_K_FULL)


@dataclasses.dataclass
class Scenario:
    name: str
    bs: int
    prefix: int
    extend: int
    window: int
    mode: RealKvHashMode
    num_sources: int
    num_slots: int            # canary slots (SWA: the SWA pool)
    page_size: int
    # step inputs (device arrays)
    rpi: jax.Array
    prefix_lens: jax.Array
    extend_lens: jax.Array
    req_to_token: jax.Array
    lut: Optional[jax.Array]
    input_ids: jax.Array
    positions: jax.Array
    out_cache_loc: jax.Array   # canary slots (LUT-translated for SWA)
    sources: Tuple            # RealKvSource...
    canary: jax.Array          # populated with every prefix record (read-only for verify)
    verify_plan: kvc.VerifyPlan
    write_plan: kvc.WritePlan
    verify_capacity: int

    @property
    def verify_entries(self) -> int:
        return self.bs * (min(self.prefix, self.window) if self.window else self.prefix)

    @property
    def write_entries(self) -> int:
        return self.bs * self.extend

    def describe(self) -> dict:
        return {"name": self.name, "bs": self.bs, "prefix": self.prefix, "extend": self.extend,
                "swa_window": self.window, "real_kv_mode": self.mode.name, "num_sources": self.num_sources,
                "num_slots": self.num_slots, "page_size": self.page_size,
                "verify_entries": self.verify_entries, "write_entries": self.write_entries,
                "kv_bytes_per_token": KV_BYTES if self.num_sources else 0}


@functools.lru_cache(maxsize=None)
def _jit_plan(vcap, wcap, window, has_lut):
    def f(rpi, p, e, r2t, lut):
        return kvc.plan(rpi, p, e, r2t, verify_capacity=vcap, write_req_capacity=wcap, swa_window_size=window,
                        full_to_swa_index_mapping=lut if has_lut else None)
    return jax.jit(f)


@functools.lru_cache(maxsize=None)
def _jit_write(mode):
    def f(canary, log, wp, ids, pos, loc, srcs):
        return kvc.write(canary, log, wp, ids, pos, loc, tag=TAG, real_kv_sources=srcs, real_kv_hash_mode=mode)
    return jax.jit(f, donate_argnums=(0, 1))


def build(name: str, bs: int, prefix: int, extend: int, *, window: int = 0,
          mode: RealKvHashMode = RealKvHashMode.NONE, num_sources: int = 0, seed: int = 0,
          page_size: int = PAGE_SIZE, slack: float = SLACK) -> Scenario:
    """Build one scenario on the default device (see the module docstring). The canary is populated and
    the plans made with the default backend of the platform (``impl=None``: the native one if built)."""
    rng = np.random.default_rng(seed)
    length = prefix + extend
    ppr = max(1, -(-length // page_size))            # pages per request
    lp = ppr * page_size
    need_pages = bs * ppr
    num_pages = int(np.ceil(need_pages * slack)) + 1  # + page 0 (reserved: slot 0 = padding)
    S = num_pages * page_size
    perm = rng.permutation(np.arange(1, num_pages, dtype=np.int64))[:need_pages]
    r2t = np.zeros((bs + 1, lp), np.int32)
    r2t[1:] = (perm.reshape(bs, ppr, 1) * page_size + np.arange(page_size)).reshape(bs, lp)
    tokens = rng.integers(1, TOKEN_VOCAB, size=(bs + 1, lp), dtype=np.int32)
    rpi = np.arange(1, bs + 1, dtype=np.int32)

    lut = None
    translate = lambda x: x  # noqa: E731
    if window:
        swa_perm = np.concatenate([[0], rng.permutation(np.arange(1, num_pages))])
        lut_np = (swa_perm.reshape(-1, 1) * page_size + np.arange(page_size)).reshape(-1).astype(np.int32)
        lut_np[0] = 0
        lut = jnp.asarray(lut_np)
        translate = lambda x: lut_np[x]  # noqa: E731

    sources = ()
    if num_sources:
        sources = tuple(
            kvc.RealKvSource(jnp.asarray(rng.integers(0, 256, size=(S, KV_BYTES), dtype=np.uint8)), 1, KV_BYTES,
                             KV_BYTES) for _ in range(num_sources))

    # populate: one write of every prefix token (positions 0..P-1), the op the step itself runs
    canary = kvc.new_canary_buffer(S)
    log = kvc.ViolationLog.create(ring_capacity=64)
    if prefix > 0:
        _, wp0 = _jit_plan(1, bs, 0, False)(jnp.asarray(rpi), jnp.zeros(bs, jnp.int32), jnp.full(bs, prefix, jnp.int32),
                                            jnp.asarray(r2t), None)
        loc0 = translate(r2t[1:, :prefix]).reshape(-1)
        ids0 = tokens[1:, :prefix].reshape(-1)
        pos0 = np.tile(np.arange(prefix, dtype=np.int32), bs)
        canary, log = _jit_write(RealKvHashMode(mode))(canary, log, wp0, jnp.asarray(ids0), jnp.asarray(pos0),
                                                    jnp.asarray(loc0), sources)
        if log.total():
            raise RuntimeError(f"bench scenario {name}: populating the canary recorded {log.total()} rows")

    vcap = max(1, bs * (min(prefix, window) if window else prefix))
    vp, wp = _jit_plan(vcap, bs, window, lut is not None)(
        jnp.asarray(rpi), jnp.full(bs, prefix, jnp.int32), jnp.full(bs, extend, jnp.int32), jnp.asarray(r2t), lut)
    ids = tokens[1:, prefix:prefix + extend].reshape(-1)
    pos = np.tile(np.arange(prefix, prefix + extend, dtype=np.int32), bs)
    loc = translate(r2t[1:, prefix:prefix + extend]).reshape(-1).astype(np.int32)
    sc = Scenario(name=name, bs=bs, prefix=prefix, extend=extend, window=window, mode=RealKvHashMode(mode),
                  num_sources=num_sources, num_slots=S, page_size=page_size, rpi=jnp.asarray(rpi),
                  prefix_lens=jnp.full(bs, prefix, jnp.int32), extend_lens=jnp.full(bs, extend, jnp.int32),
                  req_to_token=jnp.asarray(r2t), lut=lut, input_ids=jnp.asarray(ids), positions=jnp.asarray(pos),
                  out_cache_loc=jnp.asarray(loc), sources=sources, canary=jax.block_until_ready(canary),
                  verify_plan=vp, write_plan=wp, verify_capacity=vcap)
    # every buffer is ready before anyone (the native baselines included) reads it through a pointer
    jax.block_until_ready((sc.verify_plan, sc.write_plan, sc.input_ids, sc.positions, sc.out_cache_loc,
                           sc.req_to_token, sc.lut, [s.array for s in sc.sources]))
    return sc
