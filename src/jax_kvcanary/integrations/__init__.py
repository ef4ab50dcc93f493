"""Integrations of the canary into third-party serving engines.

Each integration is its own module and imports its engine only when it is imported itself
(``import jax_kvcanary`` never imports an engine):

- ``jax_kvcanary.integrations.sglang_jax``: sglang-jax, the JAX backend of SGLang
  (``pip install 'jax_kvcanary[sglang-jax]'``).
"""
