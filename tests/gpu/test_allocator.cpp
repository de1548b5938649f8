// The device allocator frees a tensor on the stream it was allocated on, not on the stream that
// happens to be current when the tensor is released, or on the stream free_on moved it to
// (cuda/runtime.h).
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
  const cuda::OwnedStream a(cudaStreamNonBlocking), b(cudaStreamNonBlocking);  // not ordered with stream 0
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
}

// A stream destroyed before a tensor made on it (retired by its owner): the tensor is freed later
// without touching the dead stream, after the stream's kernel, and the pool stays usable.
TEST(CudaAllocator, TensorOutlivingItsStreamIsFreedAfterItsWork) {
  cuda::init();
  constexpr long long n = 1 << 20;
  std::optional<Tensor> orphan;
  {
    const cuda::OwnedStream s(cudaStreamNonBlocking);
    const cuda::StreamGuard on_s(s);
    orphan.emplace(Tensor::empty({n}, DType::f32, Device::cuda(0)));
    launch_late_fill(orphan->data<float>(), n, 2.0f, 20, s);
  }  // s retired (its kernel done) and destroyed here
  std::vector<float> got(n, 0.0f);
  ASSERT_EQ(cudaMemcpy(got.data(), orphan->raw(), n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  long long twos = 0;
  for (float v : got) twos += v == 2.0f;
  EXPECT_EQ(twos, n) << "retiring the stream did not wait for its kernel";
  orphan.reset();  // freed on the legacy stream, not on the destroyed one
  Tensor next = Tensor::zeros({n}, DType::f32, Device::cuda(0));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(got.data(), next.raw(), n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  long long nonzero = 0;
  for (float v : got) nonzero += v != 0.0f;
  EXPECT_EQ(nonzero, 0);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// Made on one stream, last used on another that joined it (a side stream's output read by the
// caller's stream): free_on, given a view inside the allocation, orders the free behind the
// reader's work. Freed on the idle maker's stream instead, the memory would be handed at once to a
// third stream's allocation while the reader still writes it.
TEST(CudaAllocator, FreeOnOrdersTheFreeBehindTheLastReader) {
  cuda::init();
  const cuda::OwnedStream maker(cudaStreamNonBlocking), reader(cudaStreamNonBlocking), third(cudaStreamNonBlocking);
  constexpr long long n = 1 << 20;
  std::optional<Tensor> made;
  {
    const cuda::StreamGuard on_maker(maker);
    made.emplace(Tensor::zeros({n}, DType::f32, Device::cuda(0)));
  }
  cudaEvent_t ready = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(ready, maker), cudaSuccess);
  ASSERT_EQ(cudaStreamWaitEvent(reader, ready, 0), cudaSuccess);
  launch_late_fill(made->data<float>(), n, 3.0f, 50, reader);
  ASSERT_EQ(cudaStreamSynchronize(maker), cudaSuccess);  // the maker is idle: its free would complete at once
  cuda::free_on(made->view().rows(n / 2, n / 2 + 8), reader);
  made.reset();
  std::vector<float> got(n, -1.0f);
  {
    const cuda::StreamGuard on_third(third);
    Tensor next = Tensor::empty({n}, DType::f32, Device::cuda(0));
    ASSERT_EQ(cudaMemsetAsync(next.raw(), 0, n * sizeof(float), third), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got.data(), next.raw(), n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  }
  long long threes = 0;
  for (float v : got) threes += v != 0.0f;
  EXPECT_EQ(threes, 0) << "memory moved to the reader's stream was reused before the reader's kernel ran";
  ASSERT_EQ(cudaEventDestroy(ready), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace flexep::testing
