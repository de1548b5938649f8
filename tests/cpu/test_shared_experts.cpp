// SharedExperts (Automodel's MLP, optionally sigmoid-gated) against an fp64 reference written here
// and against central finite differences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "flexep/core/random.h"
#include "flexep/layer/shared_experts.h"

using namespace flexep;

namespace {

MoEConfig make_config(Activation act, bool bias, bool gate, int dim = 8, int n_shared = 2, int shared_inter = 3) {
  MoEConfig c;
  c.dim = dim;
  c.moe_inter_dim = 5;
  c.n_shared_experts = n_shared;
  c.shared_expert_inter_dim = shared_inter;
  c.shared_expert_activation = act;
  c.expert_bias = bias;
  c.shared_expert_gate = gate;
  return c;
}

void fill_random(const TensorView& t, unsigned seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, scale);
  for (std::int64_t i = 0; i < t.numel(); ++i) write_from_double(t, i, nd(rng));
}

Parameter* find(SharedExperts& m, const std::string& name) {
  for (Parameter* p : m.parameters())
    if (p->name == name) return p;
  return nullptr;
}

void randomize(SharedExperts& m, unsigned seed) {
  m.init(seed, 0.5);
  unsigned s = seed;
  for (Parameter* p : m.parameters())
    if (p->name.size() > 5 && p->name.compare(p->name.size() - 5, 5, ".bias") == 0) fill_random(p->value, ++s, 0.5);
}

std::vector<double> as_doubles(const Parameter* p) {
  std::vector<double> v;
  if (!p) return v;
  for (std::int64_t i = 0; i < p->value.numel(); ++i) v.push_back(read_as_double(p->value, i));
  return v;
}

double sig(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// fp64 copies of the parameters and the MLP of one token written out with plain loops.
struct Reference {
  MoEConfig c;
  int dim, inter;
  std::vector<double> gw, uw, dw, gb, ub, db, sw;

  Reference(SharedExperts& m, const MoEConfig& cfg) : c(cfg), dim(cfg.dim), inter(cfg.shared_inter()) {
    gw = as_doubles(find(m, "shared_experts.gate_proj.weight"));
    uw = as_doubles(find(m, "shared_experts.up_proj.weight"));
    dw = as_doubles(find(m, "shared_experts.down_proj.weight"));
    gb = as_doubles(find(m, "shared_experts.gate_proj.bias"));
    ub = as_doubles(find(m, "shared_experts.up_proj.bias"));
    db = as_doubles(find(m, "shared_experts.down_proj.bias"));
    sw = as_doubles(find(m, "shared_expert_gate.weight"));
  }

  // x W^T + b for an nn.Linear weight W [out, in].
  std::vector<double> linear(const std::vector<double>& W, const std::vector<double>& b, const double* x, int out,
                             int in) const {
    std::vector<double> y(static_cast<std::size_t>(out));
    for (int o = 0; o < out; ++o) {
      double s = b.empty() ? 0.0 : b[static_cast<std::size_t>(o)];
      for (int i = 0; i < in; ++i) s += W[static_cast<std::size_t>(o * in + i)] * x[i];
      y[static_cast<std::size_t>(o)] = s;
    }
    return y;
  }

  std::vector<double> row(const double* x) const {
    const std::vector<double> u = linear(uw, ub, x, inter, dim);
    std::vector<double> a(static_cast<std::size_t>(inter));
    if (c.shared_expert_activation == Activation::swiglu) {
      const std::vector<double> g = linear(gw, gb, x, inter, dim);
      const double L = c.swiglu_limit;
      for (int i = 0; i < inter; ++i) {
        double gi = g[static_cast<std::size_t>(i)], ui = u[static_cast<std::size_t>(i)];
        if (L > 0) gi = std::min(gi, L), ui = std::clamp(ui, -L, L);  // Automodel's MLP with swiglu_limit
        a[static_cast<std::size_t>(i)] = gi * sig(gi) * ui;
      }
    } else {
      for (int i = 0; i < inter; ++i)
        a[static_cast<std::size_t>(i)] = std::pow(std::max(u[static_cast<std::size_t>(i)], 0.0), 2);
    }
    std::vector<double> z = linear(dw, db, a.data(), dim, inter);
    if (!sw.empty()) {
      double logit = 0;
      for (int k = 0; k < dim; ++k) logit += sw[static_cast<std::size_t>(k)] * x[k];
      for (double& v : z) v *= sig(logit);
    }
    return z;
  }

  // Distance to the nearest kink: relu's 0, or swiglu_limit's clamps.
  double relu_kink_distance(const double* x) const {
    double d = 1e300;
    if (c.shared_expert_activation == Activation::relu2)
      for (double v : linear(uw, ub, x, inter, dim)) d = std::min(d, std::abs(v));
    if (c.shared_expert_activation == Activation::swiglu && c.swiglu_limit > 0) {
      for (double v : linear(gw, gb, x, inter, dim)) d = std::min(d, std::abs(v - c.swiglu_limit));
      for (double v : linear(uw, ub, x, inter, dim)) d = std::min(d, std::abs(std::abs(v) - c.swiglu_limit));
    }
    return d;
  }

  // How many gate/up values of this token the clamps act on.
  int clamped(const double* x) const {
    int n = 0;
    if (c.swiglu_limit <= 0 || c.shared_expert_activation != Activation::swiglu) return 0;
    for (double v : linear(gw, gb, x, inter, dim)) n += v > c.swiglu_limit;
    for (double v : linear(uw, ub, x, inter, dim)) n += std::abs(v) > c.swiglu_limit;
    return n;
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

std::string label(Activation a, bool bias, bool gate, DType t) {
  return std::string(to_string(a)) + (bias ? " +bias" : " no-bias") + (gate ? " +gate " : " no-gate ") +
         std::string(dtype_name(t));
}

}  // namespace

TEST(SharedExperts, ParameterNamesAndShapes) {
  {
    SharedExperts m(make_config(Activation::swiglu, true, true));
    std::vector<std::string> names;
    for (Parameter* p : m.parameters()) names.push_back(p->name);
    EXPECT_EQ(names, (std::vector<std::string>{"shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
                                               "shared_experts.down_proj.weight", "shared_experts.gate_proj.bias",
                                               "shared_experts.up_proj.bias", "shared_experts.down_proj.bias",
                                               "shared_expert_gate.weight"}));
    EXPECT_EQ(find(m, "shared_experts.gate_proj.weight")->value.shape(), Shape({6, 8}));
    EXPECT_EQ(find(m, "shared_experts.up_proj.weight")->value.shape(), Shape({6, 8}));
    EXPECT_EQ(find(m, "shared_experts.down_proj.weight")->value.shape(), Shape({8, 6}));
    EXPECT_EQ(find(m, "shared_experts.up_proj.bias")->value.shape(), Shape({6}));
    EXPECT_EQ(find(m, "shared_experts.down_proj.bias")->value.shape(), Shape({8}));
    EXPECT_EQ(find(m, "shared_expert_gate.weight")->value.shape(), Shape({1, 8}));
  }
  {
    SharedExperts m(make_config(Activation::relu2, false, false), DType::f64);
    std::vector<std::string> names;
    for (Parameter* p : m.parameters()) names.push_back(p->name);
    EXPECT_EQ(names, (std::vector<std::string>{"shared_experts.up_proj.weight", "shared_experts.down_proj.weight"}));
    EXPECT_EQ(m.parameters()[0]->value.dtype(), DType::f64);
  }
}

TEST(SharedExperts, HiddenSizeIsSharedCountTimesInterDim) {
  SharedExperts a(make_config(Activation::swiglu, false, false, 8, 2, 3));
  EXPECT_EQ(find(a, "shared_experts.up_proj.weight")->value.shape(), Shape({6, 8}));
  SharedExperts b(make_config(Activation::swiglu, false, false, 8, 3, 0));  // 0: falls back to moe_inter_dim (5)
  EXPECT_EQ(find(b, "shared_experts.down_proj.weight")->value.shape(), Shape({8, 15}));
}

TEST(SharedExperts, ForwardMatchesFp64Reference) {
  for (Activation act : {Activation::swiglu, Activation::relu2})
    for (bool bias : {false, true})
      for (bool gate : {false, true})
        for (DType pt : {DType::f32, DType::f64}) {
          SCOPED_TRACE(label(act, bias, gate, pt));
          const MoEConfig c = make_config(act, bias, gate);
          SharedExperts m(c, pt);
          randomize(m, 3);
          const std::int64_t T = 5;
          Tensor x = Tensor::empty({T, c.dim}, pt);
          fill_random(x, 4);
          const SharedOutput out = m.forward(x);
          ASSERT_EQ(out.out.shape(), Shape({T, c.dim}));
          ASSERT_EQ(out.out.dtype(), pt);
          const Reference ref(m, c);
          std::vector<double> xs;
          for (std::int64_t i = 0; i < x.numel(); ++i) xs.push_back(read_as_double(x, i));
          const double tol = pt == DType::f64 ? 1e-12 : 2e-5;
          double norm = 0;
          for (std::int64_t t = 0; t < T; ++t) {
            const std::vector<double> z = ref.row(xs.data() + t * c.dim);
            for (int j = 0; j < c.dim; ++j) {
              norm += std::abs(z[static_cast<std::size_t>(j)]);
              EXPECT_NEAR(read_as_double(out.out, t * c.dim + j), z[static_cast<std::size_t>(j)],
                          tol * (1 + std::abs(z[static_cast<std::size_t>(j)])))
                  << "token " << t << " col " << j;
            }
          }
          EXPECT_GT(norm, 0.1);
        }
}

TEST(SharedExperts, OutputDtypeFollowsTheInput) {
  const MoEConfig c = make_config(Activation::swiglu, true, true);
  SharedExperts m(c, DType::f32);
  randomize(m, 5);
  Tensor x = Tensor::empty({3, c.dim}, DType::f32);
  fill_random(x, 6);
  const Tensor xb = x.to(DType::bf16);
  const SharedOutput ob = m.forward(xb);
  const SharedOutput of = m.forward(xb.to(DType::f32));
  EXPECT_EQ(ob.out.dtype(), DType::bf16);
  for (std::int64_t i = 0; i < of.out.numel(); ++i)
    EXPECT_EQ(read_as_double(ob.out, i), static_cast<double>(bf16::from_float(of.out.data<float>()[i]).to_float()));
  EXPECT_EQ(m.backward(ob, xb).dtype(), DType::bf16);
}

TEST(SharedExperts, GradientsMatchFiniteDifferences) {
  for (Activation act : {Activation::swiglu, Activation::relu2})
    for (bool bias : {false, true})
      for (bool gate : {false, true}) {
        SCOPED_TRACE(label(act, bias, gate, DType::f64));
        const MoEConfig c = make_config(act, bias, gate, 4, 2, 2);
        SharedExperts m(c, DType::f64);
        randomize(m, 7);
        const std::int64_t T = 3;
        Tensor x = Tensor::empty({T, c.dim}, DType::f64), R = Tensor::empty({T, c.dim}, DType::f64);
        fill_random(x, 8);
        fill_random(R, 9);
        {
          const Reference ref(m, c);
          for (std::int64_t t = 0; t < T; ++t) ASSERT_GT(ref.relu_kink_distance(x.data<double>() + t * c.dim), 1e-4);
        }
        auto loss = [&]() {
          const SharedOutput o = m.forward(x);
          double s = 0;
          for (std::int64_t i = 0; i < o.out.numel(); ++i) s += o.out.data<double>()[i] * R.data<double>()[i];
          return s;
        };
        const Tensor gx = m.backward(m.forward(x), R);
        auto check = [&](const Tensor& value, const Tensor& analytic, const std::string& what) {
          ASSERT_TRUE(analytic.defined()) << what;
          ASSERT_EQ(analytic.shape(), value.shape()) << what;
          const double eps = 1e-6;
          double norm = 0;
          for (std::int64_t i = 0; i < value.numel(); ++i) {
            double& v = value.data<double>()[i];
            const double saved = v;
            v = saved + eps;
            const double lp = loss();
            v = saved - eps;
            const double lm = loss();
            v = saved;
            const double fd = (lp - lm) / (2 * eps);
            norm += std::abs(fd);
            EXPECT_NEAR(analytic.data<double>()[i], fd, 1e-7 + 1e-6 * std::abs(fd)) << what << " element " << i;
          }
          EXPECT_GT(norm, 0) << what;  // every gradient is exercised
        };
        check(x, gx, "x");
        const auto params = m.parameters();
        EXPECT_EQ(params.size(), static_cast<std::size_t>((act == Activation::swiglu ? 3 : 2) * (bias ? 2 : 1) + gate));
        for (Parameter* p : params) check(p->value, p->grad, p->name);
      }
}

TEST(SharedExperts, InitUsesNamedStreamsAndZeroBiases) {
  const MoEConfig c = make_config(Activation::swiglu, true, true);
  SharedExperts m(c, DType::f64);
  for (Parameter* p : m.parameters()) fill_random(p->value, 1);
  m.init(13, 0.02);
  for (Parameter* p : m.parameters()) {
    const bool is_bias = p->name.find(".bias") != std::string::npos;
    for (std::int64_t i = 0; i < p->value.numel(); ++i) {
      const double expected =
          is_bias ? 0.0 : 0.02 * normal01(13, stream_id(p->name.c_str()), static_cast<std::uint64_t>(i));
      ASSERT_EQ(p->value.data<double>()[i], expected) << p->name << " element " << i;
    }
  }
}

TEST(SharedExperts, BadArgumentsNameTheArgument) {
  const MoEConfig c = make_config(Activation::swiglu, false, false);
  SharedExperts m(c);
  EXPECT_EQ(argument_of([&] { m.forward(Tensor::zeros({3, c.dim + 1}, DType::f32)); }), "x");
  EXPECT_EQ(argument_of([&] { m.forward(Tensor::zeros({3}, DType::f32)); }), "x");
  EXPECT_EQ(argument_of([&] { m.forward(Tensor::zeros({3, c.dim}, DType::i32)); }), "x");
  const SharedOutput o = m.forward(Tensor::zeros({3, c.dim}, DType::f32));
  EXPECT_EQ(argument_of([&] { m.backward(o, Tensor::zeros({2, c.dim}, DType::f32)); }), "grad_out");
  EXPECT_EQ(argument_of([&] { m.backward(o, Tensor::zeros({3, c.dim}, DType::b8)); }), "grad_out");
  EXPECT_EQ(argument_of([&] { m.backward(SharedOutput(), Tensor::zeros({3, c.dim}, DType::f32)); }), "forward_output");
  SharedExperts other(c);
  EXPECT_EQ(argument_of([&] { other.backward(o, Tensor::zeros({3, c.dim}, DType::f32)); }), "forward_output");
  EXPECT_EQ(argument_of([&] { m.backward(o, Tensor::zeros({3, c.dim}, DType::f32)); }), "<no ArgumentError>");

  EXPECT_EQ(argument_of([&] { SharedExperts(c, DType::bf16); }), "param_dtype");
  MoEConfig none = c;
  none.n_shared_experts = 0;
  EXPECT_EQ(argument_of([&] { SharedExperts{none}; }), "moe.n_shared_experts");
  MoEConfig geglu = c;
  geglu.shared_expert_activation = Activation::quick_geglu;
  EXPECT_EQ(argument_of([&] { SharedExperts{geglu}; }), "moe.shared_expert_activation");
  EXPECT_EQ(argument_of([&] { m.init(1, std::nan("")); }), "init_std");
}

TEST(SharedExperts, SwigluLimitClampsLikeAutomodelsMlp) {
  // Automodel's MLP with swiglu_limit: gate clamped <= L and up to [-L, L] in fp32. Limit 0.6 with
  // unit data: several values are clamped; relu2 ignores the limit.
  for (Activation act : {Activation::swiglu, Activation::relu2})
    for (DType pt : {DType::f32, DType::f64}) {
      SCOPED_TRACE(label(act, true, true, pt));
      MoEConfig c = make_config(act, true, true);
      c.swiglu_limit = 0.6;
      SharedExperts m(c, pt);
      randomize(m, 21);
      const std::int64_t T = 6;
      Tensor x = Tensor::empty({T, c.dim}, pt);
      fill_random(x, 22);
      const SharedOutput out = m.forward(x);
      const Reference ref(m, c);
      MoEConfig unclamped = c;
      unclamped.swiglu_limit = 0;
      const Reference plain(m, unclamped);
      std::vector<double> xs;
      for (std::int64_t i = 0; i < x.numel(); ++i) xs.push_back(read_as_double(x, i));
      const double tol = pt == DType::f64 ? 1e-12 : 2e-5;
      int clamped = 0;
      double moved = 0;
      for (std::int64_t t = 0; t < T; ++t) {
        clamped += ref.clamped(xs.data() + t * c.dim);
        const std::vector<double> z = ref.row(xs.data() + t * c.dim), z0 = plain.row(xs.data() + t * c.dim);
        for (int j = 0; j < c.dim; ++j) {
          EXPECT_NEAR(read_as_double(out.out, t * c.dim + j), z[static_cast<std::size_t>(j)],
                      tol * (1 + std::abs(z[static_cast<std::size_t>(j)])));
          moved += std::abs(z[static_cast<std::size_t>(j)] - z0[static_cast<std::size_t>(j)]);
        }
      }
      if (act == Activation::swiglu) {
        EXPECT_GT(clamped, 5);  // the clamp is on the tested path
        EXPECT_GT(moved, 1e-3);
      } else {
        EXPECT_EQ(moved, 0.0);
      }
    }
}

TEST(SharedExperts, SwigluLimitGradientsMatchFiniteDifferences) {
  MoEConfig c = make_config(Activation::swiglu, true, true, 4, 2, 2);
  c.swiglu_limit = 0.5;
  SharedExperts m(c, DType::f64);
  randomize(m, 31);
  const std::int64_t T = 3;
  Tensor x = Tensor::empty({T, c.dim}, DType::f64), R = Tensor::empty({T, c.dim}, DType::f64);
  fill_random(x, 32);
  fill_random(R, 33);
  const Reference ref(m, c);
  int clamped = 0;
  for (std::int64_t t = 0; t < T; ++t) {
    ASSERT_GT(ref.relu_kink_distance(x.data<double>() + t * c.dim), 1e-4);
    clamped += ref.clamped(x.data<double>() + t * c.dim);
  }
  EXPECT_GT(clamped, 0);
  auto loss = [&]() {
    const SharedOutput o = m.forward(x);
    double s = 0;
    for (std::int64_t i = 0; i < o.out.numel(); ++i) s += o.out.data<double>()[i] * R.data<double>()[i];
    return s;
  };
  const Tensor gx = m.backward(m.forward(x), R);
  auto check = [&](const Tensor& value, const Tensor& analytic, const std::string& what) {
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
  check(x, gx, "x");
  for (Parameter* p : m.parameters()) check(p->value, p->grad, p->name);
}
