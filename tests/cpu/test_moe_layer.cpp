// The whole MoE layer (layer/moe_layer.h) on R simulated ranks against independent single-process
// references: (a) the pieces without any dispatch -- Gate -> GroupedExperts::forward_loop over all E
// experts -> + SharedExperts -- and (b) for one configuration, the formulas written out with plain
// loops here. Also: padding, parameter names, the EP-size-1 fallback, the aux loss (value, gradient,
// stability under SGD), the fake balanced gate, zero_grad and argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
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

// ---------------------------------------------------------------------------------------------
// Configurations and inputs

MoEConfig small_config(Activation act = Activation::swiglu, ScoreFunc sf = ScoreFunc::softmax) {
  MoEConfig c;
  c.n_routed_experts = 8;
  c.n_activated_experts = 2;
  c.dim = 8;
  c.inter_dim = 16;
  c.moe_inter_dim = 6;
  c.expert_activation = act;
  c.score_func = sf;
  return c;
}

MoELayerOptions f64_options(double init_std = 0.3, std::uint64_t seed = 77) {
  MoELayerOptions o;
  o.param_dtype = DType::f64;
  o.init_std = init_std;
  o.seed = seed;
  return o;
}

Tensor randn(Shape shape, std::uint64_t seed, double std = 1.0, DType dtype = DType::f64) {
  Tensor t = Tensor::empty(shape, dtype);
  if (t.numel() > 0) fill_normal(t, seed, stream_id("test.moe_layer.input"), 0.0, std);
  return t;
}

// Per-rank token counts, ragged, with T = 0 on one rank whenever R > 1.
std::vector<std::int64_t> tokens_for(int R) {
  if (R == 1) return {9};
  if (R == 2) return {7, 0};
  return {5, 12, 0, 9};
}

std::vector<Tensor> inputs_for(int R, int dim, std::uint64_t seed) {
  std::vector<Tensor> xs;
  const auto T = tokens_for(R);
  for (int r = 0; r < R; ++r) xs.push_back(randn({T[static_cast<std::size_t>(r)], dim}, seed * 101 + r));
  return xs;
}

Tensor bool_tensor(const std::vector<bool>& v) {
  Tensor t = Tensor::empty({static_cast<std::int64_t>(v.size())}, DType::b8);
  for (std::size_t i = 0; i < v.size(); ++i) t.data<bool>()[i] = v[i];
  return t;
}

// ~padding_mask, or undefined when there is no mask (what the pieces take as token_mask).
Tensor token_mask_of(const Tensor& padding) {
  if (!padding.defined()) return Tensor();
  Tensor m = Tensor::empty({padding.numel()}, DType::b8);
  for (std::int64_t i = 0; i < padding.numel(); ++i) m.data<bool>()[i] = !padding.data<bool>()[i];
  return m;
}

// Biases and the correction bias start at zero; give them generic values so that they matter. Global
// element i of tensor `name` gets the same value whichever rank holds it, and in the reference.
void fill_global(const TensorView& t, const char* name, std::uint64_t offset, double std) {
  fill_normal(t, 4242, stream_id(name), 0.0, std, offset);
}

void set_generic_extras(const MoEConfig& c, Gate* gate, GroupedExperts& experts, SharedExperts* shared) {
  if (gate) {
    if (gate->bias().value.defined()) fill_global(gate->bias().value, "test.gate.bias", 0, 0.5);
    // Scores are in (0, 1) (sigmoid) or ~1/E (softmax): 0.1 is large enough to change selections.
    if (gate->e_score_correction_bias().defined())
      fill_global(gate->e_score_correction_bias(), "test.gate.correction_bias", 0, 0.1);
  }
  const auto first = static_cast<std::uint64_t>(experts.first_expert());
  if (experts.gate_up_proj_bias().value.defined())
    fill_global(experts.gate_up_proj_bias().value, "test.experts.gate_up_proj_bias",
                first * static_cast<std::uint64_t>(c.up_dim()), 0.5);
  if (experts.down_proj_bias().value.defined())
    fill_global(experts.down_proj_bias().value, "test.experts.down_proj_bias",
                first * static_cast<std::uint64_t>(c.dim), 0.5);
  if (shared)
    for (Parameter* p : shared->parameters())
      if (p->name.size() > 5 && p->name.compare(p->name.size() - 5, 5, ".bias") == 0)
        fill_global(p->value, p->name.c_str(), 0, 0.5);
}

// ---------------------------------------------------------------------------------------------
// The layer on R ranks

struct LayerGroup {
  std::shared_ptr<HostWorld> world;
  std::vector<std::unique_ptr<MoELayer>> layers;

  LayerGroup(int R, const MoEConfig& c, const BackendConfig& b, const MoELayerOptions& o, bool extras = true)
      : world(std::make_shared<HostWorld>(R, 30.0)) {
    for (int r = 0; r < R; ++r) {
      std::shared_ptr<TokenDispatcher> d = make_host_dispatcher(world, r, c.n_routed_experts);
      layers.push_back(std::make_unique<MoELayer>(c, b, d, o));
      MoELayer& L = *layers.back();
      if (extras) set_generic_extras(c, L.gate(), L.experts(), L.shared_experts());
    }
  }
  int size() const { return static_cast<int>(layers.size()); }
  MoELayer& operator[](int r) { return *layers[static_cast<std::size_t>(r)]; }

  std::vector<MoEOutput> forward(const std::vector<Tensor>& xs, const std::vector<Tensor>& pads, bool training) {
    std::vector<MoEOutput> out(layers.size());
    auto errors = run_ranks(size(), [&](int r) {
      const auto i = static_cast<std::size_t>(r);
      out[i] = layers[i]->forward(xs[i], pads.empty() ? Tensor() : pads[i], training);
    });
    EXPECT_TRUE(all_ok(errors));
    return out;
  }
  std::vector<Tensor> backward(const std::vector<MoEOutput>& outs, const std::vector<Tensor>& grads) {
    std::vector<Tensor> gx(layers.size());
    auto errors = run_ranks(size(), [&](int r) {
      const auto i = static_cast<std::size_t>(r);
      gx[i] = layers[i]->backward(outs[i], grads[i]);
    });
    EXPECT_TRUE(all_ok(errors));
    return gx;
  }
};

// The single-process reference from the pieces: all E experts in one GroupedExperts, no dispatch.
struct PiecesReference {
  MoEConfig c;
  std::unique_ptr<Gate> gate;
  std::unique_ptr<FakeBalancedGate> fake;
  GroupedExperts experts;
  std::unique_ptr<SharedExperts> shared;

  PiecesReference(const MoEConfig& cfg, const BackendConfig& b, const MoELayerOptions& o, bool extras = true)
      : c(cfg), experts(cfg, cfg.n_routed_experts, 0, o.param_dtype) {
    if (b.fake_balanced_gate) {
      fake = std::make_unique<FakeBalancedGate>(cfg, b.fake_gate_noise);
    } else {
      gate = std::make_unique<Gate>(cfg, b.gate_precision, o.param_dtype);
      gate->init(o.seed, o.init_std);
    }
    experts.init(o.seed, o.init_std);
    if (cfg.n_shared_experts > 0) {
      shared = std::make_unique<SharedExperts>(cfg, o.param_dtype);
      shared->init(o.seed, o.init_std);
    }
    if (extras) set_generic_extras(cfg, gate.get(), experts, shared.get());
  }

  struct Out {
    Tensor out;
    std::optional<double> aux;
    Tensor indices;
  };
  Out forward(const Tensor& x, const Tensor& padding, bool training) {
    const Tensor mask = token_mask_of(padding);
    GateOutput g = gate ? gate->forward(x, mask, training) : fake->forward(x, mask);
    Tensor y = experts.forward_loop(x, mask, g.weights, g.indices);
    if (shared) {
      Tensor z = shared->forward(x).out;
      for (std::int64_t i = 0; i < y.numel(); ++i) write_from_double(y, i, read_as_double(y, i) + read_as_double(z, i));
    }
    return {y, g.aux_loss, g.indices};
  }
};

// max |got - want| <= rel * max |want| (elementwise against the tensor's scale, so values near zero
// do not need an absolute tolerance of their own).
::testing::AssertionResult close_rel(const Tensor& got, const Tensor& want, double rel) {
  if (got.shape() != want.shape())
    return ::testing::AssertionFailure() << "shape " << got.shape().str() << " vs " << want.shape().str();
  double scale = 0, worst = 0;
  std::int64_t at = -1;
  for (std::int64_t i = 0; i < want.numel(); ++i) scale = std::max(scale, std::abs(read_as_double(want, i)));
  for (std::int64_t i = 0; i < want.numel(); ++i) {
    const double d = std::abs(read_as_double(got, i) - read_as_double(want, i));
    if (!(d <= worst)) {
      worst = d;
      at = i;
    }
  }
  if (worst <= rel * scale) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "max diff " << worst << " at " << at << " (got " << read_as_double(got, at)
                                       << ", want " << read_as_double(want, at) << "), allowed " << rel * scale;
}

::testing::AssertionResult same_values(const TensorView& a, const TensorView& b) {
  if (a.shape != b.shape) return ::testing::AssertionFailure() << a.shape.str() << " vs " << b.shape.str();
  for (std::int64_t i = 0; i < a.numel(); ++i)
    if (read_as_double(a, i) != read_as_double(b, i))
      return ::testing::AssertionFailure() << "element " << i << ": " << read_as_double(a, i) << " vs "
                                           << read_as_double(b, i);
  return ::testing::AssertionSuccess();
}

Parameter* find_param(MoELayer& L, const std::string& name) {
  for (Parameter* p : L.parameters())
    if (p->name == name) return p;
  return nullptr;
}

template <class E>
std::optional<E> catch_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e;
  }
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// Forward on R ranks == the pieces reference

struct Variant {
  std::string name;
  MoEConfig cfg;
};

std::vector<Variant> forward_variants() {
  std::vector<Variant> v;
  v.push_back({"swiglu_softmax", small_config()});
  {
    MoEConfig c = small_config();
    c.n_shared_experts = 2;
    c.shared_expert_inter_dim = 3;
    c.shared_expert_gate = true;
    c.expert_bias = true;
    c.router_bias = true;
    c.route_scale = 1.7;
    v.push_back({"swiglu_shared_gate_biases", c});
  }
  {
    MoEConfig c = small_config(Activation::quick_geglu);
    c.softmax_before_topk = true;
    c.expert_bias = true;
    c.n_activated_experts = 3;
    v.push_back({"quick_geglu_softmax_before_topk", c});
  }
  {
    MoEConfig c = small_config(Activation::relu2);
    c.n_shared_experts = 1;
    c.shared_expert_activation = Activation::relu2;
    c.expert_bias = true;
    v.push_back({"relu2_shared_relu2", c});
  }
  {
    MoEConfig c = small_config(Activation::swiglu, ScoreFunc::softmax_with_bias);
    c.n_expert_groups = 4;
    c.n_limited_groups = 2;
    c.n_activated_experts = 3;
    c.force_e_score_correction_bias = true;
    c.norm_topk_prob = true;
    v.push_back({"softmax_with_bias_groups", c});
  }
  {
    MoEConfig c = small_config(Activation::swiglu, ScoreFunc::sigmoid);
    c.gate_bias_update_factor = 0.01;
    c.norm_topk_prob = true;
    c.route_scale = 2.5;
    c.n_activated_experts = 3;
    c.aux_loss_coeff = 0.01;
    c.n_shared_experts = 1;
    v.push_back({"sigmoid_correction_bias_aux", c});
  }
  {
    MoEConfig c = small_config(Activation::quick_geglu, ScoreFunc::sigmoid);
    c.n_expert_groups = 2;
    c.n_limited_groups = 1;
    v.push_back({"sigmoid_groups_no_bias", c});
  }
  {
    MoEConfig c = small_config();
    c.aux_loss_coeff = 0.1;
    c.router_bias = true;
    v.push_back({"softmax_aux", c});
  }
  {
    MoEConfig c = small_config(Activation::swigluoai, ScoreFunc::sqrtsoftplus);
    c.force_e_score_correction_bias = true;
    c.apply_router_weight_after_down = true;
    c.expert_bias = true;
    c.norm_topk_prob = true;
    v.push_back({"swigluoai_sqrtsoftplus_after_down", c});
  }
  {
    MoEConfig c = small_config(Activation::geglu, ScoreFunc::sigmoid_with_bias);
    c.n_expert_groups = 4;
    c.n_limited_groups = 2;
    c.force_e_score_correction_bias = true;
    c.n_shared_experts = 1;
    c.swiglu_limit = 0.3;
    c.router_weights_fp32 = true;
    v.push_back({"geglu_sigmoid_with_bias_shared_swiglu_limit", c});
  }
  return v;
}

}  // namespace

TEST(MoELayer, ForwardOnRanksMatchesSingleProcessPieces) {
  for (const Variant& v : forward_variants())
    for (int R : {1, 2, 4}) {
      SCOPED_TRACE(v.name + " R=" + std::to_string(R));
      const BackendConfig b;
      const MoELayerOptions o = f64_options();
      LayerGroup g(R, v.cfg, b, o);
      PiecesReference ref(v.cfg, b, o);
      const auto xs = inputs_for(R, v.cfg.dim, 3);
      const auto outs = g.forward(xs, {}, /*training=*/true);
      ASSERT_EQ(outs.size(), static_cast<std::size_t>(R));
      bool any_routed = false;
      for (int r = 0; r < R; ++r) {
        SCOPED_TRACE("rank " + std::to_string(r));
        const auto i = static_cast<std::size_t>(r);
        const auto want = ref.forward(xs[i], Tensor(), true);
        EXPECT_TRUE(close_rel(outs[i].out, want.out, 1e-12));
        EXPECT_EQ(outs[i].out.dtype(), DType::f64);
        ASSERT_EQ(outs[i].aux_loss.has_value(), want.aux.has_value());
        ASSERT_EQ(outs[i].aux_loss.has_value(), v.cfg.aux_loss_coeff > 0);
        if (want.aux) {
          EXPECT_NEAR(*outs[i].aux_loss, *want.aux, 1e-12 * std::max(1.0, std::abs(*want.aux)));
        }
        for (std::int64_t j = 0; j < want.out.numel(); ++j) any_routed |= read_as_double(want.out, j) != 0;
      }
      EXPECT_TRUE(any_routed) << "the reference output is all zero: the comparison would be vacuous";
    }
}

// The correction bias must take part in the layer's selection (the gate's buffer is what the layer
// uses): a large bias on one expert makes every token pick it.
TEST(MoELayer, CorrectionBiasSteersSelectionInsideTheLayer) {
  MoEConfig c = small_config(Activation::swiglu, ScoreFunc::sigmoid);
  c.force_e_score_correction_bias = true;
  const BackendConfig b;
  const MoELayerOptions o = f64_options();
  LayerGroup g(2, c, b, o, /*extras=*/false);
  PiecesReference ref(c, b, o, /*extras=*/false);
  for (int r = 0; r < 2; ++r) g[r].gate()->e_score_correction_bias().data<float>()[5] = 10.f;
  ref.gate->e_score_correction_bias().data<float>()[5] = 10.f;
  const std::vector<Tensor> xs = {randn({6, c.dim}, 1), randn({4, c.dim}, 2)};
  const auto outs = g.forward(xs, {}, false);
  for (int r = 0; r < 2; ++r) {
    const auto want = ref.forward(xs[static_cast<std::size_t>(r)], Tensor(), false);
    for (std::int64_t t = 0; t < want.indices.size(0); ++t) EXPECT_EQ(want.indices.data<std::int64_t>()[t * 2], 5);
    EXPECT_TRUE(close_rel(outs[static_cast<std::size_t>(r)].out, want.out, 1e-12));
  }
}

// The formulas written out with plain loops for one configuration (softmax top-k of the logits,
// route_scale, swiglu experts with biases and the prob inside the FFN, a sigmoid-gated shared
// expert), reading the parameters through the layer's own parameters() by their Automodel names.
TEST(MoELayer, ForwardMatchesFormulasWrittenOut) {
  MoEConfig c;
  c.n_routed_experts = 4;
  c.n_activated_experts = 2;
  c.dim = 8;
  c.moe_inter_dim = 5;
  c.router_bias = true;
  c.expert_bias = true;
  c.n_shared_experts = 1;
  c.shared_expert_gate = true;
  c.route_scale = 1.7;
  const MoELayerOptions o = f64_options(0.4);
  LayerGroup g(1, c, BackendConfig{}, o);
  MoELayer& L = g[0];
  const std::int64_t T = 7, D = c.dim, E = c.n_routed_experts, I = c.moe_inter_dim;
  const Tensor x = randn({T, D}, 9);
  const std::vector<bool> pad = {false, false, true, false, false, false, true};
  const auto out = g.forward({x}, {bool_tensor(pad)}, false)[0].out;

  auto P = [&](const char* name) {
    const Parameter* p = find_param(L, name);
    EXPECT_NE(p, nullptr) << name;
    return p ? p->value.data<double>() : nullptr;
  };
  const double *W = P("gate.weight"), *b = P("gate.bias"), *Wgu = P("experts.gate_and_up_projs"),
               *Wd = P("experts.down_projs"), *bgu = P("experts.gate_up_proj_bias"), *bd = P("experts.down_proj_bias"),
               *sg = P("shared_experts.gate_proj.weight"), *su = P("shared_experts.up_proj.weight"),
               *sd = P("shared_experts.down_proj.weight"), *sgb = P("shared_experts.gate_proj.bias"),
               *sub = P("shared_experts.up_proj.bias"), *sdb = P("shared_experts.down_proj.bias"),
               *sw = P("shared_expert_gate.weight");
  ASSERT_FALSE(HasFailure());
  auto silu = [](double v) { return v / (1.0 + std::exp(-v)); };
  const double* xv = x.data<double>();
  for (std::int64_t t = 0; t < T; ++t) {
    const double* xt = xv + t * D;
    std::vector<double> y(static_cast<std::size_t>(D), 0.0);
    if (!pad[static_cast<std::size_t>(t)]) {
      std::vector<double> z(static_cast<std::size_t>(E));
      for (std::int64_t e = 0; e < E; ++e) {
        z[e] = b[e];
        for (std::int64_t d = 0; d < D; ++d) z[e] += W[e * D + d] * xt[d];
      }
      std::vector<int> order(static_cast<std::size_t>(E));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int bb) { return z[a] > z[bb]; });
      const double zmax = z[order[0]];
      double denom = 0;
      for (int j = 0; j < c.n_activated_experts; ++j) denom += std::exp(z[order[j]] - zmax);
      for (int j = 0; j < c.n_activated_experts; ++j) {
        const int e = order[j];
        const double p = std::exp(z[e] - zmax) / denom * c.route_scale;
        std::vector<double> h(static_cast<std::size_t>(2 * I));
        for (std::int64_t col = 0; col < 2 * I; ++col) {
          h[col] = bgu[e * 2 * I + col];
          for (std::int64_t d = 0; d < D; ++d) h[col] += xt[d] * Wgu[(e * D + d) * 2 * I + col];
        }
        for (std::int64_t d = 0; d < D; ++d) {
          double acc = bd[e * D + d] * p;
          for (std::int64_t i = 0; i < I; ++i) acc += silu(h[i]) * h[I + i] * p * Wd[(e * I + i) * D + d];
          y[d] += acc;
        }
      }
    }
    std::vector<double> m(static_cast<std::size_t>(I));
    for (std::int64_t i = 0; i < I; ++i) {
      double gi = sgb[i], ui = sub[i];
      for (std::int64_t d = 0; d < D; ++d) {
        gi += sg[i * D + d] * xt[d];
        ui += su[i * D + d] * xt[d];
      }
      m[i] = silu(gi) * ui;
    }
    double s = 0;
    for (std::int64_t d = 0; d < D; ++d) s += sw[d] * xt[d];
    s = 1.0 / (1.0 + std::exp(-s));
    for (std::int64_t d = 0; d < D; ++d) {
      double acc = sdb[d];
      for (std::int64_t i = 0; i < I; ++i) acc += sd[d * I + i] * m[i];
      const double want = y[d] + s * acc;
      EXPECT_NEAR(out.data<double>()[t * D + d], want, 1e-12 * std::max(1.0, std::abs(want)))
          << "token " << t << " column " << d;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Padding

namespace {

MoEConfig padding_config(bool with_shared) {
  MoEConfig c = small_config(Activation::swiglu, ScoreFunc::sigmoid);
  c.gate_bias_update_factor = 0.01;  // gives the gate a cumulative load we can read
  c.aux_loss_coeff = 0.05;
  c.n_activated_experts = 3;
  c.n_shared_experts = with_shared ? 1 : 0;
  c.expert_bias = true;
  return c;
}

// Rows of x whose mask entry is false, stacked.
Tensor valid_rows(const Tensor& x, const std::vector<bool>& pad) {
  std::int64_t n = 0;
  for (bool p : pad) n += !p;
  Tensor out = Tensor::empty({n, x.size(1)}, x.dtype());
  std::int64_t row = 0;
  for (std::size_t t = 0; t < pad.size(); ++t)
    if (!pad[t]) {
      for (std::int64_t d = 0; d < x.size(1); ++d)
        out.data<double>()[row * x.size(1) + d] = x.data<double>()[static_cast<std::int64_t>(t) * x.size(1) + d];
      ++row;
    }
  return out;
}

}  // namespace

TEST(MoELayer, PaddingTokensAreNotRoutedAndDoNotCountInTheLoad) {
  for (bool with_shared : {true, false}) {
    SCOPED_TRACE(with_shared ? "with shared expert" : "without shared expert");
    const MoEConfig c = padding_config(with_shared);
    const BackendConfig b;
    const MoELayerOptions o = f64_options();
    // Rank 1 pads every token, rank 2 none.
    const std::vector<std::vector<bool>> pads = {{false, true, false, false, true, false, true, false},
                                                 {true, true, true},
                                                 {false, false, false, false, false},
                                                 {true, false, false, true, false, false}};
    const int R = 4;
    std::vector<Tensor> xs, pad_t;
    for (int r = 0; r < R; ++r) {
      xs.push_back(randn({static_cast<std::int64_t>(pads[static_cast<std::size_t>(r)].size()), c.dim}, 50 + r));
      pad_t.push_back(bool_tensor(pads[static_cast<std::size_t>(r)]));
    }
    LayerGroup g(R, c, b, o);
    const auto outs = g.forward(xs, pad_t, true);
    PiecesReference ref(c, b, o);

    // The same layer on the compacted input (padding rows removed, no mask).
    LayerGroup compact(R, c, b, o);
    std::vector<Tensor> xs_valid;
    for (int r = 0; r < R; ++r) xs_valid.push_back(valid_rows(xs[static_cast<std::size_t>(r)], pads[r]));
    const auto outs_valid = compact.forward(xs_valid, {}, true);

    for (int r = 0; r < R; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      const auto i = static_cast<std::size_t>(r);
      const auto want = ref.forward(xs[i], pad_t[i], true);
      EXPECT_TRUE(close_rel(outs[i].out, want.out, 1e-12));
      // Padding rows: only the shared expert (or nothing) contributes, exactly.
      Tensor shared_only = ref.shared ? ref.shared->forward(xs[i]).out : Tensor::zeros(xs[i].shape(), DType::f64);
      std::int64_t row = 0;
      for (std::size_t t = 0; t < pads[i].size(); ++t) {
        const auto tt = static_cast<std::int64_t>(t);
        for (std::int64_t d = 0; d < c.dim; ++d) {
          const double got = outs[i].out.data<double>()[tt * c.dim + d];
          if (pads[i][t]) {
            EXPECT_EQ(got, shared_only.data<double>()[tt * c.dim + d]) << "padding token " << t;
          } else {
            EXPECT_NEAR(got, outs_valid[i].out.data<double>()[row * c.dim + d], 1e-12) << "token " << t;
          }
        }
        row += !pads[i][t];
      }
      // The aux loss counts only valid tokens: the same as on the compacted input.
      ASSERT_TRUE(outs[i].aux_loss.has_value());
      ASSERT_TRUE(outs_valid[i].aux_loss.has_value());
      EXPECT_NEAR(*outs[i].aux_loss, *outs_valid[i].aux_loss, 1e-12);

      // The gate's load: counted here from the reference's selection over valid tokens only.
      std::vector<std::int64_t> load(static_cast<std::size_t>(c.n_routed_experts), 0);
      const std::int64_t k = c.n_activated_experts;
      std::int64_t valid = 0;
      for (std::size_t t = 0; t < pads[i].size(); ++t) {
        if (pads[i][t]) continue;
        ++valid;
        const std::int64_t* sel = want.indices.data<std::int64_t>() + static_cast<std::int64_t>(t) * k;
        for (std::int64_t j = 0; j < k; ++j) ++load[static_cast<std::size_t>(sel[j])];
      }
      EXPECT_EQ(g[r].gate()->cumulative_load(), load);
      EXPECT_EQ(std::accumulate(load.begin(), load.end(), std::int64_t{0}), valid * k);
      EXPECT_EQ(compact[r].gate()->cumulative_load(), load);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Parameters

TEST(MoELayer, ParameterNamesAndShapesAreAutomodels) {
  {
    SCOPED_TRACE("swiglu, every optional parameter, R = 2");
    MoEConfig c = small_config();
    c.router_bias = true;
    c.expert_bias = true;
    c.n_shared_experts = 2;
    c.shared_expert_inter_dim = 3;
    c.shared_expert_gate = true;
    LayerGroup g(2, c, BackendConfig{}, f64_options());
    const std::int64_t E = 8, El = 4, D = c.dim, I = c.moe_inter_dim, S = 6;
    const std::map<std::string, Shape> want = {
        {"gate.weight", {E, D}},
        {"gate.bias", {E}},
        {"experts.gate_and_up_projs", {El, D, 2 * I}},
        {"experts.down_projs", {El, I, D}},
        {"experts.gate_up_proj_bias", {El, 2 * I}},
        {"experts.down_proj_bias", {El, D}},
        {"shared_experts.gate_proj.weight", {S, D}},
        {"shared_experts.up_proj.weight", {S, D}},
        {"shared_experts.down_proj.weight", {D, S}},
        {"shared_experts.gate_proj.bias", {S}},
        {"shared_experts.up_proj.bias", {S}},
        {"shared_experts.down_proj.bias", {D}},
        {"shared_expert_gate.weight", {1, D}},
    };
    for (int r = 0; r < 2; ++r) {
      for (int pass = 0; pass < 2; ++pass) {  // names must not change (e.g. gain a second prefix) on a repeat
        std::map<std::string, Shape> got;
        for (Parameter* p : g[r].parameters()) {
          EXPECT_TRUE(got.emplace(p->name, p->value.shape()).second) << "duplicate " << p->name;
          EXPECT_EQ(p->value.dtype(), DType::f64) << p->name;
        }
        EXPECT_EQ(got, want);
      }
      EXPECT_EQ(find_param(g[r], "gate.weight"), &g[r].gate()->weight());
      EXPECT_EQ(find_param(g[r], "experts.down_projs"), &g[r].experts().down_projs());
      std::map<std::string, Shape> rep;
      for (Parameter* p : g[r].replicated_parameters()) rep.emplace(p->name, p->value.shape());
      std::map<std::string, Shape> want_rep;
      for (const auto& [name, shape] : want)
        if (name.rfind("experts.", 0) != 0) want_rep.emplace(name, shape);
      EXPECT_EQ(rep, want_rep);
    }
  }
  {
    SCOPED_TRACE("relu2, minimal, R = 4");
    MoEConfig c = small_config(Activation::relu2);
    c.n_shared_experts = 1;
    c.shared_expert_activation = Activation::relu2;
    LayerGroup g(4, c, BackendConfig{}, f64_options());
    const std::int64_t E = 8, El = 2, D = c.dim, I = c.moe_inter_dim;
    const std::map<std::string, Shape> want = {
        {"gate.weight", {E, D}},
        {"experts.gate_and_up_projs", {El, D, I}},
        {"experts.down_projs", {El, I, D}},
        {"shared_experts.up_proj.weight", {I, D}},
        {"shared_experts.down_proj.weight", {D, I}},
    };
    std::map<std::string, Shape> got, rep;
    for (Parameter* p : g[3].parameters()) got.emplace(p->name, p->value.shape());
    for (Parameter* p : g[3].replicated_parameters()) rep.emplace(p->name, p->value.shape());
    EXPECT_EQ(got, want);
    EXPECT_EQ(rep, (std::map<std::string, Shape>{{"gate.weight", {E, D}},
                                                 {"shared_experts.up_proj.weight", {I, D}},
                                                 {"shared_experts.down_proj.weight", {D, I}}}));
  }
  {
    SCOPED_TRACE("fake balanced gate: no gate parameters");
    BackendConfig b;
    b.fake_balanced_gate = true;
    LayerGroup g(1, small_config(), b, f64_options());
    EXPECT_EQ(g[0].gate(), nullptr);
    std::vector<std::string> names;
    for (Parameter* p : g[0].parameters()) names.push_back(p->name);
    EXPECT_EQ(names, (std::vector<std::string>{"experts.gate_and_up_projs", "experts.down_projs"}));
    EXPECT_TRUE(g[0].replicated_parameters().empty());
  }
}

// Expert tensors on rank r hold global experts [r*E_local, (r+1)*E_local): the slices of the
// single-process experts' tensors.
TEST(MoELayer, LocalExpertTensorsAreSlicesOfTheGlobalOnes) {
  MoEConfig c = small_config();
  c.expert_bias = true;
  const MoELayerOptions o = f64_options();
  LayerGroup g(4, c, BackendConfig{}, o);
  PiecesReference ref(c, BackendConfig{}, o);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(g[r].ep_rank(), r);
    EXPECT_EQ(g[r].ep_size(), 4);
    EXPECT_EQ(g[r].experts().first_expert(), 2 * r);
    auto check = [&](Parameter& local, Parameter& global) {
      const std::int64_t n = local.value.numel();
      for (std::int64_t i = 0; i < n; ++i)
        ASSERT_EQ(local.value.data<double>()[i], global.value.data<double>()[r * n + i]) << local.name << " " << i;
    };
    check(g[r].experts().gate_and_up_projs(), ref.experts.gate_and_up_projs());
    check(g[r].experts().down_projs(), ref.experts.down_projs());
    check(g[r].experts().gate_up_proj_bias(), ref.experts.gate_up_proj_bias());
    check(g[r].experts().down_proj_bias(), ref.experts.down_proj_bias());
    EXPECT_TRUE(same_values(g[r].gate()->weight().value, ref.gate->weight().value));
  }
}

// ---------------------------------------------------------------------------------------------
// EP size 1 with an EP dispatcher: Automodel falls back to the local path.

TEST(MoELayer, EpSizeOneWithHybridepDispatcherFallsBackToLocalPath) {
  MoEConfig c = small_config();
  c.n_shared_experts = 1;
  c.expert_bias = true;
  const MoELayerOptions o = f64_options();
  for (DispatcherKind kind : {DispatcherKind::hybridep, DispatcherKind::deepep}) {
    SCOPED_TRACE(std::string(to_string(kind)));
    BackendConfig ep;
    ep.dispatcher = kind;
    ep.experts = ExpertsKind::gmm;
    MoELayer fallback(c, ep, nullptr, o);
    MoELayer host(c, BackendConfig{}, nullptr, o);
    EXPECT_EQ(fallback.ep_size(), 1);
    EXPECT_EQ(fallback.ep_rank(), 0);
    EXPECT_EQ(fallback.experts().num_local_experts(), c.n_routed_experts);
    for (MoELayer* L : {&fallback, &host}) set_generic_extras(c, L->gate(), L->experts(), L->shared_experts());
    const Tensor x = randn({11, c.dim}, 21), G = randn({11, c.dim}, 22);
    const MoEOutput a = fallback.forward(x, Tensor(), true), h = host.forward(x, Tensor(), true);
    EXPECT_TRUE(same_values(a.out, h.out));
    PiecesReference ref(c, BackendConfig{}, o);
    EXPECT_TRUE(close_rel(a.out, ref.forward(x, Tensor(), true).out, 1e-12));
    const Tensor ga = fallback.backward(a, G), gh = host.backward(h, G);
    EXPECT_TRUE(same_values(ga, gh));
    const auto pa = fallback.parameters(), ph = host.parameters();
    ASSERT_EQ(pa.size(), ph.size());
    for (std::size_t i = 0; i < pa.size(); ++i) {
      ASSERT_EQ(pa[i]->name, ph[i]->name);
      ASSERT_TRUE(pa[i]->grad.defined()) << pa[i]->name;
      EXPECT_TRUE(same_values(pa[i]->grad, ph[i]->grad)) << pa[i]->name;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Aux loss

namespace {

// Automodel's aux loss written out from the gate's parameters: L = sum_e f_e P_e with
// f_e = load_e E / (k Lctx), P_e = sum_t score[t, e] / Lctx over valid tokens (no correction bias,
// no groups here).
double aux_by_formula(const MoEConfig& c, MoELayer& L, const Tensor& x) {
  const std::int64_t T = x.size(0), D = c.dim, E = c.n_routed_experts, k = c.n_activated_experts;
  const double* W = L.gate()->weight().value.data<double>();
  std::vector<double> load(static_cast<std::size_t>(E), 0.0), P(static_cast<std::size_t>(E), 0.0);
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<double> z(static_cast<std::size_t>(E)), p(static_cast<std::size_t>(E));
    for (std::int64_t e = 0; e < E; ++e) {
      z[e] = 0;
      for (std::int64_t d = 0; d < D; ++d) z[e] += W[e * D + d] * x.data<double>()[t * D + d];
    }
    if (c.score_func == ScoreFunc::sigmoid) {
      for (std::int64_t e = 0; e < E; ++e) p[e] = 1.0 / (1.0 + std::exp(-z[e]));
    } else {
      double m = *std::max_element(z.begin(), z.end()), s = 0;
      for (std::int64_t e = 0; e < E; ++e) s += (p[e] = std::exp(z[e] - m));
      for (std::int64_t e = 0; e < E; ++e) p[e] /= s;
    }
    // Selection: raw logits for plain softmax, the scores otherwise (same order for both here, but
    // written as documented).
    const std::vector<double>& key = c.score_func == ScoreFunc::softmax && !c.softmax_before_topk ? z : p;
    std::vector<int> order(static_cast<std::size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return key[a] > key[b]; });
    for (std::int64_t j = 0; j < k; ++j) load[order[j]] += 1;
    double norm = 1;
    if (c.norm_topk_prob && k > 1) norm = std::accumulate(p.begin(), p.end(), 0.0) + 1e-20;
    for (std::int64_t e = 0; e < E; ++e) P[e] += p[e] / norm;
  }
  const double ctx = std::max<double>(static_cast<double>(T), 1.0);
  double loss = 0;
  for (std::int64_t e = 0; e < E; ++e) loss += load[e] * E / (k * ctx) * P[e] / ctx;
  return loss;
}

struct AuxVariant {
  std::string name;
  MoEConfig cfg;
};

std::vector<AuxVariant> aux_variants() {
  MoEConfig a = small_config();
  a.aux_loss_coeff = 0.1;
  MoEConfig b = a;
  b.softmax_before_topk = true;
  MoEConfig s = a;
  s.score_func = ScoreFunc::sigmoid;
  MoEConfig sn = s;
  sn.norm_topk_prob = true;
  return {{"softmax", a}, {"softmax_before_topk", b}, {"sigmoid", s}, {"sigmoid_norm_topk_prob", sn}};
}

}  // namespace

TEST(MoELayer, AuxLossMatchesTheFormulaOnEveryRank) {
  for (const AuxVariant& v : aux_variants()) {
    SCOPED_TRACE(v.name);
    LayerGroup g(2, v.cfg, BackendConfig{}, f64_options(1.0));
    const std::vector<Tensor> xs = {randn({9, v.cfg.dim}, 31), randn({4, v.cfg.dim}, 32)};
    const auto outs = g.forward(xs, {}, true);
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(outs[static_cast<std::size_t>(r)].aux_loss.has_value());
      const double want = aux_by_formula(v.cfg, g[r], xs[static_cast<std::size_t>(r)]);
      EXPECT_NEAR(*outs[static_cast<std::size_t>(r)].aux_loss, want, 1e-12 * want) << "rank " << r;
      EXPECT_GT(want, 0.0);
    }
  }
}

TEST(MoELayer, AuxLossAbsentInEvalOrWithZeroCoefficient) {
  MoEConfig c = small_config();
  c.aux_loss_coeff = 0.1;
  LayerGroup g(2, c, BackendConfig{}, f64_options());
  const std::vector<Tensor> xs = {randn({5, c.dim}, 1), randn({3, c.dim}, 2)};
  for (const auto& o : g.forward(xs, {}, /*training=*/false)) EXPECT_FALSE(o.aux_loss.has_value());
  for (const auto& o : g.forward(xs, {}, /*training=*/true)) EXPECT_TRUE(o.aux_loss.has_value());
  c.aux_loss_coeff = 0.0;
  LayerGroup g0(2, c, BackendConfig{}, f64_options());
  for (const auto& o : g0.forward(xs, {}, /*training=*/true)) EXPECT_FALSE(o.aux_loss.has_value());
}

// Automodel's TestAuxLossSoftmaxFix: the aux loss stays >= 0 and finite for softmax (top-k first and
// softmax before top-k) and sigmoid, also after a few SGD steps on the layer (f32, like training).
TEST(MoELayer, AuxLossStaysNonNegativeAndFiniteUnderSgd) {
  for (const AuxVariant& v : aux_variants()) {
    SCOPED_TRACE(v.name);
    MoELayerOptions o;
    o.param_dtype = DType::f32;
    o.init_std = 0.5;
    LayerGroup g(2, v.cfg, BackendConfig{}, o);
    const std::vector<Tensor> xs = {randn({10, v.cfg.dim}, 41, 1.0, DType::f32),
                                    randn({6, v.cfg.dim}, 42, 1.0, DType::f32)};
    // A regression target, so that the steps train rather than diverge: grad_out = out - target.
    const std::vector<Tensor> targets = {randn({10, v.cfg.dim}, 43, 0.5, DType::f32),
                                         randn({6, v.cfg.dim}, 44, 0.5, DType::f32)};
    const Tensor w0 = g[0].gate()->weight().value.clone();
    double first_mse = 0, mse = 0;
    for (int step = 0; step < 8; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      for (int r = 0; r < 2; ++r) g[r].zero_grad();
      const auto outs = g.forward(xs, {}, true);
      std::vector<Tensor> grads;
      mse = 0;
      for (std::size_t r = 0; r < outs.size(); ++r) {
        ASSERT_TRUE(outs[r].aux_loss.has_value());
        EXPECT_TRUE(std::isfinite(*outs[r].aux_loss));
        EXPECT_GE(*outs[r].aux_loss, 0.0);
        Tensor d = outs[r].out.clone();
        for (std::int64_t i = 0; i < d.numel(); ++i) {
          d.data<float>()[i] -= targets[r].data<float>()[i];
          mse += 0.5 * d.data<float>()[i] * d.data<float>()[i];
        }
        grads.push_back(d);
      }
      if (step == 0) first_mse = mse;
      g.backward(outs, grads);
      // SGD with the replicated gradients summed over the ranks (the data-parallel all-reduce).
      std::map<std::string, std::vector<double>> summed;
      for (int r = 0; r < 2; ++r)
        for (Parameter* p : g[r].replicated_parameters()) {
          auto& acc = summed[p->name];
          acc.resize(static_cast<std::size_t>(p->grad.numel()), 0.0);
          for (std::int64_t i = 0; i < p->grad.numel(); ++i)
            acc[static_cast<std::size_t>(i)] += read_as_double(p->grad, i);
        }
      for (int r = 0; r < 2; ++r)
        for (Parameter* p : g[r].parameters()) {
          const auto it = summed.find(p->name);
          for (std::int64_t i = 0; i < p->value.numel(); ++i) {
            const double grad =
                it != summed.end() ? it->second[static_cast<std::size_t>(i)] : read_as_double(p->grad, i);
            write_from_double(p->value, i, read_as_double(p->value, i) - 0.01 * grad);
          }
        }
      // The two ranks applied the same update to their gate (replicated parameters stay equal).
      EXPECT_TRUE(same_values(g[0].gate()->weight().value, g[1].gate()->weight().value));
    }
    EXPECT_FALSE(same_values(g[0].gate()->weight().value, w0)) << "SGD did not move the gate";
    // The layer's gradients are descent directions of the task loss (they train it).
    EXPECT_LT(mse, 0.8 * first_mse);
  }
}

// Automodel's TestGateAuxLossGradientFlow: the gate weight (and bias) receive coeff * scale * dL on
// top of the task gradient. Checked as the difference against the coeff = 0 layer, compared with
// central finite differences of the aux loss alone.
TEST(MoELayer, AuxLossGradientReachesTheGate) {
  for (const AuxVariant& v : aux_variants()) {
    SCOPED_TRACE(v.name);
    MoEConfig c = v.cfg;
    c.router_bias = true;
    c.aux_loss_coeff = 0.3;
    MoEConfig c0 = c;
    c0.aux_loss_coeff = 0.0;
    const double scale = 2.5;
    const MoELayerOptions o = f64_options(1.0);
    LayerGroup with(1, c, BackendConfig{}, o), without(1, c0, BackendConfig{}, o);
    with[0].gate()->aux_loss_scale = scale;
    const Tensor x = randn({10, c.dim}, 61), G = randn({10, c.dim}, 62);
    const auto a = with.forward({x}, {}, true);
    const auto b = without.forward({x}, {}, true);
    ASSERT_TRUE(a[0].aux_loss.has_value());
    ASSERT_FALSE(b[0].aux_loss.has_value());
    EXPECT_TRUE(same_values(a[0].out, b[0].out));
    with.backward(a, {G});
    without.backward(b, {G});
    // Expert gradients do not see the aux loss.
    EXPECT_TRUE(same_values(with[0].experts().down_projs().grad, without[0].experts().down_projs().grad));

    const GateOutput base = with[0].gate()->forward(x, Tensor(), false);
    for (Parameter* p : {&with[0].gate()->weight(), &with[0].gate()->bias()}) {
      Parameter* q = p == &with[0].gate()->weight() ? &without[0].gate()->weight() : &without[0].gate()->bias();
      double max_diff = 0;
      for (std::int64_t i = 0; i < p->value.numel(); ++i) {
        const double orig = p->value.data<double>()[i], eps = 1e-6;
        auto aux_at = [&](double val) {
          p->value.data<double>()[i] = val;
          const GateOutput sel = with[0].gate()->forward(x, Tensor(), false);
          EXPECT_TRUE(same_values(sel.indices, base.indices)) << "routing flipped; pick another input";
          const double l = *with.forward({x}, {}, true)[0].aux_loss;
          return l;
        };
        const double fd = (aux_at(orig + eps) - aux_at(orig - eps)) / (2 * eps);
        p->value.data<double>()[i] = orig;
        const double diff = p->grad.data<double>()[i] - q->grad.data<double>()[i];
        EXPECT_NEAR(diff, c.aux_loss_coeff * scale * fd, 1e-7 + 1e-6 * std::abs(diff)) << p->name << "[" << i << "]";
        max_diff = std::max(max_diff, std::abs(diff));
      }
      EXPECT_GT(max_diff, 1e-6) << p->name << ": the aux loss contributes no gradient at all";
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Fake balanced gate

TEST(MoELayer, FakeBalancedGateRoutesCyclicallyWithUniformWeights) {
  MoEConfig c = small_config();
  c.n_activated_experts = 3;
  c.n_shared_experts = 1;
  c.aux_loss_coeff = 0.1;  // no aux loss without a learned gate
  BackendConfig b;
  b.fake_balanced_gate = true;
  const MoELayerOptions o = f64_options();
  const int R = 2;
  LayerGroup g(R, c, b, o);
  PiecesReference ref(c, BackendConfig{}, o);  // only its experts and shared expert are used
  const std::vector<Tensor> xs = {randn({7, c.dim}, 71), randn({5, c.dim}, 72)};
  const std::vector<Tensor> pads = {bool_tensor({false, false, true, false, false, false, false}),
                                    bool_tensor({false, true, false, false, false})};
  const auto outs = g.forward(xs, pads, true);
  const std::int64_t k = c.n_activated_experts, E = c.n_routed_experts;
  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const auto i = static_cast<std::size_t>(r);
    const std::int64_t T = xs[i].size(0);
    // Automodel's FakeBalancedGate (noise 0): token t, slot j -> expert (t*k + j) mod E, weight 1/k.
    Tensor idx = Tensor::empty({T, k}, DType::i64), w = Tensor::empty({T, k}, DType::f64);
    for (std::int64_t n = 0; n < T * k; ++n) {
      idx.data<std::int64_t>()[n] = n % E;
      w.data<double>()[n] = 1.0 / static_cast<double>(k);
    }
    Tensor want = ref.experts.forward_loop(xs[i], token_mask_of(pads[i]), w, idx);
    Tensor z = ref.shared->forward(xs[i]).out;
    for (std::int64_t n = 0; n < want.numel(); ++n) want.data<double>()[n] += z.data<double>()[n];
    EXPECT_TRUE(close_rel(outs[i].out, want, 1e-12));
    EXPECT_FALSE(outs[i].aux_loss.has_value());
  }
  // Backward runs without a gate: grad x comes from the experts and the shared expert only.
  const std::vector<Tensor> Gs = {randn({7, c.dim}, 73), randn({5, c.dim}, 74)};
  const auto gx = g.backward(outs, Gs);
  EXPECT_EQ(gx[0].shape(), xs[0].shape());
  EXPECT_EQ(gx[1].shape(), xs[1].shape());
}

TEST(MoELayer, NoisyFakeGateMatchesTheFakeGatePiece) {
  MoEConfig c = small_config();
  BackendConfig b;
  b.fake_balanced_gate = true;
  b.fake_gate_noise = 0.4;
  const MoELayerOptions o = f64_options();
  LayerGroup g(2, c, b, o);
  PiecesReference ref(c, b, o);
  const std::vector<Tensor> xs = {randn({9, c.dim}, 81), randn({6, c.dim}, 82)};
  const auto outs = g.forward(xs, {}, true);
  for (std::size_t r = 0; r < 2; ++r)
    EXPECT_TRUE(close_rel(outs[r].out, ref.forward(xs[r], Tensor(), true).out, 1e-12)) << "rank " << r;
}

// ---------------------------------------------------------------------------------------------
// zero_grad and argument errors

TEST(MoELayer, ZeroGradClearsEveryGradient) {
  MoEConfig c = small_config();
  c.router_bias = true;
  c.expert_bias = true;
  c.n_shared_experts = 1;
  c.shared_expert_gate = true;
  c.aux_loss_coeff = 0.1;
  LayerGroup g(2, c, BackendConfig{}, f64_options());
  const std::vector<Tensor> xs = {randn({12, c.dim}, 91), randn({10, c.dim}, 92)};
  const auto outs = g.forward(xs, {}, true);
  g.backward(outs, {randn({12, c.dim}, 93), randn({10, c.dim}, 94)});
  for (int r = 0; r < 2; ++r) {
    for (Parameter* p : g[r].parameters()) {
      ASSERT_TRUE(p->grad.defined()) << p->name;
      bool nonzero = false;
      for (std::int64_t i = 0; i < p->grad.numel(); ++i) nonzero |= p->grad.data<double>()[i] != 0;
      EXPECT_TRUE(nonzero) << p->name << " got no gradient (rank " << r << ")";
    }
    g[r].zero_grad();
    for (Parameter* p : g[r].parameters()) {
      ASSERT_TRUE(p->grad.defined()) << p->name;
      for (std::int64_t i = 0; i < p->grad.numel(); ++i) ASSERT_EQ(p->grad.data<double>()[i], 0.0) << p->name;
    }
  }
}

TEST(MoELayer, BadInputsRaiseArgumentErrorNamingTheArgument) {
  MoEConfig c = small_config();
  MoELayer L(c, BackendConfig{}, nullptr, f64_options());
  auto expect_arg = [](const std::function<void()>& fn, const std::string& arg) {
    const auto e = catch_error<ArgumentError>(fn);
    ASSERT_TRUE(e.has_value()) << "no ArgumentError for " << arg;
    EXPECT_EQ(e->argument(), arg) << e->what();
  };
  const Tensor x = randn({4, c.dim}, 1);
  expect_arg([&] { L.forward(randn({4, c.dim + 1}, 1), Tensor(), true); }, "x");
  expect_arg([&] { L.forward(randn({4, c.dim}, 1, 1.0, DType::f32), Tensor(), true); }, "x");
  expect_arg([&] { L.forward(x, bool_tensor({false, true, false}), true); }, "padding_mask");
  expect_arg([&] { L.forward(x, randn({4}, 2), true); }, "padding_mask");
  const MoEOutput out = L.forward(x, Tensor(), true);
  expect_arg([&] { L.backward(out, randn({3, c.dim}, 3)); }, "grad_out");
  expect_arg([&] { L.backward(out, randn({4, c.dim + 1}, 3)); }, "grad_out");
  expect_arg([&] { L.backward(out, randn({4, c.dim}, 3, 1.0, DType::f32)); }, "grad_out");
  expect_arg([&] { L.backward(MoEOutput{}, randn({4, c.dim}, 3)); }, "forward_output");
  // A failed call leaves the layer usable.
  EXPECT_NO_THROW(L.backward(out, randn({4, c.dim}, 3)));
}

namespace {

// A dispatcher that only reports its group: enough for the layer's constructor checks (the host
// dispatcher itself refuses E not divisible by R, so it cannot reach the layer's check).
class ShapeOnlyDispatcher : public TokenDispatcher {
 public:
  ShapeOnlyDispatcher(int rank, int size, int experts) : rank_(rank), size_(size), experts_(experts) {}
  std::string_view backend() const override { return "shape-only"; }
  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  int num_experts() const override { return experts_; }
  DispatchResult dispatch(const DispatchInput&, const DispatchOptions&) override { throw_error("not callable"); }
  Tensor combine(const Handle&, const TensorView&) override { throw_error("not callable"); }
  DispatchGrads dispatch_backward(const Handle&, const TensorView&, const TensorView&) override {
    throw_error("not callable");
  }
  Tensor combine_backward(const Handle&, const TensorView&) override { throw_error("not callable"); }

 private:
  int rank_, size_, experts_;
};

}  // namespace

TEST(MoELayer, ExpertsNotDivisibleByRanksOrMismatchedDispatcherIsRejected) {
  MoEConfig c = small_config();  // E = 8
  {
    const auto e = catch_error<ArgumentError>(
        [&] { MoELayer L(c, BackendConfig{}, std::make_shared<ShapeOnlyDispatcher>(0, 3, 8), f64_options()); });
    ASSERT_TRUE(e.has_value());
    EXPECT_EQ(e->argument(), "moe.n_routed_experts");
    EXPECT_NE(std::string(e->what()).find("n_routed_experts"), std::string::npos) << e->what();
  }
  {
    const auto e = catch_error<ArgumentError>(
        [&] { MoELayer L(c, BackendConfig{}, std::make_shared<ShapeOnlyDispatcher>(0, 2, 6), f64_options()); });
    ASSERT_TRUE(e.has_value());
    EXPECT_EQ(e->argument(), "dispatcher");
  }
  {
    const auto e = catch_error<ArgumentError>([&] {
      MoELayerOptions o;
      o.param_dtype = DType::bf16;
      MoELayer L(c, BackendConfig{}, nullptr, o);
    });
    ASSERT_TRUE(e.has_value());
    EXPECT_EQ(e->argument(), "param_dtype");
  }
  EXPECT_NO_THROW(MoELayer(c, BackendConfig{}, std::make_shared<ShapeOnlyDispatcher>(1, 4, 8), f64_options()));
}

TEST(MoELayer, GateInputDtypeRoutesLikeTheBf16Gate) {
  // gate_input_dtype bf16: the layer's gate sees x in bf16 (bf16 logits and weights, as the GPU
  // layer routes) while the experts run in the layer's dtype. The layer's routing equals that of the
  // gate alone on bf16 x; its weights reach the experts rounded to bf16.
  MoEConfig c = small_config(Activation::swiglu, ScoreFunc::sigmoid);
  c.norm_topk_prob = true;
  MoELayerOptions o;
  o.seed = 5;
  o.init_std = 0.3;
  o.gate_input_dtype = DType::bf16;
  MoELayer layer(c, BackendConfig{}, nullptr, o);
  const Tensor x = randn({9, c.dim}, 6, 1.0, DType::f32).to(DType::bf16).to(DType::f32);
  const MoEOutput out = layer.forward(x, Tensor(), false);
  const GateOutput g = layer.gate()->forward(x.to(DType::bf16), Tensor(), false);
  ASSERT_EQ(g.weights.dtype(), DType::bf16);
  const Tensor want = layer.experts().forward_loop(x, Tensor(), g.weights.to(DType::f32), g.indices);
  EXPECT_TRUE(same_values(out.out, want));
  // And its gradient reaches x in the layer's dtype.
  EXPECT_EQ(layer.backward(out, randn({9, c.dim}, 7, 1.0, DType::f32)).dtype(), DType::f32);
  MoELayerOptions bad = o;
  bad.gate_input_dtype = DType::f64;
  EXPECT_EQ(catch_error<ArgumentError>([&] { MoELayer(c, BackendConfig{}, nullptr, bad); })->argument(),
            "gate_input_dtype");
}

TEST(MoELayer, ReplayIndicesReachTheGate) {
  MoEConfig c = small_config(Activation::swiglu, ScoreFunc::sigmoid);
  c.enable_routing_replay = true;
  MoELayer layer(c, BackendConfig{}, nullptr, f64_options());
  const Tensor x = randn({4, c.dim}, 8);
  const Tensor forced = Tensor::from_vector<std::int64_t>({7, 6, 5, 4, 3, 2, 1, 0}, {4, 2});
  const MoEOutput out = layer.forward(x, Tensor(), false, forced);
  const GateOutput g = layer.gate()->forward(x, Tensor(), false, forced);
  EXPECT_TRUE(same_values(out.out, layer.experts().forward_loop(x, Tensor(), g.weights, forced)));
}

// y = fc2(experts(fc1(x))) with the router on x (Automodel's MoE with moe_latent_size), against
// nn.Linear written out here and the experts' per-token loop in the latent width.
TEST(MoELayer, LatentProjectionsWrapTheRoutedExperts) {
  MoEConfig c = small_config(Activation::swiglu, ScoreFunc::sigmoid);
  c.enable_routing_replay = true;
  c.moe_latent_size = 5;
  c.expert_bias = true;
  MoELayer layer(c, BackendConfig{}, nullptr, f64_options());
  LatentProjections* lp = layer.latent_projections();
  ASSERT_NE(lp, nullptr);
  for (Parameter* p : {&lp->fc1_bias(), &lp->fc2_bias()})  // zero after init: make them count
    for (std::int64_t i = 0; i < p->value.numel(); ++i) p->value.data<double>()[i] = 0.1 * static_cast<double>(i + 1);
  EXPECT_EQ(layer.experts().gate_and_up_projs().value.shape(), Shape({8, 5, 12}));
  const Tensor x = randn({4, c.dim}, 8);
  const Tensor forced = Tensor::from_vector<std::int64_t>({7, 6, 5, 4, 3, 2, 1, 0}, {4, 2});
  const MoEOutput out = layer.forward(x, Tensor(), false, forced);
  const GateOutput g = layer.gate()->forward(x, Tensor(), false, forced);
  auto linear = [](const Tensor& in, const Parameter& w, const Parameter& b) {
    const std::int64_t rows = in.size(0), n_in = w.value.size(1), n_out = w.value.size(0);
    Tensor o = Tensor::zeros({rows, n_out}, DType::f64);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < n_out; ++j) {
        double s = b.value.data<double>()[j];
        for (std::int64_t i = 0; i < n_in; ++i) s += w.value.data<double>()[j * n_in + i] * in.data<double>()[r * n_in + i];
        o.data<double>()[r * n_out + j] = s;
      }
    return o;
  };
  const Tensor x_latent = linear(x, lp->fc1_weight(), lp->fc1_bias());
  const Tensor want =
      linear(layer.experts().forward_loop(x_latent, Tensor(), g.weights, forced), lp->fc2_weight(), lp->fc2_bias());
  ASSERT_EQ(out.out.shape(), want.shape());
  for (std::int64_t i = 0; i < want.numel(); ++i)
    EXPECT_NEAR(out.out.data<double>()[i], want.data<double>()[i], 1e-12) << i;
  std::vector<std::string> names;
  for (Parameter* p : layer.parameters()) names.push_back(p->name);
  for (const char* n : {"fc1_latent_proj.weight", "fc1_latent_proj.bias", "fc2_latent_proj.weight", "fc2_latent_proj.bias"})
    EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
}

// A rank-major dispatch (DeepEP's layout) under the layer: the experts read the received rows
// through expert_rows and their rows are summed per received token before the combine, so the
// layer's output and every gradient are bitwise those of the expert-major dispatch.
TEST(MoELayer, RankMajorDispatchGivesTheExpertMajorLayerBitwise) {
  for (int R : {2, 4})
    for (DType dt : {DType::f32, DType::f64}) {
      SCOPED_TRACE("R " + std::to_string(R) + ", " + std::string(dtype_name(dt)));
      MoEConfig c = small_config(Activation::swiglu, ScoreFunc::sigmoid);
      c.n_activated_experts = 3;
      c.expert_bias = true;
      c.n_shared_experts = 1;
      MoELayerOptions em = f64_options();
      em.param_dtype = dt;
      em.dispatch.pad_multiple = 2;
      MoELayerOptions rm = em;
      rm.dispatch.layout = DispatchLayout::rank_major;
      LayerGroup a(R, c, BackendConfig{}, em), b(R, c, BackendConfig{}, rm);
      std::vector<Tensor> xs = inputs_for(R, c.dim, 5), grads;
      for (Tensor& x : xs) x = x.to(dt);
      for (int r = 0; r < R; ++r) grads.push_back(randn(xs[r].shape(), 900 + r).to(dt));
      const auto ya = a.forward(xs, {}, true), yb = b.forward(xs, {}, true);
      const auto gxa = a.backward(ya, grads), gxb = b.backward(yb, grads);
      // Equal sizes and bytes (a rank without tokens has empty tensors, with no memory to compare).
      auto same = [](const Tensor& x, const Tensor& y) {
        return x.nbytes() == y.nbytes() && (x.nbytes() == 0 || std::memcmp(x.raw(), y.raw(), x.nbytes()) == 0);
      };
      for (int r = 0; r < R; ++r) {
        SCOPED_TRACE("rank " + std::to_string(r));
        EXPECT_TRUE(same(ya[r].out, yb[r].out));
        EXPECT_TRUE(same(gxa[r], gxb[r]));
        const auto pa = a[r].parameters(), pb = b[r].parameters();
        ASSERT_EQ(pa.size(), pb.size());
        for (std::size_t i = 0; i < pa.size(); ++i) {
          ASSERT_TRUE(pa[i]->grad.defined()) << pa[i]->name;
          EXPECT_TRUE(same(pa[i]->grad, pb[i]->grad)) << pa[i]->name;
        }
      }
    }
}
