// Local (single-GPU) permute and unpermute along a LocalPlan: core permute/unpermute (plan.h) on
// the device, with the same results bit for bit. All three functions only enqueue work on `stream`
// (no synchronisation, no allocation), so they can be captured in a CUDA graph with the plan.
//
// Hidden rows are moved in 16-byte vectors: H must be a multiple of 8, and the data pointers 16-byte
// aligned (every tensor from the library's allocator is).
#pragma once

#include <cuda_runtime.h>

#include "flexep/core/tensor.h"
#include "flexep/cuda/local_plan.h"

namespace flexep::cuda {

// x [T, H] bf16 or f32, weights [T, k] f32 -> out_tokens [out_rows, H] (x's dtype), out_probs
// [out_rows] f32: each kept slot's row gets x[t] and weights[t][j]; padding rows and the rows past
// the used ones are zero with prob 0. Every output row is written exactly once.
void permute(const TensorView& x, const TensorView& weights, const LocalPlan& plan, const TensorView& out_tokens,
             const TensorView& out_probs, cudaStream_t stream);

// expert_rows [out_rows, H] -> out [T, H] (bf16 or f32 each): out[t] = the sum of token t's kept
// rows in ascending expert id, accumulated in fp32 from 0, then rounded to out's dtype (0 for a
// token without rows). Padding rows are never read.
void unpermute(const TensorView& expert_rows, const LocalPlan& plan, const TensorView& out, cudaStream_t stream);

// values [out_rows] f32 -> out [T, k] f32: out[t][j] = values[row of slot (t, j)], 0 for -1 and
// dropped slots (the gradient of the routing weights from the gradient of out_probs).
// permute's out_probs alone (the rows stay in place: row_sources gives their table).
void permute_probs(const TensorView& weights, const LocalPlan& plan, const TensorView& out_probs, cudaStream_t stream);
// sources [out_rows] int32: the token each row of the plan's output holds, -1 for padding rows and the
// budget tail (the row table the gathered experts read the tokens through, gather_gemm.h).
void row_sources(const LocalPlan& plan, const TensorView& sources, cudaStream_t stream);
// src [R, H], ids [N] int32 -> out [N, H] (src's dtype; bf16 or f32): out[r] = src[ids[r]], a zero row
// where ids[r] is -1 (ids outside [-1, R) read as -1). H * element size a multiple of 16.
void gather_rows(const TensorView& src, const TensorView& ids, const TensorView& out, cudaStream_t stream);
void gather_slot_values(const TensorView& values, const LocalPlan& plan, const TensorView& out, cudaStream_t stream);

}  // namespace flexep::cuda
