"""A multi-step serving simulation through the public ops.

Several requests, chunked prefill then decode, a shared prefix, a FULL group and an SWA group (window
+ LUT with eviction), the token oracle (scatter -> plan pool -> verify token check) and the write input
assert. Every step runs plan -> HEAD verify+write -> "attention" KV stores -> TAIL verify+write with
real-KV fingerprints, for every group. A clean run records no violation; then each kind of corruption
gives the expected fail bits at the expected slot. Runs on every implementation (``ops`` fixture).
"""

import numpy as np
import jax.numpy as jnp
import pytest

import jax_kvcanary as kvc
from jax_kvcanary.consts import FailReason as F, LaunchTag as T

NUM_SLOTS = 96
SWA_SLOTS = 64
MAX_REQS, MAX_LEN = 6, 48
BS, NTOK = 4, 20          # static batch rows and token slots (padding: rp 0, out_cache_loc -1)
CHUNK, WINDOW = 5, 4
KV_BYTES = 32             # one token's K bytes in the toy KV arrays (page_size 1)


def snapshot(host):
    """A device copy of host state that the engine mutates later: JAX may read a numpy argument
    after the call that received it returns (the host-to-device copy is asynchronous), so it must get
    a buffer nobody writes to."""
    return jnp.asarray(np.array(host, copy=True))


class Engine:
    """A tiny paged-KV engine: allocators, req_to_token, LUT, token pool, KV bytes, canaries."""

    def __init__(self, ops, seed=0):
        self.ops = ops
        self.rng = np.random.default_rng(seed)
        self.req_to_token = np.zeros((MAX_REQS, MAX_LEN), np.int32)
        self.lut = np.zeros(NUM_SLOTS, np.int32)          # full slot -> SWA slot, 0 = evicted
        self.free_full = list(range(1, NUM_SLOTS))          # slot 0 is the padding slot
        self.free_swa = list(range(1, SWA_SLOTS))
        self.kv = {"full": np.zeros((NUM_SLOTS, KV_BYTES), np.uint8), "swa": np.zeros((SWA_SLOTS, KV_BYTES), np.uint8)}
        self.canary = {(g, e): kvc.new_canary_buffer(n) for g, n in (("full", NUM_SLOTS), ("swa", SWA_SLOTS))
                       for e in ("head", "tail")}
        self.pool = jnp.zeros((MAX_REQS, MAX_LEN), jnp.int32)
        self.log = kvc.ViolationLog.create(64)
        self.reqs = {}  # rp -> dict(ids=list, prompt_len, kv_len)
        self.pending_write = None  # hook for corruption tests: (field, value) applied to this step's writes

    # -- request lifecycle -------------------------------------------------------------------------
    def add(self, rp, prompt, share_from=None, shared=0):
        self.reqs[rp] = dict(ids=list(prompt), prompt_len=len(prompt), kv_len=0)
        if share_from is not None:  # prefix cache hit: reuse the donor's first `shared` slots
            self.req_to_token[rp, :shared] = self.req_to_token[share_from, :shared]
            self.reqs[rp]["kv_len"] = shared

    def batch(self):
        """Static-shape batch arrays for one step."""
        rows = []
        for rp, r in self.reqs.items():
            todo = r["prompt_len"] - r["kv_len"]
            rows.append((rp, r["kv_len"], min(CHUNK, todo) if todo > 0 else 1))
        rpi, pre, ext = np.zeros(BS, np.int32), np.zeros(BS, np.int32), np.zeros(BS, np.int32)
        ids, pos, loc = np.zeros(NTOK, np.int32), np.zeros(NTOK, np.int32), np.full(NTOK, -1, np.int32)
        n = 0
        for b, (rp, p, e) in enumerate(rows):
            rpi[b], pre[b], ext[b] = rp, p, e
            for j in range(e):
                slot = self.free_full.pop(0)
                self.req_to_token[rp, p + j] = slot
                self.lut[slot] = self.free_swa.pop(0)
                ids[n], pos[n], loc[n] = self.reqs[rp]["ids"][p + j], p + j, slot
                n += 1
        return rows, rpi, pre, ext, ids, pos, loc

    def refresh_pool(self):
        flat, offs, rps = [], [0], []
        for rp, r in self.reqs.items():
            flat += r["ids"]
            offs.append(len(flat))
            rps.append(rp)
        while len(rps) < BS:
            rps.append(0)
            offs.append(len(flat))
        self.pool = self.ops.scatter_req_token_ids(
            jnp.asarray(np.asarray(self.pool)), jnp.asarray(np.array(flat, np.int32)),
            jnp.asarray(np.array(offs, np.int32)), jnp.asarray(np.array(rps, np.int32)))

    # -- one serving step --------------------------------------------------------------------------
    def step(self, pre_forward=None, post_forward=None):
        self.refresh_pool()
        rows, rpi, pre, ext, ids, pos, loc = self.batch()
        exp_ids, exp_pos = ids.copy(), pos.copy()
        if self.pending_write is not None:  # an engine bug: it feeds the wrong token/position
            field, index, value = self.pending_write
            {"ids": ids, "pos": pos}[field][index] = value
            self.pending_write = None
        if pre_forward:
            pre_forward(self)
        groups = {"full": (0, None, loc), "swa": (WINDOW, self.lut, np.where(loc >= 0, self.lut[np.maximum(loc, 0)], -1))}
        for g, (window, lut, gloc) in groups.items():
            head_tag, tail_tag = (T.HEAD_K_FULL, T.TAIL_K_FULL) if g == "full" else (T.HEAD_K_SWA, T.TAIL_K_SWA)
            vp, wp = self.ops.plan(
                jnp.asarray(rpi), jnp.asarray(pre), jnp.asarray(ext), snapshot(self.req_to_token),
                verify_capacity=64, write_req_capacity=BS, swa_window_size=window,
                full_to_swa_index_mapping=None if lut is None else snapshot(lut),
                req_to_verify_expected_tokens=jnp.asarray(np.asarray(self.pool)),
                req_to_verify_expected_tokens_valid_lens=jnp.asarray(
                    np.array([len(self.reqs[rp]["ids"]) if rp else 0 for rp in rpi], np.int32)))
            args = (jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(gloc))
            oracle = dict(enable_write_input_assert=True, expected_input_tokens=jnp.asarray(exp_ids),
                          expected_input_positions=jnp.asarray(exp_pos))
            head = self.canary[(g, "head")]
            self.log = self.ops.verify(head, self.log, vp, tag=head_tag, check_verify_expected_token=True)
            head, self.log = self.ops.write(head, self.log, wp, *args, tag=head_tag, **oracle)
            self.canary[(g, "head")] = head
            # "attention": store this step's K bytes
            for s in gloc[gloc >= 0]:
                self.kv[g][s] = self.rng.integers(1, 256, KV_BYTES, dtype=np.uint8)
            if post_forward and g == "full":
                post_forward(self)
            src = (kvc.RealKvSource(snapshot(self.kv[g]), 1, KV_BYTES, KV_BYTES),)
            tail = self.canary[(g, "tail")]
            self.log = self.ops.verify(tail, self.log, vp, tag=tail_tag, check_verify_expected_token=True,
                                       real_kv_sources=src, real_kv_hash_mode=kvc.RealKvHashMode.ALL)
            tail, self.log = self.ops.write(tail, self.log, wp, *args, tag=tail_tag, real_kv_sources=src,
                                            real_kv_hash_mode=kvc.RealKvHashMode.ALL, **oracle)
            self.canary[(g, "tail")] = tail
        for rp, p, e in rows:  # sampled tokens: decode appends one id per step
            r = self.reqs[rp]
            r["kv_len"] = p + e
            if r["kv_len"] >= r["prompt_len"]:
                r["ids"].append(int(self.rng.integers(0, 30000)))
        self.evict_swa()
        return rows

    def evict_swa(self):
        keep = set()
        for rp, r in self.reqs.items():
            P = r["kv_len"]
            keep |= set(self.req_to_token[rp, max(0, P - WINDOW):P].tolist())
        for slot in np.nonzero(self.lut)[0]:
            if int(slot) not in keep:
                self.free_swa.append(int(self.lut[slot]))
                self.lut[slot] = 0

    def new_rows(self, since):
        rows = np.asarray(self.log.rows())
        return rows[since:]


def serve(ops, steps, hooks=None):
    hooks = hooks or {}
    eng = Engine(ops)
    eng.add(1, list(range(100, 112)))
    eng.add(2, list(range(100, 106)) + [7, 8, 9], share_from=None)
    eng.add(3, [5, 6, 7, 8])
    for t in range(steps):
        if t == 3:  # request 4 arrives and hits request 1's cached prefix (its SWA tail is still resident)
            eng.add(4, list(range(100, 110)) + [1, 2], share_from=1, shared=10)
        hook = hooks.get(t)
        eng.step(**hook) if hook else eng.step()
    return eng


def test_clean_run_has_no_violations(ops):
    eng = serve(ops, 9)
    assert eng.log.total() == 0, eng.log.rows()
    runs = eng.log.kernel_runs()
    for tag in (T.HEAD_K_FULL, T.TAIL_K_FULL, T.HEAD_K_SWA, T.TAIL_K_SWA):
        assert runs[tag] == 2 * 9  # one verify + one write per step
    slots = eng.log.slot_runs()
    assert slots[T.HEAD_K_FULL] == slots[T.TAIL_K_FULL] > 0
    assert slots[T.HEAD_K_SWA] < slots[T.HEAD_K_FULL]  # the window verifies fewer slots
    assert eng.reqs[4]["kv_len"] > 10 and eng.reqs[1]["kv_len"] == 12 + 9 - 3  # prefill in chunks, then decode


def corrupt_record(field, value, canary_key=("full", "head")):
    def hook(eng):
        slot = int(eng.req_to_token[1, 3])
        fields = kvc.canary_fields(eng.canary[canary_key])
        raw = np.array(np.asarray(eng.canary[canary_key]))
        raw[slot, 8 * field:8 * field + 8] = np.array([value], "<i8").view(np.uint8)
        eng.canary[canary_key] = jnp.asarray(raw)
        eng.corrupted = (slot, fields[slot])
    return hook


def rows_of(eng, tag):
    rows = eng.log.rows()
    return rows[rows[:, 0] == tag]


def test_corrupt_token_field(ops):
    eng = serve(ops, 5, {4: dict(pre_forward=corrupt_record(0, 999))})
    slot, before = eng.corrupted
    succ = int(eng.req_to_token[1, 4])
    rows = rows_of(eng, T.HEAD_K_FULL)
    got = {(int(r[1]), int(r[7])) for r in rows}
    # request 1 and request 4 (sharing the prefix) both see the slot and its successor
    assert got == {(slot, F.VERIFY_TOKEN_MISMATCH), (succ, F.VERIFY_CHAIN_HASH_MISMATCH)}
    tok_row = rows[rows[:, 1] == slot][0]
    assert tok_row[3] == 999 and tok_row[4] == before[0] and tok_row[2] == 3
    assert len(rows_of(eng, T.TAIL_K_FULL)) == 0 and len(rows_of(eng, T.HEAD_K_SWA)) == 0


def test_corrupt_position_field(ops):
    eng = serve(ops, 5, {4: dict(pre_forward=corrupt_record(1, 77))})
    slot, _ = eng.corrupted
    succ = int(eng.req_to_token[1, 4])
    got = {(int(r[1]), int(r[7])) for r in rows_of(eng, T.HEAD_K_FULL)}
    assert got == {(slot, F.VERIFY_POSITION_MISMATCH), (succ, F.VERIFY_CHAIN_HASH_MISMATCH)}


def test_corrupt_prev_hash_field(ops):
    eng = serve(ops, 5, {4: dict(pre_forward=corrupt_record(2, 12345))})
    slot, before = eng.corrupted
    succ = int(eng.req_to_token[1, 4])
    rows = rows_of(eng, T.HEAD_K_FULL)
    # the slot's own link breaks, and so does its successor's (it chains from the stored prev_hash)
    assert {(int(r[1]), int(r[7])) for r in rows} == {(slot, F.VERIFY_CHAIN_HASH_MISMATCH),
                                                       (succ, F.VERIFY_CHAIN_HASH_MISMATCH)}
    own = rows[rows[:, 1] == slot][0]
    assert own[5] == 12345 and own[6] == before[2]


def test_corrupt_kv_byte(ops):
    def flip(eng):
        slot = int(eng.req_to_token[3, 1])
        eng.kv["full"][slot, 5] ^= 0xFF
        eng.flipped = slot
    eng = serve(ops, 5, {4: dict(post_forward=flip)})
    rows = eng.log.rows()
    assert {(int(r[0]), int(r[1]), int(r[7])) for r in rows} == {
        (T.TAIL_K_FULL, eng.flipped, F.VERIFY_REAL_KV_HASH_MISMATCH)}


def test_corrupt_req_to_token_entry(ops):
    def swap(eng):
        a, b = int(eng.req_to_token[3, 1]), int(eng.req_to_token[1, 5])
        eng.req_to_token[3, 1] = b
        eng.swapped = (a, b)
    eng = serve(ops, 5, {4: dict(pre_forward=swap)})
    a, b = eng.swapped
    succ = int(eng.req_to_token[3, 2])
    for tag in (T.HEAD_K_FULL, T.TAIL_K_FULL):
        got = {(int(r[1]), int(r[7])) for r in rows_of(eng, tag)}
        # the planted slot holds another request's token at another position, chained elsewhere
        assert (b, F.VERIFY_CHAIN_HASH_MISMATCH | F.VERIFY_POSITION_MISMATCH | F.VERIFY_TOKEN_MISMATCH) in got
        assert (succ, F.VERIFY_CHAIN_HASH_MISMATCH) in got


@pytest.mark.parametrize("field, bits", [("ids", F.WRITE_TOKEN_MISMATCH), ("pos", F.WRITE_POSITION_MISMATCH)])
def test_wrong_token_or_position_written(ops, field, bits):
    eng = Engine(ops)
    eng.add(1, list(range(10, 20)))
    eng.step()                              # prefill chunk 1 (positions 0..4)
    eng.pending_write = (field, 2, 555)     # the engine feeds a wrong value at flat entry 2
    eng.step()                              # chunk 2 (positions 5..9)
    rows = eng.log.rows()
    slot = int(eng.req_to_token[1, 7])
    for tag in (T.HEAD_K_FULL, T.TAIL_K_FULL):
        got = rows[(rows[:, 0] == tag) & (rows[:, 1] == slot)]
        if field == "ids":  # input assert only: the position chain is intact
            assert [int(r[7]) for r in got] == [bits]
            assert got[0][3] == 555 and got[0][4] == 17
        else:  # input assert, then the chain-position assert (expects 7)
            assert [int(r[7]) for r in got] == [bits, F.WRITE_POSITION_MISMATCH]
            assert got[0][2] == 555 and got[0][6] == 7 and got[1][6] == 7
