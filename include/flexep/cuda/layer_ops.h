// Small elementwise and reduction kernels the MoE layer glues its pieces with: padding masks on
// routing indices, the sigmoid gate of the shared experts (a [dim] -> 1 projection), bf16 adds, the
// expert load of given indices and f32 -> bf16 conversion.
// All asynchronous on `stream`; all reductions run in a fixed order (deterministic).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flexep/core/tensor.h"

namespace flexep::cuda {

// out [T, k] i64 = indices, with every slot of a padding token (padding_mask[t] true) set to -1.
void mask_padding_indices(const TensorView& indices, const TensorView& padding_mask, const TensorView& out,
                          cudaStream_t stream);
// gate [T] f32 = sigmoid(x [T, dim] bf16 . w [dim] bf16), fp32 dot products.
void sigmoid_gate_forward(const TensorView& x, const TensorView& w, const TensorView& gate, cudaStream_t stream);
// From grad_gate [T] f32 and the forward's gate [T]: g_t = grad_gate * s (1 - s);
// grad_w [dim] f32 += sum_t g_t x[t] (fixed order over t); grad_x [T, dim] bf16 += g_t w.
void sigmoid_gate_backward(const TensorView& x, const TensorView& w, const TensorView& gate,
                           const TensorView& grad_gate, const TensorView& grad_w, const TensorView& grad_x,
                           cudaStream_t stream);
// y [n] bf16 += z [n] bf16 (fp32 add, one rounding).
void add_into(const TensorView& y, const TensorView& z, cudaStream_t stream);
// out [T] bool = !mask [T] (padding mask <-> token mask).
void logical_not(const TensorView& mask, const TensorView& out, cudaStream_t stream);
// acc [n] i64 += x [n] i64.
void add_i64(const TensorView& acc, const TensorView& x, cudaStream_t stream);
// load [E] i64 = how many entries of indices [T, k] i64 hold e; -1 (and any id outside [0, E)) is
// skipped. Overwrites load.
void count_expert_load(const TensorView& indices, const TensorView& load, cudaStream_t stream);
// dst [n] bf16 = src [n] f32, rounded to nearest even.
void convert_f32_to_bf16(const TensorView& src, const TensorView& dst, cudaStream_t stream);
// Benchmark data: t (bf16 or f32) filled with uniform values of mean 0 and standard deviation
// `std`, from a counter-based hash of (seed, index): fast, deterministic, not the host generator's
// numbers.
void fill_random(const TensorView& t, std::uint64_t seed, float std, cudaStream_t stream);
// t [n] f32 = value.
void fill(const TensorView& t, float value, cudaStream_t stream);

}  // namespace flexep::cuda
