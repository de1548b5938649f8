#include "bench_spin.h"
#include "dispatch/hybridep/device/timer.cuh"
#include "flexep/cuda/runtime.h"

namespace flexep::tools {
namespace {

using hybridep::global_timer_ns;

__global__ void spin_kernel(unsigned long long ns) {
  const unsigned long long start = global_timer_ns();
  while (global_timer_ns() - start < ns) __nanosleep(500);
}

}  // namespace

void launch_spin(double microseconds, cudaStream_t stream) {
  spin_kernel<<<1, 1, 0, stream>>>(static_cast<unsigned long long>(microseconds * 1000.0));
  FLEXEP_CUDA_CHECK_LAUNCH("bench spin_kernel");
}

}  // namespace flexep::tools
