// The CPU gate's roundings for 16-bit inputs, against an emulation of Automodel's Gate.forward
// written here: without a gate precision, F.linear runs in x's dtype (the weight cast to it, fp32
// accumulation, logits rounded to bf16), the scores are fp32 from the rounded logits, and the
// weights are cast to bf16 unless router_weights_fp32. With a gate precision the logits are not
// rounded, only the weights.
//
// Data: x on a 1/16 grid in [-1, 1], W on a 1/64 grid in [-1/4, 1/4] (bf16-exact). Every product is
// a multiple of 2^-10 and every partial sum of 32 of them stays far below 2^24 such units, so the
// fp32 dot product is exact in any order and the emulation's logits are the gate's bit for bit. The
// emulation scores in fp32 with the same formulas as Automodel (and the gate), so weights are
// compared bit for bit too.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "flexep/core/random.h"
#include "flexep/layer/gate.h"

using namespace flexep;

namespace {

constexpr int kE = 16, kK = 4, kD = 32;
constexpr std::int64_t kT = 512;

MoEConfig config(ScoreFunc f) {
  MoEConfig c;
  c.n_routed_experts = kE;
  c.n_activated_experts = kK;
  c.dim = kD;
  c.score_func = f;
  c.norm_topk_prob = f == ScoreFunc::sigmoid;
  return c;
}

// f32 tensor of step * q, q uniform in [-half, half].
Tensor grid(Shape shape, std::uint64_t seed, int half, double step) {
  Tensor t = Tensor::empty(shape, DType::f32);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    const int q = static_cast<int>(uniform01(seed, stream_id("rounding.grid"), static_cast<std::uint64_t>(i)) *
                                   (2 * half + 1));
    t.data<float>()[i] = static_cast<float>((std::min(q, 2 * half) - half) * step);
  }
  return t;
}

float round_bf16(float v) { return bf16::from_float(v).to_float(); }

struct Emulated {
  std::vector<std::int64_t> indices;  // [T, k]
  std::vector<float> weights;         // [T, k] fp32, before the cast to x's dtype
};

// Automodel's Gate for softmax (top-k first), softmax_with_bias and sigmoid (no groups, no
// correction bias), in fp32 from logits that are rounded to bf16 or not.
Emulated emulate(const MoEConfig& c, const Tensor& x, const Tensor& w, bool round_logits) {
  Emulated r;
  for (std::int64_t t = 0; t < x.size(0); ++t) {
    std::vector<float> z(kE), p(kE);
    for (int e = 0; e < kE; ++e) {
      double acc = 0;  // exact on these grids
      for (int d = 0; d < kD; ++d) acc += double(x.data<float>()[t * kD + d]) * double(w.data<float>()[e * kD + d]);
      z[e] = round_logits ? round_bf16(static_cast<float>(acc)) : static_cast<float>(acc);
    }
    if (c.score_func == ScoreFunc::sigmoid) {
      for (int e = 0; e < kE; ++e) p[e] = 1.0f / (1.0f + std::exp(-z[e]));
    } else {
      float m = z[0];
      for (int e = 1; e < kE; ++e) m = std::max(m, z[e]);
      float sum = 0;
      for (int e = 0; e < kE; ++e) sum += (p[e] = std::exp(z[e] - m));
      for (int e = 0; e < kE; ++e) p[e] /= sum;
    }
    const std::vector<float>& key = c.score_func == ScoreFunc::softmax ? z : p;
    std::vector<int> order(kE);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return key[a] > key[b]; });  // ties: lower first
    std::vector<float> w0(kK);
    for (int j = 0; j < kK; ++j) w0[j] = c.score_func == ScoreFunc::softmax ? z[order[j]] : p[order[j]];
    if (c.score_func == ScoreFunc::softmax) {
      const float m = w0[0];
      float sum = 0;
      for (float& v : w0) sum += (v = std::exp(v - m));
      for (float& v : w0) v /= sum;
    }
    float denom = 1;
    if (c.norm_topk_prob) {
      denom = 0;
      for (float v : w0) denom += v;
      denom += 1e-20f;
    }
    for (int j = 0; j < kK; ++j) {
      r.indices.push_back(order[j]);
      r.weights.push_back(w0[j] / denom * static_cast<float>(c.route_scale));
    }
  }
  return r;
}

std::vector<std::int64_t> indices_of(const GateOutput& o) {
  return std::vector<std::int64_t>(o.indices.data<std::int64_t>(), o.indices.data<std::int64_t>() + o.indices.numel());
}

struct Inputs {
  Tensor x, w;  // f32 holding bf16-exact values
};
Inputs inputs(std::uint64_t seed) {
  return {grid({kT, kD}, seed, 16, 1.0 / 16), grid({kE, kD}, seed + 1, 16, 1.0 / 64)};
}

Gate gate_with(const MoEConfig& c, std::optional<DType> precision, const Tensor& w) {
  Gate g(c, precision, DType::f32);
  std::copy(w.data<float>(), w.data<float>() + w.numel(), g.weight().value.data<float>());
  return g;
}

}  // namespace

TEST(GateRounding, Bf16InputRoundsLogitsAndWeightsLikeAutomodel) {
  for (ScoreFunc f : {ScoreFunc::softmax, ScoreFunc::softmax_with_bias, ScoreFunc::sigmoid}) {
    SCOPED_TRACE(std::string(to_string(f)));
    const MoEConfig c = config(f);
    const Inputs in = inputs(3);
    Gate g = gate_with(c, std::nullopt, in.w);
    const GateOutput out = g.forward(in.x.to(DType::bf16), {}, false);
    ASSERT_EQ(out.weights.dtype(), DType::bf16);  // weights.type_as(x)
    const Emulated em = emulate(c, in.x, in.w, true);
    EXPECT_EQ(indices_of(out), em.indices);
    for (std::size_t i = 0; i < em.weights.size(); ++i)
      ASSERT_EQ(read_as_double(out.weights, static_cast<std::int64_t>(i)), round_bf16(em.weights[i])) << i;
    // The rounding is real: on unrounded logits some tokens select other experts (bf16 ties go to
    // the lower index, or two experts swap order).
    const Emulated exact = emulate(c, in.x, in.w, false);
    int differ = 0;
    for (std::int64_t t = 0; t < kT; ++t)
      differ += !std::equal(em.indices.begin() + t * kK, em.indices.begin() + (t + 1) * kK, exact.indices.begin() + t * kK);
    std::printf("  %s: %d of %lld tokens select differently from unrounded logits\n", std::string(to_string(f)).c_str(),
                differ, static_cast<long long>(kT));
    EXPECT_GT(differ, 0);
    // An f32 x runs the whole gate in fp32 and rounds nothing: it is the unrounded emulation.
    const GateOutput f32 = g.forward(in.x, {}, false);
    EXPECT_EQ(indices_of(f32), exact.indices);
    for (std::size_t i = 0; i < exact.weights.size(); ++i) ASSERT_EQ(f32.weights.data<float>()[i], exact.weights[i]);
  }
}

TEST(GateRounding, RouterWeightsFp32KeepsTheFp32Weights) {
  for (ScoreFunc f : {ScoreFunc::softmax, ScoreFunc::sigmoid}) {
    SCOPED_TRACE(std::string(to_string(f)));
    MoEConfig c = config(f);
    c.router_weights_fp32 = true;
    const Inputs in = inputs(5);
    Gate g = gate_with(c, std::nullopt, in.w);
    const GateOutput out = g.forward(in.x.to(DType::bf16), {}, false);
    ASSERT_EQ(out.weights.dtype(), DType::f32);
    const Emulated em = emulate(c, in.x, in.w, true);  // the logits are still rounded
    EXPECT_EQ(indices_of(out), em.indices);
    int unrounded = 0;
    for (std::size_t i = 0; i < em.weights.size(); ++i) {
      ASSERT_EQ(out.weights.data<float>()[i], em.weights[i]) << i;
      unrounded += em.weights[i] != round_bf16(em.weights[i]);
    }
    EXPECT_GT(unrounded, 0);  // so the two modes really differ
  }
}

TEST(GateRounding, GatePrecisionSkipsTheLogitRoundingButNotTheWeightCast) {
  // gate_precision f32 with bf16 x: x and W cast to fp32, no logit rounding; the weights are cast
  // back to x's dtype (bf16) unless router_weights_fp32.
  for (bool fp32_weights : {false, true}) {
    MoEConfig c = config(ScoreFunc::sigmoid);
    c.router_weights_fp32 = fp32_weights;
    const Inputs in = inputs(7);
    Gate g = gate_with(c, DType::f32, in.w);
    const GateOutput out = g.forward(in.x.to(DType::bf16), {}, false);
    const Emulated exact = emulate(c, in.x, in.w, false);
    EXPECT_EQ(indices_of(out), exact.indices);
    ASSERT_EQ(out.weights.dtype(), fp32_weights ? DType::f32 : DType::bf16);
    for (std::size_t i = 0; i < exact.weights.size(); ++i)
      ASSERT_EQ(read_as_double(out.weights, static_cast<std::int64_t>(i)),
                fp32_weights ? exact.weights[i] : round_bf16(exact.weights[i]))
          << i;
  }
}

TEST(GateRounding, Fp32WeightIsCastToBf16WithoutPrecision) {
  // gate_dtype float32 with bf16 x: Automodel's weight.to(x.dtype) rounds the weight before the
  // linear, so the gate routes exactly as one holding the bf16-rounded weight; with gate_precision
  // f32 the weight is used as stored and the logits move.
  const MoEConfig c = config(ScoreFunc::sigmoid);
  const Tensor x = grid({kT, kD}, 9, 16, 1.0 / 16).to(DType::bf16);
  Tensor w = Tensor::empty({kE, kD}, DType::f32);
  fill_normal(w, 10, stream_id("rounding.w"), 0.0, 0.1);  // not bf16-exact
  const Tensor w_rounded = w.to(DType::bf16).to(DType::f32);
  Gate full = gate_with(c, std::nullopt, w), rounded = gate_with(c, std::nullopt, w_rounded);
  const GateOutput a = full.forward(x, {}, false), b = rounded.forward(x, {}, false);
  EXPECT_EQ(indices_of(a), indices_of(b));
  for (std::int64_t i = 0; i < a.weights.numel(); ++i)
    ASSERT_EQ(read_as_double(a.weights, i), read_as_double(b.weights, i)) << i;
  Gate precise = gate_with(c, DType::f32, w), precise_rounded = gate_with(c, DType::f32, w_rounded);
  const GateOutput p = precise.forward(x, {}, false), q = precise_rounded.forward(x, {}, false);
  bool differs = indices_of(p) != indices_of(q);
  for (std::int64_t i = 0; i < p.weights.numel(); ++i) differs |= read_as_double(p.weights, i) != read_as_double(q.weights, i);
  EXPECT_TRUE(differs);
}

TEST(GateRounding, Bf16BackwardIsTheDerivativeAtTheRoundedValues) {
  // Sigmoid without normalisation: dL/dz[t, e] = sum_j g[t, j] [idx = e] s (1 - s), with s the fp32
  // sigmoid of the rounded logit; grad_W = dz^T x, grad_x = dz W (summed over ascending experts in
  // fp64 like the gate, then rounded once to bf16: compared bit for bit).
  MoEConfig c = config(ScoreFunc::sigmoid);
  c.norm_topk_prob = false;
  const Inputs in = inputs(11);
  Gate g = gate_with(c, std::nullopt, in.w);
  const Tensor xb = in.x.to(DType::bf16);
  const GateOutput out = g.forward(xb, {}, true);
  Tensor gw = Tensor::empty({kT, kK}, DType::f32);
  fill_normal(gw, 12, stream_id("rounding.gw"), 0.0, 1.0);
  const Tensor gx = g.backward(out, gw);
  ASSERT_EQ(gx.dtype(), DType::bf16);
  std::vector<double> dz(static_cast<std::size_t>(kT * kE), 0.0);
  for (std::int64_t t = 0; t < kT; ++t)
    for (int j = 0; j < kK; ++j) {
      const std::int64_t e = out.indices.data<std::int64_t>()[t * kK + j];
      double z = 0;
      for (int d = 0; d < kD; ++d) z += double(in.x.data<float>()[t * kD + d]) * double(in.w.data<float>()[e * kD + d]);
      const float zr = round_bf16(static_cast<float>(z));
      const double s = 1.0f / (1.0f + std::exp(-zr));  // the fp32 score, as the forward made it
      dz[static_cast<std::size_t>(t * kE + e)] += gw.data<float>()[t * kK + j] * s * (1 - s);
    }
  for (int e = 0; e < kE; ++e)
    for (int d = 0; d < kD; ++d) {
      double want = 0;
      for (std::int64_t t = 0; t < kT; ++t) want += dz[static_cast<std::size_t>(t * kE + e)] * in.x.data<float>()[t * kD + d];
      EXPECT_NEAR(g.weight().grad.data<float>()[e * kD + d], want, 1e-5 * (1 + std::abs(want)));
    }
  for (std::int64_t t = 0; t < kT; ++t)
    for (int d = 0; d < kD; ++d) {
      double want = 0;
      for (int e = 0; e < kE; ++e) want += dz[static_cast<std::size_t>(t * kE + e)] * in.w.data<float>()[e * kD + d];
      EXPECT_EQ(read_as_double(gx, t * kD + d), round_bf16(static_cast<float>(want))) << t << "," << d;
    }
}
