#include "flexep/core/config.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <string>

#include "flexep/core/error.h"

namespace flexep {

namespace {
template <class E, std::size_t N>
struct NameTable {
  std::array<std::pair<std::string_view, E>, N> entries;

  std::string_view name(E value) const {
    for (const auto& [n, v] : entries)
      if (v == value) return n;
    return "?";
  }
  // The allowed values as the user types them, aliases included: "'host', 'alltoall', ...".
  std::string allowed() const {
    std::string s;
    for (const auto& [n, v] : entries) {
      (void)v;
      if (!s.empty()) s += ", ";
      s.append("'").append(n).append("'");
    }
    return s;
  }
  E parse(std::string_view s, const std::string& arg) const {
    for (const auto& [n, v] : entries)
      if (n == s) return v;
    throw_argument_error(arg, "unknown value '", s, "'; allowed: ", allowed());
  }
};

// The first entry for a value is its canonical name; later ones are aliases.
constexpr NameTable<DispatcherKind, 5> kDispatchers{{{{"host", DispatcherKind::host},
                                                      {"alltoall", DispatcherKind::alltoall},
                                                      {"torch", DispatcherKind::alltoall},
                                                      {"deepep", DispatcherKind::deepep},
                                                      {"hybridep", DispatcherKind::hybridep}}}};
constexpr NameTable<ExpertsKind, 4> kExperts{{{{"torch", ExpertsKind::torch},
                                               {"torch_mm", ExpertsKind::torch_mm},
                                               {"gmm", ExpertsKind::gmm},
                                               {"te", ExpertsKind::te}}}};
constexpr NameTable<ScoreFunc, 5> kScoreFuncs{{{{"softmax", ScoreFunc::softmax},
                                                {"softmax_with_bias", ScoreFunc::softmax_with_bias},
                                                {"sigmoid", ScoreFunc::sigmoid},
                                                {"sigmoid_with_bias", ScoreFunc::sigmoid_with_bias},
                                                {"sqrtsoftplus", ScoreFunc::sqrtsoftplus}}}};
constexpr NameTable<Activation, 5> kActivations{{{{"swiglu", Activation::swiglu},
                                                  {"swigluoai", Activation::swigluoai},
                                                  {"quick_geglu", Activation::quick_geglu},
                                                  {"geglu", Activation::geglu},
                                                  {"relu2", Activation::relu2}}}};
constexpr NameTable<GroupMask, 2> kGroupMasks{{{{"automodel", GroupMask::automodel}, {"neg_inf", GroupMask::neg_inf}}}};

constexpr int kMaxSms = 1024;
// Each chunk is one more dispatcher with its own buffers (and, on the GPU, collectives to create).
constexpr int kMaxDispatchChunks = 16;

void check_sms(int v, int min, const char* arg) {
  FLEXEP_CHECK_ARG(v >= min && v <= kMaxSms, arg, "is ", v, "; allowed: ", min, " <= value <= ", kMaxSms,
                   min == 0 ? " (0 = use dispatcher_num_sms)" : "");
}

// The SM count shared by both phases of the configured backend, before per-phase overrides.
int backend_sms(const BackendConfig& c) {
  const int per_backend = c.dispatcher == DispatcherKind::deepep     ? c.deepep_num_sms
                          : c.dispatcher == DispatcherKind::hybridep ? c.hybridep_num_sms
                                                                     : 0;
  return per_backend > 0 ? per_backend : c.dispatcher_num_sms;
}
}  // namespace

std::string_view to_string(DispatcherKind k) { return kDispatchers.name(k); }
std::string_view to_string(ExpertsKind k) { return kExperts.name(k); }
std::string_view to_string(ScoreFunc k) { return kScoreFuncs.name(k); }
std::string_view to_string(Activation k) { return kActivations.name(k); }
std::string_view to_string(GroupMask k) { return kGroupMasks.name(k); }

DispatcherKind parse_dispatcher(std::string_view s, const std::string& arg) {
  // Automodel dispatchers built on libraries flexep does not have: say so rather than "unknown".
  if (s == "uccl_ep" || s == "mok")
    throw_argument_error(arg, "is '", s, "', Automodel's ", s == "mok" ? "Mixture-of-Kittens" : "UCCL-EP",
                         " dispatcher, which flexep does not provide; use 'alltoall' (alias 'torch'), 'hybridep', "
                         "'deepep' or 'host'");
  return kDispatchers.parse(s, arg);
}
ExpertsKind parse_experts(std::string_view s, const std::string& arg) { return kExperts.parse(s, arg); }
ScoreFunc parse_score_func(std::string_view s, const std::string& arg) { return kScoreFuncs.parse(s, arg); }
Activation parse_activation(std::string_view s, const std::string& arg) { return kActivations.parse(s, arg); }
GroupMask parse_group_mask(std::string_view s, const std::string& arg) { return kGroupMasks.parse(s, arg); }

// The hybridep_*_sms phase overrides win whatever the dispatcher, so a backend built directly from a
// config (tests, benchmarks) sees them even when `dispatcher` was left at its default.
int BackendConfig::dispatch_sms() const {
  return hybridep_dispatch_sms > 0 ? hybridep_dispatch_sms : backend_sms(*this);
}
int BackendConfig::combine_sms() const { return hybridep_combine_sms > 0 ? hybridep_combine_sms : backend_sms(*this); }
int BackendConfig::preprocess_sms() const {
  return hybridep_preprocess_sms > 0 ? hybridep_preprocess_sms : backend_sms(*this);
}

void validate(const BackendConfig& c) {
  FLEXEP_CHECK_ARG(c.dispatcher_num_sms >= 0 && c.dispatcher_num_sms <= kMaxSms, "backend.dispatcher_num_sms", "is ",
                   c.dispatcher_num_sms, "; allowed: 0 <= value <= ", kMaxSms, " (0 = the backend's default)");
  check_sms(c.deepep_num_sms, 0, "backend.deepep_num_sms");
  check_sms(c.hybridep_num_sms, 0, "backend.hybridep_num_sms");
  check_sms(c.hybridep_dispatch_sms, 0, "backend.hybridep_dispatch_sms");
  check_sms(c.hybridep_combine_sms, 0, "backend.hybridep_combine_sms");
  check_sms(c.hybridep_preprocess_sms, 0, "backend.hybridep_preprocess_sms");
  // Written so that NaN fails too. The upper bounds of the scales here and below are far above any
  // model's and keep the router's products finite (1e308 passed, and overflowed to Inf downstream).
  FLEXEP_CHECK_ARG(c.fake_gate_noise >= 0.0 && c.fake_gate_noise <= 1e4, "backend.fake_gate_noise", "is ",
                   c.fake_gate_noise, "; allowed: 0 to 10000 (0 = balanced, 1 = fully random)");
  if (c.gate_precision)
    FLEXEP_CHECK_ARG(*c.gate_precision == DType::f32 || *c.gate_precision == DType::f64, "backend.gate_precision",
                     "is ", dtype_name(*c.gate_precision), "; allowed: f32 (float32), f64 (float64) or unset");
  FLEXEP_CHECK_ARG(c.dispatch_chunks >= 1 && c.dispatch_chunks <= kMaxDispatchChunks, "backend.dispatch_chunks", "is ",
                   c.dispatch_chunks, "; allowed: 1 <= value <= ", kMaxDispatchChunks, " (1 = no split)");
}

void validate(const MoEConfig& c) {
  const int E = c.n_routed_experts, k = c.n_activated_experts, G = c.n_expert_groups;
  FLEXEP_CHECK_ARG(E >= 1, "moe.n_routed_experts", "is ", E, "; allowed: >= 1");
  FLEXEP_CHECK_ARG(k >= 1 && k <= E, "moe.n_activated_experts", "is ", k, "; allowed: 1 <= value <= n_routed_experts (",
                   E, ")");
  // Upper bounds far above any model, low enough that every size product of the layer fits 64-bit
  // arithmetic and every per-row size (2 * moe_inter_dim, E, k) a 32-bit index.
  FLEXEP_CHECK_ARG(E <= (1 << 16), "moe.n_routed_experts", "is ", E, "; allowed: <= 65536");
  FLEXEP_CHECK_ARG(c.n_shared_experts >= 0 && c.n_shared_experts <= 1024, "moe.n_shared_experts", "is ",
                   c.n_shared_experts, "; allowed: 0 to 1024");
  FLEXEP_CHECK_ARG(G >= 0, "moe.n_expert_groups", "is ", G, "; allowed: >= 0 (0 or 1 = no grouping)");
  if (c.group_limited()) {
    FLEXEP_CHECK_ARG(E % G == 0, "moe.n_expert_groups", "is ", G, ", which does not divide n_routed_experts (", E,
                     "); allowed: a divisor of n_routed_experts, or 0/1 for no grouping");
    FLEXEP_CHECK_ARG(c.n_limited_groups >= 1 && c.n_limited_groups <= G, "moe.n_limited_groups", "is ",
                     c.n_limited_groups, "; allowed: 1 <= value <= n_expert_groups (", G, ")");
    const int group_size = E / G;
    FLEXEP_CHECK_ARG(!c.top2_group_score() || group_size >= 2, "moe.n_expert_groups", "is ", G, ", leaving ",
                     group_size,
                     " expert per group, but the group score is the sum of the top-2 experts; allowed: "
                     "n_expert_groups <= n_routed_experts / 2 (",
                     E / 2, ")");
    FLEXEP_CHECK_ARG(k <= c.n_limited_groups * group_size, "moe.n_activated_experts", "is ", k,
                     " but only n_limited_groups * (n_routed_experts / n_expert_groups) = ", c.n_limited_groups, " * ",
                     group_size, " = ", c.n_limited_groups * group_size,
                     " experts are selectable; allowed: 1 <= value <= ", c.n_limited_groups * group_size);
  }
  FLEXEP_CHECK_ARG(std::isfinite(c.gate_bias_update_factor) && c.gate_bias_update_factor >= 0,
                   "moe.gate_bias_update_factor", "is ", c.gate_bias_update_factor, "; allowed: finite and >= 0");
  FLEXEP_CHECK_ARG(c.gate_bias_update_factor == 0 || c.train_gate, "moe.gate_bias_update_factor", "is ",
                   c.gate_bias_update_factor, " but train_gate is false; allowed: 0 unless train_gate is true");
  FLEXEP_CHECK_ARG(c.aux_loss_coeff >= 0 && c.aux_loss_coeff <= 1e4, "moe.aux_loss_coeff", "is ", c.aux_loss_coeff,
                   "; allowed: 0 to 10000");
  FLEXEP_CHECK_ARG(c.route_scale > 0 && c.route_scale <= 1e4, "moe.route_scale", "is ", c.route_scale,
                   "; allowed: above 0, up to 10000");
  FLEXEP_CHECK_ARG(c.dim >= 1 && c.dim <= (1 << 20), "moe.dim", "is ", c.dim, "; allowed: 1 to 1048576");
  FLEXEP_CHECK_ARG(c.inter_dim >= 0 && c.inter_dim <= (1 << 24), "moe.inter_dim", "is ", c.inter_dim,
                   "; allowed: 0 to 16777216");
  FLEXEP_CHECK_ARG(c.moe_inter_dim >= 1 && c.moe_inter_dim <= (1 << 24), "moe.moe_inter_dim", "is ", c.moe_inter_dim,
                   "; allowed: 1 to 16777216");
  const long long shared_width = static_cast<long long>(c.n_shared_experts) *
                                 (c.shared_expert_inter_dim > 0 ? c.shared_expert_inter_dim : c.moe_inter_dim);
  FLEXEP_CHECK_ARG(shared_width <= (1 << 24), "moe.n_shared_experts", c.n_shared_experts,
                   " shared experts of width ", shared_width / std::max(c.n_shared_experts, 1), " make a shared MLP ",
                   shared_width, " wide; allowed: <= 16777216");
  // An infinite limit is a legitimate "no clamp"; NaN is not. swigluoai clamps only when limit > 0
  // (Automodel's swiglu_oai), so there any number is valid.
  if (c.expert_activation == Activation::swigluoai)
    FLEXEP_CHECK_ARG(!std::isnan(c.activation_limit), "moe.activation_limit", "is ", c.activation_limit,
                     "; allowed: any number for 'swigluoai' (<= 0 = no clamp)");
  else
    FLEXEP_CHECK_ARG(c.activation_limit > 0, "moe.activation_limit", "is ", c.activation_limit, "; allowed: > 0");
  FLEXEP_CHECK_ARG(c.swiglu_limit >= 0, "moe.swiglu_limit", "is ", c.swiglu_limit,
                   "; allowed: >= 0 (0 = no clamp; infinity allowed)");
  FLEXEP_CHECK_ARG(std::isfinite(c.activation_alpha), "moe.activation_alpha", "is ", c.activation_alpha,
                   "; allowed: any finite value");
  FLEXEP_CHECK_ARG(c.shared_expert_activation == Activation::swiglu || c.shared_expert_activation == Activation::relu2,
                   "moe.shared_expert_activation", "is '", to_string(c.shared_expert_activation),
                   "'; allowed: 'swiglu', 'relu2' (Automodel's shared-expert MLP has no other activation)");
  FLEXEP_CHECK_ARG(c.shared_expert_inter_dim >= 0, "moe.shared_expert_inter_dim", "is ", c.shared_expert_inter_dim,
                   "; allowed: >= 0 (0 = use moe_inter_dim)");
  FLEXEP_CHECK_ARG(is_floating(c.dtype), "moe.dtype", "is ", dtype_name(c.dtype), "; allowed: bf16, f16, f32, f64");
  if (c.gate_dtype)
    FLEXEP_CHECK_ARG(is_floating(*c.gate_dtype), "moe.gate_dtype", "is ", dtype_name(*c.gate_dtype),
                     "; allowed: bf16, f16, f32, f64 or unset (= dtype)");
  FLEXEP_CHECK_ARG(c.moe_latent_size >= 0 && c.moe_latent_size <= (1 << 20), "moe.moe_latent_size", "is ",
                   c.moe_latent_size, "; allowed: 1 to 1048576, or 0 (null in JSON, None in Python) for none");
}

void validate_ep(const MoEConfig& c, int ep_size) {
  FLEXEP_CHECK_ARG(ep_size >= 1, "ep_size", "is ", ep_size, "; allowed: >= 1");
  FLEXEP_CHECK_ARG(c.n_routed_experts % ep_size == 0, "moe.n_routed_experts", "n_routed_experts (", c.n_routed_experts,
                   ") must be divisible by ep_size (", ep_size, "); allowed: a multiple of ", ep_size);
}

Normalization normalize(BackendConfig& c, int ep_size) {
  FLEXEP_CHECK_ARG(ep_size >= 1, "ep_size", "is ", ep_size, "; allowed: >= 1");
  Normalization n;
  if ((c.experts == ExpertsKind::te || c.experts == ExpertsKind::gmm) && !is_ep_dispatcher(c.dispatcher)) {
    n.messages.push_back(detail::concat("experts='", to_string(c.experts),
                                        "' needs an EP dispatcher (deepep or hybridep); using experts='torch_mm' "
                                        "with dispatcher='",
                                        to_string(c.dispatcher), "'"));
    c.experts = ExpertsKind::torch_mm;
  }
  if (is_ep_dispatcher(c.dispatcher) && ep_size == 1) {
    n.local_fallback = true;
    n.messages.push_back(detail::concat("'", to_string(c.dispatcher),
                                        "' dispatcher is enabled in config, but the expert-parallel size is 1; "
                                        "falling back to the local path"));
  }
  if (c.rows_in_place && ep_size > 1 && c.dispatcher != DispatcherKind::deepep) {
    n.messages.push_back(detail::concat("rows_in_place reads the rows in place on one GPU or with the deepep "
                                        "dispatcher; with dispatcher='",
                                        to_string(c.dispatcher), "' and an expert-parallel size of ", ep_size,
                                        " the experts take the dispatcher's rows"));
    c.rows_in_place = false;
  }
  return n;
}

}  // namespace flexep
