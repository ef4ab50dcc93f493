"""The sglang-jax integration's pieces that need no sglang-jax: flags, the batch-row table, the
radix-cache chains, the runner checks, and that importing the package never imports sglang-jax."""

import argparse
import subprocess
import sys
import types

import numpy as np
import pytest

from jax_kvcanary.consts import RealKvHashMode
from jax_kvcanary.integrations import sglang_jax as kvc_sgl
from jax_kvcanary.runtime import CanaryConfig


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
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-canary", "warn"])
    with pytest.raises(ValueError, match="^kv-canary: CanaryConfig.sweep_interval must be >= 0"):
        kvc_sgl.config_from_args(p.parse_args(["--kv-canary", "log",
                                               "--kv-canary-sweep-interval", "-1"]))


def test_install_none_installs_nothing_and_bad_runners_are_refused():
    assert kvc_sgl.install(object(), CanaryConfig(mode="none")) is None
    newer = types.SimpleNamespace(memory_pools=object(), jitted_run_model=lambda *a: None)
    with pytest.raises(TypeError, match="^kv-canary: this sglang-jax model runner has no "
                                        "token_to_kv_pool-only layout"):
        kvc_sgl.install(newer, CanaryConfig(mode="log"))
    with pytest.raises(ValueError, match="^kv-canary: sweep_interval > 0 needs the scheduler's"):
        kvc_sgl.install(object(), CanaryConfig(mode="log", sweep_interval=4))
    with pytest.raises(ValueError, match="^kv-canary: sweeps walk a RadixCache; this tree_cache "
                                         "is a ChunkCache"):
        kvc_sgl.install(object(), CanaryConfig(mode="log", sweep_interval=4),
                        tree_cache=type("ChunkCache", (), {})())
    overlap = types.SimpleNamespace(enable_overlap=True)
    with pytest.raises(ValueError, match="^kv-canary: the sglang-jax integration needs the "
                                         "non-overlap scheduler"):
        kvc_sgl.install_into_scheduler(overlap, CanaryConfig(mode="log"))


def test_batch_rows_reserve_row_zero_for_padding():
    rt = np.arange(5 * 6, dtype=np.int32).reshape(5, 6)
    rows = kvc_sgl.batch_rows(rt, np.array([3, 0, -1, -1], np.int32))
    assert rows.shape == (5, 6) and rows.dtype == np.int32
    np.testing.assert_array_equal(rows[0], 0)
    np.testing.assert_array_equal(rows[1], rt[3])
    np.testing.assert_array_equal(rows[2], rt[0])       # engine row 0 is a real request
    np.testing.assert_array_equal(rows[3:], 0)
    rt[3, 0] = -7                                        # a private copy: later edits do not leak
    assert rows[1, 0] == 18


def test_radix_chains_follow_the_tree():
    def node(value, children=()):
        n = types.SimpleNamespace(value=np.array(value, np.int32), children={})
        for i, c in enumerate(children):
            n.children[i] = c
        return n

    leaf_a, leaf_b = node([7, 8]), node([9])
    root = node([], [node([3, 4, 5], [leaf_a, leaf_b])])
    chains = kvc_sgl.radix_chains(types.SimpleNamespace(root_node=root))
    got = sorted(map(tuple, chains.tolist()))
    assert got == sorted([(3, 0, -1), (4, 1, 3), (5, 2, 4), (7, 3, 5), (8, 4, 7), (9, 3, 5)])
    empty = kvc_sgl.radix_chains(types.SimpleNamespace(root_node=node([])))
    assert empty.shape == (0, 3)
