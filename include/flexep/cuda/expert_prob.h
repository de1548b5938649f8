// The routing prob applied after the down projection (moe.apply_router_weight_after_down), as
// Automodel's _apply_router_weight_fp32 does it: the finished bf16 expert row times the fp32 prob,
// in fp32, rounded once to bf16. Row n of every tensor belongs to prob n; all rows are active (the
// caller passes the rows of its experts only). Asynchronous on `stream`.
#pragma once

#include <cuda_runtime.h>

#include "flexep/core/tensor.h"

namespace flexep::cuda {

// u [N, dim] bf16, probs [N] f32, y [N, dim] bf16 (may not overlap u): y[n] = bf16(u[n] * p[n]).
void prob_scale_rows(const TensorView& u, const TensorView& probs, const TensorView& y, cudaStream_t stream);

// The multiply's backward (torch's mul backward, cast back to bf16): grad_u[n] = bf16(grad_y[n] * p[n])
// and grad_probs[n] = <grad_y[n], u[n]> in fp32 (overwritten). grad_u [N, dim] bf16 may not overlap
// grad_y or u; grad_probs [N] f32 is optional.
void prob_scale_rows_backward(const TensorView& grad_y, const TensorView& u, const TensorView& probs,
                              const TensorView& grad_u, const TensorView& grad_probs, cudaStream_t stream);

}  // namespace flexep::cuda
