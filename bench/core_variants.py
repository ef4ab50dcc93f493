"""Evidence for CPU-core changes: the project's own verify/write loops (cuda/cpu_loops.h over
cuda/canary_core.h), compiled as-is and with small patches, timed against the custom call and the
native baselines on the very same JAX buffers.

    PYTHONPATH=. python -m bench.core_variants [--verify 32x2048,256x4096] [--write 32x2048,32x32768]

Nothing in ``cuda/`` is modified: the headers are copied to a temporary directory, patched there, and
built with ``g++ -O3 -std=c++17 -shared`` (the extension's flags) behind a small ``extern "C"`` shim.
Variants:
  as_is           the headers unchanged (should match the custom call, minus its dispatch)
  prefetch        verify_launch prefetches the slot record 16 entries ahead; write_request prefetches
                  (for write) the slot record it will store 16 entries ahead
Each variant has two entry points: runtime flags (index dtype, token check, real-KV sources, asserts
passed as values, as the FFI handler does) and ``+specialised`` (the same flags as literals, so the
compiler folds them: what dispatching once per launch to a template instantiation would give).
A variant whose patch no longer applies (the headers changed) is reported as such and skipped.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile

import jax
import numpy as np

CUDA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cuda")

SHIM = r'''
#include "cpu_loops.h"
using namespace kvcanary;
// Runtime flags (is64, check_token, number of sources, input/chain asserts) arrive as arguments, as in
// the FFI handler, so the compiler cannot fold them; the *_spec entry points pass literals instead,
// which is what dispatching once per launch to a specialised instantiation would give.
static inline __attribute__((always_inline)) int64_t verify_impl(uint8_t* canary, int64_t S, int64_t stride, const int32_t* slots,
                                  const int32_t* toks, const int32_t* pos, const int32_t* prevs, int64_t n,
                                  uint8_t* ring, int64_t cap, int32_t* wi, uint8_t* kc, uint8_t* sc, bool is64,
                                  bool check_token, int32_t nsrc) {
  VerifyArgs a{};
  a.canary = CanaryView{canary, S, stride};
  a.slots = IndexView{slots, is64}; a.tokens = IndexView{toks, is64};
  a.positions = IndexView{pos, is64}; a.prevs = IndexView{prevs, is64};
  a.check_token = check_token; a.sources = RealKvSources{}; a.sources.count = nsrc; a.sources.mode = nsrc;
  a.tag = 2;
  LogView lv{ring, cap, wi, kc, sc};
  verify_launch(a, n, static_cast<int32_t>(n), 1, lv);
  return wi[0];
}
extern "C" int64_t shim_verify(uint8_t* c, int64_t S, int64_t st, const int32_t* s, const int32_t* t,
                               const int32_t* p, const int32_t* pv, int64_t n, uint8_t* r, int64_t cap, int32_t* wi,
                               uint8_t* kc, uint8_t* sc, int64_t is64, int64_t check_token, int64_t nsrc) {
  return verify_impl(c, S, st, s, t, p, pv, n, r, cap, wi, kc, sc, is64 != 0, check_token != 0,
                     static_cast<int32_t>(nsrc));
}
extern "C" int64_t shim_verify_spec(uint8_t* c, int64_t S, int64_t st, const int32_t* s, const int32_t* t,
                                    const int32_t* p, const int32_t* pv, int64_t n, uint8_t* r, int64_t cap,
                                    int32_t* wi, uint8_t* kc, uint8_t* sc, int64_t, int64_t, int64_t) {
  return verify_impl(c, S, st, s, t, p, pv, n, r, cap, wi, kc, sc, false, false, 0);
}
static inline __attribute__((always_inline)) int64_t write_impl(uint8_t* canary, int64_t S, int64_t stride, const int32_t* offsets,
                                 const int32_t* seeds, int64_t nreq, const int32_t* ids, const int32_t* pos,
                                 const int32_t* locs, int64_t n, uint8_t* ring, int64_t cap, int32_t* wi,
                                 uint8_t* kc, uint8_t* sc, bool is64, bool input_assert, bool chain_assert,
                                 int32_t nsrc) {
  WriteArgs a{};
  a.canary = CanaryView{canary, S, stride};
  a.seeds = IndexView{seeds, is64}; a.input_ids = IndexView{ids, is64}; a.positions = IndexView{pos, is64};
  a.locs = IndexView{locs, is64}; a.exp_tokens = IndexView{ids, is64}; a.exp_positions = IndexView{pos, is64};
  a.input_assert = input_assert; a.chain_assert = chain_assert; a.sources = RealKvSources{};
  a.sources.count = nsrc; a.sources.mode = nsrc; a.tag = 2;
  LogView lv{ring, cap, wi, kc, sc};
  write_launch(a, IndexView{offsets, is64}, nreq, static_cast<int32_t>(nreq), n, lv);
  return wi[0];
}
extern "C" int64_t shim_write(uint8_t* c, int64_t S, int64_t st, const int32_t* o, const int32_t* sd, int64_t nr,
                              const int32_t* i, const int32_t* p, const int32_t* l, int64_t n, uint8_t* r,
                              int64_t cap, int32_t* wi, uint8_t* kc, uint8_t* sc, int64_t is64, int64_t ia,
                              int64_t ca, int64_t nsrc) {
  return write_impl(c, S, st, o, sd, nr, i, p, l, n, r, cap, wi, kc, sc, is64 != 0, ia != 0, ca != 0,
                    static_cast<int32_t>(nsrc));
}
extern "C" int64_t shim_write_spec(uint8_t* c, int64_t S, int64_t st, const int32_t* o, const int32_t* sd,
                                   int64_t nr, const int32_t* i, const int32_t* p, const int32_t* l, int64_t n,
                                   uint8_t* r, int64_t cap, int32_t* wi, uint8_t* kc, uint8_t* sc, int64_t, int64_t,
                                   int64_t, int64_t) {
  return write_impl(c, S, st, o, sd, nr, i, p, l, n, r, cap, wi, kc, sc, false, false, true, 0);
}
'''

# (file, old, new) text patches per variant
PATCHES = {
    "as_is": [],
    "prefetch": [
        ("cpu_loops.h",
         "  for (int64_t e = 0; e < active; ++e) verify_entry(a, e, emit);",
         "  constexpr int64_t kAhead = 16;  // entries: covers one 16-slot page of records in flight\n"
         "  for (int64_t e = 0; e < active; ++e) {\n"
         "    if (e + kAhead < active) {\n"
         "      const int64_t s = a.slots[e + kAhead];\n"
         "      if (s > 0 && s < a.canary.num_slots) __builtin_prefetch(a.canary.slot_ptr(s));\n"
         "    }\n"
         "    verify_entry(a, e, emit);\n"
         "  }"),
        ("canary_core.h",
         "    const int64_t slot = a.locs[i];\n    if (slot < 0) continue;\n    ++written;",
         "    const int64_t slot = a.locs[i];\n"
         "#if !defined(__CUDA_ARCH__)\n"
         "    if (i + 16 < hi) {\n"
         "      const int64_t ahead = a.locs[i + 16];\n"
         "      if (ahead >= 0 && ahead < S) __builtin_prefetch(a.canary.slot_ptr(ahead), 1);\n"
         "    }\n"
         "#endif\n"
         "    if (slot < 0) continue;\n    ++written;"),
    ],
}

_P, _I = ctypes.c_void_p, ctypes.c_int64


def build_variants(cxx=None):
    """{name: ctypes lib or None}, {name: note}."""
    cxx = cxx or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    libs, notes = {}, {}
    if not cxx:
        return libs, {"all": "no C++ compiler"}
    tmp = tempfile.mkdtemp(prefix="kvcanary-core-")
    try:
        for name, patches in PATCHES.items():
            d = os.path.join(tmp, name)
            os.makedirs(d)
            for f in ("canary_core.h", "cpu_loops.h"):
                shutil.copy(os.path.join(CUDA_DIR, f), d)
            ok = True
            for f, old, new in patches:
                p = os.path.join(d, f)
                text = open(p).read()
                if old not in text:
                    notes[name] = f"patch no longer applies to {f}"
                    ok = False
                    break
                with open(p, "w") as fh:
                    fh.write(text.replace(old, new))
            if not ok:
                continue
            src = os.path.join(d, "shim.cc")
            with open(src, "w") as fh:
                fh.write(SHIM)
            so = os.path.join(d, "shim.so")
            r = subprocess.run([cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-I", d, "-o", so, src],
                               capture_output=True, text=True, timeout=300)
            if r.returncode:
                notes[name] = "build failed: " + r.stderr[:300]
                continue
            lib = ctypes.CDLL(so)
            for fn in ("shim_verify", "shim_verify_spec"):
                getattr(lib, fn).argtypes = [_P, _I, _I, _P, _P, _P, _P, _I, _P, _I, _P, _P, _P, _I, _I, _I]
                getattr(lib, fn).restype = _I
            for fn in ("shim_write", "shim_write_spec"):
                getattr(lib, fn).argtypes = [_P, _I, _I, _P, _P, _I, _P, _P, _P, _I, _P, _I, _P, _P, _P, _I, _I,
                                             _I, _I]
                getattr(lib, fn).restype = _I
            libs[name] = lib
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return libs, notes


def _entry_points(libs):
    """(variant, lib, specialised) for every variant and both entry points."""
    return [(name, lib, spec) for name, lib in libs.items() for spec in (False, True)]


def _ptr(x):
    return x.ctypes.data if isinstance(x, np.ndarray) else x.unsafe_buffer_pointer()


def _log_bufs():
    return (np.zeros((64, 64), np.uint8), np.zeros(1, np.int32), np.zeros((12, 8), np.uint8),
            np.zeros((12, 8), np.uint8))


def _parse(spec):
    return [tuple(int(v) for v in s.split("x")) for s in spec.split(",") if s]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.core_variants", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verify", default="32x2048,32x8192,256x4096", help="bs x prefix list")
    ap.add_argument("--write", default="32x2048,32x32768", help="bs x new tokens list (64-token prefix)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--target-s", type=float, default=0.03)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    from . import harness, native, opbench, scenarios

    libs, notes = build_variants()
    nat, why = native.load()
    for k, v in notes.items():
        print(f"note: variant {k}: {v}")
    if why:
        print(f"note: {why}")
    env = opbench.Env("cpu", ["ffi"], nat, ref_cap=0, xla_cap=0, notes=[])
    results = []
    with jax.default_device(jax.devices("cpu")[0]):
        for bs, p in _parse(args.verify):
            sc = scenarios.build("v", bs, p, 1)
            vp, n = sc.verify_plan, sc.verify_entries
            cs = [c for c in opbench.verify_contenders(sc, env) if c.name in ("ffi", "c_read", "c_verify_mix3")]
            for name, lib, spec in _entry_points(libs):
                bufs = _log_bufs()
                a = [_ptr(sc.canary), sc.num_slots, sc.canary.shape[1]] + [
                    _ptr(x) for x in (vp.slot_indices, vp.expected_tokens, vp.expected_positions,
                                      vp.prev_slot_indices)] + [n, _ptr(bufs[0]), 64] + [_ptr(b) for b in bufs[1:]]
                a += [0, 0, 0]  # is64, check_token, sources: what this scenario has, as runtime values
                fn = lib.shim_verify_spec if spec else lib.shim_verify

                def run(fn=fn, a=a, bufs=bufs):
                    rows = fn(*a)
                    assert rows == 0, "variant recorded violations on a clean scenario"
                    return rows
                cs.append(harness.Contender(f"core_{name}" + ("+specialised" if spec else ""), run,
                                            kind="baseline"))
            res = harness.measure(cs, rounds=args.rounds, target_s=args.target_s)
            results.append(_emit("verify", f"bs={bs} prefix={p}", n, res))
        for bs, e in _parse(args.write):
            sc = scenarios.build("w", bs, 64, e)
            wp, n = sc.write_plan, sc.write_entries
            cs = [c for c in opbench.write_contenders(sc, env) if c.name in ("ffi", "c_write_chain")]
            for name, lib, spec in _entry_points(libs):
                buf = jax.numpy.array(sc.canary, copy=True).block_until_ready()
                bufs = _log_bufs()
                a = [_ptr(buf), sc.num_slots, buf.shape[1], _ptr(wp.offsets), _ptr(wp.seed_slot_indices), bs,
                     _ptr(sc.input_ids), _ptr(sc.positions), _ptr(sc.out_cache_loc), n, _ptr(bufs[0]), 64] + [
                         _ptr(b) for b in bufs[1:]]
                a += [0, 0, 1, 0]  # is64, input assert, chain assert (on: the log's default), sources
                fn = lib.shim_write_spec if spec else lib.shim_write

                def run(fn=fn, a=a, keep=(buf, bufs)):
                    rows = fn(*a)
                    assert rows == 0, "variant recorded violations on a clean scenario"
                    return rows
                cs.append(harness.Contender(f"core_{name}" + ("+specialised" if spec else ""), run,
                                            kind="baseline"))
            res = harness.measure(cs, rounds=args.rounds, target_s=args.target_s)
            results.append(_emit("write", f"bs={bs} prefix=64 extend={e}", n, res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"notes": notes, "results": results, "machine": harness.machine_info("cpu")}, f, indent=1)
    return 0


def _emit(op, name, n, res):
    from .harness import ratio
    ref = "c_read" if op == "verify" else "c_write_chain"
    print(f"{op} {name} (n={n})")
    rec = {"op": op, "scenario": name, "entries": n, "contenders": {}}
    for k, r in res.items():
        rv = ratio(res, k, ref)
        rf = ratio(res, k, "ffi")
        rec["contenders"][k] = {"median_s": r.median, "entries_per_s": n / r.median, "spread": r.spread,
                                f"vs_{ref}": rv, "vs_ffi": rf}
        print(f"    {k:20s} {n / r.median / 1e6:8.1f} M/s   vs {ref} {rv:5.2f}   vs ffi {rf:5.2f}   "
              f"spread {r.spread:.2f}")
    return rec


if __name__ == "__main__":
    sys.exit(main())
