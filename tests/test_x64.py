"""x64 off and on, int32 and int64 index inputs: identical output bytes (docs/design.md §10).
Each digest runs in a subprocess; the module is marked ``slow``."""

import functools
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
SCRIPT = pathlib.Path(__file__).parent / "support" / "x64_scenario.py"


@functools.lru_cache(maxsize=None)
def digest(impl, index_dtype, x64):
    env = dict(os.environ, JAX_ENABLE_X64="1" if x64 else "0", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, str(SCRIPT), impl, index_dtype], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


# The pure-JAX backend's x64 invariance is tested on a larger scenario (tests/test_xla_impl.py);
# here the native handlers', and the two backends against each other.
def test_same_bytes_x64_off_and_on_int32_and_int64():
    base = digest("ffi", "int32", x64=False)
    assert digest("ffi", "int32", x64=True) == base
    assert digest("ffi", "int64", x64=True) == base


def test_ffi_and_xla_agree():
    assert digest("ffi", "int32", x64=False) == digest("xla", "int32", x64=False)
