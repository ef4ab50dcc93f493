"""The CUDA launchers, executed on the CPU: cuda/cuda_kernels.cu compiled by g++ against a stand-in
CUDA runtime (tests/cuda_emu/cuda_runtime.h: real threads per block, barriers, warp shuffles,
atomics) and driven through a C ABI (tests/cuda_emu/emu_driver.cc), compared byte for byte with the
numpy reference. No GPU is needed: this runs in CI and checks the kernels' logic (scans, the ordered
ring append, the conflict detector and the in-order write path, tile and grid-stride loops, the
plan layout) where the GPU tests cannot run.

Two builds: ``prod`` (the production launch geometry) and ``small`` (tiny blocks and grids, so that
small inputs reach the multi-tile, multi-block and grid-stride paths). What the emulation does not
check: GPU memory ordering, warp-synchronous behaviour, performance (tests/test_gpu.py on a GPU does).

Marked ``emu`` and ``slow`` (``-m "not emu"`` leaves it out); ``KVC_EMU_SEEDS`` (default 4) sets the
seeds per cases.py config.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import jax_kvcanary as kvc
from jax_kvcanary import checks

from tests.support import gpu_cases
from tests.support.cases import CONFIGS, OPS, compare, describe_case, make_case, run_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMU_DIR = os.path.join(ROOT, "tests", "cuda_emu")
KERNELS = os.path.join(ROOT, "cuda", "cuda_kernels.cu")
SOURCES = [os.path.join(ROOT, "cuda", f) for f in ("cuda_kernels.cu", "cuda_kernels.h", "cuda_geometry.h")] + \
          [os.path.join(ROOT, "csrc", "canary_core.h")] + \
          [os.path.join(EMU_DIR, f) for f in ("cuda_runtime.h", "emu_driver.cc")]
SEEDS = int(os.environ.get("KVC_EMU_SEEDS", "4"))

BUILDS = {
    "prod": [],
    "small": ["-DKVC_VERIFY_THREADS=32", "-DKVC_VERIFY_MAX_BLOCKS=3", "-DKVC_WRITE_THREADS=32",
              "-DKVC_ONE_BLOCK_THREADS=64", "-DKVC_PLAN_THREADS=32", "-DKVC_SCATTER_THREADS=32",
              "-DKVC_MAX_GRID_BLOCKS=3"],
}

pytestmark = [pytest.mark.emu, pytest.mark.slow]


def _compile(name: str, flags) -> str:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx}) for the CUDA emulation")
    h = hashlib.sha256()
    for p in SOURCES:
        with open(p, "rb") as f:
            h.update(f.read())
    h.update(" ".join([cxx] + list(flags)).encode())
    out_dir = os.path.join(ROOT, "build", "cuda-emu")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError:
        out_dir = tempfile.mkdtemp(prefix="kvc-emu-")
    so = os.path.join(out_dir, f"emu_{name}_{h.hexdigest()[:16]}.so")
    if not os.path.exists(so):
        tmp = so + f".{os.getpid()}.tmp"
        cmd = [cxx, "-std=c++20", "-O1", "-pthread", "-fPIC", "-shared", "-Wall", "-Wextra",
               "-Wno-unknown-pragmas", "-I", EMU_DIR, "-I", os.path.join(ROOT, "cuda"), "-I", os.path.join(ROOT, "csrc"),
               *flags, "-x", "c++", KERNELS, os.path.join(EMU_DIR, "emu_driver.cc"), "-o", tmp]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError("building the CUDA emulation failed:\n" + " ".join(cmd) + "\n" + r.stderr[-4000:])
        os.replace(tmp, so)
    return so


_P, _I64, _I32, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int
_SRC_ARGS = [_I32, _I, ctypes.POINTER(ctypes.c_void_p)] + [ctypes.POINTER(ctypes.c_int64)] * 6
_SIGS = {
    "kvc_emu_verify": [_P, _I64, _I64, _P, _I64, _P, _P, _P] + [_P, _I] * 4 + [_I64, _P, _P, _I, _I64] + _SRC_ARGS,
    "kvc_emu_write": [_P, _I64, _I64, _P, _I64, _P, _P, _P, _P, _P, _I, _P, _I, _I64, _P, _P, _I, _P, _I, _P, _I,
                      _I64, _I, _P, _I, _P, _I, _I64] + _SRC_ARGS,
    "kvc_emu_plan": [_P, _I, _P, _I, _P, _I, _I64, _P, _I, _I64, _I64, _I, _P, _I, _I64, _I, _P, _I, _I64, _I,
                     _P, _I, _I64, _I64, _P, _I, _I64, _I64, _I64, _I64] + [_P] * 9,
    "kvc_emu_scatter": [_P, _I, _I64, _I64, _P, _I, _I64, _P, _I, _P, _I, _I64],
}


class Emu:
    """One emulation build: the four ops with the reference's signatures (numpy in, numpy out)."""

    def __init__(self, name):
        self.name = name
        self.lib = ctypes.CDLL(_compile(name, BUILDS[name]))
        for fn, sig in _SIGS.items():
            getattr(self.lib, fn).argtypes = sig
            getattr(self.lib, fn).restype = ctypes.c_int
        geo = (ctypes.c_int64 * 7)()
        self.lib.kvc_emu_geometry(geo)
        self.geometry = list(geo)
        self._keep = []

    # -- marshalling ------------------------------------------------------------------------------
    def _p(self, a):
        self._keep.append(a)
        return a.ctypes.data_as(ctypes.c_void_p)

    def _idx(self, a):
        a = np.ascontiguousarray(np.asarray(a))
        assert a.dtype in (np.int32, np.int64), a.dtype
        return self._p(a), int(a.dtype == np.int64)

    def _sources(self, sources, mode):
        sources, mode = checks.real_kv(sources, mode)  # ((), 0) or (1..4 sources, 1|2), as ops.py
        n = len(sources)
        arrays = [np.ascontiguousarray(np.asarray(s.array)) for s in sources]
        self._keep.extend(arrays)
        data = (ctypes.c_void_p * 4)(*[a.ctypes.data for a in arrays])

        def i64s(vals):
            return (ctypes.c_int64 * 4)(*(list(vals) + [0] * (4 - len(vals))))

        rows = [a.shape[0] for a in arrays]
        row_bytes = [a.nbytes // a.shape[0] if a.shape[0] else 0 for a in arrays]
        return [mode, n, data, i64s(rows), i64s(row_bytes), i64s([s.page_size for s in sources]),
                i64s([s.num_bytes_per_token for s in sources]), i64s([s.read_bytes for s in sources]),
                i64s([s.offset_bytes for s in sources])]

    @staticmethod
    def _log_copy(log):
        return [np.array(np.asarray(getattr(log, f)), copy=True) for f in kvc.ViolationLog._FIELDS]

    def _check(self, rc, op):
        self._keep.clear()
        assert rc == 0, f"emulated {op} returned an error"

    # -- ops --------------------------------------------------------------------------------------
    def verify(self, canary, log, vp, *, tag, check_verify_expected_token=False, real_kv_sources=(),
               real_kv_hash_mode=0):
        canary = np.ascontiguousarray(np.asarray(canary))
        ring, wi, kc, sc, flag = self._log_copy(log)
        args = [self._p(canary), canary.shape[0], canary.shape[1], self._p(ring), ring.shape[0], self._p(wi),
                self._p(kc), self._p(sc)]
        for f in ("slot_indices", "expected_tokens", "expected_positions", "prev_slot_indices"):
            args += list(self._idx(getattr(vp, f)))
        nv = np.ascontiguousarray(np.asarray(vp.num_valid, np.int32))
        en = np.ascontiguousarray(np.asarray(vp.enable, np.int32))
        args += [np.asarray(vp.slot_indices).shape[0], self._p(nv), self._p(en),
                 int(bool(check_verify_expected_token)), int(tag)]
        args += self._sources(real_kv_sources, real_kv_hash_mode)
        self._check(self.lib.kvc_emu_verify(*args), "verify")
        return kvc.ViolationLog(ring=ring, write_index=wi, kernel_run_counters=kc, slot_run_counters=sc,
                                enable_chain_position_assert=flag)

    def write(self, canary, log, wp, input_ids, positions, out_cache_loc, *, tag, enable_write_input_assert=False,
              expected_input_tokens=None, expected_input_positions=None, real_kv_sources=(), real_kv_hash_mode=0):
        canary = np.array(np.asarray(canary), copy=True)
        ring, wi, kc, sc, flag = self._log_copy(log)
        n = np.asarray(input_ids).shape[0]
        if not enable_write_input_assert:
            expected_input_tokens = expected_input_positions = np.zeros((0,), np.int32)
        et, ep = np.asarray(expected_input_tokens), np.asarray(expected_input_positions)
        assert_usable = bool(enable_write_input_assert) and et.shape[0] >= n and ep.shape[0] >= n
        nvr = np.ascontiguousarray(np.asarray(wp.num_valid_reqs, np.int32))
        args = [self._p(canary), canary.shape[0], canary.shape[1], self._p(ring), ring.shape[0], self._p(wi),
                self._p(kc), self._p(sc), self._p(flag), *self._idx(wp.offsets), *self._idx(wp.seed_slot_indices),
                np.asarray(wp.seed_slot_indices).shape[0], self._p(nvr), *self._idx(input_ids),
                *self._idx(positions), *self._idx(out_cache_loc), n, int(assert_usable), *self._idx(et),
                *self._idx(ep), int(tag)]
        args += self._sources(real_kv_sources, real_kv_hash_mode)
        self._check(self.lib.kvc_emu_write(*args), "write")
        return canary, kvc.ViolationLog(ring=ring, write_index=wi, kernel_run_counters=kc, slot_run_counters=sc,
                                        enable_chain_position_assert=flag)

    def plan(self, req_pool_indices, prefix_lens, extend_seq_lens, req_to_token, *, verify_capacity,
             write_req_capacity, swa_window_size=0, full_to_swa_index_mapping=None,
             req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None,
             kv_token_id_vs_position_offset=0, row_starts=None):
        vc, wc = int(verify_capacity), int(write_req_capacity)
        bs = np.asarray(req_pool_indices).shape[0]
        r2t = np.asarray(req_to_token)
        has_rs = row_starts is not None
        starts = np.asarray(row_starts) if has_rs else np.zeros((0,), np.int32)
        R, L = (0, 0) if has_rs else r2t.shape  # as the FFI handler: a 1-D table has no [R, L]
        has_lut = full_to_swa_index_mapping is not None
        has_pool = req_to_verify_expected_tokens is not None
        lut = np.asarray(full_to_swa_index_mapping) if has_lut else np.zeros((0,), np.int32)
        pool = np.asarray(req_to_verify_expected_tokens) if has_pool else np.zeros((0, 0), np.int32)
        vl = np.asarray(req_to_verify_expected_tokens_valid_lens) if has_pool else np.zeros((0,), np.int32)
        outs = [np.full(n, 0x5A5A5A5A, np.int32) for n in (vc, vc, vc, vc, 1, 1, wc + 1, wc, 1)]
        args = [*self._idx(req_pool_indices), *self._idx(prefix_lens), *self._idx(extend_seq_lens), bs,
                *self._idx(r2t.reshape(-1)), R, L, int(has_rs), *self._idx(starts), r2t.shape[0] if has_rs else 0,
                int(has_lut), *self._idx(lut),
                lut.shape[0], int(has_pool), *self._idx(pool.reshape(-1)), pool.shape[0], pool.shape[1],
                *self._idx(vl), int(swa_window_size), int(kv_token_id_vs_position_offset), vc, wc]
        args += [self._p(o) for o in outs]
        self._check(self.lib.kvc_emu_plan(*args), "plan")
        s, t, p, pr, nv, en, off, seeds, nvr = outs
        return (kvc.VerifyPlan(s, t, p, pr, nv, en), kvc.WritePlan(off, seeds, nvr))

    def scatter_req_token_ids(self, pool, flat_ids, offsets, req_pool_indices):
        out = np.array(np.asarray(pool), copy=True)
        assert out.dtype in (np.int32, np.int64)
        args = [self._p(out), int(out.dtype == np.int64), out.shape[0], out.shape[1], *self._idx(flat_ids),
                np.asarray(flat_ids).shape[0], *self._idx(offsets), *self._idx(req_pool_indices),
                np.asarray(req_pool_indices).shape[0]]
        self._check(self.lib.kvc_emu_scatter(*args), "scatter")
        return out

    def run(self, case):
        return getattr(self, case["op"])(*case["args"], **case["kwargs"])


_EMUS = {}


def emu(name) -> Emu:
    if name not in _EMUS:
        _EMUS[name] = Emu(name)
    return _EMUS[name]


@pytest.fixture(scope="module", autouse=True)
def _build_both():
    """Compile both builds up front, in parallel (each is a g++ run of ~30 s)."""
    import concurrent.futures as cf
    with cf.ThreadPoolExecutor(2) as ex:
        list(ex.map(lambda n: _compile(n, BUILDS[n]), BUILDS))


def _check_case(e: Emu, case):
    ref = run_reference(case)
    got = e.run(case)
    diffs = compare(case["op"], ref, got)
    return None if not diffs else describe_case(case) + "\n  " + "\n  ".join(diffs)


OP_CONFIGS = [(op, cfg) for op in OPS for cfg in CONFIGS[op]]


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("op,config", OP_CONFIGS, ids=[f"{o}-{c}" for o, c in OP_CONFIGS])
def test_emulated_kernels_match_reference(build, op, config):
    e = emu(build)
    failures = [f for f in (_check_case(e, make_case(op, config, seed)) for seed in range(SEEDS)) if f]
    assert not failures, f"{len(failures)} of {SEEDS} cases differ ({build} build):\n" + "\n".join(failures[:3])


STRESS = gpu_cases.stress_names()


@pytest.mark.parametrize("name", STRESS)
def test_emulated_kernels_stress(name):
    """Multi-tile / multi-block / grid-stride / ordered-ring / in-order-write cases (small build)."""
    e = emu("small")
    for seed in range(2):
        case = gpu_cases.stress_case(name, seed, scale="emu")
        fail = _check_case(e, case)
        assert fail is None, fail
    if name.startswith("write_conflict"):
        assert gpu_cases.has_write_conflict(gpu_cases.stress_case(name, 0, scale="emu"))


def test_small_build_geometry():
    assert emu("small").geometry == [32, 3, 32, 64, 32, 32, 3]
    assert emu("prod").geometry == [256, 1024, 128, 1024, 256, 256, 65535]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
