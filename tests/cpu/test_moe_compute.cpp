// MoECompute (layer/moe_compute.h), the layer on weights given per call, against the owner MoELayer
// holding the same values: bitwise the same outputs, aux losses, expert loads, grad x and gradients
// (f64 and f32, 1 and 2 simulated ranks, the routing and expert variants); a backward given copies
// of the weights at new addresses while the forward's tensors hold NaN; bf16 on the CPU against f32;
// mixed dtypes; the routing override.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cpu/host_ranks.h"
#include "cpu/moe_compute_util.h"
#include "cpu/same_bytes.h"
#include "flexep/core/random.h"
#include "flexep/dispatch/host.h"
#include "flexep/layer/moe_compute.h"
#include "flexep/layer/moe_layer.h"

using namespace flexep;
using namespace flexep::testing;

namespace {

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

struct Case {
  std::string name;
  MoEConfig cfg;
  bool padding = false;
  double aux_scale = 1.0;
};

std::vector<Case> cases() {
  std::vector<Case> v;
  v.push_back({"softmax_padding", small_config(), true});
  {
    MoEConfig c = small_config(Activation::swiglu, ScoreFunc::sigmoid);
    c.gate_bias_update_factor = 0.01;  // a correction bias
    c.n_expert_groups = 4;
    c.n_limited_groups = 2;
    c.n_activated_experts = 3;
    c.norm_topk_prob = true;
    c.route_scale = 2.5;
    v.push_back({"sigmoid_correction_bias_groups", c});
  }
  {
    MoEConfig c = small_config(Activation::swiglu, ScoreFunc::softmax_with_bias);
    c.force_e_score_correction_bias = true;
    c.n_expert_groups = 4;
    c.n_limited_groups = 2;
    c.n_activated_experts = 3;
    c.norm_topk_prob = true;
    c.aux_loss_coeff = 0.05;
    v.push_back({"softmax_with_bias_groups_aux_padding", c, true, 0.6});
  }
  {
    MoEConfig c = small_config();
    c.n_shared_experts = 2;
    c.shared_expert_inter_dim = 3;
    c.shared_expert_gate = true;
    c.expert_bias = true;
    c.router_bias = true;
    v.push_back({"shared_gate_expert_and_router_bias_padding", c, true});
  }
  {
    MoEConfig c = small_config(Activation::relu2);
    c.n_shared_experts = 1;
    c.shared_expert_activation = Activation::relu2;
    c.expert_bias = true;
    v.push_back({"relu2_shared_relu2_without_gate", c});
  }
  {
    MoEConfig c = small_config(Activation::quick_geglu);
    c.softmax_before_topk = true;
    c.aux_loss_coeff = 0.1;
    c.router_bias = true;
    c.n_shared_experts = 1;
    v.push_back({"quick_geglu_softmax_before_topk_aux_shared", c, false, 0.37});
  }
  {
    MoEConfig c = small_config(Activation::swiglu, ScoreFunc::sigmoid);
    c.moe_latent_size = 5;
    c.expert_bias = true;
    c.n_shared_experts = 1;
    v.push_back({"latent_projections_bias_shared_padding", c, true});
  }
  return v;
}

Tensor randn(Shape shape, std::uint64_t seed, double std = 1.0, DType dtype = DType::f64) {
  Tensor t = Tensor::empty(shape, dtype);
  if (t.numel() > 0) fill_normal(t, seed, stream_id("test.moe_compute.input"), 0.0, std);
  return t;
}

std::vector<std::int64_t> tokens_for(int R) {
  return R == 1 ? std::vector<std::int64_t>{9} : std::vector<std::int64_t>{7, 4};
}

// Biases and the correction bias start at zero; random values make them matter.
void set_extras(MoELayer& L, int rank) {
  for (Parameter* p : L.parameters())
    if (p->name.find("bias") != std::string::npos)
      fill_normal(p->value, 4242 + rank, stream_id(p->name.c_str()), 0.0, 0.5);
  if (Gate* g = L.gate())
    if (g->e_score_correction_bias().defined())
      fill_normal(g->e_score_correction_bias(), 4242 + rank, stream_id("cb"), 0.0, 0.1);
}

struct Inputs {
  std::vector<Tensor> x, pad, grad;
};

Inputs inputs(int R, const Case& c, DType dtype, std::uint64_t seed = 3) {
  Inputs in;
  const auto T = tokens_for(R);
  for (int r = 0; r < R; ++r) {
    const std::int64_t t = T[static_cast<std::size_t>(r)];
    in.x.push_back(randn({t, c.cfg.dim}, seed * 101 + r, 1.0, dtype));
    in.grad.push_back(randn({t, c.cfg.dim}, seed * 103 + r, 1.0, dtype));
    Tensor pad;
    if (c.padding) {
      pad = Tensor::zeros({t}, DType::b8);
      for (std::int64_t i = std::max<std::int64_t>(0, t - 2); i < t; ++i) pad.data<bool>()[i] = true;
    }
    in.pad.push_back(pad);
  }
  return in;
}

struct Owners {
  std::shared_ptr<HostWorld> world;
  std::vector<std::unique_ptr<MoELayer>> layers;
  Owners(int R, const MoEConfig& c, DType dtype, const BackendConfig& b = {})
      : world(std::make_shared<HostWorld>(R, 30.0)) {
    MoELayerOptions o;
    o.param_dtype = dtype;
    o.init_std = 0.3;
    o.seed = 77;
    for (int r = 0; r < R; ++r) {
      layers.push_back(std::make_unique<MoELayer>(c, b, make_host_dispatcher(world, r, c.n_routed_experts), o));
      set_extras(*layers.back(), r);
    }
  }
};

struct Computes {
  std::shared_ptr<HostWorld> world;
  std::vector<std::unique_ptr<MoECompute>> layers;
  Computes(int R, const MoEConfig& c, const BackendConfig& b = {}, const DispatchOptions& o = {})
      : world(std::make_shared<HostWorld>(R, 30.0)) {
    for (int r = 0; r < R; ++r)
      layers.push_back(std::make_unique<MoECompute>(c, b, make_host_dispatcher(world, r, c.n_routed_experts), o));
  }
};

struct Result {
  MoEOutput fwd;
  Tensor grad_x;
  std::vector<std::pair<std::string, Tensor>> grads;
};

std::vector<Result> run_owners(Owners& o, const Inputs& in, double aux_scale) {
  const int R = static_cast<int>(o.layers.size());
  std::vector<Result> res(static_cast<std::size_t>(R));
  EXPECT_TRUE(all_ok(run_ranks(R, [&](int r) {
    const auto i = static_cast<std::size_t>(r);
    MoELayer& L = *o.layers[i];
    if (L.gate()) L.gate()->aux_loss_scale = aux_scale;
    res[i].fwd = L.forward(in.x[i], in.pad[i], true);
    res[i].grad_x = L.backward(res[i].fwd, in.grad[i]);
  })));
  for (std::size_t i = 0; i < res.size(); ++i) res[i].grads = owner_gradients(*o.layers[i]);
  return res;
}

// forward with `fwd_weights[r]`, backward with `bwd_weights[r]` (the same values; maybe elsewhere).
// `between` runs on each rank after its forward.
std::vector<Result> run_computes(Computes& cs, const std::vector<MoEWeights>& fwd_weights,
                                 const std::vector<MoEWeights>& bwd_weights, const Inputs& in, double aux_scale,
                                 const std::function<void(int)>& between = {}) {
  const int R = static_cast<int>(cs.layers.size());
  std::vector<Result> res(static_cast<std::size_t>(R));
  EXPECT_TRUE(all_ok(run_ranks(R, [&](int r) {
    const auto i = static_cast<std::size_t>(r);
    res[i].fwd = cs.layers[i]->forward(fwd_weights[i], in.x[i], in.pad[i], true);
    if (between) between(r);
    MoEBackward b = cs.layers[i]->backward(bwd_weights[i], *res[i].fwd.saved, in.grad[i], aux_scale);
    res[i].grad_x = b.grad_x;
    res[i].grads = b.gradients.named();
  })));
  return res;
}

// Same names, same order, same bytes.
void expect_same_grads(const std::vector<std::pair<std::string, Tensor>>& got,
                       const std::vector<std::pair<std::string, Tensor>>& want) {
  std::map<std::string, Tensor> w(want.begin(), want.end());
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, g] : got) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(w.count(name));
    EXPECT_TRUE(same_bytes(g, w[name]));
  }
}

void expect_same_results(const std::vector<Result>& got, const std::vector<Result>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t r = 0; r < got.size(); ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_TRUE(same_bytes(got[r].fwd.out, want[r].fwd.out));
    ASSERT_EQ(got[r].fwd.aux_loss.has_value(), want[r].fwd.aux_loss.has_value());
    if (want[r].fwd.aux_loss) {
      EXPECT_EQ(*got[r].fwd.aux_loss, *want[r].fwd.aux_loss);
    }
    EXPECT_TRUE(same_bytes(got[r].fwd.expert_load, want[r].fwd.expert_load));
    EXPECT_TRUE(same_bytes(got[r].grad_x, want[r].grad_x));
    expect_same_grads(got[r].grads, want[r].grads);
  }
}

std::vector<MoEWeights> views_of(std::vector<HeldWeights>& h) {
  std::vector<MoEWeights> v;
  for (HeldWeights& w : h) v.push_back(w.w);
  return v;
}

}  // namespace

TEST(MoECompute, MatchesOwnerLayerBitwise) {
  for (const Case& c : cases())
    for (DType dtype : {DType::f64, DType::f32})
      for (int R : {1, 2}) {
        SCOPED_TRACE(c.name + " " + std::string(dtype_name(dtype)) + " R=" + std::to_string(R));
        Owners owners(R, c.cfg, dtype);
        const Inputs in = inputs(R, c, dtype);
        const std::vector<Result> want = run_owners(owners, in, c.aux_scale);
        std::vector<HeldWeights> held;
        for (auto& L : owners.layers) held.push_back(owner_weights(*L));
        Computes computes(R, c.cfg);
        const std::vector<Result> got = run_computes(computes, views_of(held), views_of(held), in, c.aux_scale);
        expect_same_results(got, want);
        // Every weight that requires a gradient got one (the gate: moe.train_gate, true here).
        for (std::size_t r = 0; r < got.size(); ++r) {
          std::size_t expected = 0;
          for (const MoEWeightSpec& s : computes.layers[r]->weight_specs()) expected += s.requires_grad;
          EXPECT_EQ(got[r].grads.size(), expected);
          for (const auto& [name, g] : got[r].grads) EXPECT_EQ(g.dtype(), dtype) << name;
        }
        EXPECT_EQ(got[0].fwd.aux_loss.has_value(), c.cfg.aux_loss_coeff > 0);
      }
}

// The expert load is what the gate counts over unmasked tokens (Automodel's _compute_expert_load).
TEST(MoECompute, ExpertLoadCountsUnmaskedTokens) {
  const Case c = cases()[0];  // padding
  Owners owners(1, c.cfg, DType::f64);
  const Inputs in = inputs(1, c, DType::f64);
  Computes computes(1, c.cfg);
  HeldWeights h = owner_weights(*owners.layers[0]);
  const MoEOutput out = computes.layers[0]->forward(h.w, in.x[0], in.pad[0], false);
  Tensor mask = Tensor::empty({in.x[0].size(0)}, DType::b8);
  std::int64_t valid = 0;
  for (std::int64_t t = 0; t < mask.numel(); ++t) valid += (mask.data<bool>()[t] = !in.pad[0].data<bool>()[t]);
  const GateOutput g = owners.layers[0]->gate()->forward(in.x[0], mask, false);
  ASSERT_EQ(out.expert_load.numel(), c.cfg.n_routed_experts);
  ASSERT_EQ(out.expert_load.dtype(), DType::i64);
  std::int64_t sum = 0;
  for (int e = 0; e < c.cfg.n_routed_experts; ++e) {
    EXPECT_EQ(out.expert_load.data<std::int64_t>()[e], g.expert_load[static_cast<std::size_t>(e)]) << e;
    sum += out.expert_load.data<std::int64_t>()[e];
  }
  EXPECT_EQ(sum, valid * c.cfg.n_activated_experts);
  EXPECT_LT(valid, mask.numel());
}

// FSDP2 with reshard_after_forward: backward gets the same values at other addresses, and the
// forward's buffers may already hold something else. The saved state must not read them.
TEST(MoECompute, BackwardReadsTheWeightsItIsGiven) {
  for (const Case& c : {cases()[2], cases()[3], cases()[5]})
    for (int R : {1, 2}) {
      SCOPED_TRACE(c.name + " R=" + std::to_string(R));
      Owners owners(R, c.cfg, DType::f64);
      const Inputs in = inputs(R, c, DType::f64);
      std::vector<HeldWeights> fwd, same, moved;
      for (auto& L : owners.layers) {
        fwd.push_back(copies(owner_weights(*L).w));
        same.push_back(copies(owner_weights(*L).w));
        moved.push_back(copies(owner_weights(*L).w));
      }
      Computes a(R, c.cfg), b(R, c.cfg);
      const std::vector<Result> want = run_computes(a, views_of(same), views_of(same), in, c.aux_scale);
      const std::vector<Result> got = run_computes(b, views_of(fwd), views_of(moved), in, c.aux_scale,
                                                   [&](int r) { poison(fwd[static_cast<std::size_t>(r)].w); });
      expect_same_results(got, want);
      // The poison did reach the forward's tensors (so a backward reading them would have shown).
      EXPECT_TRUE(std::isnan(read_as_double(fwd[0].w.experts.down_projs, 0)));
    }
}

// bf16 on the CPU: the experts and shared experts compute in f32 on the bf16 values, and the gate
// reads the bf16 x and rounds where Automodel's does (bf16 logits, bf16 weights). So the result is
// that of an f32 run on the bf16 values whose gate reads x in bf16 (set_gate_input_dtype), rounded
// once to bf16: the output exactly, the gradients within one bf16 rounding (the gate's go from f64
// sums straight to bf16, the f32 run's through f32 first).
TEST(MoECompute, Bf16OnTheCpuAgreesWithF32) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const int R = 2;
    Owners owners(R, c.cfg, DType::f32);
    const Inputs in32 = inputs(R, c, DType::f32);
    Inputs in16 = in32, in_rounded = in32;
    std::vector<HeldWeights> w16, w32;
    for (int r = 0; r < R; ++r) {
      const auto i = static_cast<std::size_t>(r);
      in16.x[i] = in32.x[i].to(DType::bf16);
      in16.grad[i] = in32.grad[i].to(DType::bf16);
      in_rounded.x[i] = in16.x[i].to(DType::f32);
      in_rounded.grad[i] = in16.grad[i].to(DType::f32);
      w16.push_back(copies(owner_weights(*owners.layers[i]).w, DType::bf16));
      w32.push_back(copies(w16.back().w, DType::f32));
    }
    Computes a(R, c.cfg), b(R, c.cfg);
    for (auto& L : b.layers) L->set_gate_input_dtype(DType::bf16);
    const std::vector<Result> got = run_computes(a, views_of(w16), views_of(w16), in16, c.aux_scale);
    const std::vector<Result> ref = run_computes(b, views_of(w32), views_of(w32), in_rounded, c.aux_scale);
    for (int r = 0; r < R; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      const auto i = static_cast<std::size_t>(r);
      ASSERT_EQ(got[i].fwd.out.dtype(), DType::bf16);
      EXPECT_TRUE(same_bytes(got[i].fwd.out, ref[i].fwd.out.to(DType::bf16)));
      ASSERT_EQ(got[i].grad_x.dtype(), DType::bf16);
      EXPECT_TRUE(same_bytes(got[i].grad_x, ref[i].grad_x.to(DType::bf16)));
      EXPECT_TRUE(same_bytes(got[i].fwd.expert_load, ref[i].fwd.expert_load));
      ASSERT_EQ(got[i].grads.size(), ref[i].grads.size());
      for (std::size_t n = 0; n < got[i].grads.size(); ++n) {
        const auto& [name, g] = got[i].grads[n];
        SCOPED_TRACE(name);
        ASSERT_EQ(name, ref[i].grads[n].first);
        ASSERT_EQ(g.dtype(), DType::bf16);
        const Tensor& want = ref[i].grads[n].second;
        ASSERT_EQ(g.shape(), want.shape());
        double scale = 0;
        for (std::int64_t k = 0; k < want.numel(); ++k) scale = std::max(scale, std::abs(read_as_double(want, k)));
        for (std::int64_t k = 0; k < want.numel(); ++k) {
          const double w = read_as_double(want, k), d = std::abs(read_as_double(g, k) - w);
          // Half a bf16 ulp of the value (2^-9 relative), and f32-level noise of the tensor's scale.
          ASSERT_LE(d, std::abs(w) * 0x1p-8 + 1e-6 * scale) << "element " << k;
        }
      }
    }
  }
}

// Weights in another dtype than x: computed in x's precision (f64 here, or f32 for an f32 x),
// gradients returned in each weight's own dtype.
TEST(MoECompute, MixedDtypesComputeInXsPrecision) {
  const Case c = cases()[3];  // shared experts with gate, biases
  Owners owners(1, c.cfg, DType::f64);
  const Inputs in = inputs(1, c, DType::f64);
  HeldWeights w64 = copies(owner_weights(*owners.layers[0]).w);
  HeldWeights w32 = copies(w64.w, DType::f32);
  HeldWeights w32_as_64 = copies(w32.w, DType::f64);
  Computes a(1, c.cfg), b(1, c.cfg);
  const Result got = run_computes(a, {w32.w}, {w32.w}, in, 1.0)[0];
  const Result ref = run_computes(b, {w32_as_64.w}, {w32_as_64.w}, in, 1.0)[0];
  EXPECT_EQ(got.fwd.out.dtype(), DType::f64);
  EXPECT_TRUE(same_bytes(got.fwd.out, ref.fwd.out));  // f64 compute on the f32 values
  EXPECT_TRUE(same_bytes(got.grad_x, ref.grad_x));
  ASSERT_EQ(got.grads.size(), ref.grads.size());
  for (std::size_t n = 0; n < got.grads.size(); ++n) {
    SCOPED_TRACE(got.grads[n].first);
    EXPECT_EQ(got.grads[n].second.dtype(), DType::f32);
    // The gate rounds its f64 sums once into the f32 target; the others are f64 results rounded.
    EXPECT_TRUE(same_bytes(got.grads[n].second, ref.grads[n].second.to(DType::f32)));
  }
}

// A routing override replaces the router: the output is the experts' loop over the given indices and
// weights (padding masked), the load counts them, there is no aux loss and no gate gradient, and the
// gate weights need not be given.
TEST(MoECompute, RoutingOverrideIsHonoured) {
  Case c = cases()[3];  // shared experts, biases, padding
  c.cfg.aux_loss_coeff = 0.1;
  Owners owners(1, c.cfg, DType::f64);
  MoELayer& L = *owners.layers[0];
  const Inputs in = inputs(1, c, DType::f64);
  const std::int64_t T = in.x[0].size(0), k = c.cfg.n_activated_experts;
  std::vector<std::int64_t> idx(static_cast<std::size_t>(T * k));
  std::vector<float> wts(idx.size());
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t j = 0; j < k; ++j) {
      const auto i = static_cast<std::size_t>(t * k + j);
      idx[i] = (t == 1 && j == 1) ? -1 : (3 * t + 5 * j) % c.cfg.n_routed_experts;  // one empty slot
      wts[i] = 0.25f + 0.5f * static_cast<float>(j) + 0.01f * static_cast<float>(t);
    }
  const Tensor indices = Tensor::from_vector(idx, {T, k}), weights = Tensor::from_vector(wts, {T, k});

  HeldWeights h = owner_weights(L);
  h.w.gate = {};  // not read with an override
  Computes cs(1, c.cfg);
  const MoEOutput out = cs.layers[0]->forward(h.w, in.x[0], in.pad[0], true, {indices, weights});
  EXPECT_FALSE(out.aux_loss.has_value());

  // Reference: Automodel's expert loop over the given routing on unmasked tokens, plus the shared MLP.
  Tensor mask = Tensor::empty({T}, DType::b8);
  for (std::int64_t t = 0; t < T; ++t) mask.data<bool>()[t] = !in.pad[0].data<bool>()[t];
  Tensor want = L.experts().forward_loop(in.x[0], mask, weights.to(DType::f64), indices);
  const Tensor shared = L.shared_experts()->forward(in.x[0]).out;
  for (std::int64_t i = 0; i < want.numel(); ++i) want.data<double>()[i] += shared.data<double>()[i];
  double worst = 0, scale = 0;
  for (std::int64_t i = 0; i < want.numel(); ++i) {
    worst = std::max(worst, std::abs(out.out.data<double>()[i] - want.data<double>()[i]));
    scale = std::max(scale, std::abs(want.data<double>()[i]));
  }
  EXPECT_LE(worst, 1e-12 * scale);
  EXPECT_GT(scale, 0);

  std::vector<std::int64_t> load(static_cast<std::size_t>(c.cfg.n_routed_experts), 0);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t j = 0; j < k; ++j)
      if (const std::int64_t e = idx[static_cast<std::size_t>(t * k + j)]; mask.data<bool>()[t] && e >= 0)
        ++load[static_cast<std::size_t>(e)];
  for (int e = 0; e < c.cfg.n_routed_experts; ++e)
    EXPECT_EQ(out.expert_load.data<std::int64_t>()[e], load[static_cast<std::size_t>(e)]) << e;

  const MoEBackward b = cs.layers[0]->backward(h.w, *out.saved, in.grad[0]);
  EXPECT_FALSE(b.gradients.gate.weight.defined());
  EXPECT_FALSE(b.gradients.gate.bias.defined());
  EXPECT_TRUE(b.gradients.experts.gate_and_up_projs.defined());
  EXPECT_TRUE(b.gradients.shared_experts.down_projs.defined());
  // Without the router the token gradient is the experts' and the shared MLP's alone: the owner's
  // backward minus its gate's contribution would differ, so compare with a run of the same override
  // where the gate weights are given (they are still not read).
  HeldWeights with_gate = owner_weights(L);
  Computes cs2(1, c.cfg);
  const MoEOutput out2 = cs2.layers[0]->forward(with_gate.w, in.x[0], in.pad[0], true, {indices, weights});
  const MoEBackward b2 = cs2.layers[0]->backward(with_gate.w, *out2.saved, in.grad[0]);
  EXPECT_TRUE(same_bytes(out2.out, out.out));
  EXPECT_TRUE(same_bytes(b2.grad_x, b.grad_x));
  EXPECT_FALSE(b2.gradients.gate.weight.defined());
}

// backend.dispatch_chunks: the routed path cut into chunks of rows, each through its own
// dispatcher (siblings of the given one; a rank of 4 tokens in 5 chunks has empty ones). Every
// row's output, grad x, the aux loss and the loads are bitwise one chunk's; the gradients too,
// but for the experts' weight gradients, which add up chunk by chunk (a different summation order).
TEST(MoECompute, ChunksGiveTheSameRowsAsOneChunk) {
  for (const Case& c : cases())
    for (DispatchLayout layout : {DispatchLayout::expert_major, DispatchLayout::rank_major})
      for (int R : {1, 2})
        for (int chunks : {2, 5}) {
          SCOPED_TRACE(c.name + (layout == DispatchLayout::rank_major ? " rank-major" : "") + " R=" +
                       std::to_string(R) + " chunks=" + std::to_string(chunks));
          Owners owners(R, c.cfg, DType::f64);
          std::vector<HeldWeights> held;
          for (auto& L : owners.layers) held.push_back(owner_weights(*L));
          const Inputs in = inputs(R, c, DType::f64);
          DispatchOptions o;
          o.layout = layout;
          auto run = [&](int n) {
            BackendConfig b;
            b.dispatch_chunks = n;
            Computes cs(R, c.cfg, b, o);
            return run_computes(cs, views_of(held), views_of(held), in, c.aux_scale);
          };
          const std::vector<Result> want = run(1), got = run(chunks);
          ASSERT_EQ(got.size(), want.size());
          for (std::size_t r = 0; r < got.size(); ++r) {
            SCOPED_TRACE("rank " + std::to_string(r));
            EXPECT_TRUE(same_bytes(got[r].fwd.out, want[r].fwd.out));
            EXPECT_EQ(got[r].fwd.aux_loss, want[r].fwd.aux_loss);
            EXPECT_TRUE(same_bytes(got[r].fwd.expert_load, want[r].fwd.expert_load));
            EXPECT_TRUE(same_bytes(got[r].grad_x, want[r].grad_x));
            std::map<std::string, Tensor> w(want[r].grads.begin(), want[r].grads.end());
            ASSERT_EQ(got[r].grads.size(), want[r].grads.size());
            for (const auto& [name, g] : got[r].grads) {
              SCOPED_TRACE(name);
              ASSERT_TRUE(w.count(name));
              if (name.rfind("experts.", 0) != 0) {
                EXPECT_TRUE(same_bytes(g, w[name]));
                continue;
              }
              ASSERT_EQ(g.numel(), w[name].numel());
              double num = 0, den = 0;
              for (std::int64_t j = 0; j < g.numel(); ++j) {
                const double d = g.data<double>()[j] - w[name].data<double>()[j];
                num += d * d;
                den += w[name].data<double>()[j] * w[name].data<double>()[j];
              }
              EXPECT_GT(den, 0.0);
              EXPECT_LE(std::sqrt(num), 1e-13 * std::sqrt(den));
            }
          }
        }
}

TEST(MoECompute, DispatchChunksOutOfRangeAreNamed) {
  for (int n : {0, -1, 17}) {
    BackendConfig b;
    b.dispatch_chunks = n;
    try {
      MoECompute m(small_config(), b, nullptr);
      ADD_FAILURE() << "dispatch_chunks=" << n << " was accepted";
    } catch (const ArgumentError& e) {
      EXPECT_EQ(e.argument(), "backend.dispatch_chunks") << e.what();
      EXPECT_NE(std::string(e.what()).find(std::to_string(n)), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("16"), std::string::npos) << e.what();
    }
  }
}
