// The row table of a LocalPlan and the gather along it: what lets the experts read the tokens in place
// (gather_gemm.h) instead of a permuted copy.
//
// row_sources: every row starts at -1 (padding, and the budget tail), then each kept slot (t, j)
// writes t into its row. Rows are distinct per slot, so the writes never collide.
// gather_rows: one warp per output row, 16 bytes per lane; a row id of -1 gives a zero row.
#include "flexep/cuda/runtime.h"
#include "cuda/permute_launch.h"

namespace flexep::cuda::permute_detail {

namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    row_sources_kernel(const std::int32_t* __restrict__ slot_rows, long long tokens, int k, long long out_rows,
                       std::int32_t* __restrict__ sources) {
  const long long i = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= tokens * k) return;
  const long long row = slot_rows[i];
  if (row >= 0 && row < out_rows) sources[row] = static_cast<std::int32_t>(i / k);
}

__global__ void __launch_bounds__(kThreads)
    gather_rows_kernel(const uint4* __restrict__ src, long long src_rows, const std::int32_t* __restrict__ ids,
                       long long rows, long long vecs_per_row, uint4* __restrict__ out) {
  const long long r = static_cast<long long>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  if (r >= rows) return;
  const long long id = ids[r];
  const bool valid = id >= 0 && id < src_rows;  // ids were made by row_sources; the check keeps reads in bounds
  uint4* dst = out + r * vecs_per_row;
  for (long long v = threadIdx.x % 32; v < vecs_per_row; v += 32) dst[v] = valid ? src[id * vecs_per_row + v] : uint4{};
}

}  // namespace

void launch_row_sources(const PlanRefs& plan, std::int32_t* sources, cudaStream_t stream) {
  if (plan.out_rows == 0) return;
  FLEXEP_CUDA_CHECK(cudaMemsetAsync(sources, 0xff, static_cast<std::size_t>(plan.out_rows) * sizeof(std::int32_t), stream));
  const long long slots = plan.tokens * plan.topk;
  if (slots == 0) return;
  row_sources_kernel<<<static_cast<unsigned>((slots + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      plan.slot_rows, plan.tokens, static_cast<int>(plan.topk), plan.out_rows, sources);
  FLEXEP_CUDA_CHECK(cudaGetLastError());
}

void launch_gather_rows(const void* src, std::int64_t src_rows, const std::int32_t* ids, std::int64_t rows,
                        std::int64_t row_bytes, void* out, cudaStream_t stream) {
  if (rows == 0 || row_bytes == 0) return;
  constexpr long long kRowsPerBlock = kThreads / 32;
  gather_rows_kernel<<<static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock), kThreads, 0, stream>>>(
      static_cast<const uint4*>(src), src_rows, ids, rows, row_bytes / 16, static_cast<uint4*>(out));
  FLEXEP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flexep::cuda::permute_detail
