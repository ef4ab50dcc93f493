"""Fixtures shared by the server test modules of data-parallel attention and several nodes: one
tiny Qwen2, its unguarded answers and the build with sglang-jax's CPU DP path made rank-correct,
made once per test session."""

import pytest

from tests.support.sglang_server import unguarded_answers
from tests.support.tiny_qwen2 import write_tiny_qwen2


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """A tiny Qwen2 written at test time (seeded weights, a local tokenizer)."""
    return write_tiny_qwen2(str(tmp_path_factory.mktemp("tiny-qwen2-shared")))


@pytest.fixture(scope="session")
def unguarded_tiny(tiny_qwen2, tmp_path_factory):
    """``mixed_requests``' tokens from one process without the canary (``--dp-size 1``)."""
    return unguarded_answers(tiny_qwen2, str(tmp_path_factory.mktemp("one") / "one.log"))


@pytest.fixture(scope="session")
def cpu_dp_fixed_env(tmp_path_factory):
    """The environment of a server that imports the replay suite's build with sglang-jax's CPU
    data-parallel path fixed (``replay/patches/fix-cpu-dp-rank-slots.patch``)."""
    from tests.integrations.replay import builds

    return builds.make_build(str(tmp_path_factory.mktemp("builds")),
                             ("fix-cpu-dp-rank-slots.patch",)).env
