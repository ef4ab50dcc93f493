"""The XLA programs each engine step executes, counted in sglang-jax's scheduler process (test
support for the one-program-per-step test).

``install(path)`` wraps sglang-jax's ``ModelWorker.forward_batch_generation`` (the model call,
the canary's wrapper of it when guarded, and the sampler). While the file ``path + ".on"`` exists,
each call runs under a ``jax.profiler`` trace, waits for its outputs, and appends one JSON line to
``path``: the forward mode, the batch size, ``programs`` (the trace's program executions:
``CommonPjRtLoadedExecutable::ExecuteHelper*`` events, one per program and device) and
``outputs`` (a SHA-256 of the step's next-token logits and sampled token ids, bytes as the
device holds them). Run under the non-overlap scheduler, where each call is one whole step.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile

import jax
import numpy as np

#: the environment variable that names the file (``launch_counting_programs``)
PATH_ENV = "KV_CANARY_TEST_PROGRAM_COUNT"
EXECUTE = "CommonPjRtLoadedExecutable::ExecuteHelper"


def executions(trace_dir: str) -> int:
    """The program executions recorded in the one trace under ``trace_dir``."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(trace_dir) for f in fs
             if f.endswith(".xplane.pb")]
    assert len(files) == 1, files
    data = jax.profiler.ProfileData.from_file(files[0])
    return sum(ev.name.startswith(EXECUTE) for plane in data.planes for line in plane.lines
               for ev in line.events)


def digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.asarray(a)
        h.update(str((a.dtype, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def install(path: str) -> None:
    from sgl_jax.srt.managers.tp_worker import ModelWorker

    original = ModelWorker.forward_batch_generation
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0

    @functools.wraps(original)
    def counted(self, model_worker_batch, *args, **kwargs):
        if not os.path.exists(path + ".on"):
            return original(self, model_worker_batch, *args, **kwargs)
        with tempfile.TemporaryDirectory() as trace_dir:
            jax.profiler.start_trace(trace_dir, profiler_options=options)
            try:
                out = original(self, model_worker_batch, *args, **kwargs)
                logits, ids = out[0].next_token_logits, out[1]
                jax.block_until_ready((logits, ids))
            finally:
                jax.profiler.stop_trace()
            programs = executions(trace_dir)
        with open(path, "a") as f:
            f.write(json.dumps({"mode": model_worker_batch.forward_mode.name,
                                "batch": int(model_worker_batch.real_bs), "programs": programs,
                                "outputs": digest(logits, ids)}) + "\n")
        return out

    ModelWorker.forward_batch_generation = counted
