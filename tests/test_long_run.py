"""Long-run consistency of a small serving loop.

A minimal engine: ``bs`` requests over a fixed slot table; each step every request extends by 1-3
tokens (a finished request restarts at position 0 and reuses its slots, a new chain); the jitted,
donated step runs plan -> HEAD verify + write -> TAIL verify + write (TAIL with a real-KV source).
At random steps one fault with an exactly known number of rows is injected:

  1. an out-of-range ``out_cache_loc`` for a request's first token   -> 1 WRITE_SLOT row per write
  2. an out-of-range seed in the write plan                          -> 1 WRITE_SEED row per write
  3. a position off by one on a request's first token (prefix > 0)   -> min(E, 2) chain-position rows
                                                                        per write
  4. a wrong expected position on the HEAD verify's first entry      -> 1 position-mismatch row

(the faulted request restarts at the next step, so a fault never leaks into later steps). Every
``KVC_LONG_CHECK`` steps the test asserts: kernel counters == steps x launches per tag; slot counters
== the entries planned and written; write_index == the faults' expected rows; the ring holds exactly
the first ``cap`` expected rows (by tag, fail bits and IndexKind) and, once full, never changes again
(fill-once overflow).

``KVC_LONG_STEPS`` sets the ffi step count (default 10000, the full run: it takes ~6 s);
``KVC_LONG_XLA_STEPS`` the count for ``impl="xla"`` (default 1500, ~4 s after a ~30 s compile;
marked ``slow``).
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcanary as kvc
from jax_kvcanary.consts import IndexKind, LaunchTag

from tests.support.impls import BACKEND_PARAMS

STEPS = {"ffi": int(os.environ.get("KVC_LONG_STEPS", "10000")),
         "xla": int(os.environ.get("KVC_LONG_XLA_STEPS", "1500"))}
CHECK_EVERY = int(os.environ.get("KVC_LONG_CHECK", "250"))

R, LMAX = 5, 12            # pool rows (row 0 = padding), positions per request
BS = R - 1                 # batch rows 1..4
S = 1 + BS * LMAX          # slot 0 = padding slot
N = 3 * BS                 # tokens per step (padded)
VC, WC, CAP = BS * LMAX, BS + 1, 48
HEAD, TAIL = int(LaunchTag.HEAD_K_FULL), int(LaunchTag.TAIL_K_FULL)
TABLE = np.zeros((R, LMAX), np.int32)
for _rp in range(1, R):
    TABLE[_rp] = 1 + (_rp - 1) * LMAX + np.arange(LMAX)


def make_step(impl):
    table = jnp.asarray(TABLE)
    kv = jnp.asarray(np.random.default_rng(1).integers(0, 256, (S, 2, 16), dtype=np.uint8))
    sources = (kvc.RealKvSource(kv, 1, 32, 32),)

    def step(head, tail, log, prefix, extend, ids, pos, loc, seed_fault, vpos_fault):
        rpi = jnp.arange(1, R, dtype=jnp.int32)
        vp, wp = kvc.plan(rpi, prefix, extend, table, verify_capacity=VC, write_req_capacity=WC, impl=impl)
        # fault 2: seed of batch row seed_fault[0] -> out of range (no-op for -1)
        seeds = jnp.where(jnp.arange(WC) == seed_fault[0], S + 5, wp.seed_slot_indices)
        wp = kvc.WritePlan(wp.offsets, seeds, wp.num_valid_reqs)
        # fault 4: expected position of the HEAD verify's first entry off by vpos_fault[0]
        head_vp = kvc.VerifyPlan(vp.slot_indices, vp.expected_tokens,
                                 vp.expected_positions.at[0].add(vpos_fault[0]), vp.prev_slot_indices,
                                 vp.num_valid, vp.enable)
        log = kvc.verify(head, log, head_vp, tag=HEAD, impl=impl)
        head, log = kvc.write(head, log, wp, ids, pos, loc, tag=HEAD, impl=impl)
        log = kvc.verify(tail, log, vp, tag=TAIL, real_kv_sources=sources,
                         real_kv_hash_mode=kvc.RealKvHashMode.ALL, impl=impl)
        tail, log = kvc.write(tail, log, wp, ids, pos, loc, tag=TAIL, real_kv_sources=sources,
                              real_kv_hash_mode=kvc.RealKvHashMode.ALL, impl=impl)
        return head, tail, log

    return jax.jit(step, donate_argnums=(0, 1, 2))


class Model:
    """Host-side schedule, fault injection and expected counters/rows."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.P = np.zeros(BS, np.int64)
        self.restart = np.zeros(BS, bool)
        self.kernel = {HEAD: 0, TAIL: 0}
        self.slots = {HEAD: 0, TAIL: 0}
        self.rows = []        # expected (tag, fail bits, IndexKind code or 0), in ring order
        self.faults = 0

    def next_inputs(self):
        rng = self.rng
        P = np.where(self.restart, 0, self.P)
        E = rng.choice([1, 1, 1, 2, 3], BS)
        P = np.where(P + E > LMAX, 0, P)  # finished: restart at position 0 (slot reuse)
        self.restart[:] = False
        ids = np.zeros(N, np.int32)
        pos = np.zeros(N, np.int32)
        loc = np.full(N, -1, np.int32)    # padding tokens are outside every range anyway
        first = []
        k = 0
        for r in range(BS):
            first.append(k)
            for j in range(E[r]):
                ids[k] = rng.integers(0, 32000)
                pos[k] = P[r] + j
                loc[k] = TABLE[r + 1, P[r] + j]
                k += 1
        seed_fault, vpos_fault = -1, 0
        step_rows = []
        if rng.random() < 1 / 25:
            kind, r = int(rng.integers(1, 5)), int(rng.integers(0, BS))
            if kind == 3 and P[r] == 0:
                kind = 1  # the chain-position assert needs a real seed
            if kind == 4 and P.sum() == 0:
                kind = 2  # no verify entry this step
            self.faults += 1
            if kind == 1:
                loc[first[r]] = S + 3
                step_rows = [("w", 64, int(IndexKind.WRITE_SLOT))]
            elif kind == 2:
                seed_fault = r
                step_rows = [("w", 64, int(IndexKind.WRITE_SEED))]
            elif kind == 3:
                pos[first[r]] += 1
                # token 0 at P+1 (expected P), token 1 at P+1 again (expected P+2); then in step
                step_rows = [("w", 16, 0)] * min(int(E[r]), 2)
            else:
                vpos_fault = 1
                step_rows = [("hv", 2, 0)]
            if kind != 4:
                self.restart[r] = True
        # ring order within a step: HEAD verify, HEAD write, TAIL verify, TAIL write
        self.rows += [(HEAD, b, c) for w, b, c in step_rows if w == "hv"]
        self.rows += [(HEAD, b, c) for w, b, c in step_rows if w == "w"]
        self.rows += [(TAIL, b, c) for w, b, c in step_rows if w == "w"]
        for tag in (HEAD, TAIL):
            self.kernel[tag] += 2
            self.slots[tag] += int(P.sum()) + int(E.sum())  # verify entries + written entries
        self.P = P + E
        return (P.astype(np.int32), E.astype(np.int32), ids, pos, loc,
                np.array([seed_fault], np.int32), np.array([vpos_fault], np.int32))


def _check(log, model, frozen, step):
    wi = log.total()
    assert wi == len(model.rows), f"step {step}: write_index {wi} != expected rows {len(model.rows)}"
    kr, sr = log.kernel_runs(), log.slot_runs()
    for tag in range(kvc.NUM_LAUNCH_TAGS):
        assert kr[tag] == model.kernel.get(tag, 0), (step, tag, kr.tolist())
        assert sr[tag] == model.slots.get(tag, 0), (step, tag, sr.tolist())
    ring = np.asarray(log.ring).view("<i8")
    n = min(wi, CAP)
    got = [(int(r[0]), int(r[7]), int(r[5]) if r[7] == 64 else 0) for r in ring[:n]]
    assert got == model.rows[:n], f"step {step}: ring rows differ from the injected faults"
    if frozen is not None:
        assert np.array_equal(np.asarray(log.ring), frozen), f"step {step}: a full ring changed (not fill-once)"
    return np.asarray(log.ring).copy() if wi >= CAP else None


@pytest.mark.parametrize("impl", BACKEND_PARAMS)
def test_long_run_counters_rows_and_fill_once_ring(impl):
    steps = STEPS[impl]
    step_fn = make_step(impl)
    head, tail = kvc.new_canary_buffer(S), kvc.new_canary_buffer(S)
    log = kvc.ViolationLog.create(CAP)
    model = Model(seed=11)
    frozen = None
    t0 = time.perf_counter()
    for t in range(1, steps + 1):
        head, tail, log = step_fn(head, tail, log, *model.next_inputs())
        if t == 1:
            jax.block_until_ready(log)
            t1 = time.perf_counter()  # compile + first step
        if t % CHECK_EVERY == 0 or t == steps:
            frozen = _check(log, model, frozen, t)
    elapsed = time.perf_counter() - t1
    assert model.faults > 0 and len(model.rows) > 0
    if steps >= 40 * CAP:
        assert log.total() > CAP, "the run never overflowed the ring"
    print(f"\n{impl}: compile + step 1 {t1 - t0:.1f}s, then {steps - 1} steps in {elapsed:.1f}s "
          f"({1e6 * elapsed / max(steps - 1, 1):.0f} us/step), "
          f"{model.faults} faults, {log.total()} rows (ring capacity {CAP})")
