"""Fault injection: pure functions that inject each upstream fault kind (format.md §11), and the
faults of KV that leaves the device (``OFFLOAD_KINDS``, format.md §14).

Each function returns the corrupted copy of what it changes (the input is left as it was) and a
``Fault`` saying what changed and which tag / reason must fire, so tests can assert the exact
detection. Apply them between steps, as the table of format.md §11 says.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from ..consts import FailReason, HostCheckTag
from .config import launch_tag
from ..consts import fail_reason_label

KINDS = ("req_to_token_swap", "real_kv_used", "real_kv_unused_cache", "real_kv_post_forward",
         "next_token_swap", "swa_evicted_in_window")


@dataclasses.dataclass(frozen=True)
class Fault:
    """What a fault changed and how it must be detected.

    kind              one of ``KINDS`` or ``OFFLOAD_KINDS``
    group             'FULL' | 'SWA' (the group whose canary must fire first)
    slot, position    the corrupted slot (in that group's slot space) and its position; -1 = n/a
    changed           human-readable description of the change (old -> new)
    expected_tags     tags of which at least one must report ...
    expected_reasons  ... at least one of these reasons
    device            the device whose state was corrupted (multi-device), else None
    """

    kind: str
    group: str
    slot: int
    position: int
    changed: str
    expected_tags: Tuple[int, ...]          # LaunchTag or HostCheckTag values
    expected_reasons: Tuple[FailReason, ...]
    device: Optional[int] = None

    @property
    def expected_labels(self) -> Tuple[str, ...]:
        return tuple(fail_reason_label(int(r)) for r in self.expected_reasons)

    def matches(self, violation) -> bool:
        """True when a decoded ``Violation`` is an expected detection of this fault."""
        if violation.tag not in [int(t) for t in self.expected_tags]:
            return False
        if self.device is not None and violation.device not in (None, self.device):
            return False
        return any(lbl in violation.reasons for lbl in self.expected_labels)

    def describe(self) -> str:
        tags = ",".join(t.name for t in self.expected_tags)
        return (f"{self.kind} on {self.group}"
                + (f" device {self.device}" if self.device is not None else "")
                + f": {self.changed}; expect {'|'.join(self.expected_labels)} on {tags}")


def _set(arr, index, value):
    if isinstance(arr, np.ndarray):
        out = arr.copy()
        out[index] = value
        return out
    return arr.at[index].set(value)


# -- req_to_token swap ------------------------------------------------------------------------------
def swap_req_to_token(req_to_token, rp: int, position: int, new_slot: int, *,
                      groups: Sequence[str] = ("FULL",), halves: Sequence[str] = ("K", "V")):
    """Point ``req_to_token[rp, position]`` (a prefix position of an active request) at another
    live slot ``new_slot`` that holds different content. Detected by verify as
    ``verify_chain_hash`` (often with ``verify_position``) on HEAD_* / TAIL_* of ``groups``.

    ``req_to_token``: int[R, L], numpy or jax. Returns ``(new_table, Fault)``.
    """
    old = int(np.asarray(req_to_token[rp, position]))
    if int(new_slot) == old:
        raise ValueError("kv-canary: swap_req_to_token needs a different slot")
    if int(new_slot) == 0:
        raise ValueError("kv-canary: swap_req_to_token must not use slot 0 (padding)")
    table = _set(req_to_token, (rp, position), new_slot)
    tags = tuple(sorted(launch_tag(st, h, g) for g in groups for h in halves
                        for st in ("HEAD", "TAIL")))
    return table, Fault("req_to_token_swap", groups[0], int(new_slot), int(position),
                        f"req_to_token[{rp}, {position}]: {old} -> {int(new_slot)}", tags,
                        (FailReason.VERIFY_CHAIN_HASH_MISMATCH,))


# -- SWA eviction inside the window ----------------------------------------------------------------
def evict_swa_in_window(lut, full_slot: int, position: int, *, halves: Sequence[str] = ("K", "V")):
    """Map full slot ``full_slot`` (position ``position`` of an active request, inside its sliding
    window) to SWA slot 0 in the full-to-SWA ``lut``: the SWA pool no longer holds KV that
    attention still reads (the early-eviction bug class). Detected by verify as an
    ``index_out_of_range`` row with slot -1 at that position (the plan's
    ``report_evicted_in_window``) on HEAD_* / TAIL_* of the SWA group.

    ``lut``: int[S_full], numpy or jax. Returns ``(new_lut, Fault)``.
    """
    old = int(np.asarray(lut[full_slot]))
    if old == 0:
        raise ValueError(f"kv-canary: evict_swa_in_window needs a slot the SWA pool holds; full "
                         f"slot {full_slot} already maps to 0")
    tags = tuple(sorted(launch_tag(st, h, "SWA") for h in halves for st in ("HEAD", "TAIL")))
    return _set(lut, full_slot, 0), Fault(
        "swa_evicted_in_window", "SWA", -1, int(position),
        f"full_to_swa_index_mapping[{full_slot}]: {old} -> 0", tags,
        (FailReason.INDEX_OUT_OF_RANGE,))


# -- real-KV byte flips -----------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("row", "elem", "byte", "mask", "device"))
def _flip_jax(arr, *, row, elem, byte, mask, device):
    x = arr if device is None else arr[device]
    flat = x.reshape(x.shape[0], -1)
    v = flat[row, elem]
    b = jax.lax.bitcast_convert_type(v, jnp.uint8)
    b = b ^ jnp.uint8(mask) if b.ndim == 0 else b.at[byte].set(b[byte] ^ jnp.uint8(mask))
    flat = flat.at[row, elem].set(jax.lax.bitcast_convert_type(b, v.dtype))
    x = flat.reshape(x.shape)
    return x if device is None else arr.at[device].set(x)


def flip_kv_byte(kv, slot: int, *, page_size: int, num_bytes_per_token: int, byte: int = 0,
                 mask: int = 0xFF, device: Optional[int] = None):
    """XOR ``mask`` into byte ``byte`` of slot ``slot``'s strip of a KV array (format.md §4.4 addressing:
    row ``slot // page_size``, byte ``(slot % page_size) * num_bytes_per_token + byte`` of
    ``kv[row]``). With ``device``, ``kv`` has a leading device axis and ``kv[device]`` is changed.

    ``kv``: numpy or jax array of any dtype of >= 8 bits. Returns the new array (same placement, so a jitted step does not recompile).
    """
    local_shape = kv.shape[1:] if device is not None else kv.shape
    itemsize = np.dtype(kv.dtype).itemsize
    row, col = divmod(int(slot), int(page_size))
    col = col * int(num_bytes_per_token) + int(byte)
    row_bytes = itemsize * int(np.prod(local_shape[1:]))
    if not (0 <= row < local_shape[0]) or not (0 <= col < row_bytes):
        raise ValueError(f"kv-canary: slot {slot} byte {byte} is outside the KV array "
                         f"(shape {tuple(local_shape)})")
    elem, b = divmod(col, itemsize)
    if isinstance(kv, np.ndarray):
        out = kv.copy()
        view = (out if device is None else out[device]).reshape(local_shape[0], -1).view(np.uint8)
        view[row, col] ^= np.uint8(mask)
        return out
    out = _flip_jax(kv, row=row, elem=elem, byte=b, mask=int(mask), device=device)
    if getattr(kv, "committed", False):   # keep placement and committedness: no recompile
        out = jax.device_put(out, kv.sharding)
    return out


def _kv_fault(kind, stage, kv, slot, position, page_size, num_bytes_per_token, group, device,
              reasons):
    new = flip_kv_byte(kv, slot, page_size=page_size, num_bytes_per_token=num_bytes_per_token,
                       device=device)
    return new, Fault(kind, group, int(slot), int(position),
                      f"byte 0 of slot {slot} (position {position}) XOR 0xFF in layer-0 K",
                      (launch_tag(stage, "K", group),), reasons, device)


def flip_real_kv_used(kv, slot: int, position: int, *, page_size: int, num_bytes_per_token: int,
                      group: str = "FULL", device: Optional[int] = None):
    """``real_kv_used``: flip byte 0 of a slot an active request attends to (for SWA: in its
    window, ``slot`` already LUT-translated), in the group's layer-0 K array, before the step.
    Detected as ``verify_real_kv_hash`` on ``TAIL_K_<group>``. Returns ``(kv, Fault)``."""
    return _kv_fault("real_kv_used", "TAIL", kv, slot, position, page_size, num_bytes_per_token,
                     group, device, (FailReason.VERIFY_REAL_KV_HASH_MISMATCH,))


def flip_real_kv_unused_cache(kv, slot: int, position: int, *, page_size: int,
                              num_bytes_per_token: int, group: str = "FULL",
                              device: Optional[int] = None):
    """``real_kv_unused_cache``: flip a cached slot that no running request references, on a sweep
    step. Detected as ``verify_real_kv_hash`` on ``SWEEP_K_<group>`` (SWA may show
    ``verify_chain_hash`` instead). Returns ``(kv, Fault)``."""
    reasons = (FailReason.VERIFY_REAL_KV_HASH_MISMATCH,)
    if group == "SWA":
        reasons += (FailReason.VERIFY_CHAIN_HASH_MISMATCH,)
    return _kv_fault("real_kv_unused_cache", "SWEEP", kv, slot, position, page_size,
                     num_bytes_per_token, group, device, reasons)


def flip_real_kv_post_forward(kv, slot: int, position: int, *, page_size: int,
                              num_bytes_per_token: int, group: str = "FULL",
                              device: Optional[int] = None):
    """``real_kv_post_forward``: flip a slot written this step, after TAIL. Detected as
    ``verify_real_kv_hash`` at the next step's ``TAIL_K_<group>`` verify. Returns ``(kv, Fault)``."""
    return _kv_fault("real_kv_post_forward", "TAIL", kv, slot, position, page_size,
                     num_bytes_per_token, group, device, (FailReason.VERIFY_REAL_KV_HASH_MISMATCH,))


# -- next-token swap --------------------------------------------------------------------------------
def swap_next_tokens(next_tokens, i: int, j: int, *, groups: Sequence[str] = ("FULL",),
                     halves: Sequence[str] = ("K", "V")):
    """``next_token_swap``: swap the sampled next tokens of batch rows ``i`` and ``j`` (they must
    differ). With the oracle's true tokens as ``expected_input_tokens``, the next step's HEAD and
    TAIL writes report ``write_token``. Returns ``(tokens, Fault)``."""
    a, b = int(np.asarray(next_tokens[i])), int(np.asarray(next_tokens[j]))
    if a == b:
        raise ValueError("kv-canary: swap_next_tokens needs two different tokens")
    out = _set(_set(next_tokens, i, b), j, a)
    tags = tuple(sorted(launch_tag(st, h, g) for g in groups for h in halves
                        for st in ("HEAD", "TAIL")))
    return out, Fault("next_token_swap", groups[0], -1, -1,
                      f"next tokens of rows {i} and {j}: ({a}, {b}) -> ({b}, {a})", tags,
                      (FailReason.WRITE_TOKEN_MISMATCH,))


# -- KV that leaves the device (format.md §14) ------------------------------------------------------
OFFLOAD_KINDS = ("offload_byte_flip", "reload_wrong_slot", "transfer_byte_flip")


def flip_host_copy_byte(host_kv, host_slot: int, *, slot: int, position: int, page_size: int,
                        num_bytes_per_token: int, group: str = "FULL"):
    """``offload_byte_flip``: XOR 0xFF into byte 0 of ``host_slot``'s strip of a host copy of layer-0 K
    (numpy), between the device-to-host copy and the host check. Detected by that check as
    ``verify_real_kv_hash`` on ``HOST_BACKUP_K_<group>``, naming the device ``slot``. Returns
    ``(host_kv, Fault)``."""
    out = np.array(host_kv, copy=True)
    row, col = divmod(int(host_slot), int(page_size))
    out.reshape(out.shape[0], -1).view(np.uint8)[row, col * int(num_bytes_per_token)] ^= np.uint8(0xFF)
    return out, Fault("offload_byte_flip", group, int(slot), int(position),
                          f"byte 0 of host slot {host_slot} (device slot {slot}, position {position}) XOR 0xFF "
                          "in the host copy of layer-0 K", (HostCheckTag[f"HOST_BACKUP_K_{group}"],),
                          (FailReason.VERIFY_REAL_KV_HASH_MISMATCH,))


def swap_reload_slots(dst_slots, i: int, j: int, *, positions: Tuple[int, int], group: str = "FULL",
                      halves: Sequence[str] = ("K", "V")):
    """``reload_wrong_slot``: exchange entries ``i`` and ``j`` of the slot list a reload copies KV *and*
    records to, while the engine's tables keep the intended slots: a mapping bug on the way back.
    The next step's HEAD and TAIL verifies report ``verify_position`` / ``verify_chain_hash`` at the
    two slots. ``positions``: the positions of entries ``i`` and ``j``. Returns ``(slots, Fault)``."""
    a, b = int(dst_slots[i]), int(dst_slots[j])
    if a == b or positions[0] == positions[1]:
        raise ValueError("kv-canary: swap_reload_slots needs two different slots holding different positions")
    out = _set(np.asarray(dst_slots), i, b)
    out[j] = a
    tags = tuple(sorted(launch_tag(st, h, group) for h in halves for st in ("HEAD", "TAIL")))
    return out, Fault("reload_wrong_slot", group, a, int(positions[0]),
                      f"reload copies to slots ({a}, {b}) swapped: positions {positions[0]} and {positions[1]}",
                      tags, (FailReason.VERIFY_POSITION_MISMATCH, FailReason.VERIFY_CHAIN_HASH_MISMATCH))


def flip_transfer_byte(data: bytes, offset: int, *, slot: int, position: int, group: str = "FULL"):
    """``transfer_byte_flip``: XOR 0xFF into byte ``offset`` of a transfer pack in transit, inside the
    layer-0 K bytes of the entry whose sender slot is ``slot``. Detected on the receiving side by the
    pack's check as ``verify_real_kv_hash`` on ``HOST_TRANSFER_K_<group>`` with the sender's slot and
    position. Returns ``(data, Fault)``."""
    out = bytearray(data)
    out[int(offset)] ^= 0xFF
    return bytes(out), Fault("transfer_byte_flip", group, int(slot), int(position),
                             f"byte {offset} of the transfer pack (sender slot {slot}, position {position}, "
                             "layer-0 K) XOR 0xFF", (HostCheckTag[f"HOST_TRANSFER_K_{group}"],),
                             (FailReason.VERIFY_REAL_KV_HASH_MISMATCH,))
