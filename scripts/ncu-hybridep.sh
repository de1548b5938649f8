#!/usr/bin/env bash
# Profiles the hybridep v2 kernels of `flexep bench dsv3-ep2` with Nsight Compute on the GPU machine.
# The two ranks run as two processes (bench_processes.h); rank 0 runs under ncu, rank 1 without. ncu
# serialises rank 0's kernels but rank 1 runs on, so the kernels' waits for the peer still end.
# Only metrics that ncu collects in ONE pass: a replayed hybridep kernel would wait for peer flags
# that ncu restored to their old values (a timeout, not a profile). ncu tells when a section needs
# more passes; drop it then.
#   scripts/ncu-hybridep.sh [build dir] [SMs] [kernel regex]  -> $OUT/ncu-rank0.ncu-rep (+ .txt)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
build="${1:-build-gpu}" sms="${2:-16}" kernels="${3:-dispatch_kernel_v2|combine_kernel_v2}"
out="${OUT:-gpu-out}"
mkdir -p "$out"
id_file="$(mktemp -u /tmp/flexep-ncu-id.XXXXXX)"
export FLEXEP_WORLD_SIZE=2 FLEXEP_NCCL_ID_FILE="$id_file"
common=(bench dsv3-ep2 --backend hybridep --sms "$sms" --warmup 2 --reps 3 --out "$out")
FLEXEP_RANK=1 FLEXEP_LOCAL_RANK=1 "$build/flexep" "${common[@]}" > "$out/ncu-rank1.log" 2>&1 &
FLEXEP_RANK=0 FLEXEP_LOCAL_RANK=0 ncu --clock-control none --cache-control none \
  --kernel-name "regex:$kernels" --launch-skip 4 --launch-count 2 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
  --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum \
  -o "$out/ncu-rank0" -f "$build/flexep" "${common[@]}" > "$out/ncu-rank0.log" 2>&1
rc=$?
wait
ncu --import "$out/ncu-rank0.ncu-rep" --page details > "$out/ncu-rank0.txt" 2>&1 || true
rm -f "$id_file"
tail -5 "$out/ncu-rank0.log"
exit $rc
