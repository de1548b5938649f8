#!/usr/bin/env bash
# Profiles the hybridep kernels of `flexep bench dsv3-ep2` with Nsight Compute on the GPU machine.
#   scripts/ncu-hybridep.sh [build dir] [SMs] [kernel regex] [ranks] [case]
#     -> $OUT/ncu-rank0.ncu-rep (+ .txt, -source.csv); case: dsv3-ep2 (default) or decode (the fused
#     small-call kernel: kernel regex dispatch_small_kernel)
#
# ranks 1 (default): one process on GPU 0, a one-rank hybridep (every row local, no peer). ncu may
#   replay a kernel as often as its sections need: nothing outside the process writes the flags it
#   waits for, so a replay restores everything the kernel reads. The per-SM load/store behaviour is
#   that of the two-rank case; the NVLink part is absent.
# ranks 2: the two ranks as two processes (bench_processes.h); rank 0 runs under ncu, rank 1 without.
#   ncu serialises rank 0's kernels but rank 1 runs on, so the kernels' waits for the peer still end.
#   Only metrics that ncu collects in ONE pass: a replayed kernel waits for peer flags that ncu
#   restored to their old values (the dispatch kernel happened to survive 17 passes, the combine
#   kernel did not). ncu prints the number of passes: more than 1 means drop a metric.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
build="${1:-build-gpu}" sms="${2:-16}" kernels="${3:-dispatch_kernel|combine_kernel}" ranks="${4:-1}"
case_name="${5:-dsv3-ep2}"
out="${OUT:-gpu-out}"
mkdir -p "$out"
common=(bench "$case_name" --backend hybridep --sms "$sms" --warmup 2 --reps 3 --out "$out")
# The first launches are warm-up; one launch of each kernel is enough.
profile=(--clock-control none --kernel-name "regex:$kernels" --launch-skip 4 --launch-count 2)
if [ "$ranks" = 1 ]; then
  CUDA_VISIBLE_DEVICES=0 ncu "${profile[@]}" --set full -o "$out/ncu-rank0" -f \
    "$build/flexep" "${common[@]}" > "$out/ncu-rank0.log" 2>&1
  rc=$?
else
  id_file="$(mktemp -u /tmp/flexep-ncu-id.XXXXXX)"
  export FLEXEP_WORLD_SIZE=2 FLEXEP_NCCL_ID_FILE="$id_file"
  FLEXEP_RANK=1 FLEXEP_LOCAL_RANK=1 "$build/flexep" "${common[@]}" > "$out/ncu-rank1.log" 2>&1 &
  FLEXEP_RANK=0 FLEXEP_LOCAL_RANK=0 ncu "${profile[@]}" --cache-control none \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed \
    -o "$out/ncu-rank0" -f "$build/flexep" "${common[@]}" > "$out/ncu-rank0.log" 2>&1
  rc=$?
  wait
  rm -f "$id_file"
fi
ncu --import "$out/ncu-rank0.ncu-rep" --page details > "$out/ncu-rank0.txt" 2>&1 || true
# Per-instruction warp-stall samples (SASS): where docs/hybridep.md's "Where the time goes per ncu" comes from.
ncu --import "$out/ncu-rank0.ncu-rep" --page source --csv --print-source sass > "$out/ncu-rank0-source.csv" 2>/dev/null || true
tail -5 "$out/ncu-rank0.log"
exit $rc
