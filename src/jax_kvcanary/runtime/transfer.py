"""Transfer packs: KV slots and their canary records in one versioned byte string, for another engine
or process (format.md §14.3).

The sender gathers the KV of the slots it ships (one entry per slot, in its slot order) and the
records exported with the same list (``offload.export_state_records``), and ``pack_transfer`` puts
them, with its own slot numbers and the fingerprint geometry, into bytes. The receiver's
``unpack_transfer`` checks the framing (``kv-canary:`` errors, never a crash, for a wrong magic,
version, length or header) and then re-computes the fingerprints of the received KV
(``hostcheck.check_host_copy``, tags ``HOST_TRANSFER_*``): a byte flipped in transit is reported
with the *sender's* slot and the record's position. The receiver then copies the KV into its own
slots and imports the records with the same slot list; its next HEAD/TAIL verify checks the prefix
again, in its own slot space.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from typing import Mapping, Optional, Sequence, Tuple

import numpy as np

from .. import consts
from ..consts import RealKvHashMode
from ..inputs import RealKvSource
from .hostcheck import HostCheckResult, check_records

MAGIC = b"KVCANARY"
VERSION = 1
_PREFIX = struct.Struct("<8sIIII")      # magic, version, header bytes, header crc32, reserved (0)
_ALIGN = 64
_GROUPS = ("FULL", "SWA")


class TransferError(ValueError):
    """A malformed transfer pack (``kv-canary: ...``)."""


@dataclasses.dataclass(frozen=True)
class TransferPack:
    """The content of a transfer pack (numpy arrays; views into the received bytes).

    Attributes:
      slots: ``{group: int64[n_g]}``, the sender's slots, one per entry.
      kv: ``{name: array[n_g, ...]}``, KV per entry (any dtype); a name starts with its group
        (``'FULL/k/0'``).
      records: ``{canary name: uint8[n_g, 32]}`` (``'HEAD_K_FULL'``, ``'TAIL_V_SWA'``, ...).
      fingerprints: ``{TAIL canary name: ((kv name, read_bytes), ...)}``: the real-KV sources of
        that canary's fingerprint, in source order; a source whose strip starts inside the entry is
        ``(kv name, read_bytes, offset_bytes)``.
      real_kv_hash_mode: the device's ``RealKvHashMode``.
    """

    slots: Mapping[str, np.ndarray]
    kv: Mapping[str, np.ndarray]
    records: Mapping[str, np.ndarray]
    fingerprints: Mapping[str, Tuple[tuple, ...]]
    real_kv_hash_mode: RealKvHashMode

    def sources(self) -> dict:
        """``{TAIL canary name: tuple of RealKvSource}`` over the received KV: entry ``i`` is slot ``i``
        (``page_size`` 1, one entry's bytes per row, the strip ``offset_bytes`` into it)."""
        out = {}
        for name, srcs in self.fingerprints.items():
            out[name] = tuple(RealKvSource(self.kv[k], 1, _row_bytes(self.kv[k]), rb, *off) for k, rb, *off in srcs)
        return out

    def check(self, impl: Optional[str] = None) -> HostCheckResult:
        """The host check of the received KV against the received TAIL records (``HOST_TRANSFER_*``
        tags); rows name the sender's slots."""
        if self.real_kv_hash_mode == RealKvHashMode.NONE or not self.fingerprints:
            return HostCheckResult(np.zeros((0, consts.VIOLATION_FIELDS), np.int64), 0)
        local = {g: np.arange(s.shape[0], dtype=np.int64) for g, s in self.slots.items()}
        return check_records(self.sources(), dict(self.records), local, stage="TRANSFER",
                             real_kv_hash_mode=self.real_kv_hash_mode, report_slots=dict(self.slots),
                             impl=impl)


def _row_bytes(a) -> int:
    return int(a.dtype.itemsize * int(np.prod(a.shape[1:], dtype=np.int64)))


def _fingerprint(entry) -> tuple:
    """One fingerprint source: ``(kv name, read_bytes)``, or ``(kv name, read_bytes, offset_bytes)``
    for a non-zero offset (an offset of 0 is dropped, so such entries read as before)."""
    name, read_bytes, *offset = entry
    if len(offset) > 1:
        raise ValueError(f"a fingerprint source has at most 3 fields, got {list(entry)!r}")
    offset = int(offset[0]) if offset else 0
    return (str(name), int(read_bytes)) + ((offset,) if offset else ())


def _group(name: str, kind: str) -> str:
    g = name.split("/", 1)[0] if kind == "kv" else name.rsplit("_", 1)[-1]
    if g not in _GROUPS:
        raise TransferError(f"kv-canary: transfer {kind} name {name!r} names no group of {_GROUPS}")
    return g


def pack_transfer(slots: Mapping[str, object], kv: Mapping[str, object], records: Mapping[str, object],
                  *, fingerprints: Mapping[str, Sequence[Tuple[str, int]]] = (),
                  real_kv_hash_mode=RealKvHashMode.NONE) -> bytes:
    """Pack KV entries, their records and the sender's slots into bytes (format.md §14.3).

    Args:
      slots: ``{group: int[n_g]}``, the sender's slot of each entry of the group.
      kv: ``{'GROUP/...': array[n_g, ...]}``: the KV of each entry (any dtype of >= 8 bits; row
        ``i`` = the bytes of entry ``i``, e.g. one layer's K of one slot).
      records: ``{canary name: uint8[n_g, 32]}``, exported with the same slot list.
      fingerprints: ``{'TAIL_<half>_<group>': ((kv name, read_bytes[, offset_bytes]), ...)}``: which
        KV arrays are the fingerprint sources of that canary on the device, in the device's source
        order, with their ``read_bytes`` and ``offset_bytes`` (default 0); the ``read_bytes`` from
        byte ``offset_bytes`` of an entry are that slot's strip (e.g. V head 0 of a fused K/V row).
      real_kv_hash_mode: the device's mode (PARTIAL or ALL for a check on arrival).

    Returns:
      The pack (``bytes``).

    Raises:
      ValueError: a ``kv-canary:`` message when an array's entry count does not match its group's
        slots, a name has no group, or a fingerprint names a missing KV array.
    """
    arrays = []
    counts = {}
    for g, s in slots.items():
        _group(f"{g}/", "kv")
        s = np.asarray(s).astype("<i8").reshape(-1)
        counts[g] = s.shape[0]
        arrays.append((f"slots/{g}", s))
    for kind, table in (("records", records), ("kv", kv)):
        for name in sorted(table):
            a = np.ascontiguousarray(np.asarray(table[name]))
            g = _group(name, kind)
            if g not in counts or a.ndim < 1 or a.shape[0] != counts[g]:
                raise TransferError(f"kv-canary: transfer {kind} {name!r} has shape {a.shape}, but group "
                                    f"{g} has {counts.get(g, 0)} slots")
            if kind == "records" and (a.dtype != np.uint8 or a.shape[1:] != (consts.CANARY_SLOT_BYTES,)):
                raise TransferError(f"kv-canary: transfer records {name!r} must be uint8[n, 32], got "
                                    f"{a.dtype.name}{list(a.shape)}")
            arrays.append((f"{kind}/{name}", a))
    # a source without an offset is written as before, [name, read_bytes]: such packs are unchanged
    fp = {name: [list(_fingerprint(e)) for e in srcs] for name, srcs in dict(fingerprints).items()}
    for name, srcs in fp.items():
        for k, *_ in srcs:
            if k not in kv:
                raise TransferError(f"kv-canary: fingerprint of {name!r} names KV {k!r}, which is not "
                                    "in the pack")
    entries, offset = [], 0
    for name, a in arrays:
        offset = -(-offset // _ALIGN) * _ALIGN
        entries.append({"name": name, "dtype": a.dtype.name, "shape": list(a.shape), "offset": offset})
        offset += a.nbytes
    header = json.dumps({"real_kv_hash_mode": int(real_kv_hash_mode), "arrays": entries,
                         "fingerprints": fp}, sort_keys=True).encode()
    start = -(-(_PREFIX.size + len(header)) // _ALIGN) * _ALIGN
    out = bytearray(start + offset)
    out[:_PREFIX.size] = _PREFIX.pack(MAGIC, VERSION, len(header), zlib.crc32(header), 0)
    out[_PREFIX.size:_PREFIX.size + len(header)] = header
    for e, (_, a) in zip(entries, arrays):
        out[start + e["offset"]:start + e["offset"] + a.nbytes] = a.reshape(-1).view(np.uint8).tobytes()
    return bytes(out)


def _header(buf: memoryview) -> Tuple[dict, int]:
    n = len(buf)
    if n < _PREFIX.size:
        raise TransferError(f"kv-canary: transfer pack is truncated: {n} bytes, need at least {_PREFIX.size}")
    magic, version, hlen, crc, _ = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise TransferError(f"kv-canary: not a transfer pack: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise TransferError(f"kv-canary: transfer pack version {version} is not supported (this build "
                            f"reads version {VERSION})")
    if _PREFIX.size + hlen > n:
        raise TransferError(f"kv-canary: transfer pack is truncated: its header needs "
                            f"{_PREFIX.size + hlen} bytes, got {n}")
    raw = bytes(buf[_PREFIX.size:_PREFIX.size + hlen])
    if zlib.crc32(raw) != crc:
        raise TransferError("kv-canary: transfer pack header is corrupt (crc32 mismatch)")
    try:
        return json.loads(raw), -(-(_PREFIX.size + hlen) // _ALIGN) * _ALIGN
    except ValueError:
        raise TransferError("kv-canary: transfer pack header is not valid JSON") from None


def unpack_transfer(data, *, check: bool = True, impl: Optional[str] = None
                    ) -> Tuple[TransferPack, HostCheckResult]:
    """Read a pack made by ``pack_transfer`` and (by default) check the received KV.

    Args:
      data: the pack (``bytes``, ``bytearray``, ``memoryview`` or a ``uint8`` numpy array).
      check: run ``TransferPack.check`` (the fingerprints of the received KV vs its records).
      impl: backend of the check (see ``check_host_copy``).

    Returns:
      ``(pack, result)``: the ``TransferPack`` (arrays are views into ``data``) and the
      ``HostCheckResult`` (empty when ``check`` is False).

    Raises:
      ValueError (``TransferError``): a ``kv-canary:`` message for a truncated pack, a wrong magic or
        version, a corrupt header, or arrays that do not fit the pack or its groups.
    """
    raw = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
    buf = memoryview(np.ascontiguousarray(raw).reshape(-1).view(np.uint8))
    head, start = _header(buf)
    n = len(buf)
    try:
        mode = RealKvHashMode(int(head["real_kv_hash_mode"]))
        tables = {"slots": {}, "records": {}, "kv": {}}
        for e in head["arrays"]:
            kind, name = str(e["name"]).split("/", 1)
            dtype = np.dtype(str(e["dtype"]))
            shape = tuple(int(d) for d in e["shape"])
            lo = start + int(e["offset"])
            hi = lo + dtype.itemsize * int(np.prod(shape, dtype=np.int64))
            if kind not in tables or dtype.hasobject or min(shape, default=0) < 0 or not start <= lo <= hi <= n:
                raise TransferError(f"kv-canary: transfer pack array {e['name']!r} ({dtype.name}{list(shape)} "
                                    f"at bytes [{lo}, {hi})) does not fit the {n}-byte pack")
            tables[kind][name] = np.frombuffer(buf[lo:hi], dtype).reshape(shape)
        fingerprints = {str(k): tuple(map(_fingerprint, v)) for k, v in head["fingerprints"].items()}
    except (KeyError, TypeError, ValueError) as err:
        if isinstance(err, TransferError):
            raise
        raise TransferError(f"kv-canary: transfer pack header is malformed: {err!r}") from None
    slots = tables["slots"]
    for kind in ("records", "kv"):
        for name, a in tables[kind].items():
            g = _group(name, kind)
            if g not in slots or a.ndim < 1 or a.shape[0] != slots[g].shape[0]:
                raise TransferError(f"kv-canary: transfer {kind} {name!r} has shape {a.shape}, but group "
                                    f"{g} has {slots[g].shape[0] if g in slots else 0} slots")
    for name, srcs in fingerprints.items():
        if name not in tables["records"] or any(k not in tables["kv"] for k, *_ in srcs):
            raise TransferError(f"kv-canary: fingerprint of {name!r} names an array that is not in the pack")
    pack = TransferPack(slots, tables["kv"], tables["records"], fingerprints, mode)
    return pack, (pack.check(impl) if check else HostCheckResult(
        np.zeros((0, consts.VIOLATION_FIELDS), np.int64), 0))
