#!/usr/bin/env bash
# The one command for the GPU machine (see docs/gpu.md): builds against the NCCL that PyTorch's
# wheel ships (the library PyTorch loads), runs the GPU tests (ctest label gpu, which includes
# multigpu), runs the benchmark cases of bench/device-cases.txt, and copies logs and JSON to $OUT.
#   FLEXEP_GPU_TESTS=0      skip the tests     FLEXEP_BENCH=0   skip the benchmarks
#   FLEXEP_CTEST_ARGS=...   extra ctest arguments (e.g. -R Permute)
#   FLEXEP_SANITIZER=memcheck|racecheck   run the GPU test binary under compute-sanitizer instead
#   FLEXEP_CMAKE_ARGS=...   extra configure arguments
#   FLEXEP_BUILD_TARGETS=.. build only these targets (e.g. flexep: the benchmarks, no tests)
#   FLEXEP_PYTHON=1         also build the Python extension, then run the one-GPU PyTorch tests
#                           (python/tests/gpu/test_torch_1gpu.py, test_deepep_1gpu.py, test_fuzz_1gpu.py) and
#                           bench/automodel_layer_bench.py
#                           against NeMo Automodel 0.7.0, installed (--no-deps) from the wheel in .whl/
#                           (pip download --no-deps nemo-automodel==0.7.0 -d .whl; carry .whl)
#   FLEXEP_TORCH_BENCH=0    with FLEXEP_PYTHON=1: the PyTorch tests without the Automodel benchmark
set -uo pipefail
# NVLink multicast can take the host's GPUs out of service: never let anything enable it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The device's copy of the tree has no history: the benchmark JSON takes the commit from COMMIT
# (git rev-parse HEAD > COMMIT here, carried to the device), through FLEXEP_COMMIT.
if [ -z "${FLEXEP_COMMIT:-}" ] && [ -f "$root/COMMIT" ]; then export FLEXEP_COMMIT="$(cat "$root/COMMIT")"; fi
out="${OUT:-$root/gpu-out}"
build="${FLEXEP_BUILD_DIR:-$root/build-gpu}"
mkdir -p "$out"
status=0
step() { echo "== $*" | tee -a "$out/summary.txt"; }

step "machine"
{ nvidia-smi; nvidia-smi topo -m; } > "$out/machine.txt" 2>&1 || true
nccl_root="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)"
echo "NCCL (PyTorch wheel): ${nccl_root:-not found}" | tee -a "$out/summary.txt"

step "build"
python_args=()
if [ "${FLEXEP_PYTHON:-0}" = 1 ]; then python_args=(-DFLEXEP_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v python3)"); fi
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLEXEP_CUDA=ON \
 ${nccl_root:+-DFLEXEP_NCCL_ROOT=$nccl_root} "${python_args[@]}" ${FLEXEP_CMAKE_ARGS:-} > "$out/configure.log" 2>&1 \
 || { cat "$out/configure.log"; exit 1; }
# shellcheck disable=SC2086
if ! cmake --build "$build" -j "${FLEXEP_JOBS:-32}" ${FLEXEP_BUILD_TARGETS:+--target $FLEXEP_BUILD_TARGETS} > "$out/build.log" 2>&1; then
  grep -E "error|Error" "$out/build.log" | head -40
  exit 1
fi
export LD_LIBRARY_PATH="${nccl_root:+$nccl_root/lib:}${LD_LIBRARY_PATH:-}"

if [ "${FLEXEP_SANITIZER:-}" != "" ]; then
  step "compute-sanitizer --tool ${FLEXEP_SANITIZER}"
  # The simulated-rank tests need what ctest gives them (tests/CMakeLists.txt): eager module
  # loading and a hardware queue per rank.
  CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32 \
  compute-sanitizer --tool "$FLEXEP_SANITIZER" --report-api-errors no --error-exitcode 3 "$build/tests/flexep_gpu_tests" \
    ${FLEXEP_GTEST_FILTER:+--gtest_filter=$FLEXEP_GTEST_FILTER} > "$out/sanitizer-${FLEXEP_SANITIZER}.log" 2>&1
  rc=$?; tail -5 "$out/sanitizer-${FLEXEP_SANITIZER}.log"; [ $rc = 0 ] || status=$rc
fi

if [ "${FLEXEP_GPU_TESTS:-1}" = 1 ]; then
  step "GPU tests"
  # One GPU: the multigpu label needs two (the hybridep suite still runs, on simulated ranks).
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  one_gpu=()
  if [ "${gpus:-0}" -lt 2 ]; then
    one_gpu=(-LE multigpu)
    echo "one GPU: the multigpu tests are left out; SimulatedRanks/* runs the hybridep ones" | tee -a "$out/summary.txt"
  fi
  ctest --test-dir "$build" -L gpu "${one_gpu[@]}" --output-on-failure --timeout "${FLEXEP_TEST_TIMEOUT:-120}" -j 2 \
    ${FLEXEP_CTEST_ARGS:-} > "$out/ctest-gpu.log" 2>&1
  rc=$?; grep -E "tests passed|tests failed|\*\*\*Failed|Failed|Timeout" "$out/ctest-gpu.log" | tail -30; [ $rc = 0 ] || status=$rc
fi

if [ "${FLEXEP_PYTHON:-0}" = 1 ]; then
  step "PyTorch on one GPU against NeMo Automodel 0.7.0"
  site="$build/automodel-site"
  wheel="$(ls "$root"/.whl/nemo_automodel-0.7.0-*.whl 2>/dev/null | head -1)"
  if [ -n "$wheel" ] && [ ! -d "$site/nemo_automodel" ]; then
    python3 -m pip install --quiet --no-deps --target "$site" "$wheel" > "$out/automodel-install.log" 2>&1 || status=1
  fi
  export PYTHONPATH="$build/python:$site${PYTHONPATH:+:$PYTHONPATH}"
  timeout "${FLEXEP_PYTEST_TIMEOUT:-300}" python3 -m pytest -q -s "$root/python/tests/gpu/test_torch_1gpu.py" "$root/python/tests/gpu/test_deepep_1gpu.py" \
    "$root/python/tests/gpu/test_fuzz_1gpu.py" > "$out/pytest-gpu.log" 2>&1
  rc=$?; grep -E "passed|failed|agree|losses|Error" "$out/pytest-gpu.log" | tail -12; [ $rc = 0 ] || status=$rc
  if [ "${FLEXEP_TORCH_BENCH:-1}" = 1 ]; then
    mkdir -p "$root/bench/results"
    timeout "${FLEXEP_TORCH_BENCH_TIMEOUT:-240}" python3 "$root/bench/automodel_layer_bench.py" --out "$root/bench/results" \
      > "$out/automodel-bench.log" 2>&1
    rc=$?; tail -8 "$out/automodel-bench.log"; [ $rc = 0 ] || status=$rc
  fi
fi

if [ "${FLEXEP_BENCH:-1}" = 1 ] && [ -f "$root/bench/device-cases.txt" ]; then
  step "benchmarks"
  mkdir -p "$root/bench/results"
  while IFS= read -r line; do
    case "$line" in ''|'#'*) continue ;; esac
    echo "-- flexep bench $line" | tee -a "$out/bench.log"
    # shellcheck disable=SC2086
    "$build/flexep" bench $line --out "$root/bench/results" >> "$out/bench.log" 2>&1 || { status=1; echo "   FAILED" | tee -a "$out/bench.log"; }
  done < "$root/bench/device-cases.txt"
  tail -40 "$out/bench.log"
  # Results come back as one archive (the device tool returns at most 8 files).
  tar -C "$root/bench/results" -czf "$out/bench-results.tgz" . 2>/dev/null || true
fi

[ -d "$root/bench/results" ] && tar -C "$root/bench/results" -czf "$out/bench-results.tgz" . 2>/dev/null || true
step "done (status $status)"
exit $status
