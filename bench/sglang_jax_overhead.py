"""The canary's overhead in sglang-jax: decode step time with the canary on vs off.

    python bench/sglang_jax_overhead.py [--batch-sizes 1 4 8] [--prompt-len 96] [--rounds 30]

Needs sglang-jax (``pip install 'jax_kvcanary[sglang-jax]'``); runs on the CPU with the tiny
random-weight Qwen2 of ``jax_kvcanary.integrations.sglang_jax_tiny``. For each batch size, B
requests of ``--prompt-len`` tokens are prefilled through the engine, then one real decode batch is
prepared by sglang-jax (``prepare_for_decode``, ``get_model_worker_batch``, ``ForwardBatch``) and
``ModelRunner.forward`` is timed on it, to completion, with the canary installed (HEAD + model +
TAIL in one jit, the host-side row copy and the monitor's readback) and uninstalled, in interleaved
rounds (the order alternates). Re-running one decode step rewrites the same slots with the same
values, so every canary-on step takes the clean path (checked: no violation). Sweeps are off.
Prints per batch size the median step time off and on, the median per-round ratio on/off, the
absolute canary cost per step (median on - median off), and the same from the fastest step of
each (min on - min off: steadier than the medians on a loaded machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--real-data", choices=("none", "partial", "all"), default="partial")
    args = p.parse_args(argv)

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jax_kvcanary.integrations import sglang_jax_tiny as tiny
    tiny.set_flax_env()
    warnings.simplefilter("ignore", DeprecationWarning)
    import logging
    logging.getLogger("sgl_jax").setLevel(logging.ERROR)
    try:
        import sgl_jax  # noqa: F401
    except Exception as exc:
        print(f"skipped: sglang-jax (sgl_jax) is not importable: {exc!r}")
        return 0
    import jax
    import numpy as np
    from sgl_jax.srt.layers.logits_processor import LogitsMetadata
    from sgl_jax.srt.model_executor.forward_batch_info import ForwardBatch

    from jax_kvcanary.integrations import sglang_jax as kvc_sgl
    from jax_kvcanary.runtime import CanaryConfig

    bmax = max(args.batch_sizes)
    eng = tiny.TinyEngine(max_running_requests=bmax, bs_paddings=sorted(set(args.batch_sizes)),
                          max_total_tokens=bmax * (args.prompt_len + 8) + 64,
                          token_padding=bmax * args.prompt_len)
    cfg = CanaryConfig(mode="log", real_kv_hash_mode=args.real_data.upper())
    canary = kvc_sgl.SglangJaxCanary(eng.runner, cfg)
    print(f"sglang-jax decode step, canary on vs off (CPU, jax {jax.__version__}, tiny Qwen2 "
          f"2 layers, prompt {args.prompt_len} tokens, real-KV {args.real_data}, "
          f"{args.rounds} interleaved rounds)")
    print(f"{'batch':>5} {'off ms':>8} {'on ms':>8} {'ratio':>6} {'canary ms/step':>15}"
          f" {'min off':>8} {'min on':>8} {'min diff':>9}")
    rng = np.random.default_rng(0)
    for bs in args.batch_sizes:
        eng.reset()
        canary.reset()
        canary.install()                        # the prefill stamps the prefix's canary records
        reqs = [tiny.Request(f"b{i}", [int(t) for t in rng.integers(3, 500, args.prompt_len)], 8)
                for i in range(bs)]
        batch = eng.prefill(reqs)
        batch.prepare_for_decode()
        mwb = batch.get_model_worker_batch(*eng.paddings, 1)
        fb = ForwardBatch.init_new(mwb, eng.runner)
        lm = LogitsMetadata.from_model_worker_batch(mwb, eng.mesh)

        def step():
            out, _ = eng.runner.forward(fb, lm)
            jax.block_until_ready((out.next_token_logits, eng.kv_buffer))

        for on in (True, False):                # compile both
            (canary.install if on else canary.uninstall)()
            step()
        times = {True: [], False: []}
        for r in range(args.rounds):
            for on in ((True, False) if r % 2 else (False, True)):
                (canary.install if on else canary.uninstall)()
                t0 = time.perf_counter()
                step()
                times[on].append(time.perf_counter() - t0)
        canary.uninstall()
        canary.flush()
        if canary.monitor.violations:
            print(f"error: {len(canary.monitor.violations)} violations in a clean run",
                  file=sys.stderr)
            return 1
        off, on = statistics.median(times[False]), statistics.median(times[True])
        ratio = statistics.median(a / b for a, b in zip(times[True], times[False]))
        lo_off, lo_on = min(times[False]), min(times[True])
        print(f"{bs:>5} {off * 1e3:8.2f} {on * 1e3:8.2f} {ratio:6.3f} {(on - off) * 1e3:15.2f}"
              f" {lo_off * 1e3:8.2f} {lo_on * 1e3:8.2f} {(lo_on - lo_off) * 1e3:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
