// Test helpers for MoECompute: MoEWeights from an owner MoELayer's parameters (the shared experts
// packed into the grouped layout by this file's own loops, independently of the library's layout
// code), deep copies of weights at new addresses, and gradients by state_dict name.
#pragma once

#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "flexep/layer/moe_layer.h"

namespace flexep::testing {

// MoEWeights plus the tensors its views point into (packed or copied ones).
struct HeldWeights {
  MoEWeights w;
  std::vector<Tensor> keep;
  const TensorView& hold(Tensor t) {
    keep.push_back(std::move(t));
    return keep.back().view();
  }
};

inline Parameter* find_param(MoELayer& L, const std::string& name) {
  for (Parameter* p : L.parameters())
    if (p->name == name) return p;
  return nullptr;
}

inline TensorView value_of(MoELayer& L, const std::string& name) {
  Parameter* p = find_param(L, name);
  return p ? p->value.view() : TensorView();
}

inline bool shared_gated(const MoEConfig& c) { return c.shared_expert_activation != Activation::relu2; }

// nn.Linear-shaped shared-expert tensors (weights or their gradients) in the grouped one-expert
// layout: gate_and_up [1, dim, up] with [d, i] = gate[i, d] and [d, up - I + i] = up[i, d]; down
// [1, I, dim] with [i, d] = down[d, i]; gate_up bias [1, up] = [gate | up]; down bias [1, dim].
inline ExpertGradients pack_shared(const MoEConfig& c, const TensorView& gate, const TensorView& up,
                                   const TensorView& down, const TensorView& gate_b, const TensorView& up_b,
                                   const TensorView& down_b) {
  const std::int64_t I = c.shared_inter(), D = c.dim, U = shared_gated(c) ? 2 * I : I;
  ExpertGradients g;
  const DType t = up.dtype;
  g.gate_and_up_projs = Tensor::zeros({1, D, U}, t);
  g.down_projs = Tensor::zeros({1, I, D}, t);
  for (std::int64_t d = 0; d < D; ++d)
    for (std::int64_t i = 0; i < I; ++i) {
      if (shared_gated(c)) write_from_double(g.gate_and_up_projs, d * U + i, read_as_double(gate, i * D + d));
      write_from_double(g.gate_and_up_projs, d * U + (U - I) + i, read_as_double(up, i * D + d));
      write_from_double(g.down_projs, i * D + d, read_as_double(down, d * I + i));
    }
  if (up_b.defined()) {
    g.gate_up_proj_bias = Tensor::zeros({1, U}, t);
    g.down_proj_bias = Tensor::zeros({1, D}, t);
    for (std::int64_t i = 0; i < I; ++i) {
      if (shared_gated(c)) write_from_double(g.gate_up_proj_bias, i, read_as_double(gate_b, i));
      write_from_double(g.gate_up_proj_bias, (U - I) + i, read_as_double(up_b, i));
    }
    for (std::int64_t d = 0; d < D; ++d) write_from_double(g.down_proj_bias, d, read_as_double(down_b, d));
  }
  return g;
}

// The owner's parameters as MoEWeights: views for the gate and the routed experts, a packed copy for
// the shared experts.
inline HeldWeights owner_weights(MoELayer& L) {
  const MoEConfig& c = L.config();
  HeldWeights h;
  if (Gate* g = L.gate()) {
    h.w.gate.weight = g->weight().value;
    if (g->bias().value.defined()) h.w.gate.bias = g->bias().value;
    if (g->e_score_correction_bias().defined()) h.w.gate.e_score_correction_bias = g->e_score_correction_bias();
  }
  GroupedExperts& e = L.experts();
  h.w.experts = {e.gate_and_up_projs().value, e.down_projs().value, e.gate_up_proj_bias().value,
                 e.down_proj_bias().value};
  if (L.shared_experts()) {
    const ExpertGradients packed =
        pack_shared(c, value_of(L, "shared_experts.gate_proj.weight"), value_of(L, "shared_experts.up_proj.weight"),
                    value_of(L, "shared_experts.down_proj.weight"), value_of(L, "shared_experts.gate_proj.bias"),
                    value_of(L, "shared_experts.up_proj.bias"), value_of(L, "shared_experts.down_proj.bias"));
    h.w.shared_experts.gate_and_up_projs = h.hold(packed.gate_and_up_projs);
    h.w.shared_experts.down_projs = h.hold(packed.down_projs);
    if (packed.gate_up_proj_bias.defined()) {
      h.w.shared_experts.gate_up_proj_bias = h.hold(packed.gate_up_proj_bias);
      h.w.shared_experts.down_proj_bias = h.hold(packed.down_proj_bias);
    }
    h.w.shared_expert_gate = value_of(L, "shared_expert_gate.weight");
  }
  if (LatentProjections* lp = L.latent_projections()) {
    h.w.fc1_latent_proj = lp->fc1();
    h.w.fc2_latent_proj = lp->fc2();
  }
  return h;
}

// The owner's gradients under MoEWeights names (shared experts packed like their weights).
inline std::vector<std::pair<std::string, Tensor>> owner_gradients(MoELayer& L) {
  const MoEConfig& c = L.config();
  std::vector<std::pair<std::string, Tensor>> out;
  for (Parameter* p : L.parameters())
    if (p->name.rfind("shared_experts.", 0) != 0 && p->grad.defined()) out.emplace_back(p->name, p->grad);
  if (L.shared_experts()) {
    auto grad = [&](const char* n) {
      Parameter* p = find_param(L, n);
      return p && p->grad.defined() ? p->grad.view() : TensorView();
    };
    const ExpertGradients g =
        pack_shared(c, grad("shared_experts.gate_proj.weight"), grad("shared_experts.up_proj.weight"),
                    grad("shared_experts.down_proj.weight"), grad("shared_experts.gate_proj.bias"),
                    grad("shared_experts.up_proj.bias"), grad("shared_experts.down_proj.bias"));
    out.emplace_back("shared_experts.gate_and_up_projs", g.gate_and_up_projs);
    out.emplace_back("shared_experts.down_projs", g.down_projs);
    if (g.gate_up_proj_bias.defined()) {
      out.emplace_back("shared_experts.gate_up_proj_bias", g.gate_up_proj_bias);
      out.emplace_back("shared_experts.down_proj_bias", g.down_proj_bias);
    }
  }
  return out;
}

// Deep copies of every given weight (new addresses, same values), optionally converted to `dtype`
// (the correction bias stays f32).
inline HeldWeights copies(const MoEWeights& w, std::optional<DType> dtype = std::nullopt) {
  HeldWeights h;
  for (const std::string& name : moe_weight_names()) {
    const TensorView& v = *w.find(name);
    if (!v.defined()) continue;
    Tensor t = Tensor::wrap(v).clone();
    if (dtype && name != "gate.e_score_correction_bias") t = t.to(*dtype);
    *h.w.find(name) = h.hold(t);
  }
  return h;
}

// Overwrites every given weight with NaN (what a freed or resharded buffer may hold).
inline void poison(const MoEWeights& w) {
  for (const std::string& name : moe_weight_names()) {
    const TensorView& v = *w.find(name);
    for (std::int64_t i = 0; i < v.numel(); ++i) write_from_double(v, i, std::nan(""));
  }
}

}  // namespace flexep::testing
