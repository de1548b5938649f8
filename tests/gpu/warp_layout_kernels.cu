#include "dispatch/hybridep/kernels/warp_layout.cuh"
#include "flexep/cuda/runtime.h"
#include "gpu/warp_layout_kernels.h"

namespace flexep::testing {
namespace {

__global__ void warp_layout_kernel(const long long* pairs, hybridep::LayoutParams p, long long* begin, long long* kept,
                                   long long* tpe, long long* totals) {
  const hybridep::ReceiverTotals t = hybridep::warp_receiver_layout(pairs, p, begin, kept, tpe, threadIdx.x);
  if (threadIdx.x == 0) {
    totals[0] = t.required;
    totals[1] = t.out_rows;
    totals[2] = t.used;
    totals[3] = t.dropped;
    totals[4] = t.overflow ? 1 : 0;
  }
}

}  // namespace

void run_warp_receiver_layout(const std::int64_t* pairs, int ranks, int experts, std::int64_t pad_multiple,
                              std::int64_t budget, bool drop, std::int64_t* begin, std::int64_t* kept,
                              std::int64_t* tpe, std::int64_t* totals, cudaStream_t stream) {
  const hybridep::LayoutParams p{ranks, experts, pad_multiple, budget, drop};
  // int64_t is long on Linux, long long in the kernels: the same 64-bit words.
  warp_layout_kernel<<<1, 32, 0, stream>>>(reinterpret_cast<const long long*>(pairs), p,
                                           reinterpret_cast<long long*>(begin), reinterpret_cast<long long*>(kept),
                                           reinterpret_cast<long long*>(tpe), reinterpret_cast<long long*>(totals));
  FLEXEP_CUDA_CHECK_LAUNCH("warp_layout_kernel");
}

}  // namespace flexep::testing
