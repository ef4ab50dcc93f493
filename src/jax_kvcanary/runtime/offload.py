"""Canary records that travel with KV leaving the device (format.md §14.1).

When an engine copies KV slots out of device memory (a host tier, a transfer to another engine)
it exports the slots' canary records with the *same index list* as the KV copy, and when the KV
comes back (to new slots) it imports them with the same list as the KV copy back. A mapping bug on
either way moves records and KV together, so the slots the engine's ``req_to_token`` then points at
hold records whose positions and chain no longer fit: the next HEAD/TAIL verify reports them.

Slot sentinels (the write op's, format.md §7.5): a negative slot is padding, skipped and not
counted; ``slot >= num_slots`` is out of range, skipped and counted; slot 0 is a slot like any
other (it receives the dummy writes of padded tokens, so using 0 as padding is harmless too).

Everything here is plain JAX: jit-compatible, the same on every backend, no x64 needed.
"""

from __future__ import annotations

from typing import Mapping, Tuple

import jax
import jax.numpy as jnp

from .. import checks, consts
from .config import endpoint_of
from .endpoints import CanaryState

RECORD_BYTES = consts.CANARY_SLOT_BYTES


def _out_of_range(slots, num_slots):
    return jnp.sum(slots >= num_slots, dtype=jnp.int32).reshape(1)


@jax.jit
def _export(canary, slots):
    num_slots = canary.shape[0]
    ok = (slots >= 0) & (slots < num_slots)
    rows = jnp.take(canary[:, :RECORD_BYTES], jnp.clip(slots, 0, num_slots - 1), axis=0)
    return jnp.where(ok[:, None], rows, jnp.uint8(0)), _out_of_range(slots, num_slots)


@jax.jit
def _import(canary, slots, records):
    num_slots = canary.shape[0]
    ok = (slots >= 0) & (slots < num_slots)
    # duplicates: the last entry wins (as in a copy with the same list); XLA's scatter leaves the
    # winner of duplicate indices unspecified, so every entry but the last of a slot is dropped.
    key = jnp.where(ok, slots, num_slots)
    order = jnp.argsort(key, stable=True)
    ordered = key[order]
    last = jnp.concatenate([ordered[:-1] != ordered[1:], jnp.ones((1,), bool)])
    keep = jnp.zeros(slots.shape, bool).at[order].set(last) & ok
    target = jnp.where(keep, slots, num_slots)           # num_slots: dropped by mode="drop"
    canary = canary.at[target, :RECORD_BYTES].set(records, mode="drop")
    return canary, _out_of_range(slots, num_slots)


def export_records(canary, slots) -> Tuple[jax.Array, jax.Array]:
    """Gather the canary records of ``slots`` (format.md §14.1).

    Args:
      canary: ``uint8[num_slots, stride]``.
      slots: int32/int64 ``[n]``, the slots being copied out, in the order of the KV copy.

    Returns:
      ``(records, out_of_range)``: ``records`` ``uint8[n, 32]`` (entry ``i`` = the first 32 bytes of
      slot ``slots[i]``; all zeros for a skipped entry) and ``out_of_range`` ``int32[1]``, the number
      of entries with ``slot >= num_slots``. Negative slots are skipped and not counted.

    Raises:
      TypeError, ValueError: a ``kv-canary:`` message for a bad canary or slot array.
    """
    checks.canary(canary)
    n = checks.index_array(slots, "slots")
    if n == 0:
        return jnp.zeros((0, RECORD_BYTES), jnp.uint8), jnp.zeros((1,), jnp.int32)
    return _export(canary, slots)


def import_records(canary, slots, records) -> Tuple[jax.Array, jax.Array]:
    """Scatter ``records`` into the canary at ``slots`` (format.md §14.1): the inverse of
    ``export_records`` with the index list of the KV copy back.

    Bytes ``[32, stride)`` of a slot and every slot not named are left as they were. When a slot is
    named twice the later entry wins. In a jit that donates ``canary`` it is updated in place.

    Args:
      canary: ``uint8[num_slots, stride]``.
      slots: int32/int64 ``[n]``; negative = skip; ``>= num_slots`` = skip and count.
      records: ``uint8[n, 32]``, e.g. from ``export_records``.

    Returns:
      ``(canary, out_of_range)``: the updated canary and ``int32[1]``, the entries with
      ``slot >= num_slots``.

    Raises:
      TypeError, ValueError: a ``kv-canary:`` message for a bad canary, slot or record array.
    """
    checks.canary(canary)
    n = checks.index_array(slots, "slots")
    checks.records(records, n)
    if n == 0:
        return canary, jnp.zeros((1,), jnp.int32)
    return _import(canary, slots, records)


def export_state_records(state: CanaryState, slots: Mapping[str, jax.Array]
                         ) -> Tuple[dict, jax.Array]:
    """Export the records of every HEAD and TAIL canary of ``state`` for the slots leaving the device.

    Both stages travel: after a correct reload the next step's HEAD verify (chain, position) and
    TAIL verify (chain, position, real-KV fingerprint) both find the records they expect at the new
    slots, and after a wrong one both report.

    Args:
      state: the engine's ``CanaryState``.
      slots: ``{group: int32/int64[n_g]}``, the slots copied out in each watched group's slot space
        (SWA: the SWA slots). Groups left out export nothing.

    Returns:
      ``(records, out_of_range)``: ``{canary name (e.g. 'TAIL_K_SWA'): uint8[n_g, 32]}`` and the
      ``int32[1]`` count of out-of-range entries summed over the canaries.
    """
    out, oob = {}, jnp.zeros((1,), jnp.int32)
    for name in sorted(state.canaries):
        if endpoint_of(name)[2] in slots:
            out[name], bad = export_records(state.canaries[name], slots[endpoint_of(name)[2]])
            oob = oob + bad
    return out, oob


def import_state_records(state: CanaryState, slots: Mapping[str, jax.Array], records: Mapping
                         ) -> Tuple[CanaryState, jax.Array]:
    """Import records exported by ``export_state_records`` into ``state`` at the slots the KV was
    copied back to (the inverse, with the same ``{group: slots}`` mapping).

    Raises:
      ValueError: ``records`` lacks a canary of ``state`` whose group is in ``slots``.

    Returns:
      ``(state, out_of_range)``, as ``export_state_records``.
    """
    canaries, oob = dict(state.canaries), jnp.zeros((1,), jnp.int32)
    for name in sorted(canaries):
        if endpoint_of(name)[2] not in slots:
            continue
        if name not in records:
            raise ValueError(f"kv-canary: records has no entry for canary {name!r} (got "
                             f"{sorted(records)})")
        canaries[name], bad = import_records(canaries[name], slots[endpoint_of(name)[2]], records[name])
        oob = oob + bad
    return state.replace(canaries=canaries), oob
