"""The demo: a small paged-KV transformer served with the KV-cache canary on
(``python -m jax_kvcanary.demo``; see ``cli.py`` for the options).

cli.py       the command line: serve, report detections, summary, canary on/off overhead replay
engine.py    the toy serving engine: scheduler, serving loop, sweeps, overhead replay
model.py     the transformer (pure JAX) and its paged KV arrays
kvpool.py    slot allocator and token-level prefix cache (host)
workload.py  the requests
steps.py     the jitted steps (canary on / off) and sweep, cached by static configuration
faults.py    finds a target for each fault kind and injects it at the right point
"""

from .cli import main, parse_args
from .engine import EngineConfig, ToyEngine
from .model import ModelConfig
from .workload import Request, make_workload

__all__ = ["main", "parse_args", "EngineConfig", "ToyEngine", "ModelConfig", "Request", "make_workload"]
