#!/usr/bin/env bash
# Configures and builds flexep into build/ (or $FLEXEP_BUILD_DIR). Extra arguments go to cmake.
# CUDA code is compiled whenever nvcc is found (FLEXEP_CUDA=AUTO), also on machines without a GPU.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${FLEXEP_BUILD_DIR:-$root/build}"
jobs="${FLEXEP_JOBS:-$(nproc)}"
if [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then export PATH="/usr/local/cuda/bin:$PATH"; fi
# The CUDA kernels build on CUTLASS's headers (the nvidia-cutlass package, in .venv).
cutlass=()
if command -v nvcc >/dev/null; then cutlass=(-DFLEXEP_CUTLASS_INCLUDE="$("$root/scripts/cutlass-headers.sh")"); fi
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE="${FLEXEP_BUILD_TYPE:-Release}" "${cutlass[@]}" "$@" >/dev/null
cmake --build "$build" -j "$jobs" ${FLEXEP_TARGETS:+--target $FLEXEP_TARGETS}
