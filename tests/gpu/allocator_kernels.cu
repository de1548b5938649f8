#include "allocator_kernels.h"

#include "flexep/cuda/runtime.h"

namespace flexep::testing {
namespace {

__global__ void late_fill(float* x, long long n, float value, long long sleep_ns) {
  if (threadIdx.x == 0)
    for (long long slept = 0; slept < sleep_ns; slept += 1000) __nanosleep(1000);
  __syncthreads();
  for (long long i = threadIdx.x; i < n; i += blockDim.x) x[i] = value;
}

}  // namespace

void launch_late_fill(float* x, long long n, float value, int sleep_ms, cudaStream_t stream) {
  late_fill<<<1, 256, 0, stream>>>(x, n, value, static_cast<long long>(sleep_ms) * 1000000);
  FLEXEP_CUDA_CHECK_LAUNCH("late_fill");
}

}  // namespace flexep::testing
