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

``verify_pages_per_request`` (installed by ``tests.support.launch_with_stand_ins`` when
``VERIFY_PAGES_SWITCH`` is ``1``, for the clean twin of a server that runs the bug): with
``--speculative-algorithm EAGLE`` a batch of two or more requests is served wrong (EAGLE3 without
the overlap scheduler takes a legacy path of its own, which serves the same batches right). The
decode batch's ``cache_loc`` lays each request's pages out by its allocated length
(``allocate_lens``: the committed tokens plus the slots allocated ahead for draft tokens), and
``FlashAttention.get_eagle_forward_metadata`` cuts the TARGET_VERIFY page table at the requests'
KV lengths (``seq_lens + draft_token_num``) without re-gathering it, which it does for
DRAFT_EXTEND: batch row ``r >= 1`` reads the slots that start where row ``r - 1``'s KV length
ends, the end of row ``r - 1``'s over-allocation, and the verify kernel writes its draft tokens'
KV there. The patch re-gathers each request's pages from its allocated segment, as the
DRAFT_EXTEND branch does.
"""

from __future__ import annotations

import numpy as np

#: the environment switch with which ``tests.support.launch_with_stand_ins`` installs
#: ``verify_pages_per_request`` (the twin of a server that runs the stock bug)
VERIFY_PAGES_SWITCH = "KV_CANARY_TEST_FIX_EAGLE_VERIFY_PAGES"


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


def verify_pages_per_request() -> None:
    """Patch ``FlashAttention.get_eagle_forward_metadata`` so that a TARGET_VERIFY step's page
    table holds each request's own pages (see the module docstring)."""
    from sgl_jax.srt.layers.attention.flashattention_backend import FlashAttention

    stock = FlashAttention.get_eagle_forward_metadata
    if getattr(stock, "pages_per_request", False):
        return

    def get_eagle_forward_metadata(self, batch, *, page_indices=None, **kwargs):
        spec = batch.spec_info_padded
        allocate = getattr(spec, "allocate_lens", None)
        if (batch.forward_mode.is_target_verify() and page_indices is None
                and allocate is not None and int(batch.dp_size) == 1):
            ps = self.page_size
            pages = (np.asarray(batch.cache_loc)[::ps] // ps).astype(np.int32)
            sel = np.asarray(batch.logits_indices_selector)
            kv_lens = np.asarray(batch.seq_lens)[sel] + int(spec.draft_token_num)
            need = (kv_lens + ps - 1) // ps                   # pages attention reads per request
            have = (np.asarray(allocate, np.int64) + ps - 1) // ps   # pages laid out per request
            page_indices = np.zeros_like(pages)
            src = dst = 0
            for n, m in zip(need, have):
                page_indices[dst:dst + n] = pages[src:src + n]
                src, dst = src + int(m), dst + int(n)
        return stock(self, batch, page_indices=page_indices, **kwargs)

    get_eagle_forward_metadata.pages_per_request = True
    FlashAttention.get_eagle_forward_metadata = get_eagle_forward_metadata
