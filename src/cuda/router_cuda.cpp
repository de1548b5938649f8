// Router host glue: argument validation, the cuBLAS GEMMs (logits, grad_x, grad_weight) and the
// order of the kernel launches. The kernels are in router_{route,reduce,backward,cast}.cu.
#include "flexep/cuda/router.h"

#include <climits>
#include <cmath>
#include <string>
#include <type_traits>

#include "cuda/router_kernels.h"
#include "flexep/core/checks.h"
#include "flexep/cuda/cublas.h"
#include "flexep/cuda/runtime.h"
#include "core/gate_rules.h"

namespace flexep::cuda {

namespace {

using router::launch_cast;

using gate_rules::top2_group_score;
using gate_rules::uses_groups;
bool normalized(const MoEConfig& c) { return c.norm_topk_prob && c.n_activated_experts > 1; }

// The CPU Gate's checks (src/layer/gate.cpp, validate_gate; the shared tail in core/gate_rules.h) plus the
// kernel limits.
void validate_config(const MoEConfig& c, std::optional<DType> precision) {
  const int E = c.n_routed_experts, k = c.n_activated_experts;
  FLEXEP_CHECK_ARG(E >= 1 && E <= kRouterMaxExperts, "moe.n_routed_experts", "must be in [1, ", kRouterMaxExperts,
                   "] on the GPU (one warp holds a token's scores), got ", E);
  FLEXEP_CHECK_ARG(c.dim >= 1, "moe.dim", "must be >= 1, got ", c.dim);
  FLEXEP_CHECK_ARG(k >= 1 && k <= E, "moe.n_activated_experts", "must be in [1, moe.n_routed_experts = ", E,
                   "], got ", k);
  FLEXEP_CHECK_ARG(k <= kRouterMaxTopK, "moe.n_activated_experts", "must be <= ", kRouterMaxTopK,
                   " on the GPU (one slot per lane), got ", k);
  FLEXEP_CHECK_ARG(std::isfinite(c.route_scale), "moe.route_scale", "must be finite, got ", c.route_scale);
  FLEXEP_CHECK_ARG(c.aux_loss_coeff >= 0 && std::isfinite(c.aux_loss_coeff), "moe.aux_loss_coeff",
                   "must be a finite value >= 0, got ", c.aux_loss_coeff);
  gate_rules::validate_precision_and_groups(c, precision);
}

// `t` is required, of `shape`, one of `dtypes`, on `device`.
void check_tensor(const TensorView& t, std::initializer_list<std::int64_t> shape, std::initializer_list<DType> dtypes,
                  Device device, const std::string& arg) {
  check::shape(t, shape, arg);
  check::dtype(t, dtypes, arg);
  FLEXEP_CHECK_ARG(t.device == device, arg, "is on device ", t.device.str(), " but 'x' is on ", device.str(),
                   "; all router tensors must be on the same CUDA device");
}

// ---- GEMMs: row-major operands, cuBLAS column-major calls ---------------------------------------
struct GemmTypes {
  cudaDataType a, b, c;
  cublasComputeType_t compute;
  bool double_scalars;
};
// bf16 inputs on the tensor cores, fp32 accumulation.
constexpr GemmTypes kBf16ToF32{CUDA_R_16BF, CUDA_R_16BF, CUDA_R_32F, CUBLAS_COMPUTE_32F, false};
constexpr GemmTypes kBf16ToBf16{CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF, CUBLAS_COMPUTE_32F, false};
// Pedantic: true fp32 / fp64 whatever the handle's math mode (no TF32, no emulation).
constexpr GemmTypes kF32{CUDA_R_32F, CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F_PEDANTIC, false};
constexpr GemmTypes kF64{CUDA_R_64F, CUDA_R_64F, CUDA_R_64F, CUBLAS_COMPUTE_64F_PEDANTIC, true};

// Column-major C [m, n] = op(A) [m, k] op(B) [k, n] + beta C.
void gemm(cudaStream_t stream, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void* A, int lda,
          const void* B, int ldb, double beta, void* C, int ldc, const GemmTypes& ty) {
  cublasHandle_t h = cublas_handle(stream);
  FLEXEP_CUBLAS_CHECK(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST));  // the scalars below live on the host
  if (ty.double_scalars) {
    const double one = 1.0, b = beta;
    FLEXEP_CUBLAS_CHECK(cublasGemmEx(h, ta, tb, m, n, k, &one, A, ty.a, lda, B, ty.b, ldb, &b, C, ty.c, ldc,
                                     ty.compute, CUBLAS_GEMM_DEFAULT));
  } else {
    const float one = 1.0f, b = static_cast<float>(beta);
    FLEXEP_CUBLAS_CHECK(cublasGemmEx(h, ta, tb, m, n, k, &one, A, ty.a, lda, B, ty.b, ldb, &b, C, ty.c, ldc,
                                     ty.compute, CUBLAS_GEMM_DEFAULT));
  }
}

// logits [T, E] = x [T, dim] W [E, dim]^T: column-major logits^T = W^T x^T.
void logits_gemm(cudaStream_t s, const void* w, const void* x, void* logits, int T, int E, int dim,
                 const GemmTypes& ty) {
  gemm(s, CUBLAS_OP_T, CUBLAS_OP_N, E, T, dim, w, dim, x, dim, 0.0, logits, E, ty);
}
// grad_x [T, dim] = g [T, K] W [K, dim]: column-major grad_x^T = W^T g^T.
void grad_x_gemm(cudaStream_t s, const void* w, const void* g, void* grad_x, int T, int K, int dim,
                 const GemmTypes& ty) {
  gemm(s, CUBLAS_OP_N, CUBLAS_OP_N, dim, T, K, w, dim, g, K, 0.0, grad_x, dim, ty);
}
// grad_w [E, dim] (+)= g^T x with g [T, E] of row stride ldg: column-major grad_w^T = x^T g.
void grad_w_gemm(cudaStream_t s, const void* x, const void* g, int ldg, void* grad_w, int T, int E, int dim,
                 double beta, const GemmTypes& ty) {
  gemm(s, CUBLAS_OP_N, CUBLAS_OP_T, dim, E, T, x, dim, g, ldg, beta, grad_w, dim, ty);
}

// src (bf16 or f32) as a new tensor of T (bf16, f32 or f64).
template <class T>
Tensor cast_to(const TensorView& src, Device dev, cudaStream_t stream) {
  Tensor t = Tensor::empty(src.shape, dtype_of_v<T>, dev);
  if (src.dtype == dtype_of_v<T>) {
    copy_async(t, src, stream);
  } else if (src.dtype == DType::bf16) {
    if constexpr (!std::is_same_v<T, bf16>) launch_cast(src.ptr<bf16>(), t.data<T>(), src.numel(), stream);
  } else {
    if constexpr (!std::is_same_v<T, float>) launch_cast(src.ptr<float>(), t.data<T>(), src.numel(), stream);
  }
  return t;
}

// The gate weight in the dtype of the unset precision's linear: bf16 (Automodel's weight.to(x.dtype)).
// A bf16 weight is used in place; an f32 one (gate_dtype float32) is rounded into `storage`.
const void* bf16_weight(const TensorView& weight, Tensor& storage, cudaStream_t stream) {
  if (weight.dtype == DType::bf16) return weight.data;
  storage = cast_to<bf16>(weight, weight.device, stream);
  return storage.raw();
}

router::RouteParams route_params(const MoEConfig& c, std::optional<DType> precision) {
  router::RouteParams p;
  p.experts = c.n_routed_experts;
  p.topk = c.n_activated_experts;
  if (uses_groups(c)) {
    p.groups = c.n_expert_groups;
    p.limited_groups = c.n_limited_groups;
  }
  p.top2_group_score = top2_group_score(c);
  p.neg_inf_mask = c.group_mask_neg_inf();
  p.score = static_cast<int>(gate_rules::score_kind(c));
  p.topk_then_softmax = gate_rules::topk_then_softmax(c);
  p.weights_from_biased = gate_rules::weights_from_biased_scores(c);
  p.normalized = normalized(c);
  p.round_logits_bf16 = gate_rules::rounds_logits(precision, DType::bf16);
  p.round_weights_bf16 = !c.router_weights_fp32;
  p.route_scale = c.route_scale;
  return p;
}

static_assert(static_cast<int>(gate_rules::ScoreKind::softmax) == router::kSoftmax &&
                  static_cast<int>(gate_rules::ScoreKind::sigmoid) == router::kSigmoid &&
                  static_cast<int>(gate_rules::ScoreKind::sqrtsoftplus) == router::kSqrtSoftplus,
              "the kernels' score kinds are gate_rules'");

// logits [T, E] in L's arithmetic (f32 for the unset precision's bf16 GEMM and for f32, f64 for f64).
template <class L>
void compute_logits(std::optional<DType> precision, const TensorView& x, const TensorView& weight, const Tensor& logits,
                    cudaStream_t stream) {
  const int T = static_cast<int>(x.size(0)), dim = static_cast<int>(x.size(1)), E = static_cast<int>(weight.size(0));
  if (!precision) {
    Tensor rounded;
    logits_gemm(stream, bf16_weight(weight, rounded, stream), x.data, logits.raw(), T, E, dim, kBf16ToF32);
    return;
  }
  const Tensor xs = cast_to<L>(x, x.device, stream), ws = cast_to<L>(weight, x.device, stream);
  logits_gemm(stream, ws.raw(), xs.raw(), logits.raw(), T, E, dim, sizeof(L) == 8 ? kF64 : kF32);
}

// S: the routing arithmetic; L: the logits' (differs only for sqrtsoftplus under f64 precision,
// which scores the f64 logits after rounding them to fp32, as Automodel's logits.float()).
template <class S, class L>
RouterOutput forward_impl(const MoEConfig& c, std::optional<DType> precision, const TensorView& x,
                          const TensorView& weight, const TensorView& bias, const TensorView& correction_bias,
                          const TensorView& token_mask, const TensorView& replay, bool training, cudaStream_t stream) {
  const Device dev = x.device;
  const DType sd = dtype_of_v<S>;
  const std::int64_t T = x.size(0), E = c.n_routed_experts, k = c.n_activated_experts;
  RouterOutput out;
  out.config = c;
  out.gate_precision = precision;
  out.tokens = T;
  out.logits = Tensor::empty({T, E}, sd, dev);
  const bool biased_weights = gate_rules::weights_from_biased_scores(c);
  if (biased_weights) {  // the backward's aux term reads the original (biased) scores
    out.score_offset = Tensor::empty({E}, DType::f32, dev);
    copy_async(out.score_offset, correction_bias, stream);
  }
  out.scores = Tensor::empty({T, E}, sd, dev);
  out.topk_scores = Tensor::empty({T, k}, sd, dev);
  out.weights = Tensor::empty({T, k}, DType::f32, dev);
  out.indices = Tensor::empty({T, k}, DType::i64, dev);
  out.expert_load = Tensor::empty({E}, DType::i64, dev);
  zero_async(out.expert_load, stream);
  if (token_mask.defined()) {
    out.token_mask = Tensor::empty({T}, DType::b8, dev);
    copy_async(out.token_mask, token_mask, stream);
  }
  const bool aux = training && c.aux_loss_coeff > 0;
  Tensor denominators;  // sum_e scores + eps per token: original_scores' normalisation
  if (aux && normalized(c)) denominators = Tensor::empty({T}, sd, dev);

  if (T > 0) {
    if constexpr (std::is_same_v<S, L>) {
      compute_logits<L>(precision, x, weight, out.logits, stream);
    } else {
      const Tensor wide = Tensor::empty({T, E}, dtype_of_v<L>, dev);
      compute_logits<L>(precision, x, weight, wide, stream);
      launch_cast(wide.data<L>(), out.logits.data<S>(), wide.numel(), stream);
    }
    router::RouteArgs<S> a;
    a.tokens = T;
    a.logits = out.logits.data<S>();
    a.bias = bias.defined() ? bias.data : nullptr;
    a.bias_is_bf16 = bias.defined() && bias.dtype == DType::bf16;
    a.correction_bias =
        correction_bias.defined() && c.score_func != ScoreFunc::softmax ? correction_bias.ptr<float>() : nullptr;
    a.mask = token_mask.defined() ? token_mask.ptr<bool>() : nullptr;
    a.replay = replay.defined() ? replay.ptr<std::int64_t>() : nullptr;
    a.scores = out.scores.data<S>();
    a.topk_scores = out.topk_scores.data<S>();
    a.weights = out.weights.data<float>();
    a.indices = out.indices.data<std::int64_t>();
    a.load = out.expert_load.data<std::int64_t>();
    a.score_denominator = denominators.defined() ? denominators.data<S>() : nullptr;
    router::launch_route<S>(route_params(c, precision), a, stream);
  }

  if (aux) {
    const router::ColumnChunks ch = router::column_chunks(T);
    const Tensor partial = Tensor::empty({ch.chunks, E}, DType::f64, dev);
    const Tensor valid = Tensor::empty({ch.chunks}, DType::i32, dev);
    router::launch_column_partial_sums<S>(out.scores.data<S>(), token_mask.defined() ? token_mask.ptr<bool>() : nullptr,
                                          denominators.defined() ? denominators.data<S>() : nullptr,
                                          biased_weights ? out.score_offset.data<float>() : nullptr, T,
                                          static_cast<int>(E), partial.data<double>(), valid.data<std::int32_t>(),
                                          stream);
    out.aux_f_over_ctx = Tensor::empty({E}, DType::f64, dev);
    out.aux_loss = Tensor::empty({1}, sd, dev);
    router::launch_aux_finish(partial.data<double>(), valid.data<std::int32_t>(), ch.chunks,
                              out.expert_load.data<std::int64_t>(), static_cast<int>(E), static_cast<int>(k),
                              out.aux_f_over_ctx.data<double>(), out.aux_loss.raw(), sizeof(S) == 8, stream);
  }
  return out;
}

// grad_x and grad_weight from fp32 grad_logits for the unset precision: g = hi + lo in bf16, so
// grad_x = [hi | lo] [W ; W] is one bf16 GEMM with K = 2E, and grad_weight += hi^T x + lo^T x, where
// [hi | lo]^T x is one GEMM of 2E rows (x, the big operand, read once) whose halves are then added.
void input_grads_bf16(const Tensor& g, const TensorView& x, const TensorView& weight, const Tensor& grad_x,
                      const TensorView& grad_weight, cudaStream_t stream) {
  const Device dev = x.device;
  const int T = static_cast<int>(x.size(0)), dim = static_cast<int>(x.size(1)), E = static_cast<int>(weight.size(0));
  const Tensor hl = Tensor::empty({T, 2 * E}, DType::bf16, dev);
  router::launch_split_bf16(g.data<float>(), hl.data<bf16>(), T, E, stream);
  {
    // The weight the forward's linear used: bf16, rounded from an f32 weight.
    Tensor rounded;
    const TensorView w16(const_cast<void*>(bf16_weight(weight, rounded, stream)), DType::bf16, weight.shape,
                         weight.device);
    const Tensor w2 = Tensor::empty({2 * E, dim}, DType::bf16, dev);
    copy_async(w2.view().rows(0, E), w16, stream);
    copy_async(w2.view().rows(E, 2 * E), w16, stream);
    grad_x_gemm(stream, w2.raw(), hl.raw(), grad_x.raw(), T, 2 * E, dim, kBf16ToBf16);
  }
  if (!grad_weight.defined()) return;
  const Tensor halves = Tensor::empty({2 * E, dim}, DType::f32, dev);
  grad_w_gemm(stream, x.data, hl.data<bf16>(), 2 * E, halves.raw(), T, 2 * E, dim, 0.0, kBf16ToF32);
  router::launch_accumulate_halves(halves.data<float>(), grad_weight.ptr<float>(), static_cast<std::int64_t>(E) * dim,
                                   stream);
}

// grad_x and grad_weight in the gate precision S (x and W cast to S, pedantic GEMMs); grad_x is
// rounded once to bf16, grad_weight accumulated into fp32.
template <class S>
void input_grads_exact(const Tensor& g, const TensorView& x, const TensorView& weight, const Tensor& grad_x,
                       const TensorView& grad_weight, cudaStream_t stream) {
  const Device dev = x.device;
  const int T = static_cast<int>(x.size(0)), dim = static_cast<int>(x.size(1)), E = static_cast<int>(weight.size(0));
  const GemmTypes& ty = sizeof(S) == 8 ? kF64 : kF32;
  {
    const Tensor ws = cast_to<S>(weight, dev, stream);
    const Tensor gx = Tensor::empty({T, dim}, dtype_of_v<S>, dev);
    grad_x_gemm(stream, ws.raw(), g.raw(), gx.raw(), T, E, dim, ty);
    launch_cast(gx.data<S>(), grad_x.data<bf16>(), gx.numel(), stream);
  }
  if (!grad_weight.defined()) return;
  const Tensor xs = cast_to<S>(x, dev, stream);
  if constexpr (sizeof(S) == 8) {
    const Tensor gw = Tensor::empty({E, dim}, DType::f64, dev);  // fp64 GEMMs cannot write fp32
    grad_w_gemm(stream, xs.raw(), g.raw(), E, gw.raw(), T, E, dim, 0.0, ty);
    router::launch_accumulate(gw.data<double>(), grad_weight.ptr<float>(), gw.numel(), stream);
  } else {
    grad_w_gemm(stream, xs.raw(), g.raw(), E, grad_weight.data, T, E, dim, 1.0, ty);
  }
}

template <class S>
RouterGrads backward_impl(const RouterOutput& f, const TensorView& grad_weights, const TensorView& x,
                          const TensorView& weight, const TensorView& grad_weight, const TensorView& grad_bias,
                          double aux_loss_scale, cudaStream_t stream) {
  const MoEConfig& c = f.config;
  const Device dev = x.device;
  const std::int64_t T = f.tokens, E = c.n_routed_experts;
  RouterGrads out;
  out.grad_logits = Tensor::empty({T, E}, dtype_of_v<S>, dev);
  out.grad_x = Tensor::empty({T, c.dim}, DType::bf16, dev);
  if (T == 0) return out;

  router::BackwardParams p;
  p.experts = c.n_routed_experts;
  p.topk = c.n_activated_experts;
  p.score = static_cast<int>(gate_rules::score_kind(c));
  p.topk_then_softmax = gate_rules::topk_then_softmax(c);
  p.normalized = normalized(c);
  p.route_scale = c.route_scale;
  p.aux = f.aux_loss.defined();
  p.aux_scale = c.aux_loss_coeff * aux_loss_scale;
  router::BackwardArgs<S> a;
  a.tokens = T;
  a.grad_weights = grad_weights.ptr<float>();
  a.indices = f.indices.data<std::int64_t>();
  a.topk_scores = f.topk_scores.data<S>();
  a.scores = f.scores.data<S>();
  a.logits = f.logits.data<S>();
  a.score_offset = f.score_offset.defined() ? f.score_offset.data<float>() : nullptr;
  a.mask = f.token_mask.defined() ? f.token_mask.data<bool>() : nullptr;
  a.f_over_ctx = p.aux ? f.aux_f_over_ctx.data<double>() : nullptr;
  a.grad_logits = out.grad_logits.data<S>();
  router::launch_router_backward<S>(p, a, stream);

  if constexpr (sizeof(S) == 4) {
    if (!f.gate_precision) {
      input_grads_bf16(out.grad_logits, x, weight, out.grad_x, grad_weight, stream);
    } else if (*f.gate_precision == DType::f64) {
      // fp32 routing on f64 logits (sqrtsoftplus): the linear's backward is f64, as its forward.
      const Tensor g64 = cast_to<double>(out.grad_logits, dev, stream);
      input_grads_exact<double>(g64, x, weight, out.grad_x, grad_weight, stream);
    } else {
      input_grads_exact<float>(out.grad_logits, x, weight, out.grad_x, grad_weight, stream);
    }
  } else {
    input_grads_exact<double>(out.grad_logits, x, weight, out.grad_x, grad_weight, stream);
  }

  if (grad_bias.defined()) {
    const router::ColumnChunks ch = router::column_chunks(T);
    const Tensor partial = Tensor::empty({ch.chunks, E}, DType::f64, dev);
    router::launch_column_partial_sums<S>(out.grad_logits.data<S>(), nullptr, nullptr, nullptr, T,
                                          static_cast<int>(E), partial.data<double>(), nullptr, stream);
    router::launch_add_column_sums(partial.data<double>(), ch.chunks, static_cast<int>(E), grad_bias.ptr<float>(),
                                   stream);
  }
  return out;
}

}  // namespace

RouterOutput router_forward(const MoEConfig& config, std::optional<DType> gate_precision, const TensorView& x,
                            const TensorView& weight, const TensorView& bias, const TensorView& correction_bias,
                            const TensorView& token_mask, bool training, cudaStream_t stream,
                            const TensorView& replay_indices) {
  validate_config(config, gate_precision);
  const std::int64_t E = config.n_routed_experts;
  check::shape(x, {-1, config.dim}, "x");
  FLEXEP_CHECK_ARG(x.device.is_cuda(), "x", "is on device ", x.device.str(), "; the GPU router takes CUDA tensors");
  check::dtype(x, {DType::bf16}, "x");
  const std::int64_t T = x.size(0);
  FLEXEP_CHECK_ARG(T <= INT_MAX, "x", "has ", T, " rows; at most ", INT_MAX, " are supported");
  check_tensor(weight, {E, config.dim}, {DType::bf16, DType::f32}, x.device, "weight");
  if (config.router_bias) check_tensor(bias, {E}, {DType::bf16, DType::f32}, x.device, "bias");
  else FLEXEP_CHECK_ARG(!bias.defined(), "bias", "was given but moe.router_bias is false");
  if (config.has_correction_bias()) check_tensor(correction_bias, {E}, {DType::f32}, x.device, "correction_bias");
  else
    FLEXEP_CHECK_ARG(!correction_bias.defined(), "correction_bias",
                     "was given but the config has none (moe.gate_bias_update_factor = 0 and "
                     "moe.force_e_score_correction_bias = false)");
  if (token_mask.defined()) check_tensor(token_mask, {T}, {DType::b8}, x.device, "token_mask");
  if (replay_indices.defined()) {
    FLEXEP_CHECK_ARG(config.enable_routing_replay, "replay_indices",
                     "were given but moe.enable_routing_replay is false");
    check_tensor(replay_indices, {T, config.n_activated_experts}, {DType::i64}, x.device, "replay_indices");
  }

  init();
  DeviceGuard device(x.device.index);
  StreamGuard ordered(stream);  // outlives every temporary below: they are freed on `stream`
  const TensorView& r = replay_indices;
  if (gate_precision == DType::f64) {
    if (gate_rules::routes_in_fp32(config))
      return forward_impl<float, double>(config, gate_precision, x, weight, bias, correction_bias, token_mask, r,
                                         training, stream);
    return forward_impl<double, double>(config, gate_precision, x, weight, bias, correction_bias, token_mask, r,
                                        training, stream);
  }
  return forward_impl<float, float>(config, gate_precision, x, weight, bias, correction_bias, token_mask, r, training,
                                    stream);
}

RouterGrads router_backward(const RouterOutput& forward, const TensorView& grad_weights, const TensorView& x,
                            const TensorView& weight, const TensorView& grad_weight, const TensorView& grad_bias,
                            double aux_loss_scale, cudaStream_t stream) {
  FLEXEP_CHECK_ARG(forward.scores.defined() && forward.topk_scores.defined() && forward.indices.defined(), "forward",
                   "has no saved state; pass the RouterOutput returned by router_forward");
  const MoEConfig& c = forward.config;
  const std::int64_t T = forward.tokens, E = c.n_routed_experts, k = c.n_activated_experts;
  const Device dev = forward.scores.device();
  check::shape(x, {T, c.dim}, "x");
  check::dtype(x, {DType::bf16}, "x");
  FLEXEP_CHECK_ARG(x.device == dev, "x", "is on device ", x.device.str(), " but the forward ran on ", dev.str());
  check_tensor(grad_weights, {T, k}, {DType::f32}, dev, "grad_weights");
  check_tensor(weight, {E, c.dim}, {DType::bf16, DType::f32}, dev, "weight");
  if (grad_weight.defined()) check_tensor(grad_weight, {E, c.dim}, {DType::f32}, dev, "grad_weight");
  if (grad_bias.defined()) {
    FLEXEP_CHECK_ARG(c.router_bias, "grad_bias", "was given but the forward ran without a router bias");
    check_tensor(grad_bias, {E}, {DType::f32}, dev, "grad_bias");
  }
  FLEXEP_CHECK_ARG(std::isfinite(aux_loss_scale), "aux_loss_scale", "must be finite, got ", aux_loss_scale);
  FLEXEP_CHECK_ARG(!forward.aux_loss.defined() || forward.aux_f_over_ctx.defined(), "forward",
                   "has an aux loss but no aux_f_over_ctx; pass the RouterOutput returned by router_forward");

  init();
  DeviceGuard device(dev.index);
  StreamGuard ordered(stream);
  if (forward.scores.dtype() == DType::f64)
    return backward_impl<double>(forward, grad_weights, x, weight, grad_weight, grad_bias, aux_loss_scale, stream);
  return backward_impl<float>(forward, grad_weights, x, weight, grad_weight, grad_bias, aux_loss_scale, stream);
}

}  // namespace flexep::cuda
