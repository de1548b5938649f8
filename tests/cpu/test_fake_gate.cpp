// FakeBalancedGate: Automodel's benchmark router (balanced cyclic routing, or content-seeded noise).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "flexep/core/random.h"
#include "flexep/layer/gate.h"

using namespace flexep;

namespace {

MoEConfig fake_config(int experts = 8, int topk = 2) {
  MoEConfig c;
  c.n_routed_experts = experts;
  c.n_activated_experts = topk;
  c.dim = 16;
  return c;
}

Tensor input(std::int64_t tokens, DType dtype, std::uint64_t seed) {
  Tensor t = Tensor::empty({tokens, 16}, dtype);
  fill_normal(t, seed, stream_id("test.fake_gate.x"), 0.0, 1.0);
  return t;
}

std::vector<std::int64_t> indices_of(const GateOutput& out) {
  const std::int64_t* p = out.indices.data<std::int64_t>();
  return std::vector<std::int64_t>(p, p + out.indices.numel());
}

std::vector<double> weights_of(const GateOutput& out) {
  std::vector<double> w(static_cast<std::size_t>(out.weights.numel()));
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = read_as_double(out.weights, static_cast<std::int64_t>(i));
  return w;
}

std::vector<std::int64_t> count(const std::vector<std::int64_t>& idx, int experts) {
  std::vector<std::int64_t> c(static_cast<std::size_t>(experts), 0);
  for (std::int64_t e : idx) ++c[static_cast<std::size_t>(e)];
  return c;
}

}  // namespace

TEST(FakeBalancedGate, UniformWeightsAndCyclicIndices) {
  FakeBalancedGate g(fake_config(8, 2), 0.0);
  const GateOutput out = g.forward(input(16, DType::f32, 1), {});
  EXPECT_EQ(out.weights.shape(), Shape({16, 2}));
  EXPECT_EQ(out.indices.shape(), Shape({16, 2}));
  EXPECT_EQ(out.indices.dtype(), DType::i64);
  EXPECT_FALSE(out.aux_loss.has_value());
  EXPECT_EQ(out.saved, nullptr);
  for (double w : weights_of(out)) EXPECT_EQ(w, 0.5);
  const std::vector<std::int64_t> idx = indices_of(out);
  for (std::int64_t t = 0; t < 16; ++t)
    for (std::int64_t j = 0; j < 2; ++j) EXPECT_EQ(idx[t * 2 + j], (t * 2 + j) % 8);
  // 32 slots over 8 experts: exactly 4 each.
  EXPECT_EQ(out.expert_load, std::vector<std::int64_t>(8, 4));
}

TEST(FakeBalancedGate, SkipFirstExperts) {
  for (int skip : {1, 3, 6}) {
    FakeBalancedGate g(fake_config(8, 2), 0.0, skip);
    const GateOutput out = g.forward(input(1000, DType::f32, 2), {});
    const std::vector<std::int64_t> idx = indices_of(out);
    const int available = 8 - skip;
    for (std::int64_t t = 0; t < 1000; ++t)
      for (std::int64_t j = 0; j < 2; ++j) EXPECT_EQ(idx[t * 2 + j], (t * 2 + j) % available + skip);
    const std::vector<std::int64_t> c = count(idx, 8);
    for (int e = 0; e < skip; ++e) EXPECT_EQ(c[e], 0);
    // Balanced over the remaining experts: counts differ by at most one.
    const auto [lo, hi] = std::minmax_element(c.begin() + skip, c.end());
    EXPECT_LE(*hi - *lo, 1);
    EXPECT_GE(*lo, 2000 / available);
    for (double w : weights_of(out)) EXPECT_EQ(w, 0.5);
  }
}

TEST(FakeBalancedGate, WeightsDtypeFollowsInput) {
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    for (double noise : {0.0, 0.5}) {
      FakeBalancedGate g(fake_config(8, 4), noise);
      const GateOutput out = g.forward(input(8, dt, 3), {});
      EXPECT_EQ(out.weights.dtype(), dt);
      EXPECT_EQ(out.indices.dtype(), DType::i64);
    }
  }
}

TEST(FakeBalancedGate, ExpertLoadRespectsMask) {
  for (double noise : {0.0, 0.6}) {
    FakeBalancedGate g(fake_config(8, 2), noise);
    Tensor mask = Tensor::empty({10}, DType::b8);
    for (int t = 0; t < 10; ++t) mask.data<bool>()[t] = t % 3 != 0;
    const GateOutput out = g.forward(input(10, DType::f32, 4), mask);
    const std::vector<std::int64_t> idx = indices_of(out);
    std::vector<std::int64_t> expected(8, 0);
    for (int t = 0; t < 10; ++t)
      if (t % 3 != 0)
        for (int j = 0; j < 2; ++j) ++expected[static_cast<std::size_t>(idx[t * 2 + j])];
    EXPECT_EQ(out.expert_load, expected);
  }
}

TEST(FakeBalancedGate, NoiseKeepsIndicesValidUniqueAndWeightsPositive) {
  const int skip = 2;
  FakeBalancedGate g(fake_config(8, 3), 1.0, skip);
  const GateOutput out = g.forward(input(500, DType::bf16, 5), {});
  const std::vector<std::int64_t> idx = indices_of(out);
  const std::vector<double> w = weights_of(out);
  bool uniform = true;
  for (int t = 0; t < 500; ++t) {
    std::set<std::int64_t> row;
    double sum = 0;
    for (int j = 0; j < 3; ++j) {
      const std::int64_t e = idx[t * 3 + j];
      EXPECT_GE(e, skip);
      EXPECT_LT(e, 8);
      row.insert(e);
      EXPECT_GT(w[t * 3 + j], 0.0);
      sum += w[t * 3 + j];
      uniform &= std::abs(w[t * 3 + j] - 1.0 / 3) < 1e-3;
    }
    EXPECT_EQ(row.size(), 3u) << "token " << t << " repeats an expert";
    EXPECT_NEAR(sum, 1.0, 1e-2);  // bf16 weights
  }
  EXPECT_FALSE(uniform);
}

TEST(FakeBalancedGate, NoiseWeightsInterpolateUniformAndRandom) {
  // weight = (1 - noise) / k + noise * r, with r a positive random row normalised to sum 1.
  const double noise = 0.3;
  FakeBalancedGate g(fake_config(8, 4), noise);
  const GateOutput out = g.forward(input(64, DType::f64, 6), {});
  const std::vector<double> w = weights_of(out);
  for (int t = 0; t < 64; ++t) {
    double sum = 0;
    for (int j = 0; j < 4; ++j) {
      const double r = (w[t * 4 + j] - (1 - noise) / 4) / noise;
      EXPECT_GT(r, 0.0);
      EXPECT_LE(r, 1.0);
      sum += w[t * 4 + j];
    }
    EXPECT_NEAR(sum, 1.0, 1e-12);
  }
}

TEST(FakeBalancedGate, NoiseIsDeterministicForEqualInputAndVariesOtherwise) {
  FakeBalancedGate g(fake_config(8, 2), 0.7);
  const Tensor x = input(64, DType::f32, 7);
  const GateOutput a = g.forward(x, {});
  const GateOutput b = g.forward(x.clone(), {});
  EXPECT_EQ(indices_of(a), indices_of(b));
  EXPECT_EQ(weights_of(a), weights_of(b));
  FakeBalancedGate other(fake_config(8, 2), 0.7);  // a fresh instance routes the same x the same way
  EXPECT_EQ(indices_of(other.forward(x, {})), indices_of(a));

  const GateOutput c = g.forward(input(64, DType::f32, 8), {});
  EXPECT_NE(indices_of(a), indices_of(c));
  // Only the first four values seed the routing: changing the fifth leaves it unchanged, changing
  // the first changes it.
  Tensor y = x.clone();
  y.data<float>()[4] += 1.0f;
  EXPECT_EQ(indices_of(g.forward(y, {})), indices_of(a));
  y.data<float>()[0] += 1.0f;
  EXPECT_NE(indices_of(g.forward(y, {})), indices_of(a));
}

TEST(FakeBalancedGate, NoiseCreatesLoadImbalance) {
  FakeBalancedGate balanced(fake_config(8, 2), 0.0);
  FakeBalancedGate noisy(fake_config(8, 2), 0.5);
  const Tensor x = input(2000, DType::f32, 9);
  const std::vector<std::int64_t> even = balanced.forward(x, {}).expert_load;
  const std::vector<std::int64_t> load = noisy.forward(x, {}).expert_load;
  EXPECT_EQ(*std::min_element(even.begin(), even.end()), *std::max_element(even.begin(), even.end()));
  EXPECT_GT(*std::max_element(load.begin(), load.end()), *std::min_element(load.begin(), load.end()));
  std::int64_t total = 0;
  for (std::int64_t l : load) total += l;
  EXPECT_EQ(total, 4000);
}

TEST(FakeBalancedGate, RejectsInvalidArguments) {
  auto arg_of = [](double noise, int skip, int experts = 8, int topk = 2) {
    try {
      FakeBalancedGate g(fake_config(experts, topk), noise, skip);
    } catch (const ArgumentError& e) {
      return e.argument();
    }
    return std::string("(no error)");
  };
  EXPECT_EQ(arg_of(-0.1, 0), "noise");
  EXPECT_EQ(arg_of(1.5, 0), "(no error)");  // Automodel takes any noise level; only [0, 1] is documented
  EXPECT_EQ(arg_of(std::nan(""), 0), "noise");
  EXPECT_EQ(arg_of(INFINITY, 0), "noise");
  EXPECT_EQ(arg_of(1.0, 6), "(no error)");
  EXPECT_EQ(arg_of(0.0, 7), "skip_first_n_experts");  // one expert left for top-2
  EXPECT_EQ(arg_of(0.0, -1), "skip_first_n_experts");
  EXPECT_EQ(arg_of(0.0, 0, 8, 9), "moe.n_activated_experts");

  FakeBalancedGate g(fake_config(8, 2), 0.0);
  auto forward_arg = [&](const TensorView& x, const TensorView& mask) {
    try {
      g.forward(x, mask);
    } catch (const ArgumentError& e) {
      return e.argument();
    }
    return std::string("(no error)");
  };
  EXPECT_EQ(forward_arg(Tensor::zeros({4}, DType::f32), {}), "x");
  EXPECT_EQ(forward_arg(Tensor::zeros({4, 16}, DType::i64), {}), "x");
  EXPECT_EQ(forward_arg(input(4, DType::f32, 10), Tensor::zeros({5}, DType::b8)), "token_mask");
  EXPECT_EQ(forward_arg(input(0, DType::f32, 10), {}), "(no error)");
}
