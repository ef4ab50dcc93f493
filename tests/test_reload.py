"""The reload path (format.md §14.1), on the runtime's endpoints (tests/support/mini_engine.py): a
request's 6 slots are offloaded (records exported, KV copied to the host) and come back into other
slots that held another request; after import_records the next step's HEAD/TAIL verifies are silent
for a correct reload and report a wrong mapping, a stale page and a flipped byte where they are."""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvcanary.runtime.offload import export_state_records, import_state_records

from tests.support.mini_engine import DIM, HEADS, NUM_SLOTS, PROMPT, engine, rows, step

OLD, NEW = list(range(9, 15)), list(range(17, 23))


def _reload(kv_dst, rec_dst, flip=None):
    ep, state, kv = engine()
    state, kv = step(ep, state, kv, NEW, 0, [200 + t for t in range(6)])     # another request in NEW
    state, kv = step(ep, state, kv, OLD, 0, PROMPT)
    records, oob = export_state_records(state, {"FULL": jnp.asarray(OLD, jnp.int32)})
    host = {h: np.asarray(kv[h]).reshape(NUM_SLOTS, HEADS, DIM)[OLD].copy() for h in kv}     # device -> host
    assert int(oob[0]) == 0 and state.log.total() == 0
    if flip is not None:
        host["k"].reshape(6, -1).view(np.uint8)[flip, 2] ^= 0x01
    for h in kv:                                                              # host -> device, new slots
        keep = [i for i, s in enumerate(kv_dst) if s >= 0]
        flat = kv[h].reshape(NUM_SLOTS, HEADS, DIM).at[jnp.asarray([kv_dst[i] for i in keep])].set(host[h][keep])
        kv[h] = flat.reshape(kv[h].shape)
    state, oob = import_state_records(state, {"FULL": jnp.asarray(rec_dst, jnp.int32)}, records)
    assert int(oob[0]) == 0
    state, kv = step(ep, state, kv, NEW + [23], 6, [106])                     # decode on the reloaded prefix
    return rows(state.log.violations())


def test_a_correct_reload_is_silent():
    assert _reload(NEW, NEW) == []


def test_a_wrong_mapping_breaks_position_and_chain():
    swapped = [NEW[1], NEW[0]] + NEW[2:]              # KV and records both follow the buggy mapping
    got = _reload(swapped, swapped)
    assert got and all(r[0] in ("HEAD_K_FULL", "HEAD_V_FULL", "TAIL_K_FULL", "TAIL_V_FULL") for r in got)
    for tag in ("HEAD_K_FULL", "TAIL_K_FULL"):
        mine = {r[2]: set(r[1]) for r in got if r[0] == tag}
        assert mine[17] >= {"verify_position"} and mine[18] >= {"verify_position", "verify_chain_hash"}
        assert mine[19] == {"verify_chain_hash"} and set(mine) == {17, 18, 19}


def test_a_stale_page_is_a_real_kv_mismatch_at_its_slot():
    got = _reload([s if s != 19 else -1 for s in NEW], NEW)          # slot 19's KV never copied back
    assert got == [["TAIL_K_FULL", ["verify_real_kv_hash"], 19, 2], ["TAIL_V_FULL", ["verify_real_kv_hash"], 19, 2]]


@pytest.mark.parametrize("entry", [0, 4])
def test_a_byte_flipped_on_the_host_is_found_after_the_reload(entry):
    assert _reload(NEW, NEW, flip=entry) == [["TAIL_K_FULL", ["verify_real_kv_hash"], NEW[entry], entry]]
