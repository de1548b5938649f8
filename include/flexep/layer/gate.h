// The router (NeMo Automodel's Gate), CPU reference, forward and backward.
//
// Forward on x [T, dim] with token_mask [T]:
//   logits = x W^T (+ b), computed in the gate precision (f64 if asked or if x is f64, else f32);
//   softmax:            top-k of the raw logits, weights = softmax over those k values;
//                       original_scores = full softmax (aux loss only);
//   softmax + softmax_before_topk: full softmax, top-k of it, weights gathered from it;
//   softmax_with_bias:  full softmax; selection on softmax + correction bias, with optional group
//                       limiting (group score = sum of its top-2); weights from the unbiased softmax;
//   sigmoid:            sigmoid; selection on sigmoid + correction bias; group score = max per group
//                       without a correction bias, sum of top-2 with one; weights from the unbiased
//                       sigmoid.
//   Group limiting keeps n_limited_groups groups and excludes the others from selection (we mask
//   them to -inf; Automodel multiplies them by 0, which differs only when biased scores are
//   negative: see docs/semantics.md). Ties: the lower expert index wins, everywhere.
//   norm_topk_prob and k > 1: weights /= sum + 1e-20, and original_scores likewise.
//   weights *= route_scale.
//   load[e] = number of unmasked tokens that selected e.
//   aux loss (training, coeff > 0): L = sum_e f_e P_e, f_e = load_e E / (k Lctx),
//   P_e = sum_t mask_t original_scores[t, e] / Lctx, Lctx = max(sum mask, 1).
// Backward: grad_weights [T, k] -> grad_x; accumulates weight.grad and bias.grad, including the aux
// loss gradient coeff * aux_loss_scale * dL (Automodel's MoEAuxLossAutoScaler).
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "flexep/comm/process_group.h"
#include "flexep/core/config.h"
#include "flexep/core/tensor.h"

namespace flexep {

struct GateSaved;  // what backward needs (logits, scores, selection); opaque

struct GateOutput {
  Tensor weights;                         // [T, k], dtype of x
  Tensor indices;                         // [T, k] int64
  std::optional<double> aux_loss;         // unscaled L; set in training with aux_loss_coeff > 0
  std::vector<std::int64_t> expert_load;  // [E], tokens per expert (unmasked tokens only)
  std::shared_ptr<const GateSaved> saved;
};

class Gate {
 public:
  // param_dtype: f32 or f64 (CPU reference). Parameters start at zero; see init().
  Gate(const MoEConfig& config, std::optional<DType> gate_precision, DType param_dtype = DType::f32);

  // weight ~ N(0, init_std) drawn from (seed, "gate.weight"); bias and correction bias zero.
  void init(std::uint64_t seed, double init_std);

  // x [T, dim] (dtype = param dtype); token_mask [T] bool or undefined (all valid).
  GateOutput forward(const TensorView& x, const TensorView& token_mask, bool training);
  Tensor backward(const GateOutput& forward_output, const TensorView& grad_weights);

  // Aux-loss-free balancing: bias += sign(mean(load) - load) * factor, with the load accumulated
  // over training forwards since the last update and summed over `group` (nullptr: this rank).
  void update_bias(ProcessGroup* group);
  const std::vector<std::int64_t>& cumulative_load() const { return cumulative_load_; }

  Parameter& weight() { return weight_; }
  Parameter& bias() { return bias_; }  // undefined value when router_bias is off
  Tensor& e_score_correction_bias() { return correction_bias_; }  // [E] f32, undefined when off
  std::vector<Parameter*> parameters();  // named "weight", "bias"
  double aux_loss_scale = 1.0;           // MoEAuxLossAutoScaler.main_loss_backward_scale
  const MoEConfig& config() const { return config_; }

 private:
  MoEConfig config_;
  std::optional<DType> precision_;
  Parameter weight_, bias_;
  Tensor correction_bias_;
  std::vector<double> correction_bias_master_;
  std::vector<std::int64_t> cumulative_load_;
};

// Benchmark gate with a perfectly balanced (noise = 0) or a noisy, content-seeded routing
// (Automodel's FakeBalancedGate). No parameters, no gradient to x.
class FakeBalancedGate {
 public:
  FakeBalancedGate(const MoEConfig& config, double noise, int skip_first_n_experts = 0);
  GateOutput forward(const TensorView& x, const TensorView& token_mask);

 private:
  int experts_, topk_, skip_;
  double noise_;
};

}  // namespace flexep
