#!/usr/bin/env bash
# One wheel, every supported jax: build the package ONCE with build isolation (CPU module only), as
# `pip install .` does, then install that wheel into two fresh venvs, one with the oldest supported
# jax (the jaxlib==X pin of pyproject's [build-system] requires) and one with the newest jax the
# registry has for this Python, and check in each that the native CPU handlers are registered, that
# impl=None picks them, and that plan + write + verify + scatter give the same bytes as impl='xla'
# (tests/build/roundtrip.py); on the newest, also the direct handler calls and the donation tests.
#
#   tests/build/check_wheel_compat.sh PYTHON WORKDIR
#
# PYTHON: the interpreter to build and test with (e.g. a Python 3.12, whose newest jax is the newest
# released). WORKDIR: scratch space (wheel, CMake build dir, venvs); emptied first. Needs the package
# registry (pip). KVC_COMPAT_NEWEST=X tests jax X instead of the newest. Exits non-zero on any failure.
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 PYTHON WORKDIR" >&2; exit 2; }
py=$1
work=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
[ -n "$work" ] && [ "$work" != "/" ] || { echo "bad WORKDIR" >&2; exit 2; }
rm -rf "$work"
mkdir -p "$work"
work=$(cd "$work" && pwd)

quiet() {  # run a command; show its output (less pip's index notices) only if it fails
  local log="$work/last.log"
  if ! "$@" >"$log" 2>&1; then grep -v "WARNING: Location" "$log" | tail -40 >&2; return 1; fi
}

pin=$("$py" -c "import tomllib, re, sys
reqs = tomllib.load(open(sys.argv[1], 'rb'))['build-system']['requires']
print(next(m.group(1) for r in reqs if (m := re.fullmatch(r'\s*jaxlib\s*==\s*([0-9.]+)\s*(;.*)?', r))))" \
  "$root/pyproject.toml")
echo "python: $("$py" -c 'import sys; print(sys.version.split()[0])') ($py); oldest supported jaxlib (build pin): $pin"

echo "== build the wheel once (pip wheel, build isolation, JAX_KVCANARY_CUDA=off)"
t0=$SECONDS
(cd "$root" && JAX_KVCANARY_CUDA=off quiet "$py" -m pip wheel --no-deps -v . -w "$work/wheels" \
  -C build-dir="$work/build")
grep -h "XLA FFI headers:" "$work/last.log" | sed 's/^ *//' || true
wheel=$(ls "$work"/wheels/jax_kvcanary-*.whl)
echo "built $(basename "$wheel") in $(( SECONDS - t0 )) s"

check() {  # check NAME REQUIREMENT...: a fresh venv with the wheel and the requirements, then the round trip
  local name=$1; shift
  local venv="$work/venv-$name"
  echo "== $name: fresh venv, pip install <wheel> $*"
  t0=$SECONDS
  "$py" -m venv "$venv"
  quiet "$venv/bin/python" -m pip install --disable-pip-version-check "$wheel" "$@"
  (cd "$work" && JAX_PLATFORMS=cpu "$venv/bin/python" "$root/tests/build/roundtrip.py")
  echo "   ($(( SECONDS - t0 )) s)"
}

check oldest "jax==$pin" "jaxlib==$pin"
if [ -n "${KVC_COMPAT_NEWEST:-}" ]; then
  check newest "jax==$KVC_COMPAT_NEWEST" "jaxlib==$KVC_COMPAT_NEWEST"
else
  check newest jax
fi
# What changes with XLA itself: the handlers' argument and attribute decoding called directly
# (csrc/ffi_attrs.h relies on XLA passing the attributes sorted by name), and what the compiler
# copies in a donated step, on the newest jax
echo "== newest: direct handler calls and donation (pytest)"
t0=$SECONDS
quiet "$work/venv-newest/bin/python" -m pip install --disable-pip-version-check pytest
(cd "$root" && export JAX_PLATFORMS=cpu && quiet "$work/venv-newest/bin/python" -m pytest -q -p no:cacheprovider \
  tests/test_ffi_direct.py tests/test_donation.py)
tail -1 "$work/last.log"
echo "   ($(( SECONDS - t0 )) s)"
echo "wheel compat: ok (one wheel, native ffi == xla on jaxlib $pin and" \
  "$("$work/venv-newest/bin/python" -c 'import jaxlib; print(jaxlib.__version__)'))"
