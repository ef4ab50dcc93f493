"""What each run mode measures: the sizes and rounds of every section, and the scenario matrix.

Shared by the suite (``bench/cli.py``, ``bench/sections.py``) and the serving-step child process
(``bench/step_process.py``), which gets only the mode's name on its command line.
"""

from __future__ import annotations

DECODE_BS = (1, 32, 256, 1024)
DECODE_PREFIX = (128, 1024, 4096, 16384)

# Serving-step model sizes: the toy of bench/overhead.py, and sizes where the model dominates the step
# as in real serving.
REALISTIC = {"layers": 8, "d_model": 1024}
REALISTIC_WIDE = {"layers": 8, "d_model": 2048}

MODES = {
    # test-only: the whole pipeline on tiny sizes in seconds (tests/test_bench.py)
    "smoke": dict(rounds=5, step_rounds=5, step_target_s=0.0005, target_s=0.0005, sweep=[16], xla_sweep=[16], ref_cap=512, xla_cap=512,
                  chain=[1, 4], step=[(2, 32, {"layers": 1, "d_model": 64, "vocab": 256})], gpu_sweep=[16],
                  copy_mib=8, targets=dict(chain_tokens=4096, decode_bs=16, scaling=(4, 256), scaling_rounds=5, scaling_target_s=0.0005)),
    # rounds >= 5 everywhere; target_s = wall time of one contender's calls per round. step_rounds,
    # step_target_s: a model-dominated step on a shared CPU varies by ~10 % from call to call (with
    # bench/host_memory.py; 20-40 % without) and has outliers of 2-4x, so its on/off ratio (a median of
    # per-round ratios) needs more rounds, and rounds of several calls. scaling_rounds, scaling_target_s:
    # the same for the thread-pool scaling line, whose one-thread verify of 2^20 entries (~8 ms) varies
    # by up to 1.8x between calls on a shared VM.
    "quick": dict(rounds=5, step_rounds=9, step_target_s=0.1, target_s=0.004, sweep=[128, 2048], xla_sweep=[128], ref_cap=4096, xla_cap=4096,
                  chain=[1, 16, 64], step=[(4, 256), (16, 1024), (8, 512, REALISTIC)], gpu_sweep=[128, 2048, 32768],
                  targets=dict(chain_tokens=1 << 20, decode_bs=256, scaling=(256, 4096), scaling_rounds=15,
                               scaling_target_s=0.02)),
    "medium": dict(rounds=9, step_rounds=41, step_target_s=0.25, target_s=0.01, sweep=[128, 512, 2048, 8192, 32768], xla_sweep=[128, 2048],
                   ref_cap=16384, xla_cap=1 << 20, chain=[1, 4, 16, 64],
                   step=[(8, 512), (32, 1024), (32, 4096), (128, 1024), (8, 512, REALISTIC), (32, 1024, REALISTIC),
                         (16, 2048, REALISTIC), (8, 1024, REALISTIC_WIDE)],
                   gpu_sweep=[128, 2048, 32768, 131072, 524288],
                   targets=dict(chain_tokens=1 << 20, decode_bs=256, scaling=(256, 4096), scaling_rounds=31,
                                scaling_target_s=0.05)),
    "full": dict(rounds=7, step_rounds=41, step_target_s=0.25, target_s=0.05, sweep=[128, 512, 2048, 8192, 32768, 131072],
                 xla_sweep=[128, 2048, 32768], ref_cap=16384, xla_cap=1 << 20, chain=[1, 4, 16, 64, 128],
                 step=[(8, 512), (32, 1024), (32, 4096), (128, 1024), (64, 4096), (8, 512, REALISTIC),
                       (32, 1024, REALISTIC), (64, 4096, REALISTIC), (16, 2048, REALISTIC_WIDE)],
                 gpu_sweep=[128, 2048, 32768, 131072, 524288],
                 targets=dict(chain_tokens=1 << 20, decode_bs=256, scaling=(256, 4096), scaling_rounds=31,
                                scaling_target_s=0.05)),
}


def matrix(mode: str) -> list:
    """[(name, ``scenarios.build`` kwargs)] of upstream's scenario matrix for a mode."""
    from jax_kvcanary import RealKvHashMode as M
    out = []
    for bs in DECODE_BS:
        for p in DECODE_PREFIX:
            out.append((f"decode bs={bs} prefix={p}", dict(bs=bs, prefix=p, extend=1)))
    for p in (0, 4096, 12288):
        out.append((f"prefill chunk=4096 prefix={p}", dict(bs=1, prefix=p, extend=4096)))
    for bs in (32, 256):
        out.append((f"swa w=128 decode bs={bs} prefix=4096", dict(bs=bs, prefix=4096, extend=1, window=128)))
    out.append(("swa w=128 prefill chunk=4096 prefix=12288", dict(bs=1, prefix=12288, extend=4096, window=128)))
    out.append(("realkv none decode bs=32 prefix=1024", dict(bs=32, prefix=1024, extend=1)))
    for m in (M.PARTIAL, M.ALL):
        for k in (1, 4):
            out.append((f"realkv {m.name.lower()} x{k} decode bs=32 prefix=1024",
                        dict(bs=32, prefix=1024, extend=1, mode=m, num_sources=k)))
    if mode == "full":
        return out
    if mode == "medium":
        return [(n, kw) for n, kw in out if kw["bs"] * max(kw["prefix"], 1) <= (1 << 20)]
    if mode == "smoke":
        return [(n, kw) for n, kw in out if n == "decode bs=1 prefix=128"]
    quick = {"decode bs=1 prefix=128", "decode bs=32 prefix=1024", "decode bs=256 prefix=4096",
             "prefill chunk=4096 prefix=4096", "swa w=128 decode bs=32 prefix=4096",
             "realkv partial x1 decode bs=32 prefix=1024", "realkv all x4 decode bs=32 prefix=1024"}
    return [(n, kw) for n, kw in out if n in quick]
