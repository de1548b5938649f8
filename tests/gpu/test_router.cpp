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
// The CPU gate always gets x in bf16 (the GPU's x), so it applies Automodel's roundings exactly as
// the GPU must: bf16 logits without a gate precision, weights rounded to bf16 unless
// router_weights_fp32 (layer/gate.h).
//
// Tolerances (stated once, used everywhere):
//   indices, expert load: exact;
//   weights: 1e-5 relative per element (fp32 softmax/sigmoid against fp32 CPU math: a few ulps);
//     rounded to bf16 (the default): within one bf16 ulp (2^-7 relative) of the CPU's and equal to it
//     for >= 99% of the elements (the two fp32 values differ by ulps, which moves a rounding only at a
//     bf16 midpoint), and equal bit for bit to bf16(the GPU's own fp32 weights) of the same forward
//     with router_weights_fp32, whose fp32 weights are held to 1e-5;
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
#include "cpu/same_bytes.h"
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

// bf16 values: per element within one bf16 ulp (2^-7 relative), and equal for >= 99% of them.
void expect_within_bf16_ulp(const std::string& what, const std::vector<double>& got, const std::vector<double>& ref) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  std::size_t equal = 0;
  int failures = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    equal += got[i] == ref[i];
    if (!(std::fabs(got[i] - ref[i]) <= 0x1p-7 * std::fabs(ref[i]) + 1e-30) && failures++ < 5)
      ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", reference " << ref[i];
  }
  std::printf("  %-44s %zu of %zu equal\n", what.c_str(), equal, got.size());
  EXPECT_GE(static_cast<double>(equal), 0.99 * static_cast<double>(got.size())) << what;
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
  bool weight_f32 = false;    // the gate weight stored in f32 on the GPU (moe.gate_dtype float32)
  double cb_shift = 0.0;      // added to the correction bias grid (negative: negative biased scores)
  std::int64_t* replay = nullptr;  // [T, k] forced selection (routing replay), or null
};

std::string describe(const Case& cs) {
  const MoEConfig& c = cs.config;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "%s%s E=%d k=%d G=%d/%d(%s) T=%lld dim=%d prec=%s norm=%d scale=%g cb=%d%+g aux=%d mask=%d fp32w=%d "
                "biasedw=%d wf32=%d replay=%d",
                std::string(to_string(c.score_func)).c_str(), c.softmax_before_topk ? "(before_topk)" : "",
                c.n_routed_experts, c.n_activated_experts, c.n_expert_groups, c.n_limited_groups,
                std::string(to_string(c.group_mask)).c_str(), static_cast<long long>(cs.tokens), c.dim,
                cs.precision ? std::string(dtype_name(*cs.precision)).c_str() : "unset", c.norm_topk_prob ? 1 : 0,
                c.route_scale, c.has_correction_bias() ? 1 : 0, cs.cb_shift,
                cs.training && c.aux_loss_coeff > 0 ? 1 : 0, static_cast<int>(cs.mask), c.router_weights_fp32 ? 1 : 0,
                c.router_weight_uses_score_correction_bias ? 1 : 0, cs.weight_f32 ? 1 : 0, cs.replay ? 1 : 0);
  return buf;
}

// Runs one case end to end on both sides and compares everything.
void run_case(const Case& cs) {
  SCOPED_TRACE(describe(cs));
  std::printf("case %s\n", describe(cs).c_str());
  const MoEConfig& c = cs.config;
  const std::int64_t T = cs.tokens, E = c.n_routed_experts, k = c.n_activated_experts, D = c.dim;
  const bool f64 = cs.precision == DType::f64;
  // sqrtsoftplus routes in fp32 whatever the precision (Automodel's logits.float()).
  const bool f64_routing = f64 && c.score_func != ScoreFunc::sqrtsoftplus;
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
  Tensor cb = c.has_correction_bias() ? grid({E}, cs.seed, "router.cb", 8, 1.0 / 64) : Tensor();
  if (cb.defined())
    for (std::int64_t e = 0; e < E; ++e) cb.data<float>()[e] += static_cast<float>(cs.cb_shift);
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
  const Tensor xb = x.to(DType::bf16);  // exact: the grid is bf16
  const Tensor replay = cs.replay ? Tensor::from_vector(std::vector<std::int64_t>(cs.replay, cs.replay + T * k), {T, k})
                                  : Tensor();
  const GateOutput ref = gate.forward(xb, mask, cs.training, replay);

  // GPU.
  const Tensor xd = cuda::to_device(xb, 0, s);
  const Tensor wd = cuda::to_device(cs.weight_f32 ? w : w.to(DType::bf16), 0, s);
  const Tensor replayd = replay.defined() ? cuda::to_device(replay, 0, s) : Tensor();
  const Tensor bd = c.router_bias ? cuda::to_device(bias.to(cs.bias_f32 ? DType::f32 : DType::bf16), 0, s) : Tensor();
  const Tensor cbd = c.has_correction_bias() ? cuda::to_device(cb, 0, s) : Tensor();
  const Tensor maskd = mask.defined() ? cuda::to_device(mask, 0, s) : Tensor();
  poison_pool(static_cast<std::size_t>(T * E * 8 * 4 + 4096), s);
  const cuda::RouterOutput out =
      cuda::router_forward(c, cs.precision, xd, wd, bd, cbd, maskd, cs.training, s, replayd);

  ASSERT_EQ(out.weights.shape(), Shape({T, k}));
  ASSERT_EQ(out.weights.dtype(), DType::f32);
  ASSERT_EQ(out.indices.dtype(), DType::i64);
  ASSERT_EQ(out.scores.dtype(), f64_routing ? DType::f64 : DType::f32);
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
  const std::vector<double> gpu_weights = device_values(out.weights, s);
  if (c.router_weights_fp32) {
    EXPECT_EQ(ref.weights.dtype(), DType::f32);
    expect_elementwise("weights", gpu_weights, values(ref.weights), 1e-5);
  } else {
    EXPECT_EQ(ref.weights.dtype(), DType::bf16);
    expect_within_bf16_ulp("weights (bf16 values)", gpu_weights, values(ref.weights));
    // The fp32 weights behind the rounding, and the rounding itself.
    MoEConfig c32 = c;
    c32.router_weights_fp32 = true;
    const cuda::RouterOutput out32 =
        cuda::router_forward(c32, cs.precision, xd, wd, bd, cbd, maskd, cs.training, s, replayd);
    Gate gate32(c32, cs.precision, DType::f32);
    assign(gate32.weight().value, w);
    if (c.router_bias) assign(gate32.bias().value, bias);
    if (c.has_correction_bias()) assign(gate32.e_score_correction_bias(), cb);
    const std::vector<double> w32 = device_values(out32.weights, s);
    expect_elementwise("weights (router_weights_fp32)", w32, values(gate32.forward(xb, mask, false, replay).weights),
                       1e-5);
    for (std::size_t i = 0; i < w32.size(); ++i)
      ASSERT_EQ(gpu_weights[i], static_cast<double>(bf16::from_float(static_cast<float>(w32[i])).to_float()))
          << "weight " << i << " is not the bf16 rounding of the fp32 weight";
  }
  EXPECT_EQ(device_ints(out.expert_load, s), ref.expert_load);
  ASSERT_EQ(out.aux_loss.defined(), ref.aux_loss.has_value());
  if (ref.aux_loss) {
    const double got = device_values(out.aux_loss, s)[0];
    std::printf("  aux loss GPU %.10g CPU %.10g\n", got, *ref.aux_loss);
    EXPECT_LE(std::fabs(got - *ref.aux_loss), (f64_routing ? 1e-9 : 1e-5) * std::fabs(*ref.aux_loss) + 1e-12);
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
  // The GPU's logits are already rounded as the scores saw them; an f32 (or f64) x rounds nothing.
  const Tensor logits = cuda::to_host(out.logits, s).to(pd);
  const GateOutput iref = identity.forward(logits, mask, cs.training, replay);
  const std::vector<std::int64_t> iidx(iref.indices.data<std::int64_t>(),
                                       iref.indices.data<std::int64_t>() + iref.indices.numel());
  EXPECT_EQ(idx, iidx) << "selection on the GPU's logits";
  const Tensor ref_grad_logits = identity.backward(iref, grad_weights);
  expect_close("grad_logits", device_values(grads.grad_logits, s), values(ref_grad_logits),
               f64_routing ? 1e-9 : 1e-4);
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
    c.router_weights_fp32 = true;  // compared with the CPU's fp32 weights below
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
        // The bf16 linear rounds its fp32 result: compare with the rounded exact value (an fp32
        // accumulation error moves the rounding at a bf16 midpoint only, by one bf16 ulp).
        exact[static_cast<std::size_t>(t * E + e)] = bf16::from_float(static_cast<float>(acc)).to_float();
      }
    expect_close("logits (bf16 GEMM, fp32 accumulate, bf16 result)", values(logits), exact, 1e-3);

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

// Automodel 0.7.0's score functions: sigmoid_with_bias (group score always top-2, -inf mask) and
// sqrtsoftplus (no groups; fp32 routing even under f64 precision), every precision.
TEST(RouterGpu, SigmoidWithBiasAndSqrtSoftplusMatchCpuGate) {
  if (!flexep::testing::require_gpus(1)) return;
  std::uint64_t seed = 500;
  for (ScoreFunc f : {ScoreFunc::sigmoid_with_bias, ScoreFunc::sqrtsoftplus})
    for (std::optional<DType> prec : {std::optional<DType>(), std::optional<DType>(DType::f32),
                                      std::optional<DType>(DType::f64)})
      for (bool corrected : {false, true}) {
        Case cs = base_case(f, 64, 8, 48);
        cs.config.n_expert_groups = 8;  // acts for sigmoid_with_bias, ignored by sqrtsoftplus
        cs.config.n_limited_groups = 4;
        cs.config.force_e_score_correction_bias = corrected;
        cs.config.norm_topk_prob = corrected;
        cs.config.route_scale = 2.5;
        cs.config.router_bias = !corrected;
        cs.config.aux_loss_coeff = 0.01;
        cs.training = true;
        cs.mask = MaskKind::partial;
        cs.bias_f32 = prec.has_value();
        cs.precision = prec;
        cs.tokens = 67;
        cs.seed = ++seed;
        run_case(cs);
      }
  // Groups of 0 (as Qwen-style configs write them) and the kernel limits.
  Case zero = base_case(ScoreFunc::sigmoid_with_bias, 512, 32, 40);
  zero.config.n_expert_groups = 0;
  zero.config.force_e_score_correction_bias = true;
  zero.tokens = 19;
  run_case(zero);
  Case big = base_case(ScoreFunc::sqrtsoftplus, 512, 32, 40);
  big.config.force_e_score_correction_bias = true;
  big.config.norm_topk_prob = true;
  big.tokens = 19;
  run_case(big);
}

// Group masks with negative biased scores (the correction bias shifted below every score): with
// group_mask "automodel", softmax_with_bias and sigmoid multiply the dropped groups by 0, so experts
// of dropped groups win; "neg_inf" never selects them. The GPU matches the CPU gate in both modes,
// and the two modes really select differently on this data.
TEST(RouterGpu, GroupMaskModesWithNegativeBiasedScores) {
  if (!flexep::testing::require_gpus(1)) return;
  std::uint64_t seed = 600;
  for (ScoreFunc f : {ScoreFunc::softmax_with_bias, ScoreFunc::sigmoid, ScoreFunc::sigmoid_with_bias})
    for (std::optional<DType> prec : {std::optional<DType>(), std::optional<DType>(DType::f64)}) {
      std::vector<std::int64_t> chosen[2];
      for (GroupMask mode : {GroupMask::automodel, GroupMask::neg_inf}) {
        Case cs = base_case(f, 64, 8, 32);
        cs.config.n_expert_groups = 8;
        cs.config.n_limited_groups = 2;
        cs.config.force_e_score_correction_bias = true;
        cs.config.group_mask = mode;
        cs.cb_shift = -1.2;  // every biased score negative
        cs.precision = prec;
        cs.tokens = 40;
        cs.seed = seed;
        run_case(cs);
        // The selection of this case again, to compare the modes.
        Gate g(cs.config, prec, DType::f32);
        assign(g.weight().value, grid({64, 32}, cs.seed, "router.w", 4, 0.125));
        Tensor cb = grid({64}, cs.seed, "router.cb", 8, 1.0 / 64);
        for (std::int64_t e = 0; e < 64; ++e) cb.data<float>()[e] += -1.2f;
        assign(g.e_score_correction_bias(), cb);
        const GateOutput o = g.forward(grid({40, 32}, cs.seed, "router.x", 4, 0.25).to(DType::bf16), {}, false);
        chosen[mode == GroupMask::neg_inf] = std::vector<std::int64_t>(
            o.indices.data<std::int64_t>(), o.indices.data<std::int64_t>() + o.indices.numel());
      }
      ++seed;
      if (f == ScoreFunc::sigmoid_with_bias)
        EXPECT_EQ(chosen[0], chosen[1]) << "sigmoid_with_bias masks with -inf in both modes";
      else
        EXPECT_NE(chosen[0], chosen[1]) << "the multiply-by-0 mask must let dropped groups win here";
    }
}

// router_weight_uses_score_correction_bias (sigmoid): weights and original scores are biased; the
// aux loss and the normalisation read them, with and without groups.
TEST(RouterGpu, SigmoidWeightsFromBiasedScores) {
  if (!flexep::testing::require_gpus(1)) return;
  std::uint64_t seed = 700;
  for (bool groups : {false, true})
    for (std::optional<DType> prec : {std::optional<DType>(), std::optional<DType>(DType::f64)}) {
      Case cs = base_case(ScoreFunc::sigmoid, 64, 8, 48);
      if (groups) {
        cs.config.n_expert_groups = 8;
        cs.config.n_limited_groups = 4;
      }
      cs.config.force_e_score_correction_bias = true;
      cs.config.router_weight_uses_score_correction_bias = true;
      cs.config.norm_topk_prob = true;
      cs.config.aux_loss_coeff = 0.02;
      cs.cb_shift = 0.25;
      cs.training = true;
      cs.mask = MaskKind::partial;
      cs.precision = prec;
      cs.tokens = 67;
      cs.seed = ++seed;
      run_case(cs);
    }
}

// router_weights_fp32 on and off for every score function (the default cases above round).
TEST(RouterGpu, RouterWeightsFp32) {
  if (!flexep::testing::require_gpus(1)) return;
  std::uint64_t seed = 800;
  for (ScoreFunc f : {ScoreFunc::softmax, ScoreFunc::softmax_with_bias, ScoreFunc::sigmoid,
                      ScoreFunc::sigmoid_with_bias, ScoreFunc::sqrtsoftplus})
    for (std::optional<DType> prec : {std::optional<DType>(), std::optional<DType>(DType::f64)}) {
      Case cs = base_case(f, 64, 6, 32);
      cs.config.router_weights_fp32 = true;
      cs.config.norm_topk_prob = true;
      cs.precision = prec;
      cs.seed = ++seed;
      run_case(cs);
    }
}

// An f32 gate weight (moe.gate_dtype float32): on the bf16-exact grid the results equal the CPU's
// as with a bf16 weight; see Fp32GateWeightIsRoundedWithoutPrecision for non-bf16 values.
TEST(RouterGpu, Fp32GateWeightMatchesCpuGate) {
  if (!flexep::testing::require_gpus(1)) return;
  std::uint64_t seed = 900;
  for (std::optional<DType> prec : {std::optional<DType>(), std::optional<DType>(DType::f32),
                                    std::optional<DType>(DType::f64)}) {
    Case cs = base_case(ScoreFunc::sigmoid, 64, 8, 48);
    cs.weight_f32 = true;
    cs.config.router_bias = true;
    cs.bias_f32 = true;
    cs.config.norm_topk_prob = true;
    cs.config.aux_loss_coeff = 0.01;
    cs.training = true;
    cs.precision = prec;
    cs.seed = ++seed;
    run_case(cs);
  }
}

// Without a gate precision Automodel casts an f32 gate weight (and bias) to x's bf16 before the
// linear: the GPU router with the f32 weight gives bit for bit the logits, selection, weights and
// gradients of the router holding the bf16-rounded weight. With gate_precision f32 it uses the
// weight as stored, and the logits move.
TEST(RouterGpu, Fp32GateWeightIsRoundedWithoutPrecision) {
  if (!flexep::testing::require_gpus(1)) return;
  const cuda::OwnedStream stream;
  const cudaStream_t s = stream.get();
  cuda::StreamGuard ordered(s);
  const int E = 64, k = 8, D = 96;
  const std::int64_t T = 200;
  MoEConfig c = make_config(ScoreFunc::sigmoid, E, k, D);
  c.router_bias = true;
  c.norm_topk_prob = true;
  const Tensor x = cuda::to_device(normal({T, D}, 11, "router.fx").to(DType::bf16), 0, s);
  const Tensor w32 = normal({E, D}, 11, "router.fw", 0.1), b32 = normal({E}, 11, "router.fb", 0.1);
  const Tensor w_f32 = cuda::to_device(w32, 0, s), b_f32 = cuda::to_device(b32, 0, s);
  const Tensor w_bf16 = cuda::to_device(w32.to(DType::bf16), 0, s), b_bf16 = cuda::to_device(b32.to(DType::bf16), 0, s);
  const cuda::RouterOutput a = cuda::router_forward(c, std::nullopt, x, w_f32, b_f32, {}, {}, false, s);
  const cuda::RouterOutput b = cuda::router_forward(c, std::nullopt, x, w_bf16, b_bf16, {}, {}, false, s);
  EXPECT_TRUE(flexep::testing::same_bytes(cuda::to_host(a.logits, s), cuda::to_host(b.logits, s)));
  EXPECT_EQ(device_ints(a.indices, s), device_ints(b.indices, s));
  EXPECT_TRUE(flexep::testing::same_bytes(cuda::to_host(a.weights, s), cuda::to_host(b.weights, s)));
  const Tensor gw = cuda::to_device(normal({T, k}, 11, "router.fgw"), 0, s);
  const Tensor gwa = cuda::to_device(Tensor::zeros({E, D}, DType::f32), 0, s);
  const Tensor gwb = cuda::to_device(Tensor::zeros({E, D}, DType::f32), 0, s);
  const cuda::RouterGrads ga = cuda::router_backward(a, gw, x, w_f32, gwa, {}, 1.0, s);
  const cuda::RouterGrads gb = cuda::router_backward(b, gw, x, w_bf16, gwb, {}, 1.0, s);
  EXPECT_TRUE(flexep::testing::same_bytes(cuda::to_host(ga.grad_x, s), cuda::to_host(gb.grad_x, s)));
  EXPECT_TRUE(flexep::testing::same_bytes(cuda::to_host(gwa, s), cuda::to_host(gwb, s)));
  const cuda::RouterOutput p = cuda::router_forward(c, DType::f32, x, w_f32, b_f32, {}, {}, false, s);
  const cuda::RouterOutput q = cuda::router_forward(c, DType::f32, x, w_bf16, b_bf16, {}, {}, false, s);
  EXPECT_FALSE(flexep::testing::same_bytes(cuda::to_host(p.logits, s), cuda::to_host(q.logits, s)));
}

// The bf16 rounding of the logits, bit for bit: x on a 1/16 grid and W on a 1/64 grid make every
// fp32 dot product exact (multiples of 2^-10 far below 2^24 units) in any order, so the expected
// logits are bf16(exact dot) with no tolerance, written here independently of the CPU gate. The
// selection is checked against a top-k written here on those logits (ties: the lower index), and
// the rounding must matter: on unrounded logits some tokens select other experts.
TEST(RouterGpu, Bf16LogitRoundingMatchesEmulationBitForBit) {
  if (!flexep::testing::require_gpus(1)) return;
  const cuda::OwnedStream stream;
  const cudaStream_t s = stream.get();
  cuda::StreamGuard ordered(s);
  const int E = 64, k = 8, D = 32;
  const std::int64_t T = 1024;
  for (ScoreFunc f : {ScoreFunc::softmax, ScoreFunc::sigmoid}) {
    SCOPED_TRACE(std::string(to_string(f)));
    const MoEConfig c = make_config(f, E, k, D);
    const Tensor x = grid({T, D}, 12, "router.bx", 16, 1.0 / 16), w = grid({E, D}, 12, "router.bw", 16, 1.0 / 64);
    const cuda::RouterOutput out = cuda::router_forward(c, std::nullopt, cuda::to_device(x.to(DType::bf16), 0, s),
                                                        cuda::to_device(w.to(DType::bf16), 0, s), {}, {}, {}, false, s);
    const Tensor logits = cuda::to_host(out.logits, s);
    const std::vector<std::int64_t> idx = device_ints(out.indices, s);
    int rounded = 0, differ = 0;
    for (std::int64_t t = 0; t < T; ++t) {
      std::vector<float> z(E), exact(E);
      for (int e = 0; e < E; ++e) {
        double acc = 0;
        for (int d = 0; d < D; ++d) acc += double(x.data<float>()[t * D + d]) * double(w.data<float>()[e * D + d]);
        exact[e] = static_cast<float>(acc);
        z[e] = bf16::from_float(exact[e]).to_float();
        rounded += z[e] != exact[e];
        ASSERT_EQ(logits.data<float>()[t * E + e], z[e]) << "token " << t << " expert " << e;
      }
      // The top-k of the monotone scores is the top-k of the logits, ties to the lower index.
      auto top = [&](const std::vector<float>& v) {
        std::vector<int> order(E);
        for (int e = 0; e < E; ++e) order[e] = e;
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return v[a] > v[b]; });
        return std::vector<std::int64_t>(order.begin(), order.begin() + k);
      };
      const std::vector<std::int64_t> want = top(z);
      for (int j = 0; j < k; ++j) ASSERT_EQ(idx[t * k + j], want[j]) << "token " << t << " slot " << j;
      differ += top(exact) != want;
    }
    std::printf("  %s: %d of %lld logits rounded, %d of %lld tokens select differently unrounded\n",
                std::string(to_string(f)).c_str(), rounded, static_cast<long long>(T * E), differ,
                static_cast<long long>(T));
    EXPECT_GT(rounded, T * E / 4);
    EXPECT_GT(differ, 0);
  }
}

// Routing replay: the forced selection replaces the top-k (also with groups, which then do not act),
// the weights are gathered at it, and gradients flow as on the CPU gate; replaying the router's own
// selection reproduces its output bit for bit.
TEST(RouterGpu, ReplayMatchesCpuGate) {
  if (!flexep::testing::require_gpus(1)) return;
  const int E = 64, k = 6;
  const std::int64_t T = 45;
  std::vector<std::int64_t> forced(static_cast<std::size_t>(T * k));
  for (std::int64_t t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) forced[static_cast<std::size_t>(t * k + j)] = (t * 7 + j * 11) % E;
  std::uint64_t seed = 1000;
  struct Row {
    ScoreFunc f;
    bool before, biased, groups;
  };
  for (const Row& r :
       {Row{ScoreFunc::softmax, false, false, false}, Row{ScoreFunc::softmax, true, false, false},
        Row{ScoreFunc::softmax_with_bias, false, false, true}, Row{ScoreFunc::sigmoid, false, true, true},
        Row{ScoreFunc::sigmoid_with_bias, false, false, true}, Row{ScoreFunc::sqrtsoftplus, false, false, false}})
    for (std::optional<DType> prec : {std::optional<DType>(), std::optional<DType>(DType::f64)}) {
      Case cs = base_case(r.f, E, k, 32);
      cs.config.enable_routing_replay = true;
      cs.config.softmax_before_topk = r.before;
      cs.config.force_e_score_correction_bias = r.f != ScoreFunc::softmax;
      cs.config.router_weight_uses_score_correction_bias = r.biased;
      if (r.groups) {
        cs.config.n_expert_groups = 8;
        cs.config.n_limited_groups = 2;
      }
      cs.config.norm_topk_prob = true;
      cs.config.aux_loss_coeff = 0.01;
      cs.training = true;
      cs.mask = MaskKind::partial;
      cs.precision = prec;
      cs.tokens = T;
      cs.seed = ++seed;
      cs.replay = forced.data();
      run_case(cs);
    }
  // Replaying the router's own selection changes nothing.
  const cuda::OwnedStream stream;
  const cudaStream_t s = stream.get();
  cuda::StreamGuard ordered(s);
  MoEConfig c = make_config(ScoreFunc::sigmoid, E, k, 32);
  c.enable_routing_replay = true;
  const Tensor x = cuda::to_device(grid({T, 32}, 3, "router.x", 4, 0.25).to(DType::bf16), 0, s);
  const Tensor w = cuda::to_device(grid({E, 32}, 3, "router.w", 4, 0.125).to(DType::bf16), 0, s);
  const cuda::RouterOutput own = cuda::router_forward(c, std::nullopt, x, w, {}, {}, {}, false, s);
  const cuda::RouterOutput again = cuda::router_forward(c, std::nullopt, x, w, {}, {}, {}, false, s, own.indices);
  EXPECT_EQ(device_ints(again.indices, s), device_ints(own.indices, s));
  EXPECT_TRUE(flexep::testing::same_bytes(cuda::to_host(again.weights, s), cuda::to_host(own.weights, s)));
  // An id outside [0, E) is passed on (for the dispatcher to report) with a NaN weight and no load.
  std::vector<std::int64_t> bad = device_ints(own.indices, s);
  bad[3] = E + 5;
  const cuda::RouterOutput b = cuda::router_forward(c, std::nullopt, x, w, {}, {}, {}, false, s,
                                                    cuda::to_device(Tensor::from_vector(bad, {T, k}), 0, s));
  const std::vector<std::int64_t> bidx = device_ints(b.indices, s);
  EXPECT_EQ(bidx[3], E + 5);
  EXPECT_TRUE(std::isnan(device_values(b.weights, s)[3]));
  std::int64_t load = 0;
  for (std::int64_t l : device_ints(b.expert_load, s)) load += l;
  EXPECT_EQ(load, T * k - 1);
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
  const Tensor w_f64 = cuda::to_device(grid({16, 8}, 1, "router.w", 4, 0.125).to(DType::f64), 0, s);
  expect_arg_error(fwd(c, x, w_f64), "weight");  // bf16 or f32 only
  {
    const Tensor forced = cuda::to_device(Tensor::zeros({5, 4}, DType::i64), 0, s);
    expect_arg_error([&] { (void)cuda::router_forward(c, std::nullopt, x, w, {}, {}, {}, false, s, forced); },
                     "replay_indices");  // moe.enable_routing_replay is false
    MoEConfig replay = c;
    replay.enable_routing_replay = true;
    const Tensor forced32 = cuda::to_device(Tensor::zeros({5, 4}, DType::i32), 0, s);
    expect_arg_error([&] { (void)cuda::router_forward(replay, std::nullopt, x, w, {}, {}, {}, false, s, forced32); },
                     "replay_indices");
    const Tensor forced_short = cuda::to_device(Tensor::zeros({5, 3}, DType::i64), 0, s);
    expect_arg_error(
        [&] { (void)cuda::router_forward(replay, std::nullopt, x, w, {}, {}, {}, false, s, forced_short); },
        "replay_indices");
  }

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
