"""SWEEP plans: verify the chains a prefix cache holds, in power-of-two buckets (format.md §11).

A chain entry is ``(slot, position, prev_slot)``: for every cached node slot, its position is its
depth in the tree and ``prev_slot`` the slot before it (the parent's last slot for a node's first
slot, -1 at a root child). The plan is verified against the TAIL canaries with the SWEEP tags
(``CanaryEndpoints.sweep``), with real-KV sources and without a token check.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from ..inputs import VerifyPlan

DEFAULT_MIN_CAPACITY = 256


def bucket_capacity(n: int, min_capacity: int = DEFAULT_MIN_CAPACITY) -> int:
    """The smallest power of two ``>= max(n, min_capacity, 1)``: repeated sweeps reuse compiled code."""
    n = max(int(n), int(min_capacity), 1)
    return 1 << (n - 1).bit_length()


def as_chain_array(chains) -> np.ndarray:
    """``chains`` (an ``[n, 3]`` array or a sequence of ``(slot, position, prev_slot)``) -> int64[n, 3]."""
    arr = np.asarray(chains, dtype=np.int64)
    if arr.size == 0:
        return np.zeros((0, 3), np.int64)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError("kv-canary: sweep chains must be (slot, position, prev_slot) triples, got "
                         f"shape {arr.shape}")
    return arr


def translate_chains(chains, lut) -> np.ndarray:
    """Map full-pool slots and prevs to SWA slots through ``lut`` (host array).

    An evicted slot (LUT 0) becomes 0, so verify skips the entry (slot) or its chain check (prev);
    ``prev = -1`` (a root child) stays -1. An index outside the LUT becomes -1, which verify
    reports as out of range.
    """
    arr = as_chain_array(chains).copy()
    lut = np.asarray(lut, dtype=np.int64)

    def t(x, keep_negative):
        ok = (x >= 0) & (x < lut.shape[0])
        out = np.where(ok, lut[np.clip(x, 0, max(lut.shape[0] - 1, 0))], -1)
        return np.where(x < 0, x, out) if keep_negative else out

    arr[:, 0] = t(arr[:, 0], keep_negative=False)
    arr[:, 2] = t(arr[:, 2], keep_negative=True)
    return arr


def build_sweep_plan(chains, *, capacity: Optional[int] = None,
                     min_capacity: int = DEFAULT_MIN_CAPACITY) -> VerifyPlan:
    """A ``VerifyPlan`` over the chain entries, padded with zeros to ``capacity`` (default: the
    power-of-two bucket of ``len(chains)``). Arrays are int32; expected tokens are -1.
    """
    arr = as_chain_array(chains)
    n = arr.shape[0]
    cap = bucket_capacity(n, min_capacity) if capacity is None else int(capacity)
    if n > cap:
        raise ValueError(f"kv-canary: {n} sweep entries do not fit capacity {cap}")
    pad = np.zeros((cap, 3), np.int32)
    pad[:n] = arr
    tokens = np.zeros((cap,), np.int32)
    tokens[:n] = -1
    return VerifyPlan(
        slot_indices=jnp.asarray(pad[:, 0]), expected_tokens=jnp.asarray(tokens),
        expected_positions=jnp.asarray(pad[:, 1]), prev_slot_indices=jnp.asarray(pad[:, 2]),
        num_valid=jnp.asarray(np.array([n], np.int32)), enable=jnp.asarray(np.ones((1,), np.int32)))


def build_group_sweep_plans(chains, groups: Sequence[str], *, lut=None,
                            min_capacity: int = DEFAULT_MIN_CAPACITY) -> Mapping[str, VerifyPlan]:
    """``{group: VerifyPlan}`` for ``CanaryEndpoints.sweep``: FULL uses the chains as they are, SWA
    their LUT translation. Every group gets the same bucket capacity (one compiled sweep)."""
    arr = as_chain_array(chains)
    cap = bucket_capacity(arr.shape[0], min_capacity)
    plans = {}
    for g in groups:
        if g == "SWA":
            if lut is None:
                raise ValueError("kv-canary: an SWA sweep needs the full_to_swa_index_mapping (lut)")
            plans[g] = build_sweep_plan(translate_chains(arr, lut), capacity=cap)
        else:
            plans[g] = build_sweep_plan(arr, capacity=cap)
    return plans
