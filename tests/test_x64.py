"""x64 off and on, int32 and int64 index inputs: identical output bytes (docs/design.md §10)."""

import functools
import os
import pathlib
import subprocess
import sys

import pytest

from tests.support.impls import IMPLS

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
@pytest.mark.parametrize("impl", [i for i in IMPLS if i not in ("reference", "xla")])
def test_same_bytes_x64_off_and_on_int32_and_int64(impl):
    base = digest(impl, "int32", x64=False)
    assert digest(impl, "int32", x64=True) == base
    assert digest(impl, "int64", x64=True) == base


def test_ffi_and_xla_agree():
    if not {"ffi", "xla"} <= set(IMPLS):
        pytest.skip("KVC_TEST_IMPLS excludes ffi or xla")
    assert digest("ffi", "int32", x64=False) == digest("xla", "int32", x64=False)
