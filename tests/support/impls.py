"""The implementations under test and a uniform way to call them.

``reference`` is the numpy oracle, ``ffi`` the native custom call on the default platform and ``xla``
the pure-JAX backend. ``KVC_TEST_IMPLS`` (a comma list) narrows the set during development; CI runs
all of them.
"""

from __future__ import annotations

import os

from jax_kvcanary import reference

ALL_IMPLS = ("reference", "ffi", "xla")
IMPLS = tuple(i for i in os.environ.get("KVC_TEST_IMPLS", ",".join(ALL_IMPLS)).split(",") if i)
COMPARED_IMPLS = tuple(i for i in IMPLS if i != "reference")  # compared against the reference


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
