#include "bench_spin.h"
#include "flexep/cuda/runtime.h"

namespace flexep::tools {
namespace {

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void spin_kernel(unsigned long long ns) {
  const unsigned long long start = global_ns();
  while (global_ns() - start < ns) __nanosleep(500);
}

}  // namespace

void launch_spin(double microseconds, cudaStream_t stream) {
  spin_kernel<<<1, 1, 0, stream>>>(static_cast<unsigned long long>(microseconds * 1000.0));
  FLEXEP_CUDA_CHECK_LAUNCH("bench spin_kernel");
}

}  // namespace flexep::tools
