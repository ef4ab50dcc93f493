"""The toy engine's jitted functions, cached by static configuration so that every engine of
the same shape (tests, the demo's runs) compiles them once.

``step(rep, sh, kv, cstate, batch) -> (kv, cstate, next_tokens)``: canary HEAD, model forward,
canary TAIL (or the forward alone with the canary off). ``sweep(kv, cstate, plans) -> cstate``.
``offload_fns``: the offload tier's gather (KV + records out) and scatter (back into new slots).
Both donate the state; with ``devices > 1`` they run under ``jax.shard_map``, each device on its own
KV shard, canary buffers and ring.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..runtime.config import CanaryConfig
from ..runtime.endpoints import CanaryBatch, CanaryEndpoints
from ..runtime.multidevice import AXIS, device_mesh, global_view, local_view
from ..runtime.offload import export_state_records, import_state_records
from . import model as M


def step_key(c: CanaryConfig) -> CanaryConfig:
    """The part of the config that shapes the compiled step (host-only fields normalised)."""
    return c.replace(mode="log" if c.enabled else "none", sweep_interval=0, health_interval=0,
                     stats_interval=0)


def endpoints(ccfg, sizes):
    num_slots, rows, vcap, swa_vcap = sizes
    return CanaryEndpoints(ccfg, num_slots=num_slots, write_req_capacity=rows, verify_capacity=vcap,
                           swa_num_slots=num_slots, swa_verify_capacity=swa_vcap)


def _canary_batch(c: CanaryConfig, swa: bool, b) -> CanaryBatch:
    return CanaryBatch(
        b["req_pool_indices"], b["prefix_lens"], b["extend_seq_lens"], b["req_to_token"],
        b["input_ids"], b["positions"], b["out_cache_loc"],
        full_to_swa_index_mapping=b["lut"] if swa else None,
        expected_input_tokens=b["expected_input_tokens"] if c.write_input_assert else None,
        expected_input_positions=b["expected_input_positions"] if c.write_input_assert else None,
        token_pool=b["token_pool"] if c.token_check else None,
        token_valid_lens=b["token_valid_lens"] if c.token_check else None)


@functools.lru_cache(maxsize=None)
def step_fn(mcfg: M.ModelConfig, ccfg: CanaryConfig, on: bool, sizes, devices: int):
    """``step(rep, sh, kv, cstate, batch) -> (kv, cstate, next_tokens)``, jitted; kv and the canary
    state are donated. Canary HEAD before the forward, TAIL after it (when ``on``)."""
    ep = endpoints(ccfg, sizes)
    swa = "swa" in mcfg.layers

    def local(rep, sh, kv, cs, b, axis):
        if on:
            cs, ctx = ep.head(cs, _canary_batch(ccfg, swa, b))
        kv, next_tokens = M.forward(mcfg, rep, sh, kv, b, axis)
        if on:
            cs = ep.tail(cs, ctx, M.real_kv_sources(mcfg, kv))
        return kv, cs, next_tokens

    if devices == 1:
        return jax.jit(lambda rep, sh, kv, cs, b: local(rep, sh, kv, cs, b, None),
                       donate_argnums=(2, 3))

    def body(rep, sh, kv, cs, b):
        sh, kv, cs = local_view((sh, kv, cs))
        kv, cs, nt = local(rep, sh, kv, cs, b, AXIS)
        return global_view(kv), global_view(cs), nt

    return jax.jit(jax.shard_map(body, mesh=device_mesh(devices),
                                 in_specs=(P(), P(AXIS), P(AXIS), P(AXIS), P()),
                                 out_specs=(P(AXIS), P(AXIS), P())),
                   donate_argnums=(2, 3))


@functools.lru_cache(maxsize=None)
def sweep_fn(mcfg: M.ModelConfig, ccfg: CanaryConfig, sizes, devices: int):
    """``sweep(kv, cstate, plans) -> cstate``, jitted; the canary state is donated."""
    ep = endpoints(ccfg, sizes)

    def local(kv, cs, plans):
        return ep.sweep(cs, plans, M.real_kv_sources(mcfg, kv))

    if devices == 1:
        return jax.jit(local, donate_argnums=(1,))

    def body(kv, cs, plans):
        kv, cs = local_view((kv, cs))
        return global_view(local(kv, cs, plans))

    return jax.jit(jax.shard_map(body, mesh=device_mesh(devices), in_specs=(P(AXIS), P(AXIS), P()),
                                 out_specs=P(AXIS)), donate_argnums=(1,))


def _slot_lists(ccfg: CanaryConfig, full, swa):
    return {g: (full if g == "FULL" else swa) for g in ccfg.groups}


@functools.lru_cache(maxsize=None)
def offload_fns(mcfg: M.ModelConfig, ccfg: CanaryConfig):
    """The offload tier's device side, jitted (one device):

    ``gather(kv, cstate, full, swa) -> (rows, records, out_of_range)``: every layer's K and V of the
    slots (``rows[h][layer]``: ``[n, heads, head_dim]``; full layers at ``full``, SWA layers at
    ``swa``) and the records of every HEAD/TAIL canary, exported with the same lists;
    ``scatter(kv, cstate, full, swa, rows, records) -> (kv, cstate, out_of_range)``: the way back
    (kv and the canary state donated). A negative slot is padding: nothing is read or written.
    """
    def layer_slots(kind, full, swa):
        return full if kind == "full" else swa

    def gather(kv, cs, full, swa):
        rows = {h: [jnp.take(a.reshape((-1,) + a.shape[2:]), jnp.clip(layer_slots(kind, full, swa), 0, None), axis=0)
                    for a, kind in zip(kv[h], mcfg.layers)] for h in kv}
        records, oob = export_state_records(cs, _slot_lists(ccfg, full, swa))
        return rows, records, oob

    def scatter(kv, cs, full, swa, rows, records):
        new = {}
        for h in kv:
            new[h] = []
            for a, kind, r in zip(kv[h], mcfg.layers, rows[h]):
                flat = a.reshape((-1,) + a.shape[2:])
                s = layer_slots(kind, full, swa)
                flat = flat.at[jnp.where(s >= 0, s, flat.shape[0])].set(r, mode="drop")
                new[h].append(flat.reshape(a.shape))
        cs, oob = import_state_records(cs, _slot_lists(ccfg, full, swa), records)
        return new, cs, oob

    return jax.jit(gather), jax.jit(scatter, donate_argnums=(0, 1))
