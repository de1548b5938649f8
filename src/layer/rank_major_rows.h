// The CPU layer's experts on a rank-major dispatch (docs/semantics.md, "Rank-major dispatch"), as
// Automodel's GroupedExpertsDeepEP runs them: the received rows are gathered into expert-major
// order through expert_rows (each with the weight of the slot that chose that expert), the experts
// run, and their rows are summed back per received row, in ascending local expert, in fp32 (f64
// for f64) and rounded once: the first level of the combine, which the rank-major combine expects.
// The backward mirrors it. With these, a layer on a rank-major dispatch is bitwise the layer on
// the expert-major one.
#pragma once

#include <cstdint>
#include <vector>

#include "flexep/core/tensor.h"
#include "flexep/dispatch/dispatcher.h"

namespace flexep::ref {

struct ExpertMajorRows {
  Tensor tokens;                    // [M, H]: recv_x rows in expert_rows order, zero for padding
  Tensor probs;                     // [M]: the choosing slot's weight, 0 for padding
  std::vector<std::int64_t> slot;   // [M]: row * k + slot of the entry in recv_topk_*, -1 for padding
  std::int64_t recv_rows = 0, k = 0;
};

// The expert-major rows of a rank-major DispatchResult (blocking: expert_rows holds exactly the
// padded lists; budget: the entries past sum(tokens_per_expert) are left out).
ExpertMajorRows gather_expert_major(const DispatchResult& r);

// Expert output rows [M, H] -> one row per received token [recv_rows, H] (level 1 of the combine).
Tensor sum_per_received_row(const TensorView& expert_out, const ExpertMajorRows& m);

// combine_backward's [recv_rows, H] -> the experts' [M, H] gradient rows (each entry its row's).
Tensor gather_rows(const TensorView& received, const ExpertMajorRows& m);

// The experts' input gradients back to the rank-major dispatch's: rows [M, H] summed per received
// row (as sum_per_received_row), probs [M] into their slots of topk_weights' gradient [recv_rows, k].
struct RankMajorGrads {
  Tensor rows, topk_weights;
};
RankMajorGrads scatter_to_received(const TensorView& grad_rows, const TensorView& grad_probs,
                                   const ExpertMajorRows& m, DType weight_dtype);

}  // namespace flexep::ref
