// The router (NeMo Automodel's Gate), CPU reference, forward and backward.
//
// Forward on x [T, dim] with token_mask [T]:
//   logits = x W^T (+ b) as Automodel's F.linear: x, W and b cast to the gate precision, or to x's
//            dtype without one; with bf16/f16 x and no gate precision the logits are rounded to x's
//            dtype (fp32 accumulation), and scored in fp32 from the rounded values. Arithmetic in
//            f64 if the precision (or, without one, x) is f64, else f32; sqrtsoftplus routes in f32.
//   softmax:            top-k of the raw logits, weights = softmax over those k values;
//                       original_scores = full softmax (aux loss only);
//   softmax + softmax_before_topk: full softmax, top-k of it, weights gathered from it;
//   softmax_with_bias:  full softmax; selection on softmax + correction bias, with optional group
//                       limiting (group score = sum of its top-2); weights from the unbiased softmax;
//   sigmoid:            sigmoid; selection on sigmoid + correction bias; group score = max per group
//                       without a correction bias, sum of top-2 with one; weights from the unbiased
//                       sigmoid, or from the biased one with router_weight_uses_score_correction_bias
//                       (then the original scores are the biased ones too);
//   sigmoid_with_bias:  as sigmoid, but the group score is always the sum of the top-2;
//   sqrtsoftplus:       sqrt(softplus(logits)) (torch's softplus, threshold 20); selection on it +
//                       correction bias; no group limiting; weights from the unbiased scores.
//   Group limiting keeps n_limited_groups groups (n_expert_groups 0 or 1: none; softmax and
//   sqrtsoftplus ignore groups). With group_mask `automodel` the dropped groups' selection scores are
//   multiplied by 0 under softmax_with_bias and sigmoid (so with negative biased scores a dropped
//   expert can still be selected) and set to -inf under sigmoid_with_bias; `neg_inf` sets them to
//   -inf everywhere. Ties: the lower index wins (experts and groups), everywhere.
//   norm_topk_prob and k > 1: weights /= sum + 1e-20, and original_scores likewise.
//   weights *= route_scale; then cast to x's dtype (f32 with router_weights_fp32).
//   replay_indices [T, k] (moe.enable_routing_replay): the selection is not computed but taken from
//   there; the weights are gathered at those indices as above (Automodel's replay_selection).
//   load[e] = number of unmasked tokens that selected e.
//   aux loss (training, coeff > 0): L = sum_e f_e P_e, f_e = load_e E / (k Lctx),
//   P_e = sum_t mask_t original_scores[t, e] / Lctx, Lctx = max(sum mask, 1).
// Backward: grad_weights [T, k] -> grad_x (x's dtype); accumulates weight.grad and bias.grad,
// including the aux loss gradient coeff * aux_loss_scale * dL (Automodel's MoEAuxLossAutoScaler).
// The roundings are passed straight through (the derivative of the unrounded formulas at the
// rounded values).
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "flexep/comm/process_group.h"
#include "flexep/core/config.h"
#include "flexep/core/tensor.h"
#include "flexep/layer/moe_weights.h"

namespace flexep {

struct GateSaved;  // what backward needs (logits, scores, selection); opaque

struct GateOutput {
  Tensor weights;                         // [T, k], dtype of x (f32 with router_weights_fp32)
  Tensor indices;                         // [T, k] int64
  std::optional<double> aux_loss;         // unscaled L; set in training with aux_loss_coeff > 0
  std::vector<std::int64_t> expert_load;  // [E], tokens per expert (unmasked tokens only)
  std::shared_ptr<const GateSaved> saved;
};

// The gate as a function of weights given per call (MoECompute's router; Gate below calls it with
// its own parameters). Holds the configuration only.
class GateCompute {
 public:
  GateCompute(const MoEConfig& config, std::optional<DType> gate_precision);

  // x [T, dim] f32, f64, bf16 or f16; weights.weight [E, dim] and weights.bias [E] (given iff
  // moe.router_bias) in any float dtype, cast as Automodel's F.linear casts them (to the gate
  // precision, else to x's dtype); weights.e_score_correction_bias [E] f32, given iff
  // moe.has_correction_bias(); token_mask [T] bool or undefined (all valid); replay_indices as in
  // Gate::forward. All on the CPU.
  GateOutput forward(const GateWeights& weights, const TensorView& x, const TensorView& token_mask,
                     bool training, const TensorView& replay_indices = TensorView()) const;
  // grad_weights [T, k] -> grad x (x's dtype). Adds the gradients of the weight and the bias into the
  // defined members of `accumulate_into` (any float dtype, the weights' shapes). `weights` are read
  // as the forward read them (same precision); they need not be the forward's tensors, only hold
  // the same values. aux_loss_scale: MoEAuxLossAutoScaler.main_loss_backward_scale.
  Tensor backward(const GateWeights& weights, const GateOutput& forward_output, const TensorView& grad_weights,
                  double aux_loss_scale, const GateGradients& accumulate_into) const;

  const MoEConfig& config() const { return config_; }
  std::optional<DType> precision() const { return precision_; }

 private:
  MoEConfig config_;
  std::optional<DType> precision_;
};

class Gate {
 public:
  // param_dtype: f32 or f64 (CPU reference). Parameters start at zero; see init().
  Gate(const MoEConfig& config, std::optional<DType> gate_precision, DType param_dtype = DType::f32);

  // weight ~ N(0, init_std) drawn from (seed, "gate.weight"); bias and correction bias zero.
  void init(std::uint64_t seed, double init_std);

  // x [T, dim] in the parameter dtype, or bf16/f16; token_mask [T] bool or undefined (all valid);
  // replay_indices [T, k] int32/int64 or undefined (only with moe.enable_routing_replay; ids in
  // [0, E), distinct per token).
  GateOutput forward(const TensorView& x, const TensorView& token_mask, bool training,
                     const TensorView& replay_indices = TensorView());
  Tensor backward(const GateOutput& forward_output, const TensorView& grad_weights);

  // Aux-loss-free balancing: bias += sign(mean(load) - load) * factor, with the load accumulated
  // over training forwards since the last update and summed over `group` (nullptr: this rank).
  void update_bias(ProcessGroup* group);
  const std::vector<std::int64_t>& cumulative_load() const { return cumulative_load_; }
  // What a training forward adds to the cumulative load (for owners that route through GateCompute).
  void add_to_cumulative_load(const std::vector<std::int64_t>& expert_load);

  Parameter& weight() { return weight_; }
  Parameter& bias() { return bias_; }  // undefined value when router_bias is off
  Tensor& e_score_correction_bias() { return correction_bias_; }  // [E] f32, undefined when off
  std::vector<Parameter*> parameters();  // named "weight", "bias"
  GateWeights weights() const;           // views of the values above
  double aux_loss_scale = 1.0;           // MoEAuxLossAutoScaler.main_loss_backward_scale
  const MoEConfig& config() const { return config_; }
  const GateCompute& compute() const { return compute_; }

 private:
  MoEConfig config_;
  GateCompute compute_;
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
