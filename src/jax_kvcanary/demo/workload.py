"""The demo's requests: prompts with shared prefixes, staggered arrivals, varied output lengths."""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import numpy as np


@dataclasses.dataclass(eq=False)
class Request:
    """One request and its serving state (host side).

    ``slots[p]`` is the full-pool slot of position ``p`` (after prefix-cache remaps); ``own`` the
    slots this request frees when it finishes; ``nodes`` the prefix-cache nodes it holds.
    ``pending`` is the engine's next input token, ``oracle`` the sampler's true one.
    """

    rid: int
    prompt: List[int]
    max_new: int
    arrival: int
    rp: int = 0
    kv_len: int = 0
    slots: List[int] = dataclasses.field(default_factory=list)
    own: set = dataclasses.field(default_factory=set)
    nodes: list = dataclasses.field(default_factory=list)
    outputs: List[int] = dataclasses.field(default_factory=list)
    pending: Optional[int] = None
    oracle: Optional[int] = None
    cached_tokens: int = 0
    swa_evicted: int = 0
    done: bool = False

    @property
    def prefilled(self) -> bool:
        return self.kv_len >= len(self.prompt)


def make_workload(num_requests: int, *, vocab: int = 256, max_seq_len: int = 64, seed: int = 0,
                  system_len: int = 12) -> List[Request]:
    """``num_requests`` requests: all share a system prompt; request ``i`` and ``i + T`` also share
    a topic; every prompt ends with a few tokens of its own. Two requests arrive every four steps;
    output lengths vary (request 0 is short, so its cached prefix becomes unused early)."""
    rng = np.random.default_rng(seed)
    tok = lambda n: [int(t) for t in rng.integers(1, vocab, n)]  # noqa: E731
    system = tok(system_len)
    n_topics = max(1, (num_requests + 1) // 2)
    topics = [tok(int(rng.integers(4, 14))) for _ in range(n_topics)]
    out = []
    for i in range(num_requests):
        prompt = system + topics[i % n_topics] + tok(int(rng.integers(2, 6)))
        max_new = 4 if i == 0 else int(rng.integers(10, 31))
        max_new = max(1, min(max_new, max_seq_len - len(prompt)))
        out.append(Request(rid=i, prompt=prompt, max_new=max_new, arrival=(i // 2) * 4))
    return out
