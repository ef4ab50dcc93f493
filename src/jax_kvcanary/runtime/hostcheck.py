"""The host-side check of KV that left the device (format.md §14.2).

Right after a device-to-host copy (a host tier's backup) or after receiving a transfer, the host has
KV bytes and the records exported with them (``offload.export_records``). ``check_host_copy``
re-computes the real-KV fingerprint of every copied slot from the host bytes, with the same fold as
the device (format.md §4.4), and compares it with the record's ``real_kv_hash``. Mismatches come
out as standard violation rows (format.md §3.2), tagged with a ``HostCheckTag``, so the report text
and the monitor are the usual ones.

How it runs: the existing ``verify`` op, on the CPU device (the native handler by default), over a
canary built from the records at their host slots and a plan whose entries have ``prev = 0`` (chain
check skipped), the record's own position and no token check; only the real-KV comparison can fire.
Preparation is vectorised numpy; a check is one verify launch (one per repeated-slot rank when the
same host slot is named twice). Shapes are bucketed to powers of two, so repeated checks reuse
compiled code. Host slot 0, which verify treats as padding, is folded on the host (numpy) instead.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import checks, consts, hashing, ops
from ..consts import FailReason, HostCheckTag, IndexKind, RealKvHashMode
from ..inputs import RealKvSource, VerifyPlan
from ..state import ViolationLog, decode_row
from .config import endpoint_of
from .report import format_report
from .sweep import bucket_capacity

#: Counter rows of the log a host check uses: the upstream 12 tags and the host-check tags.
NUM_TAGS = max(HostCheckTag) + 1
_RKV = int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
_OOB = int(FailReason.INDEX_OUT_OF_RANGE)
_ALIGN = 64
_MIN_BUCKET = 64      # smallest canary and plan bucket: small checks share one compiled launch


def host_tag(stage: str, half: str, group: str) -> HostCheckTag:
    """``host_tag('BACKUP', 'K', 'FULL') == HostCheckTag.HOST_BACKUP_K_FULL`` (stage BACKUP or
    TRANSFER)."""
    return HostCheckTag[f"HOST_{stage}_{half}_{group}"]


def aligned_host_array(shape, dtype) -> np.ndarray:
    """Zeros of ``shape`` / ``dtype`` in a 64-byte-aligned host buffer. JAX's CPU device reads such a
    C-contiguous numpy array in place (no copy); ``check_host_copy`` copies any other array once.
    Use it for host KV pools and receive buffers."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.zeros(nbytes + _ALIGN, np.uint8)
    start = (-raw.ctypes.data) % _ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


@dataclasses.dataclass(frozen=True)
class HostCheckResult:
    """What ``check_host_copy`` found.

    Attributes:
      rows: ``int64[k, 8]`` violation rows (format.md §3.2) in entry order: a check row with bit
        ``verify_real_kv_hash`` (column 1 the reported slot, 2 the record's position, 3 its token,
        4 -1, 5 and 6 its ``prev_hash``), or an ``INDEX_OUT_OF_RANGE`` row (``real_kv_source_k``)
        for a host slot outside a source.
      checked: entries whose fingerprint was compared.
    """

    rows: np.ndarray
    checked: int

    @property
    def ok(self) -> bool:
        return self.rows.shape[0] == 0

    def violations(self) -> list:
        """The rows decoded: ``list[ViolationRow]``."""
        return [decode_row(r, i) for i, r in enumerate(self.rows)]

    def reports(self, step: int = 0) -> list:
        """The report text (format.md §10) of every row; ``total_violations`` is ``len(rows)``."""
        n = int(self.rows.shape[0])
        return [format_report(r, total=n, ring_capacity=n, step=step) for r in self.rows]


def _cpu():
    return jax.devices("cpu")[0]


def _as_sources(sources):
    """A single source as a 1-tuple; anything else as given (``checks.real_kv`` judges it)."""
    return (sources,) if isinstance(sources, RealKvSource) else sources


def _i64(x) -> np.ndarray:
    return np.asarray(x).astype(np.int64).reshape(-1)


def _ranks(s: np.ndarray) -> np.ndarray:
    """For each entry, how many earlier entries name the same slot (0 for the first)."""
    order = np.argsort(s, kind="stable")
    ordered = s[order]
    start = np.r_[True, ordered[1:] != ordered[:-1]]
    run_start = np.maximum.accumulate(np.where(start, np.arange(s.size), 0))
    ranks = np.empty(s.size, np.int64)
    ranks[order] = np.arange(s.size) - run_start
    return ranks


@functools.lru_cache(maxsize=None)
def _verify_fn(tag: int, mode: int, impl, geometry: tuple):
    """The jitted verify of one host-check launch: ``(canary, plan int32[3, V], num_valid int32[1],
    *source arrays) -> (write_index, ring)``; the log is made inside, so only the inputs cross."""
    def run(canary, plan, num_valid, *arrays):
        cap = plan.shape[1]
        log = ViolationLog(jnp.zeros((cap, consts.VIOLATION_ROW_BYTES), jnp.uint8), jnp.zeros((1,), jnp.int32),
                           jnp.zeros((NUM_TAGS, consts.COUNTER_BYTES), jnp.uint8),
                           jnp.zeros((NUM_TAGS, consts.COUNTER_BYTES), jnp.uint8), jnp.ones((1,), jnp.int32))
        vp = VerifyPlan(plan[0], jnp.full((cap,), -1, jnp.int32), plan[1], plan[2], num_valid,
                        jnp.ones((1,), jnp.int32))
        sources = tuple(RealKvSource(a, *g) for a, g in zip(arrays, geometry))
        out = ops.verify(canary, log, vp, tag=tag, real_kv_sources=sources, real_kv_hash_mode=mode, impl=impl)
        return out.write_index, out.ring
    return jax.jit(run)


def _native_rows(srcs, rec, s, entries, mode, tag, impl):
    """``(entry indices, rows)`` lists from one verify launch per repeated-slot rank over ``entries``
    (host slots ``> 0`` inside every source), on the CPU device."""
    num_slots = bucket_capacity(int(s[entries].max()) + 1, _MIN_BUCKET)
    seen = np.zeros(num_slots, bool)
    seen[s[entries]] = True
    ranks = np.zeros(entries.size, np.int64) if np.count_nonzero(seen) == entries.size else _ranks(s[entries])
    fn = _verify_fn(tag, mode, impl, tuple((x.page_size, x.num_bytes_per_token, x.read_bytes, x.offset_bytes)
                                           for x in srcs))
    out_e, out_r = [], []
    for rank in range(int(ranks.max()) + 1):
        g = entries[ranks == rank]
        cap = bucket_capacity(g.size, _MIN_BUCKET)
        canary = aligned_host_array((num_slots, consts.CANARY_SLOT_BYTES), np.uint8)
        canary[s[g]] = rec[g].view(np.uint8)
        plan = aligned_host_array((3, cap), np.int32)
        plan[0, :g.size] = s[g]
        plan[1, :g.size] = rec[g, 1].astype(np.int32)   # low bits; a mismatch here is masked below
        with jax.default_device(_cpu()):
            count, ring = fn(canary, plan, np.array([g.size], np.int32), *(x.array for x in srcs))
        k = min(int(np.asarray(count)[0]), cap)
        if k == 0:
            continue
        rows = np.asarray(ring)[:k].view("<i8").astype(np.int64)
        rows = rows[(rows[:, 7] & _RKV) != 0]      # only the fingerprint counts (positions: see plan)
        rows[:, 7] = _RKV
        order = np.argsort(s[g], kind="stable")
        out_e.append(g[order[np.searchsorted(s[g][order], rows[:, 1])]])
        out_r.append(rows)
    return out_e, out_r


def check_host_copy(sources, records, slots, *, real_kv_hash_mode, tag, report_slots=None,
                    impl: Optional[str] = None) -> HostCheckResult:
    """Re-compute the real-KV fingerprints of a host copy and compare them with its records.

    Args:
      sources: a ``RealKvSource`` or a tuple of up to 4 over the *host* KV (numpy arrays, or jax
        arrays on the CPU device; any dtype of >= 8 bits, paged like the device arrays: slot ``s``
        is at row ``s // page_size``). The same sources, in the same order and geometry
        (``offset_bytes`` included), as the device's TAIL fingerprint (e.g. the host copy of layer
        0's K for the K records).
      records: ``uint8[n, 32]`` exported with the KV (the TAIL canary's records: HEAD records hold
        no fingerprint).
      slots: int32/int64 ``[n]``, the host slot each record's KV was copied to; negative = padding
        (skipped).
      real_kv_hash_mode: ``RealKvHashMode.PARTIAL`` or ``ALL``, as on the device.
      tag: the tag stamped into the rows, usually a ``HostCheckTag`` (``host_tag(...)``); any int
        in ``[0, 20)``.
      report_slots: int32/int64 ``[n]``, the slot each row names (default ``slots``): the device
        slots the records were exported from, or the sender's slots of a transfer.
      impl: ``'ffi'``, ``'xla'`` or None, as for the ops (None: the CPU's native handler).

    Returns:
      A ``HostCheckResult`` with the rows (entry order) and the number of entries compared.

    Raises:
      TypeError, ValueError: a ``kv-canary:`` message for a bad source, mode, tag, record or slot
        array. Data never raises: a host slot outside a source gives an ``INDEX_OUT_OF_RANGE`` row.
    """
    srcs = _as_sources(sources)
    srcs, mode = checks.real_kv(srcs, real_kv_hash_mode)
    if mode == RealKvHashMode.NONE:
        raise ValueError("kv-canary: check_host_copy needs at least one RealKvSource and "
                         f"real_kv_hash_mode PARTIAL or ALL, got {real_kv_hash_mode!r} with "
                         f"{len(_as_sources(sources))} source(s)")
    tag = checks.tag(tag, NUM_TAGS)
    n = checks.index_array(slots, "slots")
    checks.records(records, n)
    if report_slots is not None:
        checks.index_array(report_slots, "report_slots", n)
    rec = np.ascontiguousarray(np.asarray(records)).view("<i8").reshape(n, consts.CANARY_FIELDS_PER_SLOT)
    s = _i64(slots)
    names = s if report_slots is None else _i64(report_slots)

    ps = np.array([src.page_size for src in srcs], np.int64)
    bound = np.array([src.rows for src in srcs], np.int64)
    first = np.full(n, -1, np.int64)
    for k in reversed(range(len(srcs))):        # the lowest failing source wins
        first[(s >= 0) & (s // ps[k] >= bound[k])] = k
    entries, rows = [], []

    i = np.flatnonzero(first >= 0)
    if i.size:
        k = first[i]
        entries.append(i)
        rows.append(np.stack([np.full(i.size, tag), names[i], rec[i, 1], np.full(i.size, -1),
                              s[i] // ps[k], int(IndexKind.REAL_KV_SOURCE_0) + k, bound[k],
                              np.full(i.size, _OOB)], axis=1))
    ok = (s >= 0) & (first < 0)

    i = np.flatnonzero(ok & (s == 0))       # verify skips slot 0 (padding): fold it here
    if i.size:
        got = hashing.to_i64(hashing.slot_real_kv_hash(srcs, s[i], mode))
        i = i[got != rec[i, 3]]
        entries.append(i)
        rows.append(np.stack([np.full(i.size, tag), names[i], rec[i, 1], rec[i, 0], np.full(i.size, -1),
                              rec[i, 2], rec[i, 2], np.full(i.size, _RKV)], axis=1))

    i = np.flatnonzero(ok & (s > 0))
    if i.size:
        e, r = _native_rows(srcs, rec, s, i, mode, tag, impl)
        for ee, rr in zip(e, r):
            rr[:, 1] = names[ee]
        entries += e
        rows += r

    if not rows:
        return HostCheckResult(np.zeros((0, consts.VIOLATION_FIELDS), np.int64), int(ok.sum()))
    order = np.argsort(np.concatenate(entries), kind="stable")
    return HostCheckResult(np.concatenate(rows).astype(np.int64)[order], int(ok.sum()))


def check_records(sources_by_name: dict, records: dict, slots, *, stage: str, real_kv_hash_mode,
                  report_slots=None, impl: Optional[str] = None) -> HostCheckResult:
    """``check_host_copy`` for several halves / groups at once: for each TAIL canary name
    (``'TAIL_K_FULL'``, ...) in ``records`` that has host sources in ``sources_by_name``, check with
    tag ``HOST_{stage}_{half}_{group}``; the rows are concatenated in name order.

    Args:
      sources_by_name: ``{'TAIL_K_FULL': RealKvSource or tuple, ...}`` over the host copy.
      records: ``{canary name: uint8[n, 32]}`` (e.g. from ``export_state_records``); HEAD records
        are ignored (they hold no fingerprint).
      slots: ``{group: int[n_g]}``, host slots per group.
      stage: ``'BACKUP'`` or ``'TRANSFER'``.
      report_slots: ``{group: int[n_g]}`` or None.
    """
    all_rows, checked = [], 0
    for name in sorted(records):
        if not name.startswith("TAIL_") or name not in sources_by_name:
            continue
        _, half, group = endpoint_of(name)
        res = check_host_copy(sources_by_name[name], records[name], slots[group],
                              real_kv_hash_mode=real_kv_hash_mode, tag=host_tag(stage, half, group),
                              report_slots=None if report_slots is None else report_slots[group],
                              impl=impl)
        all_rows.append(res.rows)
        checked += res.checked
    rows = np.concatenate(all_rows) if all_rows else np.zeros((0, consts.VIOLATION_FIELDS), np.int64)
    return HostCheckResult(rows, checked)
