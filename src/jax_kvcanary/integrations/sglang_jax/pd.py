"""The canary records of a request's KV moved between sglang-jax's prefill and decode servers
(``--disaggregation-mode prefill|decode``, the ``jax_transfer`` engine, one host).

sglang-jax's prefill server gathers a finished prefill's KV pages (``_extract_req_kv``: one array
per layer, ``padded_pages`` pages padded with page 0) and registers them for the decode server to
pull; the decode server pulls them with a spec of the same shapes (``_build_kv_spec_for_req``) and
writes them into the slots it allocated (``_install_received_kv``). The records travel in the same
pull, as one more array beside the layers (format.md §14.1):

- prefill: the records of every HEAD/TAIL canary for the slots of the gathered pages, in page
  order (``uint8[padded_pages * page_size, 32 * canaries]``, replicated over the mesh);
- decode: the spec gets the same array; once the engine has written the KV, the records of the
  prompt's tokens are imported at the slots the KV went to (padding is not), so the decode steps
  that read the prompt verify the transferred prefix like any other: a page written to the wrong
  slots, or KV damaged or lost in transit, reports there (position, chain, fingerprint).

Both sides must run the canary (the launcher on each). A decode server whose prefill peer sent
no records (a peer without the canary) sees the pull fail: the wrapper raises before the engine
writes anything, with a ``kv-canary:`` message, and the engine's own handler of a failed install
releases the request's slots and aborts it; the server serves on.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ...runtime.config import endpoint_of
from ...runtime.offload import RECORD_BYTES, export_state_records, import_state_records

#: what the canary wraps on sglang-jax main's PD scheduler (its mixins' methods)
PREFILL_NEEDS = ("_extract_req_kv", "req_to_token_pool", "token_to_kv_pool_allocator")
DECODE_NEEDS = ("_build_kv_spec_for_req", "_install_received_kv", "token_to_kv_pool_allocator")


class TransferRecords:
    """The records of one PD server's transfers (``role`` ``prefill`` or ``decode``).

    Attributes: ``requests`` (whose records were sent, prefill, or received, decode) and
    ``slots`` (prompt slots whose records were sent or imported).
    """

    def __init__(self, canary, scheduler, role: str):
        if canary.tp > 1:
            raise ValueError("kv-canary: PD disaggregation with --tp-size above 1 is not supported "
                             "(not run here); run with --tp-size 1, or --kv-canary none")
        needs = PREFILL_NEEDS if role == "prefill" else DECODE_NEEDS
        missing = [a for a in needs if not hasattr(scheduler, a)]
        if missing:
            raise TypeError(f"kv-canary: this sglang-jax {role} scheduler lacks "
                            f"{', '.join(missing)}; the canary follows sglang-jax main's PD")
        self.canary = canary
        self.scheduler = scheduler
        self.role = role
        self.page_size = int(canary.layout.page_size)
        self.width = RECORD_BYTES * len(canary.state.canaries)
        self.sharding = NamedSharding(canary.runner.mesh, PartitionSpec())
        self.requests = self.slots = 0

    def _by_group(self, slots: np.ndarray) -> dict:
        """``slots`` for every group of the canary state (sglang-jax's MHA pool: ``FULL``)."""
        slots = jax.device_put(slots, self.sharding)
        return {endpoint_of(n)[2]: slots for n in self.canary.state.canaries}

    def install(self) -> "TransferRecords":
        s = self.scheduler
        if self.role == "prefill":
            s._extract_req_kv = functools.partial(self._extract_req_kv, s._extract_req_kv)
        else:
            s._build_kv_spec_for_req = functools.partial(self._build_kv_spec_for_req,
                                                         s._build_kv_spec_for_req)
            s._install_received_kv = functools.partial(self._install_received_kv,
                                                       s._install_received_kv)
        return self

    # -- prefill --------------------------------------------------------------------------------
    def _extract_req_kv(self, original, req):
        layers = original(req)
        pages = int(layers[0].shape[0])
        ps = self.page_size
        num = (len(req.origin_input_ids) + ps - 1) // ps
        row = np.asarray(self.scheduler.req_to_token_pool.req_to_token[req.req_pool_idx,
                                                                       :num * ps:ps])
        ids = np.zeros(pages, np.int64)
        ids[:num] = row // ps
        slots = (ids[:, None] * ps + np.arange(ps)).reshape(-1).astype(np.int32)
        c = self.canary
        with c._monitor_lock:
            records, _ = export_state_records(c.state, self._by_group(slots))
        records = jnp.concatenate([records[n] for n in sorted(records)], axis=1)
        self.requests += 1
        self.slots += len(req.origin_input_ids)
        return list(layers) + [jax.device_put(records, self.sharding)]

    # -- decode ---------------------------------------------------------------------------------
    def _build_kv_spec_for_req(self, original, req):
        spec = list(original(req))
        rows = int(spec[0].shape[0]) * self.page_size
        return spec + [jax.ShapeDtypeStruct((rows, self.width), jnp.uint8,
                                            sharding=self.sharding)]

    def _install_received_kv(self, original, req, kv_indices, kv):
        kv = list(kv)
        records = kv.pop()
        try:                          # a failed pull fails here, before anything is written
            records.block_until_ready()
        except Exception as e:
            raise RuntimeError(
                f"kv-canary: the KV pulled for request {req.rid} came without its canary records "
                f"({type(e).__name__}: {e}); is the prefill server running the launcher with the "
                "canary too? The request is not served from an unchecked prompt") from e
        original(req, kv_indices, kv)
        seqlen = len(req.origin_input_ids)
        slots = np.full(int(records.shape[0]), -1, np.int32)
        slots[:seqlen] = np.asarray(kv_indices)[:seqlen]
        names = sorted(self.canary.state.canaries)
        records = {n: records[:, k * RECORD_BYTES:(k + 1) * RECORD_BYTES]
                   for k, n in enumerate(names)}
        c = self.canary
        with c._monitor_lock:
            c.state, _ = import_state_records(c.state, self._by_group(slots), records)
        self.requests += 1
        self.slots += seqlen


def install_transfer_records(canary, scheduler):
    """``TransferRecords`` on a PD prefill or decode scheduler, or None for a plain server."""
    role = getattr(scheduler.server_args, "disaggregation_mode", "null")
    if role not in ("prefill", "decode"):
        return None
    canary.transfer = TransferRecords(canary, scheduler, role).install()
    return canary.transfer
