#include "flexep/layer/moe_weights.h"

#include <algorithm>

#include "flexep/core/error.h"

namespace flexep {

namespace {

// One row per weight: its name and where it lives in the two structs (one table, so names, lookups
// and the gradient list cannot drift apart).
struct Slot {
  const char* name;
  TensorView& (*weight)(MoEWeights&);
  Tensor* (*grad)(MoEGradients&);  // null: never has a gradient
};

#define FLEXEP_SLOT(name, member, grad_member)                                  \
  Slot {                                                                        \
    name, [](MoEWeights& w) -> TensorView& { return w.member; },                \
        [](MoEGradients& g) -> Tensor* { return &g.grad_member; }               \
  }

const std::vector<Slot>& slots() {
  static const std::vector<Slot> table = {
      FLEXEP_SLOT("gate.weight", gate.weight, gate.weight),
      FLEXEP_SLOT("gate.bias", gate.bias, gate.bias),
      Slot{"gate.e_score_correction_bias", [](MoEWeights& w) -> TensorView& { return w.gate.e_score_correction_bias; },
           nullptr},
      FLEXEP_SLOT("experts.gate_and_up_projs", experts.gate_and_up_projs, experts.gate_and_up_projs),
      FLEXEP_SLOT("experts.down_projs", experts.down_projs, experts.down_projs),
      FLEXEP_SLOT("experts.gate_up_proj_bias", experts.gate_up_proj_bias, experts.gate_up_proj_bias),
      FLEXEP_SLOT("experts.down_proj_bias", experts.down_proj_bias, experts.down_proj_bias),
      FLEXEP_SLOT("shared_experts.gate_and_up_projs", shared_experts.gate_and_up_projs,
                  shared_experts.gate_and_up_projs),
      FLEXEP_SLOT("shared_experts.down_projs", shared_experts.down_projs, shared_experts.down_projs),
      FLEXEP_SLOT("shared_experts.gate_up_proj_bias", shared_experts.gate_up_proj_bias,
                  shared_experts.gate_up_proj_bias),
      FLEXEP_SLOT("shared_experts.down_proj_bias", shared_experts.down_proj_bias, shared_experts.down_proj_bias),
      FLEXEP_SLOT("shared_expert_gate.weight", shared_expert_gate, shared_expert_gate),
      FLEXEP_SLOT("fc1_latent_proj.weight", fc1_latent_proj.weight, fc1_latent_proj.weight),
      FLEXEP_SLOT("fc1_latent_proj.bias", fc1_latent_proj.bias, fc1_latent_proj.bias),
      FLEXEP_SLOT("fc2_latent_proj.weight", fc2_latent_proj.weight, fc2_latent_proj.weight),
      FLEXEP_SLOT("fc2_latent_proj.bias", fc2_latent_proj.bias, fc2_latent_proj.bias),
  };
  return table;
}

#undef FLEXEP_SLOT

std::string dtype_list(const std::vector<DType>& ts) {
  std::string s;
  for (DType t : ts) s += (s.empty() ? "" : ", ") + std::string(dtype_name(t));
  return s;
}

bool is_gate_weight(const std::string& name) { return name.rfind("gate.", 0) == 0; }

}  // namespace

TensorView* MoEWeights::find(std::string_view name) {
  for (const Slot& s : slots())
    if (name == s.name) return &s.weight(*this);
  return nullptr;
}

const TensorView* MoEWeights::find(std::string_view name) const { return const_cast<MoEWeights*>(this)->find(name); }

std::vector<std::pair<std::string, Tensor>> MoEGradients::named() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const Slot& s : slots()) {
    if (!s.grad) continue;
    const Tensor& g = *s.grad(const_cast<MoEGradients&>(*this));
    if (g.defined()) out.emplace_back(s.name, g);
  }
  return out;
}

const std::vector<std::string>& moe_weight_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const Slot& s : slots()) n.emplace_back(s.name);
    return n;
  }();
  return names;
}

std::vector<MoEWeightSpec> moe_weight_specs(const MoEConfig& c, const BackendConfig& backend, int num_local_experts) {
  const std::int64_t E = c.n_routed_experts, El = num_local_experts, dim = c.dim, xd = c.expert_dim();
  const std::int64_t up = c.up_dim(), inter = c.moe_inter_dim;
  const std::int64_t inter_s = c.shared_inter();
  const std::int64_t up_s = c.shared_expert_activation == Activation::relu2 ? inter_s : 2 * inter_s;
  const bool router = !backend.fake_balanced_gate, shared = c.n_shared_experts > 0;
  std::vector<MoEWeightSpec> v;
  if (router) {
    v.push_back({"gate.weight", {E, dim}, "[moe.n_routed_experts, moe.dim]", c.train_gate});
    if (c.router_bias) v.push_back({"gate.bias", {E}, "[moe.n_routed_experts]", c.train_gate});
    if (c.has_correction_bias())
      v.push_back({"gate.e_score_correction_bias", {E}, "[moe.n_routed_experts]", false});
  }
  // The routed experts' width: moe.dim, or the latent size.
  const char* xd_name = c.latent() ? "moe.moe_latent_size" : "moe.dim";
  v.push_back({"experts.gate_and_up_projs", {El, xd, up}, std::string("[local experts, ") + xd_name + ", up]", true});
  v.push_back({"experts.down_projs", {El, inter, xd},
               std::string("[local experts, moe.moe_inter_dim, ") + xd_name + "]", true});
  if (c.expert_bias) {
    v.push_back({"experts.gate_up_proj_bias", {El, up}, "[local experts, up]", true});
    v.push_back({"experts.down_proj_bias", {El, xd}, std::string("[local experts, ") + xd_name + "]", true});
  }
  if (shared) {
    v.push_back({"shared_experts.gate_and_up_projs", {1, dim, up_s}, "[1, moe.dim, shared up]", true});
    v.push_back({"shared_experts.down_projs", {1, inter_s, dim}, "[1, shared inter, moe.dim]", true});
    if (c.expert_bias) {
      v.push_back({"shared_experts.gate_up_proj_bias", {1, up_s}, "[1, shared up]", true});
      v.push_back({"shared_experts.down_proj_bias", {1, dim}, "[1, moe.dim]", true});
    }
    if (c.shared_expert_gate) v.push_back({"shared_expert_gate.weight", {1, dim}, "[1, moe.dim]", true});
  }
  if (c.latent()) {
    v.push_back({"fc1_latent_proj.weight", {xd, dim}, "[moe.moe_latent_size, moe.dim]", true});
    if (c.expert_bias) v.push_back({"fc1_latent_proj.bias", {xd}, "[moe.moe_latent_size]", true});
    v.push_back({"fc2_latent_proj.weight", {dim, xd}, "[moe.dim, moe.moe_latent_size]", true});
    if (c.expert_bias) v.push_back({"fc2_latent_proj.bias", {dim}, "[moe.dim]", true});
  }
  return v;
}

void check_moe_weights(const MoEWeights& weights, const std::vector<MoEWeightSpec>& specs,
                       const std::function<MoEWeightRule(const MoEWeightSpec&)>& rule, bool optional_gate) {
  for (const std::string& name : moe_weight_names()) {
    const TensorView& t = *weights.find(name);
    const auto spec = std::find_if(specs.begin(), specs.end(), [&](const MoEWeightSpec& s) { return s.name == name; });
    if (spec == specs.end()) {
      FLEXEP_CHECK_ARG(!t.defined(), name, "was given (shape ", t.shape.str(),
                       ") but this configuration has no such weight; it takes: ", [&] {
                         std::string s;
                         for (const MoEWeightSpec& sp : specs) s += (s.empty() ? "" : ", ") + sp.name;
                         return s;
                       }());
      continue;
    }
    if (!t.defined()) {
      FLEXEP_CHECK_ARG(optional_gate && is_gate_weight(name), name, "is missing; this configuration needs it, shape ",
                       spec->shape.str(), " ", spec->dims);
      continue;
    }
    FLEXEP_CHECK_ARG(t.shape == spec->shape, name, "has shape ", t.shape.str(), ", expected ", spec->shape.str(), " ",
                     spec->dims);
    const MoEWeightRule r = rule(*spec);
    FLEXEP_CHECK_ARG(std::find(r.dtypes.begin(), r.dtypes.end(), t.dtype) != r.dtypes.end(), name, "has dtype ",
                     dtype_name(t.dtype), ", expected ", r.dtypes.size() > 1 ? "one of " : "", dtype_list(r.dtypes));
    FLEXEP_CHECK_ARG(t.device == r.device, name, "is on ", t.device.str(), ", expected ", r.device.str());
    FLEXEP_CHECK_ARG(t.numel() == 0 || t.data != nullptr, name, "has no data (a null pointer with shape ",
                     t.shape.str(), ")");
  }
}

}  // namespace flexep
