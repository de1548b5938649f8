// Receiver-side placement: received rows arrive ordered (source rank, source token); each of their
// metadata entries goes to the expert-major row
//   expert_begin[e] + (number of earlier received entries of e),
// which is the host backend's (source rank, source token) order inside expert e. The count comes
// from an exclusive scan over expert-major flags (unpack: mark -> scan -> place -> scatter).
#include "dispatch/alltoall/device/block_rows.cuh"
#include "dispatch/alltoall/kernels/kernels.h"
#include "flexep/cuda/runtime.h"

namespace flexep::alltoall {

namespace {

__global__ void __launch_bounds__(kThreads)
    mark_received_kernel(const SlotMeta* meta, std::int64_t rows, int meta_width, int local_experts, int* flags) {
  const std::int64_t n = rows * meta_width, stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int e = meta[i].expert;
    if (e >= 0 && e < local_experts) flags[static_cast<std::int64_t>(e) * rows + i / meta_width] = 1;
  }
}

__global__ void __launch_bounds__(kThreads)
    place_received_kernel(const SlotMeta* meta, const int* flag_scan, std::int64_t rows, int meta_width,
                          int local_experts, const long long* params, std::int64_t out_rows, int* out_row) {
  const long long* expert_begin = params;
  const long long* kept_rows = params + local_experts;
  const long long* pairs_before = params + 2 * local_experts;
  const std::int64_t n = rows * meta_width, stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int e = meta[i].expert;
    int dst = -1;
    if (e >= 0 && e < local_experts) {
      const long long q = flag_scan[static_cast<std::int64_t>(e) * rows + i / meta_width] - pairs_before[e];
      // The budget keeps a prefix of every group: entries at q >= kept_rows are dropped.
      if (q >= 0 && q < kept_rows[e] && expert_begin[e] + q < out_rows) dst = static_cast<int>(expert_begin[e] + q);
    }
    out_row[i] = dst;
  }
}

__global__ void __launch_bounds__(kRowThreads)
    scatter_rows_kernel(const std::uint16_t* rows, const SlotMeta* meta, const int* out_row, std::int64_t count,
                        int meta_width, std::int64_t hidden, std::uint16_t* out, float* out_probs) {
  for (std::int64_t i = blockIdx.x; i < count; i += gridDim.x)
    for (int m = 0; m < meta_width; ++m) {
      const int dst = out_row[i * meta_width + m];
      if (dst < 0) continue;
      copy_row(out + static_cast<std::int64_t>(dst) * hidden, rows + i * hidden, hidden);
      if (out_probs && threadIdx.x == 0) out_probs[dst] = meta[i * meta_width + m].prob;
    }
}

}  // namespace

void launch_mark_received(const SlotMeta* meta, std::int64_t rows, int meta_width, int local_experts, int* flags,
                          cudaStream_t stream) {
  if (rows == 0) return;
  mark_received_kernel<<<blocks_for_items(rows * meta_width), kThreads, 0, stream>>>(meta, rows, meta_width,
                                                                                     local_experts, flags);
  FLEXEP_CUDA_CHECK_LAUNCH("mark_received_kernel");
}

void launch_place_received(const SlotMeta* meta, const int* flag_scan, std::int64_t rows, int meta_width,
                           int local_experts, const long long* params, std::int64_t out_rows, int* out_row,
                           cudaStream_t stream) {
  if (rows == 0) return;
  place_received_kernel<<<blocks_for_items(rows * meta_width), kThreads, 0, stream>>>(
      meta, flag_scan, rows, meta_width, local_experts, params, out_rows, out_row);
  FLEXEP_CUDA_CHECK_LAUNCH("place_received_kernel");
}

void launch_scatter_rows(const void* rows, const SlotMeta* meta, const int* out_row, std::int64_t count, int meta_width,
                         std::int64_t hidden, void* out, float* out_probs, cudaStream_t stream) {
  if (count == 0) return;
  scatter_rows_kernel<<<blocks_for_rows(count), kRowThreads, 0, stream>>>(
      static_cast<const std::uint16_t*>(rows), meta, out_row, count, meta_width, hidden,
      static_cast<std::uint16_t*>(out), out_probs);
  FLEXEP_CUDA_CHECK_LAUNCH("scatter_rows_kernel");
}

}  // namespace flexep::alltoall
