"""Choose the XLA FFI headers the native handlers are compiled against (run by CMakeLists.txt).

An XLA runtime accepts FFI handlers compiled against its own XLA FFI API version or an older minor
version of the same major version, and rejects newer ones. So the handlers are compiled against the
headers of the oldest supported jaxlib, the ``jaxlib==X`` pin of ``[build-system] requires`` in
pyproject.toml, and one build loads on every jaxlib from X on:

* the environment's jaxlib is the pinned one or older (an isolated build: pip installed the pin):
  its own headers (``jaxlib/include``);
* it is newer (a ``--no-build-isolation`` build next to a newer jax): the pinned jaxlib's headers,
  taken from its wheel (``pip download``, so pip's cache and index settings apply) and kept in
  ``--cache-dir``; if that fails (no network), the environment's headers, and the status line says
  so: the module then needs a jaxlib at least as new as the environment's.

``--mode env`` always takes the environment's headers; ``--mode <dir>`` takes ``<dir>`` (an include
dir holding ``xla/ffi/api/c_api.h``). Prints ``include_dir;jaxlib_version;major;minor;source;note``
for CMake on stdout (``source``: environment, pinned or path; ``note``: why the pinned headers were
not used, or empty).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import zipfile

HEADERS = ("api.h", "c_api.h", "ffi.h")


def version_tuple(text: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:4])


def api_version(include_dir: str) -> tuple[int, int]:
    """(major, minor) of the XLA FFI API declared by ``include_dir/xla/ffi/api/c_api.h``."""
    with open(os.path.join(include_dir, "xla", "ffi", "api", "c_api.h")) as f:
        text = f.read()
    found = [re.search(rf"^#define XLA_FFI_API_{part}\s+(\d+)", text, re.M) for part in ("MAJOR", "MINOR")]
    if not all(found):
        raise SystemExit(f"no XLA_FFI_API_MAJOR/MINOR in {include_dir}/xla/ffi/api/c_api.h")
    return int(found[0].group(1)), int(found[1].group(1))


def pinned_jaxlib(pyproject: str) -> str:
    """X of the ``jaxlib==X`` build requirement (the oldest supported jaxlib)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10 (a plain CMake build; pip needs 3.11): the quoted strings
        with open(pyproject) as f:
            requires = re.findall(r'"([^"]*)"', f.read().split("[project]")[0])
    else:
        with open(pyproject, "rb") as f:
            requires = tomllib.load(f)["build-system"]["requires"]
    for req in requires:
        m = re.fullmatch(r"\s*jaxlib\s*==\s*([0-9][0-9.]*)\s*(;.*)?", req)  # with a marker or not
        if m:
            return m.group(1)
    raise SystemExit(f"no jaxlib==X pin in [build-system] requires of {pyproject}: {requires}")


def environment_jaxlib() -> tuple[str, str]:
    """(version, include dir) of the jaxlib installed for this Python, without importing it."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"jaxlib is not installed for {sys.executable} (pip install jaxlib)")
    include = os.path.join(list(spec.submodule_search_locations)[0], "include")
    if not os.path.isfile(os.path.join(include, "xla", "ffi", "api", "c_api.h")):
        raise SystemExit(f"the installed jaxlib has no XLA FFI headers under {include}")
    return importlib.metadata.version("jaxlib"), include


def fetch(version: str, cache_dir: str) -> tuple[str | None, str]:
    """The include dir of jaxlib ``version``'s FFI headers under ``cache_dir`` (downloading its wheel
    once), or (None, why it failed)."""
    dest = os.path.join(cache_dir, f"jaxlib-{version}", "include")
    api = os.path.join(dest, "xla", "ffi", "api")
    if all(os.path.isfile(os.path.join(api, h)) for h in HEADERS):
        return dest, ""
    # First a wheel for this interpreter (likely in pip's cache already), then a fixed one: the
    # headers are the same in every wheel of a release.
    attempts = ([], ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
                     "--platform", "manylinux_2_27_x86_64"])
    why = ""
    with tempfile.TemporaryDirectory() as tmp:
        for extra in attempts:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--retries", "2",
                   "--disable-pip-version-check", "-d", tmp, f"jaxlib=={version}", *extra]
            r = subprocess.run(cmd, capture_output=True, text=True)
            wheels = [w for w in os.listdir(tmp) if w.startswith("jaxlib-") and w.endswith(".whl")]
            if r.returncode == 0 and wheels:
                break
            errors = [ln for ln in r.stderr.splitlines() if ln.startswith("ERROR")]
            why = "; ".join(errors[-1:] or r.stderr.strip().splitlines()[-1:]) or f"pip exited with {r.returncode}"
        else:
            return None, f"pip download jaxlib=={version} failed: {why}"
        os.makedirs(api, exist_ok=True)
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as z:
            names = set(z.namelist())
            for h in HEADERS:
                member = f"jaxlib/include/xla/ffi/api/{h}"
                if member not in names:
                    return None, f"{wheels[0]} has no {member}"
                with z.open(member) as src, open(os.path.join(api, h) + ".tmp", "wb") as out:
                    out.write(src.read())
            for h in HEADERS:
                os.replace(os.path.join(api, h) + ".tmp", os.path.join(api, h))
    return dest, ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pyproject", required=True)
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--mode", default="auto", help="auto (default), env, or an include directory")
    a = ap.parse_args()
    note = ""
    if a.mode not in ("auto", "env"):
        include, version, source = os.path.abspath(a.mode), "unknown", "path"
    else:
        version, include = environment_jaxlib()
        source = "environment"
        if a.mode == "auto":
            pin = pinned_jaxlib(a.pyproject)
            if version_tuple(version) > version_tuple(pin):
                fetched, note = fetch(pin, a.cache_dir)
                if fetched:
                    version, include, source = pin, fetched, "pinned"
    major, minor = api_version(include)
    print(";".join([include, version, str(major), str(minor), source, note.replace(";", ",")]))


if __name__ == "__main__":
    main()
