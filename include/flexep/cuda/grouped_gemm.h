// Grouped GEMMs of the routed experts on cuBLAS (blocking mode: the per-expert row counts are on the
// host). The token matrix is split into consecutive row blocks, block g having counts[g] rows and
// using expert matrix g. All matrices are row-major; bf16 inputs, fp32 accumulation.
//
//   forward:    C [N, M] bf16        C_g  = A_g [n_g, K] * B_g [K, M]     (x * W_gu, a_p * W_down)
//   dgrad:      C [N, K] bf16        C_g  = D_g [n_g, M] * B_g^T          (dh * W_gu^T)
//   wgrad:      C [G, K, M] f32      C_g += A_g^T * D_g                   (x^T * dh), accumulating
//   wgrad_bf16: C [G, K, M] bf16     C_g  = A_g^T * D_g                   overwriting, one rounding
//                                    (or C_g += A_g^T * D_g, one rounding per call)
//
// Experts with zero rows run no GEMM: an accumulating wgrad leaves their block exactly as it was, an
// overwriting one zeroes it. Rows of C past sum(counts) are NOT written by forward/dgrad (callers
// zero them if they need to); N = 0 or sum(counts) = 0 does nothing (but the overwriting wgrads
// still zero C). Calls are asynchronous on `stream`; they never synchronise the device.
//
// How forward, dgrad and wgrad_bf16 run: an expert whose work n_g * K * M reaches a threshold
// (default 2.5e9 multiply-adds) gets its own cublasGemmEx; the others go to one
// cublasGemmGroupedBatchedEx call (all-bf16 A/B/C, which that API requires, fp32 compute).
// Measured on an H200 (bf16, fp32 accumulate): the grouped call tops out near 350 TFLOP/s whatever the
// sizes, single GEMMs reach 800+ on big experts (K 7168, M 4096: 1024 rows 840 vs 340 TFLOP/s), while
// for small experts the grouped call wins (64 rows: 220 vs 170; K 2048, M 1536, 256 rows: 270 vs 135
// with 32 experts). The pointer arrays of the grouped call are staged in pinned host memory owned by
// the calling thread (a small ring; a slot is rewritten only after the copy that read it has
// completed, which may wait on the host for that earlier copy, never for the GEMMs). Not capturable
// in a CUDA graph (blocking mode).
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

// a [N, K] bf16, d [N, M] bf16, c [G, K, M] f32: accumulated (beta = 1), or with accumulate = false
// overwritten (beta = 0; the blocks of experts without rows are zeroed), which saves reading c: the
// first backward after a zero_grad needs no zero-filled c.
// cublasGemmGroupedBatchedEx has no bf16-in / fp32-out combination (cuBLAS 13: A, B and C share one
// type), so this runs one cublasGemmEx per non-empty expert.
void grouped_gemm_wgrad(const TensorView& a, const TensorView& d, const std::vector<std::int64_t>& counts,
                        const TensorView& c, cudaStream_t stream, bool accumulate = true);

// a [N, K] bf16, d [N, M] bf16, c [G, K, M] bf16, overwritten (beta = 0: c is never read, so it may
// be uninitialised memory); blocks of experts without rows are zeroed. Each block is the fp32 sum
// rounded once to bf16. For weight gradients in the parameters' dtype: no f32 buffer, no conversion
// pass, and the small experts share one grouped call. With `accumulate` the products are added to c
// (beta = 1: c read as bf16, the fp32 sum rounded once; blocks of experts without rows untouched), as
// autograd adds bf16 gradients: how the chunks of one backward add up (backend.dispatch_chunks).
void grouped_gemm_wgrad_bf16(const TensorView& a, const TensorView& d, const std::vector<std::int64_t>& counts,
                             const TensorView& c, cudaStream_t stream, bool accumulate = false);

// The threshold above (multiply-adds per expert; 0: every expert its own GEMM; INT64_MAX: all grouped).
// Process-wide; for tuning and tests.
void set_grouped_gemm_own_gemm_min_work(std::int64_t macs);
std::int64_t grouped_gemm_own_gemm_min_work();

// Exclusive prefix sum of counts ([G + 1] int64: 0, c0, c0 + c1, ..., sum) as a device tensor on
// `device`, uploaded on `stream` through the same pinned staging (no sync). This is the row -> expert
// map the activation and bias kernels take. Counts must be >= 0 (ArgumentError "counts").
Tensor expert_offsets(const std::vector<std::int64_t>& counts, int device, cudaStream_t stream);

}  // namespace flexep::cuda
