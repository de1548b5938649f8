// The MoE layer's weights for one call, as views of tensors the caller owns (PyTorch's parameters
// under FSDP2, an owner type's Parameters, ...), and the gradients a backward returns for them.
// The compute objects (moe_compute.h, cuda_moe_compute.h) read these views during the call only and
// keep no pointer to them, so the caller may hand other tensors (other addresses, same values) to
// each call: a backward reads the weights passed to it, not those of its forward.
//
// Members and names follow Automodel's state_dict ("experts.gate_and_up_projs", ...). The shared
// experts use the grouped one-expert layout on every device: gate_and_up_projs [1, dim, up_s] =
// [gate_proj^T | up_proj^T] (relu2: up_proj^T), down_projs [1, inter_s, dim] = down_proj^T, biases
// [1, up_s] = [gate_proj.bias | up_proj.bias] and [1, dim] (inter_s = moe.shared_inter(), up_s =
// 2 * inter_s for gated activations, inter_s for relu2). With moe.moe_latent_size the routed experts'
// "dim" is the latent size (moe.expert_dim()) and the two latent projections are nn.Linear-shaped:
// fc1_latent_proj [latent, dim], fc2_latent_proj [dim, latent], biases (moe.expert_bias) [out].
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "flexep/core/config.h"
#include "flexep/core/tensor.h"

namespace flexep {

// A grouped-experts layer: the routed experts of one rank [E_local, ...] or the shared experts [1, ...].
struct ExpertWeights {
  TensorView gate_and_up_projs;  // [E, dim, up]
  TensorView down_projs;         // [E, inter, dim]
  TensorView gate_up_proj_bias;  // [E, up]   (moe.expert_bias)
  TensorView down_proj_bias;     // [E, dim]  (moe.expert_bias)
};
struct ExpertGradients {
  Tensor gate_and_up_projs, down_projs, gate_up_proj_bias, down_proj_bias;
};

struct GateWeights {
  TensorView weight;                   // [E, dim]
  TensorView bias;                     // [E] (moe.router_bias)
  TensorView e_score_correction_bias;  // [E] fp32, read for selection only; never gets a gradient
};
struct GateGradients {
  Tensor weight, bias;
};

// An nn.Linear: weight [out, in], bias [out] (moe.expert_bias).
struct LinearWeights {
  TensorView weight;
  TensorView bias;
};
struct LinearGradients {
  Tensor weight, bias;
};

struct MoEWeights {
  GateWeights gate;
  ExpertWeights experts;
  ExpertWeights shared_experts;
  TensorView shared_expert_gate;  // "shared_expert_gate.weight" [1, dim]
  LinearWeights fc1_latent_proj;  // dim -> latent (moe.moe_latent_size)
  LinearWeights fc2_latent_proj;  // latent -> dim

  // The member of a state_dict name, or null for a name the layer does not have.
  TensorView* find(std::string_view name);
  const TensorView* find(std::string_view name) const;
};

// Fresh tensors, owned by the caller: the library never writes them after the backward that made
// them. Undefined for weights the configuration lacks or that get no gradient.
struct MoEGradients {
  GateGradients gate;
  ExpertGradients experts;
  ExpertGradients shared_experts;
  Tensor shared_expert_gate;
  LinearGradients fc1_latent_proj, fc2_latent_proj;

  // (state_dict name, gradient) for every defined gradient, in moe_weight_names() order.
  std::vector<std::pair<std::string, Tensor>> named() const;
};

// Every weight name the layer can have, in a fixed order (gate, routed experts, shared experts,
// latent projections: Automodel's module order).
const std::vector<std::string>& moe_weight_names();

// One weight a configuration takes.
struct MoEWeightSpec {
  std::string name;    // state_dict name
  Shape shape;         // on this rank (routed experts: the local ones)
  std::string dims;    // what the dimensions are, for errors: "[local experts, moe.dim, up]"
  bool requires_grad;  // gate.*: moe.train_gate; the correction bias: never; the rest: always
};

// The weights of a layer with this configuration on a rank holding num_local_experts routed
// experts, in moe_weight_names() order. The fake balanced gate has no gate weights.
std::vector<MoEWeightSpec> moe_weight_specs(const MoEConfig& config, const BackendConfig& backend,
                                            int num_local_experts);

// What a compute object accepts for one weight.
struct MoEWeightRule {
  std::vector<DType> dtypes;
  Device device;
};

// Checks `weights` against `specs`: each spec's weight is given (unless `optional_gate`: then the
// gate.* weights may be absent, as a routing override does not read them), with its shape, one of
// rule(spec)'s dtypes, on its device; a weight that no spec names must be absent. Throws an
// ArgumentError named after the weight ("experts.gate_and_up_projs") that says what was given and
// what is expected.
void check_moe_weights(const MoEWeights& weights, const std::vector<MoEWeightSpec>& specs,
                       const std::function<MoEWeightRule(const MoEWeightSpec&)>& rule, bool optional_gate);

}  // namespace flexep
