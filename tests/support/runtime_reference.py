"""Numpy oracles of the runtime's record export/import and host check (docs/format.md §14), for the
tests: readable loops over the same helpers as ``jax_kvcanary.reference`` (the ops' references)."""

import numpy as np

from jax_kvcanary import consts, hashing
from jax_kvcanary.consts import FailReason, IndexKind
from jax_kvcanary.reference import _OOB, _RealKv, _ints


# ---- export_records / import_records (§14.1) ----------------------------------------------------

def export_records(canary, slots):
    """Records of ``slots`` (§14.1): ``(uint8[n, 32], int32[1] out-of-range count)``. A negative slot
    gives a zero record and is not counted; ``slot >= num_slots`` gives a zero record and counts."""
    c = np.asarray(canary)
    S = c.shape[0]
    out = np.zeros((len(_ints(slots)), consts.CANARY_SLOT_BYTES), np.uint8)
    oob = 0
    for i, s in enumerate(_ints(slots)):
        if s >= S:
            oob += 1
        elif s >= 0:
            out[i] = c[s, :consts.CANARY_SLOT_BYTES]
    return out, np.array([oob], np.int32)


def import_records(canary, slots, records):
    """A copy of ``canary`` with ``records[i]`` stored at ``slots[i]`` in entry order, so the later
    entry of a repeated slot wins (§14.1); skipped and counted as :func:`export_records`."""
    c = np.array(np.asarray(canary), copy=True)
    rec = np.asarray(records)
    S = c.shape[0]
    oob = 0
    for i, s in enumerate(_ints(slots)):
        if s >= S:
            oob += 1
        elif s >= 0:
            c[s, :consts.CANARY_SLOT_BYTES] = rec[i]
    return c, np.array([oob], np.int32)


# ---- host check of a host copy (§14.2) ----------------------------------------------------------

def host_check(sources, records, slots, *, real_kv_hash_mode, tag, report_slots=None):
    """Rows of the host check (§14.2): entry ``i`` compares ``records[i]``'s ``real_kv_hash`` with the
    fold of slot ``slots[i]`` of ``sources``. Returns ``int64[k, 8]`` in entry order."""
    tag = int(tag)
    rec = np.ascontiguousarray(np.asarray(records)).view("<i8").reshape(-1, consts.CANARY_FIELDS_PER_SLOT)
    slots = _ints(slots)
    names = slots if report_slots is None else _ints(report_slots)
    rkv = _RealKv(sources, real_kv_hash_mode, slots)
    rows = []
    for i, s in enumerate(slots):
        if s < 0:
            continue  # padding
        tok, pos, prev, stored = (int(v) for v in rec[i])
        k = rkv.first_bad(s)
        if k is not None:
            ps, bound = rkv.bounds[k]
            rows.append([tag, names[i], pos, -1, s // ps, int(IndexKind.REAL_KV_SOURCE_0) + k, bound, _OOB])
        elif stored != hashing.to_i64(rkv.hash(s)):
            rows.append([tag, names[i], pos, tok, -1, prev, prev, int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH)])
    return np.array(rows, dtype=np.int64).reshape(-1, consts.VIOLATION_FIELDS)
