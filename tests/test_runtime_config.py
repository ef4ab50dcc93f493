"""CanaryConfig: defaults, validated combinations and clear errors; tag sets."""

import dataclasses

import pytest

from jax_kvcanary.consts import LaunchTag as T, RealKvHashMode
from jax_kvcanary.runtime import CanaryConfig, launch_tag
from jax_kvcanary.runtime.config import endpoint_of


def test_defaults_and_frozen():
    c = CanaryConfig()
    assert c.mode == "log" and c.real_kv_hash_mode is RealKvHashMode.PARTIAL
    assert c.groups == ("FULL",) and c.halves == ("K", "V") and c.health_interval == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.mode = "raise"


def test_normalisation():
    c = CanaryConfig(real_kv_hash_mode="all", halves=("v", "K"), groups=("SWA", "FULL"),
                     swa_window_size=16, sweep_interval=20)
    assert c.real_kv_hash_mode is RealKvHashMode.ALL
    assert c.halves == ("K", "V") and c.groups == ("FULL", "SWA")
    assert c.health_interval == 20                       # max(8, sweep_interval)
    assert CanaryConfig(real_kv_hash_mode=0).real_kv_hash_mode is RealKvHashMode.NONE


def test_tags():
    c = CanaryConfig(groups=("FULL", "SWA"), swa_window_size=8, sweep_interval=4)
    assert c.tags("HEAD") == (T.HEAD_K_FULL, T.HEAD_V_FULL, T.HEAD_K_SWA, T.HEAD_V_SWA)
    assert set(c.expected_tags()) == set(T)              # all 12 launch tags
    assert set(CanaryConfig(halves="K").expected_tags()) == {T.HEAD_K_FULL, T.TAIL_K_FULL}
    assert CanaryConfig(mode="none").expected_tags() == ()
    assert launch_tag("SWEEP", "V", "SWA") is T.SWEEP_V_SWA
    for t in T:                                          # endpoint_of inverts launch_tag
        assert launch_tag(*endpoint_of(t.name)) is t
    for bad in ("TAIL_K", "TAIL_K_FULL_X", "HOST_K_FULL", "TAIL_Q_FULL", "TAIL_K_SLIDING"):
        with pytest.raises(ValueError, match=f"kv-canary: '{bad}' is not a canary name"):
            endpoint_of(bad)


@pytest.mark.parametrize("kw, exc, text", [
    (dict(mode="warn"), ValueError, "CanaryConfig.mode must be one of ('none', 'log', 'raise'), got 'warn'"),
    (dict(real_kv_hash_mode=3), ValueError, "CanaryConfig.real_kv_hash_mode must be NONE, PARTIAL or ALL"),
    (dict(real_kv_hash_mode="bits"), ValueError, "real_kv_hash_mode must be NONE, PARTIAL or ALL"),
    (dict(ring_capacity=0), ValueError, "CanaryConfig.ring_capacity must be >= 1, got 0"),
    (dict(ring_capacity=2.5), TypeError, "CanaryConfig.ring_capacity must be an int, got float"),
    (dict(sweep_interval=-1), ValueError, "CanaryConfig.sweep_interval must be >= 0, got -1"),
    (dict(token_check=1), TypeError, "CanaryConfig.token_check must be a bool, got int"),
    (dict(halves=()), ValueError, "CanaryConfig.halves must be a non-empty subset of ('K', 'V')"),
    (dict(halves=("K", "Q")), ValueError, "CanaryConfig.halves must be a non-empty subset"),
    (dict(halves=("K", "k")), ValueError, "CanaryConfig.halves has duplicates"),
    (dict(groups=("SWA",)), ValueError, "groups includes 'SWA', which needs swa_window_size > 0"),
    (dict(swa_window_size=16), ValueError, "swa_window_size=16 is set but 'SWA' is not in groups"),
    (dict(sweep_interval=16, health_interval=8), ValueError,
     "health_interval=8 must be >= sweep_interval=16"),
])
def test_errors(kw, exc, text):
    with pytest.raises(exc) as e:
        CanaryConfig(**kw)
    assert str(e.value).startswith("kv-canary: ")
    assert text in str(e.value)


def test_replace_revalidates():
    c = CanaryConfig()
    assert c.replace(mode="raise").mode == "raise"
    with pytest.raises(ValueError):
        c.replace(groups=("FULL", "SWA"))
