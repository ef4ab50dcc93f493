"""The sglang-jax integration's pieces that need no sglang-jax: flags, the runner layouts and their
refusals, the real-KV sources of both fused KV layouts, the page-table batch, the radix-cache
chains, the launcher's refusals, and that importing the package never imports sglang-jax."""

import argparse
import subprocess
import sys
import types
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvcanary import hashing
from jax_kvcanary.consts import RealKvHashMode
from jax_kvcanary.integrations import sglang_jax as kvc_sgl
from jax_kvcanary.integrations.sglang_jax import layout
from jax_kvcanary.runtime import CanaryConfig
from tests.support.sglang_fakes import fake_runner, kv_pool, serving_runner

pytestmark = pytest.mark.integration


def test_import_does_not_import_sglang_jax():
    code = ("import sys, jax_kvcanary, jax_kvcanary.runtime, jax_kvcanary.integrations.sglang_jax; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('sgl_jax', 'flax')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_flags_parse_into_config():
    p = kvc_sgl.add_cli_args(argparse.ArgumentParser())
    ns = p.parse_args([])
    assert (ns.kv_canary, ns.kv_canary_real_data, ns.kv_canary_sweep_interval) == ("none", "partial", 0)
    assert not kvc_sgl.config_from_args(ns).enabled
    ns = p.parse_args(["--kv-canary", "raise", "--kv-canary-real-data", "all",
                       "--kv-canary-sweep-interval", "16"])
    cfg = kvc_sgl.config_from_args(ns)
    assert (cfg.mode, cfg.real_kv_hash_mode, cfg.sweep_interval) == ("raise", RealKvHashMode.ALL, 16)
    assert not (cfg.write_input_assert or cfg.token_check)
    cfg = kvc_sgl.config_from_args(p.parse_args(["--kv-canary", "log",
                                                 "--kv-canary-write-input-assert",
                                                 "--kv-canary-token-check"]))
    assert cfg.write_input_assert and cfg.token_check
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-canary", "warn"])
    with pytest.raises(ValueError, match="^kv-canary: CanaryConfig.sweep_interval must be >= 0"):
        kvc_sgl.config_from_args(p.parse_args(["--kv-canary", "log",
                                               "--kv-canary-sweep-interval", "-1"]))


def test_install_none_installs_nothing_and_bad_runners_are_refused():
    assert kvc_sgl.install(object(), CanaryConfig(mode="none")) is None
    with pytest.raises(TypeError, match="^kv-canary: this sglang-jax model runner has no "
                                        "jitted_run_model"):
        kvc_sgl.install(types.SimpleNamespace(), CanaryConfig(mode="log"))
    with pytest.raises(ValueError, match="^kv-canary: sweep_interval > 0 needs the scheduler's"):
        kvc_sgl.install(object(), CanaryConfig(mode="log", sweep_interval=4))
    with pytest.raises(ValueError, match="^kv-canary: sweeps walk a RadixCache; this tree_cache "
                                         "is a ChunkCache"):
        kvc_sgl.install(object(), CanaryConfig(mode="log", sweep_interval=4),
                        tree_cache=type("ChunkCache", (), {})())


@pytest.mark.parametrize("change, message", [
    (dict(dp_size=2, mesh=types.SimpleNamespace(shape={"data": 1, "tensor": 2})),
     r"dp_size=2 needs the mesh's data axis of 2 devices"),
    (dict(dp_size=2, token_to_kv_pool=kv_pool(np.zeros((9, 1, 4, 1, 8)), "MLATokenToKVPool")),
     "data-parallel attention .dp_size=2. is guarded with the MHA KV pool"),
    (dict(token_to_kv_pool=type("HybridLinearKVPool", (types.SimpleNamespace,), {})(
        full_kv_pool=None)),
     "^kv-canary: the hybrid linear pool is guarded around an MHATokenToKVPool, this one holds "
     "a NoneType"),
    (dict(token_to_kv_pool=kv_pool(np.zeros((9, 1, 4, 1, 8)), "PoolOfATomorrowVersion")),
     "^kv-canary: the KV pool PoolOfATomorrowVersion is not supported: the canary knows only "
     "MHATokenToKVPool, SWAKVPool"),
    (dict(server_args=types.SimpleNamespace(attention_backend="fa_mha")),
     "attention backend 'fa_mha' is not supported"),
    (dict(memory_pools=types.SimpleNamespace(_pools={"token_to_kv_pool": 0, "recurrent": 0},
                                             replace_all=print)),
     r"supports a MemoryPools of token_to_kv_pool with the KV pool MHATokenToKVPool, this runner "
     r"has \('recurrent', 'token_to_kv_pool'\)"),
])
def test_runner_layouts_refuse_what_they_cannot_cover(change, message):
    kv0 = np.zeros((9, 1, 4, 1, 8), np.float32)
    with pytest.raises(ValueError, match=message):
        layout.runner_layout(fake_runner(kv0, **change))


def test_runner_layout_is_chosen_by_what_the_runner_has():
    main = layout.runner_layout(fake_runner(np.zeros((5, 4, 4, 1, 8), np.float32), page_size=4))
    assert isinstance(main, layout.PoolsRunner) and main.geometry.num_slots == 20
    legacy = fake_runner(np.zeros((9, 4, 8), np.float32), _set_kv_cache_after_forward=print)
    del legacy.memory_pools
    old = layout.runner_layout(legacy)
    assert isinstance(old, layout.LegacyRunner) and old.geometry.num_slots == 9
    legacy.tp_size = 2
    with pytest.raises(ValueError, match="supported on sglang-jax main only; this 0.0.2 runner "
                                         "has tp_size=2"):
        layout.runner_layout(legacy)
    assert isinstance(layout.runner_layout(fake_runner(np.zeros((5, 4, 4, 1, 8), np.float32),
                                                       tp_size=2)), layout.PoolsRunner)
    with pytest.raises(ValueError, match="^kv-canary: expected layer 0's fused KV buffer"):
        layout.fused_geometry(np.zeros((9, 3, 8), np.float32))
    with pytest.raises(ValueError, match="^kv-canary: a KV head must be a multiple of 16 bytes"):
        layout.fused_geometry(np.zeros((9, 4, 3), np.float32))


@pytest.mark.parametrize("shape", [(6, 1, 4, 1, 8), (3, 2, 4, 1, 8), (2, 3, 2, 2, 8), (6, 4, 8)])
@pytest.mark.parametrize("mode", [RealKvHashMode.PARTIAL, RealKvHashMode.ALL])
def test_real_kv_sources_fold_the_slot_s_k_and_v_head_zero_bytes(shape, mode):
    """Each layout addresses slot s's token row in place: K = the row's first bytes (K head 0),
    V = V head 0's first 16 bytes (PARTIAL) or the whole row (ALL), heads interleaved K0 V0 K1
    V1 (packed in pairs for the 2-byte-packing layout)."""
    rng = np.random.default_rng(0)
    kv = rng.standard_normal(shape).astype(np.float32)
    geo = layout.fused_geometry(kv)
    srcs = layout.real_kv_sources(jnp.asarray(kv), mode)
    rows = kv.reshape(geo.num_slots, geo.token_elems)           # token row s, heads K0 V0 K1 ...
    for s in range(geo.num_slots):
        row = rows[s].view(np.uint8)
        k = row[:16] if mode == RealKvHashMode.PARTIAL else row
        v = (row[geo.head_elems * 4: geo.head_elems * 4 + 16] if mode == RealKvHashMode.PARTIAL
             else row)
        for half, want in (("K", k), ("V", v)):
            got = hashing.slot_real_kv_hash((srcs[half],), s, int(mode))
            assert got == hashing.real_kv_hash([want]), (half, s)


def test_segment_starts_follow_the_attention_backend():
    seq = jnp.asarray(np.array([5, 1, 8, 0], np.int32))
    assert layout.segment_starts(seq, 4, aligned=True).tolist() == [0, 8, 12, 20]
    assert layout.segment_starts(seq, 4, aligned=False).tolist() == [0, 5, 6, 14]
    assert layout.segment_starts(seq, 1, aligned=True).tolist() == [0, 5, 6, 14]


def test_page_table_batch_reads_the_step_s_own_arrays():
    mesh = jax.make_mesh((1,), ("data",))
    arrays = dict(req_pool_indices=np.array([3, 0, -1], np.int32),
                  seq_lens=np.array([5, 2, 0], np.int32),
                  extend_prefix_lens=np.array([3, 0, 0], np.int32),
                  extend_seq_lens=np.array([2, 2, 0], np.int32),
                  cache_loc=np.arange(12, dtype=np.int32), input_ids=np.arange(8, dtype=np.int32),
                  positions=np.array([3, 4, 0, 1, 0, 0, 0, 0], np.int32),
                  out_cache_loc=np.array([4, 5, 6, 7, -1, -1, -1, -1], np.int32))
    b = layout.page_table_batch({k: jnp.asarray(v) for k, v in arrays.items()}, decode=False,
                                page_size=4, aligned=True, mesh=mesh)
    assert b.req_pool_indices.tolist() == [1, 1, 0]      # engine row 0 is a live request
    assert b.prefix_lens.tolist() == [3, 0, 0] and b.extend_seq_lens.tolist() == [2, 2, 0]
    assert b.req_to_token_row_starts.tolist() == [0, 8, 12] and b.is_page_table
    arrays.update(seq_lens=np.array([6, 3, 0], np.int32), extend_prefix_lens=None,
                  extend_seq_lens=None)
    d = layout.page_table_batch({k: None if v is None else jnp.asarray(v)
                                 for k, v in arrays.items()},
                                decode=True, page_size=1, aligned=False, mesh=mesh)
    assert d.prefix_lens.tolist() == [5, 2, 0] and d.extend_seq_lens.tolist() == [1, 1, 0]
    assert d.req_to_token_row_starts.tolist() == [0, 6, 9]


def server_args(**kw):
    a = dict(tp_size=1, dp_size=1, speculative_algorithm=None, enable_lora=False, multimodal=False,
             disaggregation_mode="null", pd_disaggregation="", hicache_storage="disable",
             attention_backend="native", disable_radix_cache=False,
             enable_unified_radix_tree=False)
    a.update(kw)
    return types.SimpleNamespace(**a)


def test_refusals_name_the_setting_and_the_fix():
    from jax_kvcanary.integrations.sglang_jax.inject import InjectSpec
    from jax_kvcanary.integrations.sglang_jax.server import dp_refusals, refusals

    log = CanaryConfig(mode="log")
    assert refusals(server_args(), log) == []
    assert refusals(server_args(tp_size=4), log) == []            # tensor parallel: covered
    assert refusals(server_args(tp_size=4, dp_size=2), log) == []  # data-parallel attention too
    assert refusals(server_args(tp_size=2, dp_size=2), log, InjectSpec("real_kv_used")) == []
    got = refusals(server_args(tp_size=2, dp_size=2), log, InjectSpec("cache_loc_off_by_one"))
    assert got and got[0].startswith("kv-canary: --kv-canary-inject cache_loc_off_by_one with "
                                     "--dp-size 2 is not supported"), got
    nodes = dict(nnodes=2, tp_size=2, disable_overlap_schedule=True)
    assert refusals(server_args(**nodes), log) == []     # several nodes: guarded
    assert refusals(server_args(**nodes), log, InjectSpec("real_kv_used", node=1)) == []
    assert refusals(server_args(nnodes=2, tp_size=2), log)[0].startswith(
        "kv-canary: the overlap scheduler (add --disable-overlap-schedule) with --nnodes 2 is not "
        "supported")
    assert dp_refusals(server_args(dp_size=2, speculative_algorithm="EAGLE3"), log, None)[0][0] \
        == "--speculative-algorithm EAGLE3"
    assert dp_refusals(server_args(dp_size=2, disaggregation_mode="decode"), log, None)[0][0] \
        == "--disaggregation-mode decode"
    got = refusals(server_args(tp_size=2, dp_size=2), CanaryConfig(mode="log", token_check=True))
    assert got and "--kv-canary-token-check with --dp-size 2" in got[0], got
    cases = [
        (dict(dp_size=2, tp_size=2, hicache_storage="none"),
         "kv-canary: --hicache-storage none with --dp-size 2 is not supported"),
        (dict(nnodes=2, tp_size=2, disable_overlap_schedule=True, hicache_storage="none"),
         "kv-canary: --hicache-storage none with --nnodes 2 is not supported"),
        (dict(speculative_algorithm="NEXTN"), "kv-canary: --speculative-algorithm NEXTN is not "
                                              "supported: the canary guards EAGLE and EAGLE3"),
        (dict(enable_lora=True), "kv-canary: --enable-lora is not supported"),
        (dict(hicache_storage="file"), "kv-canary: --hicache-storage file is not supported"),
        (dict(attention_backend="fa_mha"), "kv-canary: --attention-backend fa_mha"),
        (dict(pd_disaggregation="pathways"), "kv-canary: --pd-disaggregation pathways"),
        (dict(disaggregation_mode="decode", disaggregation_use_raiden=True),
         "kv-canary: --disaggregation-use-raiden with --disaggregation-mode decode"),
        (dict(disaggregation_mode="prefill", disaggregation_enable_d2h=True),
         "kv-canary: --disaggregation-enable-d2h with --disaggregation-mode prefill"),
        (dict(disaggregation_mode="prefill", tp_size=2),
         "kv-canary: --tp-size 2 with --disaggregation-mode prefill"),
    ]
    for change, text in cases:
        got = refusals(server_args(**change), log)
        assert len(got) == 1 and got[0].startswith(text) and "; " in got[0], got
    swept = CanaryConfig(mode="log", sweep_interval=4)
    assert refusals(server_args(disable_radix_cache=True), swept)[0].startswith(
        "kv-canary: --kv-canary-sweep-interval 4 with --disable-radix-cache")
    got = refusals(server_args(), log, InjectSpec("real_kv_unused_cache"))
    assert got and "add --kv-canary-sweep-interval" in got[0]
    got = refusals(server_args(), log, InjectSpec("future_token_ring_wrap"))
    assert got and "add --kv-canary-write-input-assert" in got[0]
    assert refusals(server_args(hicache_storage="none"), log) == []   # the host tier: guarded
    for kind in ("hicache_reload_swap", "hicache_stale_page", "hicache_host_flip",
                 "hicache_revive_free"):
        got = refusals(server_args(), log, InjectSpec(kind))
        assert got and "add --hicache-storage none" in got[0]
        assert refusals(server_args(hicache_storage="none"), log, InjectSpec(kind)) == []
    for mode in ("prefill", "decode"):                # jax_transfer on one host: guarded
        assert refusals(server_args(disaggregation_mode=mode), log) == []
    for kind in ("pd_zero_slot", "pd_page_shift", "pd_early_reuse"):
        for mode in ("null", "prefill"):
            got = refusals(server_args(disaggregation_mode=mode), log, InjectSpec(kind))
            assert got and "start it on the decode server" in got[0], got
        assert refusals(server_args(disaggregation_mode="decode"), log, InjectSpec(kind)) == []
    tokens = CanaryConfig(mode="log", token_check=True)
    assert refusals(server_args(enable_mixed_chunk=True), log) == []
    assert refusals(server_args(enable_mixed_chunk=True), tokens)[0].startswith(
        "kv-canary: --kv-canary-write-input-assert / --kv-canary-token-check with "
        "--enable-mixed-chunk is not supported")


def test_a_fault_aimed_at_the_swa_group_is_checked_where_it_is_named():
    from jax_kvcanary.integrations.sglang_jax.inject import InjectSpec

    assert InjectSpec("real_kv_used", group="SWA").on_swa
    assert InjectSpec("swa_map_stale").on_swa and not InjectSpec("real_kv_used").on_swa
    with pytest.raises(ValueError, match="^kv-canary: --kv-canary-inject-group must be one of "
                                         "FULL, SWA, DRAFT, got 'swa'"):
        InjectSpec("real_kv_used", group="swa")
    with pytest.raises(ValueError, match="real_kv_unused_cache cannot be aimed at the SWA group "
                                         r"\(--kv-canary-inject-group SWA\): the SWA group is not "
                                         "swept"):
        InjectSpec("real_kv_unused_cache", group="SWA")
    with pytest.raises(ValueError, match="HiCache and PD are refused with a hybrid SWA pool"):
        InjectSpec("pd_zero_slot", group="SWA")


def test_launcher_rejects_bad_canary_flags_before_importing_sglang_jax():
    from jax_kvcanary.integrations.sglang_jax import launch_server

    for argv in (["--kv-canary", "warn"], ["--kv-canary-inject", "nope"],
                 ["--kv-canary-inject", "real_kv_used", "--kv-canary-inject-group", "SLIDING"]):
        with pytest.raises(SystemExit) as ei:
            launch_server.main(argv)
        assert ei.value.code == 2
    assert launch_server.main(["--kv-canary", "none", "--kv-canary-inject", "real_kv_used"]) == 2
    assert launch_server.main(["--kv-canary", "log", "--kv-canary-inject-step", "0",
                               "--kv-canary-inject", "wrong_position"]) == 2
    code = ("import sys; from jax_kvcanary.integrations.sglang_jax.launch_server import main; "
            "assert main(['--kv-canary', 'none', '--kv-canary-inject', 'real_kv_used']) == 2; "
            "assert 'sgl_jax' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_radix_chains_follow_the_tree():
    def node(value, children=()):
        n = types.SimpleNamespace(value=np.array(value, np.int32), children={})
        for i, c in enumerate(children):
            n.children[i] = c
        return n

    leaf_a, leaf_b = node([7, 8]), node([9])
    root = node([], [node([3, 4, 5], [leaf_a, leaf_b])])
    [chains] = kvc_sgl.radix_chains(types.SimpleNamespace(root_node=root))
    got = sorted(map(tuple, chains.tolist()))
    assert got == sorted([(3, 0, -1), (4, 1, 3), (5, 2, 4), (7, 3, 5), (8, 4, 7), (9, 3, 5)])
    [empty] = kvc_sgl.radix_chains(types.SimpleNamespace(root_node=node([])))
    assert empty.shape == (0, 3)
    # data-parallel attention: each rank's nodes (their keys' dp_rank) hold rank-local slots
    rank0, rank1 = node([3, 4], [node([5])]), node([3, 4])
    for n, r in ((rank0, 0), (rank0.children[0], 0), (rank1, 1)):
        n.key = types.SimpleNamespace(dp_rank=r)
    per_rank = kvc_sgl.radix_chains(types.SimpleNamespace(root_node=node([], [rank0, rank1])), 2)
    assert [sorted(map(tuple, c.tolist())) for c in per_rank] == [
        [(3, 0, -1), (4, 1, 3), (5, 2, 4)], [(3, 0, -1), (4, 1, 3)]]


def test_the_step_path_copies_nothing_to_the_device_and_compiles_once_per_bucket():
    """The wrapper around the engine's model call reads the step's own device arrays only: no
    host-to-device copy per step (whatever the context length), and one compile per bucket."""
    import logging

    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((1,), ("data",))
    rep, data = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
    kv0 = jax.device_put(np.zeros((64, 1, 4, 1, 8), np.float32), rep)
    outputs = (None, {"token_to_kv_pool": [kv0]}, None, None)
    runner = fake_runner(kv0, jitted_run_model=lambda fb, lm: outputs, mesh=mesh)
    quiet = logging.getLogger("kvc-unit-quiet")
    quiet.disabled = True
    canary = kvc_sgl.install(runner, CanaryConfig(mode="log", health_interval=0), logger=quiet)

    def decode_batch(context):
        seq = np.array([context, context - 3, 0, 0], np.int32)
        loc = np.zeros(4 * 32, np.int32)
        loc[: seq.sum()] = 1 + np.arange(seq.sum()) % 63
        arrays = dict(req_pool_indices=np.array([0, 1, -1, -1], np.int32), seq_lens=seq,
                      cache_loc=loc, input_ids=np.array([5, 6, 0, 0], np.int32),
                      positions=np.maximum(seq - 1, 0),
                      out_cache_loc=np.array([1, 2, -1, -1], np.int32))
        fb = types.SimpleNamespace(forward_mode=types.SimpleNamespace(is_decode=lambda: True,
                                                                      is_target_verify=lambda: False),
                                   extend_prefix_lens=None, extend_seq_lens=None,
                                   **{k: jax.device_put(v, data) for k, v in arrays.items()})
        return fb

    batches = [decode_batch(n) for n in (5, 12, 30)]
    runner.jitted_run_model(batches[0], None)           # compiles
    with jax.transfer_guard_host_to_device("disallow"):
        for fb in batches:
            for _ in range(3):
                assert runner.jitted_run_model(fb, None) is outputs
    assert canary._check_fn._cache_size() == 1
    assert canary.steps == 10 and canary.host_time.steps == 10


def test_prometheus_counters_add_what_changed_and_restart_after_a_reset():
    prom = pytest.importorskip("prometheus_client")
    from jax_kvcanary.integrations.sglang_jax.metrics import CanaryTotals, PrometheusCounters

    reg = prom.CollectorRegistry()
    pc = PrometheusCounters(registry=reg)
    t = CanaryTotals()
    t.steps, t.sweeps = 10, 2
    t.violations = {("HEAD_K_FULL", "verify_position"): 3}
    t.verified, t.written = {"HEAD_K_FULL": 100}, {"HEAD_K_FULL": 40}
    pc.update(t, protected=64)
    t.steps, t.violations = 15, {("HEAD_K_FULL", "verify_position"): 5}
    t.verified = {"HEAD_K_FULL": 160}
    pc.update(t, protected=80)
    get = reg.get_sample_value
    assert get("kv_canary_steps_total") == 15
    assert get("kv_canary_violations_total", {"tag": "HEAD_K_FULL", "reason": "verify_position"}) == 5
    assert get("kv_canary_slots_verified_total", {"tag": "HEAD_K_FULL"}) == 160
    assert get("kv_canary_slots_written_total", {"tag": "HEAD_K_FULL"}) == 40
    assert get("kv_canary_sweeps_total") == 2 and get("kv_canary_protected_tokens") == 80
    assert get("kv_canary_health_ok") == 1
    reset = CanaryTotals()                       # a fresh canary state counts from zero again
    reset.steps, reset.health_ok = 4, False
    pc.update(reset)
    assert get("kv_canary_steps_total") == 19 and get("kv_canary_health_ok") == 0
    assert get("kv_canary_protected_tokens") == 80  # unknown (None) leaves the gauge as it was
    line = t.stats_line(80)
    assert line.startswith("kv_canary stats: step=15 protected_tokens=80 sweep_passes=2 "
                           "violations=5 HEAD_K_FULL=verified:160,written:40"), line


def test_the_host_tier_and_pd_counts_reach_the_stats_line_and_the_metrics():
    prom = pytest.importorskip("prometheus_client")
    from jax_kvcanary.integrations.sglang_jax.metrics import CanaryTotals, PrometheusCounters

    reg = prom.CollectorRegistry()
    pc = PrometheusCounters(registry=reg)
    t = CanaryTotals()
    t.host_pages = {"exported": 7, "imported": 5, "skipped": 1, "checked": 6}
    t.pd_side, t.pd = "decode", {"requests": 3, "slots": 21}
    pc.update(t)
    get = reg.get_sample_value
    assert get("kv_canary_hicache_pages_total", {"what": "skipped"}) == 1
    assert get("kv_canary_pd_requests_total", {"side": "decode"}) == 3
    assert get("kv_canary_pd_slots_total", {"side": "decode"}) == 21
    assert get("kv_canary_pd_requests_total", {"side": "prefill"}) is None
    line = t.stats_line(0)
    assert line.endswith(" hicache_pages=exported:7,imported:5,skipped:1,checked:6 "
                         "pd_decode=requests:3,slots:21"), line


def test_an_idle_report_that_fails_for_another_reason_does_not_end_the_server(caplog):
    """Only a violation (mode raise) or a failed health check ends the server between steps."""
    import logging

    from jax_kvcanary.integrations.sglang_jax.server import end_server

    logger = logging.getLogger("kvc-test-end-server")
    with caplog.at_level(logging.ERROR, logger=logger.name):
        end_server(None, logger, RuntimeError("Array has been deleted"))   # no os.kill reached
    assert caplog.messages == ["kv-canary: the idle-time report failed (RuntimeError: Array has "
                               "been deleted); serving goes on"]


def test_idle_reporter_reports_soon_but_ends_episodes_only_after_a_real_pause():
    """Slow steps (0.4 s apart, longer than ``idle_s``) get their readback decoded between them,
    but once their interval is known the episodes are ended only after a pause of 4 intervals,
    not between steps."""
    import time

    from jax_kvcanary.integrations.sglang_jax.canary import IdleReporter

    calls = []
    r = IdleReporter(calls.append, idle_s=0.1, close_s=0.3)
    for _ in range(6):
        r.touch()
        time.sleep(0.4)
    # after the first step the interval is unknown: that gap ends the episodes; then never again
    assert calls.count(False) == 6 and calls.count(True) == 1, calls
    time.sleep(2.4)
    assert calls[-1] is True and calls.count(True) == 2, calls


def test_idle_reporter_retries_a_stage_its_report_could_not_do_without_waiting():
    """``report`` returns False while the last step still runs on the device: the stage is tried
    again, not skipped."""
    import time

    from jax_kvcanary.integrations.sglang_jax.canary import IdleReporter

    calls, answers = [], [False, False, True, True]
    r = IdleReporter(lambda close: calls.append(close) or answers.pop(0), idle_s=0.1, close_s=0.3)
    r.touch()
    time.sleep(1.0)
    assert calls == [False, False, False, True], calls


class FakeHostPool:
    """What the canary reads of sglang-jax main's ``LRUHostKVPool``: page-addressed host slots,
    an allocation epoch per slot, staged loads tagged with the epoch they were staged at. The KV
    itself is not modelled (``flush_backup`` publishes a placeholder)."""

    def __init__(self, pages: int, page_size: int = 1):
        self._lock, self._pending_load_lock = threading.Lock(), threading.Lock()
        self._page_size = page_size
        self._generation, self._allocated = [0] * pages, [False] * pages
        self._slots, self._pending_load = [None] * pages, {}
        self.scattered = []

    def alloc(self, ids):
        for b in ids:
            self._allocated[b] = True
            self._generation[b] += 1

    def stage_backup(self, device_indices, host_buffer_ids):
        pass

    def flush_backup(self, host_buffer_ids):
        for b in host_buffer_ids:
            self._slots[b] = "kv"

    def stage_load(self, host_buffer_ids):
        for b in host_buffer_ids:
            self._pending_load[b] = (self._generation[b], "kv")

    def flush_load(self, host_buffer_ids, device_indices):
        for b, p in zip(host_buffer_ids, device_indices):
            gen, _ = self._pending_load.pop(b)
            if self._allocated[b] and gen == self._generation[b]:
                self.scattered.append(int(p))

    def free(self, host_page_ids):
        for b in host_page_ids:
            self._allocated[b], self._slots[b] = False, None

    def release(self, buffer_id):
        self.free([buffer_id])


def test_hicache_records_travel_with_each_backup_and_load():
    """Records exported at a backup (device pages 3, 4 -> host pages 0, 1), imported at the load's
    new device pages (7, 8) for the pages the engine scatters; host page 1, freed and reused while
    its load was staged, is skipped by the engine and its device page keeps no imported record;
    records of freed host pages are dropped."""
    from jax_kvcanary.integrations.sglang_jax.canary import SglangJaxCanary
    from jax_kvcanary.integrations.sglang_jax.hicache import HostRecords

    canary = SglangJaxCanary(serving_runner(), CanaryConfig(mode="log", real_kv_hash_mode="NONE"))
    marked = {}
    for k, name in enumerate(sorted(canary.state.canaries)):
        c = np.array(canary.state.canaries[name])
        c[3, :32], c[4, :32] = 10 + k, 20 + k
        marked[name] = jax.device_put(c, canary.state.canaries[name].sharding)
    canary.state = canary.state.replace(canaries=marked)
    pool = FakeHostPool(4)
    host = HostRecords(canary, pool).install()
    pool.alloc([0, 1])
    pool.stage_backup([3, 4], [0, 1])
    pool.flush_backup([0, 1])
    assert sorted(host.pages) == [0, 1] and host.exported == 2
    pool.stage_load([0, 1])
    pool.alloc([1])                                  # host page 1 freed and reused mid-load
    pool.flush_load([0, 1], [7, 8])
    assert pool.scattered == [7] and (host.imported, host.skipped) == (1, 1)
    for k, name in enumerate(sorted(canary.state.canaries)):
        c = np.asarray(canary.state.canaries[name])
        assert (c[7, :32] == 10 + k).all() and (c[8, :32] == 0).all(), name
    pool.free([0])
    pool.release(1)
    assert host.pages == {}
    with pytest.raises(TypeError, match="kv-canary: this sglang-jax HiCache host pool"):
        HostRecords(canary, types.SimpleNamespace(stage_backup=print))
