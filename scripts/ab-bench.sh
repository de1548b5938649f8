#!/usr/bin/env bash
# A/B benchmarks of several commits on the GPU machine, the way docs/hybridep-history.md's experiments are
# measured: every variant built from its own tree, then the same `flexep bench` command run for
# each variant in turn, several rounds, alternating, so that the machine's drift (clocks, another
# tenant, HBM temperature) hits every variant alike. Compare variants within one run only: the same
# code can read a few percent apart on another machine.
#
# The GPU machine gets a copy of the working tree without .git, so the trees are packed here:
#   scripts/ab-bench.sh pack <commit> [<commit> ...]     (here: .ab/<short>.tar + .ab/<short>.COMMIT)
# and built and run there (carry `.ab` with the device call):
#   scripts/ab-bench.sh run "<flexep bench arguments>" ["<more bench arguments>" ...]
#     AB_ROUNDS (default 2), AB_OUT (default $OUT/ab or ab-out), AB_JOBS (build jobs per variant),
#     AB_TESTS (a gtest filter run on every variant after the benches, e.g. 'Kernels/HybridEpOneRank.*')
# Each run prints its deepep, hybridep and alltoall time records (phase, timing, SMs, median us) per variant
# and round; the JSON of every run (with its commit) and the logs go to AB_OUT; on the device ($OUT
# set) they come back as two archives, AB_OUT/bench-json.tgz and AB_OUT/logs.tgz.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="$root/.ab"

pack() {
  mkdir -p "$dir"
  for c in "$@"; do
    local full short
    if ! full="$(git -C "$root" rev-parse --verify --quiet "$c^{commit}")"; then
      echo "ab-bench: no commit '$c'" >&2
      exit 2
    fi
    short="${full:0:8}"
    git -C "$root" archive --format=tar -o "$dir/$short.tar" "$full"
    echo "$full" > "$dir/$short.COMMIT"
    echo "packed $c as .ab/$short.tar"
  done
}

run() {
  if [ $# -lt 1 ]; then
    echo "ab-bench run: give the flexep bench arguments, e.g. \"decode --backend hybridep --sms 16,32\"" >&2
    exit 2
  fi
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  local out="${AB_OUT:-${OUT:+$OUT/ab}}"
  out="${out:-$root/ab-out}"
  mkdir -p "$out/bench"
  local variants=()
  for tar in "$dir"/*.tar; do
    [ -e "$tar" ] || { echo "ab-bench run: nothing in .ab (scripts/ab-bench.sh pack <commit>...)" >&2; exit 2; }
    variants+=("$(basename "$tar" .tar)")
  done
  local cores jobs
  cores="$(nproc)"
  jobs="${AB_JOBS:-$(( cores / ${#variants[@]} > 0 ? cores / ${#variants[@]} : 1 ))}"
  for v in "${variants[@]}"; do
    mkdir -p "/tmp/ab/$v" && tar -xf "$dir/$v.tar" -C "/tmp/ab/$v" && cp "$dir/$v.COMMIT" "/tmp/ab/$v/COMMIT"
    # Every variant is built by this tree's gpu-test.sh (the same procedure for all); without
    # AB_TESTS only the flexep program (the benchmarks), so the builds take less.
    cp "$root/scripts/gpu-test.sh" "/tmp/ab/$v/scripts/gpu-test.sh"
    local targets=flexep
    [ -n "${AB_TESTS:-}" ] && targets=""
    (cd "/tmp/ab/$v" && FLEXEP_GPU_TESTS=0 FLEXEP_BENCH=0 FLEXEP_JOBS="$jobs" OUT="$out/build-$v" \
       FLEXEP_BUILD_TARGETS="$targets" \
       bash scripts/gpu-test.sh > "$out/build-$v.txt" 2>&1; echo "built $v: rc=$?") &
  done
  wait
  local nccl_root
  nccl_root="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)"
  export LD_LIBRARY_PATH="${nccl_root:+$nccl_root/lib:}${LD_LIBRARY_PATH:-}"
  local status=0
  for round in $(seq 1 "${AB_ROUNDS:-2}"); do
    for v in "${variants[@]}"; do
      local i=0
      for args in "$@"; do
        i=$((i + 1))
        local log="$out/bench-$v-$round-$i.txt"
        # shellcheck disable=SC2086
        if ! "/tmp/ab/$v/build-gpu/flexep" bench $args --out "$out/bench" > "$log" 2>&1; then
          status=1
          echo "$v round $round: FAILED ($log)"
        fi
        echo "$v round $round: $args"
        # case routing backend phase timing SMs min median ...: the backend, phase, timing, SMs and median
        awk '$3 ~ /^(deepep|hybridep|alltoall|nccl-alltoall)$/ && $6 ~ /^[0-9]+$|^-$/ {
               printf "  %s %s %s %s: %s\n", $3, $4, $5, $6, $8 }' "$log"
      done
    done
  done
  if [ -n "${AB_TESTS:-}" ]; then
    for v in "${variants[@]}"; do
      # Simulated ranks need both (docs/gpu.md); the other tests do not mind them.
      CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32 \
        "/tmp/ab/$v/build-gpu/tests/flexep_gpu_tests" --gtest_filter="$AB_TESTS" > "$out/tests-$v.txt" 2>&1
      local rc=$?
      echo "tests $v ($AB_TESTS): rc=$rc, $(grep -cE '^\[ +OK ' "$out/tests-$v.txt") ok"
      [ $rc = 0 ] || status=$rc
    done
  fi
  # The device tool returns a few files only (at most eight): the JSON of every run as one archive,
  # and under $OUT everything else (builds' logs, bench and test logs) as a second one.
  tar -C "$out/bench" -czf "$out/bench-json.tgz" . 2>/dev/null || true
  if [ -n "${OUT:-}" ]; then
    (cd "$out" && tar -czf logs.tgz --exclude=bench-json.tgz --exclude=logs.tgz . 2>/dev/null &&
       find . -mindepth 1 -maxdepth 1 ! -name bench-json.tgz ! -name logs.tgz -exec rm -rf {} +)
  fi
  return $status
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  run) shift; run "$@" ;;
  *) sed -n '2,15p' "$0"; exit 2 ;;
esac
