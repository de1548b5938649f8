// Finite-difference gradient checks of the whole MoE layer (gate -> dispatch -> experts -> combine
// (+ shared experts)), in fp64, on 1 and 2 simulated ranks. The objective is
//   J = sum over ranks of ( sum(out_r * G_r) + coeff * aux_loss_scale * aux_r )
// for fixed random G_r. Checked: grad x on every rank and every parameter (a deterministic sample of
// entries per tensor). Replicated parameters (gate, shared experts) are perturbed on every rank at
// once and their analytic gradient is the sum of the ranks' gradients (the data-parallel all-reduce,
// done here); expert parameters live on one rank and are perturbed there only.
//
// Selection is discrete: a central difference is only meaningful if no perturbation changes which
// experts are selected. Every evaluation re-runs the gate alone and asserts the indices are those of
// the unperturbed input (a larger init_std keeps the logits well separated).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cpu/host_ranks.h"
#include "flexep/core/random.h"
#include "flexep/dispatch/host.h"
#include "flexep/layer/moe_layer.h"

using namespace flexep;
using namespace flexep::testing;

namespace {

constexpr double kEps = 1e-6;
constexpr int kSamplesPerTensor = 20;

Tensor randn(Shape shape, std::uint64_t seed, double std = 1.0) {
  Tensor t = Tensor::empty(shape, DType::f64);
  if (t.numel() > 0) fill_normal(t, seed, stream_id("test.moe_layer_grad.input"), 0.0, std);
  return t;
}

Tensor bool_tensor(const std::vector<bool>& v) {
  Tensor t = Tensor::empty({static_cast<std::int64_t>(v.size())}, DType::b8);
  for (std::size_t i = 0; i < v.size(); ++i) t.data<bool>()[i] = v[i];
  return t;
}

Tensor token_mask_of(const Tensor& padding) {
  if (!padding.defined()) return Tensor();
  Tensor m = Tensor::empty({padding.numel()}, DType::b8);
  for (std::int64_t i = 0; i < padding.numel(); ++i) m.data<bool>()[i] = !padding.data<bool>()[i];
  return m;
}

bool is_expert_param(const std::string& name) { return name.rfind("experts.", 0) == 0; }

// Biases and the correction bias start at zero, a special point; give them generic values. A
// global expert's values do not depend on the rank that holds it.
void set_generic_extras(MoELayer& L) {
  const MoEConfig& c = L.config();
  auto fill = [](const TensorView& t, const char* stream, std::uint64_t offset, double std) {
    fill_normal(t, 4243, stream_id(stream), 0.0, std, offset);
  };
  if (Gate* g = L.gate()) {
    if (g->bias().value.defined()) fill(g->bias().value, "grad.gate.bias", 0, 0.5);
    if (g->e_score_correction_bias().defined()) fill(g->e_score_correction_bias(), "grad.gate.cbias", 0, 0.1);
  }
  GroupedExperts& ex = L.experts();
  const auto first = static_cast<std::uint64_t>(ex.first_expert());
  if (ex.gate_up_proj_bias().value.defined())
    fill(ex.gate_up_proj_bias().value, "grad.experts.bgu", first * static_cast<std::uint64_t>(c.up_dim()), 0.5);
  if (ex.down_proj_bias().value.defined())
    fill(ex.down_proj_bias().value, "grad.experts.bd", first * static_cast<std::uint64_t>(c.dim), 0.5);
  if (SharedExperts* s = L.shared_experts())
    for (Parameter* p : s->parameters())
      if (p->name.size() > 5 && p->name.compare(p->name.size() - 5, 5, ".bias") == 0)
        fill(p->value, p->name.c_str(), 0, 0.5);
}

struct GradCase {
  std::string name;
  MoEConfig cfg;
  bool padding = false;
};

MoEConfig base_config() {
  MoEConfig c;
  c.n_routed_experts = 8;
  c.n_activated_experts = 2;
  c.dim = 8;
  c.moe_inter_dim = 6;
  return c;
}

std::vector<GradCase> grad_cases() {
  std::vector<GradCase> v;
  {
    MoEConfig c = base_config();
    c.n_shared_experts = 1;
    c.shared_expert_inter_dim = 4;
    c.shared_expert_gate = true;
    c.expert_bias = true;
    c.router_bias = true;
    c.route_scale = 1.3;
    v.push_back({"swiglu_shared_gate_bias", c});
  }
  {
    MoEConfig c = base_config();
    c.expert_activation = Activation::quick_geglu;
    c.expert_bias = true;
    c.n_activated_experts = 3;
    v.push_back({"quick_geglu", c});
  }
  {
    MoEConfig c = base_config();
    c.expert_activation = Activation::relu2;
    c.n_shared_experts = 1;
    c.shared_expert_activation = Activation::relu2;
    c.expert_bias = true;
    v.push_back({"relu2", c});
  }
  {
    MoEConfig c = base_config();
    c.score_func = ScoreFunc::sigmoid;
    c.force_e_score_correction_bias = true;
    c.norm_topk_prob = true;
    c.n_activated_experts = 3;
    c.route_scale = 2.0;
    v.push_back({"sigmoid_correction_bias_norm_topk", c});
  }
  {
    MoEConfig c = base_config();
    c.softmax_before_topk = true;
    c.router_bias = true;
    v.push_back({"softmax_before_topk", c});
  }
  {
    MoEConfig c = base_config();
    c.n_shared_experts = 1;
    c.shared_expert_gate = true;
    c.aux_loss_coeff = 0.2;  // the aux loss must ignore padding tokens, in value and gradient
    v.push_back({"padding_mask", c, /*padding=*/true});
  }
  {
    MoEConfig c = base_config();
    c.aux_loss_coeff = 0.3;
    c.router_bias = true;
    c.n_shared_experts = 1;
    v.push_back({"aux_loss_softmax", c});
  }
  {
    MoEConfig c = base_config();
    c.score_func = ScoreFunc::softmax_with_bias;
    c.n_expert_groups = 4;
    c.n_limited_groups = 2;
    c.n_activated_experts = 3;
    c.force_e_score_correction_bias = true;
    c.norm_topk_prob = true;
    c.aux_loss_coeff = 0.3;
    v.push_back({"aux_loss_softmax_with_bias_groups", c});
  }
  {
    MoEConfig c = base_config();
    c.score_func = ScoreFunc::sigmoid;
    c.norm_topk_prob = true;
    c.aux_loss_coeff = 0.3;
    v.push_back({"aux_loss_sigmoid_norm_topk", c});
  }
  {
    MoEConfig c = base_config();
    c.score_func = ScoreFunc::sqrtsoftplus;
    c.force_e_score_correction_bias = true;
    c.norm_topk_prob = true;
    c.aux_loss_coeff = 0.2;
    c.expert_activation = Activation::swigluoai;
    c.activation_limit = 1.5;
    c.apply_router_weight_after_down = true;
    c.expert_bias = true;
    v.push_back({"sqrtsoftplus_swigluoai_after_down", c});
  }
  {
    MoEConfig c = base_config();
    c.score_func = ScoreFunc::sigmoid_with_bias;
    c.n_expert_groups = 4;
    c.n_limited_groups = 2;
    c.n_activated_experts = 3;
    c.force_e_score_correction_bias = true;
    c.expert_activation = Activation::geglu;
    c.n_shared_experts = 1;
    c.swiglu_limit = 0.4;  // the shared swiglu expert is clamped
    v.push_back({"sigmoid_with_bias_groups_geglu_shared_limit", c});
  }
  {
    // Automodel's latent projections around the routed experts (biases on), a gated shared expert
    // reading x, and the router reading x: every path of grad x meets in one sum.
    MoEConfig c = base_config();
    c.moe_latent_size = 5;
    c.expert_bias = true;
    c.n_shared_experts = 1;
    c.shared_expert_gate = true;
    c.score_func = ScoreFunc::sigmoid;
    c.force_e_score_correction_bias = true;
    c.aux_loss_coeff = 0.2;
    v.push_back({"latent_projections_bias_shared", c});
  }
  {
    MoEConfig c = base_config();
    c.moe_latent_size = 11;  // wider than dim
    c.expert_activation = Activation::relu2;
    c.apply_router_weight_after_down = true;
    v.push_back({"latent_projections_wide_relu2_after_down", c, /*padding=*/true});
  }
  {
    MoEConfig c = base_config();
    c.score_func = ScoreFunc::sigmoid;
    c.force_e_score_correction_bias = true;
    c.router_weight_uses_score_correction_bias = true;
    c.norm_topk_prob = true;
    c.aux_loss_coeff = 0.2;
    c.swiglu_limit = 0.5;
    v.push_back({"sigmoid_biased_weights_swiglu_limit", c});
  }
  return v;
}

// The layer on R ranks with fixed inputs, cotangents and padding.
struct Harness {
  MoEConfig cfg;
  std::shared_ptr<HostWorld> world;
  std::vector<std::unique_ptr<MoELayer>> layers;
  std::vector<Tensor> xs, pads, masks, Gs, base_indices;
  double aux_scale = 1.7;  // MoEAuxLossAutoScaler's scale, != 1 so that it is visibly applied

  Harness(int R, const GradCase& gc) : cfg(gc.cfg), world(std::make_shared<HostWorld>(R, 30.0)) {
    MoELayerOptions o;
    o.param_dtype = DType::f64;
    o.init_std = 0.5;  // logits well apart: no near-ties that an eps could flip
    o.seed = 2024;
    const std::vector<std::int64_t> T = R == 1 ? std::vector<std::int64_t>{7} : std::vector<std::int64_t>{6, 5};
    for (int r = 0; r < R; ++r) {
      std::shared_ptr<TokenDispatcher> d = make_host_dispatcher(world, r, cfg.n_routed_experts);
      layers.push_back(std::make_unique<MoELayer>(cfg, BackendConfig{}, d, o));
      set_generic_extras(*layers.back());
      layers.back()->gate()->aux_loss_scale = aux_scale;
      const std::int64_t t = T[static_cast<std::size_t>(r)];
      xs.push_back(randn({t, cfg.dim}, 500 + static_cast<std::uint64_t>(r)));
      Gs.push_back(randn({t, cfg.dim}, 600 + static_cast<std::uint64_t>(r)));
      if (gc.padding) {
        std::vector<bool> p(static_cast<std::size_t>(t), false);
        p[1] = true;
        p[static_cast<std::size_t>(t) - 1] = true;
        pads.push_back(bool_tensor(p));
      } else {
        pads.push_back(Tensor());
      }
      masks.push_back(token_mask_of(pads.back()));
    }
    base_indices = indices();
  }
  int R() const { return static_cast<int>(layers.size()); }
  MoELayer& operator[](int r) { return *layers[static_cast<std::size_t>(r)]; }

  std::vector<MoEOutput> forward() {
    std::vector<MoEOutput> outs(layers.size());
    auto errors = run_ranks(R(), [&](int r) {
      const auto i = static_cast<std::size_t>(r);
      outs[i] = layers[i]->forward(xs[i], pads[i], /*training=*/true);
    });
    EXPECT_TRUE(all_ok(errors));
    return outs;
  }

  double objective() {
    double J = 0;
    const auto outs = forward();
    for (std::size_t r = 0; r < outs.size(); ++r) {
      const Tensor& y = outs[r].out;
      for (std::int64_t i = 0; i < y.numel(); ++i) J += y.data<double>()[i] * Gs[r].data<double>()[i];
      EXPECT_EQ(outs[r].aux_loss.has_value(), cfg.aux_loss_coeff > 0);
      if (outs[r].aux_loss) J += cfg.aux_loss_coeff * aux_scale * *outs[r].aux_loss;
    }
    return J;
  }

  // The gate's selection on every rank for the current x and parameters (gate only, no collective).
  std::vector<Tensor> indices() {
    std::vector<Tensor> idx;
    for (std::size_t r = 0; r < layers.size(); ++r)
      idx.push_back(layers[r]->gate()->forward(xs[r], masks[r], /*training=*/false).indices);
    return idx;
  }
  bool routing_unchanged() {
    const auto now = indices();
    for (std::size_t r = 0; r < now.size(); ++r)
      for (std::int64_t i = 0; i < now[r].numel(); ++i)
        if (now[r].data<std::int64_t>()[i] != base_indices[r].data<std::int64_t>()[i]) return false;
    return true;
  }

  // Central difference of J along the entries `targets` (all set to the same offset together).
  double central_difference(const std::vector<double*>& targets) {
    std::vector<double> orig;
    for (double* t : targets) orig.push_back(*t);
    auto at = [&](double delta) {
      for (std::size_t i = 0; i < targets.size(); ++i) *targets[i] = orig[i] + delta;
      EXPECT_TRUE(routing_unchanged()) << "a perturbation of " << delta << " changed the selected experts";
      return objective();
    };
    const double plus = at(kEps), minus = at(-kEps);
    for (std::size_t i = 0; i < targets.size(); ++i) *targets[i] = orig[i];
    return (plus - minus) / (2 * kEps);
  }
};

// Up to n distinct positions in [0, numel), reproducible from (key, rank).
std::vector<std::int64_t> sample(std::int64_t numel, int n, std::string key, int rank = 0) {
  key += '#';
  key += std::to_string(rank);
  std::vector<std::int64_t> all(static_cast<std::size_t>(numel));
  std::iota(all.begin(), all.end(), 0);
  if (numel <= n) return all;
  std::mt19937 rng(static_cast<unsigned>(std::hash<std::string>{}(key) & 0xffffffffu));
  for (int i = 0; i < n; ++i) {  // partial Fisher-Yates with an explicit modulus (portable)
    const auto j = static_cast<std::size_t>(i + static_cast<std::int64_t>(rng() % static_cast<unsigned>(numel - i)));
    std::swap(all[static_cast<std::size_t>(i)], all[j]);
  }
  all.resize(static_cast<std::size_t>(n));
  return all;
}

bool close(double analytic, double fd) { return std::abs(analytic - fd) <= 1e-7 + 1e-6 * std::abs(analytic); }

void check_case(const GradCase& gc, int R) {
  Harness h(R, gc);
  // Analytic gradients: one forward and backward on every rank.
  const auto outs = h.forward();
  std::vector<Tensor> gx(static_cast<std::size_t>(R));
  auto errors = run_ranks(R, [&](int r) {
    const auto i = static_cast<std::size_t>(r);
    gx[i] = h[r].backward(outs[i], h.Gs[i]);
  });
  ASSERT_TRUE(all_ok(errors));
  std::vector<std::map<std::string, Tensor>> grads(static_cast<std::size_t>(R));
  for (int r = 0; r < R; ++r)
    for (Parameter* p : h[r].parameters()) {
      ASSERT_TRUE(p->grad.defined()) << p->name << " has no gradient on rank " << r;
      grads[static_cast<std::size_t>(r)][p->name] = p->grad.clone();
    }
  ASSERT_TRUE(h.routing_unchanged());

  // grad x, every rank.
  for (int r = 0; r < R; ++r) {
    const auto i = static_cast<std::size_t>(r);
    double largest = 0;
    for (std::int64_t e : sample(h.xs[i].numel(), kSamplesPerTensor, "x", r)) {
      const double fd = h.central_difference({h.xs[i].data<double>() + e});
      const double an = gx[i].data<double>()[e];
      EXPECT_TRUE(close(an, fd)) << "grad x rank " << r << " [" << e << "]: analytic " << an << ", fd " << fd;
      largest = std::max(largest, std::abs(an));
    }
    EXPECT_GT(largest, 1e-3) << "grad x on rank " << r << " is (near) zero: a vacuous check";
  }

  // Every parameter. The list comes from rank 0; expert tensors are checked on each rank.
  std::vector<std::string> names;
  for (Parameter* p : h[0].parameters()) names.push_back(p->name);
  for (const std::string& name : names) {
    auto param_on = [&](int r) -> Parameter* {
      for (Parameter* p : h[r].parameters())
        if (p->name == name) return p;
      return nullptr;
    };
    double largest = 0;
    if (!is_expert_param(name)) {
      const std::int64_t numel = param_on(0)->value.numel();
      for (std::int64_t e : sample(numel, kSamplesPerTensor, name)) {
        std::vector<double*> targets;
        double an = 0;
        for (int r = 0; r < R; ++r) {
          Parameter* p = param_on(r);
          ASSERT_NE(p, nullptr) << name << " missing on rank " << r;
          targets.push_back(p->value.data<double>() + e);
          an += grads[static_cast<std::size_t>(r)][name].data<double>()[e];  // the all-reduce
        }
        const double fd = h.central_difference(targets);
        EXPECT_TRUE(close(an, fd)) << name << " [" << e << "]: analytic (sum over ranks) " << an << ", fd " << fd;
        largest = std::max(largest, std::abs(an));
      }
    } else {
      for (int r = 0; r < R; ++r) {
        Parameter* p = param_on(r);
        ASSERT_NE(p, nullptr) << name << " missing on rank " << r;
        const int n = (kSamplesPerTensor + R - 1) / R;
        for (std::int64_t e : sample(p->value.numel(), n, name, r)) {
          const double fd = h.central_difference({p->value.data<double>() + e});
          const double an = grads[static_cast<std::size_t>(r)][name].data<double>()[e];
          EXPECT_TRUE(close(an, fd)) << name << " rank " << r << " [" << e << "]: analytic " << an << ", fd " << fd;
          largest = std::max(largest, std::abs(an));
        }
      }
    }
    EXPECT_GT(largest, 1e-4) << name << ": every sampled gradient is (near) zero, a vacuous check";
  }
}

}  // namespace

TEST(MoELayerGrad, FiniteDifferencesOneRank) {
  for (const GradCase& gc : grad_cases()) {
    SCOPED_TRACE(gc.name);
    check_case(gc, 1);
  }
}

TEST(MoELayerGrad, FiniteDifferencesTwoRanks) {
  for (const GradCase& gc : grad_cases()) {
    SCOPED_TRACE(gc.name);
    check_case(gc, 2);
  }
}

// Padding tokens: their grad x comes from the shared expert alone (the routed path and the gate,
// aux loss included, never see them). Checked against the shared expert's own backward.
TEST(MoELayerGrad, PaddingTokensGetOnlyTheSharedExpertGradient) {
  const auto cases = grad_cases();
  const auto it = std::find_if(cases.begin(), cases.end(), [](const GradCase& c) { return c.padding; });
  ASSERT_NE(it, cases.end());
  const GradCase& gc = *it;
  Harness h(2, gc);
  const auto outs = h.forward();
  std::vector<Tensor> gx(2);
  ASSERT_TRUE(all_ok(run_ranks(2, [&](int r) {
    const auto i = static_cast<std::size_t>(r);
    gx[i] = h[r].backward(outs[i], h.Gs[i]);
  })));
  for (int r = 0; r < 2; ++r) {
    const auto i = static_cast<std::size_t>(r);
    SharedExperts* s = h[r].shared_experts();
    ASSERT_NE(s, nullptr);
    const Tensor want = s->backward(s->forward(h.xs[i]), h.Gs[i]);
    const std::int64_t D = gc.cfg.dim;
    for (std::int64_t t = 0; t < h.xs[i].size(0); ++t) {
      if (!h.pads[i].data<bool>()[t]) continue;
      for (std::int64_t d = 0; d < D; ++d)
        EXPECT_NEAR(gx[i].data<double>()[t * D + d], want.data<double>()[t * D + d], 1e-13)
            << "rank " << r << " padding token " << t;
    }
  }
}
