"""One side of the two-process transfer test (tests/test_transfer.py), on the tiny engine of
tests/support/mini_engine.py.

    python -m tests.support.transfer_peer send PACK            prefill 6 tokens into slots 9..14, ship them
    python -m tests.support.transfer_peer recv PACK [PACK...]  per pack: unpack + check, import into
                                                               slots 17..22, decode one token

Both print one JSON line: ``send`` its slots and positions; ``recv``, per pack, the host-check rows
and the rows of the decode step's verifies, as ``[tag, reasons, slot, position]``.
"""

from __future__ import annotations

import json
import pathlib
import sys

import jax.numpy as jnp
import numpy as np

from jax_kvcanary.runtime.offload import export_state_records, import_state_records
from jax_kvcanary.runtime.transfer import pack_transfer, unpack_transfer

from tests.support.mini_engine import DIM, HEADS, NUM_SLOTS, PROMPT, TOKEN_BYTES, engine, rows, step


def send(path):
    ep, state, kv = engine()
    slots = list(range(9, 15))
    state, kv = step(ep, state, kv, slots, 0, PROMPT)
    assert state.log.total() == 0
    sl = jnp.asarray(slots, jnp.int32)
    records, _ = export_state_records(state, {"FULL": sl})
    kv_rows = {f"FULL/{h}/0": np.asarray(kv[h]).reshape(NUM_SLOTS, HEADS, DIM)[slots] for h in ("k", "v")}
    data = pack_transfer({"FULL": slots}, kv_rows, {k: np.asarray(r) for k, r in records.items()},
                         fingerprints={"TAIL_K_FULL": [("FULL/k/0", TOKEN_BYTES)],
                                       "TAIL_V_FULL": [("FULL/v/0", TOKEN_BYTES)]},
                         real_kv_hash_mode=ep.config.real_kv_hash_mode)
    pathlib.Path(path).write_bytes(data)
    print(json.dumps({"slots": slots, "positions": list(range(len(slots)))}))


def recv(paths):
    out = []
    for path in paths:
        ep, state, kv = engine()
        pack, result = unpack_transfer(pathlib.Path(path).read_bytes())
        new = list(range(17, 23))
        for h in ("k", "v"):
            flat = kv[h].reshape(NUM_SLOTS, HEADS, DIM).at[jnp.asarray(new)].set(jnp.asarray(pack.kv[f"FULL/{h}/0"]))
            kv[h] = flat.reshape(kv[h].shape)
        state, _ = import_state_records(state, {"FULL": jnp.asarray(new, jnp.int32)},
                                        {k: jnp.asarray(r) for k, r in pack.records.items()})
        state, kv = step(ep, state, kv, new + [23], len(new), [106])
        out.append({"host": rows(result.violations()), "device": rows(state.log.violations())})
    print(json.dumps(out))


if __name__ == "__main__":
    send(sys.argv[2]) if sys.argv[1] == "send" else recv(sys.argv[2:])
