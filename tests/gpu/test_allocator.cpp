// The device allocator frees a tensor on the stream it was allocated on, not on the stream that
// happens to be current when the tensor is released (cuda/runtime.h).
#include <gtest/gtest.h>

#include <optional>
#include <vector>

#include "allocator_kernels.h"
#include "flexep/core/tensor.h"
#include "flexep/cuda/runtime.h"

namespace flexep::testing {
namespace {

TEST(CudaAllocator, ReleasedOutsideItsStreamStaysOrderedAfterItsKernels) {
  cuda::init();
  cudaStream_t a = nullptr, b = nullptr;  // non-blocking: not ordered with the legacy stream
  ASSERT_EQ(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), cudaSuccess);
  constexpr long long n = 1 << 20;
  std::optional<Tensor> first;
  {
    const cuda::StreamGuard on_a(a);
    first.emplace(Tensor::empty({n}, DType::f32, Device::cuda(0)));
    launch_late_fill(first->data<float>(), n, 1.0f, 50, a);  // writes in ~50 ms
  }
  first.reset();  // released while the legacy stream is current and the kernel still waits
  std::vector<float> got(n, -1.0f);
  {
    const cuda::StreamGuard on_b(b);
    Tensor second = Tensor::empty({n}, DType::f32, Device::cuda(0));
    ASSERT_EQ(cudaMemsetAsync(second.raw(), 0, n * sizeof(float), b), cudaSuccess);
    // If the pool gave `second` the memory of `first` before a's kernel ran, that kernel's ones
    // land in it after the zeros.
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got.data(), second.raw(), n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  }
  long long ones = 0;
  for (float v : got) ones += v != 0.0f;
  EXPECT_EQ(ones, 0) << "the memory of a tensor released outside its stream was reused before its kernel ran";
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
}

}  // namespace
}  // namespace flexep::testing
