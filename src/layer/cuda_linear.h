// nn.Linear on the GPU in bf16, what the MoE layer's latent projections (moe.moe_latent_size)
// compute: y = x W^T + b. cuBLAS GEMMs with fp32 accumulation (cuda/dense.h) and the one-expert
// bias kernels (cuda/expert_bias.h). Asynchronous on `stream`.
#pragma once

#include <cuda_runtime.h>

#include "flexep/core/tensor.h"

namespace flexep::cuda {

// x [T, in] bf16, weight [out, in] bf16, bias [out] bf16 or undefined -> y [T, out] bf16 (the GEMM
// rounds once, the bias is added in fp32 and rounded again).
Tensor linear_forward(const TensorView& x, const TensorView& weight, const TensorView& bias, cudaStream_t stream);

// -> grad x [T, in] bf16 = grad_y W. Adds grad_y^T x into grad_weight ([out, in] f32) and the column
// sums of grad_y into grad_bias ([out] f32), where they are defined (fixed summation order).
Tensor linear_backward(const TensorView& x, const TensorView& weight, const TensorView& grad_y,
                       const TensorView& grad_weight, const TensorView& grad_bias, cudaStream_t stream);

}  // namespace flexep::cuda
