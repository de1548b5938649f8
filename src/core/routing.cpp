#include "flexep/core/routing.h"

#include <algorithm>

#include "flexep/core/checks.h"

namespace flexep {

namespace {
std::int64_t index_at(const TensorView& indices, std::int64_t i) {
  return indices.dtype == DType::i64 ? indices.ptr<std::int64_t>()[i]
                                     : static_cast<std::int64_t>(indices.ptr<std::int32_t>()[i]);
}
}  // namespace

Multihot topk_to_multihot(const TensorView& indices, const TensorView& weights, int num_experts) {
  FLEXEP_CHECK_ARG(num_experts >= 1, "num_experts", "must be >= 1, got ", num_experts);
  check::expert_indices(indices, num_experts, "indices");
  check::shape(weights, {indices.size(0), indices.size(1)}, "weights");
  check::dtype(weights, {DType::f32, DType::f64, DType::bf16}, "weights");
  const std::int64_t T = indices.size(0), k = indices.size(1);
  const DType prob_dtype = weights.dtype == DType::f64 ? DType::f64 : DType::f32;
  Multihot m{Tensor::zeros({T, num_experts}, DType::b8), Tensor::zeros({T, num_experts}, prob_dtype)};
  bool* map = m.routing_map.data<bool>();
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t e = index_at(indices, t * k + j);
      if (e < 0) continue;
      map[t * num_experts + e] = true;
      write_from_double(m.probs, t * num_experts + e, read_as_double(weights, t * k + j));
    }
  return m;
}

Tensor multihot_backward(const TensorView& grad_probs, const TensorView& indices) {
  check::rank(indices, 2, "indices");
  check::dtype(indices, {DType::i32, DType::i64}, "indices");
  check::rank(grad_probs, 2, "grad_probs");
  check::dtype(grad_probs, {DType::f32, DType::f64}, "grad_probs");
  FLEXEP_CHECK_ARG(grad_probs.size(0) == indices.size(0), "grad_probs", "has ", grad_probs.size(0),
                   " rows but 'indices' has ", indices.size(0));
  const std::int64_t T = indices.size(0), k = indices.size(1), E = grad_probs.size(1);
  Tensor g = Tensor::zeros({T, k}, grad_probs.dtype);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t e = index_at(indices, t * k + j);
      if (e == -1) continue;
      // Other negatives are corrupt ids, not padding: skipping them would zero a real gradient.
      FLEXEP_CHECK_ARG(e >= 0 && e < E, "indices", "value ", e, " at [", t, ", ", j,
                       "] is out of range; allowed: -1 <= id < ", E);
      write_from_double(g, t * k + j, read_as_double(grad_probs, t * E + e));
    }
  return g;
}

TopK multihot_to_topk(const TensorView& routing_map, const TensorView& probs) {
  check::rank(routing_map, 2, "routing_map");
  check::dtype(routing_map, {DType::b8}, "routing_map");
  check::shape(probs, {routing_map.size(0), routing_map.size(1)}, "probs");
  check::dtype(probs, {DType::f32, DType::f64}, "probs");
  const std::int64_t T = routing_map.size(0), E = routing_map.size(1);
  const bool* map = routing_map.ptr<bool>();
  std::int64_t k = 0;
  for (std::int64_t t = 0; t < T; ++t) k = std::max<std::int64_t>(k, std::count(map + t * E, map + (t + 1) * E, true));
  k = std::max<std::int64_t>(k, 1);
  TopK out{Tensor::empty({T, k}, DType::i64), Tensor::zeros({T, k}, probs.dtype)};
  std::int64_t* idx = out.indices.data<std::int64_t>();
  std::fill(idx, idx + T * k, -1);
  for (std::int64_t t = 0; t < T; ++t) {
    std::int64_t j = 0;
    for (std::int64_t e = 0; e < E; ++e)
      if (map[t * E + e]) {
        idx[t * k + j] = e;
        write_from_double(out.weights, t * k + j, read_as_double(probs, t * E + e));
        ++j;
      }
  }
  return out;
}

std::vector<std::int64_t> expert_counts(const TensorView& indices, int num_experts) {
  FLEXEP_CHECK_ARG(num_experts >= 1, "num_experts", "must be >= 1, got ", num_experts);
  check::rank(indices, 2, "indices");
  check::dtype(indices, {DType::i32, DType::i64}, "indices");
  std::vector<std::int64_t> c(static_cast<std::size_t>(num_experts), 0);
  const std::int64_t n = indices.numel();
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t e = index_at(indices, i);
    if (e == -1) continue;
    FLEXEP_CHECK_ARG(e >= 0 && e < num_experts, "indices", "value ", e, " is out of range; allowed: -1 <= id < ",
                     num_experts);
    ++c[static_cast<std::size_t>(e)];
  }
  return c;
}

}  // namespace flexep
