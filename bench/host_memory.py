"""Keep freed host memory in the process while benchmarking on CPU.

XLA:CPU allocates each execution's temporaries (hundreds of MB for the realistic serving steps) with
``posix_memalign`` on its worker threads. glibc serves a request that large from a fresh ``mmap`` and
unmaps it on free, so every step page-faults its temporaries in afresh: measured on the 8-layer
d_model=1024 bs=32 prefix=1024 step, 95 000 minor faults and ~0.25 s of kernel time per 400 ms step,
with rounds of the same step varying by +-30 %. That cost is the same with the canary on and off, but
its noise hides a canary that costs well under 1 % of the step.

``keep_freed_memory()`` asks glibc for one arena, no mmap-backed chunks and no trimming (``mallopt``),
as a serving process with its own allocator effectively has: the temporaries are then reused from the
heap (0 faults per step, the same step in ~270 ms, rounds within +-8 %). The canary-on and -off
steps both run under it. It must run before XLA's threads first allocate (before the first JAX
computation); later, threads keep the arena they already have. Its own cost: with one arena shared
by every thread a custom call's launch inside a compiled step takes ~0.3 us more (the ``targets``
section's 256 decode writes, three runs each: 0.89-1.02 of the C loop with it, 1.06-1.10 without).
So only the serving-step section runs under it, in a process of its own (bench/step_process.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8


def keep_freed_memory() -> str:
    """Configure glibc malloc as above; returns what was done (recorded in the run's metadata)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return f"unchanged (no glibc mallopt in {name!r})"
    settings = {"arena_max": (M_ARENA_MAX, 1), "mmap_max": (M_MMAP_MAX, 0),
                "trim_threshold": (M_TRIM_THRESHOLD, 2**31 - 1)}
    failed = [k for k, (param, value) in settings.items() if mallopt(param, value) != 1]
    if failed:
        return "glibc mallopt refused " + ", ".join(failed)
    return "glibc malloc: one arena, no mmap chunks, no trim (freed step temporaries are reused)"
