// A test kernel for the device allocator's stream ordering (test_allocator.cpp).
#pragma once

#include <cuda_runtime.h>

namespace flexep::testing {

// One thread block that waits about `sleep_ms` on the GPU, then writes `value` to x[0..n).
void launch_late_fill(float* x, long long n, float value, int sleep_ms, cudaStream_t stream);

}  // namespace flexep::testing
