// Shared experts: a dense MLP every token passes through (Automodel's MLP), optionally scaled by
// a sigmoid gate: z = sigmoid(x w_g^T) * MLP(x). CPU reference, forward and backward.
//   swiglu: MLP(x) = down(silu(gate(x)) * up(x));   relu2: MLP(x) = down(relu(up(x))^2)
// With moe.swiglu_limit L > 0, swiglu clamps gate(x) <= L and up(x) to [-L, L] first (Automodel's MLP).
// Weights are nn.Linear-shaped [out, in]: gate_proj/up_proj [inter, dim], down_proj [dim, inter];
// biases (expert_bias) [out]; shared_expert_gate [1, dim] without bias.
#pragma once

#include <memory>
#include <vector>

#include "flexep/core/config.h"
#include "flexep/core/tensor.h"

namespace flexep {

struct SharedSaved;

struct SharedOutput {
  Tensor out;  // [T, dim]
  std::shared_ptr<const SharedSaved> saved;
};

// The shared MLP's tensors in nn.Linear layout (Automodel's shared_experts.gate_proj.weight, ...).
template <class T>
struct SharedMlpTensors {
  T gate_proj, up_proj, down_proj;                 // [inter, dim], [inter, dim], [dim, inter]; no gate_proj for relu2
  T gate_proj_bias, up_proj_bias, down_proj_bias;  // [inter], [inter], [dim]  (moe.expert_bias)
  T shared_expert_gate;                            // [1, dim]  (moe.shared_expert_gate)
};
using SharedMlpWeights = SharedMlpTensors<TensorView>;
using SharedMlpGradients = SharedMlpTensors<Tensor>;

// The shared experts as a function of weights given per call (what MoECompute runs; SharedExperts
// below calls it with its own parameters). Holds the configuration only.
class SharedExpertsCompute {
 public:
  explicit SharedExpertsCompute(const MoEConfig& config);
  // weights: present as the configuration says, all in one dtype, f32 or f64 (the precision of
  // the computation), on the CPU; x [T, dim] any float dtype.
  SharedOutput forward(const SharedMlpWeights& weights, const TensorView& x) const;
  // -> grad x. Adds the weight gradients into the defined members of `accumulate_into` (the weights'
  // dtype and shapes). `weights` must hold the forward's values (not necessarily the same tensors).
  Tensor backward(const SharedMlpWeights& weights, const SharedOutput& forward_output, const TensorView& grad_out,
                  const SharedMlpGradients& accumulate_into) const;
  int inter() const { return inter_; }

 private:
  DType check_weights(const SharedMlpWeights& weights) const;  // -> their dtype
  MoEConfig config_;
  int inter_;
};

class SharedExperts {
 public:
  SharedExperts(const MoEConfig& config, DType param_dtype = DType::f32);
  void init(std::uint64_t seed, double init_std);  // weights N(0, std), biases zero
  SharedOutput forward(const TensorView& x);
  Tensor backward(const SharedOutput& forward_output, const TensorView& grad_out);  // -> grad x
  // "shared_experts.gate_proj.weight", ..., "shared_expert_gate.weight" (full names).
  std::vector<Parameter*> parameters();
  SharedMlpWeights weights() const;  // views of the values above

 private:
  MoEConfig config_;
  DType dtype_;
  SharedExpertsCompute compute_;
  int inter_;
  Parameter gate_w_, up_w_, down_w_, gate_b_, up_b_, down_b_, gate_scalar_w_;
};

}  // namespace flexep
