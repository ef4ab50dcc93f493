"""Shared fixtures: ``ops`` is parametrised over every implementation under test
(``tests/support/impls.py``); GPU-marked tests skip cleanly without a CUDA GPU. The markers are
registered in pyproject.toml."""

import pytest

from tests.support.impls import IMPL_PARAMS, Ops


@pytest.fixture(params=IMPL_PARAMS)
def ops(request):
    return Ops(request.param)


def pytest_collection_modifyitems(config, items):
    import jax
    try:
        has_gpu = bool(jax.devices("gpu"))
    except RuntimeError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU visible to JAX")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
