// Grouped GEMMs of the routed experts on cuBLAS (blocking mode: the per-expert row counts are on the
// host). The token matrix is split into consecutive row blocks, block g having counts[g] rows and
// using expert matrix g. All matrices are row-major; bf16 inputs, fp32 accumulation.
//
//   forward: C [N, M] bf16           C_g  = A_g [n_g, K] * B_g [K, M]       (x * W_gu, a_p * W_down)
//   dgrad:   C [N, K] bf16           C_g  = D_g [n_g, M] * B_g^T            (dh * W_gu^T)
//   wgrad:   C [G, K, M] f32         C_g += A_g^T * D_g                     (x^T * dh), accumulating
//
// Experts with zero rows are skipped: their wgrad block is left exactly as it was. Rows of C past
// sum(counts) are NOT written by forward/dgrad (callers zero them if they need to); N = 0 or
// sum(counts) = 0 does nothing. Calls are asynchronous on `stream`; they never synchronise the device.
// The pointer arrays of the batched call are staged in pinned host memory owned by the calling
// thread (a small ring; a slot is rewritten only after the copy that read it has completed, which
// may wait on the host for that earlier copy, never for the GEMMs).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "flexep/core/tensor.h"

namespace flexep::cuda {

// a [N, K] bf16, b [G, K, M] bf16, counts: G entries >= 0 summing to <= N, c [N, M] bf16.
void grouped_gemm_forward(const TensorView& a, const TensorView& b, const std::vector<std::int64_t>& counts,
                          const TensorView& c, cudaStream_t stream);

// d [N, M] bf16, b [G, K, M] bf16, c [N, K] bf16.
void grouped_gemm_dgrad(const TensorView& d, const TensorView& b, const std::vector<std::int64_t>& counts,
                        const TensorView& c, cudaStream_t stream);

// a [N, K] bf16, d [N, M] bf16, c [G, K, M] f32 (accumulated, beta = 1).
// cublasGemmGroupedBatchedEx has no bf16-in / fp32-out combination (cuBLAS 13: A, B and C share one
// type), so this runs one cublasGemmEx per non-empty expert.
void grouped_gemm_wgrad(const TensorView& a, const TensorView& d, const std::vector<std::int64_t>& counts,
                        const TensorView& c, cudaStream_t stream);

// Exclusive prefix sum of counts ([G + 1] int64: 0, c0, c0 + c1, ..., sum) as a device tensor on
// `device`, uploaded on `stream` through the same pinned staging (no sync). This is the row -> expert
// map the activation and bias kernels take. Counts must be >= 0 (ArgumentError "counts").
Tensor expert_offsets(const std::vector<std::int64_t>& counts, int device, cudaStream_t stream);

}  // namespace flexep::cuda
