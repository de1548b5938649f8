// Plain (non-grouped) GEMMs for the shared experts and the router, row-major, on cublasGemmEx:
//
//   C [m, n] = alpha * op(A) * op(B) + beta * C,   op(X) = X^T when trans_x
//
// A and B bf16, C bf16 or f32, fp32 accumulation (CUBLAS_COMPUTE_32F). Shapes: op(A) [m, k],
// op(B) [k, n]. With beta = 0, C is not read (it may hold garbage). m = 0 or n = 0 does nothing;
// k = 0 gives C = beta * C for beta in {0, 1} (other betas are refused). Asynchronous on `stream`.
//
// Typical uses (weights nn.Linear-shaped [out, in]):
//   forward  h = x W^T:      gemm(x, false, W, true, h)
//   dgrad    gx = gh W:      gemm(gh, false, W, false, gx)
//   wgrad    gW += gh^T x:   gemm(gh, true, x, false, gW_f32, 1, 1)
// The elementwise parts of the shared experts reuse the routed-expert kernels with one expert:
// cuda::activation_forward/backward (expert_activation.h) and cuda::down_bias_forward/backward
// (expert_bias.h) with undefined expert_offsets and undefined probs.
#pragma once

#include <cuda_runtime.h>

#include "flexep/core/tensor.h"

namespace flexep::cuda {

void gemm(const TensorView& a, bool trans_a, const TensorView& b, bool trans_b, const TensorView& c, float alpha,
          float beta, cudaStream_t stream);

inline void gemm(const TensorView& a, bool trans_a, const TensorView& b, bool trans_b, const TensorView& c,
                 cudaStream_t stream) {
  gemm(a, trans_a, b, trans_b, c, 1.f, 0.f, stream);
}

}  // namespace flexep::cuda
