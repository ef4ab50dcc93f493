"""A tiny in-process sglang-jax 0.0.2 engine for the integration's in-process tests (test support).

``TinyEngine`` builds a random-weight Qwen2 (2 layers, hidden 256, 2 heads, 1 KV head, vocab 512,
float32) from a hand-written ``config.json`` (``load_format='dummy'``, then every floating weight
replaced by small normal values; nothing is downloaded, no tokenizer: requests are token ids),
and drives sglang-jax's own ``ModelWorker`` / ``ModelRunner``, ``ScheduleBatch``, ``RadixCache``,
allocator and ``req_to_token`` pool the way its scheduler does in non-overlap mode: a prefill
batch for the arrivals of a step (prefix-cache match, ``prepare_for_extend``), else the next
chunk of a request in chunked prefill, else one decode step of the running batch
(``prepare_for_decode``), then the scheduler's result processing (append the sampled token,
``check_finished``, ``cache_unfinished_req`` / ``cache_finished_req``, ``filter_batch``).
Chunked prefill follows the scheduler too: the prompt is cut to ``Request.chunk`` tokens
(``PrefillAdder``), the chunk samples nothing (``is_chunked``), and the next step caches the chunk
in the radix tree, frees the request's ``req_to_token`` row and extends the rest with the cached
chunk as its prefix in a new row. Sampling is greedy, on the host, from the engine's logits (sglang-jax 0.0.2's own
sampler does not trace on the CPU).

Runs on the CPU (``device='cpu'``, ``attention_backend='native'``). Needs sglang-jax 0.0.2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from typing import Callable, List, Optional, Sequence

import numpy as np

# flax >= 0.12 makes every nnx.Module a pytree and eagerly shards annotated variables; sglang-jax
# 0.0.2 registers its attention backends as pytrees itself and builds its dummy weights outside an
# abstract mesh. These two flax switches restore the behaviour it was written against; they must
# be set before flax is imported.
FLAX_ENV = {"FLAX_PYTREE_MODULE": "0", "FLAX_ALWAYS_SHARD_VARIABLE": "0"}

QWEN2_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "vocab_size": 512, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "float32",
    "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
}


def set_flax_env() -> None:
    """Set ``FLAX_ENV`` (unless set); call before anything imports flax."""
    for k, v in FLAX_ENV.items():
        os.environ.setdefault(k, v)


@dataclasses.dataclass
class Request:
    """A request of the workload: token ids, tokens to generate, the step it arrives at."""

    rid: str
    prompt: List[int]
    max_new: int
    arrival: int = 0
    chunk: int = 0              # chunked prefill: at most this many prompt tokens per step (0: all)
    req: object = None          # the sglang-jax Req once admitted

    @property
    def output(self) -> List[int]:
        return [] if self.req is None else [int(t) for t in self.req.output_ids]


def shared_prefix_workload(n: int = 4, *, prefix_len: int = 12, seed: int = 0, max_new: int = 6,
                           second_wave_new: int = 10, stagger: int = 3,
                           vocab: int = 512) -> List[Request]:
    """``n`` requests over two shared prefixes with distinct tails, in two waves: the first half
    arrives at once (``max_new`` tokens each), the second ``stagger`` steps later and matches the
    first wave's prefixes in the prefix cache (``second_wave_new`` tokens each, so that it still
    runs after the first wave finished and left cached slots no request uses)."""
    rng = np.random.default_rng(seed)
    prefixes = [list(rng.integers(3, vocab, prefix_len)) for _ in range(2)]
    reqs = []
    first = max(1, n // 2)
    for i in range(n):
        tail = list(rng.integers(3, vocab, 3 + i % 3))
        reqs.append(Request(f"r{i}", [int(t) for t in prefixes[i % 2] + tail],
                            max_new if i < first else second_wave_new,
                            arrival=0 if i < first else stagger))
    return reqs


def chunked_prefill_workload(*, prompt_len: int = 40, chunk: int = 16, seed: int = 1,
                             max_new: int = 5, vocab: int = 512) -> List[Request]:
    """A long request prefilled in chunks of ``chunk`` tokens (steps 1-3 for the defaults), and a
    second request sharing its first half that arrives while it is chunked: it waits for the last
    chunk, then hits the chunks the radix tree cached."""
    rng = np.random.default_rng(seed)
    prompt = [int(t) for t in rng.integers(3, vocab, prompt_len)]
    tail = [int(t) for t in rng.integers(3, vocab, 4)]
    return [Request("long", prompt, max_new, arrival=0, chunk=chunk),
            Request("shares", prompt[: prompt_len // 2] + tail, max_new, arrival=1)]


class TinyEngine:
    """The tiny engine. ``run(workload, hook)`` serves a workload step by step.

    Attributes: ``worker`` (sglang-jax ``ModelWorker``), ``runner`` (its ``ModelRunner``),
    ``tree_cache`` (``RadixCache``), ``req_to_token_pool``, ``allocator``, ``step_no``.
    """

    def __init__(self, *, max_running_requests: int = 4, max_total_tokens: int = 1024,
                 context_length: int = 256, token_padding: int = 64,
                 bs_paddings: Optional[Sequence[int]] = None, page_size: int = 1, seed: int = 0,
                 weight_scale: float = 0.05, model_dir: Optional[str] = None):
        set_flax_env()
        import jax
        import jax.numpy as jnp
        from flax import nnx
        from sgl_jax.srt.managers.tp_worker import ModelWorker
        from sgl_jax.srt.mem_cache.radix_cache import RadixCache
        from sgl_jax.srt.server_args import ServerArgs
        from sgl_jax.srt.utils.mesh_utils import create_device_mesh

        self.model_dir = model_dir or tempfile.mkdtemp(prefix="kvc-qwen2-")
        with open(os.path.join(self.model_dir, "config.json"), "w") as f:
            json.dump(QWEN2_CONFIG, f)
        self.server_args = ServerArgs(
            model_path=self.model_dir, device="cpu", attention_backend="native",
            page_size=page_size,
            dtype="float32", max_total_tokens=max_total_tokens,
            max_running_requests=max_running_requests, tp_size=1, skip_server_warmup=True,
            load_format="dummy", mem_fraction_static=0.5, random_seed=seed,
            skip_tokenizer_init=True, context_length=context_length,
            precompile_token_paddings=[token_padding],
            precompile_bs_paddings=list(bs_paddings or [max_running_requests]),
            disable_overlap_schedule=True,
            disable_radix_cache=False)
        self.mesh = create_device_mesh(ici_parallelism=[-1, 1, 1], dcn_parallelism=[1, 1, 1])
        self.worker = ModelWorker(self.server_args, self.mesh)
        self.runner = self.worker.model_runner
        # small random weights (the dummy loader's uniform values make a degenerate model)
        state = nnx.state(self.runner.model)
        leaves, treedef = jax.tree_util.tree_flatten(state)
        key = jax.random.PRNGKey(seed)
        new = []
        for i, x in enumerate(leaves):
            if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating):
                x = (weight_scale * jax.random.normal(jax.random.fold_in(key, i), x.shape)
                     ).astype(x.dtype)
            new.append(x)
        nnx.update(self.runner.model, jax.tree_util.tree_unflatten(treedef, new))
        self.runner.initialize_jit()       # its jitted call captured the old weights
        self.req_to_token_pool = self.runner.req_to_token_pool
        self.allocator = self.runner.token_to_kv_pool_allocator
        cfg = self.runner.model_config
        self.tree_cache = RadixCache(
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.allocator,
            page_size=page_size, kv_head_num=cfg.get_total_num_kv_heads_with_replication(1),
            head_dim=cfg.head_dim, layer_num=cfg.num_hidden_layers, dtype=self.runner.kv_cache_dtype)
        self.paddings = self.worker.get_precompile_paddings()
        self.page_size = page_size
        self.step_no = 0
        self._chunked = None

    # -- state ------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Empty pools and prefix cache (the KV bytes stay; every slot is written before it is read)."""
        self.req_to_token_pool.clear()
        self.req_to_token_pool.req_to_token[:] = 0
        self.allocator.clear()
        self.tree_cache.reset()
        self.step_no = 0
        self._chunked = None

    @property
    def kv_buffer(self):
        return self.runner.token_to_kv_pool.kv_buffer

    # -- batches ----------------------------------------------------------------------------------
    def _forward(self, batch, before_forward=None):
        import jax

        mwb = batch.get_model_worker_batch(*self.paddings, self.page_size)
        if before_forward is not None:
            before_forward(mwb)
        logits, _, _ = self.worker.forward_batch_generation(mwb, skip_sample=True)
        # greedy, on the host: sglang-jax 0.0.2's sampler does not trace on the CPU (its min-p
        # branch unpacks a 3-tuple into two names), so the engine's own sampler is skipped
        ids = np.argmax(np.asarray(jax.device_get(logits.next_token_logits)), axis=-1)
        ids = ids[: mwb.real_bs]
        batch.output_ids = ids
        return ids

    def _new_req(self, r: Request):
        from sgl_jax.srt.managers.schedule_batch import Req
        from sgl_jax.srt.sampling.sampling_params import SamplingParams

        sp = SamplingParams(max_new_tokens=r.max_new, temperature=0.0, ignore_eos=True)
        sp.normalize(None)
        sp.verify(self.runner.model_config.vocab_size)
        req = Req(r.rid, "", list(r.prompt), sp, vocab_size=self.runner.model_config.vocab_size)
        req.init_next_round_input(self.tree_cache)
        r.req = req
        return req

    @staticmethod
    def _cut(r: Request) -> None:
        """Cut ``r``'s extend to ``r.chunk`` tokens when the rest is longer (``PrefillAdder``)."""
        q = r.req
        if r.chunk > 0 and q.extend_input_len > r.chunk:
            q.extend_input_len = r.chunk
            q.fill_ids = q.fill_ids[: len(q.prefix_indices) + r.chunk]
            q.is_chunked += 1

    def prefill(self, reqs: Sequence[Request], before_forward=None):
        """One EXTEND step for ``reqs``; returns the new ``ScheduleBatch`` (finished ones and the
        one in chunked prefill filtered)."""
        for r in reqs:
            self.tree_cache.inc_lock_ref(self._new_req(r).last_node)
            self._cut(r)
        if sum(r.req.is_chunked > 0 for r in reqs) > 1:
            raise ValueError("kv-canary: the tiny engine prefills at most one request in chunks at "
                             "a time (as sglang-jax's scheduler)")
        return self._extend(reqs, before_forward)

    def prefill_next_chunk(self, before_forward=None):
        """The next EXTEND step of the request in chunked prefill: its last chunk goes into the
        radix tree, its ``req_to_token`` row is freed, and the rest (up to its ``chunk`` tokens)
        extends the cached chunks in a new row (the scheduler's ``get_new_batch_prefill``)."""
        r = self._chunked
        q = r.req
        self.tree_cache.cache_unfinished_req(q)
        self.req_to_token_pool.free(q.req_pool_idx)
        q.init_next_round_input()
        self._cut(r)
        return self._extend([r], before_forward, chunked_req=q)

    @property
    def chunked_req(self):
        """The sglang-jax ``Req`` in chunked prefill (the next step extends it), or None."""
        return None if self._chunked is None else self._chunked.req

    def _extend(self, reqs: Sequence[Request], before_forward, chunked_req=None):
        from sgl_jax.srt.managers.schedule_batch import ScheduleBatch

        sreqs = [r.req for r in reqs]
        batch = ScheduleBatch.init_new(sreqs, self.req_to_token_pool, self.allocator,
                                       self.tree_cache, self.runner.model_config, False,
                                       chunked_req=chunked_req, mesh=self.mesh)
        batch.prepare_for_extend()
        ids = self._forward(batch, before_forward)
        self._chunked = None
        for r, t in zip(reqs, ids):
            q = r.req
            if q.is_chunked > 0:          # a chunk short of the prompt's end samples nothing
                q.is_chunked -= 1
                self._chunked = r
                continue
            q.output_ids.append(int(t))
            q.check_finished()
            if q.finished():
                self.tree_cache.cache_finished_req(q)
            else:
                self.tree_cache.cache_unfinished_req(q)
        batch.filter_batch(chunked_req_to_exclude=self.chunked_req)
        return batch

    def decode(self, batch, before_forward=None):
        """One DECODE step of the running ``batch``; returns it (finished requests filtered)."""
        batch.prepare_for_decode()
        ids = self._forward(batch, before_forward)
        for q, t in zip(batch.reqs, ids):
            q.output_ids.append(int(t))
            q.check_finished()
            if q.finished():
                self.tree_cache.cache_finished_req(q)
        batch.filter_batch()
        return batch

    # -- serving ----------------------------------------------------------------------------------
    def run(self, workload: Sequence[Request], *, before_step: Optional[Callable] = None,
            after_step: Optional[Callable] = None, max_steps: int = 200) -> List[List[int]]:
        """Serve ``workload``: each step is the next chunk of a request in chunked prefill (if any),
        else a prefill of the arrivals due (if any), else a decode of the running batch.
        ``before_step(engine, running, due)`` may return a callable run on the
        ``ModelWorkerBatch`` just before the forward; ``after_step(engine)`` runs after it.
        Returns the generated tokens per request."""
        waiting = sorted(workload, key=lambda r: r.arrival)
        running = None

        def busy():
            return running is not None and not running.is_empty()

        while waiting or self.chunked_req is not None or busy():
            if self.step_no >= max_steps:
                raise RuntimeError("kv-canary: the tiny engine did not finish its workload")
            self.step_no += 1
            in_chunks = self.chunked_req is not None
            due = [] if in_chunks else [r for r in waiting if r.arrival < self.step_no]
            hook = before_step(self, running, due) if before_step is not None else None
            if in_chunks or due:
                if in_chunks:
                    new = self.prefill_next_chunk(hook)
                else:
                    waiting = [r for r in waiting if r not in due]
                    new = self.prefill(due, hook)
                if not new.is_empty():
                    if running is None or running.is_empty():
                        running = new
                    else:
                        running.merge_batch(new)
            elif busy():
                running = self.decode(running, hook)
            if after_step is not None:
                after_step(self)
        return [r.output for r in workload]
