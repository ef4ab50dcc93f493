#!/usr/bin/env bash
# bench/gpu_check.sh: on a fresh GPU machine (no network; system Python with jax + jax-cuda plugin
# preinstalled), build jax_kvcanary with CUDA on, run the GPU tests and the GPU benchmarks, and print
# a summary. Budget: under 8 minutes on one H100/H200 (each step has its own time limit).
#
#   bash bench/gpu_check.sh              # from anywhere; works in the repository root
#
# Environment (all optional):
#   PYTHON                   interpreter (default python3)
#   CMAKE_CUDA_ARCHITECTURES CUDA architectures (default 90)
#   KVC_GPU_OUT              output folder for logs and results (default $OUT if set, else bench/results/gpu-check)
#   KVC_GPU_BUILD=cmake|pip  force the build path (default: pip when nanobind + scikit-build-core import,
#                            falling back to a plain CMake build if pip fails)
#   KVC_GPU_SANITIZE=0       skip the compute-sanitizer memcheck/racecheck step
#   KVC_GPU_BENCH=0          skip the benchmarks
#   KVC_GPU_SEEDS            seeds per config in tests/test_gpu.py (default 6)
#
# Build paths (everything after runs with the repository root on PYTHONPATH, for tests/ and bench/):
#   pip:   python -m pip install --no-build-isolation --no-deps . (JAX_KVCANARY_CUDA=on): the package
#          with both native modules is installed; the src/ layout keeps the tree from shadowing it.
#   cmake: cmake -S . -B build/gpu-check -DJAX_KVCANARY_CUDA=on; cmake --build; the two .so files are
#          copied into src/jax_kvcanary/ and src/ goes first on PYTHONPATH.
# Exit status: non-zero if the build, the import check or the GPU tests fail.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
PY=${PYTHON:-python3}
ARCH=${CMAKE_CUDA_ARCHITECTURES:-90}
out=${KVC_GPU_OUT:-${OUT:-$root/bench/results/gpu-check}}
mkdir -p "$out"
t_start=$(date +%s)
declare -a summary
status=0
note() { summary+=("$1"); echo "$1"; }
elapsed() { echo $(( $(date +%s) - t_start )); }
left() { echo $(( 470 - $(elapsed) )); }  # seconds left of the 8-minute budget (10 s of slack)

echo "== environment"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 || true
  command -v nvcc >/dev/null && nvcc --version | tail -2
  command -v cmake >/dev/null && cmake --version | head -1
  "$PY" -c "import sys, jax, jaxlib; print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__); print('devices', jax.devices())"
} 2>&1 | tee "$out/environment.txt"

echo "== build (CUDA on, sm_${ARCH//;/,sm_})"
export JAX_KVCANARY_CUDA=on
jobs=$(nproc 2>/dev/null || echo 8)
rm -f src/jax_kvcanary/_kvcanary*.so
have_pip_tools=0
"$PY" -c "import nanobind, scikit_build_core" >/dev/null 2>&1 && have_pip_tools=1
mode=${KVC_GPU_BUILD:-$([ $have_pip_tools = 1 ] && echo pip || echo cmake)}
t0=$(date +%s)
built=0
pypath="$root"
copy_modules() {  # newest build of each module -> src/jax_kvcanary/ (the cmake path)
  local m f
  for m in _kvcanary _kvcanary_cuda; do
    f=$(find "$@" -name "$m.*.so" -type f -printf '%T@ %p\n' 2>/dev/null | sort -nr | head -1 | cut -d' ' -f2-)
    [ -n "$f" ] && cp -f "$f" src/jax_kvcanary/ || return 1
  done
  pypath="$root/src:$root"
}
if [ "$mode" = pip ]; then
  if CMAKE_BUILD_PARALLEL_LEVEL=$jobs timeout 300 "$PY" -m pip install --no-build-isolation --no-deps --no-index \
       -C cmake.define.JAX_KVCANARY_CUDA=on -C "cmake.define.CMAKE_CUDA_ARCHITECTURES=$ARCH" \
       -C build-dir=build/gpu-check-pip -v . >"$out/build.log" 2>&1; then
    built=1
    note "build: pip install --no-build-isolation --no-deps: ok ($(( $(date +%s) - t0 )) s)"
  else
    note "build: pip install failed (see build.log); falling back to a plain CMake build"
    mode=cmake
  fi
fi
if [ "$mode" = cmake ] && [ $built = 0 ]; then
  gen=(); command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
  if timeout 120 cmake -S . -B build/gpu-check "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DJAX_KVCANARY_CUDA=on \
        -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DPython_EXECUTABLE="$(command -v "$PY")" >>"$out/build.log" 2>&1 &&
     timeout 300 cmake --build build/gpu-check -j "$jobs" >>"$out/build.log" 2>&1 && copy_modules build/gpu-check; then
    built=1
    note "build: plain CMake: ok ($(( $(date +%s) - t0 )) s)"
  else
    note "build: FAILED (see $out/build.log)"
  fi
fi
grep -E "warning[: ]|error[: ]" "$out/build.log" | grep -v "^--" | head -20
if [ $built = 0 ]; then
  tail -40 "$out/build.log"
  printf '%s\n' "== summary" "${summary[@]}"
  exit 1
fi
export PYTHONPATH="$pypath${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the tests start several processes

echo "== import check"
if "$PY" -c "
import jax, jax_kvcanary as kvc
from jax_kvcanary import _ffi
assert _ffi._kvcanary_cuda is not None, 'no _kvcanary_cuda'
assert 'gpu' in _ffi.NATIVE_PLATFORMS, _ffi.NATIVE_PLATFORMS
print('native platforms', sorted(_ffi.NATIVE_PLATFORMS), 'from', kvc.__file__)
print('gpu', jax.devices('gpu'))
" 2>&1 | tee "$out/import.txt"; then
  note "import: jax_kvcanary with CUDA handlers: ok"
else
  note "import: FAILED"
  printf '%s\n' "== summary" "${summary[@]}"
  exit 1
fi

echo "== GPU tests (pytest -m gpu)"
t0=$(date +%s)
timeout 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests --maxfail=5 -rfEs --durations=8 \
  --junitxml="$out/pytest-gpu.xml" 2>&1 | tee "$out/pytest-gpu.log"
rc=${PIPESTATUS[0]}
line=$(grep -E "passed|failed|error" "$out/pytest-gpu.log" | tail -1)
if [ "$rc" = 0 ]; then
  note "tests: pytest -m gpu: ok: $line ($(( $(date +%s) - t0 )) s)"
else
  [ "$rc" = 124 ] && line="timed out after 240 s; $line"
  note "tests: pytest -m gpu: FAILED (rc=$rc): $line"
  status=1
fi

if [ "${KVC_GPU_SANITIZE:-1}" != 0 ] && command -v compute-sanitizer >/dev/null 2>&1 && [ "$(left)" -gt 200 ]; then
  echo "== compute-sanitizer (memcheck, racecheck) on a few cases"
  cat >"$out/sanitize_cases.py" <<'EOF'
import os, sys
sys.path[:0] = [os.environ["KVC_ROOT"]]
import jax
from tests import test_gpu as T
from tests.support.cases import make_case, CONFIGS, x64_scope
from tests.support import gpu_cases
cases = [make_case(op, cfg, 0) for op in CONFIGS for cfg in list(CONFIGS[op])[:3]]
cases += [gpu_cases.stress_case(n, 0, scale="emu") for n in ("write_conflict_seeds", "verify_heavy", "plan_big")]
for c in cases:
    with x64_scope(c):
        T.run_on(c, "gpu", jit=False)
print("ran", len(cases), "cases")
EOF
  for tool in memcheck racecheck; do
    t0=$(date +%s)
    KVC_ROOT="$root" timeout 100 compute-sanitizer --tool $tool --target-processes all --print-limit 20 \
      "$PY" "$out/sanitize_cases.py" >"$out/sanitize-$tool.log" 2>&1
    rc=$?
    errs=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$out/sanitize-$tool.log" | tail -1)
    note "sanitizer: $tool rc=$rc: ${errs:-no summary} ($(( $(date +%s) - t0 )) s; informational)"
  done
else
  note "sanitizer: skipped (KVC_GPU_SANITIZE=0, no compute-sanitizer, or too little time left)"
fi

if [ "${KVC_GPU_BENCH:-1}" != 0 ]; then
  echo "== benchmark: CUDA paths (bench/gpu_bench.py --quick)"
  t0=$(date +%s)
  lim=$(left); [ "$lim" -gt 120 ] && lim=120; [ "$lim" -lt 30 ] && lim=30
  timeout "$lim" "$PY" bench/gpu_bench.py --quick --out "$out" 2>&1 | tee "$out/gpu_bench.log"
  rc=${PIPESTATUS[0]}
  note "bench: gpu_bench.py rc=$rc ($(( $(date +%s) - t0 )) s), table in $out/gpu_bench.log"
  budget=$(( $(left) - 5 ))
  if [ -f bench/cli.py ] && [ "$budget" -gt 60 ]; then
    echo "== benchmark: suite (python -m bench --platform gpu --quick), ${budget} s left"
    t0=$(date +%s)
    timeout "$budget" "$PY" -m bench --platform gpu --quick --out "$out" 2>&1 | tee "$out/bench-suite.log"
    rc=${PIPESTATUS[0]}
    note "bench: python -m bench --platform gpu --quick rc=$rc ($(( $(date +%s) - t0 )) s)"
  else
    note "bench: suite skipped (no bench/cli.py or < 60 s left)"
  fi
fi

echo
echo "== summary ($(elapsed) s)"
printf '  %s\n' "${summary[@]}"
if [ -f "$out/gpu_bench.log" ]; then
  echo "  -- CUDA paths (us per launch; x baseline = jitted gather/scatter time / ours):"
  grep -E "^(verify|write|plan) " "$out/gpu_bench.log" | sed 's/^/  /'
fi
if [ -f "$out/bench-suite.log" ]; then
  echo "  -- suite acceptance:"
  grep -E "^\s+\[(PASS|FAIL)\]" "$out/bench-suite.log" | sed 's/^/  /'
fi
echo "  outputs: $out"
exit $status
