"""The kv-canary launcher with the XLA programs of each engine step counted (``program_count``):
``KV_CANARY_TEST_PROGRAM_COUNT=FILE python -m tests.support.launch_counting_programs ARGS`` takes
the launcher's arguments (``--kv-canary none`` is the stock server). The count is installed at
import, so the spawned scheduler process (which imports this main module again) has it too."""

import os
import sys

from tests.support import program_count

program_count.install(os.environ[program_count.PATH_ENV])

if __name__ == "__main__":
    from jax_kvcanary.integrations.sglang_jax import launch_server

    sys.exit(launch_server.main())
