// Routing representations and their conversions. The top-k form (indices [T,k], weights [T,k],
// -1 = no expert) is what the router produces; the multihot form (routing_map [T,E] bool,
// probs [T,E]) is what Hybrid-EP consumes. Both describe the same (token, expert, prob) triples.
#pragma once

#include <cstdint>
#include <vector>

#include "flexep/core/tensor.h"

namespace flexep {

struct Multihot {
  Tensor routing_map;  // [T, E] bool
  Tensor probs;        // [T, E], dtype of the weights (f32 or f64)
};

// -1 entries are skipped. Throws ArgumentError for ids outside [-1, E) or repeated ids.
Multihot topk_to_multihot(const TensorView& indices, const TensorView& weights, int num_experts);
// Backward: gathers grad_probs [T, E] at the k slots; slots with -1 get 0. Result dtype = grad's.
Tensor multihot_backward(const TensorView& grad_probs, const TensorView& indices);
// Multihot back to a top-k form with k = max experts per token, experts ascending, padded with -1.
struct TopK {
  Tensor indices;  // [T, k] int64
  Tensor weights;  // [T, k]
};
TopK multihot_to_topk(const TensorView& routing_map, const TensorView& probs);

// Per-expert count of valid (token, expert) pairs: counts[e] over indices [T, k].
std::vector<std::int64_t> expert_counts(const TensorView& indices, int num_experts);

}  // namespace flexep
