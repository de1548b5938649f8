#!/usr/bin/env bash
# compute-sanitizer over the whole one-GPU suite (the GPU machine; after scripts/gpu-test.sh built
# build-gpu): every test of flexep_gpu_tests in its own process under each tool, N at once, each
# with a deadline, so that one slow or hanging test costs its deadline and not the sweep. Writes one
# log per (tool, test) and a summary (tool, test, exit status, errors) to $OUT/sanitize.
#   FLEXEP_SANITIZE_TOOLS   (default "memcheck racecheck synccheck")
#   FLEXEP_SANITIZE_FILTER  gtest filter of the tests to sweep (default: all of them)
#   FLEXEP_SANITIZE_EXCLUDE gtest patterns to leave out, ":"-separated (the soak: its own deadline)
#   FLEXEP_SANITIZE_SHARD   i/n: only every n-th test from the i-th (0-based), so that a sweep longer
#                           than one device call is split over n calls with the same list
#   FLEXEP_SANITIZE_JOBS    processes at once (default 8)
#   FLEXEP_SANITIZE_TIMEOUT seconds per test and tool (default 300)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${FLEXEP_BUILD_DIR:-$root/build-gpu}"
bin="$build/tests/flexep_gpu_tests"
out="${OUT:-$root/gpu-out}/sanitize"
mkdir -p "$out"
[ -x "$bin" ] || { echo "gpu-sanitize: no $bin (run scripts/gpu-test.sh first)" >&2; exit 2; }
nccl_root="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)"
export LD_LIBRARY_PATH="${nccl_root:+$nccl_root/lib:}${LD_LIBRARY_PATH:-}"
# The simulated-rank tests need what ctest gives them (tests/CMakeLists.txt).
export CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32
# One GPU: the tests of real multi-GPU ranks need two (their simulated-rank twins run).
tests="$("$bin" --gtest_list_tests --gtest_filter="${FLEXEP_SANITIZE_FILTER:-*}:-OneRankPerGpu/*:AlltoallMultiGpu.*:CommunicatorMultiGpu.*:*DISABLED_*${FLEXEP_SANITIZE_EXCLUDE:+:$FLEXEP_SANITIZE_EXCLUDE}" |
  awk '/^[^ ]/ {suite=$1} /^  / {print suite $1}')"
shard="${FLEXEP_SANITIZE_SHARD:-0/1}"
if ! [[ "$shard" =~ ^([0-9]+)/([1-9][0-9]*)$ ]] || (( BASH_REMATCH[1] >= BASH_REMATCH[2] )); then
  echo "gpu-sanitize: FLEXEP_SANITIZE_SHARD is '$shard'; expected i/n with 0 <= i < n" >&2
  exit 2
fi
tests="$(echo "$tests" | awk -v i="${BASH_REMATCH[1]}" -v n="${BASH_REMATCH[2]}" '(NR - 1) % n == i')"
echo "$(echo "$tests" | wc -l) tests (shard $shard) x ${FLEXEP_SANITIZE_TOOLS:-memcheck racecheck synccheck}"
one() {
  local tool=$1 test=$2 log
  log="$out/$tool-$(echo "$test" | tr '/' '_').log"
  timeout "${FLEXEP_SANITIZE_TIMEOUT:-300}" compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 3 \
    "$bin" --gtest_filter="$test" > "$log" 2>&1
  local rc=$? errors
  errors="$(grep -oE 'ERROR SUMMARY: [0-9]+' "$log" | tail -1 | grep -oE '[0-9]+$')"
  # A test that passed without touching the GPU gives the sanitizer nothing to check: clean.
  if grep -q "terminated before first instrumented API call" "$log" && grep -q '^\[  PASSED  \]' "$log"; then
    rc=0 errors=0
  fi
  echo "$tool $test rc=$rc errors=${errors:-?}"
}
export -f one
export out bin
for tool in ${FLEXEP_SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
  echo "$tests" | xargs -P "${FLEXEP_SANITIZE_JOBS:-8}" -I{} bash -c "one $tool '{}'"
done | tee "$out/summary.txt"
# Clean: every run exited 0 with 0 errors (124: the deadline; 3: errors found).
! grep -vE 'rc=0 errors=0$' "$out/summary.txt" > "$out/not-clean.txt"
status=$?
echo "not clean: $(wc -l < "$out/not-clean.txt") of $(wc -l < "$out/summary.txt")"
tar -C "$out" -czf "$out/../sanitize-logs.tgz" . 2>/dev/null || true
exit $status
