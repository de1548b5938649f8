// Timing of GPU work for `flexep bench`: CUDA events around each repetition after a warm-up, on one
// stream; min/median/max in microseconds.
#pragma once

#include <cuda_runtime.h>

#include <functional>
#include <vector>

#include "bench_record.h"
#include "flexep/cuda/runtime.h"

namespace flexep::tools {

inline TimeStats time_cuda(const std::function<void()>& fn, int warmup, int reps, cudaStream_t stream) {
  for (int i = 0; i < warmup; ++i) fn();
  FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaEvent_t a, b;
  FLEXEP_CUDA_CHECK(cudaEventCreate(&a));
  FLEXEP_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> us;
  for (int i = 0; i < reps; ++i) {
    FLEXEP_CUDA_CHECK(cudaEventRecord(a, stream));
    fn();
    FLEXEP_CUDA_CHECK(cudaEventRecord(b, stream));
    FLEXEP_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    FLEXEP_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    us.push_back(1000.0 * ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return stats_of(us);
}

}  // namespace flexep::tools
