#!/usr/bin/env bash
# Starts flexep_launch_check as one process per GPU: with mpirun when asked (the OpenMPI way), else
# with plain background processes sharing the unique id through a file (any other launcher).
set -u
bin="$1"
mode="${2:-file}"
n="${FLEXEP_LAUNCH_RANKS:-2}"
export NCCL_NVLS_ENABLE=0
if [ "$mode" = mpirun ]; then
  exec mpirun --allow-run-as-root --oversubscribe -np "$n" -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH \
    -x FLEXEP_NCCL_ID_FILE="$(mktemp -u /tmp/flexep-id.XXXXXX)" "$bin"
fi
idfile="$(mktemp -u /tmp/flexep-id.XXXXXX)"
pids=()
for r in $(seq 0 $((n - 1))); do
  FLEXEP_RANK=$r FLEXEP_WORLD_SIZE=$n FLEXEP_LOCAL_RANK=$r FLEXEP_NCCL_ID_FILE="$idfile" "$bin" &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
rm -f "$idfile"
exit $status
