// Top-k <-> multihot on the GPU (Hybrid-EP's routing_map / probs form), matching the CPU
// topk_to_multihot / multihot_backward of include/flexep/core/routing.h.
//
// Expert ids are user data checked in the kernels, not on the host (that would cost a copy and a
// sync): an id outside [-1, E), or an expert listed twice in a token, is recorded in `errors` as
// argument "indices" with its [token, slot] position and reported by errors.check() at the caller's
// next sync. Such a slot is skipped (never written out of bounds); the other slots are converted.
// Neither function synchronises.
#pragma once

#include <cuda_runtime.h>

#include "flexep/core/routing.h"
#include "flexep/core/tensor.h"
#include "flexep/cuda/device_errors.h"

namespace flexep::cuda {

// indices [T, k] int32/int64 (-1 = no expert), weights [T, k] f32, both on one CUDA device (the
// device of `errors`). Returns routing_map [T, E] bool and probs [T, E] f32, zero where not routed.
Multihot topk_to_multihot(const TensorView& indices, const TensorView& weights, int num_experts, DeviceErrors& errors,
                          cudaStream_t stream);

// grad_probs [T, E] f32, indices [T, k] -> grad_weights [T, k] f32: grad_probs gathered at the k
// slots, 0 for -1 slots (and for slots with an invalid id, which are reported).
Tensor multihot_backward(const TensorView& grad_probs, const TensorView& indices, DeviceErrors& errors,
                         cudaStream_t stream);

}  // namespace flexep::cuda
