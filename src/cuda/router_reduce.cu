// Deterministic column sums of [rows, cols] matrices (aux-loss P_e, bias gradient): each block sums a
// fixed chunk of rows for 32 columns in a fixed order, a second pass adds the chunks in ascending
// order. No float atomics, so the result is the same on every run and every device.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/router_kernels.h"
#include "flexep/cuda/router.h"
#include "flexep/cuda/runtime.h"

namespace flexep::cuda::router {

namespace {

constexpr int kColumns = 32;       // columns per block (one per lane: coalesced row segments)
constexpr int kRowLanes = 8;       // threads along the rows
constexpr int kBaseChunkRows = 256;
constexpr int kMaxChunks = 65535;  // gridDim.y limit

template <class S>
__global__ void __launch_bounds__(kColumns* kRowLanes)
    column_partial_kernel(const S* m, const bool* mask, const S* row_div, const float* col_offset, std::int64_t rows,
                          int cols, int rows_per_chunk, double* partial, int* valid_partial) {
  __shared__ double acc[kRowLanes][kColumns];
  __shared__ int valid[kRowLanes][kColumns];
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  const int col = static_cast<int>(blockIdx.x) * kColumns + tx;
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.y) * rows_per_chunk;
  const std::int64_t end = begin + rows_per_chunk < rows ? begin + rows_per_chunk : rows;
  double sum = 0;
  int count = 0;
  const S offset = col_offset && col < cols ? static_cast<S>(col_offset[col]) : S(0);
  for (std::int64_t r = begin + ty; r < end; r += kRowLanes) {
    const bool on = mask == nullptr || mask[r];
    count += on;
    if (on && col < cols) {
      const double v = static_cast<double>(col_offset ? m[r * cols + col] + offset : m[r * cols + col]);
      sum += row_div ? v / static_cast<double>(row_div[r]) : v;
    }
  }
  acc[ty][tx] = sum;
  valid[ty][tx] = count;
  __syncthreads();
  if (ty != 0) return;
  double total = 0;
  int total_valid = 0;
  for (int q = 0; q < kRowLanes; ++q) {
    total += acc[q][tx];
    total_valid += valid[q][tx];
  }
  if (col < cols) partial[static_cast<std::int64_t>(blockIdx.y) * cols + col] = total;
  if (valid_partial && blockIdx.x == 0 && tx == 0) valid_partial[blockIdx.y] = total_valid;
}

constexpr int kFinishThreads = 256;

__global__ void __launch_bounds__(kFinishThreads)
    aux_finish_kernel(const double* partial, const int* valid_partial, int chunks, const std::int64_t* load,
                      int experts, int topk, double* f_over_ctx, void* loss, bool loss_is_double) {
  __shared__ double terms[kRouterMaxExperts];
  __shared__ double ctx_shared;
  if (threadIdx.x == 0) {
    long long valid = 0;
    for (int c = 0; c < chunks; ++c) valid += valid_partial[c];
    ctx_shared = valid > 1 ? static_cast<double>(valid) : 1.0;  // Lctx = max(valid tokens, 1)
  }
  __syncthreads();
  const double ctx = ctx_shared;
  for (int e = static_cast<int>(threadIdx.x); e < experts; e += kFinishThreads) {
    double score_sum = 0;
    for (int c = 0; c < chunks; ++c) score_sum += partial[static_cast<std::int64_t>(c) * experts + e];
    // The CPU Gate's expressions, in its association order.
    const double f = static_cast<double>(load[e]) * static_cast<double>(experts) / (topk * ctx);
    f_over_ctx[e] = f / ctx;
    terms[e] = f * score_sum / ctx;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  double total = 0;
  for (int e = 0; e < experts; ++e) total += terms[e];
  if (loss_is_double) *static_cast<double*>(loss) = total;
  else *static_cast<float*>(loss) = static_cast<float>(total);
}

__global__ void __launch_bounds__(kFinishThreads)
    add_column_sums_kernel(const double* partial, int chunks, int cols, float* out) {
  const int col = static_cast<int>(blockIdx.x) * kFinishThreads + static_cast<int>(threadIdx.x);
  if (col >= cols) return;
  double sum = 0;
  for (int c = 0; c < chunks; ++c) sum += partial[static_cast<std::int64_t>(c) * cols + col];
  out[col] = static_cast<float>(static_cast<double>(out[col]) + sum);
}

}  // namespace

ColumnChunks column_chunks(std::int64_t rows) {
  std::int64_t per = kBaseChunkRows;
  while ((rows + per - 1) / per > kMaxChunks) per *= 2;
  return {static_cast<int>((rows + per - 1) / per), static_cast<int>(per)};
}

template <class S>
void launch_column_partial_sums(const S* m, const bool* mask, const S* row_div, const float* col_offset,
                                std::int64_t rows, int cols, double* partial, int* valid_partial, cudaStream_t stream) {
  const ColumnChunks ch = column_chunks(rows);
  if (ch.chunks == 0 || cols == 0) return;
  const dim3 grid(static_cast<unsigned>((cols + kColumns - 1) / kColumns), static_cast<unsigned>(ch.chunks));
  column_partial_kernel<S><<<grid, dim3(kColumns, kRowLanes), 0, stream>>>(
      m, mask, row_div, col_offset, rows, cols, ch.rows_per_chunk, partial, valid_partial);
  FLEXEP_CUDA_CHECK_LAUNCH("column_partial_kernel");
}

template void launch_column_partial_sums<float>(const float*, const bool*, const float*, const float*, std::int64_t,
                                                int, double*, int*, cudaStream_t);
template void launch_column_partial_sums<double>(const double*, const bool*, const double*, const float*,
                                                 std::int64_t, int, double*, int*, cudaStream_t);

void launch_aux_finish(const double* partial, const int* valid_partial, int chunks, const std::int64_t* load,
                       int experts, int topk, double* f_over_ctx, void* loss, bool loss_is_double,
                       cudaStream_t stream) {
  aux_finish_kernel<<<1, kFinishThreads, 0, stream>>>(partial, valid_partial, chunks, load, experts, topk, f_over_ctx,
                                                      loss, loss_is_double);
  FLEXEP_CUDA_CHECK_LAUNCH("aux_finish_kernel");
}

void launch_add_column_sums(const double* partial, int chunks, int cols, float* out, cudaStream_t stream) {
  if (cols == 0) return;
  add_column_sums_kernel<<<(cols + kFinishThreads - 1) / kFinishThreads, kFinishThreads, 0, stream>>>(partial, chunks,
                                                                                                      cols, out);
  FLEXEP_CUDA_CHECK_LAUNCH("add_column_sums_kernel");
}

}  // namespace flexep::cuda::router
