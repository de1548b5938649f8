// Private to the two gates, the CPU Gate (layer/gate.cpp) and the CUDA router (cuda/router_cuda.cpp):
// the routing rules and configuration checks both apply alike.
#pragma once

#include <optional>

#include "flexep/core/config.h"
#include "flexep/core/dtype.h"

namespace flexep::gate_rules {

// Plain softmax ignores groups and the correction bias (as Automodel's softmax branch does).
inline bool uses_groups(const MoEConfig& c) { return c.grouped_routing() && c.score_func != ScoreFunc::softmax; }
// Group score: sum of the top-2 biased scores, except sigmoid without a correction bias (max).
inline bool top2_group_score(const MoEConfig& c) {
  return c.score_func == ScoreFunc::softmax_with_bias || c.has_correction_bias();
}

// The checks both gates end with, after their own: the gate precision (f32, f64 or unset),
// moe.n_expert_groups >= 1 and, for group-limited routing, groups that divide the experts, hold
// two experts each where the group score needs them, a valid moe.n_limited_groups, and enough
// experts in the kept groups for moe.n_activated_experts.
void validate_precision_and_groups(const MoEConfig& c, std::optional<DType> precision);

}  // namespace flexep::gate_rules
