"""A tiny serving engine on the runtime (FULL group, K and V halves, real-KV ALL, pages of 4 slots),
for the offload / reload / transfer tests: one request row whose "forward" writes KV that depends
only on (token, position), so equal content in any slot fingerprints the same."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_kvcanary import RealKvSource
from jax_kvcanary.runtime import CanaryBatch, CanaryConfig, CanaryEndpoints

NUM_SLOTS, PAGE, HEADS, DIM = 24, 4, 2, 8
TOKEN_BYTES = HEADS * DIM * 4
PROMPT = list(range(100, 106))


def engine():
    """``(endpoints, state, kv)``: zero KV ``{'k', 'v'}: float32[6, 4, 2, 8]`` (24 slots)."""
    cfg = CanaryConfig(mode="log", real_kv_hash_mode="ALL")
    ep = CanaryEndpoints(cfg, num_slots=NUM_SLOTS, write_req_capacity=1, verify_capacity=16)
    kv = {h: jnp.zeros((NUM_SLOTS // PAGE, PAGE, HEADS, DIM), jnp.float32) for h in ("k", "v")}
    return ep, ep.init_state(), kv


def step(ep, state, kv, slots, prefix, tokens):
    """One serving step of request row 1: ``tokens`` at positions ``prefix..``; ``slots`` holds the
    slot of every position so far. The "forward" writes KV that depends on (token, position)."""
    n = len(tokens)
    table = np.zeros((4, 16), np.int32)
    table[1, :prefix + n] = slots
    loc = np.asarray(slots[prefix:prefix + n], np.int32)
    pos = np.arange(prefix, prefix + n, dtype=np.int32)
    batch = CanaryBatch(jnp.asarray([1], jnp.int32), jnp.asarray([prefix], jnp.int32),
                        jnp.asarray([n], jnp.int32), jnp.asarray(table), jnp.asarray(tokens, jnp.int32),
                        jnp.asarray(pos), jnp.asarray(loc))
    state, ctx = ep.head(state, batch)
    for i, h in enumerate(("k", "v")):
        vals = np.stack([np.random.default_rng([t, p, i]).standard_normal((HEADS, DIM)) for t, p in zip(tokens, pos)])
        flat = kv[h].reshape(NUM_SLOTS, HEADS, DIM).at[loc].set(jnp.asarray(vals, jnp.float32))
        kv[h] = flat.reshape(kv[h].shape)
    real_kv = {"FULL": {h.upper(): RealKvSource(kv[h], PAGE, TOKEN_BYTES, TOKEN_BYTES) for h in ("k", "v")}}
    return ep.tail(state, ctx, real_kv), kv


def rows(violations):
    """``[tag, reasons, slot, position]`` of each decoded violation (JSON-friendly)."""
    return [[v.tag, list(v.reasons), int(v.slot), int(v.position)] for v in violations]
