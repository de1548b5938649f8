// Exclusive prefix sums with CUB: the deterministic ranks behind the (destination rank, token)
// order of the send buffer and the (source rank, source token) order inside each expert group.
#include <cub/device/device_scan.cuh>

#include <climits>

#include "dispatch/alltoall/kernels/kernels.h"
#include "flexep/core/tensor.h"
#include "flexep/cuda/runtime.h"

namespace flexep::alltoall {

void exclusive_sum(const int* in, int* out, std::int64_t n, int device, cudaStream_t stream) {
  if (n == 0) return;
  FLEXEP_CHECK(n <= INT_MAX, "alltoall: scan of ", n, " items exceeds the 32-bit range");
  std::size_t bytes = 0;
  FLEXEP_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, bytes, in, out, static_cast<int>(n), stream));
  // Allocated and freed on `stream`, so the pool reuses it only after the scan.
  cuda::StreamGuard ordered(stream);
  Tensor temp = Tensor::empty({static_cast<std::int64_t>((bytes + 7) / 8 + 1)}, DType::i64, Device::cuda(device));
  FLEXEP_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(temp.raw(), bytes, in, out, static_cast<int>(n), stream));
}

}  // namespace flexep::alltoall
