"""The implementations under test and a uniform way to call them.

``reference`` is the numpy oracle, ``ffi`` the native custom call on the default platform and ``xla``
the pure-JAX backend. As test parameters (the ``ops`` fixture, ``BACKEND_PARAMS``) the ``xla`` cases
carry the ``xla`` marker (``-m "not xla"`` leaves them out, as CI's x64 pass does) and most of them
``slow``: its compiles dominate the suite's time; the quick loop keeps a subset (test_property,
test_xla_impl).
"""

from __future__ import annotations

import pytest

from jax_kvcanary import reference

COMPARED_IMPLS = ("ffi", "xla")                 # compared against the reference
XLA = pytest.param("xla", marks=pytest.mark.xla)
SLOW_XLA = pytest.param("xla", marks=(pytest.mark.xla, pytest.mark.slow))
IMPL_PARAMS = ("reference", "ffi", SLOW_XLA)    # the ops fixture
BACKEND_PARAMS = ("ffi", SLOW_XLA)              # ``impl`` of the tests that compare the backends


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
