// The routing rules and configuration checks of the gate, with the configuration they read: shared by
// the CPU Gate (layer/gate.cpp) and the CUDA router (cuda/router_cuda.cpp), so the kernel layer needs
// nothing from the layer above it.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "flexep/core/config.h"
#include "flexep/core/dtype.h"
#include "flexep/core/tensor.h"

namespace flexep::gate_rules {

// How the scores are made from the logits.
enum class ScoreKind { softmax, sigmoid, sqrtsoftplus };

inline ScoreKind score_kind(const MoEConfig& c) {
  switch (c.score_func) {
    case ScoreFunc::sigmoid:
    case ScoreFunc::sigmoid_with_bias:
      return ScoreKind::sigmoid;
    case ScoreFunc::sqrtsoftplus:
      return ScoreKind::sqrtsoftplus;
    default:
      return ScoreKind::softmax;
  }
}

// Plain softmax without softmax_before_topk: top-k of the logits, softmax over the k.
inline bool topk_then_softmax(const MoEConfig& c) {
  return c.score_func == ScoreFunc::softmax && !c.softmax_before_topk;
}
// Plain softmax ignores groups and the correction bias (as Automodel's softmax branch does).
inline bool uses_correction_bias(const MoEConfig& c) {
  return c.has_correction_bias() && c.score_func != ScoreFunc::softmax;
}
inline bool uses_groups(const MoEConfig& c) { return c.group_limited(); }
inline bool top2_group_score(const MoEConfig& c) { return c.top2_group_score(); }
// Automodel's sigmoid branch with router_weight_uses_score_correction_bias: the weights and the
// original scores (aux loss, normalisation) are the biased scores; the bias is a constant, so the
// gradient is the sigmoid's.
inline bool weights_from_biased_scores(const MoEConfig& c) {
  return c.score_func == ScoreFunc::sigmoid && c.router_weight_uses_score_correction_bias && c.has_correction_bias();
}
// The logits are rounded to the input's 16-bit dtype: without a gate precision, Automodel runs the
// linear in x's dtype (the weight cast to it) and scores the rounded logits in fp32.
inline bool rounds_logits(std::optional<DType> precision, DType x_dtype) {
  return !precision && (x_dtype == DType::bf16 || x_dtype == DType::f16);
}
// sqrtsoftplus scores `logits.float()` whatever the gate precision: its routing is fp32 throughout.
inline bool routes_in_fp32(const MoEConfig& c) { return c.score_func == ScoreFunc::sqrtsoftplus; }

// torch.nn.functional.softplus (beta 1, threshold 20) and its derivative, in the argument's type.
template <class R>
R softplus(R z) {
  using std::exp;
  using std::log1p;
  return z > R(20) ? z : log1p(exp(z));
}

// The checks both gates end with, after their own: the gate precision (f32, f64 or unset) and, for
// group-limited routing, groups that divide the experts, hold two experts each where the group
// score needs them, a valid moe.n_limited_groups, and enough experts in the kept groups for
// moe.n_activated_experts.
void validate_precision_and_groups(const MoEConfig& c, std::optional<DType> precision);

// A replayed selection [T, k] int32/int64 on the CPU, checked: ids in [0, E), distinct within a
// token (ArgumentError "replay_indices" otherwise). Returns the ids as int64.
std::vector<std::int64_t> read_replay_indices(const TensorView& r, std::int64_t T, int k, int E);

}  // namespace flexep::gate_rules
