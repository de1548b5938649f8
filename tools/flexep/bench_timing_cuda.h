// Timing of GPU work for `flexep bench`: CUDA events around each repetition after a warm-up, on one
// stream; min/median/max in microseconds.
#pragma once

#include <cuda_runtime.h>

#include <functional>
#include <vector>

#include "bench_record.h"
#include "flexep/cuda/runtime.h"

namespace flexep::tools {

// Two CUDA events, reused for every repetition: the microseconds between one recorded on `stream`
// before fn() and one after it, once the second has completed.
class EventTimer {
 public:
  EventTimer() {
    FLEXEP_CUDA_CHECK(cudaEventCreate(&a_));
    FLEXEP_CUDA_CHECK(cudaEventCreate(&b_));
  }
  ~EventTimer() {
    cudaEventDestroy(a_);
    cudaEventDestroy(b_);
  }
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;

  double time_us(const std::function<void()>& fn, cudaStream_t stream) {
    FLEXEP_CUDA_CHECK(cudaEventRecord(a_, stream));
    fn();
    FLEXEP_CUDA_CHECK(cudaEventRecord(b_, stream));
    FLEXEP_CUDA_CHECK(cudaEventSynchronize(b_));
    float ms = 0;
    FLEXEP_CUDA_CHECK(cudaEventElapsedTime(&ms, a_, b_));
    return 1000.0 * ms;
  }

 private:
  cudaEvent_t a_ = nullptr, b_ = nullptr;
};

inline TimeStats time_cuda(const std::function<void()>& fn, int warmup, int reps, cudaStream_t stream) {
  for (int i = 0; i < warmup; ++i) fn();
  FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
  EventTimer timer;
  std::vector<double> us;
  for (int i = 0; i < reps; ++i) us.push_back(timer.time_us(fn, stream));
  return stats_of(us);
}

}  // namespace flexep::tools
