"""Stand-ins for the sglang-jax objects the integration touches, for tests that run without
sglang-jax: a model runner whose model call returns a fixed KV buffer, the step arrays of a
``ForwardBatch``, requests, and a scheduler whose result processing records what it saw."""

from __future__ import annotations

import types
from typing import List, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


def kv_pool(kv0, class_name: str = "MHATokenToKVPool"):
    """A token KV pool holding layer 0's fused buffer ``kv0``, of a class named as sglang-jax's
    (the canary decides by the pool's class name which pools it guards)."""
    return type(class_name, (types.SimpleNamespace,), {})(kv_buffer=[kv0])


def fake_runner(kv0, **kw):
    """A main-layout ``ModelRunner`` over layer 0's fused buffer ``kv0`` (``kw`` overrides)."""
    pool = kv_pool(kv0)
    attrs = dict(jitted_run_model=lambda fb, lm: None, mesh=object(), token_to_kv_pool=pool,
                 memory_pools=types.SimpleNamespace(_pools={"token_to_kv_pool": pool},
                                                    replace_all=lambda u: None),
                 page_size=1, server_args=types.SimpleNamespace(attention_backend="native"))
    attrs.update(kw)
    return types.SimpleNamespace(**attrs)


def serving_runner(num_slots: int = 64):
    """A runner on a one-device mesh whose model call returns layer 0's KV unchanged."""
    mesh = jax.make_mesh((1,), ("data",))
    rep = NamedSharding(mesh, PartitionSpec())
    kv0 = jax.device_put(np.zeros((num_slots, 1, 4, 1, 8), np.float32), rep)
    outputs = (None, {"token_to_kv_pool": [kv0]}, None, None)
    return fake_runner(kv0, jitted_run_model=lambda fb, lm: outputs, mesh=mesh)


def forward_batch(mesh, *, bid: int, decode: bool, req_pool_indices, seq_lens, cache_loc,
                  input_ids, positions, out_cache_loc, extend_prefix_lens=None,
                  extend_seq_lens=None):
    """A ``ForwardBatch`` of the step arrays the canary reads (int32, on ``mesh``)."""
    data = NamedSharding(mesh, PartitionSpec("data"))
    arrays = dict(req_pool_indices=req_pool_indices, seq_lens=seq_lens, cache_loc=cache_loc,
                  input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
                  extend_prefix_lens=extend_prefix_lens, extend_seq_lens=extend_seq_lens)
    put = {k: None if v is None else jax.device_put(np.asarray(v, np.int32), data)
           for k, v in arrays.items()}
    return types.SimpleNamespace(bid=bid, forward_mode=types.SimpleNamespace(
        is_decode=lambda: decode, is_extend=lambda: not decode, is_target_verify=lambda: False),
        **put)


class FakeReq:
    """A running request: its pool row and the KV it holds; finished once ``finish()`` ran."""

    def __init__(self, rid: str, req_pool_idx: int, kv_len: int):
        self.rid, self.req_pool_idx = rid, req_pool_idx
        self.kv_committed_len = self.kv_allocated_len = kv_len
        self.to_finish = None
        self.finished_reason = None

    def finished(self) -> bool:
        return self.finished_reason is not None


class FakeScheduler:
    """A scheduler with one running batch of ``reqs``; ``process_batch_result`` records, for each
    request, the ``to_finish`` it found (what the scheduler's own processing would finish it
    with), after resolving the step's results like the overlap scheduler when ``overlap``."""

    def __init__(self, runner, reqs: Sequence[FakeReq], req_to_token, overlap: bool = False):
        self.batch = types.SimpleNamespace(reqs_info=[types.SimpleNamespace(reqs=list(reqs))])
        self.running_batch = self.cur_batch = self.batch
        self.req_to_token_pool = types.SimpleNamespace(req_to_token=np.asarray(req_to_token))
        self.tree_cache = None
        self.enable_overlap = overlap
        self.seen: List[dict] = []
        self.resolved = 0

        def resolve(*a, **k):
            self.resolved += 1

        self.tp_worker = types.SimpleNamespace(get_model_runner=lambda: runner,
                                               forward_batch_generation=lambda *a, **k: None,
                                               resolve_last_batch_result=resolve)

    def run_batch(self, batch):
        return None

    def get_next_batch_to_run(self):
        return None

    def process_batch_result(self, batch, result, launch_done=None):
        if self.enable_overlap:
            self.tp_worker.resolve_last_batch_result(launch_done)
        self.seen.append({req.rid: req.to_finish for req in batch.reqs_info[0].reqs})
