"""Evidence for CPU-core changes on the real custom-call path: rebuilds the extension module from the
working tree's sources in a temporary directory, as-is and with small source patches, registers each
build's handlers under suffixed FFI target names, and times them inside jit against the shipped
``impl='ffi'`` and the baselines, on the same scenario buffers, in interleaved rounds.

    PYTHONPATH=. python -m bench.experiments.ffi_variants [--verify 32x2048,32x8192,256x4096] [--write 32x2048,32x32768]

Needs cmake + ninja + a C++ compiler + nanobind (the development build's requirements). Nothing in
the tree is modified. Variants: ``as_is`` (control: must match the shipped module) and ``rkv_nodiv``
(real-KV addressing skips its 64-bit divisions when page_size == 1). Variants measured here before and
since adopted: the verify prefetch and the per-launch specialisation of the index width
(csrc/cpu_launchers.h). A variant whose patch no longer applies is reported as such and skipped.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Real-KV addressing without 64-bit divisions when page_size == 1 (the token-major layout): the row
# index is the slot and the in-row offset 0.
RKV_DIV_PATCH = [
    ("canary_core.h", "      if (slot / src[k].page_size >= src[k].rows) return k;",
     "      const int64_t row = src[k].page_size == 1 ? slot : slot / src[k].page_size;\n"
     "      if (row >= src[k].rows) return k;"),
    ("canary_core.h",
     "    return v.data + (slot / v.page_size) * v.row_bytes + (slot % v.page_size) * v.bytes_per_token;",
     "    if (v.page_size == 1) return v.data + slot * v.row_bytes;\n"
     "    return v.data + (slot / v.page_size) * v.row_bytes + (slot % v.page_size) * v.bytes_per_token;"),
]


def build(tmp, name, patches):
    d = os.path.join(tmp, name)
    os.makedirs(d)
    for f in ("CMakeLists.txt", "pyproject.toml"):
        shutil.copy(os.path.join(ROOT, f), d)
    for sub in ("cmake", "csrc", "cuda"):
        shutil.copytree(os.path.join(ROOT, sub), os.path.join(d, sub))
    for f, old, new in patches:
        p = os.path.join(d, "csrc", f)
        text = open(p).read()
        if old not in text:
            return None, f"patch no longer applies to {f}"
        open(p, "w").write(text.replace(old, new))
    b = os.path.join(d, "b")
    r = subprocess.run(["cmake", "-S", d, "-B", b, "-G", "Ninja", "-DJAX_KVCANARY_CUDA=off",
                        f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release"],
                       capture_output=True, text=True)
    if r.returncode == 0:
        r = subprocess.run(["cmake", "--build", b, "--target", "_kvcanary"], capture_output=True, text=True)
    if r.returncode:
        return None, "build failed: " + (r.stdout + r.stderr)[-400:]
    so = [f for f in os.listdir(b) if f.startswith("_kvcanary") and f.endswith(".so")]
    return os.path.join(b, so[0]), None


def register(path, suffix):
    loader = importlib.machinery.ExtensionFileLoader("jax_kvcanary._kvcanary", path)
    spec = importlib.util.spec_from_file_location("jax_kvcanary._kvcanary", path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    for target, capsule in mod.registrations().items():
        jax.ffi.register_ffi_target(f"{target}__{suffix}", capsule, platform="cpu")
    return mod


def _verify_fn(suffix, mode=0):
    import jax_kvcanary as kvc
    from jax_kvcanary import _ffi

    def f(canary, log, p, srcs):
        scratch = _ffi._scratch("verify_scratch_bytes", p.slot_indices.shape[0])
        call = jax.ffi.ffi_call(f"{_ffi.VERIFY_TARGET}__{suffix}", _ffi._log_outputs(log) + (scratch,),
                                input_output_aliases={1: 0, 2: 1, 3: 2, 4: 3})
        ring, wi, kc, sc, _ = call(canary, log.ring, log.write_index, log.kernel_run_counters, log.slot_run_counters,
                                p.slot_indices, p.expected_tokens, p.expected_positions, p.prev_slot_indices,
                                p.num_valid, p.enable, *[s.array for s in srcs], tag=np.int64(2),
                                check_token=np.bool_(False), **_ffi._source_attrs(srcs, mode if srcs else 0))
        return kvc.ViolationLog(ring, wi, kc, sc, log.enable_chain_position_assert)
    return jax.jit(f, donate_argnums=(1,))


def _write_fn(suffix):
    import jax.numpy as jnp

    import jax_kvcanary as kvc
    from jax_kvcanary import _ffi

    def f(canary, log, wp, ids, pos, loc):
        z = jnp.zeros((0,), jnp.int32)
        scratch = _ffi._scratch("write_scratch_bytes", wp.seed_slot_indices.shape[0], ids.shape[0])
        call = jax.ffi.ffi_call(f"{_ffi.WRITE_TARGET}__{suffix}",
                                (_ffi._sds(canary),) + _ffi._log_outputs(log) + (scratch,),
                                input_output_aliases={0: 0, 1: 1, 2: 2, 3: 3, 4: 4})
        canary, ring, wi, kc, sc, _ = call(canary, log.ring, log.write_index, log.kernel_run_counters,
                                        log.slot_run_counters, log.enable_chain_position_assert, wp.offsets,
                                        wp.seed_slot_indices, wp.num_valid_reqs, ids, pos, loc, z, z,
                                        tag=np.int64(2), input_assert=np.bool_(False), **_ffi._source_attrs((), 0))
        return canary, kvc.ViolationLog(ring, wi, kc, sc, log.enable_chain_position_assert)
    return jax.jit(f, donate_argnums=(0, 1))


def _parse(spec):
    return [tuple(int(v) for v in s.split("x")) for s in spec.split(",") if s]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.experiments.ffi_variants", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verify", default="32x2048,32x8192,256x4096")
    ap.add_argument("--write", default="32x2048,32x32768")
    ap.add_argument("--realkv", default="PARTIAL:1,PARTIAL:4,ALL:1",
                    help="verify with real-KV sources (bs=32, prefix=1024): MODE:num_sources list")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--target-s", type=float, default=0.01)
    ap.add_argument("--json", default=None, help="write the records here (kept: bench/experiments/results/)")
    args = ap.parse_args(argv)

    import jax.numpy as jnp

    import jax_kvcanary as kvc

    from .. import harness, native, opbench, scenarios

    tmp = tempfile.mkdtemp(prefix="kvcanary-ffi-")
    names, notes = [], {}
    try:
        for name, patches in (("as_is", []), ("rkv_nodiv", RKV_DIV_PATCH)):
            path, why = build(tmp, name, patches)
            if why:
                notes[name] = why
                print(f"note: {name}: {why}")
                continue
            register(path, name)
            names.append(name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    nat, _ = native.load()
    env = opbench.Env("cpu", ["ffi"], nat, ref_cap=0, xla_cap=0, notes=[])
    out = []
    with jax.default_device(jax.devices("cpu")[0]):
        from jax_kvcanary import RealKvHashMode
        rkv = [(m.split(":")[0], int(m.split(":")[1])) for m in args.realkv.split(",") if m]
        jobs = ([("verify", bs, p, None) for bs, p in _parse(args.verify)]
                + [("write", bs, p, None) for bs, p in _parse(args.write)]
                + [("verify", 32, 1024, r) for r in rkv])
        for op, bs, p, rk in jobs:
            mode = RealKvHashMode[rk[0]] if rk else RealKvHashMode.NONE
            if op == "verify":
                sc = scenarios.build("v", bs, p, 1, mode=mode, num_sources=rk[1] if rk else 0)
                n = sc.verify_entries
                keep = ("ffi", "gather", "c_read", "c_verify_mix3")
                cs = [c for c in opbench.verify_contenders(sc, env) if c.name in keep]
            else:
                sc = scenarios.build("w", bs, 64, p)
                n = sc.write_entries
                cs = [c for c in opbench.write_contenders(sc, env) if c.name in ("ffi", "scatter", "c_write_chain")]
            for name in names:
                st = {"log": kvc.ViolationLog.create(64), "canary": jnp.array(sc.canary, copy=True)}
                if op == "verify":
                    f = _verify_fn(name, int(mode))

                    def run(f=f, st=st, sc=sc):
                        st["log"] = f(sc.canary, st["log"], sc.verify_plan, sc.sources)
                        return st["log"]
                else:
                    f = _write_fn(name)

                    def run(f=f, st=st):
                        st["canary"], st["log"] = f(st["canary"], st["log"], sc.write_plan, sc.input_ids,
                                                    sc.positions, sc.out_cache_loc)
                        return st["log"]
                run.state = st
                cs.append(harness.Contender(f"ffi_{name}", run))
            res = harness.measure(cs, rounds=args.rounds, target_s=args.target_s)
            for c in cs:
                st = getattr(c.fn, "state", None)
                if st and st["log"].total():
                    raise RuntimeError(f"{c.name} recorded violations on a clean scenario")
            ref = "c_read" if op == "verify" else "c_write_chain"
            base = "gather" if op == "verify" else "scatter"
            rec = {"op": op, "bs": bs, "size": p, "entries": n, "real_kv": list(rk) if rk else None,
                   "entries_per_s": {k: n / r.median for k, r in res.items()},
                   "vs_shipped_ffi": {k: harness.ratio(res, k, "ffi") for k in res},
                   f"vs_{ref}": {k: harness.ratio(res, k, ref) for k in res},
                   f"vs_{base}": {k: harness.ratio(res, k, base) for k in res},
                   "spread": {k: r.spread for k, r in res.items()}}
            out.append(rec)
            print(f"{op} n={n}{' real-KV ' + str(rk) if rk else ''}: " + "  ".join(f"{k}={v / 1e6:.1f}M/s" for k, v in rec["entries_per_s"].items()))
            for key in ("vs_shipped_ffi", f"vs_{ref}", f"vs_{base}"):
                if any(v is not None for v in rec[key].values()):
                    print(f"    {key:16s} " + "  ".join(f"{k}={v:.2f}" for k, v in rec[key].items()
                                                     if k.startswith("ffi") and v is not None))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"notes": notes, "results": out, "machine": harness.machine_info("cpu")}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
