"""The jax_kvcanary test suite (a package, so that ``tests.support`` is importable from every test)."""
