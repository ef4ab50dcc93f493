"""The kv-canary launcher with the CPU stand-ins of sglang-jax's TPU-only kernels in place
(``cpu_stand_ins``), for tests of HiCache and PD on the CPU: ``python -m
tests.support.launch_with_stand_ins ARGS`` takes the launcher's arguments. The stand-ins are
installed at import, so the spawned scheduler process (which imports this main module again) has
them too."""

import sys

from tests.support import cpu_stand_ins

cpu_stand_ins.install()

if __name__ == "__main__":
    from jax_kvcanary.integrations.sglang_jax import launch_server

    sys.exit(launch_server.main())
