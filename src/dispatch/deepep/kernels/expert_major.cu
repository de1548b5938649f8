// The expert-major layout over the rank-major rows, on this rank only: the rows gathered into their
// experts' lists, and level 1 of the combine (each received row's entries summed in fixed order).
#include <cuda_bf16.h>

#include "dispatch/deepep/device/copy_row.cuh"
#include "dispatch/deepep/kernels/kernels.h"
#include "flexep/cuda/runtime.h"

namespace flexep::deepep {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

int grid_for(std::int64_t warps_needed) {
  const std::int64_t ctas = (warps_needed + kWarps - 1) / kWarps;
  return static_cast<int>(ctas < 1 ? 1 : (ctas > 65535 ? 65535 : ctas));
}

template <class V>
__global__ void __launch_bounds__(kThreads) gather_rows_kernel(const V* rows, const int* index, std::int64_t entries,
                                                               std::int64_t vectors, V* out) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * kWarps;
  for (std::int64_t p = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; p < entries; p += warps) {
    const int r = index[p];
    V* to = out + p * vectors;
    if (r < 0)
      zero_row(to, vectors, lane);
    else
      copy_row<RowSource::l2>(rows + static_cast<std::int64_t>(r) * vectors, to, vectors, lane);  // the window
  }
}

__global__ void __launch_bounds__(kThreads) sum_rows_kernel(SumRowsCall c) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * kWarps;
  const std::int64_t vectors = c.hidden / 8;
  const auto* entries = static_cast<const uint4*>(c.entries);
  const std::int64_t rows = c.layout == nullptr ? c.rows : received_rows(c.layout);
  for (std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; r < rows; r += warps) {
    const int* order = c.row_order + r * c.k;
    for (std::int64_t v = lane; v < vectors; v += 32) {
      float acc[8] = {};
      for (int n = 0; n < c.k && order[n] >= 0; ++n) {
        const uint4 raw = entries[static_cast<std::int64_t>(order[n]) * vectors + v];
        const auto* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += __bfloat162float(h[i]);
      }
      uint4 packed;
      auto* o = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] = __float2bfloat16_rn(acc[i]);
      static_cast<uint4*>(c.out)[r * vectors + v] = packed;
    }
    // Keyed on grad_w, not grad_probs: a budget of 0 entries leaves grad_probs empty (null) while
    // every received row still needs its zero weight gradients.
    if (c.grad_w != nullptr)
      for (int j = lane; j < c.k; j += 32) {
        const int p = c.slot_pos[r * c.k + j];
        c.grad_w[r * c.k + j] = p >= 0 ? c.grad_probs[p] : 0.0f;
      }
  }
}

}  // namespace

void launch_gather_rows(const void* rows, const int* index, std::int64_t entries, long long row_bytes, void* out,
                        cudaStream_t stream) {
  if (entries == 0) return;
  gather_rows_kernel<<<grid_for(entries), kThreads, 0, stream>>>(static_cast<const uint4*>(rows), index, entries,
                                                                 row_bytes / 16, static_cast<uint4*>(out));
  FLEXEP_CUDA_CHECK_LAUNCH("deepep gather_rows_kernel");
}

void launch_gather_scales(const float* scales, const int* index, std::int64_t entries, int scale_cols, float* out,
                          cudaStream_t stream) {
  if (entries == 0) return;
  gather_rows_kernel<<<grid_for(entries), kThreads, 0, stream>>>(scales, index, entries, scale_cols, out);
  FLEXEP_CUDA_CHECK_LAUNCH("deepep gather_rows_kernel (scales)");
}

void launch_sum_rows(const SumRowsCall& c, cudaStream_t stream) {
  if (c.rows == 0) return;
  sum_rows_kernel<<<grid_for(c.rows), kThreads, 0, stream>>>(c);
  FLEXEP_CUDA_CHECK_LAUNCH("deepep sum_rows_kernel");
}

}  // namespace flexep::deepep
