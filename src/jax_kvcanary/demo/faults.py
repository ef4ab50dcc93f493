"""Fault injection in the toy engine: finds a target for each kind and applies the pure
functions of ``runtime.perturb`` at the point of the step that format.md §11 names.

Phases: ``pre`` (before the step: req_to_token swap, real-KV flip on a used slot, an SWA map
entry zeroed inside a request's window),
``post_forward`` (after TAIL: flip on a slot just written), ``post_sample`` (next-token swap),
``pre_sweep`` (on a sweep step: flip on a cached slot no running request references), and with the
offload tier ``offload`` (a byte of the host copy, before its check), ``transfer`` (a byte of a reload's
transfer pack in transit) and ``reload`` (two entries of a reload's slot list swapped).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..runtime import perturb
from ..runtime.transfer import unpack_transfer

PHASES = {"req_to_token_swap": "pre", "real_kv_used": "pre", "swa_evicted_in_window": "pre",
          "real_kv_post_forward": "post_forward",
          "next_token_swap": "post_sample", "real_kv_unused_cache": "pre_sweep",
          "offload_byte_flip": "offload", "transfer_byte_flip": "transfer", "reload_wrong_slot": "reload"}


class FaultInjectorMixin:
    """Mixed into ``ToyEngine``: ``arm()`` a fault; ``self.fault = (step, Fault)`` once injected."""

    def arm(self, kind: str, step: int, *, group: str = "FULL", device: Optional[int] = None):
        """Inject fault ``kind`` at the first step >= ``step`` where it has a target."""
        if kind not in perturb.KINDS + perturb.OFFLOAD_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; choose from {perturb.KINDS + perturb.OFFLOAD_KINDS}")
        if group == "SWA" and not self.cfg.swa:
            raise ValueError("fault group SWA needs the SWA layer (swa=True)")
        if kind == "swa_evicted_in_window" and group != "SWA":
            raise ValueError("fault swa_evicted_in_window targets the SWA group (group='SWA')")
        if kind in perturb.OFFLOAD_KINDS and (not self.cfg.offload or group != "FULL"):
            raise ValueError(f"fault {kind} needs the offload tier (offload=True) and targets the FULL group")
        if self.mesh is None:
            device = None
        elif device is None:
            device = 0
        self._armed = (kind, int(step), group, device)

    def _due(self, phase):
        a = self._armed
        return a if a is not None and PHASES[a[0]] == phase and self.step_no >= a[1] else None

    def _flip(self, group, slot, fn, position, device):
        li = self.mcfg.first_layer("full" if group == "FULL" else "swa")
        self.kv["k"][li], fault = fn(self.kv["k"][li], slot, position, page_size=self.cfg.page_size,
                                     num_bytes_per_token=self.mcfg.token_bytes, group=group,
                                     device=device)
        return fault

    def _inject_pre(self, rows, b):
        a = self._due("pre")
        if a is None:
            return
        kind, _, group, device = a
        fault = None
        if kind == "req_to_token_swap":
            here = set(int(s) for s in b["out_cache_loc"]) | {0}
            for r, p_len, _ in rows:
                if p_len < 3:
                    continue
                pos = max(1, p_len - self.cfg.swa_window) if group == "SWA" else p_len // 2
                if pos > p_len - 2:
                    continue
                cands = [s for s in self.alloc.live() if s not in here
                         and self.slot_pos.get(s, pos) != pos and s != self.req_to_token[r.rp, pos]
                         and (group == "FULL" or self.lut[s] != 0)]
                if cands:
                    new = int(self._rng.choice(cands))
                    self.req_to_token, fault = perturb.swap_req_to_token(
                        self.req_to_token, r.rp, pos, new, groups=(group,),
                        halves=self.canary.halves)
                    b["req_to_token"] = self.req_to_token.copy()
                    break
        elif kind == "swa_evicted_in_window":    # the newest prefix position: inside every window
            for r, p_len, _ in rows:
                full = int(self.req_to_token[r.rp, p_len - 1]) if p_len > 0 else 0
                if full and self.lut[full] != 0:
                    self.lut, fault = perturb.evict_swa_in_window(
                        self.lut, full, p_len - 1, halves=self.canary.halves)
                    b["lut"] = self.lut.copy()
                    break
        else:  # real_kv_used
            for r, p_len, _ in rows:
                if p_len < 1:
                    continue
                pos = p_len - 1 if group == "SWA" else p_len // 2
                slot = int(self.req_to_token[r.rp, pos])
                if group == "SWA":
                    slot = int(self.lut[slot])
                if slot:
                    fault = self._flip(group, slot, perturb.flip_real_kv_used, pos, device)
                    break
        self._record_fault(fault)

    def _inject_post_forward(self, rows):
        a = self._due("post_forward")
        if a is None:
            return
        _, _, group, device = a
        for r, p_len, e in rows:
            if r.prefilled and len(r.outputs) + 1 < r.max_new:   # a decode row that goes on
                pos = p_len + e - 1
                slot = r.slots[pos] if group == "FULL" else int(self.lut[r.slots[pos]])
                if slot:
                    self._record_fault(self._flip(group, slot, perturb.flip_real_kv_post_forward,
                                                  pos, device))
                    return

    def _inject_post_sample(self, rows, tokens):
        a = self._due("post_sample")
        if a is None:
            return tokens
        _, _, group, _ = a
        cands = [i for i, (r, p_len, e) in enumerate(rows)
                 if p_len + e >= len(r.prompt) and len(r.outputs) + 1 < r.max_new]
        for x in range(len(cands)):
            for y in range(x + 1, len(cands)):
                i, j = cands[x], cands[y]
                if tokens[i] != tokens[j]:
                    tokens, fault = perturb.swap_next_tokens(tokens, i, j, groups=self.groups,
                                                             halves=self.canary.halves)
                    self._record_fault(fault)
                    return tokens
        return tokens

    def _inject_pre_sweep(self):
        a = self._due("pre_sweep")
        if a is None:
            return
        _, _, group, device = a
        for n in self.cache.unused_nodes():
            slot = n.slot if group == "FULL" else int(self.lut[n.slot])
            if slot:
                self._record_fault(self._flip(group, slot, perturb.flip_real_kv_unused_cache,
                                              n.depth, device))
                return

    def _inject_offload(self, tier, host, full, nodes):
        """``offload_byte_flip``: a byte of the first offloaded slot's host copy of layer-0 K."""
        if self._due("offload") is None:
            return
        li = self.mcfg.first_layer("full")
        tier.kv["k"][li], fault = perturb.flip_host_copy_byte(
            tier.kv["k"][li], int(host[0]), slot=int(full[0]), position=nodes[0].depth, page_size=self.cfg.page_size,
            num_bytes_per_token=self.mcfg.token_bytes)
        self._record_fault(fault)

    def _inject_transfer(self, data: bytes, nodes):
        """``transfer_byte_flip``: byte 0 of the last entry's layer-0 K in the reload's pack."""
        if self._due("transfer") is None:
            return data
        pack, _ = unpack_transfer(data, check=False)
        j = len(nodes) - 1
        entry = pack.kv[f"FULL/k/{self.mcfg.first_layer('full')}"][j]
        offset = entry.ctypes.data - np.frombuffer(data, np.uint8).ctypes.data
        data, fault = perturb.flip_transfer_byte(data, offset, slot=int(pack.slots["FULL"][j]),
                                                 position=nodes[j].depth)
        self._record_fault(fault)
        return data

    def _inject_reload(self, new, nodes):
        """``reload_wrong_slot``: the reload copies entries 0 and 1 to each other's slots."""
        if self._due("reload") is None or len(nodes) < 2:
            return new
        dst, fault = perturb.swap_reload_slots(new, 0, 1, positions=(nodes[0].depth, nodes[1].depth),
                                               halves=self.canary.halves)
        self._record_fault(fault)
        return dst

    def _record_fault(self, fault):
        if fault is not None:
            self.fault = (self.step_no, fault)
            self._armed = None

