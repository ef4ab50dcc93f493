"""End to end: the canary installed into a real sglang-jax engine (in process, on the CPU).

One tiny random-weight Qwen2 engine (``sglang_jax_tiny.TinyEngine``) serves a workload with shared
prefixes (prefill, prefix-cache hits, decode) and one with a chunked prefill, with the canary off
and on, then with one fault at a time injected into sglang-jax's own structures (its
``req_to_token`` pool, its allocator's free list, its fused KV buffer, the positions of its batch). Each fault must be reported by the
monitor with the expected tag and reason at most two steps after the step it was injected before.
"""

import os

import numpy as np
import pytest

from tests.support import sglang_jax_tiny as tiny
from tests.support.sglang_server import installed_sglang_jax

pytestmark = pytest.mark.integration
if installed_sglang_jax() != "0.0.2":
    pytest.skip("these in-process tests drive sglang-jax 0.0.2's ModelWorker (pip install "
                "'jax_kvcanary[sglang-jax]'); sglang-jax main is tested through its HTTP server "
                "(test_sglang_jax_server.py)", allow_module_level=True)
tiny.set_flax_env()                                  # before sgl_jax imports flax
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import sgl_jax  # noqa: E402,F401  (a broken install fails here, it does not skip)

import jax  # noqa: E402

from jax_kvcanary import LaunchTag  # noqa: E402
from jax_kvcanary.integrations import sglang_jax as kvc_sgl  # noqa: E402
from jax_kvcanary.runtime import CanaryConfig, CanaryViolationError, Monitor  # noqa: E402
from jax_kvcanary.runtime import REPORT_LINE_RE  # noqa: E402

CONFIG = CanaryConfig(mode="log", real_kv_hash_mode="PARTIAL", sweep_interval=2)


@pytest.fixture(scope="module")
def engine():
    eng = tiny.TinyEngine()
    eng.reference = eng.run(tiny.shared_prefix_workload())        # canary off
    eng.canary = kvc_sgl.SglangJaxCanary(eng.runner, CONFIG, tree_cache=eng.tree_cache)
    yield eng
    eng.canary.uninstall()


def serve(eng, workload=None, **hooks):
    """Reset the engine and the canary, serve the workload (default: the shared-prefix one) with
    the canary on; returns ``(outputs, canary)`` after the monitor's final readback."""
    eng.reset()
    c = eng.canary
    c.reset()
    c.install()
    try:
        out = eng.run(workload or tiny.shared_prefix_workload(), **hooks)
    finally:
        c.uninstall()
    c.flush()
    return out, c


def flip_kv_byte(eng, slot, offset=0):
    """XOR byte ``offset`` of ``slot``'s row in layer 0's fused KV buffer with 0xFF (offset 0:
    the first byte of K head 0)."""
    kv0 = eng.kv_buffer[0]
    arr = np.array(kv0)
    arr.reshape(arr.shape[0], -1).view(np.uint8)[slot, offset] ^= 0xFF
    eng.kv_buffer[0] = jax.device_put(arr, kv0.sharding)


def decode_fault(inject, *, min_running=1, canary=None):
    """``(before_step hook, done)``: the hook runs ``inject(engine, running_batch)`` once, before
    the first decode step from engine step 3 on with at least ``min_running`` running requests;
    ``done`` then holds ``step`` (the canary step the fault precedes) and ``slot`` (what
    ``inject`` returned: the slot it damaged, or None)."""
    done = {}

    def before(eng, running, due):
        if done or due or running is None or len(running.reqs) < min_running or eng.step_no < 3:
            return None
        done["slot"] = inject(eng, running)
        done["step"] = (canary or eng.canary).steps + 1
        return None
    return before, done


def assert_detected(c, injected_step, tag, reason):
    hits = [v for v in c.monitor.violations if v.tag_name == tag and reason in v.reasons]
    seen = sorted({(v.tag_name, r) for v in c.monitor.violations for r in v.reasons})
    assert hits, f"no {tag} {reason} row; the monitor reported {seen}"
    first = min(v.step for v in hits)
    assert first - injected_step <= 2, (
        f"{tag} {reason} reported at step {first}, fault injected before step {injected_step}")
    assert REPORT_LINE_RE.match(hits[0].report.splitlines()[0]), hits[0].report
    print(f"\n{tag} {reason}: injected before step {injected_step}, first reported at step "
          f"{first}; all reported (tag, reason): {seen}\n{hits[0].report}")
    return hits


def test_clean_run_no_violation_same_tokens_no_recompile(engine):
    out, c = serve(engine)
    assert out == engine.reference                  # the canary does not change generation
    assert c.monitor.violations == []
    counters = c.monitor.counters
    for tag in CONFIG.expected_tags():                # every endpoint ran and verified something
        assert counters.kernel_runs[0, tag] > 0
        assert counters.verified[0, tag] > 0, tag.name
    assert c.sweeps >= 3 and c.monitor.health.checks >= 1
    # the checks run in the engine's own program (fused), compiled once per engine bucket
    # (EXTEND and DECODE), however many steps; the separate launch is never compiled
    assert c.fused and c._fused[1]._cache_size() == 2 and c._check_fn._cache_size() == 0
    out2, c = serve(engine)
    assert out2 == engine.reference and c._fused[1]._cache_size() == 2


def test_canary_state_donated_and_kv_read_in_place(engine):
    """The step's one program (the engine's model call and the canary's checks) aliases every
    canary state buffer and every layer's KV buffer to its outputs (both donated, no copy), and
    the canary reads layer 0's KV in place; the separate launch (kept for runners whose jit
    cannot be wrapped) aliases the canary state and reads the KV in place too."""
    import re

    from sgl_jax.srt.layers.logits_processor import LogitsMetadata
    from sgl_jax.srt.model_executor.forward_batch_info import ForwardBatch

    from jax_kvcanary.integrations.sglang_jax.layout import step_arrays

    engine.reset()
    c = engine.canary
    c.reset()
    batch = engine.prefill([tiny.Request("d", list(range(3, 30)), 4)])
    batch.prepare_for_decode()
    mwb = batch.get_model_worker_batch(*engine.paddings, 1)
    fb = ForwardBatch.init_new(mwb, engine.runner)
    n_state = len(jax.tree_util.tree_leaves(c.state))
    kv_shape = "f32[" + ",".join(map(str, engine.kv_buffer[0].shape)) + "]"
    aot, step = c._fused
    hlo = step.lower(aot.leaves(), fb, c.layout.donated_pool(),
                     LogitsMetadata.from_model_worker_batch(mwb, engine.runner.mesh), c.state,
                     {}).compile().as_text()
    header = hlo.splitlines()[0]
    n_kv = len(jax.tree_util.tree_leaves(c.layout.donated_pool()))
    assert len(re.findall(r"may-alias|must-alias", header)) == n_state + n_kv, header[:400]
    assert not re.search(re.escape(kv_shape) + r"\S* copy\(", hlo)
    hlo = c._check_fn.lower(c.state, step_arrays(fb), {"FULL": engine.kv_buffer[0]},
                            decode=True).compile().as_text()
    header = hlo.splitlines()[0]
    assert len(re.findall(r"may-alias|must-alias", header)) == n_state, header[:400]
    assert not re.search(re.escape(kv_shape) + r"\S* copy\(", hlo)


def extend_prefixes(log):
    """A ``before_step`` hook that appends each EXTEND step's prefix lengths to ``log``."""
    def before(eng, running, due):
        def record(mwb):
            if mwb.forward_mode.is_extend():
                log.append([int(x) for x in mwb.extend_prefix_lens[: mwb.real_bs]])
        return record
    return before


def test_chunked_prefill_clean_same_tokens(engine):
    """A 40-token prompt prefilled in chunks of 16 (each chunk verifies the chunks before it),
    then a request sharing its first 20 tokens hits the chunks the radix tree cached."""
    engine.reset()
    reference = engine.run(tiny.chunked_prefill_workload())          # canary off
    prefixes = []
    out, c = serve(engine, tiny.chunked_prefill_workload(), before_step=extend_prefixes(prefixes))
    assert prefixes == [[0], [16], [32], [20]]
    assert out == reference
    assert c.monitor.violations == []
    assert c.monitor.counters.verified[0, LaunchTag.HEAD_K_FULL] >= 16 + 32 + 20


def test_req_to_token_corrupted_between_chunks(engine):
    """A chunked prompt's req_to_token row is corrupted between two of its chunks (two of its
    first chunk's slots exchanged): the scheduler caches the wrong slots in the radix tree and the
    next chunk's attention reads them; the next chunk's HEAD verify of the prefix reports them."""
    done = {}

    def before(eng, running, due):
        q = eng.chunked_req
        if done or q is None:
            return None
        row = eng.req_to_token_pool.req_to_token[q.req_pool_idx]
        row[3], row[9] = row[9], row[3]
        done["step"] = eng.canary.steps + 1
        return None

    _, c = serve(engine, tiny.chunked_prefill_workload(), before_step=before)
    assert done
    hits = assert_detected(c, done["step"], "HEAD_K_FULL", "verify_position")
    assert {v.position for v in hits} >= {3, 9}


def test_req_to_token_swap_between_live_requests(engine):
    """(a) Two running requests exchange one req_to_token entry (a prefix position followed by
    another prefix position, where their tokens differ)."""
    def swap(eng, running):
        a, b = running.reqs[0], running.reqs[1]
        n = min(len(a.origin_input_ids), len(b.origin_input_ids))
        pos = next(i for i in range(n) if a.origin_input_ids[i] != b.origin_input_ids[i])
        rt = eng.req_to_token_pool.req_to_token
        assert rt[a.req_pool_idx, pos] != rt[b.req_pool_idx, pos]
        rt[a.req_pool_idx, pos], rt[b.req_pool_idx, pos] = (rt[b.req_pool_idx, pos],
                                                            rt[a.req_pool_idx, pos])

    before, done = decode_fault(swap, min_running=2)
    _, c = serve(engine, before_step=before)
    assert done, "no step had two running requests"
    assert_detected(c, done["step"], "HEAD_K_FULL", "verify_chain_hash")
    assert_detected(c, done["step"], "TAIL_K_FULL", "verify_chain_hash")


def test_slot_freed_and_reallocated_while_cached(engine):
    """(b) A slot of a cached prefix that a running request still uses goes back to the front
    of the allocator's free list (a double free); the next decode step allocates it again."""
    def double_free(eng, running):
        q = running.reqs[-1]
        slot = int(eng.req_to_token_pool.req_to_token[q.req_pool_idx, 2])
        assert slot in set(np.concatenate([n.value for n in _nodes(eng.tree_cache)]).tolist())
        eng.allocator.free_slots = np.concatenate(
            [np.array([slot], np.int32), eng.allocator.free_slots])
        return slot

    before, done = decode_fault(double_free)
    _, c = serve(engine, before_step=before)
    assert done
    hits = assert_detected(c, done["step"], "TAIL_K_FULL", "verify_position")
    assert any(v.slot == done["slot"] for v in hits)


def test_kv_byte_flip_in_used_slot(engine):
    """(c) A byte of layer 0's KV flipped in a slot a running request attends to."""
    def flip(eng, running):
        q = running.reqs[0]
        slot = int(eng.req_to_token_pool.req_to_token[q.req_pool_idx, 5])
        flip_kv_byte(eng, slot)
        return slot

    before, done = decode_fault(flip)
    _, c = serve(engine, before_step=before)
    assert done
    hits = assert_detected(c, done["step"], "TAIL_K_FULL", "verify_real_kv_hash")
    assert any(v.slot == done["slot"] for v in hits)
    assert not any(v.tag_name.startswith("HEAD") for v in c.monitor.violations)


def test_kv_byte_flip_in_cached_unused_slot_caught_by_sweep(engine):
    """(d) A byte of layer 0's KV flipped in a cached slot no running request references."""
    done = {}

    def before(eng, running, due):
        if done or due or running is None:
            return None
        used = set()
        for q in running.reqs:
            used.update(eng.req_to_token_pool.req_to_token[q.req_pool_idx, :len(q.fill_ids)].tolist())
        for node in _nodes(eng.tree_cache):
            if node.lock_ref == 0 and not used.intersection(node.value.tolist()):
                slot = int(node.value[0])
                flip_kv_byte(eng, slot)
                done["step"], done["slot"] = eng.canary.steps + 1, slot
                return None
        return None

    _, c = serve(engine, before_step=before)
    assert done, "no cached slot was left unused while requests still ran"
    hits = assert_detected(c, done["step"], "SWEEP_K_FULL", "verify_real_kv_hash")
    assert any(v.slot == done["slot"] for v in hits)
    assert not any(v.tag_name.startswith(("HEAD", "TAIL")) for v in c.monitor.violations)


def test_wrong_position_fed_to_forward_raises(engine):
    """(e) A decode row's position in the batch handed to the forward is off by one; the monitor
    is in raise mode here and raises with the upstream report text."""
    done = {}

    def before(eng, running, due):
        if done or due or running is None or eng.step_no < 3:
            return None

        def shift(mwb):
            mwb.positions[0] += 1
            done["step"] = eng.canary.steps + 1
        return shift

    eng = engine
    eng.reset()
    c = eng.canary
    c.reset()
    c.monitor = Monitor.from_config(CONFIG.replace(mode="raise"))
    c.install()
    try:
        with pytest.raises(CanaryViolationError) as ei:
            eng.run(tiny.shared_prefix_workload(), before_step=before)
    finally:
        c.uninstall()
    assert done
    assert c.steps - done["step"] <= 1                 # raised by the monitor call after step T+1
    first = str(ei.value).splitlines()[0]
    m = REPORT_LINE_RE.match(first)
    assert m, first
    assert "launch_tag=HEAD_K_FULL" in first and "fail_reason=write_position" in first
    # the engine still holds live KV buffers (the raising step had donated the old ones)
    assert not any(buf.is_deleted() for buf in eng.kv_buffer)


def _nodes(tree_cache):
    out, stack = [], [tree_cache.root_node]
    while stack:
        n = stack.pop()
        for ch in n.children.values():
            if ch.value is not None and len(ch.value):
                out.append(ch)
            stack.append(ch)
    return out


def test_real_data_all_sees_a_flip_deep_in_v(engine):
    """With ``--kv-canary-real-data all`` every byte of the slot's fused K/V row is fingerprinted
    (by both halves): a byte in the middle of V head 0, which PARTIAL does not read, is reported
    at TAIL_V and TAIL_K."""
    c = kvc_sgl.SglangJaxCanary(engine.runner, CONFIG.replace(real_kv_hash_mode="ALL"),
                                tree_cache=engine.tree_cache)
    head_bytes = engine.kv_buffer[0].shape[2] * engine.kv_buffer[0].dtype.itemsize

    def flip(eng, running):
        assert c.monitor.violations == []          # clean until here
        q = running.reqs[0]
        slot = int(eng.req_to_token_pool.req_to_token[q.req_pool_idx, 4])
        flip_kv_byte(eng, slot, head_bytes + 100)   # V head 0, byte 100
        return slot

    before, done = decode_fault(flip, canary=c)

    engine.reset()
    c.install()
    try:
        engine.run(tiny.shared_prefix_workload(), before_step=before)
    finally:
        c.uninstall()
    c.flush()
    assert done
    hits = assert_detected(c, done["step"], "TAIL_V_FULL", "verify_real_kv_hash")
    assert any(v.slot == done["slot"] for v in hits)
    assert_detected(c, done["step"], "TAIL_K_FULL", "verify_real_kv_hash")


def test_install_is_idempotent_and_follows_a_rejitted_runner(engine):
    runner, c = engine.runner, engine.canary
    original = runner.jitted_run_model
    c.install()
    c.install()
    assert c.installed and c._original is original
    c.uninstall()
    assert runner.jitted_run_model is original and not c.installed
    c.install()
    runner.initialize_jit()                  # the engine rebuilds its jitted call (new weights)
    assert not c.installed
    rejitted = runner.jitted_run_model
    c.install()                              # wraps the new one
    assert c.installed and c._original is rejitted
    c.uninstall()
    assert runner.jitted_run_model is rejitted


def test_install_into_scheduler_uses_its_runner_and_radix_cache(engine):
    import types

    launched, processed, gated = [], [], []
    sched = types.SimpleNamespace(tp_worker=engine.worker, tree_cache=engine.tree_cache,
                                  enable_overlap=False, run_batch=launched.append,
                                  process_batch_result=lambda b, r: processed.append(b))
    c = kvc_sgl.install_into_scheduler(sched, CONFIG)
    try:
        assert c.installed and c.runner is engine.runner and c.tree_cache is engine.tree_cache
        sched.run_batch("batch")                       # the hook counts launches, then launches
        assert launched == ["batch"] and c.launches == 1 and not c.sweeps_from_wrapper
        assert c.gated                                  # results wait for the step's checks
        c.gate_hooks.append(lambda batch, step: gated.append((batch, list(processed))))
        sched.process_batch_result("batch", types.SimpleNamespace(bid=None))
        assert processed == ["batch"] and gated == []  # no launch of the canary had that bid
    finally:
        c.uninstall()
    assert kvc_sgl.install_into_scheduler(sched, CONFIG.replace(mode="none")) is None
