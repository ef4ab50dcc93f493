"""The toy engine's offload tier (``--offload``, format.md §14): cold prefix-cache slots move to host
memory with their canary records and come back into new device slots on a prefix hit.

Offload, after each step: every cached node that no running request holds is gathered from the
device (every layer's K and V, and the records of every HEAD/TAIL canary, exported with the same
slot lists) into the host pool; the host check re-computes the fingerprints of the host copy
(``HOST_BACKUP_*`` rows name the device slots); the device slots are freed.

Reload, on a prefix hit before the step: the host tier ships the nodes' KV and records as a transfer
pack, as a remote tier or another engine would; the engine unpacks it, which checks the received KV
(``HOST_TRANSFER_*`` rows name the host tier's slots), copies KV and records into newly allocated
slots with one slot list per group, and points the cache at them. The next step's HEAD and TAIL
verifies then check the reloaded prefix like any other.

Host pool: one host slot per node for every layer (full layers hold the node's full-pool KV, SWA
layers its SWA-pool KV when it has an SWA slot), in 64-byte-aligned pages.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..consts import RealKvHashMode
from ..inputs import RealKvSource
from ..runtime.config import endpoint_of
from ..runtime.hostcheck import aligned_host_array, check_records
from ..runtime.sweep import bucket_capacity
from ..runtime.transfer import pack_transfer, unpack_transfer
from . import steps
from .kvpool import SlotAllocator

MIN_BUCKET = 16   # gather/scatter compile once per power-of-two bucket of this size or more


class HostTier:
    """The host side of the offload tier of one ``ToyEngine`` (single device)."""

    def __init__(self, engine):
        e, m = engine, engine.mcfg
        self.engine = e
        self.page = m.page_size
        self.groups = e.canary.groups
        self.mode = e.canary.real_kv_hash_mode
        shape = (e.num_slots // m.page_size, m.page_size, m.local_heads, m.head_dim)
        self.kv = {h: [aligned_host_array(shape, np.float32) for _ in m.layers] for h in ("k", "v")}
        self.records = {name: np.zeros((e.num_slots, 32), np.uint8) for name in e.cstate.canaries}
        self.has_swa = np.zeros(e.num_slots, bool)
        self.alloc = SlotAllocator(e.num_slots)
        self.gather, self.scatter = steps.offload_fns(m, steps.step_key(e.canary))
        self.offloaded = self.reloaded = self.checked = 0

    # -- layout -----------------------------------------------------------------------------------
    def _flat(self, h, li):
        a = self.kv[h][li]
        return a.reshape((-1,) + a.shape[2:])

    def _layer_of(self, group):
        return self.engine.mcfg.first_layer("full" if group == "FULL" else "swa")

    def _sel(self, group, has):
        return slice(None) if group == "FULL" else has

    def sources(self):
        """``{TAIL canary name: RealKvSource}`` over the host copy of each group's layer 0 (the
        device's TAIL geometry)."""
        tb = self.engine.mcfg.token_bytes
        return {f"TAIL_{h.upper()}_{g}": RealKvSource(self.kv[h][self._layer_of(g)], self.page, tb, tb)
                for g in self.groups for h in ("k", "v") if h.upper() in self.engine.canary.halves}

    @staticmethod
    def _pad(x, n):
        out = np.full(n, -1, np.int32)
        out[:len(x)] = x
        return jnp.asarray(out)

    # -- offload ----------------------------------------------------------------------------------
    def offload_cold(self):
        """Move every resident cached node that no running request holds to the host; returns the
        host check's violations (reported to the monitor)."""
        e = self.engine
        nodes = e.cache.unused_nodes()
        if not nodes:
            return []
        n = len(nodes)
        full = np.array([nd.slot for nd in nodes], np.int32)
        swa = e.lut[full].astype(np.int32) if e.cfg.swa else np.zeros(n, np.int32)
        has = swa > 0
        nb = bucket_capacity(n, MIN_BUCKET)
        rows, recs, oob = self.gather(e.kv, e.cstate, self._pad(full, nb), self._pad(np.where(has, swa, -1), nb))
        if int(oob[0]):
            raise RuntimeError(f"toy engine: offload of {n} slots named {int(oob[0])} out-of-range slots")
        host = np.array(self.alloc.alloc(n), np.int64)
        for h in self.kv:
            for li, kind in enumerate(e.mcfg.layers):
                sel = slice(None) if kind == "full" else has
                self._flat(h, li)[host[sel]] = np.asarray(rows[h][li])[:n][sel]
        for name, r in recs.items():
            sel = self._sel(endpoint_of(name)[2], has)
            self.records[name][host[sel]] = np.asarray(r)[:n][sel]
        self.has_swa[host] = has
        e._inject_offload(self, host, full, nodes)
        found = []
        if self.mode != RealKvHashMode.NONE:
            res = check_records(self.sources(), {k: v[host[self._sel(endpoint_of(k)[2], has)]]
                                                 for k, v in self.records.items()},
                                {"FULL": host, "SWA": host[has]}, stage="BACKUP", real_kv_hash_mode=self.mode,
                                report_slots={"FULL": full, "SWA": swa[has]})
            self.checked += res.checked
            found = res.rows
        for nd, hs in zip(nodes, host):
            nd.host_slot, nd.slot = int(hs), -1
        e._free_full(full)
        self.offloaded += n
        return e.monitor.report_rows(found, step=e.step_no)

    # -- reload -----------------------------------------------------------------------------------
    def _pack(self, host, has):
        """The host tier's side: the nodes' KV and records as a transfer pack (slots = host slots)."""
        e, tb = self.engine, self.engine.mcfg.token_bytes
        kv = {}
        for h in self.kv:
            for li, kind in enumerate(e.mcfg.layers):
                g = "FULL" if kind == "full" else "SWA"
                kv[f"{g}/{h}/{li}"] = self._flat(h, li)[host[self._sel(g, has)]]
        records = {k: v[host[self._sel(endpoint_of(k)[2], has)]] for k, v in self.records.items()}
        fingerprints = {name: [(f"{g}/{h.lower()}/{self._layer_of(g)}", tb)]
                        for name in self.sources() for _, h, g in [endpoint_of(name)]}
        slots = {"FULL": host, "SWA": host[has]} if e.cfg.swa else {"FULL": host}
        return pack_transfer(slots, kv, records, fingerprints=fingerprints, real_kv_hash_mode=self.mode)

    def reload(self, nodes):
        """Bring offloaded ``nodes`` (a prefix path, parents first) back into new device slots;
        returns the transfer check's violations (reported to the monitor)."""
        e = self.engine
        n = len(nodes)
        host = np.array([nd.host_slot for nd in nodes], np.int64)
        has = self.has_swa[host]
        data = e._inject_transfer(self._pack(host, has), nodes)
        pack, res = unpack_transfer(data, check=self.mode != RealKvHashMode.NONE)
        new = np.array(e.alloc.alloc(n), np.int32)
        new_swa = np.full(n, -1, np.int32)
        if e.cfg.swa:
            new_swa[has] = e.swa_alloc.alloc(int(has.sum()))
            e.lut[new] = np.where(has, new_swa, 0)
        dst = e._inject_reload(new, nodes)
        nb = bucket_capacity(n, MIN_BUCKET)
        rows = {}
        for h in self.kv:
            rows[h] = []
            for li, kind in enumerate(e.mcfg.layers):
                g = "FULL" if kind == "full" else "SWA"
                r = np.zeros((nb,) + self.kv[h][li].shape[2:], np.float32)
                r[:n][self._sel(g, has)] = pack.kv[f"{g}/{h}/{li}"]
                rows[h].append(jnp.asarray(r))
        recs = {}
        for name, r in pack.records.items():
            full_r = np.zeros((nb, 32), np.uint8)
            full_r[:n][self._sel(endpoint_of(name)[2], has)] = r
            recs[name] = jnp.asarray(full_r)
        e.kv, e.cstate, oob = self.scatter(e.kv, e.cstate, self._pad(dst, nb), self._pad(new_swa, nb), rows, recs)
        if int(oob[0]):
            raise RuntimeError(f"toy engine: reload of {n} slots named {int(oob[0])} out-of-range slots")
        for nd, s in zip(nodes, new):
            nd.slot, nd.host_slot = int(s), None
            e.slot_pos[int(s)] = nd.depth
        self.alloc.free(host)
        self.reloaded += n
        self.checked += res.checked
        return e.monitor.report_rows(res.rows, step=e.step_no)

    def adopt(self, node, slot: int):
        """A request just prefilled ``slot`` with the same content as the offloaded ``node``: the node
        takes that device slot back and its host copy is dropped."""
        self.alloc.free([node.host_slot])
        node.slot, node.host_slot = int(slot), None
