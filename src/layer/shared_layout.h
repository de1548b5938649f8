// Private to the CPU layer files: the shared experts' two layouts. MoEWeights carries them in the
// grouped one-expert layout (moe_weights.h); the CPU math (SharedExperts) and MoELayer's parameters
// use nn.Linear's. Pure layout changes (slices and transposes, exact in every dtype); the dtype is
// kept.
#pragma once

#include "flexep/core/config.h"
#include "flexep/layer/moe_weights.h"
#include "flexep/layer/shared_experts.h"

namespace flexep {

// grouped gate_and_up [1, dim, up] = [gate_proj^T | up_proj^T] (relu2: up_proj^T), down [1, inter,
// dim] = down_proj^T, biases [1, up] = [gate bias | up bias] and [1, dim]; shared_expert_gate passes
// through. Undefined members stay undefined.
SharedMlpGradients shared_to_linear(const MoEConfig& config, const ExpertWeights& grouped,
                                    const TensorView& shared_expert_gate);
ExpertGradients shared_to_grouped(const MoEConfig& config, const SharedMlpWeights& linear);

inline SharedMlpWeights views_of(const SharedMlpGradients& t) {
  return {t.gate_proj,      t.up_proj,        t.down_proj,         t.gate_proj_bias,
          t.up_proj_bias,   t.down_proj_bias, t.shared_expert_gate};
}
inline ExpertWeights views_of(const ExpertGradients& t) {
  return {t.gate_and_up_projs, t.down_projs, t.gate_up_proj_bias, t.down_proj_bias};
}

}  // namespace flexep
