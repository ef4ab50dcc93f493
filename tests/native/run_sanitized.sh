#!/usr/bin/env bash
# Build the native core's fuzz driver with ASan + UBSan (g++, -fno-sanitize-recover=all) in its own
# build directory and run it; then a ThreadSanitizer build of the same driver on fewer cases (the
# parallel launchers). Any sanitizer report, oracle mismatch or invariant failure exits non-zero.
#
#   tests/native/run_sanitized.sh [CASES_PER_OP] [SEED ...]
#
# Defaults: 20000 cases per op (the CI run; the full run is e.g. `run_sanitized.sh 200000 1 2 3`),
# seeds 1 2. Env: KVC_NATIVE_FUZZ_CASES overrides the default case count; KVC_SANITIZE_BUILD_DIR the
# build directory (default build/sanitize); CXX the compiler (default g++); PYTHON the interpreter used
# to configure the top-level project (default: python on PATH). Without a usable Python/JAX, the
# driver's own CMake project (tests/native) is configured instead: it needs no Python.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cases=${1:-${KVC_NATIVE_FUZZ_CASES:-20000}}
shift || true
seeds=("$@")
[ ${#seeds[@]} -gt 0 ] || seeds=(1 2)
build=${KVC_SANITIZE_BUILD_DIR:-$root/build/sanitize}
cxx=${CXX:-g++}
py=${PYTHON:-$(command -v python || command -v python3 || true)}
gen=()
command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)

configure_top() {
  [ -n "$py" ] && "$py" -c "import jax, nanobind" >/dev/null 2>&1 || return 1
  cmake -S "$root" -B "$build/top" "${gen[@]}" -DCMAKE_CXX_COMPILER="$cxx" -DJAX_KVCANARY_SANITIZE=ON \
    -DJAX_KVCANARY_CUDA=off -DPython_EXECUTABLE="$py" >"$build/configure.log" 2>&1 || return 1
  grep -q kvcanary_fuzz_driver "$build/top/CMakeFiles/TargetDirectories.txt" 2>/dev/null || return 1
  echo "$build/top"
}

mkdir -p "$build"
if dir=$(configure_top); then
  echo "configured top-level project with -DJAX_KVCANARY_SANITIZE=ON in $dir"
else
  dir="$build/native"
  cmake -S "$here" -B "$dir" "${gen[@]}" -DCMAKE_CXX_COMPILER="$cxx" -DJAX_KVCANARY_SANITIZE=ON \
    >"$build/configure.log" 2>&1 || { cat "$build/configure.log"; exit 1; }
  echo "configured tests/native standalone (sanitizers on) in $dir"
fi
cmake --build "$dir" --target kvcanary_fuzz_driver kvcanary_fuzz_driver_tsan
driver="$dir/tests/native/kvcanary_fuzz_driver"
[ -x "$driver" ] || driver="$dir/kvcanary_fuzz_driver"
tsan="${driver}_tsan"

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:halt_on_error=1:abort_on_error=0:strict_string_checks=1:detect_stack_use_after_return=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
for seed in "${seeds[@]}"; do
  echo "== fuzz_driver $cases cases/op, seed $seed (ASan + UBSan)"
  "$driver" "$cases" "$seed"
done
tsan_cases=$(( cases < 3000 ? cases : 3000 ))
echo "== fuzz_driver $tsan_cases cases/op, seed ${seeds[0]} (TSan)"
TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1} "$tsan" "$tsan_cases" "${seeds[0]}"
echo "sanitized native fuzz: OK"
