// The GPU router (cuda::router_forward / router_backward) against the CPU reference Gate.
//
// Data: x, W and the router bias lie on coarse grids (x in {-1, -0.75, ..., 1}, W and bias in
// {-0.5, ..., 0.5} step 1/8, correction bias step 1/64), exact in bf16. Every product and partial
// sum of x W^T is a multiple of 1/32 far below 2^24 ulps, so the bf16 tensor-core GEMM, the fp32
// and fp64 cuBLAS GEMMs and the CPU loops give bit-identical logits, and the GPU selection must
// equal the CPU's exactly, including the many exact ties such grids produce. Distinct logits differ
// by >= 1/32, far more than the few-ulp differences of the two exp implementations, so no near-tie
// can flip. RouterGpu.UnsetPrecisionContinuousData uses continuous data instead and compares the
// selection with the CPU gate run on the GPU's own logits (identity weight), allowing only swaps
// of experts whose keys are within float rounding.
//
// grad_logits are checked against the same identity-weight CPU gate: with W = I its grad_x *is*
// dLoss/dlogits.
//
// Tolerances (stated once, used everywhere):
//   indices, expert load: exact;
//   weights: 1e-5 relative per element (fp32 softmax/sigmoid against fp32 CPU math: a few ulps);
//   aux loss: 1e-5 relative (fp32 scores), 1e-9 (f64 precision, double end to end);
//   grad_logits: 1e-4 relative in Frobenius norm (fp64 kernel math on fp32 saved scores against the
//     CPU's fp64 math on its own fp32 scores), 1e-9 in f64 precision;
//   grad_weight, grad_bias: 1e-4 (fp32 accumulation; the unset precision's hi/lo bf16 split is exact
//     to 2^-17);
//   grad_x: 1e-2 (bf16 output, 2^-9 rounding per element).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "flexep/core/error.h"
#include "flexep/core/random.h"
#include "flexep/cuda/router.h"
#include "flexep/cuda/runtime.h"
#include "flexep/layer/gate.h"
#include "gpu/gpu_test_util.h"

using namespace flexep;

namespace {

// 0xFF bytes in a pool block freed just before a call: outputs that reuse it and are never written
// stay NaN / -1 / true, so the comparisons below catch them.
void poison_pool(std::size_t bytes, cudaStream_t s) {
  Tensor t = Tensor::empty({static_cast<std::int64_t>(bytes)}, DType::b8, Device::cuda(0));
  FLEXEP_CUDA_CHECK(cudaMemsetAsync(t.raw(), 0xFF, bytes, s));
}

MoEConfig make_config(ScoreFunc f, int experts, int topk, int dim) {
  MoEConfig c;
  c.n_routed_experts = experts;
  c.n_activated_experts = topk;
  c.dim = dim;
  c.score_func = f;
  return c;
}

// f32 host tensor of step * q, q uniform in [-half, half].
Tensor grid(Shape shape, std::uint64_t seed, const char* name, int half, double step) {
  Tensor t = Tensor::empty(shape, DType::f32);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    const int q = static_cast<int>(uniform01(seed, stream_id(name), static_cast<std::uint64_t>(i)) * (2 * half + 1));
    t.data<float>()[i] = static_cast<float>((std::min(q, 2 * half) - half) * step);
  }
  return t;
}

Tensor normal(Shape shape, std::uint64_t seed, const char* name, double std = 1.0) {
  Tensor t = Tensor::empty(shape, DType::f32);
  fill_normal(t, seed, stream_id(name), 0.0, std);
  return t;
}

std::vector<double> values(const TensorView& t) {
  std::vector<double> v(static_cast<std::size_t>(t.numel()));
  for (std::int64_t i = 0; i < t.numel(); ++i) v[static_cast<std::size_t>(i)] = read_as_double(t, i);
  return v;
}
std::vector<double> device_values(const TensorView& t, cudaStream_t s) { return values(cuda::to_host(t, s)); }
std::vector<std::int64_t> device_ints(const TensorView& t, cudaStream_t s) {
  const Tensor h = cuda::to_host(t, s);
  return std::vector<std::int64_t>(h.data<std::int64_t>(), h.data<std::int64_t>() + h.numel());
}

void assign(const Tensor& dst, const TensorView& src) {
  ASSERT_EQ(dst.numel(), src.numel());
  for (std::int64_t i = 0; i < dst.numel(); ++i) write_from_double(dst, i, read_as_double(src, i));
}

// ||got - ref|| / ||ref|| (||got - ref|| when ref is zero) and the max abs error, printed, and
// checked against rtol.
void expect_close(const std::string& what, const std::vector<double>& got, const std::vector<double>& ref,
                  double rtol) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double num = 0, den = 0, max_err = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double d = got[i] - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
    max_err = std::max(max_err, std::isnan(d) ? INFINITY : std::fabs(d));
  }
  const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  std::printf("  %-44s rel %.3e  max %.3e  (n = %zu)\n", what.c_str(), rel, max_err, got.size());
  EXPECT_LE(rel, rtol) << what << ": max abs error " << max_err;
  EXPECT_FALSE(std::isnan(num)) << what << " has NaN";
}

// Per element |got - ref| <= rtol |ref| (+ a denormal-level floor).
void expect_elementwise(const std::string& what, const std::vector<double>& got, const std::vector<double>& ref,
                        double rtol) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  int failures = 0;
  for (std::size_t i = 0; i < got.size() && failures < 5; ++i)
    if (!(std::fabs(got[i] - ref[i]) <= rtol * std::fabs(ref[i]) + 1e-30)) {
      ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", reference " << ref[i];
      ++failures;
    }
}

void expect_arg_error(const std::function<void()>& f, const std::string& arg) {
  try {
    f();
    ADD_FAILURE() << "expected an ArgumentError naming '" << arg << "'";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), arg) << e.what();
  }
}

enum class MaskKind { none, partial, all_masked };

struct Case {
  MoEConfig config;
  std::optional<DType> precision;
  std::int64_t tokens = 37;
  bool training = false;
  MaskKind mask = MaskKind::none;
  std::uint64_t seed = 1;
  double aux_loss_scale = 1.0;
  bool bias_f32 = false;      // router bias dtype on the GPU (bf16 otherwise)
  bool zero_token = false;    // token 0 is all zeros: every logit ties
  bool tied_pairs = false;    // W rows 2i and 2i+1 equal: exact ties between neighbours
  bool with_grads = true;     // grad_weight / grad_bias buffers (false: frozen gate)
};

std::string describe(const Case& cs) {
  const MoEConfig& c = cs.config;
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s%s E=%d k=%d G=%d/%d T=%lld dim=%d prec=%s norm=%d scale=%g cb=%d aux=%d mask=%d",
                std::string(to_string(c.score_func)).c_str(), c.softmax_before_topk ? "(before_topk)" : "",
                c.n_routed_experts, c.n_activated_experts, c.n_expert_groups, c.n_limited_groups,
                static_cast<long long>(cs.tokens), c.dim,
                cs.precision ? std::string(dtype_name(*cs.precision)).c_str() : "unset", c.norm_topk_prob ? 1 : 0,
                c.route_scale, c.has_correction_bias() ? 1 : 0, cs.training && c.aux_loss_coeff > 0 ? 1 : 0,
                static_cast<int>(cs.mask));
  return buf;
}

// Runs one case end to end on both sides and compares everything.
void run_case(const Case& cs) {
  SCOPED_TRACE(describe(cs));
  std::printf("case %s\n", describe(cs).c_str());
  const MoEConfig& c = cs.config;
  const std::int64_t T = cs.tokens, E = c.n_routed_experts, k = c.n_activated_experts, D = c.dim;
  const bool f64 = cs.precision == DType::f64;
  const cuda::OwnedStream stream;
  const cudaStream_t s = stream.get();
  cuda::StreamGuard ordered(s);

  // Inputs (host f32 holding bf16-exact values).
  Tensor x = grid({T, D}, cs.seed, "router.x", 4, 0.25);
  if (cs.zero_token && T > 0) std::fill(x.data<float>(), x.data<float>() + D, 0.0f);
  Tensor w = grid({E, D}, cs.seed, "router.w", 4, 0.125);
  if (cs.tied_pairs)
    for (std::int64_t e = 1; e < E; e += 2) std::memcpy(w.data<float>() + e * D, w.data<float>() + (e - 1) * D, D * 4);
  const Tensor bias = c.router_bias ? grid({E}, cs.seed, "router.bias", 4, 0.125) : Tensor();
  const Tensor cb = c.has_correction_bias() ? grid({E}, cs.seed, "router.cb", 8, 1.0 / 64) : Tensor();
  Tensor mask;
  if (cs.mask != MaskKind::none) {
    mask = Tensor::empty({T}, DType::b8);
    for (std::int64_t t = 0; t < T; ++t) mask.data<bool>()[t] = cs.mask == MaskKind::partial && t % 3 != 1;
  }
  const Tensor grad_weights = normal({T, k}, cs.seed, "router.grad_weights");
  const Tensor grad_w0 = normal({E, D}, cs.seed, "router.grad_w0", 0.1);  // accumulated into
  const Tensor grad_b0 = normal({E}, cs.seed, "router.grad_b0", 0.1);

  // CPU reference gate with the same parameters.
  Gate gate(c, cs.precision, DType::f32);
  assign(gate.weight().value, w);
  if (c.router_bias) assign(gate.bias().value, bias);
  if (c.has_correction_bias()) assign(gate.e_score_correction_bias(), cb);
  gate.aux_loss_scale = cs.aux_loss_scale;
  const GateOutput ref = gate.forward(x, mask, cs.training);

  // GPU.
  const Tensor xd = cuda::to_device(x.to(DType::bf16), 0, s);
  const Tensor wd = cuda::to_device(w.to(DType::bf16), 0, s);
  const Tensor bd = c.router_bias ? cuda::to_device(bias.to(cs.bias_f32 ? DType::f32 : DType::bf16), 0, s) : Tensor();
  const Tensor cbd = c.has_correction_bias() ? cuda::to_device(cb, 0, s) : Tensor();
  const Tensor maskd = mask.defined() ? cuda::to_device(mask, 0, s) : Tensor();
  poison_pool(static_cast<std::size_t>(T * E * 8 * 4 + 4096), s);
  const cuda::RouterOutput out =
      cuda::router_forward(c, cs.precision, xd, wd, bd, cbd, maskd, cs.training, s);

  ASSERT_EQ(out.weights.shape(), Shape({T, k}));
  ASSERT_EQ(out.indices.dtype(), DType::i64);
  ASSERT_EQ(out.scores.dtype(), f64 ? DType::f64 : DType::f32);
  const std::vector<std::int64_t> idx = device_ints(out.indices, s);
  const std::vector<std::int64_t> ref_idx(ref.indices.data<std::int64_t>(),
                                          ref.indices.data<std::int64_t>() + ref.indices.numel());
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t j = 0; j < k; ++j)
      if (idx[t * k + j] != ref_idx[t * k + j]) {
        ADD_FAILURE() << "token " << t << " slot " << j << ": GPU selects " << idx[t * k + j] << ", CPU "
                      << ref_idx[t * k + j];
        return;
      }
  if (cs.zero_token && T > 0 && !c.has_correction_bias() && !c.grouped_routing()) {
    for (std::int64_t j = 0; j < k; ++j) EXPECT_EQ(idx[j], j) << "all-tied token: lowest indices first";
  }
  expect_elementwise("weights", device_values(out.weights, s), values(ref.weights), 1e-5);
  EXPECT_EQ(device_ints(out.expert_load, s), ref.expert_load);
  ASSERT_EQ(out.aux_loss.defined(), ref.aux_loss.has_value());
  if (ref.aux_loss) {
    const double got = device_values(out.aux_loss, s)[0];
    std::printf("  aux loss GPU %.10g CPU %.10g\n", got, *ref.aux_loss);
    EXPECT_LE(std::fabs(got - *ref.aux_loss), (f64 ? 1e-9 : 1e-5) * std::fabs(*ref.aux_loss) + 1e-12);
  }

  // Backward: CPU gate (end to end) and the GPU, both accumulating into the same starting grads.
  gate.weight().grad = grad_w0.clone();
  if (c.router_bias) gate.bias().grad = grad_b0.clone();
  const Tensor ref_grad_x = gate.backward(ref, grad_weights);
  const Tensor gwd = cuda::to_device(grad_w0, 0, s);
  const Tensor gbd = c.router_bias ? cuda::to_device(grad_b0, 0, s) : Tensor();
  const Tensor grad_weights_d = cuda::to_device(grad_weights, 0, s);
  poison_pool(static_cast<std::size_t>(T * (E + D) * 8 * 2 + 4096), s);
  const cuda::RouterGrads grads = cuda::router_backward(out, grad_weights_d, xd, wd, cs.with_grads ? gwd : Tensor(),
                                                        cs.with_grads ? gbd : Tensor(), cs.aux_loss_scale, s);
  ASSERT_EQ(grads.grad_x.shape(), Shape({T, D}));
  ASSERT_EQ(grads.grad_x.dtype(), DType::bf16);
  expect_close("grad_x (bf16)", device_values(grads.grad_x, s), values(ref_grad_x), 1e-2);
  auto minus = [](std::vector<double> a, const std::vector<double>& b) {
    for (std::size_t i = 0; i < a.size(); ++i) a[i] -= b[i];
    return a;
  };
  const std::vector<double> w0 = values(grad_w0), b0 = values(grad_b0);
  if (cs.with_grads) {
    expect_close("grad_weight (accumulated part)", minus(device_values(gwd, s), w0),
                 minus(values(gate.weight().grad), w0), 1e-4);
    if (c.router_bias)
      expect_close("grad_bias (accumulated part)", minus(device_values(gbd, s), b0),
                   minus(values(gate.bias().grad), b0), 1e-4);
  } else {
    EXPECT_EQ(device_values(gwd, s), w0) << "a frozen gate's buffers stay untouched";
  }

  // grad_logits (and selection again) against the CPU gate on the GPU's logits with W = I.
  MoEConfig ci = c;
  ci.dim = c.n_routed_experts;
  ci.router_bias = false;
  const DType pd = f64 ? DType::f64 : DType::f32;
  Gate identity(ci, cs.precision, pd);
  for (std::int64_t e = 0; e < E; ++e) write_from_double(identity.weight().value, e * E + e, 1.0);
  if (c.has_correction_bias()) assign(identity.e_score_correction_bias(), cb);
  identity.aux_loss_scale = cs.aux_loss_scale;
  const Tensor logits = cuda::to_host(out.logits, s);
  const GateOutput iref = identity.forward(logits, mask, cs.training);
  const std::vector<std::int64_t> iidx(iref.indices.data<std::int64_t>(),
                                       iref.indices.data<std::int64_t>() + iref.indices.numel());
  EXPECT_EQ(idx, iidx) << "selection on the GPU's logits";
  const Tensor ref_grad_logits = identity.backward(iref, grad_weights);
  expect_close("grad_logits", device_values(grads.grad_logits, s), values(ref_grad_logits), f64 ? 1e-9 : 1e-4);
}

Case base_case(ScoreFunc f, int E, int k, int dim) {
  Case cs;
  cs.config = make_config(f, E, k, dim);
  return cs;
}

}  // namespace

TEST(RouterGpu, EveryScoreFunctionAndPrecisionMatchesCpuGate) {
  if (!flexep::testing::require_gpus(1)) return;
  struct Func {
    ScoreFunc f;
    bool before_topk;
  };
  const Func funcs[] = {{ScoreFunc::softmax, false},
                        {ScoreFunc::softmax, true},
                        {ScoreFunc::softmax_with_bias, false},
                        {ScoreFunc::sigmoid, false}};
  std::uint64_t seed = 10;
  for (const Func& fn : funcs)
    for (std::optional<DType> prec : {std::optional<DType>(), std::optional<DType>(DType::f32),
                                      std::optional<DType>(DType::f64)})
      for (bool norm : {false, true}) {
        Case cs = base_case(fn.f, 64, 8, 48);
        cs.config.softmax_before_topk = fn.before_topk;
        cs.config.norm_topk_prob = norm;
        cs.config.route_scale = norm ? 2.5 : 0.75;
        cs.config.router_bias = norm;  // half the cases with a bias
        cs.bias_f32 = prec.has_value();
        cs.precision = prec;
        cs.tokens = 67;
        cs.seed = ++seed;
        cs.training = norm;  // aux loss on half the cases
        cs.config.aux_loss_coeff = 0.01;
        cs.mask = norm ? MaskKind::partial : MaskKind::none;
        cs.aux_loss_scale = 0.5;
        run_case(cs);
      }
}

TEST(RouterGpu, GroupLimitedRoutingWithCorrectionBias) {
  if (!flexep::testing::require_gpus(1)) return;
  std::uint64_t seed = 100;
  for (ScoreFunc f : {ScoreFunc::softmax_with_bias, ScoreFunc::sigmoid})
    for (bool corrected : {false, true})
      for (std::optional<DType> prec : {std::optional<DType>(), std::optional<DType>(DType::f64)}) {
        Case cs = base_case(f, 256, 8, 64);  // DeepSeek-V3 shape: 8 groups, keep 4
        cs.config.n_expert_groups = 8;
        cs.config.n_limited_groups = 4;
        cs.config.force_e_score_correction_bias = corrected;
        cs.config.norm_topk_prob = true;
        cs.config.route_scale = 2.5;
        cs.config.aux_loss_coeff = 0.001;
        cs.training = true;
        cs.mask = MaskKind::partial;
        cs.precision = prec;
        cs.tokens = 130;
        cs.seed = ++seed;
        run_case(cs);
      }
  // Sigmoid without a correction bias scores groups by their max, so single-expert groups work.
  Case cs = base_case(ScoreFunc::sigmoid, 16, 2, 24);
  cs.config.n_expert_groups = 16;
  cs.config.n_limited_groups = 5;
  cs.tokens = 41;
  run_case(cs);
  // Correction bias without groups.
  Case flat = base_case(ScoreFunc::sigmoid, 64, 6, 32);
  flat.config.force_e_score_correction_bias = true;
  flat.tokens = 50;
  run_case(flat);
}

TEST(RouterGpu, ExpertCountsTopKAndOddSizes) {
  if (!flexep::testing::require_gpus(1)) return;
  std::uint64_t seed = 200;
  for (int E : {8, 40, 64, 256})
    for (int k : {1, 8})
      for (ScoreFunc f : {ScoreFunc::softmax, ScoreFunc::sigmoid}) {
        Case cs = base_case(f, E, k, E == 40 ? 33 : 16);  // odd dim, E not a multiple of 32
        cs.config.norm_topk_prob = true;
        if (E == 40) cs.precision = DType::f32;  // odd sizes through the scalar cast path
        cs.tokens = 53;
        cs.seed = ++seed;
        cs.training = true;
        cs.config.aux_loss_coeff = 0.02;
        run_case(cs);
      }
  // The kernel limits: 512 experts, top-32, and k = E.
  Case big = base_case(ScoreFunc::softmax_with_bias, 512, 32, 40);
  big.tokens = 19;
  big.config.norm_topk_prob = true;
  run_case(big);
  Case all = base_case(ScoreFunc::softmax, 8, 8, 16);
  all.config.softmax_before_topk = true;
  all.tokens = 9;
  run_case(all);
}

TEST(RouterGpu, TiesBreakTowardsLowerIndex) {
  if (!flexep::testing::require_gpus(1)) return;
  std::uint64_t seed = 300;
  for (ScoreFunc f : {ScoreFunc::softmax, ScoreFunc::softmax_with_bias, ScoreFunc::sigmoid})
    for (bool groups : {false, true}) {
      Case cs = base_case(f, 32, 4, 8);  // small dim: many equal logits on the grid
      cs.zero_token = true;                // token 0: all logits 0
      cs.tied_pairs = true;                // experts 2i and 2i+1 always tie
      if (groups && f != ScoreFunc::softmax) {
        cs.config.n_expert_groups = 4;
        cs.config.n_limited_groups = 2;
      }
      cs.tokens = 45;
      cs.seed = ++seed;
      run_case(cs);
    }
}

TEST(RouterGpu, AuxLossWithMasks) {
  if (!flexep::testing::require_gpus(1)) return;
  std::uint64_t seed = 400;
  for (MaskKind m : {MaskKind::none, MaskKind::partial, MaskKind::all_masked})
    for (ScoreFunc f : {ScoreFunc::softmax, ScoreFunc::sigmoid})
      for (std::optional<DType> prec : {std::optional<DType>(), std::optional<DType>(DType::f32)}) {
        Case cs = base_case(f, 64, 6, 32);
        cs.config.norm_topk_prob = f == ScoreFunc::sigmoid;
        cs.config.aux_loss_coeff = 0.05;
        cs.training = true;
        cs.mask = m;
        cs.precision = prec;
        cs.tokens = 300;  // two column-sum chunks
        cs.aux_loss_scale = 3.0;
        cs.seed = ++seed;
        run_case(cs);
      }
  // Not training: no aux loss, and a frozen gate (no grad_weight / grad_bias buffers).
  Case frozen = base_case(ScoreFunc::softmax, 16, 2, 16);
  frozen.config.aux_loss_coeff = 0.05;
  frozen.config.router_bias = true;
  frozen.with_grads = false;
  run_case(frozen);
}

TEST(RouterGpu, EmptyBatch) {
  if (!flexep::testing::require_gpus(1)) return;
  for (std::optional<DType> prec : {std::optional<DType>(), std::optional<DType>(DType::f64)}) {
    Case cs = base_case(ScoreFunc::sigmoid, 64, 8, 32);
    cs.tokens = 0;
    cs.training = true;
    cs.config.aux_loss_coeff = 0.01;
    cs.config.router_bias = true;
    cs.precision = prec;
    run_case(cs);  // empty outputs, zero load, aux loss 0, untouched parameter grads
  }
}

// Continuous data: the bf16 GEMM is checked against an fp64 dot product, and the selection against
// the CPU gate run on the GPU's own fp32 logits; experts may swap only where their selection keys
// agree to float rounding (the two exp implementations differ by ulps).
TEST(RouterGpu, UnsetPrecisionContinuousData) {
  if (!flexep::testing::require_gpus(1)) return;
  const cuda::OwnedStream stream;
  const cudaStream_t s = stream.get();
  cuda::StreamGuard ordered(s);
  for (ScoreFunc f : {ScoreFunc::softmax, ScoreFunc::softmax_with_bias, ScoreFunc::sigmoid}) {
    const int E = 128, k = 8, D = 256;
    const std::int64_t T = 512;
    MoEConfig c = make_config(f, E, k, D);
    c.force_e_score_correction_bias = f != ScoreFunc::softmax;
    c.norm_topk_prob = true;
    SCOPED_TRACE(std::string(to_string(f)));
    const Tensor x = normal({T, D}, 7, "router.cx").to(DType::bf16);
    const Tensor w = normal({E, D}, 7, "router.cw", 0.1).to(DType::bf16);
    const Tensor cb = c.has_correction_bias() ? normal({E}, 7, "router.ccb", 0.01) : Tensor();
    const Tensor xd = cuda::to_device(x, 0, s), wd = cuda::to_device(w, 0, s);
    const Tensor cbd = cb.defined() ? cuda::to_device(cb, 0, s) : Tensor();
    const cuda::RouterOutput out = cuda::router_forward(c, std::nullopt, xd, wd, {}, cbd, {}, false, s);

    const Tensor logits = cuda::to_host(out.logits, s);
    std::vector<double> exact(static_cast<std::size_t>(T * E));
    for (std::int64_t t = 0; t < T; ++t)
      for (int e = 0; e < E; ++e) {
        double acc = 0;
        for (int d = 0; d < D; ++d) acc += read_as_double(x, t * D + d) * read_as_double(w, e * D + d);
        exact[static_cast<std::size_t>(t * E + e)] = acc;
      }
    expect_close("logits (bf16 GEMM, fp32 accumulate)", values(logits), exact, 1e-5);

    MoEConfig ci = c;
    ci.dim = E;
    Gate identity(ci, std::nullopt, DType::f32);
    for (int e = 0; e < E; ++e) identity.weight().value.data<float>()[e * E + e] = 1.0f;
    if (cb.defined()) assign(identity.e_score_correction_bias(), cb);
    const GateOutput ref = identity.forward(logits, {}, false);
    const std::vector<std::int64_t> idx = device_ints(out.indices, s);
    const std::vector<double> scores = device_values(out.scores, s), weights = device_values(out.weights, s);
    const std::vector<double> lg = values(logits), ref_weights = values(ref.weights);
    auto key = [&](std::int64_t t, std::int64_t e) {
      if (f == ScoreFunc::softmax) return lg[static_cast<std::size_t>(t * E + e)];
      return scores[static_cast<std::size_t>(t * E + e)] + (cb.defined() ? cb.data<float>()[e] : 0.0);
    };
    int near_ties = 0;
    for (std::int64_t t = 0; t < T; ++t) {
      std::int64_t j = 0;
      while (j < k && idx[t * k + j] == ref.indices.data<std::int64_t>()[t * k + j]) ++j;
      if (j == k) {
        for (int q = 0; q < k; ++q) {
          const std::size_t i = static_cast<std::size_t>(t * k + q);
          EXPECT_LE(std::fabs(weights[i] - ref_weights[i]), 1e-5 * std::fabs(ref_weights[i])) << "token " << t;
        }
        continue;
      }
      const double a = key(t, idx[t * k + j]), b = key(t, ref.indices.data<std::int64_t>()[t * k + j]);
      EXPECT_LE(std::fabs(a - b), 1e-6 * std::max(std::fabs(a), std::fabs(b)))
          << "token " << t << " slot " << j << ": GPU picks " << idx[t * k + j] << " (key " << a << "), CPU "
          << ref.indices.data<std::int64_t>()[t * k + j] << " (key " << b << ")";
      ++near_ties;
    }
    std::printf("  %s: %d of %lld tokens differ by a float-rounding near-tie\n", std::string(to_string(f)).c_str(),
                near_ties, static_cast<long long>(T));
    EXPECT_LE(near_ties, T / 20);
  }
}

TEST(RouterGpu, RejectsBadArguments) {
  if (!flexep::testing::require_gpus(1)) return;
  const cuda::OwnedStream stream;
  const cudaStream_t s = stream.get();
  cuda::StreamGuard ordered(s);
  MoEConfig c = make_config(ScoreFunc::softmax, 16, 4, 8);
  const Tensor x = cuda::to_device(grid({5, 8}, 1, "router.x", 4, 0.25).to(DType::bf16), 0, s);
  const Tensor w = cuda::to_device(grid({16, 8}, 1, "router.w", 4, 0.125).to(DType::bf16), 0, s);
  auto fwd = [&](const MoEConfig& cfg, const TensorView& xx, const TensorView& ww, const TensorView& b = {},
                 const TensorView& cb = {}, const TensorView& m = {}, std::optional<DType> p = std::nullopt) {
    return [=] { (void)cuda::router_forward(cfg, p, xx, ww, b, cb, m, true, s); };
  };
  const Tensor x_wide = cuda::to_device(grid({5, 9}, 1, "router.x", 4, 0.25).to(DType::bf16), 0, s);
  expect_arg_error(fwd(c, x_wide, w), "x");                                  // dim mismatch
  const Tensor w_wide = cuda::to_device(grid({16, 9}, 1, "router.w", 4, 0.125).to(DType::bf16), 0, s);
  expect_arg_error(fwd(c, x, w_wide), "weight");                             // dim mismatch
  const Tensor x_f32 = cuda::to_device(grid({5, 8}, 1, "router.x", 4, 0.25), 0, s);
  expect_arg_error(fwd(c, x_f32, w), "x");                                   // wrong dtype
  const Tensor w_host = grid({16, 8}, 1, "router.w", 4, 0.125).to(DType::bf16);
  expect_arg_error(fwd(c, x, w_host), "weight");                             // CPU vs GPU
  const TensorView w_other(w.raw(), DType::bf16, w.shape(), Device::cuda(1));  // never dereferenced
  expect_arg_error(fwd(c, x, w_other), "weight");                            // another GPU
  expect_arg_error(fwd(c, grid({5, 8}, 1, "router.x", 4, 0.25).to(DType::bf16), w), "x");  // x on the CPU
  const Tensor b = cuda::to_device(grid({16}, 1, "router.bias", 4, 0.125), 0, s);
  expect_arg_error(fwd(c, x, w, b), "bias");                                 // no router_bias in the config
  MoEConfig cb_cfg = c;
  cb_cfg.score_func = ScoreFunc::sigmoid;
  cb_cfg.force_e_score_correction_bias = true;
  expect_arg_error(fwd(cb_cfg, x, w), "correction_bias");                    // missing
  const Tensor m = cuda::to_device(Tensor::zeros({4}, DType::b8), 0, s);
  expect_arg_error(fwd(c, x, w, {}, {}, m), "token_mask");                   // wrong length
  MoEConfig many = c;
  many.n_routed_experts = 513;
  expect_arg_error(fwd(many, x, w), "moe.n_routed_experts");
  MoEConfig wide_k = make_config(ScoreFunc::softmax, 64, 33, 8);
  expect_arg_error(fwd(wide_k, x, w), "moe.n_activated_experts");
  expect_arg_error(fwd(c, x, w, {}, {}, {}, DType::bf16), "backend.gate_precision");

  const cuda::RouterOutput out = cuda::router_forward(c, std::nullopt, x, w, {}, {}, {}, false, s);
  const Tensor gw = cuda::to_device(normal({5, 4}, 1, "router.gw"), 0, s);
  const Tensor gw_f64 = cuda::to_device(normal({5, 4}, 1, "router.gw").to(DType::f64), 0, s);
  const Tensor gw_short = cuda::to_device(normal({4, 4}, 1, "router.gw"), 0, s);
  const Tensor grad_b = cuda::to_device(Tensor::zeros({16}, DType::f32), 0, s);
  auto bwd = [&](const cuda::RouterOutput& o, const TensorView& g, const TensorView& xx, const TensorView& gb) {
    return [&o, g, xx, gb, &w, s] { (void)cuda::router_backward(o, g, xx, w, {}, gb, 1.0, s); };
  };
  expect_arg_error(bwd(out, gw_f64, x, {}), "grad_weights");
  expect_arg_error(bwd(out, gw_short, x, {}), "grad_weights");
  expect_arg_error(bwd(out, gw, x_wide, {}), "x");
  expect_arg_error(bwd(out, gw, x, grad_b), "grad_bias");  // the forward had no bias
  const cuda::RouterOutput empty;
  expect_arg_error(bwd(empty, gw, x, {}), "forward");
}
