"""Outputs of a bench run: JSON, a Markdown report, a PNG plot and a README snippet; the acceptance
checks (the targets each op must meet on this machine); the bytes-moved model and the measured copy bandwidth (achieved bandwidth)."""

from __future__ import annotations

import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

H200_COPY_TBPS = 4.3  # the H200's measured device-to-device copy bandwidth (the roofline of the GPU tables)
ACCEPT_MIN_ENTRIES = 65536

# Fewest bytes an op must move per entry (each input read once, each output written once):
#   verify: slot, position, prev indices (3 x int32) + the slot's and the predecessor's 32-byte records
#           (+ eff bytes of each real-KV source)
#   write:  token, position, slot (3 x int32) + one 32-byte record store (+ eff bytes per source)
#   plan:   two req_to_token reads (int32) + four int32 outputs
BYTES_PER_ENTRY = {"verify": 12 + 64, "write": 12 + 32, "plan": 8 + 16}


def bytes_per_entry(rec) -> int:
    sc = rec["scenario"]
    b = BYTES_PER_ENTRY[rec["op"]]
    if rec["op"] != "plan" and sc["num_sources"]:
        eff = 16 if sc["real_kv_mode"] == "PARTIAL" else sc["kv_bytes_per_token"]
        b += eff * sc["num_sources"]
    return b


def copy_bandwidth(platform: str, mib=None) -> dict:
    """Bytes read + written per second by a jitted elementwise pass over a large buffer."""
    n = ((mib or (2048 if platform == "gpu" else 64)) << 20) // 4
    x = jnp.arange(n, dtype=jnp.uint32)
    f = jax.jit(lambda a: a + jnp.uint32(1), donate_argnums=(0,))
    x = f(x).block_until_ready()
    x = f(x).block_until_ready()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(5):
            x = f(x)
        x.block_until_ready()
        ts.append((time.perf_counter() - t0) / 5)
    t = statistics.median(ts)
    return {"bytes": 2 * 4 * n, "median_s": t, "GBps": 2 * 4 * n / t / 1e9,
            "how": "jit(a + 1) on a donated uint32 buffer, read + write bytes"}


def annotate_bandwidth(out: dict) -> None:
    copy = out.get("copy_bandwidth", {}).get("GBps")
    gpu = out["meta"]["platform"] == "gpu"
    for rec in out.get("sweep", []) + out.get("matrix", []):
        b = bytes_per_entry(rec)
        rec["bytes_per_entry"] = b
        for c in rec["contenders"].values():
            if c["entries_per_s"]:
                gbps = c["entries_per_s"] * b / 1e9
                c["achieved_GBps"] = gbps
                if copy:
                    c["of_measured_copy_bw"] = gbps / copy
                if gpu:
                    c["of_h200_4.3TBps"] = gbps / (H200_COPY_TBPS * 1e3)


# ---- acceptance -----------------------------------------------------------------------------------

def _r(rec, num, den):
    return rec.get("ratios", {}).get(num, {}).get(f"vs_{den}")


WRITE_VS_C = 0.8             # write: at least this fraction of the plain C chain loop's speed
WRITE_DECODE_VS_C = 0.9      # a decode batch's write inside a compiled step: likewise
VERIFY_VS_C_READ = 1.0       # verify of >= VERIFY_BIG_ENTRIES: at least the C read loop's speed
VERIFY_BIG_ENTRIES = 1 << 20
VERIFY_SCALING = 1.7         # verify on 2 cores: at least this speed-up over one thread
STEP_ON_OFF = 1.05           # a serving step of a realistic model size: canary on / off at most this
STEP_REALISTIC_D_MODEL = 1024  # steps of at least this d_model count as realistic


def acceptance(out: dict, platform: str) -> dict:
    checks = []
    sweep = out.get("sweep", [])
    big = [r for r in sweep if r["entries"] >= ACCEPT_MIN_ENTRIES]
    for rec in big:
        n = rec["entries"]
        if rec["op"] == "verify":
            v = _r(rec, "ffi", "gather")
            if v is not None:
                checks.append({"what": f"verify n={n}: ffi / jitted gather >= 1", "value": round(v, 3), "ok": v >= 1.0})
            v = _r(rec, "ffi", "c_read")
            if v is not None:
                checks.append({"what": f"verify n={n}: ffi / native C read loop >= 0.5", "value": round(v, 3),
                               "ok": v >= 0.5})
        if rec["op"] == "write":
            v = _r(rec, "ffi", "c_write_chain")
            if v is not None:
                checks.append({"what": f"write n={n}: ffi / native C chain loop >= 0.5", "value": round(v, 3),
                               "ok": v >= 0.5})
    for rec in out.get("matrix", []):
        v = _r(rec, "ffi", "c_read") if rec["op"] == "verify" else None
        if v is not None and rec["entries"] >= VERIFY_BIG_ENTRIES:
            checks.append({"what": f"verify n={rec['entries']} ({rec['scenario']['name']}): ffi / native C "
                                   f"read loop >= {VERIFY_VS_C_READ}", "value": round(v, 3),
                           "ok": v >= VERIFY_VS_C_READ})
    for r in out.get("targets", []):
        if r["target"] in ("write_chain", "write_decode") and r["ffi_over_c"] is not None:
            least = WRITE_VS_C if r["target"] == "write_chain" else WRITE_DECODE_VS_C
            what = (f"write 1 x {r['tokens']} tokens: ffi / native C chain loop >= {least}"
                    if r["target"] == "write_chain" else
                    f"write {r['requests']} decode requests (cost inside jit): ffi / native C chain loop >= {least}")
            checks.append({"what": what, "value": round(r["ffi_over_c"], 3), "ok": r["ffi_over_c"] >= least})
        if r["target"] == "verify_scaling" and (r["cpu_count"] or 1) >= 2:
            checks.append({"what": f"verify {r['entries']} entries: thread pool / one thread >= {VERIFY_SCALING}",
                           "value": round(r["speedup"], 3), "ok": r["speedup"] >= VERIFY_SCALING})
        if r.get("violations_recorded"):
            checks.append({"what": f"clean path in {r['target']}", "value": r["violations_recorded"], "ok": False})
    for s in out.get("step", []):
        if s["model"]["d_model"] >= STEP_REALISTIC_D_MODEL:
            checks.append({"what": f"serving step {s['model']['layers']}x{s['model']['d_model']} bs={s['bs']} "
                                   f"prefix={s['prefix']}: canary on / off <= {STEP_ON_OFF}",
                           "value": round(s["on_over_off"], 3), "ok": s["on_over_off"] <= STEP_ON_OFF})
    rows = {}
    for rec in sweep + out.get("matrix", []):
        for k, v in rec.get("violations_recorded", {}).items():
            rows[k] = rows.get(k, 0) + v
        if rec.get("c_write_chain_records_match_ffi") is False:
            checks.append({"what": f"C chain loop wrote the same records as ffi ({rec['scenario']['name']})",
                           "value": False, "ok": False})
    for s in out.get("step", []):
        rows["step"] = rows.get("step", 0) + s["violations_recorded"]
    if rows:
        checks.append({"what": "clean path: no violation row recorded while timing", "value": rows,
                       "ok": not any(rows.values())})
    if out["meta"]["mode"] == "quick":
        el = out["meta"].get("elapsed_s")
        if el is None:
            el = round(time.time() - time.mktime(time.strptime(out["meta"]["started"], "%Y-%m-%dT%H:%M:%S")), 1)
        checks.append({"what": "--quick finished in under 180 s", "value": el, "ok": el < 180})
    return {"checks": checks, "all_ok": all(c["ok"] for c in checks)}


def _targets_lines(targets):
    L = ["| case | ours | baseline | ratio | target |", "|---|---:|---:|---:|---|"]
    for r in targets:
        if r["target"] == "write_chain":
            L.append(f"| write, 1 request x {r['tokens']} tokens (one serial chain) | "
                     f"{r['ffi_entries_per_s'] / 1e6:.1f} M/s | C chain loop {r['c_entries_per_s'] / 1e6:.1f} M/s | "
                     f"{_x(r['ffi_over_c'])} | >= {WRITE_VS_C} |")
        elif r["target"] == "write_decode":
            L.append(f"| write, {r['requests']} decode requests, cost inside a compiled step | "
                     f"{r['ffi_us_per_launch']:.2f} us/launch | C chain loop {r['c_us_per_launch']:.2f} us | "
                     f"{_x(r['ffi_over_c'])} | >= {WRITE_DECODE_VS_C} |")
        elif r["target"] == "verify_scaling":
            L.append(f"| verify, {r['entries']} entries, XLA's thread pool vs one thread ({r['cpu_count']} cores) | "
                     f"{r['pool_entries_per_s'] / 1e6:.1f} M/s | one thread {r['one_thread_entries_per_s'] / 1e6:.1f} M/s "
                     f"| {_x(r['speedup'])} (fastest rounds {_x(r.get('speedup_fastest'))}) "
                     f"| >= {VERIFY_SCALING} (2+ cores) |")
    return L


# ---- Markdown ----------------------------------------------------------------------------------------

def _m(x):
    return "-" if x is None else f"{x / 1e6:.2f}"


def _x(x):
    return "-" if x is None else f"{x:.2f}"


SWEEP_ORDER = ["ffi", "xla", "reference", "gather", "scatter", "cumsum_gather", "c_read", "c_read_prefetch",
               "c_verify_mix3", "c_write_chain"]


def _sweep_table(recs, op):
    recs = [r for r in recs if r["op"] == op]
    if not recs:
        return []
    names = [n for n in SWEEP_ORDER if any(n in r["contenders"] for r in recs)]
    ratio_cols = [n for n in names if any(r["contenders"].get(n, {}).get("kind") == "baseline" for r in recs)]
    head = ["entries"] + [f"{n} M/s" for n in names] + [f"ffi/{n}" for n in ratio_cols]
    if any("xla" in r["contenders"] for r in recs) and recs[0]["baseline"] in ratio_cols:
        head.append(f"xla/{recs[0]['baseline']}")
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in recs:
        c = r["contenders"]
        row = [str(r["entries"])] + [_m(c.get(n, {}).get("entries_per_s")) for n in names]
        row += [_x(r["ratios"].get("ffi", {}).get(f"vs_{n}")) for n in ratio_cols]
        if f"xla/{recs[0]['baseline']}" in head:
            row.append(_x(r["ratios"].get("xla", {}).get(f"vs_{recs[0]['baseline']}")))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _matrix_table(recs):
    by = {}
    for r in recs:
        by.setdefault(r["scenario"]["name"], {})[r["op"]] = r
    head = ["scenario", "verify entries", "verify ffi M/s", "ffi/gather", "ffi/c_read", "write entries",
            "write ffi M/s", "ffi/scatter", "ffi/c_chain", "plan ffi M/s", "ffi/cumsum_gather", "verify ffi us"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for name, ops in by.items():
        v, w, p = ops.get("verify"), ops.get("write"), ops.get("plan")
        vf = v["contenders"].get("ffi", {}) if v else {}
        lines.append("| " + " | ".join([
            name, str(v["entries"]) if v else "-", _m(vf.get("entries_per_s")),
            _x(_r(v, "ffi", "gather")) if v else "-", _x(_r(v, "ffi", "c_read")) if v else "-",
            str(w["entries"]) if w else "-", _m(w["contenders"].get("ffi", {}).get("entries_per_s")) if w else "-",
            _x(_r(w, "ffi", "scatter")) if w else "-", _x(_r(w, "ffi", "c_write_chain")) if w else "-",
            _m(p["contenders"].get("ffi", {}).get("entries_per_s")) if p else "-",
            _x(_r(p, "ffi", "cumsum_gather")) if p else "-",
            f"{vf['median_s'] * 1e6:.0f}" if vf else "-"]) + " |")
    return lines


def _bw_table(recs):
    lines = ["| op | scenario | entries | bytes/entry | contender | GB/s | of measured copy | of 4.3 TB/s |",
             "|---|---|---:|---:|---|---:|---:|---:|"]
    for r in recs:
        for n, c in r["contenders"].items():
            if "achieved_GBps" in c:
                lines.append(f"| {r['op']} | {r['scenario']['name']} | {r['entries']} | {r['bytes_per_entry']} | {n} | "
                             f"{c['achieved_GBps']:.1f} | {c.get('of_measured_copy_bw', 0):.3f} | "
                             f"{c.get('of_h200_4.3TBps', 0):.4f} |")
    return lines


def _la(x):
    return "-" if not x else "/".join(f"{v:.1f}" for v in x)


def markdown(out: dict) -> str:
    m = out["meta"]
    scaling = next((t for t in out.get("targets", []) if t["target"] == "verify_scaling"), None)
    L = [f"# jax_kvcanary benchmark — {m['platform']} — {m['date']} ({m['mode']})", "",
         f"Command: `{m['command']}` (from the repository root, `PYTHONPATH=.`)", "",
         f"Machine: {m['cpu']}, {m['affinity_cpus']} usable of {m['cpu_count']} cores, {m['mem_gib']} GiB; "
         f"load average at start {_la(m.get('loadavg_at_start'))}, at end {_la(m.get('loadavg_at_end'))} "
         f"(other jobs share the machine: see the spreads in the JSON); devices {m['devices']}.  ",
         f"Versions: Python {m['python']}, jax {m['jax']}, jaxlib {m['jaxlib']}, numpy {m['numpy']}, "
         f"jax_kvcanary {m['jax_kvcanary']} (git {m['git_commit']}); native platforms {m['native_platforms']}; "
         f"x64 {'on' if m['x64'] else 'off'}.  ",
         f"Backends timed: {', '.join(m['backends'])}. "
         + (f"Native baselines: {m['native_baselines']['compiler_version']} `{m['native_baselines']['flags']}`. "
            if m.get("native_baselines") else "")
         + f"Copy bandwidth measured in this run: {out['copy_bandwidth']['GBps']:.1f} GB/s.", "",
         f"Method: warm-up (compile + 2 calls), calibrated reps per round (~{m['target_s_per_round'] * 1e3:.0f} ms), "
         f"{m['rounds']} interleaved rounds ({m.get('step_rounds', m['rounds'])} of ~"
         f"{m.get('step_target_s_per_round', m['target_s_per_round']) * 1e3:.0f} ms for the serving steps"
         + (f", {scaling['rounds']} for the thread-pool scaling" if scaling else "")
         + ") with "
         "rotating order, `block_until_ready`, donated state, Python's garbage collector off while timing; "
         "times are medians over rounds, ratios are medians of per-round ratios (throughput of the first over "
         "the second). "
         + (f"Serving steps timed in a process of their own (bench/step_process.py), host allocator there: "
            f"{m['step_host_allocator']} (bench/host_memory.py); the other sections with glibc's defaults. "
            if m.get("step_host_allocator") else "")
         + f"Elapsed {m.get('elapsed_s')} s.", ""]
    if out["notes"]:
        L += ["Notes:", ""] + [f"- {n}" for n in out["notes"]] + [""]
    L += ["Scenarios: paged pool (page 16, 1.25x slack, page 0 reserved), each request's pages drawn from a "
          "random permutation of the pool; the canary is populated by a real `write` of every prefix token, so "
          "verify takes the clean path (no rows). Native C baselines run on the same JAX buffers (raw pointers). "
          "`c_read` reads both 32-byte records per entry without hashing; `c_read_prefetch` adds a software "
          "prefetch; `c_verify_mix3` adds the predecessor's mix3 and the compares (verify-equivalent work); "
          "`c_write_chain` is the serial mix3 chain + record stores.", ""]
    acc = out.get("acceptance")
    if acc and acc["checks"]:
        L += ["## Acceptance", ""] + [f"- {'PASS' if a['ok'] else 'FAIL'} — {a['what']}: {a['value']}"
                                      for a in acc["checks"]] + [""]
    if out.get("sweep"):
        L += ["## Per-op throughput (M entries/s), bs=32", ""]
        for op, desc in (("verify", "verify: 32 requests x prefix P"), ("write", "write: 32 requests x E new tokens "
                                                                                 "after a 64-token prefix"),
                         ("plan", "plan: 32 requests x prefix P")):
            t = _sweep_table(out["sweep"], op)
            if t:
                L += [f"### {desc}", ""] + t + [""]
    if out.get("matrix"):
        L += ["## Scenario matrix (ffi)", ""] + _matrix_table(out["matrix"]) + [""]
    if out.get("dispatch"):
        d = out["dispatch"]
        L += ["## Per-call overhead inside jit", "",
              f"Slope of the jitted step time over N chained calls (N = {d['chain_lengths']}); tiny inputs.", "",
              "| op | per call (us) | intercept (us) |", "|---|---:|---:|"]
        for k, v in d["ops"].items():
            L.append(f"| {k} | {v['per_call_us']:.2f} | {v['intercept_us']:.1f} |")
        L.append("")
    if out.get("targets"):
        L += ["## The serving path's hot cases (CPU)", ""] + _targets_lines(out["targets"]) + [""]
    if out.get("step"):
        s0 = out["step"][0]
        L += ["## Canary overhead in a jitted serving step", "",
              "A decoder step (per layer: q/k/v projections, K/V stores at `out_cache_loc`, attention over the "
              "prefix gathered through `req_to_token`, output projection; then the logits), one decode token per "
              f"request, donated KV and canary state; canary via {s0['canary']}: {s0['launches']}. "
              "`canary only` runs the same canary launches on the same state without the model; "
              "`canary cost` = on - off. on/off is the median of per-round ratios; on/off (min) the ratio of the "
              "fastest rounds (interference only adds time); the JSON keeps every round.", "",
              "| layers x d_model | bs | prefix | off (ms) | on (ms) | on/off | on/off (min) | canary cost (ms) | "
              "canary only (ms) | launches | verified entries | fingerprint bytes |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for s in out["step"]:
            md = s["model"]
            L.append(f"| {md['layers']} x {md['d_model']} | {s['bs']} | {s['prefix']} | {s['off_ms']:.2f} | "
                     f"{s['on_ms']:.2f} | {s['on_over_off']:.3f} | {s.get('on_over_off_min', float('nan')):.3f} | "
                     f"{s['on_ms'] - s['off_ms']:.2f} | "
                     f"{s['canary_only_ms']:.2f} | {s['launches_per_step']} | {s['verified_entries_per_step']} | "
                     f"{s['fingerprint_bytes_per_step']} |")
        L += ["", _step_cost_lines(out)]
    if out.get("offload"):
        from .offload import markdown as offload_markdown
        L += offload_markdown(out["offload"])
    if m["platform"] == "gpu" and (out.get("sweep") or out.get("matrix")):
        L += ["## Achieved bandwidth", "", "Bytes per entry: the fewest an op must move (see bench/report.py).", ""]
        L += _bw_table(out.get("sweep", []) + out.get("matrix", [])) + [""]
    return "\n".join(L) + "\n"


def snippet(out: dict, md_name: str) -> str:
    m = out["meta"]
    L = [f"### Benchmarks ({m['platform']}, {m['date']})", "",
         f"`{m['command']}` on {m['cpu']} ({m['affinity_cpus']} cores, shared), jax {m['jax']}. "
         f"Full report: `bench/results/{md_name}`. Entries/s are medians; ratios are interleaved per-round "
         "medians (ffi throughput over the baseline's).", ""]
    sweep = out.get("sweep", [])
    if sweep:
        L += ["| op | entries | ffi (M entries/s) | vs jitted XLA baseline | vs native C loop | xla (M/s) |",
              "|---|---:|---:|---:|---:|---:|"]
        for op in ("verify", "write", "plan"):
            recs = [r for r in sweep if r["op"] == op]
            if not recs:
                continue
            picks = [r for r in recs if r["entries"] >= ACCEPT_MIN_ENTRIES] or recs[-1:]
            picks = [picks[0], picks[-1]] if len(picks) > 1 else picks
            for r in picks:
                base, lim = r["baseline"], r.get("native_limit")
                xr = r["contenders"].get("xla", {}).get("entries_per_s")
                L.append(f"| {op} | {r['entries']} | {_m(r['contenders'].get('ffi', {}).get('entries_per_s'))} | "
                         f"{_x(_r(r, 'ffi', base))} ({base}) | "
                         + (f"{_x(_r(r, 'ffi', lim))} ({lim})" if lim else "-") + f" | {_m(xr)} |")
        L.append("")
    if out.get("targets"):
        L += _targets_lines(out["targets"]) + [""]
    if out.get("step"):
        L += ["Canary on vs off in a jitted decode step (plan + HEAD/TAIL verify+write of K and V, real-KV "
              "PARTIAL; median of per-round ratios, then in brackets the fastest rounds' ratio and the canary's "
              "launches alone, timed on the same state without the model, against the step off: on a shared "
              "machine the on/off ratio of a long step varies more than the canary costs): "
              + ", ".join(f"{s['model']['layers']}x{s['model']['d_model']} bs={s['bs']} prefix={s['prefix']}: "
                          f"{s['on_over_off']:.3f}x (min {s.get('on_over_off_min', float('nan')):.3f}x; "
                          f"{s['canary_only_ms']:.2f} ms of {s['off_ms']:.1f} ms)"
                          for s in out["step"]) + ".", ""]
    if out.get("dispatch"):
        d = out["dispatch"]["ops"]
        parts = [f"{k} {v['per_call_us']:.1f} us" for k, v in d.items()]
        L += ["Per-call cost inside jit (slope over chained calls): " + ", ".join(parts) + ".", ""]
    if out.get("offload"):
        L += ["Host check of an offloaded KV copy (bytes/s over a plain host memcpy of the same bytes): "
              + ", ".join(f"{r['mode']} {r['slots']} slots x {r['token_bytes']} B: {r['check_over_memcpy']:.3f}"
                          for r in out["offload"]) + ".", ""]
    return "\n".join(L) + "\n"


# ---- plot ----------------------------------------------------------------------------------------------

def plot(out: dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sweep = out.get("sweep", [])
    ops = [op for op in ("verify", "write", "plan") if any(r["op"] == op for r in sweep)]
    if not ops:
        return False
    fig, axes = plt.subplots(2, len(ops), figsize=(5.2 * len(ops), 8), squeeze=False)
    for j, op in enumerate(ops):
        recs = sorted([r for r in sweep if r["op"] == op], key=lambda r: r["entries"])
        names = [n for n in SWEEP_ORDER if any(n in r["contenders"] for r in recs)]
        ax = axes[0][j]
        for n in names:
            pts = [(r["entries"], r["contenders"][n]["entries_per_s"]) for r in recs if n in r["contenders"]]
            kind = next(r["contenders"][n]["kind"] for r in recs if n in r["contenders"])
            ax.plot(*zip(*pts), marker="o", linestyle="-" if kind == "backend" else "--", label=n)
        ax.set_xscale("log"); ax.set_yscale("log")
        ax.set_title(f"{op}: throughput"); ax.set_xlabel("entries"); ax.set_ylabel("entries / s")
        ax.grid(True, which="both", alpha=0.3); ax.legend(fontsize=8)
        ax = axes[1][j]
        for b in ("ffi", "xla"):
            for other in names:
                if other in ("ffi", "xla", "reference"):
                    continue
                pts = [(r["entries"], r["ratios"].get(b, {}).get(f"vs_{other}")) for r in recs]
                pts = [p for p in pts if p[1] is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o", linestyle="-" if b == "ffi" else ":", label=f"{b} / {other}")
        ax.axhline(1.0, color="k", lw=0.8); ax.axhline(0.5, color="gray", lw=0.8, ls="--")
        ax.set_xscale("log"); ax.set_yscale("log")
        ax.set_title(f"{op}: throughput ratio"); ax.set_xlabel("entries"); ax.set_ylabel("ratio")
        ax.grid(True, which="both", alpha=0.3); ax.legend(fontsize=7)
    m = out["meta"]
    fig.suptitle(f"jax_kvcanary {m['platform']} {m['date']} ({m['mode']}) — {m['cpu']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _step_cost_lines(out: dict) -> str:
    """Where the canary's cost in a step goes, from this run's figures."""
    steps = [s for s in out["step"] if s["verified_entries_per_step"]]
    ns = [s["canary_only_ms"] * 1e6 / s["verified_entries_per_step"] for s in steps] or [float("nan")]
    calls = [v["per_call_us"] for k, v in out.get("dispatch", {}).get("ops", {}).items() if k.endswith("[ffi]")]
    s0 = out["step"][0]
    launch = (f"{s0['launches_per_step']} launches per step at {min(calls):.1f}-{max(calls):.1f} us each inside jit "
              f"(the dispatch section), about {s0['launches_per_step'] * max(calls) / 1e3:.3f} ms a step whatever its size"
              if calls else f"{s0['launches_per_step']} launches per step")
    return ("Where the canary's cost goes: " + launch + "; HEAD and TAIL each verify the whole prefix of K and V "
            "(verified entries = 2 endpoints x 2 halves x bs x prefix), and the TAIL endpoints fold "
            "16 bytes of layer-0 K and V per verified or written slot into fingerprints (fingerprint bytes). "
            f"`canary only` per verified entry: {min(ns):.1f}-{max(ns):.1f} ns over these steps, so the cost "
            "follows bs x prefix (the KV the step reads), not the model's size; the on/off ratio falls as the model "
            "grows.")


def write_all(out: dict, out_dir: str, stem: str):
    annotate_bandwidth(out)
    paths = []
    p = os.path.join(out_dir, stem + ".json")
    with open(p, "w") as f:
        json.dump(out, f, indent=1, default=json_default)
    paths.append(p)
    p = os.path.join(out_dir, stem + ".md")
    with open(p, "w") as f:
        f.write(markdown(out))
    paths.append(p)
    p = os.path.join(out_dir, stem + ".png")
    if plot(out, p):
        paths.append(p)
    else:
        out["notes"].append("matplotlib not available: no PNG")
    p = os.path.join(out_dir, "README_snippet.md")
    with open(p, "w") as f:
        f.write(snippet(out, stem + ".md"))
    paths.append(p)
    return paths


def json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)
