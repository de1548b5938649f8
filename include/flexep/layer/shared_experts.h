// Shared experts: a dense MLP every token passes through (Automodel's MLP), optionally scaled by
// a sigmoid gate: z = sigmoid(x w_g^T) * MLP(x). CPU reference, forward and backward.
//   swiglu: MLP(x) = down(silu(gate(x)) * up(x));   relu2: MLP(x) = down(relu(up(x))^2)
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

class SharedExperts {
 public:
  SharedExperts(const MoEConfig& config, DType param_dtype = DType::f32);
  void init(std::uint64_t seed, double init_std);  // weights N(0, std), biases zero
  SharedOutput forward(const TensorView& x);
  Tensor backward(const SharedOutput& forward_output, const TensorView& grad_out);  // -> grad x
  // "shared_experts.gate_proj.weight", ..., "shared_expert_gate.weight" (full names).
  std::vector<Parameter*> parameters();

 private:
  MoEConfig config_;
  DType dtype_;
  int inter_;
  Parameter gate_w_, up_w_, down_w_, gate_b_, up_b_, down_b_, gate_scalar_w_;
};

}  // namespace flexep
