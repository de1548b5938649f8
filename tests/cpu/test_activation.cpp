// The scalar expert activations of activation.h against formulas written out here, and their
// backward against central finite differences (fp64, away from the relu and clamp kinks).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "flexep/core/activation.h"

using namespace flexep;

namespace {

double sig(double x) { return 1.0 / (1.0 + std::exp(-x)); }

std::vector<double> random_row(std::size_t n, unsigned seed, double scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, scale);
  std::vector<double> v(n);
  for (double& x : v) x = nd(rng);
  return v;
}

ActivationParams params(Activation kind, double limit = 7.0) {
  ActivationParams p;
  p.kind = kind;
  p.limit = limit;
  return p;
}

// sum_i w_i * act(h)_i, the scalar whose gradient the backward is checked against.
double weighted_sum(const std::vector<double>& h, const std::vector<double>& w, int inter, const ActivationParams& p) {
  std::vector<double> a(static_cast<std::size_t>(inter));
  activation_forward(h.data(), a.data(), inter, p);
  double s = 0;
  for (int i = 0; i < inter; ++i) s += w[static_cast<std::size_t>(i)] * a[static_cast<std::size_t>(i)];
  return s;
}

void expect_backward_matches_fd(const std::vector<double>& h, int inter, const ActivationParams& p) {
  const std::vector<double> w = random_row(static_cast<std::size_t>(inter), 99, 1.0);
  std::vector<double> grad(h.size());
  activation_backward(h.data(), w.data(), grad.data(), inter, p);
  const double eps = 1e-6;
  for (std::size_t c = 0; c < h.size(); ++c) {
    std::vector<double> hp = h, hm = h;
    hp[c] += eps;
    hm[c] -= eps;
    const double fd = (weighted_sum(hp, w, inter, p) - weighted_sum(hm, w, inter, p)) / (2 * eps);
    EXPECT_NEAR(grad[c], fd, 1e-8 + 1e-6 * std::abs(fd)) << "column " << c << " (h = " << h[c] << ")";
  }
}

}  // namespace

TEST(Activation, SwigluForwardUsesGateAndUpHalves) {
  const int inter = 7;
  const std::vector<double> h = random_row(2 * inter, 1, 2.0);
  std::vector<double> a(inter);
  activation_forward(h.data(), a.data(), inter, params(Activation::swiglu));
  for (int i = 0; i < inter; ++i) {
    const double g = h[static_cast<std::size_t>(i)], u = h[static_cast<std::size_t>(inter + i)];
    EXPECT_NEAR(a[static_cast<std::size_t>(i)], g / (1.0 + std::exp(-g)) * u, 1e-15) << i;
  }
}

TEST(Activation, QuickGegluForwardIsInterleavedAndClamped) {
  // Gate = even columns, up = odd columns. Values chosen on both sides of the limit 7: the gate is
  // clamped from above only, the up value to [-7, 7].
  const std::vector<double> h = {0.5, -1.25, 9.0, 2.0, -12.0, 0.75, 3.0, 8.5, 1.5, -30.0, 7.0, -7.0};
  const int inter = 6;
  std::vector<double> a(inter);
  activation_forward(h.data(), a.data(), inter, params(Activation::quick_geglu));
  const double al = 1.702;
  const double expected[6] = {
      0.5 * sig(al * 0.5) * (-1.25 + 1),     // no clamp
      7.0 * sig(al * 7.0) * (2.0 + 1),       // gate 9 -> 7
      -12.0 * sig(al * -12.0) * (0.75 + 1),  // gate has no lower clamp
      3.0 * sig(al * 3.0) * (7.0 + 1),       // up 8.5 -> 7
      1.5 * sig(al * 1.5) * (-7.0 + 1),      // up -30 -> -7
      7.0 * sig(al * 7.0) * (-7.0 + 1),      // exactly at the limits
  };
  for (int i = 0; i < inter; ++i) EXPECT_NEAR(a[static_cast<std::size_t>(i)], expected[i], 1e-14) << i;
}

TEST(Activation, QuickGegluHonoursAlphaAndLimit) {
  ActivationParams p = params(Activation::quick_geglu, 1.0);
  p.alpha = 0.5;
  const std::vector<double> h = {2.0, 3.0, 0.3, -0.2};
  std::vector<double> a(2);
  activation_forward(h.data(), a.data(), 2, p);
  EXPECT_NEAR(a[0], 1.0 * sig(0.5 * 1.0) * (1.0 + 1), 1e-15);
  EXPECT_NEAR(a[1], 0.3 * sig(0.5 * 0.3) * (-0.2 + 1), 1e-15);
}

TEST(Activation, Relu2Forward) {
  const std::vector<double> h = {-2.0, -0.0, 0.0, 0.5, 3.0};
  std::vector<double> a(h.size());
  activation_forward(h.data(), a.data(), 5, params(Activation::relu2));
  const double expected[5] = {0.0, 0.0, 0.0, 0.25, 9.0};
  for (int i = 0; i < 5; ++i) EXPECT_EQ(a[static_cast<std::size_t>(i)], expected[i]) << i;
}

TEST(Activation, FloatAgreesWithDouble) {
  for (Activation kind : {Activation::swiglu, Activation::quick_geglu, Activation::relu2}) {
    const int inter = 16;
    const std::vector<double> h = random_row(2 * inter, 5, 4.0);
    std::vector<float> hf(h.begin(), h.end());
    std::vector<double> a(inter);
    std::vector<float> af(inter);
    activation_forward(h.data(), a.data(), inter, params(kind));
    activation_forward(hf.data(), af.data(), inter, params(kind));
    for (int i = 0; i < inter; ++i)
      EXPECT_NEAR(af[static_cast<std::size_t>(i)], a[static_cast<std::size_t>(i)],
                  1e-5 * (1 + std::abs(a[static_cast<std::size_t>(i)])))
          << to_string(kind) << " " << i;
  }
}

TEST(Activation, SwigluBackwardMatchesFiniteDifferences) {
  expect_backward_matches_fd(random_row(2 * 9, 2, 2.0), 9, params(Activation::swiglu));
}

TEST(Activation, QuickGegluBackwardMatchesFiniteDifferences) {
  // Limit 1.5 so that several inputs sit beyond it (zero gradient there); none lies within 1e-3 of
  // a kink, where the finite difference would straddle it.
  const std::vector<double> h = {0.3, -0.7, 2.4, 1.1, -3.0, 1.9, 1.2, -2.2, -0.4, 0.9, 4.0, -1.0, 0.05, 1.7};
  const ActivationParams p = params(Activation::quick_geglu, 1.5);
  for (double v : h) ASSERT_GT(std::abs(std::abs(v) - p.limit), 1e-3);
  expect_backward_matches_fd(h, 7, p);
}

TEST(Activation, QuickGegluClampedInputsHaveZeroGradient) {
  const std::vector<double> h = {9.0, 0.5, 0.5, 9.0, 0.5, -9.0, 7.0, 7.0};
  const std::vector<double> ga = {1.0, 1.0, 1.0, 1.0};
  std::vector<double> g(h.size());
  activation_backward(h.data(), ga.data(), g.data(), 4, params(Activation::quick_geglu));
  EXPECT_EQ(g[0], 0.0);  // gate above the limit
  EXPECT_NE(g[1], 0.0);
  EXPECT_NE(g[2], 0.0);
  EXPECT_EQ(g[3], 0.0);  // up above the limit
  EXPECT_EQ(g[5], 0.0);  // up below -limit
  // At the limit the gradient passes (torch.clamp's convention, boundaries included).
  EXPECT_NEAR(g[6], 1.0 * (7.0 + 1) * (sig(1.702 * 7) + 1.702 * 7 * sig(1.702 * 7) * (1 - sig(1.702 * 7))), 1e-12);
  EXPECT_NEAR(g[7], 7.0 * sig(1.702 * 7), 1e-12);
}

TEST(Activation, Relu2BackwardMatchesFiniteDifferences) {
  std::vector<double> h = random_row(11, 3, 1.0);
  for (double& v : h)
    if (std::abs(v) < 1e-3) v = 0.5;
  expect_backward_matches_fd(h, 11, params(Activation::relu2));
}

TEST(Activation, IsGated) {
  EXPECT_TRUE(is_gated(Activation::swiglu));
  EXPECT_TRUE(is_gated(Activation::swigluoai));
  EXPECT_TRUE(is_gated(Activation::quick_geglu));
  EXPECT_TRUE(is_gated(Activation::geglu));
  EXPECT_FALSE(is_gated(Activation::relu2));
}

namespace {
double silu(double x) { return x * sig(x); }
// torch's gelu(approximate="tanh"), written out.
double gelu_tanh(double x) { return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x))); }
ActivationParams clamped_swiglu(double limit) {
  ActivationParams p = params(Activation::swiglu);
  p.swiglu_limit = limit;
  return p;
}
}  // namespace

TEST(Activation, SwigluLimitClampsGateFromAboveAndUpBothWays) {
  // limit 2: gate clamped <= 2 only, up to [-2, 2]; the second half of h is up.
  const std::vector<double> h = {0.5, 3.0, -5.0, 2.0, 1.5, /* up */ -1.25, 0.75, 4.0, -3.0, 2.0};
  std::vector<double> a(5);
  activation_forward(h.data(), a.data(), 5, clamped_swiglu(2.0));
  const double expected[5] = {silu(0.5) * -1.25, silu(2.0) * 0.75, silu(-5.0) * 2.0, silu(2.0) * -2.0,
                              silu(1.5) * 2.0};
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(a[static_cast<std::size_t>(i)], expected[i], 1e-15) << i;
  // swiglu_limit 0 is the unclamped swiglu; activation_limit does not act on swiglu.
  ActivationParams plain = params(Activation::swiglu, 0.1);
  activation_forward(h.data(), a.data(), 5, plain);
  for (int i = 0; i < 5; ++i)
    EXPECT_NEAR(a[static_cast<std::size_t>(i)],
                silu(h[static_cast<std::size_t>(i)]) * h[static_cast<std::size_t>(5 + i)], 1e-15);
}

TEST(Activation, SwigluLimitBackwardMatchesFiniteDifferencesAndZeroBeyond) {
  const std::vector<double> h = {0.3, 2.6, -4.0, 1.2, -0.9, /* up */ 0.7, -3.1, 2.9, -1.4, 0.2};
  const ActivationParams p = clamped_swiglu(2.0);
  for (double v : h) ASSERT_GT(std::abs(std::abs(v) - 2.0), 1e-3);
  expect_backward_matches_fd(h, 5, p);
  const std::vector<double> ga(5, 1.0);
  std::vector<double> g(10);
  activation_backward(h.data(), ga.data(), g.data(), 5, p);
  EXPECT_EQ(g[1], 0.0);  // gate 2.6 > 2
  EXPECT_NE(g[2], 0.0);  // gate -4: no lower clamp
  EXPECT_EQ(g[6], 0.0);  // up -3.1 < -2
  EXPECT_EQ(g[7], 0.0);  // up 2.9 > 2
  // At the limits the gradient passes (torch.clamp includes the boundaries).
  const std::vector<double> edge = {2.0, 0.5, /* up */ 1.0, -2.0};
  std::vector<double> ge(4);
  activation_backward(edge.data(), ga.data(), ge.data(), 2, p);
  const double s2 = sig(2.0);
  EXPECT_NEAR(ge[0], 1.0 * (s2 + 2.0 * s2 * (1 - s2)), 1e-14);
  EXPECT_NEAR(ge[3], silu(0.5), 1e-14);
}

TEST(Activation, SwigluOaiUsesHalvesAlphaAndClamps) {
  ActivationParams p = params(Activation::swigluoai, 7.0);
  p.alpha = 1.702;
  // Concatenated [gate | up] (unlike quick_geglu's interleaving), gate <= 7, up in [-7, 7].
  const std::vector<double> h = {0.5, 9.0, -12.0, 3.0, /* up */ -1.25, 2.0, 0.75, 8.5};
  std::vector<double> a(4);
  activation_forward(h.data(), a.data(), 4, p);
  const double al = 1.702;
  const double expected[4] = {0.5 * sig(al * 0.5) * (-1.25 + 1), 7.0 * sig(al * 7.0) * (2.0 + 1),
                              -12.0 * sig(al * -12.0) * (0.75 + 1), 3.0 * sig(al * 3.0) * (7.0 + 1)};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(a[static_cast<std::size_t>(i)], expected[i], 1e-14) << i;
  // limit <= 0: no clamp at all (Automodel clamps only when limit > 0).
  p.limit = 0.0;
  activation_forward(h.data(), a.data(), 4, p);
  EXPECT_NEAR(a[1], 9.0 * sig(al * 9.0) * 3.0, 1e-12);
  EXPECT_NEAR(a[3], 3.0 * sig(al * 3.0) * 9.5, 1e-12);
}

TEST(Activation, SwigluOaiBackwardMatchesFiniteDifferences) {
  const std::vector<double> h = {0.3, -0.7, 2.4, 1.1, -3.0, 1.9, 1.2, -2.2, -0.4, 0.9, 4.0, -0.6, 0.05, 1.7};
  ActivationParams p = params(Activation::swigluoai, 1.5);
  p.alpha = 1.3;
  for (double v : h) ASSERT_GT(std::abs(std::abs(v) - 1.5), 1e-3);
  expect_backward_matches_fd(h, 7, p);
  p.limit = -1;  // unclamped
  expect_backward_matches_fd(h, 7, p);
  p.limit = 1.5;
  const std::vector<double> ga(7, 1.0);
  std::vector<double> g(14);
  activation_backward(h.data(), ga.data(), g.data(), 7, p);
  EXPECT_EQ(g[2], 0.0);  // gate 2.4 > 1.5
  EXPECT_NE(g[4], 0.0);  // gate -3: no lower clamp
  EXPECT_EQ(g[7 + 0], 0.0);  // up -2.2 < -1.5
  EXPECT_EQ(g[7 + 3], 0.0);  // up 4.0 > 1.5
}

TEST(Activation, GegluIsTanhGeluTimesUp) {
  const std::vector<double> h = {-3.0, -0.5, 0.0, 0.8, 2.5, /* up */ 1.5, -2.0, 3.0, 0.25, -1.0};
  std::vector<double> a(5);
  activation_forward(h.data(), a.data(), 5, params(Activation::geglu));
  for (int i = 0; i < 5; ++i)
    EXPECT_NEAR(a[static_cast<std::size_t>(i)],
                gelu_tanh(h[static_cast<std::size_t>(i)]) * h[static_cast<std::size_t>(5 + i)], 1e-15)
        << i;
  // The tanh approximation differs from the exact erf gelu (by ~1e-4 near 1): it really is the tanh one.
  const double exact = 0.5 * 0.8 * (1 + std::erf(0.8 / std::sqrt(2.0)));
  EXPECT_GT(std::abs(gelu_tanh(0.8) - exact), 1e-5);
}

TEST(Activation, GegluBackwardMatchesFiniteDifferences) {
  expect_backward_matches_fd(random_row(2 * 9, 4, 2.0), 9, params(Activation::geglu));
}

TEST(Activation, NewActivationsFloatAgreeWithDouble) {
  for (const ActivationParams& p : {params(Activation::swigluoai), params(Activation::geglu), clamped_swiglu(3.0)}) {
    const int inter = 16;
    const std::vector<double> h = random_row(2 * inter, 6, 4.0);
    std::vector<float> hf(h.begin(), h.end());
    std::vector<double> a(inter);
    std::vector<float> af(inter);
    activation_forward(h.data(), a.data(), inter, p);
    activation_forward(hf.data(), af.data(), inter, p);
    for (int i = 0; i < inter; ++i)
      EXPECT_NEAR(af[static_cast<std::size_t>(i)], a[static_cast<std::size_t>(i)],
                  1e-5 * (1 + std::abs(a[static_cast<std::size_t>(i)])))
          << to_string(p.kind) << " " << i;
  }
}

TEST(Activation, ParamsFromConfig) {
  MoEConfig c;
  c.activation_alpha = 1.25;
  c.activation_limit = 3.5;
  c.swiglu_limit = 9.0;
  const ActivationParams p = activation_params(c, Activation::swigluoai);
  EXPECT_EQ(p.kind, Activation::swigluoai);
  EXPECT_EQ(p.alpha, 1.25);
  EXPECT_EQ(p.limit, 3.5);
  EXPECT_EQ(p.swiglu_limit, 9.0);
}
