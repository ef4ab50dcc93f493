"""sglang-jax builds for the replays: copies of the installed ``sgl_jax`` package with patches.

A build is a directory holding a patched copy of the ``sgl_jax`` package that is installed (the
vendored snapshot of sglang-jax main); a server started with ``PYTHONPATH=<build>`` imports that
copy instead (``Build.env``), its spawned scheduler process too. Patches are ``git diff`` files
under ``patches/`` whose paths are relative to the package directory (``a/srt/...``), applied
with ``patch -p1``; each starts with a header saying what it is.

Every build, the "fixed" one included, carries the fixtures ``FIXTURES``: changes that let the
snapshot serve correctly on the CPU, named as such (see each file's header).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from typing import Sequence, Tuple

PATCHES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "patches")

#: applied to every replay build (each patch's header says why; ``twins`` shows what each does):
#: a page table of its own for every step (main's overlap scheduler reuses one host buffer, which
#: JAX on the CPU aliases), and the page table laid out as the native attention backend reads it
#: (back to back, not page-aligned: page sizes above 1 with several requests in a batch)
FIXTURES = ("fixture-cpu-cache-loc-copy.patch", "fixture-native-page-table-layout.patch")


def installed_package() -> str:
    """The directory of the installed ``sgl_jax`` package (not imported)."""
    spec = importlib.util.find_spec("sgl_jax")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("sglang-jax is not installed")
    return list(spec.submodule_search_locations)[0]


def patch_header(name: str) -> str:
    """The header of a patch file: its lines before the first ``diff --git``."""
    with open(os.path.join(PATCHES, name)) as f:
        text = f.read()
    return text[:text.find("diff --git")].strip()


@dataclasses.dataclass(frozen=True)
class Build:
    """A patched copy of ``sgl_jax`` at ``root/sgl_jax``; ``patches`` applied in order."""

    root: str
    patches: Tuple[str, ...]

    @property
    def env(self) -> dict:
        """The environment that makes a server import this build."""
        return {"PYTHONPATH": os.pathsep.join([self.root, os.environ.get("PYTHONPATH", "")])
                .rstrip(os.pathsep)}

    def check(self) -> None:
        """Fail unless a Python started with ``env`` imports this build's ``sgl_jax``."""
        env = dict(os.environ, **self.env)
        got = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                              "print(u.find_spec('sgl_jax').submodule_search_locations[0])"],
                             capture_output=True, text=True, env=env, check=True).stdout.strip()
        want = os.path.join(self.root, "sgl_jax")
        if os.path.realpath(got) != os.path.realpath(want):
            raise RuntimeError(f"a server with {self.env} imports {got}, not the build {want}")


def make_build(workdir: str, patches: Sequence[str], fixtures: Sequence[str] = FIXTURES) -> Build:
    """The build of the installed ``sgl_jax`` with ``fixtures`` then ``patches`` (names under
    ``patches/``), made under ``workdir`` once per list of patches (reused if present)."""
    names = tuple(fixtures) + tuple(patches)
    key = hashlib.sha1("\n".join(names).encode()).hexdigest()[:10]
    root = os.path.join(workdir, f"sgl-jax-{key}")
    done = os.path.join(root, ".applied")
    if not os.path.exists(done):
        shutil.rmtree(root, ignore_errors=True)
        pkg = os.path.join(root, "sgl_jax")
        shutil.copytree(installed_package(), pkg,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        for name in names:
            with open(os.path.join(PATCHES, name)) as f:
                r = subprocess.run(["patch", "-p1", "--forward", "--batch", "--silent", "-d", pkg],
                                   stdin=f, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"patch {name} does not apply to {installed_package()}:\n"
                                   f"{r.stdout}{r.stderr}")
        with open(done, "w") as f:
            f.write("\n".join(names) + "\n")
    build = Build(root, names)
    build.check()
    return build
