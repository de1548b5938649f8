// nn.Linear, CPU reference: y = x W^T + b, forward and backward, in f32 or f64. What the MoE layer's
// latent projections (moe.moe_latent_size: fc1_latent_proj, fc2_latent_proj) compute.
#pragma once

#include "flexep/core/tensor.h"

namespace flexep::ref {

// x [T, in], weight [out, in], bias [out] or undefined, all of one dtype (f32 or f64). -> [T, out]
Tensor linear_forward(const TensorView& x, const TensorView& weight, const TensorView& bias);

// -> grad x [T, in] = grad_y W. Adds grad_y^T x into grad_weight and the column sums of grad_y into
// grad_bias, where they are defined (the weights' shapes, the compute dtype).
Tensor linear_backward(const TensorView& x, const TensorView& weight, const TensorView& grad_y,
                       const Tensor& grad_weight, const Tensor& grad_bias);

}  // namespace flexep::ref
