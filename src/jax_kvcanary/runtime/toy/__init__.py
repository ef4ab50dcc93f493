"""The demo's toy serving engine: a small paged-KV transformer served with the canary on.

model.py     the transformer (pure JAX) and its paged KV arrays
kvpool.py    slot allocator and token-level prefix cache (host)
workload.py  the requests
engine.py    scheduler, serving loop, sweeps, overhead replay
steps.py     the jitted steps (canary on / off) and sweep, cached by static configuration
faults.py    finds a target for each fault kind and injects it at the right point
"""

from .engine import EngineConfig, ToyEngine
from .model import ModelConfig
from .workload import Request, make_workload

__all__ = ["EngineConfig", "ToyEngine", "ModelConfig", "Request", "make_workload"]
