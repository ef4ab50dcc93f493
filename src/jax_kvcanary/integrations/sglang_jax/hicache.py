"""The canary records of sglang-jax's HiCache host tier (``--hicache-storage none``).

sglang-jax main keeps evicted radix-tree nodes in a host pool (``LRUHostKVPool``: one host page =
one device page, every layer) and loads them back into new device slots on a prefix hit. The
records travel with the KV (format.md §14.1), with the same page lists as the engine's copies:

- backup (``stage_backup``, the scheduler's thread): the records of the device pages' slots are
  exported from the canary state and kept for the host pages, in the host pool's numbering;
- the host copy (``flush_backup``, the engine's D2H worker): once the engine has written a host
  page, its layer-0 KV is fingerprinted on the host and compared with the records exported with
  it; mismatches are ``HOST_BACKUP_*`` rows naming the device slots, reported at once (in mode
  ``raise`` they end the server, as a violation found between steps does);
- load (``flush_load``, the scheduler's thread, before the batch that reads the prefix): the
  records of every host page the engine scatters are imported at the new device slots; a page the
  engine skips (its host page was freed and reused while the load was staged) stays unimported, so
  the next step that reads its device slots reports them (``verify_*`` rows: position, chain or
  fingerprint of whatever those slots held before);
- free / release of host pages: their records are dropped.

With tensor parallelism the records of each device's canary (its own heads' fingerprints) travel
as a block of their own, and each device's heads of the host copy are checked against its block.
"""

from __future__ import annotations

import functools
import threading
from typing import Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ...consts import RealKvHashMode
from ...runtime.errors import CanaryViolationError
from ...runtime.hostcheck import check_records
from ...runtime.offload import export_records, import_records
from .layout import real_kv_sources

#: what the canary reads of the engine's ``LRUHostKVPool`` (sglang-jax main)
HOST_POOL_NEEDS = ("stage_backup", "flush_backup", "flush_load", "free", "release", "_lock",
                   "_pending_load_lock", "_pending_load", "_generation", "_allocated", "_slots",
                   "_page_size")


def _per_block(fn, canary, in_axes):
    """``fn`` of ``runtime.offload`` on one canary, or with tensor parallelism (``[tp, slots,
    stride]``) on each device's block."""
    return jax.vmap(fn, in_axes=in_axes) if canary.ndim == 3 else fn


def _export(canaries: dict, slots):
    return {name: _per_block(export_records, c, (0, None))(c, slots)[0]
            for name, c in canaries.items()}


def _import(canaries: dict, slots, records: dict):
    return {name: _per_block(import_records, c, (0, None, 0))(c, slots, _like(records[name], c))[0]
            for name, c in canaries.items()}


def _like(records, canary):
    """Per-device record blocks sharded as the canary's (vmap maps both over one axis)."""
    return (jax.sharding.reshard(records, jax.typeof(canary).sharding) if canary.ndim == 3
            else records)


class HostRecords:
    """The records of one scheduler's HiCache host pool (``tree_cache.host_pool``), kept beside it.

    Args:
      canary: the installed ``SglangJaxCanary``.
      host_pool: the engine's ``LRUHostKVPool``.

    Attributes: ``pages`` (host page id -> ``{canary name: uint8[(tp,) page_size, 32]}``),
    ``exported`` / ``imported`` / ``skipped`` / ``checked`` (pages so far).
    """

    def __init__(self, canary, host_pool):
        missing = [a for a in HOST_POOL_NEEDS if not hasattr(host_pool, a)]
        if missing:
            raise TypeError(f"kv-canary: this sglang-jax HiCache host pool "
                            f"({type(host_pool).__name__}) lacks {', '.join(missing)}; the "
                            "canary follows the LRUHostKVPool of sglang-jax main")
        self.canary = canary
        self.pool = host_pool
        self.page_size = int(host_pool._page_size)
        self.pages: Dict[int, dict] = {}
        self._lock = threading.Lock()                # the D2H worker and the scheduler's thread
        self.exported = self.imported = self.skipped = self.checked = 0
        self._export = jax.jit(_export)
        self._import = jax.jit(_import, donate_argnums=(0,),
                               out_shardings=canary._state_sharding())

    # -- install --------------------------------------------------------------------------------
    def install(self) -> "HostRecords":
        """Wrap the host pool's backup, load and free."""
        pool = self.pool
        for name in ("stage_backup", "flush_backup", "flush_load", "free", "release"):
            setattr(pool, name, functools.partial(getattr(self, "_" + name),
                                                  getattr(pool, name)))
        return self

    def _slots(self, device_pages) -> np.ndarray:
        ps = self.page_size
        pages = np.asarray(device_pages, np.int64).reshape(-1, 1)
        return (pages * ps + np.arange(ps, dtype=np.int64)).reshape(-1).astype(np.int32)

    # -- the engine's copies --------------------------------------------------------------------
    def _stage_backup(self, original, device_indices, host_buffer_ids):
        original(device_indices, host_buffer_ids)
        ids = [int(b) for b in host_buffer_ids]
        if not ids:
            return
        c = self.canary
        with c._monitor_lock:
            out = self._export(c.state.canaries, jnp.asarray(self._slots(device_indices)))
        out = {k: np.asarray(v) for k, v in out.items()}
        ps, axis = self.page_size, out[next(iter(out))].ndim - 2
        with self._lock:
            for i, bid in enumerate(ids):
                sl = (slice(None),) * axis + (slice(i * ps, (i + 1) * ps),)
                self.pages[bid] = {"device_pages": int(device_indices[i]),
                                   "records": {k: v[sl] for k, v in out.items()}}
            self.exported += len(ids)

    def _flush_backup(self, original, host_buffer_ids):
        original(host_buffer_ids)
        if self.canary.config.real_kv_hash_mode == RealKvHashMode.NONE:
            return
        c = self.canary
        try:
            rows = self.check(host_buffer_ids)
            if rows.shape[0]:
                c.report_host_rows(rows)
        except CanaryViolationError as e:             # mode raise: end the server, as idle does
            if c.idle.on_error is not None:
                c.idle.on_error(e)
            else:
                c.logger.error("kv-canary: %s", e)
        except Exception as e:                        # the engine's worker must not die of it
            c.logger.exception("kv-canary: the check of a HiCache host copy failed (%s: %s)",
                               type(e).__name__, e)

    def _flush_load(self, original, host_buffer_ids, device_indices):
        ids = [int(b) for b in host_buffer_ids]
        pool = self.pool
        with pool._lock, pool._pending_load_lock:     # what the engine scatters (its epoch check)
            fresh = [pool._allocated[b] and b in pool._pending_load
                     and pool._pending_load[b][0] == pool._generation[b] for b in ids]
        original(host_buffer_ids, device_indices)
        with self._lock:
            take = [(b, int(p)) for b, p, ok in zip(ids, device_indices, fresh)
                    if ok and b in self.pages]
            entries = [self.pages[b]["records"] for b, _ in take]
        skipped = len(ids) - len(take)
        if take:
            axis = entries[0][next(iter(entries[0]))].ndim - 2
            records = {k: np.concatenate([e[k] for e in entries], axis=axis) for k in entries[0]}
            slots = jnp.asarray(self._slots([p for _, p in take]))
            c = self.canary
            with c._monitor_lock:
                canaries = self._import(dict(c.state.canaries), slots, records)
                c.state = c.state.replace(canaries=canaries)
        self.imported += len(take)
        self.skipped += skipped
        self.canary.logger.info("kv-canary: HiCache load of %d page(s): records imported at their "
                                "new device pages%s", len(ids), f"; {skipped} page(s) left "
                                "unimported (skipped by the engine, or never backed up with "
                                "records)" if skipped else "")

    def _free(self, original, host_page_ids):
        original(host_page_ids)
        with self._lock:
            for b in host_page_ids:
                self.pages.pop(int(b), None)

    def _release(self, original, buffer_id):
        original(buffer_id)
        with self._lock:
            self.pages.pop(int(buffer_id), None)

    # -- the host check -------------------------------------------------------------------------
    def check(self, host_buffer_ids) -> np.ndarray:
        """The ``HOST_BACKUP_*`` rows of the host copies of ``host_buffer_ids`` (those the engine
        published), against the records exported with them: ``int64[k, 8]``."""
        pool, ps, mode = self.pool, self.page_size, self.canary.config.real_kv_hash_mode
        with self._lock:
            got = [(int(b), pool._slots[int(b)], self.pages.get(int(b))) for b in host_buffer_ids]
        got = [(b, s, e) for b, s, e in got if s is not None and e is not None]
        if not got:
            return np.zeros((0, 8), np.int64)
        report = self._slots([e["device_pages"] for _, _, e in got])
        host = np.arange(len(got) * ps, dtype=np.int64)
        names = list(got[0][2]["records"])
        tp = self.canary.tp
        rows = []
        for d in range(tp if tp > 1 else 1):
            kv0 = np.stack([_layer0(s, d if tp > 1 else None) for _, s, _ in got])
            src = real_kv_sources(kv0, mode)
            sources = {n: src[n.split("_")[1]] for n in names if n.startswith("TAIL_")}
            recs = {n: np.concatenate([e["records"][n][d] if tp > 1 else e["records"][n]
                                       for _, _, e in got]) for n in names}
            res = check_records(sources, recs, {"FULL": host}, stage="BACKUP",
                                real_kv_hash_mode=mode, report_slots={"FULL": report})
            rows.append(res.rows)
        self.checked += len(got)
        return np.concatenate(rows)


def _layer0(slot: jax.Array, device: Optional[int]) -> np.ndarray:
    """Layer 0 of one host page ``(layer_num, page_size, ...)``: the whole page, or the heads of
    tensor-parallel device ``device`` (its shard)."""
    if device is None:
        return np.asarray(slot[0])
    shards = sorted(slot.addressable_shards, key=lambda s: s.index[2].start or 0)
    return np.asarray(shards[device].data)[0]


def install_host_records(canary, tree_cache) -> Optional[HostRecords]:
    """``HostRecords`` on the scheduler's HiCache host pool, or None without HiCache."""
    if not getattr(tree_cache, "hicache_enabled", False):
        return None
    if canary.layout.latent is not None:
        raise ValueError("kv-canary: HiCache with the MLA latent pool is not supported: its host "
                         "check reads fused K/V rows; run with --hicache-storage disable")
    canary.host_tier = HostRecords(canary, tree_cache.host_pool).install()
    return canary.host_tier
