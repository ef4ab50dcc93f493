"""Test-only patches of sglang-jax bugs (not TPU stand-ins: these are the engine's own faults on
every device) that would otherwise end the servers some tests need. The product never installs
them; each says where the bug is.

``free_eagle_tail_slot``: with speculative decoding (EAGLE, EAGLE3) at page size 1, sglang-jax
main leaks one KV slot per finished request, and its idle-time check then ends the server
(``token_to_kv_pool_allocator memory leak detected!``, seen at the first idle moment after a
request). ``RadixCache.cache_finished_req`` keys the EAGLE radix tree by token bigrams, so the
tree takes the request's first ``committed - 1`` slots; at page size > 1 it frees the rest of
``kv_indices`` itself, at page size 1 it frees nothing, and ``release_kv_cache``
(``mem_cache/common.py``) frees the over-allocated slots from ``committed`` on: the slot of
position ``committed - 1`` belongs to nobody. The patch frees it after the stock method ran.
``--disable-radix-cache`` and page sizes above 1 do not leak.
"""

from __future__ import annotations

import numpy as np


def free_eagle_tail_slot() -> None:
    """Patch ``RadixCache.cache_finished_req`` (see the module docstring)."""
    from sgl_jax.srt.mem_cache.radix_cache import RadixCache

    stock = RadixCache.cache_finished_req
    if getattr(stock, "frees_eagle_tail", False):
        return

    def cache_finished_req(self, req, is_insert: bool = True, **kwargs):
        tail = None
        if (self.is_eagle and self.page_size == 1 and not self.disable
                and req.req_pool_idx is not None and not req.kv_committed_freed):
            n = int(req.kv_committed_len)
            tree_owned = req.cache_protected_len            # as the stock method counts it
            if tree_owned > req.last_matched_prefix_len:
                tree_owned -= 1
            if n >= 1 and n - 1 >= tree_owned:
                tail = np.array(self.req_to_token_pool.req_to_token[req.req_pool_idx, n - 1:n])
                tail = tail[tail != 0]
        stock(self, req, is_insert, **kwargs)
        if tail is not None and tail.size:
            dp_rank = req.dp_rank if req.dp_rank is not None else 0
            self.token_to_kv_pool_allocator.free(tail, dp_rank=dp_rank)

    cache_finished_req.frees_eagle_tail = True
    RadixCache.cache_finished_req = cache_finished_req
