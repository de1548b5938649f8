// The expert activations fused with the gate/up bias and the routing-prob multiply (docs/semantics.md, "Experts":
// y = (act(x W_gu + b_gu) * p) W_down + ...), forward and backward, on expert-major rows. The scalar
// oracle is core/activation.h; the math here is fp32 on bf16 storage.
//
// Which expert a row belongs to: `expert_offsets` [E + 1] int64 on the device (see
// cuda::expert_offsets), row n belongs to expert e when offsets[e] <= n < offsets[e + 1] (found by a
// binary search per row); rows n >= offsets[E] are *inactive*. An undefined `expert_offsets` means one
// expert owning every row (E = 1; the shared experts use this). Offsets must be non-decreasing; the
// kernels stay in bounds whatever they contain, but garbage offsets give garbage results.
// An undefined `probs` means p = 1 for every row.
//
// Kernels use 16-byte accesses when inter is a multiple of 8 and every pointer is 16-byte aligned,
// and a scalar path otherwise. All calls are asynchronous on `stream`.
#pragma once

#include <cuda_runtime.h>

#include "flexep/core/activation.h"
#include "flexep/core/tensor.h"

namespace flexep::cuda {

// h [N, up] bf16 (the GEMM output, before the bias), gate_up_bias [E, up] bf16 or undefined,
// probs [N] f32 or undefined, out [N, inter] bf16:
//   out[n] = act(h[n] + b[e(n)]) * p[n]  on active rows, 0 on inactive rows.
// up = 2 * inter for swiglu / quick_geglu, inter for relu2.
void activation_forward(const ActivationParams& act, const TensorView& h, const TensorView& gate_up_bias,
                        const TensorView& probs, const TensorView& expert_offsets, const TensorView& out,
                        cudaStream_t stream);

// grad_ap [N, inter] bf16 is the gradient reaching out = act * p. Writes
//   grad_h [N, up] bf16      = act'(h + b) * (grad_ap * p)           (0 on inactive rows)
//   grad_probs [N] f32       = sum_i grad_ap[n, i] * act(h + b)[n, i] (0 on inactive rows; optional)
// and accumulates grad_gate_up_bias [E, up] f32 += sum over the rows of expert e of grad_h (as stored,
// bf16) in a fixed order (deterministic, no atomics; optional).
void activation_backward(const ActivationParams& act, const TensorView& h, const TensorView& gate_up_bias,
                         const TensorView& probs, const TensorView& expert_offsets, const TensorView& grad_ap,
                         const TensorView& grad_h, const TensorView& grad_probs, const TensorView& grad_gate_up_bias,
                         cudaStream_t stream);

}  // namespace flexep::cuda
