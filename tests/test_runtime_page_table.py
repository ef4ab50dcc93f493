"""The endpoints on a page-table batch (``CanaryBatch.req_to_token_row_starts``): the step's flat
page table, as attention reads it, with each row's segment start. The write stamps the step's new
slots first, then the verify checks every entry of every segment, the step's own tokens included,
so a wrong entry is reported in the step that reads it."""

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvcanary as kvc
from jax_kvcanary.consts import LaunchTag as T
from jax_kvcanary.runtime import CanaryBatch, CanaryConfig, CanaryEndpoints, Monitor

S = 64          # slots
TABLE = 48      # page-table entries per step (the engine's bucket)
B = 4           # batch rows
N = 8           # token bucket


def i32(x):
    return jnp.asarray(np.asarray(x, np.int32))


def sources(kv):
    s = kvc.RealKvSource(kv, 1, 64, 64)
    return {"FULL": {"K": s, "V": s}}


def make():
    cfg = CanaryConfig(health_interval=0)
    ep = CanaryEndpoints(cfg, num_slots=S, write_req_capacity=B, verify_capacity=TABLE)

    def step(st, kv, b):
        st, ctx = ep.head(st, b)
        kv = kv.at[b.out_cache_loc].set(b.input_ids[:, None].astype(jnp.float32) + 0.5, mode="drop")
        return ep.tail(st, ctx, sources(kv)), kv

    return ep, jax.jit(step, donate_argnums=(0, 1))


class Engine:
    """Requests with their slots; ``batch`` lays their segments out back to back (gaps of
    ``gap`` entries between segments, like page alignment) the way sglang-jax builds cache_loc."""

    def __init__(self):
        self.slots = {}          # rid -> list of slots
        self.next_slot = 1

    def alloc(self):
        s = self.next_slot
        self.next_slot += 1
        return s

    def batch(self, steps, *, gap=0, table_edit=None, loc_edit=None):
        """``steps``: ``[(rid, new_tokens)]`` in batch order."""
        table = np.zeros(TABLE, np.int32)
        starts, prefix, extend, ids, pos, loc = [], [], [], [], [], []
        at = 0
        for rid, e in steps:
            own = self.slots.setdefault(rid, [])
            p = len(own)
            new = [self.alloc() for _ in range(e)]
            starts.append(at)
            prefix.append(p)
            extend.append(e)
            ids += [100 * rid + p + i for i in range(e)]
            pos += [p + i for i in range(e)]
            loc += new
            table[at: at + p + e] = own + new
            at += p + e + gap
            own += new
        if table_edit:
            table_edit(table, starts)
        if loc_edit:
            loc_edit(loc)
        pad = lambda v, n, fill=0: v + [fill] * (n - len(v))  # noqa: E731
        live = pad([1] * len(steps), B)
        return CanaryBatch(i32(live), i32(pad(prefix, B)), i32(pad(extend, B)), i32(table),
                           i32(pad(ids, N)), i32(pad(pos, N)), i32(pad(loc, N, -1)),
                           req_to_token_row_starts=i32(pad(starts, B)))


def serve(batches):
    ep, step = make()
    st, kv = ep.init_state(), jnp.zeros((S, 16), jnp.float32)
    mon = Monitor.from_config(ep.config)
    found = []
    for b in batches:
        st, kv = step(st, kv, b)
        found += [(v.tag_name, v.reasons, v.slot, v.step) for v in mon.step(st)]
    found += [(v.tag_name, v.reasons, v.slot, v.step) for v in mon.flush()]
    return st, found


def test_clean_segments_with_gaps_are_silent_and_every_entry_is_verified():
    eng = Engine()
    batches = [eng.batch([(1, 3), (2, 4)], gap=1), eng.batch([(1, 1), (2, 1)], gap=3),
               eng.batch([(2, 1), (1, 1)], gap=0)]
    st, found = serve(batches)
    assert found == []
    # every table entry attention reads is verified, the step's own tokens included
    assert st.log.slot_runs()[T.HEAD_K_FULL] == (7 + 9 + 11) + (7 + 2 + 2)


def test_a_wrong_entry_for_this_steps_token_is_reported_in_the_same_step():
    """attention reads its own new token from the table: a table entry that is not the slot the
    step writes (out_cache_loc) is reported by that step, not a later one."""
    eng = Engine()
    first = eng.batch([(1, 3)])

    def edit(table, starts):                 # row 0's new token (position 3) -> slot 2
        table[starts[0] + 3] = 2

    second = eng.batch([(1, 1)], table_edit=edit)
    _, found = serve([first, second, eng.batch([(1, 1)])])
    assert found, "not reported"
    assert {tag for tag, *_ in found} >= {"HEAD_K_FULL", "TAIL_K_FULL"}
    assert all(step <= 2 + 1 for *_, step in found)      # step 2's rows, pumped after step 3
    assert any("verify_position" in reasons and slot == 2 for _, reasons, slot, _ in found)


def test_a_slot_written_for_one_request_while_another_reads_it_is_reported_at_once():
    """Two requests in one step: request 2's new token is written into a slot request 1's
    segment still holds (a double allocation); request 1's verify of the same step sees it."""
    eng = Engine()
    first = eng.batch([(1, 3), (2, 2)])
    victim = eng.slots[1][1]

    def edit(loc):
        loc[1] = victim                      # request 2's new token goes to request 1's slot
    second = eng.batch([(1, 1), (2, 1)], loc_edit=edit)
    _, found = serve([first, second])
    hits = [f for f in found if f[2] == victim]
    assert hits and all(step <= 2 for *_, step in hits)
    assert any("verify_position" in reasons for _, reasons, _, _ in hits)


def test_a_row_start_off_by_one_is_reported():
    eng = Engine()
    first = eng.batch([(1, 2), (2, 3)])
    second = eng.batch([(1, 1), (2, 1)])
    # read row 1 one entry early (its start off by one): every entry is a neighbour's slot
    starts = np.asarray(second.req_to_token_row_starts).copy()
    starts[1] -= 1
    second = second._replace(req_to_token_row_starts=i32(starts))
    _, found = serve([first, second])
    assert any("verify_position" in reasons for _, reasons, _, _ in found)
