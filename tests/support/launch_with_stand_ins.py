"""The kv-canary launcher with the CPU stand-ins of sglang-jax's TPU-only kernels in place
(``cpu_stand_ins``) and the test-only patches of engine bugs that would end the servers
(``engine_patches``), for tests of the features built on them on the CPU: ``python -m
tests.support.launch_with_stand_ins ARGS`` takes the launcher's arguments. Both are installed at
import, so the spawned scheduler process (which imports this main module again) has them too."""

import os
import sys

from tests.support import cpu_stand_ins, engine_patches

cpu_stand_ins.install()
engine_patches.free_eagle_tail_slot()
if os.environ.get(engine_patches.VERIFY_PAGES_SWITCH) == "1":
    engine_patches.verify_pages_per_request()

if __name__ == "__main__":
    from jax_kvcanary.integrations.sglang_jax import launch_server

    sys.exit(launch_server.main())
