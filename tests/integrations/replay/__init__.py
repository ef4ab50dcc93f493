"""Real sglang-jax KV bugs, replayed against the guarded server (test support).

Each bug of ``bugs.BUGS`` is re-introduced into a copy of the installed sglang-jax by a patch
under ``patches/`` (``builds``), served by the launcher with the canary, and counted against the
fixed build (``runner``). ``python -m tests.integrations.replay`` prints the table;
``tests/integrations/test_replay.py`` runs some of them in CI.
"""
