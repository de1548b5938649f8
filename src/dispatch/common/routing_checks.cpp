#include "dispatch/common/routing_checks.h"

#include "flexep/core/checks.h"
#include "flexep/core/error.h"

namespace flexep::check {

void routing_form(const DispatchInput& in, std::int64_t tokens, int experts, Device dev,
                  const std::function<void(std::int64_t k)>& check_k) {
  if (in.multihot()) {
    FLEXEP_CHECK_ARG(!in.indices.defined() && !in.weights.defined(), "indices",
                     "was given together with routing_map; pass either the top-k form (indices, weights) or the "
                     "multihot form (routing_map, probs)");
    check::shape(in.routing_map, {tokens, experts}, "routing_map");
    check::dtype(in.routing_map, {DType::b8}, "routing_map");
    check::device(in.routing_map, dev, "routing_map");
    check::shape(in.probs, {tokens, experts}, "probs");
    check::dtype(in.probs, {DType::f32}, "probs");
    check::device(in.probs, dev, "probs");
  } else {
    FLEXEP_CHECK_ARG(in.indices.defined(), "indices",
                     "is required; pass the top-k form (indices, weights) or the multihot form (routing_map, probs)");
    check::shape(in.indices, {tokens, -1}, "indices");
    check::dtype(in.indices, {DType::i32, DType::i64}, "indices");
    check::device(in.indices, dev, "indices");
    const std::int64_t k = in.indices.size(1);
    check_k(k);
    check::shape(in.weights, {tokens, k}, "weights");
    check::dtype(in.weights, {DType::f32}, "weights");
    check::device(in.weights, dev, "weights");
  }
}

void expert_major_layout(const DispatchOptions& options, std::string_view backend) {
  FLEXEP_CHECK_ARG(options.layout == DispatchLayout::expert_major, "options.layout", "is rank_major, which the ",
                   backend, " backend does not write; allowed: expert_major (rank_major: the deepep and host backends)");
}

}  // namespace flexep::check
