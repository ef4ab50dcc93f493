"""The demo: a small paged-KV transformer decoder served with the KV-cache canary on.

    python -m jax_kvcanary.demo [--steps 40] [--requests 8] [--inject KIND] [--mode log|raise]
                                [--real-kv none|partial|all] [--sweep-interval 8] [--devices 1]
                                [--offload]

It serves a batch of requests (shared prefixes through a prefix cache, chunked prefill then decode,
an SWA layer with its own slot pool and LUT), shows a progress bar, then a summary: tokens served,
slots verified / written per tag, violations by tag and reason, and the canary's overhead (the
recorded steps replayed with the canary off and on). ``--inject KIND`` injects one fault
(``jax_kvcanary.runtime.perturb.KINDS``, and with ``--offload`` the ``OFFLOAD_KINDS``) and reports when
and how it was detected. ``--offload`` adds a host tier: cold prefix-cache slots are evicted to host
memory with their canary records (the host copy is checked) and reloaded into new slots, through a
transfer pack that is checked on arrival, on a prefix hit.

Exit status: 0 clean (or log mode); 1 a ``CanaryViolationError`` in raise mode; 2 an injected fault
that was not detected as expected; 3 a failed health check.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from ..runtime import perturb

FAULT_KINDS = perturb.KINDS + perturb.OFFLOAD_KINDS
#: faults planted in a reload of offloaded slots (armed early: see ``default_inject_step``)
RELOAD_KINDS = ("reload_wrong_slot", "transfer_byte_flip")
REAL_KV = {"none": "NONE", "partial": "PARTIAL", "all": "ALL"}
MAX_LOGGED_REPORTS = 6


def parse_args(argv=None):
    paragraphs = __doc__.split("\n\n")
    p = argparse.ArgumentParser(prog="python -m jax_kvcanary.demo", description=paragraphs[1],
                                epilog=next(t for t in paragraphs if t.startswith("Exit status")),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="serving steps (default 40)")
    p.add_argument("--requests", type=int, default=8, help="requests to serve (default 8)")
    p.add_argument("--inject", choices=FAULT_KINDS, default=None, help="inject one fault of this kind")
    p.add_argument("--inject-step", type=int, default=None,
                   help="step at (or after) which to inject (default: steps // 2; 2 for the "
                        "reload faults reload_wrong_slot and transfer_byte_flip)")
    p.add_argument("--inject-group", choices=("full", "swa"), default=None,
                   help="attention group the fault targets (default full; swa for "
                        "swa_evicted_in_window, which only the SWA group has)")
    p.add_argument("--inject-device", type=int, default=0, help="device whose KV is corrupted")
    p.add_argument("--mode", choices=("log", "raise"), default="log",
                   help="log: report and keep serving; raise: stop with CanaryViolationError")
    p.add_argument("--real-kv", choices=tuple(REAL_KV), default="partial",
                   help="real-KV fingerprint mode at TAIL and SWEEP (default partial)")
    p.add_argument("--sweep-interval", type=int, default=8,
                   help="sweep the prefix cache every N steps; 0 = off (default 8)")
    p.add_argument("--devices", type=int, default=1,
                   help="split attention heads / KV over N devices (CPU: virtual devices)")
    p.add_argument("--no-swa", action="store_true", help="no sliding-window layer")
    p.add_argument("--token-check", action="store_true",
                   help="also verify stored tokens against the ground-truth token pool")
    p.add_argument("--stats-interval", type=int, default=0,
                   help="log a kv_canary stats line every N steps (default 0 = off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-overhead", action="store_true", help="skip the canary on/off replay")
    p.add_argument("--offload", action="store_true",
                   help="host offload tier: evict cold prefix-cache slots to host, reload them on a hit")
    args = p.parse_args(argv)
    if args.steps < 1 or args.requests < 1 or args.devices < 1:
        p.error("--steps, --requests and --devices must be >= 1")
    if args.sweep_interval < 0 or args.stats_interval < 0:
        p.error("--sweep-interval and --stats-interval must be >= 0")
    if args.inject and args.inject.startswith("real_kv") and args.real_kv == "none":
        p.error(f"--inject {args.inject} is detected by the real-KV fingerprint: use --real-kv partial|all")
    if args.inject == "real_kv_unused_cache" and args.sweep_interval == 0:
        p.error("--inject real_kv_unused_cache is detected by a sweep: use --sweep-interval N > 0")
    if args.inject_group is None:
        args.inject_group = "swa" if args.inject == "swa_evicted_in_window" else "full"
    if args.inject == "swa_evicted_in_window" and (args.inject_group != "swa" or args.no_swa):
        p.error("--inject swa_evicted_in_window targets the SWA group: use --inject-group swa "
                "(and the SWA layer, without --no-swa)")
    if args.inject_group == "swa" and args.no_swa:
        p.error("--inject-group swa needs the SWA layer (drop --no-swa)")
    if args.inject in perturb.OFFLOAD_KINDS and (not args.offload or args.inject_group != "full"):
        p.error(f"--inject {args.inject} needs the offload tier (--offload) and targets the full group")
    if args.inject in ("offload_byte_flip", "transfer_byte_flip") and args.real_kv == "none":
        p.error(f"--inject {args.inject} is detected by the real-KV fingerprint: use --real-kv partial|all")
    if args.offload and args.devices > 1:
        p.error("--offload runs on one device (drop --devices)")
    return args


class Progress:
    """A one-line progress bar on stderr (redrawn in place on a terminal, else printed at 25% marks)."""

    def __init__(self, total: int, stream=None, width: int = 32):
        self.total, self.width = total, width
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.mid_line = False
        self._last_mark = -1
        self._last_line = None

    def line(self, done: int, extra: str) -> str:
        fill = int(self.width * done / self.total)
        return f"[{'#' * fill}{'.' * (self.width - fill)}] {done}/{self.total} steps  {extra}"

    def update(self, done: int, extra: str = "", final: bool = False):
        """Redraw (a terminal) or print at a new 25% mark; ``final``: also print a changed last line."""
        line = self.line(done, extra)
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
            self.mid_line = True
        else:
            mark = 4 * done // self.total
            if mark != self._last_mark or (final and line != self._last_line):
                self._last_mark, self._last_line = mark, line
                self.stream.write(line + "\n")
        self.stream.flush()

    def break_line(self):
        if self.mid_line:
            self.stream.write("\n")
            self.mid_line = False

    def close(self):
        self.break_line()


class _ReportHandler(logging.Handler):
    """Prints the first few violation reports in full, then only counts them."""

    def __init__(self, bar: Progress):
        super().__init__(logging.INFO)
        self.bar, self.shown, self.hidden = bar, 0, 0

    def emit(self, record):
        msg = record.getMessage()
        if record.levelno >= logging.WARNING and msg.startswith("kv_canary violation"):
            if self.shown >= MAX_LOGGED_REPORTS:
                self.hidden += 1
                return
            self.shown += 1
        self.bar.break_line()
        self.bar.stream.write(msg + "\n")
        self.bar.stream.flush()


def _ensure_devices(n: int):
    import jax
    if n > 1 and jax.config.jax_platforms in (None, "", "cpu"):
        try:
            jax.config.update("jax_num_cpu_devices", max(n, jax.config.jax_num_cpu_devices))
        except Exception:  # noqa: BLE001 - the backend is already up; device_mesh reports it
            pass


def _impl_name():
    from .. import backend
    impl, reason = backend.describe()
    return impl if reason is None else f"{impl} ({reason})"


def _fmt_tag_table(monitor, tags):
    c = monitor.counters
    runs, ver, wr = c.kernel_runs.sum(0), c.verified.sum(0), c.written.sum(0)
    lines = [f"    {'tag':<14}{'launches':>10}{'verified':>12}{'written':>12}"]
    for t in tags:
        lines.append(f"    {t.name:<14}{runs[t]:>10}{ver[t]:>12}{wr[t]:>12}")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    _ensure_devices(args.devices)
    from ..runtime import CanaryConfig
    from .engine import EngineConfig

    t_start = time.perf_counter()
    swa = not args.no_swa
    ecfg = EngineConfig(requests=args.requests, swa=swa, devices=args.devices, seed=args.seed,
                        offload=args.offload)
    ccfg = CanaryConfig(mode=args.mode, real_kv_hash_mode=REAL_KV[args.real_kv],
                        sweep_interval=args.sweep_interval,
                        groups=("FULL", "SWA") if swa else ("FULL",),
                        swa_window_size=ecfg.swa_window if swa else 0,
                        write_input_assert=True, token_check=args.token_check,
                        stats_interval=args.stats_interval)
    bar = Progress(args.steps)
    handler = _ReportHandler(bar)
    lg = logging.getLogger("jax_kvcanary.demo")
    lg.addHandler(handler)
    lg.setLevel(logging.INFO)
    lg.propagate = False
    try:
        return _run(args, ecfg, ccfg, bar, handler, lg, t_start)
    finally:
        lg.removeHandler(handler)


def default_inject_step(args) -> int:
    """Where ``--inject`` arms its fault without ``--inject-step``: mid-run, except for the faults
    of a reload (the prefix-cache hits on offloaded slots come early in the demo's workload), which
    arm from step 2 on so that the first reload is the target."""
    return 2 if args.inject in RELOAD_KINDS else max(2, args.steps // 2)


def _run(args, ecfg, ccfg, bar, handler, lg, t_start):
    from .engine import ToyEngine

    engine = ToyEngine(ecfg, ccfg, record=not args.no_overhead, logger=lg)
    _print_header(args, engine)
    engine.warmup()
    t_warm = time.perf_counter() - t_start
    if args.inject:
        step = args.inject_step if args.inject_step is not None else default_inject_step(args)
        engine.arm(args.inject, step, group=args.inject_group.upper(),
                   device=args.inject_device if args.devices > 1 else None)
    res = _serve(args, engine, bar)
    overhead = None
    if res.status == 0 and not args.no_overhead:
        import numpy as np
        on, off = engine.measure_overhead()
        overhead = (float(np.median(on)), float(np.median(off)), float(on.sum() / off.sum()))
    _print_summary(args, engine, res, handler, overhead, t_start, t_warm)
    if res.status == 0 and args.inject and res.detected is None:
        return 2
    return res.status


class _Served:
    def __init__(self):
        self.steps, self.status, self.error = 0, 0, None
        self.first_seen = {}      # (tag, reason) -> step first reported
        self.detected = None      # (step, Violation): the first expected detection of the fault


def _serve(args, engine, bar) -> _Served:
    from ..runtime import CanaryHealthError, CanaryViolationError

    res = _Served()

    def note(vs):
        for v in vs:
            for r in v.reasons:
                res.first_seen.setdefault((v.tag_name, r), v.step)
            if res.detected is None and engine.fault is not None and engine.fault[1].matches(v):
                res.detected = (v.step, v)

    def show(final=False):
        bar.update(res.steps, f"tokens {engine.tokens_prefill + engine.tokens_decode}  "
                              f"violations {len(engine.monitor.violations)}", final=final)

    try:
        for _ in range(args.steps):
            note(engine.iterate())
            res.steps += 1
            show()
        note(engine.monitor.flush())
        show(final=True)           # the last step's readback: the bar ends on the summary's count
    except CanaryViolationError as e:
        note(e.violations)
        res.status, res.error = 1, e
    except CanaryHealthError as e:
        res.status, res.error = 3, e
    bar.close()
    return res


def _print_header(args, engine):
    m, e, c = engine.mcfg, engine.cfg, engine.canary
    window = f", window {m.swa_window}" if e.swa else ""
    devs = f"{e.devices} device" + ("s (attention heads and KV split)" if e.devices > 1 else "")
    p = lambda *a: print(*a, file=sys.stdout)  # noqa: E731
    p("jax_kvcanary demo")
    p(f"  model   {len(m.layers)} layers ({' + '.join(m.layers)}{window}), d_model {m.d_model}, "
      f"{m.heads} heads x {m.head_dim}, vocab {m.vocab}, random weights; {devs}")
    p(f"  cache   {engine.num_slots} slots in pages of {m.page_size}, batch {e.batch_rows} rows x "
      f"{e.token_budget} tokens, prefill chunks of {e.chunk_size}, prefix cache"
      + (", host offload tier" if e.offload else ""))
    p(f"  canary  mode={c.mode} real_kv={args.real_kv} sweep_interval={c.sweep_interval} "
      f"groups={','.join(c.groups)} halves={','.join(c.halves)} write_input_assert=on "
      f"token_check={'on' if c.token_check else 'off'} impl={_impl_name()}")
    sys.stdout.flush()


def _print_summary(args, engine, res, handler, overhead, t_start, t_warm):
    mon, c = engine.monitor, engine.canary
    p = lambda *a: print(*a, file=sys.stdout)  # noqa: E731
    finished = sum(r.done for r in engine.requests)
    p("")
    p("summary")
    p(f"  steps served       {res.steps} ({finished}/{len(engine.requests)} requests finished)")
    p(f"  tokens served      {engine.tokens_prefill + engine.tokens_decode} (prefill "
      f"{engine.tokens_prefill}, decode {engine.tokens_decode}); {engine.tokens_cached} prompt tokens "
      f"from the prefix cache, {engine.remaps} slots remapped to cached donors")
    p(f"  sweeps             {engine.sweeps} ({engine.sweep_entries} cached slots verified per "
      "group and half)")
    if engine.tier is not None:
        t = engine.tier
        p(f"  offload tier       {t.offloaded} slots offloaded to host, {t.reloaded} reloaded into new slots; "
          f"{t.checked} host-side fingerprint checks (host copies and transfer packs)")
    if mon.counters is not None:
        ndev = mon.counters.kernel_runs.shape[0]
        p("  slots per tag      (incl. the warm-up step" + (f"; summed over {ndev} devices)" if ndev > 1 else ")"))
        for line in _fmt_tag_table(mon, c.expected_tags() or c.tags("HEAD") + c.tags("TAIL")):
            p(line)
    if engine.fault is not None:
        fstep, fault = engine.fault
        p(f"  fault injected     step {fstep}: {fault.describe()}")
        if res.detected is not None:
            dstep, v = res.detected
            lag = dstep - fstep
            p(f"  detected           step {dstep} ({lag} step{'s' if lag != 1 else ''} after the fault): "
              f"{v.tag_name} {'+'.join(v.reasons)} slot_idx={v.slot} position={v.position}"
              + (f" device={v.device}" if v.device is not None else ""))
        else:
            p("  detected           NO: the expected tag and reason were not reported")
    elif args.inject:
        p(f"  fault injected     no target found for {args.inject} (try more --steps)")
    extra = f" reported of {mon.total} recorded" if mon.total != len(mon.violations) else ""
    p(f"  violations         {len(mon.violations)}{extra}")
    width = max([14] + [len(tag) + 1 for tag, _ in mon.by_tag_reason])   # HOST_TRANSFER_K_FULL is 20
    for (tag, reason), n in sorted(mon.by_tag_reason.items()):
        p(f"    {tag:<{width}}{reason:<22}{n:>6}   (first reported at step {res.first_seen.get((tag, reason))})")
    if handler.hidden:
        p(f"  ({handler.hidden} more reports not printed: the first {MAX_LOGGED_REPORTS} are; "
          "every row is counted above)")
    if overhead is not None:
        p(f"  canary overhead    {overhead[2]:.2f}x step time with the canary on vs off (median "
          f"{overhead[0] * 1e3:.2f} ms vs {overhead[1] * 1e3:.2f} ms; {len(engine.trace)} steps "
          "replayed, sweeps included)")
    p(f"  wall time          {time.perf_counter() - t_start:.1f} s (start-up and compile {t_warm:.1f} s)")
    if res.error is not None:
        p("")
        p(f"{type(res.error).__name__} at step {engine.step_no}:")
        p(str(res.error))
    sys.stdout.flush()

