"""Native CPU baselines (bench/native/baselines.c), built at bench time with the system C compiler.

``load()`` compiles the C file with ``cc -O2 -shared -fPIC`` into a temporary directory and loads it
with ctypes; it returns ``(Native, None)`` or ``(None, reason)`` when there is no compiler or the build
fails (the bench then skips the native baselines with that note).

The loops run on the very buffers the custom calls see: the raw pointers of the JAX CPU arrays
(``unsafe_buffer_pointer``), so both sides get the same memory (page size, placement, alignment).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile

import numpy as np

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "baselines.c")
CFLAGS = ["-O2", "-shared", "-fPIC"]

_P = ctypes.c_void_p
_I = ctypes.c_int64


def _ptr(x) -> int:
    """Raw data pointer of a JAX CPU array or a numpy array."""
    if isinstance(x, np.ndarray):
        return x.ctypes.data
    return x.unsafe_buffer_pointer()


def _i32(x):
    if x.dtype != np.int32:
        raise TypeError(f"native baselines take int32 index arrays, got {x.dtype}")
    return x


class Native:
    def __init__(self, lib, cc: str, version: str):
        self.lib = lib
        self.cc = cc
        self.compiler = version
        lib.kvb_read_records.argtypes = [_P, _I, _P, _P, _I]
        lib.kvb_read_records.restype = ctypes.c_uint64
        lib.kvb_read_records_prefetch.argtypes = [_P, _I, _P, _P, _I]
        lib.kvb_read_records_prefetch.restype = ctypes.c_uint64
        lib.kvb_verify_mix3.argtypes = [_P, _I, _I, _P, _P, _P, _I]
        lib.kvb_verify_mix3.restype = _I
        lib.kvb_write_chain.argtypes = [_P, _I, _I, _P, _P, _I, _P, _P, _P]
        lib.kvb_write_chain.restype = _I
        lib.kvb_write_chain_reps.argtypes = [_P, _I, _I, _P, _P, _I, _P, _P, _P, _I]
        lib.kvb_write_chain_reps.restype = _I

    def describe(self) -> dict:
        return {"compiler": self.cc, "compiler_version": self.compiler, "flags": " ".join(CFLAGS),
                "source": "bench/native/baselines.c"}

    # Each returns a zero-argument callable running the loop once over fixed buffers (the arrays are
    # kept alive by the closure).
    def read_records(self, canary, slots, prevs, n: int, prefetch: bool = False):
        f = self.lib.kvb_read_records_prefetch if prefetch else self.lib.kvb_read_records
        keep = (canary, _i32(slots), _i32(prevs))
        args = (_ptr(canary), canary.shape[1], _ptr(slots), _ptr(prevs), n)
        return lambda: (keep, f(*args))[1]

    def verify_mix3(self, canary, slots, positions, prevs, n: int):
        keep = (canary, _i32(slots), _i32(positions), _i32(prevs))
        args = (_ptr(canary), canary.shape[0], canary.shape[1], _ptr(slots), _ptr(positions), _ptr(prevs), n)
        return lambda: (keep, self.lib.kvb_verify_mix3(*args))[1]

    def write_chain(self, canary, offsets, seeds, num_reqs: int, ids, positions, locs):
        keep = (canary, _i32(offsets), _i32(seeds), _i32(ids), _i32(positions), _i32(locs))
        args = (_ptr(canary), canary.shape[0], canary.shape[1], _ptr(offsets), _ptr(seeds), num_reqs,
                _ptr(ids), _ptr(positions), _ptr(locs))
        return lambda: (keep, self.lib.kvb_write_chain(*args))[1]

    def write_chain_reps(self, canary, offsets, seeds, num_reqs: int, ids, positions, locs, reps: int):
        """``write_chain`` run ``reps`` times inside C: one call's time / reps is one launch's cost."""
        keep = (canary, _i32(offsets), _i32(seeds), _i32(ids), _i32(positions), _i32(locs))
        args = (_ptr(canary), canary.shape[0], canary.shape[1], _ptr(offsets), _ptr(seeds), num_reqs,
                _ptr(ids), _ptr(positions), _ptr(locs), int(reps))
        return lambda: (keep, self.lib.kvb_write_chain_reps(*args))[1]

    def verify_mismatches(self, canary, slots, positions, prevs, n: int) -> int:
        """How many entries fail the mix3 loop's checks (0 on a clean scenario)."""
        return int(self.verify_mix3(canary, slots, positions, prevs, n)())


_CACHE = {}


def load():
    """Build and load the baselines once per process: ``(Native | None, note | None)``."""
    if "v" in _CACHE:
        return _CACHE["v"]
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        _CACHE["v"] = (None, "no C compiler (cc/gcc/clang) on PATH: native baselines skipped")
        return _CACHE["v"]
    tmp = tempfile.mkdtemp(prefix="kvcanary-bench-")
    so = os.path.join(tmp, "baselines.so")
    try:
        proc = subprocess.run([cc, *CFLAGS, "-o", so, SRC], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            _CACHE["v"] = (None, f"native baselines failed to build with {cc}: {proc.stderr.strip()[:300]}")
            return _CACHE["v"]
        ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        lib = ctypes.CDLL(so)
        _CACHE["v"] = (Native(lib, cc, ver.splitlines()[0] if ver else "?"), None)
    except (OSError, subprocess.SubprocessError) as e:
        _CACHE["v"] = (None, f"native baselines unavailable: {e}")
    finally:
        # the loaded library stays mapped; the directory can go
        shutil.rmtree(tmp, ignore_errors=True)
    return _CACHE["v"]
