// Grouped experts, CPU reference: the local experts of one rank applied to expert-major rows
// (the dispatcher's output), forward and backward.
//
// For row n of expert e with prob p:
//   h = x W_gu[e] (+ b_gu[e]);  a = act(h);  y = (a * p) W_down[e] (+ b_down[e] * p)
// or, with moe.apply_router_weight_after_down, y = (a W_down[e] (+ b_down[e])) * p.
// Layouts (Automodel's): gate_and_up_projs [E_local, dim, up_dim], down_projs [E_local, inter, dim],
// gate_up_proj_bias [E_local, up_dim], down_proj_bias [E_local, dim]; up_dim = 2*inter for gated
// activations, inter for relu2. Padding rows (x = 0, p = 0) produce y = 0 and contribute nothing to
// the parameter gradients.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "flexep/core/activation.h"
#include "flexep/core/config.h"
#include "flexep/core/tensor.h"
#include "flexep/layer/moe_weights.h"

namespace flexep {

struct ExpertsSaved;

struct ExpertsOutput {
  Tensor out;  // [N, dim]
  std::shared_ptr<const ExpertsSaved> saved;
};

struct ExpertsGrads {
  Tensor tokens;  // [N, dim]
  Tensor probs;   // [N]
};

// The grouped experts as a function of weights given per call (what MoECompute runs; GroupedExperts
// below calls it with its own parameters). Holds sizes and the activation only.
class GroupedExpertsCompute {
 public:
  // `name` prefixes the weights' names in errors ("experts." or "shared_experts.").
  GroupedExpertsCompute(const MoEConfig& config, int num_local_experts, std::string name = "experts.");

  // weights: the four tensors of ExpertWeights (biases given iff moe.expert_bias), all f32 or all
  // f64 (the precision of the computation), on the CPU. tokens, probs and tokens_per_expert as for
  // GroupedExperts::forward.
  ExpertsOutput forward(const ExpertWeights& weights, const TensorView& tokens, const TensorView& probs,
                        const std::vector<std::int64_t>& tokens_per_expert) const;
  // Adds the weight gradients into the defined members of `accumulate_into` (the weights' dtype and
  // shapes); returns the grads of tokens and probs. `weights` must hold the forward's values (they
  // need not be the same tensors).
  ExpertsGrads backward(const ExpertWeights& weights, const ExpertsOutput& forward_output, const TensorView& grad_out,
                        const ExpertGradients& accumulate_into) const;

  int num_local_experts() const { return local_; }
  const ActivationParams& activation() const { return act_; }

 private:
  DType check_weights(const ExpertWeights& weights) const;  // -> their dtype
  MoEConfig config_;
  int local_;
  std::string name_;
  ActivationParams act_;
};

class GroupedExperts {
 public:
  // first_expert: global id of local expert 0 (rank * E_local), used for initialisation streams.
  GroupedExperts(const MoEConfig& config, int num_local_experts, int first_expert, DType param_dtype = DType::f32);

  // Weights ~ N(0, init_std), per global expert from (seed, name, expert): identical for any
  // number of ranks. Biases zero.
  void init(std::uint64_t seed, double init_std);

  // tokens [N, dim], probs [N] (dtype = param dtype); tokens_per_expert sums to at most N (rows
  // past the sum are ignored and produce zero output).
  ExpertsOutput forward(const TensorView& tokens, const TensorView& probs,
                        const std::vector<std::int64_t>& tokens_per_expert);
  // Accumulates parameter grads; returns grads of tokens and probs.
  ExpertsGrads backward(const ExpertsOutput& forward_output, const TensorView& grad_out);

  // Automodel's GroupedExperts loop (the oracle without any dispatch): for each local expert,
  // gather the unmasked tokens that chose it, run the FFN, scale by the weight, scatter-add.
  // x [T, dim], token_mask [T] (or undefined), weights [T, k], indices [T, k] with global ids.
  Tensor forward_loop(const TensorView& x, const TensorView& token_mask, const TensorView& weights,
                      const TensorView& indices) const;

  Parameter& gate_and_up_projs() { return gate_and_up_; }
  Parameter& down_projs() { return down_; }
  Parameter& gate_up_proj_bias() { return gate_up_bias_; }  // undefined value without expert_bias
  Parameter& down_proj_bias() { return down_bias_; }
  std::vector<Parameter*> parameters();  // named as in Automodel (without the "experts." prefix)
  ExpertWeights weights() const;         // views of the values above
  int num_local_experts() const { return local_; }
  int first_expert() const { return first_; }
  const ActivationParams& activation() const { return compute_.activation(); }

 private:
  MoEConfig config_;
  int local_, first_;
  DType dtype_;
  GroupedExpertsCompute compute_;
  Parameter gate_and_up_, down_, gate_up_bias_, down_bias_;
};

}  // namespace flexep
