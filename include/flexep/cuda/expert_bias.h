// Per-expert down-projection bias scaled by the routing prob (y += b_down[e] * p), its backward, and
// the deterministic per-expert column sum that every bias gradient uses. Rows map to experts through
// `expert_offsets` exactly as in expert_activation.h (undefined: one expert owning every row; rows
// >= offsets[E] are inactive). An undefined `probs` means p = 1. Asynchronous on `stream`.
#pragma once

#include <cuda_runtime.h>

#include "flexep/core/tensor.h"

namespace flexep::cuda {

// y [N, dim] bf16, in place: y[n] += b[e(n)] * p[n] on active rows (fp32 math, one bf16 rounding);
// inactive rows are left untouched. down_bias [E, dim] bf16.
void down_bias_forward(const TensorView& y, const TensorView& down_bias, const TensorView& probs,
                       const TensorView& expert_offsets, cudaStream_t stream);

// grad_y [N, dim] bf16. Accumulates (each optional):
//   grad_down_bias [E, dim] f32 += sum over the rows n of expert e of p[n] * grad_y[n]   (fixed order)
//   grad_probs [N] f32 [n]      += <grad_y[n], b[e(n)]>                                   (active rows)
void down_bias_backward(const TensorView& grad_y, const TensorView& down_bias, const TensorView& probs,
                        const TensorView& expert_offsets, const TensorView& grad_down_bias,
                        const TensorView& grad_probs, cudaStream_t stream);

// out [E, C] f32 += sum over the rows n of expert e of scale[n] * x[n]  (x [N, C] bf16, scale [N] f32 or
// undefined = 1). Deterministic: each expert's rows are cut into a fixed number of contiguous parts
// (a function of N, E and C only), each summed in row order, and the parts added in order; no atomics.
void expert_column_sum(const TensorView& x, const TensorView& scale, const TensorView& expert_offsets,
                       const TensorView& out, cudaStream_t stream);

}  // namespace flexep::cuda
