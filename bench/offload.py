"""The host check of an offloaded KV copy (``runtime.hostcheck.check_host_copy``) against a plain host
memcpy (``np.copyto``) of the same bytes, in the same process, interleaved rounds (bench/harness.py).

    python -m bench.offload [--slots 65536] [--token-bytes 1024] [--rounds 7]

A host copy of ``slots`` KV slots (pages of 16, ``token-bytes`` per slot, float32, 64-byte aligned)
with the records a device TAIL write stamped on the same bytes; the check is the one a host tier runs
right after its device-to-host copy. Bytes/s counts the copy's bytes for every contender (ALL folds
all of them, PARTIAL the first 16 of each slot). ``numpy_fold`` is the same fingerprint computed with
vectorised numpy (``hashing.slot_real_kv_hash``), the path the native handler replaces.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

PAGE = 16

#: (slots, token bytes) per bench mode
POINTS = {"smoke": [(1024, 256)], "quick": [(16384, 256)], "medium": [(16384, 256), (65536, 1024)],
          "full": [(16384, 256), (65536, 1024), (262144, 1024)]}


def _case(slots: int, token_bytes: int, mode, seed: int = 0):
    """Host KV (aligned), its RealKvSource, and the TAIL records of a device write over the same bytes."""
    import jax_kvcanary as kvc
    from jax_kvcanary.runtime import aligned_host_array, export_records

    host = aligned_host_array((slots // PAGE, PAGE, token_bytes // 4), np.float32)
    host[:] = np.random.default_rng(seed).standard_normal(host.shape, dtype=np.float32)
    cpu = jax.devices("cpu")[0]
    dev = jax.device_put(host, cpu)
    idx = jax.device_put(jnp.arange(slots, dtype=jnp.int32), cpu)
    wp = kvc.WritePlan(jax.device_put(jnp.asarray([0, slots], jnp.int32), cpu),
                       jax.device_put(jnp.asarray([-1], jnp.int32), cpu), jax.device_put(jnp.ones(1, jnp.int32), cpu))
    canary, log = kvc.write(jax.device_put(kvc.new_canary_buffer(slots), cpu), jax.device_put(kvc.ViolationLog.create(), cpu),
                            wp, idx, idx, idx, tag=kvc.LaunchTag.TAIL_K_FULL,
                            real_kv_sources=(kvc.RealKvSource(dev, PAGE, token_bytes, token_bytes),),
                            real_kv_hash_mode=mode)
    assert log.total() == 0
    records, _ = export_records(canary, idx)
    return host, kvc.RealKvSource(host, PAGE, token_bytes, token_bytes), np.asarray(records), np.asarray(idx)


def measure(slots: int, token_bytes: int, mode_name: str, *, rounds: int, target_s: float) -> dict:
    """One point: check vs memcpy (and the numpy fold) on ``slots`` x ``token_bytes``."""
    from jax_kvcanary import RealKvHashMode, hashing
    from jax_kvcanary.consts import HostCheckTag
    from jax_kvcanary.runtime import check_host_copy

    from . import harness

    mode = RealKvHashMode[mode_name]
    host, src, records, idx = _case(slots, token_bytes, mode)
    dst = np.empty_like(host)
    nbytes = host.nbytes
    stored = records.view("<i8")[:, 3]

    def check():
        res = check_host_copy(src, records, idx, real_kv_hash_mode=mode, tag=HostCheckTag.HOST_BACKUP_K_FULL)
        assert res.ok, res.rows[:3]
        return None

    def memcpy():
        np.copyto(dst, host)
        return None

    def numpy_fold():
        got = hashing.to_i64(hashing.slot_real_kv_hash((src,), idx, mode))
        assert np.array_equal(got, stored)
        return None

    res = harness.measure([harness.Contender("host_check", check),
                           harness.Contender("memcpy", memcpy, kind="baseline"),
                           harness.Contender("numpy_fold", numpy_fold, kind="baseline", max_reps=1)],
                          rounds=rounds, target_s=target_s)
    rate = {k: nbytes / r.median for k, r in res.items()}
    return {"slots": slots, "token_bytes": token_bytes, "page_size": PAGE, "mode": mode_name, "bytes": nbytes,
            "bytes_per_s": rate, "median_s": {k: r.median for k, r in res.items()},
            "spread": {k: round(r.spread, 3) for k, r in res.items()},
            "check_over_memcpy": harness.ratio(res, "host_check", "memcpy"),
            "check_over_numpy_fold": harness.ratio(res, "host_check", "numpy_fold")}


def run(mode: str, *, rounds: int, target_s: float, log=print) -> list:
    """Every point of a bench mode, ALL and PARTIAL."""
    out = []
    for slots, tb in POINTS[mode]:
        for m in ("ALL", "PARTIAL"):
            r = measure(slots, tb, m, rounds=rounds, target_s=target_s)
            log(f"    {m:7s} slots={slots:>7d} x {tb:4d} B  check {r['bytes_per_s']['host_check'] / 1e9:6.2f} GB/s  "
                f"memcpy {r['bytes_per_s']['memcpy'] / 1e9:6.2f} GB/s  check/memcpy {r['check_over_memcpy']:.3f}  "
                f"check/numpy_fold {r['check_over_numpy_fold']:.1f}")
            out.append(r)
    return out


def markdown(recs: list) -> list:
    """Lines of the report section."""
    lines = ["## Host check of an offloaded copy vs memcpy", "",
             "`check_host_copy` (native verify on the CPU device, prev 0, fingerprint only) on a 64-byte-aligned "
             "host copy in pages of 16, against `np.copyto` of the same bytes and the vectorised numpy fold; "
             "bytes/s counts the copy's bytes for every contender; ratios are per-round medians.", "",
             "| mode | slots | bytes/slot | check GB/s | memcpy GB/s | numpy fold GB/s | check/memcpy | check/numpy |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in recs:
        b = r["bytes_per_s"]
        lines.append(f"| {r['mode']} | {r['slots']} | {r['token_bytes']} | {b['host_check'] / 1e9:.2f} | "
                     f"{b['memcpy'] / 1e9:.2f} | {b['numpy_fold'] / 1e9:.3f} | {r['check_over_memcpy']:.3f} | "
                     f"{r['check_over_numpy_fold']:.1f} |")
    return lines + [""]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.offload", description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=65536)
    ap.add_argument("--token-bytes", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", action="store_true", help="print the records as JSON")
    args = ap.parse_args(argv)
    recs = [measure(args.slots, args.token_bytes, m, rounds=args.rounds, target_s=0.05) for m in ("ALL", "PARTIAL")]
    print(json.dumps(recs, indent=1) if args.json else "\n".join(markdown(recs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
