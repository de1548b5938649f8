// Routing replay on the CPU gate (Automodel's replay_selection): the forced indices replace the
// top-k, the weights are gathered at them from the scores the gate computes now (the softmax of the
// replayed logits for plain softmax), and gradients flow through the recomputed scores. Checked
// against formulas written here in fp64 and central finite differences.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "flexep/core/random.h"
#include "flexep/layer/gate.h"

using namespace flexep;

namespace {

constexpr int kE = 8, kK = 3, kD = 5;
constexpr std::int64_t kT = 6;

MoEConfig config(ScoreFunc f) {
  MoEConfig c;
  c.n_routed_experts = kE;
  c.n_activated_experts = kK;
  c.dim = kD;
  c.score_func = f;
  c.enable_routing_replay = true;
  return c;
}

Tensor randn(Shape shape, std::uint64_t seed) {
  Tensor t = Tensor::empty(shape, DType::f64);
  fill_normal(t, seed, stream_id("replay.input"), 0.0, 1.0);
  return t;
}

// Experts the top-k would not pick: the three lowest-indexed of a token-dependent rotation, in an
// order that is not by score.
Tensor forced_indices() {
  std::vector<std::int64_t> v;
  for (std::int64_t t = 0; t < kT; ++t)
    for (int j = 0; j < kK; ++j) v.push_back((t + 3 * j + 1) % kE);
  return Tensor::from_vector(v, {kT, kK});
}

double logit(Gate& g, const Tensor& x, std::int64_t t, int e) {
  double z = 0;
  for (int d = 0; d < kD; ++d) z += x.data<double>()[t * kD + d] * g.weight().value.data<double>()[e * kD + d];
  return z;
}

std::string argument_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ArgumentError& e) {
    return e.argument();
  }
  return "(no error)";
}

}  // namespace

TEST(GateReplay, ForcedIndicesReplaceTheSelectionAndWeightsAreGatheredThere) {
  struct Row {
    ScoreFunc f;
    bool before, norm, biased;
  };
  for (const Row& r :
       {Row{ScoreFunc::softmax, false, false, false}, Row{ScoreFunc::softmax, true, true, false},
        Row{ScoreFunc::softmax_with_bias, false, true, false}, Row{ScoreFunc::sigmoid, false, true, true},
        Row{ScoreFunc::sigmoid_with_bias, false, false, false}, Row{ScoreFunc::sqrtsoftplus, false, true, false}}) {
    SCOPED_TRACE(std::string(to_string(r.f)) + (r.before ? " before_topk" : "") + (r.biased ? " biased" : ""));
    MoEConfig c = config(r.f);
    c.softmax_before_topk = r.before;
    c.norm_topk_prob = r.norm;
    c.route_scale = 1.5;
    c.force_e_score_correction_bias = r.f != ScoreFunc::softmax;
    c.router_weight_uses_score_correction_bias = r.biased;
    Gate g(c, std::nullopt, DType::f64);
    g.init(1, 0.8);
    std::vector<double> cb(kE, 0.0);
    if (c.force_e_score_correction_bias)
      for (int e = 0; e < kE; ++e) {
        g.e_score_correction_bias().data<float>()[e] = static_cast<float>(0.05 * (e - 3));
        cb[e] = g.e_score_correction_bias().data<float>()[e];  // the fp32 buffer's value
      }
    const Tensor x = randn({kT, kD}, 2), forced = forced_indices();
    const GateOutput out = g.forward(x, {}, true, forced);
    for (std::int64_t i = 0; i < kT * kK; ++i)
      ASSERT_EQ(out.indices.data<std::int64_t>()[i], forced.data<std::int64_t>()[i]);
    for (std::int64_t t = 0; t < kT; ++t) {
      std::vector<double> z(kE), p(kE);
      for (int e = 0; e < kE; ++e) z[e] = logit(g, x, t, e);
      double zmax = z[0], sum = 0;
      for (double v : z) zmax = std::max(zmax, v);
      for (int e = 0; e < kE; ++e) sum += std::exp(z[e] - zmax);
      for (int e = 0; e < kE; ++e) {
        if (r.f == ScoreFunc::sigmoid || r.f == ScoreFunc::sigmoid_with_bias) p[e] = 1 / (1 + std::exp(-z[e]));
        else if (r.f == ScoreFunc::sqrtsoftplus) p[e] = std::sqrt(std::log1p(std::exp(z[e])));
        else p[e] = std::exp(z[e] - zmax) / sum;
        if (r.biased) p[e] += cb[e];
      }
      std::vector<double> w(kK);
      for (int j = 0; j < kK; ++j) {
        const int e = static_cast<int>(forced.data<std::int64_t>()[t * kK + j]);
        w[j] = r.f == ScoreFunc::softmax && !r.before ? z[e] : p[e];
      }
      if (r.f == ScoreFunc::softmax && !r.before) {  // softmax over the replayed logits
        double m = w[0], s = 0;
        for (double v : w) m = std::max(m, v);
        for (double& v : w) s += (v = std::exp(v - m));
        for (double& v : w) v /= s;
      }
      double denom = 1;
      if (r.norm) denom = w[0] + w[1] + w[2] + 1e-20;
      for (int j = 0; j < kK; ++j)
        EXPECT_NEAR(out.weights.data<double>()[t * kK + j], 1.5 * w[j] / denom, 1e-13) << t << "," << j;
    }
    // The load counts the replayed experts.
    std::vector<std::int64_t> load(kE, 0);
    for (std::int64_t i = 0; i < kT * kK; ++i) ++load[static_cast<std::size_t>(forced.data<std::int64_t>()[i])];
    EXPECT_EQ(out.expert_load, load);
    // Replaying the gate's own selection changes nothing.
    const GateOutput own = g.forward(x, {}, false);
    const GateOutput again = g.forward(x, {}, false, own.indices);
    for (std::int64_t i = 0; i < kT * kK; ++i) {
      EXPECT_EQ(again.indices.data<std::int64_t>()[i], own.indices.data<std::int64_t>()[i]);
      EXPECT_EQ(again.weights.data<double>()[i], own.weights.data<double>()[i]);
    }
  }
}

TEST(GateReplay, GradientsFlowThroughTheRecomputedScores) {
  for (ScoreFunc f : {ScoreFunc::softmax, ScoreFunc::sigmoid, ScoreFunc::sqrtsoftplus}) {
    SCOPED_TRACE(std::string(to_string(f)));
    MoEConfig c = config(f);
    c.norm_topk_prob = f != ScoreFunc::softmax;
    c.aux_loss_coeff = 0.1;
    c.router_bias = true;
    Gate g(c, std::nullopt, DType::f64);
    g.init(3, 0.8);
    fill_normal(g.bias().value, 4, stream_id("replay.bias"), 0.0, 0.3);
    Tensor x = randn({kT, kD}, 5);
    const Tensor forced = forced_indices(), R = randn({kT, kK}, 6);
    auto objective = [&] {
      const GateOutput o = g.forward(x, {}, true, forced);
      double j = *o.aux_loss * c.aux_loss_coeff;
      for (std::int64_t i = 0; i < kT * kK; ++i) j += o.weights.data<double>()[i] * R.data<double>()[i];
      return j;
    };
    const Tensor gx = g.backward(g.forward(x, {}, true, forced), R);
    auto check = [&](double* v, double analytic, const std::string& what) {
      const double keep = *v, h = 1e-6;
      *v = keep + h;
      const double plus = objective();
      *v = keep - h;
      const double minus = objective();
      *v = keep;
      const double fd = (plus - minus) / (2 * h);
      EXPECT_NEAR(analytic, fd, 1e-8 + 1e-6 * std::abs(fd)) << what;
    };
    for (std::int64_t i = 0; i < x.numel(); ++i) check(x.data<double>() + i, gx.data<double>()[i], "x");
    for (std::int64_t i = 0; i < g.weight().value.numel(); ++i)
      check(g.weight().value.data<double>() + i, g.weight().grad.data<double>()[i], "W");
    for (std::int64_t i = 0; i < kE; ++i) check(g.bias().value.data<double>() + i, g.bias().grad.data<double>()[i], "b");
  }
}

TEST(GateReplay, RejectsBadReplayIndices) {
  MoEConfig c = config(ScoreFunc::sigmoid);
  Gate g(c, std::nullopt, DType::f64);
  const Tensor x = randn({kT, kD}, 7);
  EXPECT_EQ(argument_of([&] { g.forward(x, {}, false, forced_indices()); }), "(no error)");
  EXPECT_EQ(argument_of([&] { g.forward(x, {}, false, Tensor::zeros({kT, kK + 1}, DType::i64)); }), "replay_indices");
  EXPECT_EQ(argument_of([&] { g.forward(x, {}, false, Tensor::zeros({kT, kK}, DType::f32)); }), "replay_indices");
  Tensor bad = forced_indices();
  bad.data<std::int64_t>()[4] = kE;  // out of range
  EXPECT_EQ(argument_of([&] { g.forward(x, {}, false, bad); }), "replay_indices");
  bad = forced_indices();
  bad.data<std::int64_t>()[4] = -1;
  EXPECT_EQ(argument_of([&] { g.forward(x, {}, false, bad); }), "replay_indices");
  bad = forced_indices();
  bad.data<std::int64_t>()[5] = bad.data<std::int64_t>()[3];  // token 1 twice the same expert
  EXPECT_EQ(argument_of([&] { g.forward(x, {}, false, bad); }), "replay_indices");
  // int32 works as well.
  const Tensor forced32 = forced_indices().to(DType::i32);
  const GateOutput a = g.forward(x, {}, false, forced32), b = g.forward(x, {}, false, forced_indices());
  for (std::int64_t i = 0; i < kT * kK; ++i) EXPECT_EQ(a.weights.data<double>()[i], b.weights.data<double>()[i]);
  // Without enable_routing_replay the gate takes no forced selection (Automodel builds no replay).
  c.enable_routing_replay = false;
  Gate off(c, std::nullopt, DType::f64);
  EXPECT_EQ(argument_of([&] { off.forward(x, {}, false, forced_indices()); }), "replay_indices");
}
