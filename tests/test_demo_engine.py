"""End to end on the demo's toy engine: every fault kind is detected (tag, reason, slot, within two
steps); clean runs are silent with and without SWA, with prefix sharing and sweeps; raise mode."""

import re

import pytest

from jax_kvcanary.consts import LaunchTag as T
from jax_kvcanary.runtime import CanaryConfig, CanaryViolationError
from jax_kvcanary.demo import EngineConfig, ToyEngine
from jax_kvcanary.demo.kvpool import PrefixCache

INJECT_STEP = 10


def make(swa=True, mode="log", sweep_interval=4, **kw):
    ccfg = CanaryConfig(mode=mode, groups=("FULL", "SWA") if swa else ("FULL",),
                        swa_window_size=16 if swa else 0, sweep_interval=sweep_interval,
                        write_input_assert=True, **kw)
    eng = ToyEngine(EngineConfig(swa=swa), ccfg)
    eng.warmup()
    return eng


def serve(eng, steps):
    out = []
    for _ in range(steps):
        out += eng.iterate()
    return out + eng.monitor.flush()


@pytest.mark.parametrize("swa, kw", [(True, {}), (False, {}), (True, dict(token_check=True))],
                         ids=["swa", "full-only", "swa-token-check"])
def test_clean_run_is_silent(swa, kw):
    eng = make(swa=swa, **kw)
    assert serve(eng, 40) == []
    assert eng.done and eng.monitor.total == 0
    assert eng.tokens_cached > 0 and eng.remaps > 0           # prefix sharing, donor remaps
    assert eng.sweeps == 10 and eng.sweep_entries > 0
    runs = eng.monitor.counters.kernel_runs[0]
    for t in eng.canary.expected_tags():                     # every watched tag ran
        assert runs[t] > 0
    if not swa:
        assert runs[T.HEAD_K_SWA] == runs[T.SWEEP_K_SWA] == 0


def run_fault(kind, group="FULL", steps=INJECT_STEP + 8, **kw):
    eng = make(swa=True, **kw)
    eng.arm(kind, INJECT_STEP, group=group)
    vs = serve(eng, steps)
    assert eng.fault is not None, f"no target found for {kind}"
    fstep, fault = eng.fault
    assert vs, "nothing reported"
    first = min(v.step for v in vs)
    assert first > fstep                                     # nothing before the fault
    hits = [v for v in vs if fault.matches(v)]
    assert hits and hits[0].step - fstep <= 2, (fstep, [(v.step, v.tag_name, v.reasons) for v in vs])
    return eng, fstep, fault, vs


@pytest.mark.parametrize("group", ["FULL", "SWA"])
def test_req_to_token_swap(group):
    eng, fstep, fault, vs = run_fault("req_to_token_swap", group)
    first = [v for v in vs if v.step == fstep + 1]
    g_tags = {t for t in fault.expected_tags}
    assert {v.tag for v in first if "verify_chain_hash" in v.reasons} >= g_tags
    # the swapped-in slot is reported at the corrupted position's entry (stored position differs)
    at_slot = [v for v in first if v.slot == fault.slot]
    assert at_slot and all("verify_position" in v.reasons for v in at_slot)
    assert all(set(v.reasons) <= {"verify_chain_hash", "verify_position"} for v in vs)


@pytest.mark.parametrize("kind, group, tag", [
    ("real_kv_used", "FULL", T.TAIL_K_FULL), ("real_kv_used", "SWA", T.TAIL_K_SWA),
    ("real_kv_post_forward", "FULL", T.TAIL_K_FULL), ("real_kv_post_forward", "SWA", T.TAIL_K_SWA),
    ("real_kv_unused_cache", "FULL", T.SWEEP_K_FULL), ("real_kv_unused_cache", "SWA", T.SWEEP_K_SWA),
])
def test_real_kv_flips(kind, group, tag):
    eng, fstep, fault, vs = run_fault(kind, group)
    first = [v for v in vs if v.step == min(x.step for x in vs)]
    # one row per request attending to the slot (a shared prefix slot is in several requests)
    assert {(v.tag, v.slot, v.position, v.reasons) for v in first} == {
        (int(tag), fault.slot, fault.position, ("verify_real_kv_hash",))}
    lag = first[0].step - fstep
    assert lag == (2 if kind == "real_kv_post_forward" else 1)
    # only the K half's fingerprint sees it, and only at that slot
    assert all(v.tag_name.split("_")[1] == "K" and v.slot == fault.slot and
               v.reasons == ("verify_real_kv_hash",) for v in vs)


def test_swa_evicted_in_window():
    eng, fstep, fault, vs = run_fault("swa_evicted_in_window", "SWA")
    first = [v for v in vs if v.step == fstep + 1]
    assert {v.tag for v in first} == {int(t) for t in fault.expected_tags}
    # one out-of-range row per watched SWA tag: slot -1 at the evicted position; the only other
    # rows are the writes of the token after it, whose chain seed is now slot 0
    assert {(v.slot, v.position, v.reasons) for v in first if v.slot == -1} == {
        (-1, fault.position, ("index_out_of_range",))}
    assert all(v.slot == -1 or (v.position, v.reasons) == (fault.position + 1, ("write_position",))
               for v in first)


def test_next_token_swap():
    eng, fstep, fault, vs = run_fault("next_token_swap")
    assert {v.step for v in vs} == {fstep + 2}
    assert all(v.reasons == ("write_token",) for v in vs)     # no KV-side reason
    assert {v.tag for v in vs} == {int(t) for t in fault.expected_tags}
    assert len(vs) == 2 * len(fault.expected_tags)            # both swapped tokens, every write


def test_raise_mode():
    eng = make(mode="raise")
    eng.arm("real_kv_used", INJECT_STEP)
    with pytest.raises(CanaryViolationError) as e:
        serve(eng, INJECT_STEP + 4)
    fstep, fault = eng.fault
    assert eng.step_no == fstep + 1
    assert {(v.tag, v.slot) for v in e.value.violations} == {(int(T.TAIL_K_FULL), fault.slot)}
    assert str(e.value).startswith("kv_canary violation: launch_tag=TAIL_K_FULL "
                                   "fail_reason=verify_real_kv_hash ")
    assert eng.monitor.step(eng.cstate) == []                 # nothing more after raising


def test_engine_step_is_device_only_and_flag_switch_does_not_recompile():
    eng = make()
    db = eng._device_batch(eng.warmup_batch())
    hlo = eng.step_on.lower(eng.rep, eng.sh, eng.kv, eng.cstate, db).compile().as_text()
    targets = set(re.findall(r'custom_call_target="([^"]+)"', hlo))
    assert targets and all(t.startswith("kvcanary_") for t in targets), targets
    assert not re.search(r"\b(outfeed|infeed|send|recv)\(", hlo)
    n = eng.step_on._cache_size()
    serve(eng, 3)                                  # serving after warm-up: flag back on
    assert eng.cstate.log.chain_position_assert_enabled()
    assert eng.step_on._cache_size() == n


def test_warmup_with_chain_assert_on_would_report():
    """Why the flag is off during warm-up: the synthetic warm-up batch breaks the +1 rule."""
    eng = make()
    eng.warmup(chain_assert_during_warmup=True)
    rows = eng.cstate.log.rows()
    assert len(rows) and {int(r[7]) for r in rows} == {16}   # write_position only


def test_prefix_cache_chains():
    pc = PrefixCache()
    pc.insert([7, 8, 9], [3, 4, 5])
    nodes = pc.insert([7, 8, 1], [6, 7, 8])      # shares 7, 8 (donor slots 3, 4)
    assert [n.slot for n in nodes] == [3, 4, 8]
    assert pc.chains().tolist() == [[3, 0, -1], [4, 1, 3], [5, 2, 4], [8, 2, 4]]
    assert [n.slot for n in pc.match([7, 8, 2])] == [3, 4]
