// Gate (router) CPU reference: forward against an independent fp64 reference written here (logits by
// plain loops, selection by stable sorting), aux loss and bias update against their formulas, and
// backward against central finite differences in fp64.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "flexep/core/random.h"
#include "flexep/layer/gate.h"

using namespace flexep;

namespace {

MoEConfig make_config(ScoreFunc f, int experts = 8, int topk = 3, int dim = 6) {
  MoEConfig c;
  c.n_routed_experts = experts;
  c.n_activated_experts = topk;
  c.dim = dim;
  c.score_func = f;
  c.n_expert_groups = 1;
  c.n_limited_groups = 1;
  return c;
}

Tensor randn(Shape shape, DType dtype, std::uint64_t seed, double std = 1.0) {
  Tensor t = Tensor::empty(shape, dtype);
  fill_normal(t, seed, stream_id("test.gate.input"), 0.0, std);
  return t;
}

std::vector<double> values(const TensorView& t) {
  std::vector<double> v(static_cast<std::size_t>(t.numel()));
  for (std::int64_t i = 0; i < t.numel(); ++i) v[static_cast<std::size_t>(i)] = read_as_double(t, i);
  return v;
}

std::vector<std::int64_t> int_values(const TensorView& t) {
  std::vector<std::int64_t> v(static_cast<std::size_t>(t.numel()));
  for (std::int64_t i = 0; i < t.numel(); ++i) v[static_cast<std::size_t>(i)] = t.ptr<std::int64_t>()[i];
  return v;
}

// Positions of v in descending order, equal values by position (what the gate promises for ties).
std::vector<int> order_desc(const std::vector<double>& v) {
  std::vector<int> order(v.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return v[a] > v[b]; });
  return order;
}

struct Reference {
  std::vector<double> weights;                 // [T, k]
  std::vector<std::int64_t> indices;           // [T, k]
  std::vector<double> original;                // [T, E], normalised like Automodel
  std::vector<std::vector<int>> kept_groups;   // per token, sorted ascending
};

// Straightforward fp64 router: the gate.h comment block, one line at a time.
Reference reference(const MoEConfig& c, const std::vector<double>& x, const std::vector<double>& w,
                    const std::vector<double>& b, const std::vector<double>& cb) {
  const int E = c.n_routed_experts, k = c.n_activated_experts, D = c.dim;
  const std::size_t T = x.size() / static_cast<std::size_t>(D);
  Reference r;
  for (std::size_t t = 0; t < T; ++t) {
    std::vector<double> z(E);
    for (int e = 0; e < E; ++e) {
      double acc = 0;
      for (int d = 0; d < D; ++d) acc += x[t * D + d] * w[static_cast<std::size_t>(e) * D + d];
      z[e] = acc + (b.empty() ? 0.0 : b[e]);
    }
    std::vector<double> scores(E);
    if (c.score_func == ScoreFunc::sigmoid || c.score_func == ScoreFunc::sigmoid_with_bias) {
      for (int e = 0; e < E; ++e) scores[e] = 1.0 / (1.0 + std::exp(-z[e]));
    } else if (c.score_func == ScoreFunc::sqrtsoftplus) {
      for (int e = 0; e < E; ++e) scores[e] = std::sqrt(z[e] > 20 ? z[e] : std::log(1.0 + std::exp(z[e])));
    } else {
      const double m = *std::max_element(z.begin(), z.end());
      double sum = 0;
      for (int e = 0; e < E; ++e) sum += std::exp(z[e] - m);
      for (int e = 0; e < E; ++e) scores[e] = std::exp(z[e] - m) / sum;
    }
    std::vector<int> chosen;
    std::vector<double> weights;
    std::vector<int> kept;
    const bool biased = c.score_func != ScoreFunc::softmax && !cb.empty();
    // Automodel's original_scores: the biased ones for sigmoid with router_weight_uses_score_correction_bias.
    std::vector<double> original = scores;
    if (biased && c.score_func == ScoreFunc::sigmoid && c.router_weight_uses_score_correction_bias)
      for (int e = 0; e < E; ++e) original[e] += cb[e];
    if (c.score_func == ScoreFunc::softmax && !c.softmax_before_topk) {
      const std::vector<int> order = order_desc(z);
      chosen.assign(order.begin(), order.begin() + k);
      double m = z[chosen[0]], sum = 0;
      for (int e : chosen) sum += std::exp(z[e] - m);
      for (int e : chosen) weights.push_back(std::exp(z[e] - m) / sum);
    } else {
      std::vector<double> choice = scores;
      if (biased)
        for (int e = 0; e < E; ++e) choice[e] += cb[e];
      const bool grouped = c.score_func == ScoreFunc::softmax_with_bias || c.score_func == ScoreFunc::sigmoid ||
                           c.score_func == ScoreFunc::sigmoid_with_bias;
      if (grouped && c.n_expert_groups > 1) {
        const int G = c.n_expert_groups, size = E / G;
        std::vector<double> gscore(G);
        for (int g = 0; g < G; ++g) {
          std::vector<double> members(choice.begin() + g * size, choice.begin() + (g + 1) * size);
          std::sort(members.rbegin(), members.rend());
          const bool top2 = c.score_func != ScoreFunc::sigmoid || biased;
          gscore[g] = top2 ? members[0] + members[1] : members[0];
        }
        const std::vector<int> gorder = order_desc(gscore);
        kept.assign(gorder.begin(), gorder.begin() + c.n_limited_groups);
        std::sort(kept.begin(), kept.end());
        // Automodel: -inf under sigmoid_with_bias, a multiply by 0 under the others.
        const bool neg_inf = c.group_mask == GroupMask::neg_inf || c.score_func == ScoreFunc::sigmoid_with_bias;
        for (int e = 0; e < E; ++e)
          if (std::find(kept.begin(), kept.end(), e / size) == kept.end()) choice[e] = neg_inf ? -INFINITY : 0.0;
      }
      const std::vector<int> order = order_desc(choice);
      chosen.assign(order.begin(), order.begin() + k);
      for (int e : chosen) weights.push_back(original[e]);
    }
    if (c.norm_topk_prob && k > 1) {
      const double ws = std::accumulate(weights.begin(), weights.end(), 0.0) + 1e-20;
      const double os = std::accumulate(original.begin(), original.end(), 0.0) + 1e-20;
      for (double& v : weights) v /= ws;
      for (double& v : original) v /= os;
    }
    for (int j = 0; j < k; ++j) {
      r.weights.push_back(weights[j] * c.route_scale);
      r.indices.push_back(chosen[j]);
    }
    r.original.insert(r.original.end(), original.begin(), original.end());
    r.kept_groups.push_back(kept);
  }
  return r;
}

Reference reference_of(Gate& gate, const Tensor& x) {
  std::vector<double> b, cb;
  if (gate.bias().value.defined()) b = values(gate.bias().value);
  if (gate.e_score_correction_bias().defined()) cb = values(gate.e_score_correction_bias());
  return reference(gate.config(), values(x), values(gate.weight().value), b, cb);
}

// Aux loss from its definition, given reference original scores and the selected experts.
double reference_aux(const MoEConfig& c, const Reference& r, const std::vector<int>& mask) {
  const int E = c.n_routed_experts, k = c.n_activated_experts;
  const std::size_t T = mask.size();
  double valid = 0;
  for (int m : mask) valid += m;
  const double ctx = std::max(valid, 1.0);
  double loss = 0;
  for (int e = 0; e < E; ++e) {
    double load = 0, score = 0;
    for (std::size_t t = 0; t < T; ++t) {
      if (!mask[t]) continue;
      for (int j = 0; j < k; ++j) load += r.indices[t * k + j] == e;
      score += r.original[t * E + e];
    }
    loss += (load * E / (k * ctx)) * (score / ctx);
  }
  return loss;
}

Tensor bool_mask(const std::vector<int>& m) {
  Tensor t = Tensor::empty({static_cast<std::int64_t>(m.size())}, DType::b8);
  for (std::size_t i = 0; i < m.size(); ++i) t.data<bool>()[i] = m[i] != 0;
  return t;
}

void fill_tensor(const Tensor& t, std::uint64_t seed, double std) {
  fill_normal(t, seed, stream_id("test.gate.param"), 0.0, std);
}

void expect_matches(const GateOutput& out, const Reference& r, double tol) {
  EXPECT_EQ(int_values(out.indices), r.indices);
  const std::vector<double> w = values(out.weights);
  ASSERT_EQ(w.size(), r.weights.size());
  for (std::size_t i = 0; i < w.size(); ++i) EXPECT_NEAR(w[i], r.weights[i], tol) << "weight " << i;
}

}  // namespace

TEST(Gate, ConstructorCreatesParametersFromConfig) {
  MoEConfig c = make_config(ScoreFunc::sigmoid, 8, 2, 5);
  Gate plain(c, std::nullopt);
  EXPECT_EQ(plain.weight().value.shape(), Shape({8, 5}));
  EXPECT_EQ(plain.weight().value.dtype(), DType::f32);
  EXPECT_EQ(plain.weight().name, "weight");
  EXPECT_TRUE(plain.weight().requires_grad);
  EXPECT_FALSE(plain.bias().value.defined());
  EXPECT_FALSE(plain.e_score_correction_bias().defined());
  EXPECT_EQ(plain.parameters().size(), 1u);
  for (double v : values(plain.weight().value)) EXPECT_EQ(v, 0.0);

  c.router_bias = true;
  c.gate_bias_update_factor = 0.001;
  Gate full(c, std::nullopt, DType::f64);
  EXPECT_EQ(full.weight().value.dtype(), DType::f64);
  EXPECT_EQ(full.bias().value.shape(), Shape({8}));
  EXPECT_EQ(full.bias().value.dtype(), DType::f64);
  EXPECT_EQ(full.bias().name, "bias");
  ASSERT_EQ(full.parameters().size(), 2u);
  EXPECT_EQ(full.parameters()[1], &full.bias());
  EXPECT_EQ(full.e_score_correction_bias().shape(), Shape({8}));
  EXPECT_EQ(full.e_score_correction_bias().dtype(), DType::f32);

  MoEConfig forced = make_config(ScoreFunc::sigmoid);
  forced.force_e_score_correction_bias = true;
  forced.train_gate = false;
  Gate frozen(forced, std::nullopt);
  EXPECT_TRUE(frozen.e_score_correction_bias().defined());
  EXPECT_FALSE(frozen.weight().requires_grad);
}

TEST(Gate, RejectsInvalidConfig) {
  auto arg_of = [](const MoEConfig& c, DType param = DType::f32, std::optional<DType> prec = std::nullopt) {
    try {
      Gate g(c, prec, param);
    } catch (const ArgumentError& e) {
      return e.argument();
    }
    return std::string("(no error)");
  };
  MoEConfig c = make_config(ScoreFunc::softmax, 8, 3);
  c.n_activated_experts = 0;
  EXPECT_EQ(arg_of(c), "moe.n_activated_experts");
  c.n_activated_experts = 9;
  EXPECT_EQ(arg_of(c), "moe.n_activated_experts");
  c = make_config(ScoreFunc::sigmoid);
  c.gate_bias_update_factor = 0.01;
  c.train_gate = false;
  EXPECT_EQ(arg_of(c), "moe.train_gate");
  EXPECT_EQ(arg_of(make_config(ScoreFunc::softmax), DType::bf16), "param_dtype");
  EXPECT_EQ(arg_of(make_config(ScoreFunc::softmax), DType::f32, DType::bf16), "backend.gate_precision");
  c = make_config(ScoreFunc::sigmoid, 8, 2);
  c.n_expert_groups = 3;
  EXPECT_EQ(arg_of(c), "moe.n_expert_groups");
  c.n_expert_groups = 4;
  c.n_limited_groups = 5;
  EXPECT_EQ(arg_of(c), "moe.n_limited_groups");
  c.n_limited_groups = 1;
  c.n_activated_experts = 3;  // one kept group of 2 experts cannot supply 3
  EXPECT_EQ(arg_of(c), "moe.n_activated_experts");
  c = make_config(ScoreFunc::softmax_with_bias, 8, 2);
  c.n_expert_groups = 8;  // groups of one expert have no top-2 score
  c.n_limited_groups = 4;
  EXPECT_EQ(arg_of(c), "moe.n_expert_groups");
  c.score_func = ScoreFunc::sigmoid;  // max per group is fine with single-expert groups
  EXPECT_EQ(arg_of(c), "(no error)");
}

TEST(Gate, InitDrawsWeightFromSeededStream) {
  MoEConfig c = make_config(ScoreFunc::softmax, 4, 2, 3);
  c.router_bias = true;
  c.force_e_score_correction_bias = true;
  Gate g(c, std::nullopt, DType::f64);
  g.bias().value.data<double>()[1] = 5.0;
  g.e_score_correction_bias().data<float>()[2] = 5.0f;
  g.init(42, 0.02);
  const std::vector<double> w = values(g.weight().value);
  for (std::size_t i = 0; i < w.size(); ++i)
    EXPECT_DOUBLE_EQ(w[i], 0.02 * normal01(42, stream_id("gate.weight"), i)) << i;
  for (double v : values(g.bias().value)) EXPECT_EQ(v, 0.0);
  for (double v : values(g.e_score_correction_bias())) EXPECT_EQ(v, 0.0);
}

TEST(Gate, SoftmaxTopkFirstMatchesReference) {
  MoEConfig c = make_config(ScoreFunc::softmax, 8, 3, 6);
  c.route_scale = 2.5;
  Gate g(c, std::nullopt, DType::f64);
  g.init(1, 0.7);
  const Tensor x = randn({9, 6}, DType::f64, 11);
  const GateOutput out = g.forward(x, {}, false);
  EXPECT_EQ(out.weights.dtype(), DType::f64);
  EXPECT_EQ(out.indices.dtype(), DType::i64);
  EXPECT_EQ(out.indices.shape(), Shape({9, 3}));
  EXPECT_FALSE(out.aux_loss.has_value());
  expect_matches(out, reference_of(g, x), 1e-13);
  const std::vector<double> w = values(out.weights);
  for (int t = 0; t < 9; ++t) EXPECT_NEAR(w[t * 3] + w[t * 3 + 1] + w[t * 3 + 2], 2.5, 1e-13);
}

TEST(Gate, SoftmaxBeforeTopkMatchesReference) {
  for (bool norm : {false, true}) {
    MoEConfig c = make_config(ScoreFunc::softmax, 8, 3, 6);
    c.softmax_before_topk = true;
    c.norm_topk_prob = norm;
    c.route_scale = 1.5;
    c.router_bias = true;
    Gate g(c, std::nullopt, DType::f64);
    g.init(2, 0.7);
    fill_tensor(g.bias().value, 3, 0.5);
    const Tensor x = randn({9, 6}, DType::f64, 12);
    const GateOutput out = g.forward(x, {}, false);
    expect_matches(out, reference_of(g, x), 1e-13);
    const std::vector<double> w = values(out.weights);
    for (int t = 0; t < 9; ++t) {
      const double sum = w[t * 3] + w[t * 3 + 1] + w[t * 3 + 2];
      if (norm) {
        EXPECT_NEAR(sum, 1.5, 1e-13);
      } else {
        EXPECT_LT(sum, 1.5);  // a full softmax leaves mass on the unselected experts
      }
    }
  }
}

TEST(Gate, SoftmaxWithBiasWithoutCorrectionBiasMatchesReference) {
  MoEConfig c = make_config(ScoreFunc::softmax_with_bias, 8, 2, 6);
  Gate g(c, std::nullopt, DType::f64);
  g.init(4, 0.7);
  const Tensor x = randn({7, 6}, DType::f64, 13);
  const GateOutput out = g.forward(x, {}, false);
  expect_matches(out, reference_of(g, x), 1e-13);
}

TEST(Gate, SigmoidMatchesReferenceAndStaysInUnitInterval) {
  for (bool norm : {false, true}) {
    MoEConfig c = make_config(ScoreFunc::sigmoid, 8, 3, 6);
    c.norm_topk_prob = norm;
    c.route_scale = norm ? 2.0 : 1.0;
    Gate g(c, std::nullopt, DType::f64);
    g.init(5, 0.7);
    const Tensor x = randn({9, 6}, DType::f64, 14);
    const GateOutput out = g.forward(x, {}, false);
    expect_matches(out, reference_of(g, x), 1e-13);
    const std::vector<double> w = values(out.weights);
    for (int t = 0; t < 9; ++t) {
      double sum = 0;
      for (int j = 0; j < 3; ++j) {
        if (!norm) {
          EXPECT_GE(w[t * 3 + j], 0.0);
          EXPECT_LE(w[t * 3 + j], 1.0);
        }
        sum += w[t * 3 + j];
      }
      if (norm) {
        EXPECT_NEAR(sum, 2.0, 1e-13);
      }
    }
  }
}

TEST(Gate, FloatComputeMatchesReferenceWithinFloatPrecision) {
  for (ScoreFunc f : {ScoreFunc::softmax, ScoreFunc::softmax_with_bias, ScoreFunc::sigmoid}) {
    MoEConfig c = make_config(f, 16, 4, 32);
    c.norm_topk_prob = true;
    Gate g(c, std::nullopt);
    g.init(6, 0.3);
    const Tensor x = randn({16, 32}, DType::f32, 15);
    const GateOutput out = g.forward(x, {}, false);
    EXPECT_EQ(out.weights.dtype(), DType::f32);
    const Reference r = reference_of(g, x);
    const std::vector<double> w = values(out.weights);
    for (std::size_t i = 0; i < w.size(); ++i) EXPECT_NEAR(w[i], r.weights[i], 2e-6);
    // No two scores of these inputs lie within float rounding of each other, so selection is exact.
    const std::vector<std::int64_t> idx = int_values(out.indices);
    for (std::size_t i = 0; i < idx.size(); ++i)
      if (idx[i] != r.indices[i]) ADD_FAILURE() << "token " << i / 4 << " selects " << idx[i] << ", fp64 reference "
                                                << r.indices[i];
  }
}

TEST(Gate, GroupLimitedSoftmaxWithBiasKeepsBestGroups) {
  MoEConfig c = make_config(ScoreFunc::softmax_with_bias, 16, 4, 8);
  c.n_expert_groups = 4;
  c.n_limited_groups = 2;
  Gate g(c, std::nullopt, DType::f64);
  g.init(7, 1.0);
  const Tensor x = randn({24, 8}, DType::f64, 16);
  const GateOutput out = g.forward(x, {}, false);
  const Reference r = reference_of(g, x);
  expect_matches(out, r, 1e-13);
  const std::vector<std::int64_t> idx = int_values(out.indices);
  MoEConfig flat = c;
  flat.n_expert_groups = 1;
  const Reference rf = reference(flat, values(x), values(g.weight().value), {}, {});
  bool excluded_a_better_expert = false;
  for (int t = 0; t < 24; ++t) {
    ASSERT_EQ(r.kept_groups[t].size(), 2u);
    for (int j = 0; j < 4; ++j) {
      const int group = static_cast<int>(idx[t * 4 + j]) / 4;
      EXPECT_TRUE(group == r.kept_groups[t][0] || group == r.kept_groups[t][1]) << "token " << t;
    }
    // Plain top-4 over all experts differs for some token: the group limit really acts.
    for (int j = 0; j < 4; ++j) excluded_a_better_expert |= rf.indices[t * 4 + j] != r.indices[t * 4 + j];
  }
  EXPECT_TRUE(excluded_a_better_expert);
}

TEST(Gate, GroupLimitedSigmoidUsesMaxOrTopTwoSum) {
  for (bool corrected : {false, true}) {
    MoEConfig c = make_config(ScoreFunc::sigmoid, 16, 4, 8);
    c.n_expert_groups = 4;
    c.n_limited_groups = 2;
    c.force_e_score_correction_bias = corrected;
    Gate g(c, std::nullopt, DType::f64);
    g.init(8, 1.0);
    if (corrected) fill_tensor(g.e_score_correction_bias(), 9, 0.3);
    const Tensor x = randn({24, 8}, DType::f64, 17);
    const GateOutput out = g.forward(x, {}, false);
    const Reference r = reference_of(g, x);
    expect_matches(out, r, 1e-13);
    const std::vector<std::int64_t> idx = int_values(out.indices);
    for (int t = 0; t < 24; ++t)
      for (int j = 0; j < 4; ++j) {
        const int group = static_cast<int>(idx[t * 4 + j]) / 4;
        EXPECT_TRUE(group == r.kept_groups[t][0] || group == r.kept_groups[t][1]);
      }
  }
}

TEST(Gate, GroupScoreRuleMatters) {
  // One token, E=4 in 2 groups, keep 1, k=1, sigmoid scores s = [0.9, 0.1 | 0.8, 0.7]:
  // max per group keeps group 0 (0.9 > 0.8); the top-2 sum keeps group 1 (1.5 > 1.0).
  MoEConfig c = make_config(ScoreFunc::sigmoid, 4, 1, 1);
  c.n_expert_groups = 2;
  c.n_limited_groups = 1;
  c.router_bias = true;
  const std::vector<double> s = {0.9, 0.1, 0.8, 0.7};
  const Tensor x = Tensor::from_vector(std::vector<double>{0.0}, {1, 1});
  for (bool corrected : {false, true}) {
    c.force_e_score_correction_bias = corrected;
    Gate g(c, std::nullopt, DType::f64);
    for (int e = 0; e < 4; ++e) g.bias().value.data<double>()[e] = std::log(s[e] / (1 - s[e]));
    const GateOutput out = g.forward(x, {}, false);
    EXPECT_EQ(int_values(out.indices)[0], corrected ? 2 : 0);
    EXPECT_NEAR(values(out.weights)[0], corrected ? 0.8 : 0.9, 1e-14);
  }
}

TEST(Gate, GroupMaskFollowsAutomodelPerScoreFunction) {
  // Zero weights: every sigmoid score is 0.5; every softmax score is 1/4. The correction bias makes
  // the biased scores negative, group 0 the kept one (its top-2 sum is the larger). Automodel's
  // multiply-by-0 turns the dropped group 1 into zeros, which beat group 0's negative scores:
  // experts 2 and 3 are selected. sigmoid_with_bias masks with -inf: experts 0 and 1. group_mask
  // "neg_inf" gives -inf everywhere.
  struct Row {
    ScoreFunc f;
    GroupMask mask;
    std::vector<std::int64_t> chosen;
    double weight;
  };
  const std::vector<std::int64_t> dropped_win = {2, 3, 2, 3, 2, 3}, kept_win = {0, 1, 0, 1, 0, 1};
  for (const Row& r : {Row{ScoreFunc::sigmoid, GroupMask::automodel, dropped_win, 0.5},
                       Row{ScoreFunc::softmax_with_bias, GroupMask::automodel, dropped_win, 0.25},
                       Row{ScoreFunc::sigmoid_with_bias, GroupMask::automodel, kept_win, 0.5},
                       Row{ScoreFunc::sigmoid, GroupMask::neg_inf, kept_win, 0.5},
                       Row{ScoreFunc::softmax_with_bias, GroupMask::neg_inf, kept_win, 0.25},
                       Row{ScoreFunc::sigmoid_with_bias, GroupMask::neg_inf, kept_win, 0.5}}) {
    SCOPED_TRACE(std::string(to_string(r.f)) + " / " + std::string(to_string(r.mask)));
    MoEConfig c = make_config(r.f, 4, 2, 3);
    c.n_expert_groups = 2;
    c.n_limited_groups = 1;
    c.force_e_score_correction_bias = true;
    c.group_mask = r.mask;
    Gate g(c, std::nullopt);
    const std::vector<float> cb = {-1, -1, -2, -2};
    std::copy(cb.begin(), cb.end(), g.e_score_correction_bias().data<float>());
    const Tensor x = randn({3, 3}, DType::f32, 40);
    const GateOutput out = g.forward(x, {}, false);
    EXPECT_EQ(int_values(out.indices), r.chosen);
    for (double w : values(out.weights)) EXPECT_FLOAT_EQ(w, r.weight);  // unbiased scores
    expect_matches(out, reference_of(g, x), 1e-7);
  }
}

TEST(Gate, GroupMaskOnlyMattersWithNegativeBiasedScores) {
  // Positive biased scores: the multiply-by-0 and -inf masks select alike (the docs' claim).
  for (ScoreFunc f : {ScoreFunc::sigmoid, ScoreFunc::softmax_with_bias}) {
    MoEConfig c = make_config(f, 16, 4, 8);
    c.n_expert_groups = 4;
    c.n_limited_groups = 2;
    c.force_e_score_correction_bias = true;
    Gate a(c, std::nullopt, DType::f64);
    a.init(41, 1.0);
    fill_tensor(a.e_score_correction_bias(), 42, 0.01);
    for (int e = 0; e < 16; ++e) a.e_score_correction_bias().data<float>()[e] += 0.05f;  // all positive
    c.group_mask = GroupMask::neg_inf;
    Gate b(c, std::nullopt, DType::f64);
    b.weight().value = a.weight().value.clone();
    std::copy(a.e_score_correction_bias().data<float>(), a.e_score_correction_bias().data<float>() + 16,
              b.e_score_correction_bias().data<float>());
    const Tensor x = randn({32, 8}, DType::f64, 43);
    EXPECT_EQ(int_values(a.forward(x, {}, false).indices), int_values(b.forward(x, {}, false).indices));
  }
}

TEST(Gate, SigmoidWithBiasMatchesReferenceWithGroups) {
  for (bool corrected : {false, true}) {
    MoEConfig c = make_config(ScoreFunc::sigmoid_with_bias, 16, 4, 8);
    c.n_expert_groups = 4;
    c.n_limited_groups = 2;
    c.norm_topk_prob = true;
    c.route_scale = 2.5;
    c.force_e_score_correction_bias = corrected;
    Gate g(c, std::nullopt, DType::f64);
    g.init(44, 1.0);
    if (corrected) fill_tensor(g.e_score_correction_bias(), 45, 0.3);
    const Tensor x = randn({24, 8}, DType::f64, 46);
    const GateOutput out = g.forward(x, {}, false);
    const Reference r = reference_of(g, x);
    expect_matches(out, r, 1e-13);
    // Group score = top-2 sum even without a correction bias, and only kept groups are selected.
    const std::vector<std::int64_t> idx = int_values(out.indices);
    for (int t = 0; t < 24; ++t)
      for (int j = 0; j < 4; ++j) {
        const int group = static_cast<int>(idx[t * 4 + j]) / 4;
        EXPECT_TRUE(group == r.kept_groups[t][0] || group == r.kept_groups[t][1]) << "token " << t;
      }
  }
  // Without groups (n_expert_groups 0, as Qwen-style configs write it) it is the biased sigmoid.
  MoEConfig c = make_config(ScoreFunc::sigmoid_with_bias, 8, 2, 6);
  c.n_expert_groups = 0;
  c.n_limited_groups = 0;
  c.force_e_score_correction_bias = true;
  Gate g(c, std::nullopt, DType::f64);
  g.init(47, 0.7);
  fill_tensor(g.e_score_correction_bias(), 48, 0.2);
  const Tensor x = randn({10, 6}, DType::f64, 49);
  expect_matches(g.forward(x, {}, false), reference_of(g, x), 1e-13);
}

TEST(Gate, SqrtSoftplusMatchesReferenceAndIgnoresGroups) {
  MoEConfig c = make_config(ScoreFunc::sqrtsoftplus, 16, 4, 8);
  c.force_e_score_correction_bias = true;
  c.norm_topk_prob = true;
  c.route_scale = 1.5;
  c.router_bias = true;
  Gate g(c, std::nullopt, DType::f64);
  g.init(50, 2.0);  // logits beyond softplus's threshold 20 occur too
  fill_tensor(g.bias().value, 51, 5.0);
  g.bias().value.data<double>()[3] = 30.0;
  fill_tensor(g.e_score_correction_bias(), 52, 0.3);
  const Tensor x = randn({24, 8}, DType::f64, 53);
  const GateOutput out = g.forward(x, {}, false);
  expect_matches(out, reference_of(g, x), 1e-13);
  // Weights from the unbiased scores: sqrt(softplus(z)) for the selected expert, checked directly.
  const std::vector<double> w = values(out.weights);
  const std::vector<std::int64_t> idx = int_values(out.indices);
  for (int t = 0; t < 24; ++t) {
    double sum = 0;
    for (int j = 0; j < 4; ++j) {
      const int e = static_cast<int>(idx[t * 4 + j]);
      double z = read_as_double(g.bias().value, e);
      for (int d = 0; d < 8; ++d) z += read_as_double(x, t * 8 + d) * read_as_double(g.weight().value, e * 8 + d);
      sum += std::sqrt(z > 20 ? z : std::log1p(std::exp(z)));
    }
    for (int j = 0; j < 4; ++j) {
      const int e = static_cast<int>(idx[t * 4 + j]);
      double z = read_as_double(g.bias().value, e);
      for (int d = 0; d < 8; ++d) z += read_as_double(x, t * 8 + d) * read_as_double(g.weight().value, e * 8 + d);
      EXPECT_NEAR(w[t * 4 + j], 1.5 * std::sqrt(z > 20 ? z : std::log1p(std::exp(z))) / (sum + 1e-20), 1e-13);
    }
  }
  // Groups are ignored (Automodel's sqrtsoftplus branch has no group limiting).
  MoEConfig grouped = c;
  grouped.n_expert_groups = 4;
  grouped.n_limited_groups = 1;
  Gate h(grouped, std::nullopt, DType::f64);
  h.weight().value = g.weight().value.clone();
  h.bias().value = g.bias().value.clone();
  std::copy(g.e_score_correction_bias().data<float>(), g.e_score_correction_bias().data<float>() + 16,
            h.e_score_correction_bias().data<float>());
  const GateOutput hout = h.forward(x, {}, false);
  EXPECT_EQ(int_values(hout.indices), idx);
  EXPECT_EQ(values(hout.weights), w);
}

TEST(Gate, SqrtSoftplusRoutesInFloatEvenWithFp64Precision) {
  // Automodel scores sqrt(softplus(logits.float())): with gate_precision f64 the logits are f64 but
  // everything after them is fp32, so the weights equal an fp32 computation from the f32-rounded
  // f64 logits exactly.
  MoEConfig c = make_config(ScoreFunc::sqrtsoftplus, 8, 3, 6);
  Gate g(c, DType::f64);
  g.init(54, 0.7);
  const Tensor x = randn({10, 6}, DType::f32, 55);
  const GateOutput out = g.forward(x, {}, false);
  const std::vector<std::int64_t> idx = int_values(out.indices);
  for (int t = 0; t < 10; ++t)
    for (int j = 0; j < 3; ++j) {
      const int e = static_cast<int>(idx[t * 3 + j]);
      double z = 0;
      for (int d = 0; d < 6; ++d) z += read_as_double(x, t * 6 + d) * read_as_double(g.weight().value, e * 6 + d);
      const float zf = static_cast<float>(z);
      const float want = std::sqrt(std::log1p(std::exp(zf)));
      EXPECT_EQ(out.weights.data<float>()[t * 3 + j], want) << t << "," << j;
    }
}

TEST(Gate, SigmoidWeightsFromBiasedScores) {
  // router_weight_uses_score_correction_bias: weights = sigmoid + bias at the selected experts, and
  // the aux loss reads the biased scores too. Other score functions ignore the flag.
  MoEConfig c = make_config(ScoreFunc::sigmoid, 8, 3, 6);
  c.router_weight_uses_score_correction_bias = true;
  c.force_e_score_correction_bias = true;
  c.norm_topk_prob = true;
  c.aux_loss_coeff = 0.01;
  Gate g(c, std::nullopt, DType::f64);
  g.init(56, 0.7);
  fill_tensor(g.e_score_correction_bias(), 57, 0.2);
  const Tensor x = randn({10, 6}, DType::f64, 58);
  const std::vector<int> mask = {1, 1, 0, 1, 1, 1, 1, 0, 1, 1};
  const GateOutput out = g.forward(x, bool_mask(mask), true);
  const Reference r = reference_of(g, x);
  expect_matches(out, r, 1e-13);
  EXPECT_NEAR(*out.aux_loss, reference_aux(c, r, mask), 1e-13);
  MoEConfig unbiased = c;
  unbiased.router_weight_uses_score_correction_bias = false;
  const Reference ru =
      reference(unbiased, values(x), values(g.weight().value), {}, values(g.e_score_correction_bias()));
  EXPECT_EQ(r.indices, ru.indices);  // the selection is the same; only the weights move
  bool differs = false;
  for (std::size_t i = 0; i < r.weights.size(); ++i) differs |= std::fabs(r.weights[i] - ru.weights[i]) > 1e-6;
  EXPECT_TRUE(differs);
  for (ScoreFunc f : {ScoreFunc::softmax_with_bias, ScoreFunc::sigmoid_with_bias, ScoreFunc::sqrtsoftplus}) {
    MoEConfig o = c;
    o.score_func = f;
    Gate og(o, std::nullopt, DType::f64);
    og.weight().value = g.weight().value.clone();
    std::copy(g.e_score_correction_bias().data<float>(), g.e_score_correction_bias().data<float>() + 8,
              og.e_score_correction_bias().data<float>());
    MoEConfig plain = o;
    plain.router_weight_uses_score_correction_bias = false;
    expect_matches(og.forward(x, {}, false),
                   reference(plain, values(x), values(og.weight().value), {}, values(og.e_score_correction_bias())),
                   1e-13);
  }
}

TEST(Gate, CorrectionBiasSteersSelectionButNotWeights) {
  for (ScoreFunc f : {ScoreFunc::softmax_with_bias, ScoreFunc::sigmoid}) {
    MoEConfig c = make_config(f, 8, 2, 6);
    c.force_e_score_correction_bias = true;
    Gate g(c, std::nullopt, DType::f64);
    g.init(10, 0.7);
    const Tensor x = randn({10, 6}, DType::f64, 18);
    const GateOutput before = g.forward(x, {}, false);
    g.e_score_correction_bias().data<float>()[6] = 10.0f;  // expert 6 now always wins
    const GateOutput after = g.forward(x, {}, false);
    const std::vector<std::int64_t> idx = int_values(after.indices);
    const std::vector<double> w = values(after.weights);
    const Reference r = reference_of(g, x);
    bool changed = false;
    for (int t = 0; t < 10; ++t) {
      EXPECT_EQ(idx[t * 2], 6);
      changed |= int_values(before.indices)[t * 2] != 6;
      // The weight is the unbiased score of expert 6, not score + 10.
      EXPECT_NEAR(w[t * 2], r.weights[t * 2], 1e-13);
      EXPECT_LT(w[t * 2], 1.0);
    }
    EXPECT_TRUE(changed);
    expect_matches(after, reference_of(g, x), 1e-13);
  }
}

TEST(Gate, PlainSoftmaxIgnoresCorrectionBiasAndGroups) {
  // Groups that would be invalid for a grouped score function (3 does not divide 8) are accepted.
  MoEConfig odd = make_config(ScoreFunc::softmax, 8, 2, 6);
  odd.n_expert_groups = 3;
  odd.n_limited_groups = 5;
  EXPECT_NO_THROW(Gate(odd, std::nullopt));
  MoEConfig c = make_config(ScoreFunc::softmax, 8, 2, 6);
  Gate ref_gate(c, std::nullopt, DType::f64);
  ref_gate.init(11, 0.7);
  c.force_e_score_correction_bias = true;
  c.n_expert_groups = 4;
  c.n_limited_groups = 1;
  Gate g(c, std::nullopt, DType::f64);
  g.init(11, 0.7);
  g.e_score_correction_bias().data<float>()[0] = 10.0f;
  const Tensor x = randn({10, 6}, DType::f64, 19);
  const GateOutput a = g.forward(x, {}, false), b = ref_gate.forward(x, {}, false);
  EXPECT_EQ(int_values(a.indices), int_values(b.indices));
  EXPECT_EQ(values(a.weights), values(b.weights));
}

TEST(Gate, TiesPickLowerIndices) {
  // All-zero weights: every logit is 0, every score ties.
  for (ScoreFunc f : {ScoreFunc::softmax, ScoreFunc::softmax_with_bias, ScoreFunc::sigmoid}) {
    for (bool before : {false, true}) {
      MoEConfig c = make_config(f, 8, 3, 4);
      c.softmax_before_topk = before;
      Gate g(c, std::nullopt);
      const GateOutput out = g.forward(randn({5, 4}, DType::f32, 20), {}, false);
      const std::vector<std::int64_t> idx = int_values(out.indices);
      for (int t = 0; t < 5; ++t)
        for (int j = 0; j < 3; ++j) EXPECT_EQ(idx[t * 3 + j], j);
    }
  }
  // Tied groups: groups 2 and 3 tie above groups 0 and 1; group 2 wins, then experts 4 before 5.
  MoEConfig c = make_config(ScoreFunc::softmax_with_bias, 8, 2, 4);
  c.n_expert_groups = 4;
  c.n_limited_groups = 1;
  c.router_bias = true;
  Gate g(c, std::nullopt);
  const std::vector<float> b = {0, 0, 0, 0, 1, 1, 1, 1};
  std::copy(b.begin(), b.end(), g.bias().value.data<float>());
  const GateOutput out = g.forward(randn({3, 4}, DType::f32, 21), {}, false);
  EXPECT_EQ(int_values(out.indices), (std::vector<std::int64_t>{4, 5, 4, 5, 4, 5}));
}

TEST(Gate, Fp64PrecisionWithFp32InputSelectsLikeFp64Reference) {
  for (ScoreFunc f : {ScoreFunc::softmax, ScoreFunc::softmax_with_bias, ScoreFunc::sigmoid}) {
    MoEConfig c = make_config(f, 64, 8, 48);
    c.norm_topk_prob = true;
    c.force_e_score_correction_bias = f != ScoreFunc::softmax;
    if (f != ScoreFunc::softmax) {
      c.n_expert_groups = 8;
      c.n_limited_groups = 4;
    }
    Gate g(c, DType::f64);  // f32 parameters, fp64 router math
    g.init(12, 0.02);       // small logits: many near ties, where f32 math would drift
    if (c.force_e_score_correction_bias) fill_tensor(g.e_score_correction_bias(), 13, 1e-3);
    const Tensor x = randn({256, 48}, DType::f32, 22);
    const GateOutput out = g.forward(x, {}, false);
    EXPECT_EQ(out.weights.dtype(), DType::f32);
    const Reference r = reference_of(g, x);
    EXPECT_EQ(int_values(out.indices), r.indices);
    const std::vector<double> w = values(out.weights);
    for (std::size_t i = 0; i < w.size(); ++i)
      EXPECT_EQ(static_cast<float>(w[i]), static_cast<float>(r.weights[i])) << i;
  }
}

TEST(Gate, ExpertLoadCountsUnmaskedTokensOnly) {
  MoEConfig c = make_config(ScoreFunc::sigmoid, 8, 3, 6);
  Gate g(c, std::nullopt);
  g.init(14, 0.7);
  const Tensor x = randn({12, 6}, DType::f32, 23);
  const std::vector<int> mask = {1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1, 1};
  const GateOutput out = g.forward(x, bool_mask(mask), false);
  const std::vector<std::int64_t> idx = int_values(out.indices);
  std::vector<std::int64_t> expected(8, 0);
  for (int t = 0; t < 12; ++t)
    if (mask[t])
      for (int j = 0; j < 3; ++j) ++expected[idx[t * 3 + j]];
  EXPECT_EQ(out.expert_load, expected);
  EXPECT_EQ(std::accumulate(expected.begin(), expected.end(), std::int64_t{0}), 8 * 3);
  // Padding tokens are still routed (the layer drops them later).
  const GateOutput all = g.forward(x, {}, false);
  EXPECT_EQ(int_values(all.indices), idx);
  EXPECT_EQ(std::accumulate(all.expert_load.begin(), all.expert_load.end(), std::int64_t{0}), 12 * 3);
}

TEST(Gate, AuxLossMatchesFormula) {
  struct Case {
    ScoreFunc f;
    bool before, norm;
  };
  for (Case cs : {Case{ScoreFunc::softmax, false, false}, Case{ScoreFunc::softmax, false, true},
                  Case{ScoreFunc::softmax, true, false}, Case{ScoreFunc::softmax_with_bias, false, true},
                  Case{ScoreFunc::sigmoid, false, false}, Case{ScoreFunc::sigmoid, false, true}}) {
    MoEConfig c = make_config(cs.f, 8, 2, 6);
    c.softmax_before_topk = cs.before;
    c.norm_topk_prob = cs.norm;
    c.aux_loss_coeff = 0.01;
    Gate g(c, std::nullopt, DType::f64);
    g.init(15, 0.7);
    const Tensor x = randn({10, 6}, DType::f64, 24);
    const std::vector<int> mask = {1, 1, 1, 0, 1, 1, 0, 1, 1, 1};
    const GateOutput out = g.forward(x, bool_mask(mask), true);
    ASSERT_TRUE(out.aux_loss.has_value());
    EXPECT_TRUE(std::isfinite(*out.aux_loss));
    EXPECT_GE(*out.aux_loss, 0.0);
    EXPECT_NEAR(*out.aux_loss, reference_aux(c, reference_of(g, x), mask), 1e-13);
  }
}

TEST(Gate, AuxLossStaysNonNegativeWithNegativeLogits) {
  // Automodel once used raw logits as P_e for top-k-first softmax, which made the loss negative.
  for (ScoreFunc f : {ScoreFunc::softmax, ScoreFunc::sigmoid}) {
    for (bool before : {false, true}) {
      MoEConfig c = make_config(f, 8, 2, 6);
      c.softmax_before_topk = before;
      c.aux_loss_coeff = 0.1;
      c.router_bias = true;
      Gate g(c, std::nullopt);
      g.init(16, 2.0);
      for (int e = 0; e < 8; ++e) g.bias().value.data<float>()[e] = -20.0f;
      const GateOutput out = g.forward(randn({32, 6}, DType::f32, 25, 3.0), {}, true);
      ASSERT_TRUE(out.aux_loss.has_value());
      EXPECT_TRUE(std::isfinite(*out.aux_loss));
      EXPECT_GE(*out.aux_loss, 0.0);
    }
  }
}

TEST(Gate, AuxLossAbsentWithoutCoefficientOrTraining) {
  MoEConfig c = make_config(ScoreFunc::softmax, 8, 2, 6);
  const Tensor x = randn({4, 6}, DType::f32, 26);
  Gate off(c, std::nullopt);
  EXPECT_FALSE(off.forward(x, {}, true).aux_loss.has_value());
  c.aux_loss_coeff = 0.01;
  Gate on(c, std::nullopt);
  EXPECT_FALSE(on.forward(x, {}, false).aux_loss.has_value());
  EXPECT_TRUE(on.forward(x, {}, true).aux_loss.has_value());
  // Every token masked: Lctx clamps to 1 and the loss is exactly 0.
  const GateOutput masked = on.forward(x, bool_mask({0, 0, 0, 0}), true);
  ASSERT_TRUE(masked.aux_loss.has_value());
  EXPECT_EQ(*masked.aux_loss, 0.0);
}

namespace {
// A second, simulated rank whose load is added by the "all-reduce".
class AddingGroup : public ProcessGroup {
 public:
  explicit AddingGroup(std::vector<double> other) : other_(std::move(other)) {}
  int rank() const override { return 0; }
  int size() const override { return 2; }
  void all_reduce_sum(const TensorView& t, const std::string&) override {
    ASSERT_EQ(t.dtype, DType::f64);
    ASSERT_EQ(t.numel(), static_cast<std::int64_t>(other_.size()));
    for (std::size_t i = 0; i < other_.size(); ++i) t.ptr<double>()[i] += other_[i];
    ++calls;
  }
  void barrier(const std::string&) override {}
  int calls = 0;

 private:
  std::vector<double> other_;
};
}  // namespace

TEST(Gate, UpdateBiasMovesTowardBalanceAndClearsLoad) {
  MoEConfig c = make_config(ScoreFunc::sigmoid, 4, 1, 3);
  c.gate_bias_update_factor = 0.01;
  Gate g(c, std::nullopt);  // zero weights: every score ties, expert 0 takes all tokens
  const Tensor x = randn({6, 3}, DType::f32, 27);
  g.forward(x, {}, false);
  EXPECT_TRUE(g.cumulative_load().empty());  // eval forwards do not count
  g.forward(x, {}, true);
  g.forward(x, bool_mask({1, 1, 1, 0, 0, 0}), true);
  EXPECT_EQ(g.cumulative_load(), (std::vector<std::int64_t>{9, 0, 0, 0}));
  g.update_bias(nullptr);
  EXPECT_TRUE(g.cumulative_load().empty());
  const float* b = g.e_score_correction_bias().data<float>();
  EXPECT_FLOAT_EQ(b[0], -0.01f);  // above the mean load: pushed down
  for (int e = 1; e < 4; ++e) EXPECT_FLOAT_EQ(b[e], 0.01f);
  // Experts 1..3 now tie above expert 0; expert 1 wins and gets everything.
  g.forward(x, {}, true);
  EXPECT_EQ(g.cumulative_load(), (std::vector<std::int64_t>{0, 6, 0, 0}));
  g.update_bias(nullptr);
  EXPECT_NEAR(b[0], 0.0, 1e-9);
  EXPECT_NEAR(b[1], 0.0, 1e-9);
  EXPECT_NEAR(b[2], 0.02, 1e-9);
  EXPECT_NEAR(b[3], 0.02, 1e-9);
  EXPECT_THROW(g.update_bias(nullptr), Error);  // load was cleared
}

TEST(Gate, UpdateBiasSumsLoadOverGroup) {
  MoEConfig c = make_config(ScoreFunc::sigmoid, 4, 2, 3);
  c.gate_bias_update_factor = 0.5;
  Gate g(c, std::nullopt);
  g.forward(randn({5, 3}, DType::f32, 28), {}, true);  // load {5, 5, 0, 0}
  AddingGroup group({0, 0, 5, 5});                      // the other rank balances it exactly
  g.update_bias(&group);
  EXPECT_EQ(group.calls, 1);
  for (int e = 0; e < 4; ++e) EXPECT_EQ(g.e_score_correction_bias().data<float>()[e], 0.0f);
  g.forward(randn({5, 3}, DType::f32, 28), {}, true);
  AddingGroup skewed({0, 0, 5, 0});  // total {5, 5, 5, 0}, mean 3.75
  g.update_bias(&skewed);
  const float* b = g.e_score_correction_bias().data<float>();
  EXPECT_EQ(b[0], -0.5f);
  EXPECT_EQ(b[1], -0.5f);
  EXPECT_EQ(b[2], -0.5f);
  EXPECT_EQ(b[3], 0.5f);
}

TEST(Gate, UpdateBiasFollowsExternalWritesToTheBuffer) {
  MoEConfig c = make_config(ScoreFunc::sigmoid, 4, 1, 3);
  c.gate_bias_update_factor = 0.25;
  Gate g(c, std::nullopt);
  const Tensor x = randn({4, 3}, DType::f32, 29);
  g.forward(x, {}, true);
  g.update_bias(nullptr);  // {-0.25, 0.25, 0.25, 0.25}
  g.e_score_correction_bias().data<float>()[3] = 2.0f;  // e.g. a checkpoint load
  g.forward(x, {}, true);  // expert 3 wins everything
  g.update_bias(nullptr);
  const float* b = g.e_score_correction_bias().data<float>();
  EXPECT_EQ(b[0], 0.0f);
  EXPECT_EQ(b[1], 0.5f);
  EXPECT_EQ(b[2], 0.5f);
  EXPECT_EQ(b[3], 1.75f);
}

TEST(Gate, UpdateBiasErrorsWhenDisabled) {
  MoEConfig c = make_config(ScoreFunc::sigmoid, 4, 1, 3);
  Gate disabled(c, std::nullopt);
  disabled.forward(randn({4, 3}, DType::f32, 30), {}, true);
  EXPECT_THROW(disabled.update_bias(nullptr), Error);
  c.force_e_score_correction_bias = true;  // a bias to route with, but no update factor
  Gate forced(c, std::nullopt);
  forced.forward(randn({4, 3}, DType::f32, 30), {}, true);
  EXPECT_TRUE(forced.cumulative_load().empty());
  EXPECT_THROW(forced.update_bias(nullptr), Error);
  c.gate_bias_update_factor = 0.1;
  Gate fresh(c, std::nullopt);
  EXPECT_THROW(fresh.update_bias(nullptr), Error);  // no training forward yet
}

TEST(Gate, RejectsBadInputs) {
  MoEConfig c = make_config(ScoreFunc::softmax, 8, 2, 6);
  Gate g(c, std::nullopt);
  auto arg_of = [&](const TensorView& x, const TensorView& mask) {
    try {
      g.forward(x, mask, false);
    } catch (const ArgumentError& e) {
      return e.argument();
    }
    return std::string("(no error)");
  };
  EXPECT_EQ(arg_of(randn({4, 5}, DType::f32, 31), {}), "x");
  EXPECT_EQ(arg_of(randn({4, 6, 1}, DType::f32, 31), {}), "x");
  EXPECT_EQ(arg_of(randn({4, 6}, DType::f64, 31), {}), "x");
  EXPECT_EQ(arg_of(TensorView(), {}), "x");
  EXPECT_EQ(arg_of(randn({4, 6}, DType::f32, 31), bool_mask({1, 1, 1})), "token_mask");
  EXPECT_EQ(arg_of(randn({4, 6}, DType::f32, 31), Tensor::zeros({4}, DType::f32)), "token_mask");
  EXPECT_EQ(arg_of(randn({0, 6}, DType::f32, 31), {}), "(no error)");

  const GateOutput out = g.forward(randn({4, 6}, DType::f32, 31), {}, false);
  try {
    g.backward(out, Tensor::zeros({4, 3}, DType::f32));
    ADD_FAILURE() << "no error";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), "grad_weights");
  }
  try {
    g.backward(GateOutput{}, Tensor::zeros({4, 2}, DType::f32));
    ADD_FAILURE() << "no error";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), "forward_output");
  }
}

TEST(Gate, BackwardAccumulatesAndHonoursRequiresGrad) {
  MoEConfig c = make_config(ScoreFunc::sigmoid, 8, 2, 6);
  c.router_bias = true;
  Gate g(c, std::nullopt, DType::f64);
  g.init(17, 0.7);
  const Tensor x = randn({5, 6}, DType::f64, 32);
  const Tensor gw = randn({5, 2}, DType::f64, 33);
  const GateOutput out = g.forward(x, {}, true);
  const Tensor gx1 = g.backward(out, gw);
  EXPECT_EQ(gx1.dtype(), DType::f64);
  EXPECT_EQ(gx1.shape(), Shape({5, 6}));
  const std::vector<double> w1 = values(g.weight().grad), b1 = values(g.bias().grad);
  const Tensor gx2 = g.backward(out, gw);
  EXPECT_EQ(values(gx1), values(gx2));
  const std::vector<double> w2 = values(g.weight().grad), b2 = values(g.bias().grad);
  for (std::size_t i = 0; i < w1.size(); ++i) EXPECT_DOUBLE_EQ(w2[i], 2 * w1[i]);
  for (std::size_t i = 0; i < b1.size(); ++i) EXPECT_DOUBLE_EQ(b2[i], 2 * b1[i]);

  c.train_gate = false;
  Gate frozen(c, std::nullopt, DType::f64);
  frozen.init(17, 0.7);
  const Tensor gx = frozen.backward(frozen.forward(x, {}, true), gw);
  EXPECT_EQ(values(gx), values(gx1));
  EXPECT_FALSE(frozen.weight().grad.defined());
  EXPECT_FALSE(frozen.bias().grad.defined());

  // f32 gate: grads in f32, grad_x in f32.
  MoEConfig c32 = make_config(ScoreFunc::softmax, 8, 2, 6);
  Gate g32(c32, std::nullopt);
  g32.init(18, 0.7);
  const Tensor gx32 = g32.backward(g32.forward(randn({5, 6}, DType::f32, 34), {}, true), randn({5, 2}, DType::f32, 35));
  EXPECT_EQ(gx32.dtype(), DType::f32);
  EXPECT_EQ(g32.weight().grad.dtype(), DType::f32);
}

// ---- Finite-difference gradient checks (fp64) ----

namespace {

struct GradCase {
  std::string name;
  ScoreFunc f;
  bool before = false, norm = false, bias = false, corrected = false, masked = false;
  double route_scale = 1.0, aux = 0.0;
  int topk = 3, groups = 1, limited = 1;
  bool biased_weights = false;  // router_weight_uses_score_correction_bias
  GroupMask mask = GroupMask::automodel;
};

std::ostream& operator<<(std::ostream& os, const GradCase& c) { return os << c.name; }

class GateGradient : public ::testing::TestWithParam<GradCase> {};

// J = sum(weights * R) + coeff * scale * aux; also checks that the selection did not change.
double objective(Gate& g, const Tensor& x, const Tensor& mask, const std::vector<double>& R,
                 const std::vector<std::int64_t>& expected_indices) {
  const GateOutput out = g.forward(x, mask, true);
  EXPECT_EQ(int_values(out.indices), expected_indices) << "selection flipped under the perturbation";
  const std::vector<double> w = values(out.weights);
  double j = 0;
  for (std::size_t i = 0; i < w.size(); ++i) j += w[i] * R[i];
  if (out.aux_loss) j += g.config().aux_loss_coeff * g.aux_loss_scale * *out.aux_loss;
  return j;
}

void expect_close(double numeric, double analytic, const std::string& what) {
  EXPECT_NEAR(analytic, numeric, 1e-8 + 1e-6 * std::abs(numeric)) << what;
}

}  // namespace

TEST_P(GateGradient, MatchesFiniteDifferences) {
  const GradCase& p = GetParam();
  MoEConfig c = make_config(p.f, 8, p.topk, 5);
  c.softmax_before_topk = p.before;
  c.norm_topk_prob = p.norm;
  c.router_bias = p.bias;
  c.force_e_score_correction_bias = p.corrected;
  c.route_scale = p.route_scale;
  c.aux_loss_coeff = p.aux;
  c.n_expert_groups = p.groups;
  c.n_limited_groups = p.limited;
  c.router_weight_uses_score_correction_bias = p.biased_weights;
  c.group_mask = p.mask;
  Gate g(c, std::nullopt, DType::f64);
  g.init(100, 0.8);
  g.aux_loss_scale = 1.7;
  if (p.bias) fill_tensor(g.bias().value, 101, 0.4);
  if (p.corrected) fill_tensor(g.e_score_correction_bias(), 102, 0.1);
  const std::int64_t T = 6;
  const Tensor x = randn({T, 5}, DType::f64, 103);
  const Tensor mask = p.masked ? bool_mask({1, 1, 0, 1, 1, 0}) : Tensor();
  const Tensor R = randn({T, p.topk}, DType::f64, 104);
  const std::vector<double> r = values(R);

  const GateOutput out = g.forward(x, mask, true);
  EXPECT_EQ(out.aux_loss.has_value(), p.aux > 0);
  const std::vector<std::int64_t> idx = int_values(out.indices);
  const std::vector<double> gx = values(g.backward(out, R));
  const std::vector<double> gw = values(g.weight().grad);
  const std::vector<double> gb = p.bias ? values(g.bias().grad) : std::vector<double>();

  const double h = 1e-6;
  auto central = [&](double* v) {
    const double keep = *v;
    *v = keep + h;
    const double plus = objective(g, x, mask, r, idx);
    *v = keep - h;
    const double minus = objective(g, x, mask, r, idx);
    *v = keep;
    return (plus - minus) / (2 * h);
  };
  double largest = 0;
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    const double n = central(x.data<double>() + i);
    expect_close(n, gx[static_cast<std::size_t>(i)], "grad_x[" + std::to_string(i) + "]");
    largest = std::max(largest, std::abs(n));
  }
  for (std::int64_t i = 0; i < g.weight().value.numel(); ++i)
    expect_close(central(g.weight().value.data<double>() + i), gw[static_cast<std::size_t>(i)],
                 "grad_W[" + std::to_string(i) + "]");
  if (p.bias)
    for (std::int64_t i = 0; i < g.bias().value.numel(); ++i)
      expect_close(central(g.bias().value.data<double>() + i), gb[static_cast<std::size_t>(i)],
                   "grad_b[" + std::to_string(i) + "]");
  EXPECT_GT(largest, 1e-3);  // the check is not vacuous
}

INSTANTIATE_TEST_SUITE_P(
    Gate, GateGradient,
    ::testing::Values(
        GradCase{"softmax", ScoreFunc::softmax},
        GradCase{"softmax_norm_scale_bias_aux", ScoreFunc::softmax, false, true, true, false, true, 2.5, 0.1},
        GradCase{"softmax_before_aux", ScoreFunc::softmax, true, false, false, false, false, 1.0, 0.2},
        GradCase{"softmax_before_norm_bias_aux", ScoreFunc::softmax, true, true, true, false, true, 1.5, 0.1},
        GradCase{"softmax_with_bias", ScoreFunc::softmax_with_bias, false, false, true},
        GradCase{"softmax_with_bias_groups_corr_norm_aux", ScoreFunc::softmax_with_bias, false, true, true, true,
                 true, 2.0, 0.3, 3, 4, 2},
        GradCase{"sigmoid", ScoreFunc::sigmoid, false, false, true, false, false, 2.5},
        GradCase{"sigmoid_norm_aux", ScoreFunc::sigmoid, false, true, false, false, true, 1.0, 0.2},
        GradCase{"sigmoid_groups_max_norm_aux", ScoreFunc::sigmoid, false, true, true, false, false, 1.0, 0.1, 3, 4,
                 2},
        GradCase{"sigmoid_groups_corr_norm_aux", ScoreFunc::sigmoid, false, true, true, true, true, 2.5, 0.2, 3, 4,
                 2},
        GradCase{"sigmoid_k1_norm_ignored_aux", ScoreFunc::sigmoid, false, true, true, false, false, 1.0, 0.2, 1},
        GradCase{"sigmoid_with_bias_groups_corr_norm_aux", ScoreFunc::sigmoid_with_bias, false, true, true, true, true,
                 2.5, 0.2, 3, 4, 2},
        GradCase{"sigmoid_with_bias_groups", ScoreFunc::sigmoid_with_bias, false, false, false, false, false, 1.0, 0.1,
                 3, 4, 2},
        GradCase{"sqrtsoftplus", ScoreFunc::sqrtsoftplus, false, false, false, false, false, 2.0},
        GradCase{"sqrtsoftplus_corr_norm_bias_aux", ScoreFunc::sqrtsoftplus, false, true, true, true, true, 1.5, 0.2},
        GradCase{"sigmoid_biased_weights_norm_aux", ScoreFunc::sigmoid, false, true, true, true, true, 1.0, 0.2, 3, 1,
                 1, true},
        GradCase{"sigmoid_biased_weights_groups", ScoreFunc::sigmoid, false, false, false, true, false, 2.0, 0.1, 3, 4,
                 2, true},
        GradCase{"softmax_with_bias_groups_neg_inf", ScoreFunc::softmax_with_bias, false, true, true, true, true, 2.0,
                 0.3, 3, 4, 2, false, GroupMask::neg_inf}),
    [](const ::testing::TestParamInfo<GradCase>& info) { return info.param.name; });
