// GroupedExperts (CPU reference) against an fp64 reference written here with plain loops, against
// Automodel's loop oracle (forward_loop), and against central finite differences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "flexep/core/random.h"
#include "flexep/layer/grouped_experts.h"

using namespace flexep;

namespace {

constexpr Activation kAllActivations[] = {Activation::swiglu, Activation::swigluoai, Activation::quick_geglu,
                                          Activation::geglu, Activation::relu2};

MoEConfig make_config(Activation act, bool bias, int experts = 4, int dim = 8, int inter = 6) {
  MoEConfig c;
  c.n_routed_experts = experts;
  c.n_activated_experts = 2;
  c.dim = dim;
  c.moe_inter_dim = inter;
  c.expert_activation = act;
  c.expert_bias = bias;
  c.activation_alpha = 1.702;
  c.activation_limit = 1.5;  // low, so that quick_geglu's clamps are exercised with unit-scale data
  return c;
}

void fill_random(const TensorView& t, unsigned seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, scale);
  for (std::int64_t i = 0; i < t.numel(); ++i) write_from_double(t, i, nd(rng));
}

// Weights N(0, 0.5) (larger than a training init so activations are well away from linear) and,
// with expert_bias, random non-zero biases.
void randomize(GroupedExperts& m, unsigned seed) {
  m.init(seed, 0.5);
  if (m.gate_up_proj_bias().value.defined()) fill_random(m.gate_up_proj_bias().value, seed + 1, 0.5);
  if (m.down_proj_bias().value.defined()) fill_random(m.down_proj_bias().value, seed + 2, 0.5);
}

std::vector<double> as_doubles(const TensorView& t) {
  std::vector<double> v(static_cast<std::size_t>(t.numel()));
  for (std::int64_t i = 0; i < t.numel(); ++i) v[static_cast<std::size_t>(i)] = read_as_double(t, i);
  return v;
}

double sig(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// The reference: fp64 copies of the parameters and the FFN of one row written out directly.
struct Reference {
  MoEConfig c;
  int up, inter, dim;
  std::vector<double> wgu, wd, bgu, bd;

  explicit Reference(GroupedExperts& m, const MoEConfig& cfg)
      : c(cfg), up(cfg.up_dim()), inter(cfg.moe_inter_dim), dim(cfg.dim) {
    wgu = as_doubles(m.gate_and_up_projs().value);
    wd = as_doubles(m.down_projs().value);
    if (cfg.expert_bias) {
      bgu = as_doubles(m.gate_up_proj_bias().value);
      bd = as_doubles(m.down_proj_bias().value);
    }
  }

  std::vector<double> pre_activation(int e, const double* x) const {
    std::vector<double> h(static_cast<std::size_t>(up));
    for (int col = 0; col < up; ++col) {
      double s = bgu.empty() ? 0.0 : bgu[static_cast<std::size_t>(e * up + col)];
      for (int k = 0; k < dim; ++k) s += x[k] * wgu[static_cast<std::size_t>((e * dim + k) * up + col)];
      h[static_cast<std::size_t>(col)] = s;
    }
    return h;
  }

  double act(const std::vector<double>& h, int i) const {
    const double L = c.activation_limit;
    switch (c.expert_activation) {
      case Activation::swiglu: {
        double g = h[static_cast<std::size_t>(i)], u = h[static_cast<std::size_t>(inter + i)];
        if (c.swiglu_limit > 0) g = std::min(g, c.swiglu_limit), u = std::clamp(u, -c.swiglu_limit, c.swiglu_limit);
        return g * sig(g) * u;
      }
      case Activation::swigluoai: {
        double g = h[static_cast<std::size_t>(i)], u = h[static_cast<std::size_t>(inter + i)];
        if (L > 0) g = std::min(g, L), u = std::clamp(u, -L, L);
        return g * sig(c.activation_alpha * g) * (u + 1.0);
      }
      case Activation::geglu: {
        const double g = h[static_cast<std::size_t>(i)], u = h[static_cast<std::size_t>(inter + i)];
        return 0.5 * g * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (g + 0.044715 * g * g * g))) * u;
      }
      case Activation::quick_geglu: {
        const double g = std::min(h[static_cast<std::size_t>(2 * i)], L);
        const double u = std::clamp(h[static_cast<std::size_t>(2 * i + 1)], -L, L);
        return g * sig(c.activation_alpha * g) * (u + 1.0);
      }
      case Activation::relu2: {
        const double r = std::max(h[static_cast<std::size_t>(i)], 0.0);
        return r * r;
      }
    }
    return 0.0;
  }

  // y = (act(x Wgu + bgu) * p) Wd + bd * p, or after the down projection (act(x Wgu + bgu) Wd + bd) * p
  std::vector<double> row(int e, const double* x, double p) const {
    const std::vector<double> h = pre_activation(e, x);
    std::vector<double> y(static_cast<std::size_t>(dim));
    const bool after = c.apply_router_weight_after_down;
    for (int j = 0; j < dim; ++j) {
      double s = 0;
      for (int i = 0; i < inter; ++i)
        s += act(h, i) * (after ? 1.0 : p) * wd[static_cast<std::size_t>((e * inter + i) * dim + j)];
      const double b = bd.empty() ? 0.0 : bd[static_cast<std::size_t>(e * dim + j)];
      y[static_cast<std::size_t>(j)] = after ? (s + b) * p : s + b * p;
    }
    return y;
  }

  // Distance of the pre-activation of this row to the nearest kink of the activation (relu at 0,
  // the clamps at +-limit); infinite for swiglu.
  double kink_distance(int e, const double* x) const {
    const std::vector<double> h = pre_activation(e, x);
    double d = 1e300;
    const double L = c.activation_limit;
    for (int col = 0; col < up; ++col) {
      const double v = h[static_cast<std::size_t>(col)];
      if (c.expert_activation == Activation::relu2) d = std::min(d, std::abs(v));
      if (c.expert_activation == Activation::quick_geglu)
        d = std::min(d, col % 2 == 0 ? std::abs(v - L) : std::abs(std::abs(v) - L));
      const double halves_limit = c.expert_activation == Activation::swigluoai ? L
                                  : c.expert_activation == Activation::swiglu  ? c.swiglu_limit
                                                                               : 0.0;
      if (halves_limit > 0)
        d = std::min(d, col < inter ? std::abs(v - halves_limit) : std::abs(std::abs(v) - halves_limit));
    }
    return d;
  }
};

template <class F>
std::string argument_of(F&& f) {
  try {
    f();
  } catch (const ArgumentError& e) {
    return e.argument();
  }
  return "<no ArgumentError>";
}

std::string label(Activation a, bool bias, DType t) {
  return std::string(to_string(a)) + (bias ? " +bias " : " no-bias ") + std::string(dtype_name(t));
}

}  // namespace

TEST(Experts, ParameterNamesAndShapes) {
  {
    GroupedExperts m(make_config(Activation::swiglu, false), 2, 0);
    const auto ps = m.parameters();
    ASSERT_EQ(ps.size(), 2u);
    EXPECT_EQ(ps[0]->name, "gate_and_up_projs");
    EXPECT_EQ(ps[1]->name, "down_projs");
    EXPECT_EQ(ps[0]->value.shape(), Shape({2, 8, 12}));
    EXPECT_EQ(ps[1]->value.shape(), Shape({2, 6, 8}));
    EXPECT_EQ(ps[0]->value.dtype(), DType::f32);
    EXPECT_FALSE(m.gate_up_proj_bias().value.defined());
    EXPECT_FALSE(m.down_proj_bias().value.defined());
  }
  {
    GroupedExperts m(make_config(Activation::quick_geglu, true), 3, 1, DType::f64);
    const auto ps = m.parameters();
    ASSERT_EQ(ps.size(), 4u);
    EXPECT_EQ(ps[2]->name, "gate_up_proj_bias");
    EXPECT_EQ(ps[3]->name, "down_proj_bias");
    EXPECT_EQ(ps[0]->value.shape(), Shape({3, 8, 12}));
    EXPECT_EQ(ps[2]->value.shape(), Shape({3, 12}));
    EXPECT_EQ(ps[3]->value.shape(), Shape({3, 8}));
    EXPECT_EQ(ps[3]->value.dtype(), DType::f64);
  }
}

TEST(Experts, Relu2HasUngatedWeightShape) {
  GroupedExperts m(make_config(Activation::relu2, true), 2, 0);
  EXPECT_EQ(m.gate_and_up_projs().value.shape(), Shape({2, 8, 6}));
  EXPECT_EQ(m.gate_up_proj_bias().value.shape(), Shape({2, 6}));
  EXPECT_EQ(m.down_projs().value.shape(), Shape({2, 6, 8}));
}

TEST(Experts, ForwardMatchesFp64Reference) {
  // Three local experts with 2, 0 and 3 rows, then two rows past the sum that must come out zero.
  const std::vector<std::int64_t> counts = {2, 0, 3};
  const std::int64_t N = 7;
  const int owner[5] = {0, 0, 2, 2, 2};
  for (Activation act : kAllActivations)
    for (bool bias : {false, true})
      for (DType pt : {DType::f32, DType::f64}) {
        SCOPED_TRACE(label(act, bias, pt));
        const MoEConfig c = make_config(act, bias);
        GroupedExperts m(c, 3, 0, pt);
        randomize(m, 11);
        Tensor x = Tensor::empty({N, c.dim}, pt), p = Tensor::empty({N}, pt);
        fill_random(x, 21);
        fill_random(p, 22, 0.5);
        const ExpertsOutput out = m.forward(x, p, counts);
        ASSERT_EQ(out.out.shape(), Shape({N, c.dim}));
        ASSERT_EQ(out.out.dtype(), pt);
        const Reference ref(m, c);
        const std::vector<double> xs = as_doubles(x), ps = as_doubles(p);
        const double tol = pt == DType::f64 ? 1e-12 : 2e-5;
        for (int n = 0; n < 5; ++n) {
          const std::vector<double> y = ref.row(owner[n], xs.data() + n * c.dim, ps[static_cast<std::size_t>(n)]);
          for (int j = 0; j < c.dim; ++j)
            EXPECT_NEAR(read_as_double(out.out, n * c.dim + j), y[static_cast<std::size_t>(j)],
                        tol * (1 + std::abs(y[static_cast<std::size_t>(j)])))
                << "row " << n << " col " << j;
        }
        for (std::int64_t i = 5 * c.dim; i < N * c.dim; ++i) EXPECT_EQ(read_as_double(out.out, i), 0.0) << i;
      }
}

TEST(Experts, QuickGegluClampIsExercised) {
  // Guards the premise of the other quick_geglu tests: with limit 1.5 some pre-activations of the
  // test data lie beyond the limit, so the clamp is on the tested path.
  const MoEConfig c = make_config(Activation::quick_geglu, true);
  GroupedExperts m(c, 3, 0, DType::f64);
  randomize(m, 11);
  Tensor x = Tensor::empty({5, c.dim}, DType::f64);
  fill_random(x, 21);
  const Reference ref(m, c);
  const std::vector<double> xs = as_doubles(x);
  int beyond = 0;
  for (int n = 0; n < 5; ++n)
    for (double v : ref.pre_activation(0, xs.data() + n * c.dim)) beyond += std::abs(v) > c.activation_limit;
  EXPECT_GT(beyond, 3);
}

TEST(Experts, LoopAndGroupedAgree) {
  // Rank 1 of 2: local experts 4..7 of 8. Tokens choose 3 experts (some -1, some remote), two
  // tokens are masked. The test permutes by hand: (expert, token) pairs sorted, a zero padding row
  // after expert 1, grouped forward, then scatter-add in row order; forward_loop must agree.
  const std::int64_t T = 12, k = 3;
  const int first = 4, local = 4;
  std::mt19937_64 rng(5);
  Tensor indices = Tensor::empty({T, k}, DType::i64), weights = Tensor::empty({T, k}, DType::f32);
  Tensor mask = Tensor::empty({T}, DType::b8);
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<std::int64_t> ids = {0, 1, 2, 3, 4, 5, 6, 7};
    std::shuffle(ids.begin(), ids.end(), rng);
    for (std::int64_t j = 0; j < k; ++j) {
      indices.data<std::int64_t>()[t * k + j] = (t % 5 == 3 && j == 1) ? -1 : ids[static_cast<std::size_t>(j)];
      weights.data<float>()[t * k + j] = 0.1f + 0.8f * static_cast<float>(j + 1) / static_cast<float>(k + t % 3);
    }
    mask.data<bool>()[t] = !(t == 2 || t == 7);
  }
  for (Activation act : kAllActivations)
    for (bool bias : {false, true})
      for (DType pt : {DType::f32, DType::f64}) {
        SCOPED_TRACE(label(act, bias, pt));
        const MoEConfig c = make_config(act, bias, 8);
        GroupedExperts m(c, local, first, pt);
        randomize(m, 31);
        Tensor x = Tensor::empty({T, c.dim}, pt);
        fill_random(x, 32);

        std::vector<std::tuple<int, std::int64_t, std::int64_t>> pairs;  // (local expert, token, slot)
        for (std::int64_t t = 0; t < T; ++t)
          for (std::int64_t j = 0; j < k; ++j) {
            const std::int64_t g = indices.data<std::int64_t>()[t * k + j];
            if (mask.data<bool>()[t] && g >= first && g < first + local)
              pairs.emplace_back(static_cast<int>(g - first), t, j);
          }
        std::sort(pairs.begin(), pairs.end());
        std::vector<std::int64_t> counts(local, 0), row_token;
        std::vector<double> row_prob;
        for (int e = 0; e < local; ++e) {
          for (const auto& [pe, t, j] : pairs)
            if (pe == e) {
              row_token.push_back(t);
              row_prob.push_back(weights.data<float>()[t * k + j]);
              ++counts[static_cast<std::size_t>(e)];
            }
          if (e == 1) {  // padding row: x = 0, p = 0
            row_token.push_back(-1);
            row_prob.push_back(0.0);
            ++counts[static_cast<std::size_t>(e)];
          }
        }
        const auto N = static_cast<std::int64_t>(row_token.size());
        ASSERT_GT(N, 6);
        Tensor rows = Tensor::zeros({N, c.dim}, pt), probs = Tensor::empty({N}, pt);
        for (std::int64_t r = 0; r < N; ++r) {
          const std::int64_t t = row_token[static_cast<std::size_t>(r)];
          if (t >= 0)
            for (int d = 0; d < c.dim; ++d) write_from_double(rows, r * c.dim + d, read_as_double(x, t * c.dim + d));
          write_from_double(probs, r, row_prob[static_cast<std::size_t>(r)]);
        }
        const ExpertsOutput out = m.forward(rows, probs, counts);
        Tensor combined = Tensor::zeros({T, c.dim}, pt);
        for (std::int64_t r = 0; r < N; ++r) {
          const std::int64_t t = row_token[static_cast<std::size_t>(r)];
          if (t < 0) continue;
          for (int d = 0; d < c.dim; ++d)
            write_from_double(combined, t * c.dim + d,
                              read_as_double(combined, t * c.dim + d) + read_as_double(out.out, r * c.dim + d));
        }
        const Tensor loop = m.forward_loop(x, mask, weights, indices);
        ASSERT_EQ(loop.shape(), Shape({T, c.dim}));
        ASSERT_EQ(loop.dtype(), pt);
        const double tol = pt == DType::f64 ? 1e-13 : 1e-6;
        for (std::int64_t i = 0; i < T * c.dim; ++i)
          EXPECT_NEAR(read_as_double(loop, i), read_as_double(combined, i),
                      tol * (1 + std::abs(read_as_double(combined, i))))
              << "token " << i / c.dim;
        for (std::int64_t i = 2 * c.dim; i < 3 * c.dim; ++i) EXPECT_EQ(read_as_double(loop, i), 0.0);  // masked

        // Without a mask, the masked tokens' local experts are applied too.
        const Tensor unmasked = m.forward_loop(x, TensorView(), weights, indices);
        bool token2_local = false;
        for (std::int64_t j = 0; j < k; ++j) token2_local |= indices.data<std::int64_t>()[2 * k + j] >= first;
        double norm2 = 0;
        for (std::int64_t i = 2 * c.dim; i < 3 * c.dim; ++i) norm2 += std::abs(read_as_double(unmasked, i));
        EXPECT_EQ(norm2 > 0, token2_local);
      }
}

TEST(Experts, ZeroActiveExpertsGiveZeroOutputAndZeroGrads) {
  for (bool bias : {false, true})
    for (std::int64_t N : {std::int64_t{5}, std::int64_t{0}}) {
      SCOPED_TRACE(std::string(bias ? "bias" : "no bias") + " N=" + std::to_string(N));
      const MoEConfig c = make_config(Activation::swiglu, bias);
      GroupedExperts m(c, 3, 0);
      randomize(m, 41);
      Tensor x = Tensor::empty({N, c.dim}, DType::f32), p = Tensor::empty({N}, DType::f32);
      fill_random(x, 42);
      fill_random(p, 43);
      const ExpertsOutput out = m.forward(x, p, {0, 0, 0});
      ASSERT_EQ(out.out.shape(), Shape({N, c.dim}));
      for (std::int64_t i = 0; i < out.out.numel(); ++i) EXPECT_EQ(out.out.data<float>()[i], 0.0f);
      Tensor g = Tensor::empty({N, c.dim}, DType::f32);
      fill_random(g, 44);
      const ExpertsGrads grads = m.backward(out, g);
      ASSERT_EQ(grads.tokens.shape(), Shape({N, c.dim}));
      ASSERT_EQ(grads.probs.shape(), Shape({N}));
      for (std::int64_t i = 0; i < grads.tokens.numel(); ++i) EXPECT_EQ(grads.tokens.data<float>()[i], 0.0f);
      for (std::int64_t i = 0; i < grads.probs.numel(); ++i) EXPECT_EQ(grads.probs.data<float>()[i], 0.0f);
      ASSERT_EQ(m.parameters().size(), bias ? 4u : 2u);
      for (Parameter* prm : m.parameters()) {
        ASSERT_TRUE(prm->grad.defined()) << prm->name;
        EXPECT_EQ(prm->grad.shape(), prm->value.shape()) << prm->name;
        EXPECT_EQ(prm->grad.dtype(), prm->value.dtype()) << prm->name;
        for (std::int64_t i = 0; i < prm->grad.numel(); ++i) ASSERT_EQ(prm->grad.data<float>()[i], 0.0f) << prm->name;
      }
    }
}

TEST(Experts, PaddingRowsGiveZeroOutputAndLeaveParameterGradsUnchanged) {
  for (Activation act : kAllActivations) {
    SCOPED_TRACE(to_string(act));
    const MoEConfig c = make_config(act, true);  // biases make act(b_gu) non-zero on padding rows
    GroupedExperts m(c, 2, 0, DType::f64);
    randomize(m, 51);
    // Unpadded: expert 0 has rows 0-1, expert 1 rows 2-4.
    Tensor x = Tensor::empty({5, c.dim}, DType::f64), p = Tensor::empty({5}, DType::f64);
    Tensor g = Tensor::empty({5, c.dim}, DType::f64);
    fill_random(x, 52);
    fill_random(p, 53);
    fill_random(g, 54);
    const ExpertsOutput plain = m.forward(x, p, {2, 3});
    const ExpertsGrads plain_grads = m.backward(plain, g);
    std::vector<Tensor> plain_param_grads;
    for (Parameter* prm : m.parameters()) {
      plain_param_grads.push_back(prm->grad.clone());
      prm->grad = Tensor();
    }
    // Padded: one zero row (x = 0, p = 0) after each expert's rows, with a non-zero grad_out.
    const std::int64_t src[7] = {0, 1, -1, 2, 3, 4, -1};
    Tensor xp = Tensor::zeros({7, c.dim}, DType::f64), pp = Tensor::zeros({7}, DType::f64);
    Tensor gp = Tensor::empty({7, c.dim}, DType::f64);
    fill_random(gp, 55);
    for (int r = 0; r < 7; ++r) {
      if (src[r] < 0) continue;
      pp.data<double>()[r] = p.data<double>()[src[r]];
      for (int d = 0; d < c.dim; ++d) {
        xp.data<double>()[r * c.dim + d] = x.data<double>()[src[r] * c.dim + d];
        gp.data<double>()[r * c.dim + d] = g.data<double>()[src[r] * c.dim + d];
      }
    }
    const ExpertsOutput padded = m.forward(xp, pp, {3, 4});
    const ExpertsGrads padded_grads = m.backward(padded, gp);
    for (int r = 0; r < 7; ++r)
      for (int d = 0; d < c.dim; ++d) {
        const double y = padded.out.data<double>()[r * c.dim + d];
        if (src[r] < 0) {
          EXPECT_EQ(y, 0.0) << "padding row " << r;
          EXPECT_EQ(padded_grads.tokens.data<double>()[r * c.dim + d], 0.0) << "padding row " << r;
        } else {
          EXPECT_DOUBLE_EQ(y, plain.out.data<double>()[src[r] * c.dim + d]);
          EXPECT_DOUBLE_EQ(padded_grads.tokens.data<double>()[r * c.dim + d],
                           plain_grads.tokens.data<double>()[src[r] * c.dim + d]);
        }
      }
    const auto params = m.parameters();
    for (std::size_t i = 0; i < params.size(); ++i)
      for (std::int64_t j = 0; j < params[i]->grad.numel(); ++j)
        ASSERT_DOUBLE_EQ(params[i]->grad.data<double>()[j], plain_param_grads[i].data<double>()[j])
            << params[i]->name << " element " << j;
  }
}

TEST(Experts, OutputAndGradDtypesFollowTheInputs) {
  const MoEConfig c = make_config(Activation::swiglu, true);
  GroupedExperts m(c, 2, 0, DType::f32);
  randomize(m, 61);
  Tensor x32 = Tensor::empty({4, c.dim}, DType::f32);
  fill_random(x32, 62);
  Tensor xb = x32.to(DType::bf16);
  Tensor xb32 = xb.to(DType::f32);  // the bf16 values, exactly, in f32
  Tensor p = Tensor::from_vector<float>({0.5f, 0.25f, 1.0f, 0.75f}, {4});
  const ExpertsOutput ob = m.forward(xb, p, {1, 3});
  const ExpertsOutput of = m.forward(xb32, p, {1, 3});
  EXPECT_EQ(ob.out.dtype(), DType::bf16);
  EXPECT_EQ(of.out.dtype(), DType::f32);
  for (std::int64_t i = 0; i < of.out.numel(); ++i)
    EXPECT_EQ(read_as_double(ob.out, i), static_cast<double>(bf16::from_float(of.out.data<float>()[i]).to_float()));
  Tensor g = Tensor::empty({4, c.dim}, DType::bf16);
  fill_random(g, 63);
  const ExpertsGrads gb = m.backward(ob, g);
  EXPECT_EQ(gb.tokens.dtype(), DType::bf16);
  EXPECT_EQ(gb.probs.dtype(), DType::f32);

  GroupedExperts m64(c, 2, 0, DType::f64);
  randomize(m64, 61);
  const ExpertsOutput o64 = m64.forward(x32, p, {1, 3});
  EXPECT_EQ(o64.out.dtype(), DType::f32);
  const Tensor o32 = m.forward(x32, p, {1, 3}).out;
  for (std::int64_t i = 0; i < o64.out.numel(); ++i) EXPECT_NEAR(o64.out.data<float>()[i], o32.data<float>()[i], 1e-5);
}

TEST(Experts, GradientsMatchFiniteDifferences) {
  // f64; three experts with 2, 0 and 2 rows and one ignored row at the end. Loss = sum(out * R).
  const std::vector<std::int64_t> counts = {2, 0, 2};
  const int owner[4] = {0, 0, 2, 2};
  const std::int64_t N = 5;
  for (Activation act : kAllActivations)
    for (bool bias : {true, false}) {
      SCOPED_TRACE(label(act, bias, DType::f64));
      const MoEConfig c = make_config(act, bias, 4, 4, 3);
      GroupedExperts m(c, 3, 1, DType::f64);
      randomize(m, 71);
      Tensor x = Tensor::empty({N, c.dim}, DType::f64), p = Tensor::empty({N}, DType::f64);
      Tensor R = Tensor::empty({N, c.dim}, DType::f64);
      fill_random(x, 72);
      fill_random(p, 73, 0.7);
      fill_random(R, 74);
      {
        const Reference ref(m, c);
        for (int n = 0; n < 4; ++n) ASSERT_GT(ref.kink_distance(owner[n], x.data<double>() + n * c.dim), 1e-4) << n;
      }
      auto loss = [&]() {
        const ExpertsOutput o = m.forward(x, p, counts);
        double s = 0;
        for (std::int64_t i = 0; i < o.out.numel(); ++i) s += o.out.data<double>()[i] * R.data<double>()[i];
        return s;
      };
      const ExpertsGrads grads = m.backward(m.forward(x, p, counts), R);
      auto check = [&](const Tensor& value, const Tensor& analytic, const std::string& what) {
        ASSERT_EQ(analytic.shape(), value.shape()) << what;
        const double eps = 1e-6;
        for (std::int64_t i = 0; i < value.numel(); ++i) {
          double& v = value.data<double>()[i];
          const double saved = v;
          v = saved + eps;
          const double lp = loss();
          v = saved - eps;
          const double lm = loss();
          v = saved;
          const double fd = (lp - lm) / (2 * eps);
          EXPECT_NEAR(analytic.data<double>()[i], fd, 1e-7 + 1e-6 * std::abs(fd)) << what << " element " << i;
        }
      };
      check(x, grads.tokens, "tokens");
      check(p, grads.probs, "probs");
      for (Parameter* prm : m.parameters()) check(prm->value, prm->grad, prm->name);
      // Expert 1 received no rows: its slices of every gradient are exactly zero.
      const std::int64_t per = c.dim * c.up_dim();
      for (std::int64_t i = per; i < 2 * per; ++i) EXPECT_EQ(m.gate_and_up_projs().grad.data<double>()[i], 0.0);
    }
}

TEST(Experts, BackwardAccumulatesIntoParameterGrads) {
  const MoEConfig c = make_config(Activation::quick_geglu, true);
  GroupedExperts m(c, 2, 0, DType::f64);
  randomize(m, 81);
  Tensor x = Tensor::empty({3, c.dim}, DType::f64), p = Tensor::empty({3}, DType::f64);
  Tensor g = Tensor::empty({3, c.dim}, DType::f64);
  fill_random(x, 82);
  fill_random(p, 83);
  fill_random(g, 84);
  const ExpertsOutput o = m.forward(x, p, {1, 2});
  m.backward(o, g);
  std::vector<Tensor> once;
  for (Parameter* prm : m.parameters()) once.push_back(prm->grad.clone());
  m.backward(o, g);
  const auto params = m.parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    double norm = 0;
    for (std::int64_t j = 0; j < once[i].numel(); ++j) {
      EXPECT_NEAR(params[i]->grad.data<double>()[j], 2 * once[i].data<double>()[j], 1e-14) << params[i]->name;
      norm += std::abs(once[i].data<double>()[j]);
    }
    EXPECT_GT(norm, 0) << params[i]->name;
  }
}

TEST(Experts, InitIsIdenticalForAnyRankSplit) {
  const MoEConfig c = make_config(Activation::swiglu, true);
  GroupedExperts all(c, 4, 0), r0(c, 2, 0), r1(c, 2, 2);
  for (GroupedExperts* m : {&all, &r0, &r1}) {
    for (Parameter* prm : m->parameters()) fill_random(prm->value, 1);  // init must overwrite everything
    m->init(7, 0.02);
  }
  auto expect_same_slices = [&](const Tensor& whole, const Tensor& part, int first, const char* what) {
    const std::int64_t per = whole.numel() / 4;
    for (std::int64_t i = 0; i < part.numel(); ++i)
      ASSERT_EQ(read_as_double(whole, first * per + i), read_as_double(part, i)) << what << " element " << i;
  };
  expect_same_slices(all.gate_and_up_projs().value, r0.gate_and_up_projs().value, 0, "gate_and_up_projs rank 0");
  expect_same_slices(all.gate_and_up_projs().value, r1.gate_and_up_projs().value, 2, "gate_and_up_projs rank 1");
  expect_same_slices(all.down_projs().value, r0.down_projs().value, 0, "down_projs rank 0");
  expect_same_slices(all.down_projs().value, r1.down_projs().value, 2, "down_projs rank 1");
  // Values are N(0, std) from the parameter's named stream at the global element index.
  const std::int64_t per = c.dim * c.up_dim();
  EXPECT_FLOAT_EQ(r1.gate_and_up_projs().value.data<float>()[5],
                  static_cast<float>(0.02 * normal01(7, stream_id("gate_and_up_projs"), 2 * per + 5)));
  EXPECT_FLOAT_EQ(all.down_projs().value.data<float>()[3],
                  static_cast<float>(0.02 * normal01(7, stream_id("down_projs"), 3)));
  double sum2 = 0;
  for (std::int64_t i = 0; i < all.gate_and_up_projs().value.numel(); ++i)
    sum2 += std::pow(read_as_double(all.gate_and_up_projs().value, i), 2);
  EXPECT_NEAR(std::sqrt(sum2 / static_cast<double>(all.gate_and_up_projs().value.numel())), 0.02, 0.002);
  for (GroupedExperts* m : {&all, &r0, &r1})
    for (Parameter* b : {&m->gate_up_proj_bias(), &m->down_proj_bias()})
      for (std::int64_t i = 0; i < b->value.numel(); ++i) ASSERT_EQ(read_as_double(b->value, i), 0.0);
  // An owner that prefixes the names (the MoE layer's "experts.") must not change the values.
  const Tensor before = r1.down_projs().value.clone();
  r1.down_projs().name = "experts.down_projs";
  r1.init(7, 0.02);
  for (std::int64_t i = 0; i < before.numel(); ++i)
    ASSERT_EQ(before.data<float>()[i], r1.down_projs().value.data<float>()[i]);
}

TEST(Experts, BadArgumentsNameTheArgument) {
  const MoEConfig c = make_config(Activation::swiglu, false, 4);
  GroupedExperts m(c, 2, 0);
  Tensor x = Tensor::zeros({4, c.dim}, DType::f32), p = Tensor::zeros({4}, DType::f32);
  const std::vector<std::int64_t> ok = {2, 2};
  EXPECT_EQ(argument_of([&] { m.forward(Tensor::zeros({4, c.dim + 1}, DType::f32), p, ok); }), "tokens");
  EXPECT_EQ(argument_of([&] { m.forward(Tensor::zeros({4 * c.dim}, DType::f32), p, ok); }), "tokens");
  EXPECT_EQ(argument_of([&] { m.forward(Tensor::zeros({4, c.dim}, DType::i32), p, ok); }), "tokens");
  EXPECT_EQ(argument_of([&] { m.forward(TensorView(), p, ok); }), "tokens");
  EXPECT_EQ(argument_of([&] { m.forward(x, Tensor::zeros({5}, DType::f32), ok); }), "probs");
  EXPECT_EQ(argument_of([&] { m.forward(x, Tensor::zeros({4, 1}, DType::f32), ok); }), "probs");
  EXPECT_EQ(argument_of([&] { m.forward(x, Tensor::zeros({4}, DType::i64), ok); }), "probs");
  EXPECT_EQ(argument_of([&] { m.forward(x, p, {4}); }), "tokens_per_expert");
  EXPECT_EQ(argument_of([&] { m.forward(x, p, {2, 1, 1}); }), "tokens_per_expert");
  EXPECT_EQ(argument_of([&] { m.forward(x, p, {-1, 2}); }), "tokens_per_expert");
  EXPECT_EQ(argument_of([&] { m.forward(x, p, {3, 2}); }), "tokens_per_expert");
  EXPECT_EQ(argument_of([&] { m.forward(x, p, ok); }), "<no ArgumentError>");

  const ExpertsOutput o = m.forward(x, p, ok);
  EXPECT_EQ(argument_of([&] { m.backward(o, Tensor::zeros({3, c.dim}, DType::f32)); }), "grad_out");
  EXPECT_EQ(argument_of([&] { m.backward(o, Tensor::zeros({4, c.dim}, DType::i64)); }), "grad_out");
  EXPECT_EQ(argument_of([&] { m.backward(ExpertsOutput(), Tensor::zeros({4, c.dim}, DType::f32)); }), "forward_output");
  GroupedExperts other(c, 2, 0);
  EXPECT_EQ(argument_of([&] { other.backward(o, Tensor::zeros({4, c.dim}, DType::f32)); }), "forward_output");

  EXPECT_EQ(argument_of([&] { GroupedExperts(c, 2, 0, DType::bf16); }), "param_dtype");
  EXPECT_EQ(argument_of([&] { GroupedExperts(c, 0, 0); }), "num_local_experts");
  EXPECT_EQ(argument_of([&] { GroupedExperts(c, 2, 3); }), "first_expert");
  EXPECT_EQ(argument_of([&] { GroupedExperts(c, 2, -1); }), "first_expert");
  EXPECT_EQ(argument_of([&] { m.init(1, -0.5); }), "init_std");

  Tensor idx = Tensor::from_vector<std::int64_t>({0, 1, 2, 3, 1, -1, 0, 2}, {4, 2});
  Tensor w = Tensor::zeros({4, 2}, DType::f32);
  EXPECT_EQ(argument_of([&] { m.forward_loop(x, TensorView(), w, idx); }), "<no ArgumentError>");
  EXPECT_EQ(argument_of([&] {
              m.forward_loop(x, TensorView(), w, Tensor::from_vector<std::int64_t>({0, 1, 2, 4, 1, -1, 0, 2}, {4, 2}));
            }),
            "indices");
  EXPECT_EQ(argument_of([&] {
              m.forward_loop(x, TensorView(), w, Tensor::from_vector<std::int64_t>({0, 0, 2, 3, 1, -1, 0, 2}, {4, 2}));
            }),
            "indices");
  EXPECT_EQ(argument_of([&] { m.forward_loop(x, TensorView(), Tensor::zeros({4, 3}, DType::f32), idx); }), "indices");
  EXPECT_EQ(argument_of([&] { m.forward_loop(x, TensorView(), Tensor::zeros({3, 2}, DType::f32), idx); }), "weights");
  EXPECT_EQ(argument_of([&] { m.forward_loop(x, Tensor::zeros({4}, DType::f32), w, idx); }), "token_mask");
  EXPECT_EQ(argument_of([&] { m.forward_loop(Tensor::zeros({4, 3}, DType::f32), TensorView(), w, idx); }), "x");
}

namespace {
// The module of make_config with one of the Automodel 0.7.0 options switched on.
MoEConfig variant(Activation act, bool bias, bool after_down, double swiglu_limit) {
  MoEConfig c = make_config(act, bias);
  c.apply_router_weight_after_down = after_down;
  c.swiglu_limit = swiglu_limit;
  return c;
}
}  // namespace

TEST(Experts, AfterDownAndSwigluLimitForwardMatchFp64Reference) {
  const std::vector<std::int64_t> counts = {2, 0, 3};
  const int owner[5] = {0, 0, 2, 2, 2};
  struct V {
    Activation act;
    bool after_down;
    double limit;
  };
  for (const V& v : {V{Activation::swiglu, true, 0.0}, V{Activation::quick_geglu, true, 0.0},
                     V{Activation::relu2, true, 0.0}, V{Activation::swiglu, false, 0.8},
                     V{Activation::swiglu, true, 0.8}})
    for (bool bias : {false, true})
      for (DType pt : {DType::f32, DType::f64}) {
        SCOPED_TRACE(label(v.act, bias, pt) + (v.after_down ? " after-down" : "") + " limit " +
                     std::to_string(v.limit));
        const MoEConfig c = variant(v.act, bias, v.after_down, v.limit);
        GroupedExperts m(c, 3, 0, pt);
        randomize(m, 11);
        Tensor x = Tensor::empty({7, c.dim}, pt), p = Tensor::empty({7}, pt);
        fill_random(x, 21);
        fill_random(p, 22, 0.5);
        const ExpertsOutput out = m.forward(x, p, counts);
        const Reference ref(m, c);
        const std::vector<double> xs = as_doubles(x), ps = as_doubles(p);
        const double tol = pt == DType::f64 ? 1e-12 : 2e-5;
        for (int n = 0; n < 5; ++n) {
          const std::vector<double> y = ref.row(owner[n], xs.data() + n * c.dim, ps[static_cast<std::size_t>(n)]);
          for (int j = 0; j < c.dim; ++j)
            EXPECT_NEAR(read_as_double(out.out, n * c.dim + j), y[static_cast<std::size_t>(j)],
                        tol * (1 + std::abs(y[static_cast<std::size_t>(j)])))
                << "row " << n << " col " << j;
        }
        for (std::int64_t i = 5 * c.dim; i < 7 * c.dim; ++i) EXPECT_EQ(read_as_double(out.out, i), 0.0) << i;
      }
}

TEST(Experts, AfterDownMultipliesTheFinishedRowOnce) {
  // After the down projection the prob multiplies the finished row: y(p) == float(y(1) * p) bit for
  // bit in f32, row by row. With the prob inside the FFN the f32 roundings fall elsewhere, so the
  // same identity fails somewhere: the two orders are really different computations.
  for (bool after : {true, false}) {
    SCOPED_TRACE(after ? "after down" : "inside the FFN");
    const MoEConfig c = variant(Activation::swiglu, true, after, 0.0);
    GroupedExperts m(c, 2, 0, DType::f32);
    randomize(m, 12);
    Tensor x = Tensor::empty({6, c.dim}, DType::f32), p = Tensor::empty({6}, DType::f32);
    fill_random(x, 23);
    fill_random(p, 24, 0.5);
    Tensor ones = Tensor::empty({6}, DType::f32);
    for (int n = 0; n < 6; ++n) ones.data<float>()[n] = 1.0f;
    const Tensor y = m.forward(x, p, {2, 4}).out, y1 = m.forward(x, ones, {2, 4}).out;
    int exact = 0;
    for (int n = 0; n < 6; ++n)
      for (int j = 0; j < c.dim; ++j)
        exact += y.data<float>()[n * c.dim + j] == y1.data<float>()[n * c.dim + j] * p.data<float>()[n];
    if (after)
      EXPECT_EQ(exact, 6 * c.dim);
    else
      EXPECT_LT(exact, 6 * c.dim);
  }
}

TEST(Experts, AfterDownAndSwigluLimitGradientsMatchFiniteDifferences) {
  const std::vector<std::int64_t> counts = {2, 0, 2};
  const int owner[4] = {0, 0, 2, 2};
  const std::int64_t N = 5;
  struct V {
    Activation act;
    bool after_down;
    double limit;
  };
  for (const V& v : {V{Activation::swiglu, true, 0.0}, V{Activation::swigluoai, true, 0.0},
                     V{Activation::relu2, true, 0.0}, V{Activation::swiglu, false, 0.7},
                     V{Activation::swiglu, true, 0.7}, V{Activation::geglu, true, 0.0}})
    for (bool bias : {true, false}) {
      SCOPED_TRACE(label(v.act, bias, DType::f64) + (v.after_down ? " after-down" : "") + " limit " +
                   std::to_string(v.limit));
      MoEConfig c = variant(v.act, bias, v.after_down, v.limit);
      c.dim = 4;
      c.moe_inter_dim = 3;
      GroupedExperts m(c, 3, 1, DType::f64);
      randomize(m, 71);
      Tensor x = Tensor::empty({N, c.dim}, DType::f64), p = Tensor::empty({N}, DType::f64);
      Tensor R = Tensor::empty({N, c.dim}, DType::f64);
      fill_random(x, 72);
      fill_random(p, 73, 0.7);
      fill_random(R, 74);
      {
        const Reference ref(m, c);
        for (int n = 0; n < 4; ++n) ASSERT_GT(ref.kink_distance(owner[n], x.data<double>() + n * c.dim), 1e-4) << n;
      }
      auto loss = [&]() {
        const ExpertsOutput o = m.forward(x, p, counts);
        double s = 0;
        for (std::int64_t i = 0; i < o.out.numel(); ++i) s += o.out.data<double>()[i] * R.data<double>()[i];
        return s;
      };
      const ExpertsGrads grads = m.backward(m.forward(x, p, counts), R);
      auto check = [&](const Tensor& value, const Tensor& analytic, const std::string& what) {
        const double eps = 1e-6;
        double norm = 0;
        for (std::int64_t i = 0; i < value.numel(); ++i) {
          double& val = value.data<double>()[i];
          const double saved = val;
          val = saved + eps;
          const double lp = loss();
          val = saved - eps;
          const double lm = loss();
          val = saved;
          const double fd = (lp - lm) / (2 * eps);
          norm += std::abs(fd);
          EXPECT_NEAR(analytic.data<double>()[i], fd, 1e-7 + 1e-6 * std::abs(fd)) << what << " element " << i;
        }
        EXPECT_GT(norm, 0) << what;
      };
      check(x, grads.tokens, "tokens");
      check(p, grads.probs, "probs");
      for (Parameter* prm : m.parameters()) check(prm->value, prm->grad, prm->name);
    }
}

TEST(Experts, AfterDownLoopOracleAgreesWithGroupedRows) {
  // Automodel's loop with apply_router_weight_after_down: each (token, slot) row is finished, then
  // scaled by its weight, then summed over the slots. Two tokens, two local experts, k = 2.
  const MoEConfig c = variant(Activation::swiglu, true, true, 0.0);
  GroupedExperts m(c, 2, 0, DType::f64);
  randomize(m, 13);
  Tensor x = Tensor::empty({2, c.dim}, DType::f64);
  fill_random(x, 25);
  const Tensor idx = Tensor::from_vector<std::int64_t>({0, 1, 1, 0}, {2, 2});
  const Tensor w = Tensor::from_vector<double>({0.7, 0.2, 0.4, 0.9}, {2, 2});
  const Tensor loop = m.forward_loop(x, TensorView(), w, idx);
  const Reference ref(m, c);
  for (int t = 0; t < 2; ++t) {
    const std::vector<double> a = ref.row(static_cast<int>(idx.data<std::int64_t>()[t * 2]),
                                          x.data<double>() + t * c.dim, w.data<double>()[t * 2]);
    const std::vector<double> b = ref.row(static_cast<int>(idx.data<std::int64_t>()[t * 2 + 1]),
                                          x.data<double>() + t * c.dim, w.data<double>()[t * 2 + 1]);
    for (int j = 0; j < c.dim; ++j)
      EXPECT_NEAR(loop.data<double>()[t * c.dim + j], a[static_cast<std::size_t>(j)] + b[static_cast<std::size_t>(j)],
                  1e-12);
  }
}
