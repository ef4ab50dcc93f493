"""Shared test fixtures: the implementations under test and a uniform way to call them.

``impl`` is parametrised over every implementation: ``reference`` (numpy oracle), ``ffi`` (native
custom call on the default platform) and ``xla`` (pure jax.numpy). ``KVC_TEST_IMPLS`` (comma list)
narrows the set during development; CI runs all of them.
"""

import os

import pytest

from jax_kvcanary import reference

ALL_IMPLS = ("reference", "ffi", "xla")
IMPLS = tuple(i for i in os.environ.get("KVC_TEST_IMPLS", ",".join(ALL_IMPLS)).split(",") if i)


class Ops:
    """``plan`` / ``write`` / ``verify`` / ``scatter_req_token_ids`` of one implementation."""

    def __init__(self, impl):
        self.impl = impl

    def _call(self, name, *args, **kwargs):
        if self.impl == "reference":
            return getattr(reference, name)(*args, **kwargs)
        import jax_kvcanary as kvc
        return getattr(kvc, name)(*args, impl=self.impl, **kwargs)

    def plan(self, *a, **k):
        return self._call("plan", *a, **k)

    def write(self, *a, **k):
        return self._call("write", *a, **k)

    def verify(self, *a, **k):
        return self._call("verify", *a, **k)

    def scatter_req_token_ids(self, *a, **k):
        return self._call("scatter_req_token_ids", *a, **k)

    def __repr__(self):
        return f"Ops({self.impl})"


@pytest.fixture(params=IMPLS)
def ops(request):
    return Ops(request.param)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one")


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
