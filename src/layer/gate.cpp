#include "flexep/layer/gate.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "flexep/core/checks.h"
#include "flexep/core/random.h"
#include "core/gate_rules.h"
#include "layer/gate_saved.h"

namespace flexep {

namespace {

constexpr double kNormEps = 1e-20;  // Automodel's denominator guard for norm_topk_prob

using gate_rules::top2_group_score;
using gate_rules::uses_groups;

void validate_gate(const MoEConfig& c, std::optional<DType> precision) {
  const int E = c.n_routed_experts, k = c.n_activated_experts;
  FLEXEP_CHECK_ARG(E >= 1, "moe.n_routed_experts", "must be >= 1, got ", E);
  FLEXEP_CHECK_ARG(c.dim >= 1, "moe.dim", "must be >= 1, got ", c.dim);
  FLEXEP_CHECK_ARG(k >= 1 && k <= E, "moe.n_activated_experts", "must be in [1, moe.n_routed_experts = ", E,
                   "], got ", k);
  FLEXEP_CHECK_ARG(c.gate_bias_update_factor >= 0 && std::isfinite(c.gate_bias_update_factor),
                   "moe.gate_bias_update_factor", "must be a finite value >= 0, got ", c.gate_bias_update_factor);
  FLEXEP_CHECK_ARG(c.aux_loss_coeff >= 0 && std::isfinite(c.aux_loss_coeff), "moe.aux_loss_coeff",
                   "must be a finite value >= 0, got ", c.aux_loss_coeff);
  FLEXEP_CHECK_ARG(c.train_gate || c.gate_bias_update_factor == 0, "moe.train_gate",
                   "must be true when moe.gate_bias_update_factor > 0 (got factor ", c.gate_bias_update_factor,
                   "): the bias update is part of gate training");
  gate_rules::validate_precision_and_groups(c, precision);
}

// v cast to dtype d and back, as torch's .to(d) rounds it (a double reaches the 16-bit types through
// float, like c10's conversions).
double cast_value(DType d, double v) {
  switch (d) {
    case DType::f32:
      return static_cast<float>(v);
    case DType::bf16:
      return bf16::from_float(static_cast<float>(v)).to_float();
    case DType::f16:
      return f16::from_float(static_cast<float>(v)).to_float();
    default:
      return v;
  }
}

// t's values cast to dtype d (see cast_value), in S.
template <class S>
std::vector<S> cast_values(const TensorView& t, DType d) {
  std::vector<S> v(static_cast<std::size_t>(t.numel()));
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = static_cast<S>(cast_value(d, read_as_double(t, static_cast<std::int64_t>(i))));
  return v;
}

template <class R>
void softmax(const R* z, int n, R* out) {
  R m = z[0];
  for (int i = 1; i < n; ++i) m = std::max(m, z[i]);
  R sum = 0;
  for (int i = 0; i < n; ++i) sum += (out[i] = std::exp(z[i] - m));
  for (int i = 0; i < n; ++i) out[i] /= sum;
}

template <class R>
void row_scores(gate_rules::ScoreKind kind, const R* z, int n, R* p) {
  switch (kind) {
    case gate_rules::ScoreKind::softmax:
      softmax(z, n, p);
      break;
    case gate_rules::ScoreKind::sigmoid:
      for (int e = 0; e < n; ++e) p[e] = R(1) / (R(1) + std::exp(-z[e]));
      break;
    case gate_rules::ScoreKind::sqrtsoftplus:
      for (int e = 0; e < n; ++e) p[e] = std::sqrt(gate_rules::softplus(z[e]));
      break;
  }
}

// Keeps the n_limited_groups best groups of `choice`; the others are set to -inf or multiplied by 0
// (Automodel's mask: with negative biased scores a dropped expert then outranks the kept ones).
template <class R>
void limit_groups(const MoEConfig& c, R* choice, std::vector<R>& group_score, std::vector<std::int64_t>& kept,
                  std::vector<unsigned char>& scratch) {
  const int G = c.n_expert_groups, size = c.n_routed_experts / G;
  const bool top2 = top2_group_score(c);
  group_score.resize(static_cast<std::size_t>(G));
  for (int g = 0; g < G; ++g) {
    const R* v = choice + g * size;
    R first = -std::numeric_limits<R>::infinity(), second = first;
    for (int i = 0; i < size; ++i) {
      if (v[i] > first) {
        second = first;
        first = v[i];
      } else if (v[i] > second) {
        second = v[i];
      }
    }
    group_score[static_cast<std::size_t>(g)] = top2 ? first + second : first;
  }
  kept.resize(static_cast<std::size_t>(c.n_limited_groups));
  select_top_k(group_score.data(), G, c.n_limited_groups, kept.data(), scratch);
  std::vector<unsigned char> keep(static_cast<std::size_t>(G), 0);
  for (std::int64_t g : kept) keep[static_cast<std::size_t>(g)] = 1;
  const bool neg_inf = c.group_mask_neg_inf();
  for (int g = 0; g < G; ++g) {
    if (keep[static_cast<std::size_t>(g)]) continue;
    for (R* v = choice + g * size; v != choice + (g + 1) * size; ++v)
      *v = neg_inf ? -std::numeric_limits<R>::infinity() : *v * R(0);
  }
}

// logits [T, E] = x W^T + b as Automodel's F.linear computes them: x, W and b cast to the linear's
// dtype L (the gate precision, else x's dtype), accumulated in S, and rounded to L when L is a
// 16-bit type.
template <class S>
std::vector<S> logits(const MoEConfig& c, const TensorView& x, const TensorView& w, const TensorView& b, DType L,
                      bool round, GateSaved& s) {
  const std::size_t T = static_cast<std::size_t>(x.size(0)), E = static_cast<std::size_t>(c.n_routed_experts),
                    D = static_cast<std::size_t>(c.dim);
  const std::vector<S> xs = cast_values<S>(x, L), ws = cast_values<S>(w, L);
  const std::vector<S> bs = b.defined() ? cast_values<S>(b, L) : std::vector<S>(E, S(0));
  s.x.assign(xs.begin(), xs.end());
  std::vector<S> z(T * E);
  for (std::size_t t = 0; t < T; ++t)
    for (std::size_t e = 0; e < E; ++e) {
      const S* xt = xs.data() + t * D;
      const S* we = ws.data() + e * D;
      S acc = 0;
      for (std::size_t d = 0; d < D; ++d) acc += xt[d] * we[d];
      acc += bs[e];
      z[t * E + e] = round ? static_cast<S>(cast_value(L, acc)) : acc;
    }
  return z;
}

// Scores, selection (or the replayed one) and weights for every token in precision R, from the
// logits. Fills the saved state and returns the final weights [T, k].
template <class R, class S>
std::vector<R> route(const MoEConfig& c, const std::vector<S>& logits_in, const Tensor& correction_bias,
                     const std::vector<std::int64_t>* replay, GateSaved& s) {
  const std::size_t E = static_cast<std::size_t>(c.n_routed_experts);
  const std::size_t k = static_cast<std::size_t>(c.n_activated_experts);
  const std::size_t T = logits_in.size() / E;
  std::vector<R> cb(E, R(0));
  if (gate_rules::uses_correction_bias(c))
    for (std::size_t e = 0; e < E; ++e) cb[e] = static_cast<R>(correction_bias.data<float>()[e]);
  const bool biased_weights = gate_rules::weights_from_biased_scores(c);

  s.indices.resize(T * k);
  s.topk_scores.resize(T * k);
  s.scores.resize(T * E);
  if (biased_weights) s.original.resize(T * E);
  if (s.kind == gate_rules::ScoreKind::sqrtsoftplus) s.logits.resize(T * E);

  std::vector<R> out(T * k), z(E), p(E), choice(E), w0(k), group_score;
  std::vector<std::int64_t> kept;
  std::vector<unsigned char> scratch;
  const R scale = static_cast<R>(c.route_scale);
  for (std::size_t t = 0; t < T; ++t) {
    for (std::size_t e = 0; e < E; ++e) z[e] = static_cast<R>(logits_in[t * E + e]);
    std::int64_t* idx = s.indices.data() + t * k;
    if (replay) std::copy_n(replay->data() + t * k, k, idx);
    row_scores(s.kind, z.data(), c.n_routed_experts, p.data());
    if (s.topk_then_softmax) {
      // Top-k of the raw logits, then a softmax over just those k.
      if (!replay) select_top_k(z.data(), c.n_routed_experts, c.n_activated_experts, idx, scratch);
      for (std::size_t j = 0; j < k; ++j) w0[j] = z[static_cast<std::size_t>(idx[j])];
      softmax(w0.data(), c.n_activated_experts, w0.data());
    } else {
      // Selection on the (biased, group-limited) scores; weights gathered from the original ones.
      for (std::size_t e = 0; e < E; ++e) choice[e] = p[e] + cb[e];
      if (biased_weights)
        for (std::size_t e = 0; e < E; ++e) s.original[t * E + e] = choice[e];
      if (!replay) {
        if (uses_groups(c)) limit_groups(c, choice.data(), group_score, kept, scratch);
        select_top_k(choice.data(), c.n_routed_experts, c.n_activated_experts, idx, scratch);
      }
      for (std::size_t j = 0; j < k; ++j) {
        const std::size_t e = static_cast<std::size_t>(idx[j]);
        w0[j] = biased_weights ? p[e] + cb[e] : p[e];
      }
    }
    R denom = 1;
    if (s.normalized) {
      denom = 0;
      for (std::size_t j = 0; j < k; ++j) denom += w0[j];
      denom += static_cast<R>(kNormEps);
    }
    for (std::size_t j = 0; j < k; ++j) {
      s.topk_scores[t * k + j] = w0[j];
      out[t * k + j] = w0[j] / denom * scale;
    }
    std::copy(p.begin(), p.end(), s.scores.begin() + static_cast<std::ptrdiff_t>(t * E));
    if (!s.logits.empty()) std::copy(z.begin(), z.end(), s.logits.begin() + static_cast<std::ptrdiff_t>(t * E));
  }
  return out;
}

// original_scores after Automodel's normalisation (norm_topk_prob, k > 1: divided by their own sum).
double original_score_denominator(const GateSaved& s, std::int64_t t) {
  if (!s.normalized) return 1.0;
  double sum = 0;
  for (int e = 0; e < s.experts; ++e) sum += s.original_score(static_cast<std::size_t>(t * s.experts + e));
  return sum + kNormEps;
}

// L = sum_e f_e P_e; fills the per-expert factor that backward needs.
double aux_loss(const MoEConfig& c, GateSaved& s, const std::vector<std::int64_t>& load) {
  const std::size_t E = static_cast<std::size_t>(s.experts), T = static_cast<std::size_t>(s.tokens);
  double valid = 0;
  for (unsigned char m : s.mask) valid += m;
  const double ctx = std::max(valid, 1.0);
  std::vector<double> score_sum(E, 0.0);
  for (std::size_t t = 0; t < T; ++t) {
    if (!s.mask[t]) continue;
    const double denom = original_score_denominator(s, static_cast<std::int64_t>(t));
    for (std::size_t e = 0; e < E; ++e) score_sum[e] += s.original_score(t * E + e) / denom;
  }
  s.has_aux = true;
  s.aux_f_over_ctx.resize(E);
  double loss = 0;
  for (std::size_t e = 0; e < E; ++e) {
    const double f = static_cast<double>(load[e]) * static_cast<double>(E) / (c.n_activated_experts * ctx);
    loss += f * score_sum[e] / ctx;
    s.aux_f_over_ctx[e] = f / ctx;
  }
  return loss;
}

// A gradient target: undefined, or its weight's shape, a float dtype, on the CPU.
void check_target(const Tensor& grad, const TensorView& weight, const char* name) {
  if (!grad.defined()) return;
  FLEXEP_CHECK_ARG(weight.defined(), name, "gradient target given, but the weight is absent");
  FLEXEP_CHECK_ARG(grad.shape() == weight.shape && grad.device().is_cpu(), name, "gradient target has shape ",
                   grad.shape().str(), " on ", grad.device().str(), ", expected ", weight.shape.str(), " on cpu");
  check::dtype(grad, {DType::f32, DType::f64, DType::bf16, DType::f16}, name);
}

void accumulate_grad(const Tensor& grad, const std::vector<double>& g) {
  if (grad.dtype() == DType::f64) {
    double* d = grad.data<double>();
    for (std::size_t i = 0; i < g.size(); ++i) d[i] += g[i];
  } else if (grad.dtype() == DType::f32) {
    float* d = grad.data<float>();
    for (std::size_t i = 0; i < g.size(); ++i) d[i] = static_cast<float>(d[i] + g[i]);
  } else {
    for (std::size_t i = 0; i < g.size(); ++i) {
      const auto at = static_cast<std::int64_t>(i);
      write_from_double(grad, at, read_as_double(grad, at) + g[i]);
    }
  }
}

// The gate weight as route<S> read it in the forward: rounded to the routing precision, widened.
const std::initializer_list<DType> kGateTypes = {DType::f32, DType::f64, DType::bf16, DType::f16};

void check_gate_weights(const MoEConfig& c, const GateWeights& w) {
  const std::int64_t E = c.n_routed_experts;
  check::shape(w.weight, {E, c.dim}, "gate.weight");
  check::dtype(w.weight, kGateTypes, "gate.weight");
  check::device(w.weight, Device::cpu(), "gate.weight");
  FLEXEP_CHECK_ARG(w.bias.defined() == c.router_bias, "gate.bias", w.bias.defined() ? "was given" : "is missing",
                   " but moe.router_bias is ", c.router_bias ? "true" : "false");
  if (w.bias.defined()) {
    check::shape(w.bias, {E}, "gate.bias");
    check::dtype(w.bias, kGateTypes, "gate.bias");
    check::device(w.bias, Device::cpu(), "gate.bias");
  }
  const TensorView& cb = w.e_score_correction_bias;
  FLEXEP_CHECK_ARG(cb.defined() == c.has_correction_bias(), "gate.e_score_correction_bias",
                   cb.defined() ? "was given" : "is missing", " but this configuration ",
                   c.has_correction_bias() ? "has" : "has no",
                   " correction bias (moe.gate_bias_update_factor > 0 or moe.force_e_score_correction_bias)");
  if (cb.defined()) {
    check::shape(cb, {E}, "gate.e_score_correction_bias");
    check::dtype(cb, {DType::f32}, "gate.e_score_correction_bias");
    check::device(cb, Device::cpu(), "gate.e_score_correction_bias");
  }
}

}  // namespace

GateCompute::GateCompute(const MoEConfig& config, std::optional<DType> gate_precision)
    : config_(config), precision_(gate_precision) {
  validate_gate(config, gate_precision);
}

Gate::Gate(const MoEConfig& config, std::optional<DType> gate_precision, DType param_dtype)
    : config_(config), compute_(config, gate_precision) {
  FLEXEP_CHECK_ARG(param_dtype == DType::f32 || param_dtype == DType::f64, "param_dtype", "dtype ",
                   dtype_name(param_dtype), " is not supported by the CPU gate; allowed: f32, f64");
  const std::int64_t E = config.n_routed_experts;
  weight_.name = "weight";
  weight_.value = Tensor::zeros({E, config.dim}, param_dtype);
  weight_.requires_grad = config.train_gate;
  bias_.name = "bias";
  bias_.requires_grad = config.train_gate;
  if (config.router_bias) bias_.value = Tensor::zeros({E}, param_dtype);
  // fp32 whatever the parameter dtype: bf16 rounding of the bias would change which experts win.
  if (config.has_correction_bias()) correction_bias_ = Tensor::zeros({E}, DType::f32);
}

void Gate::init(std::uint64_t seed, double init_std) {
  FLEXEP_CHECK_ARG(init_std >= 0 && std::isfinite(init_std), "init_std", "must be a finite value >= 0, got ",
                   init_std);
  fill_normal(weight_.value, seed, stream_id("gate.weight"), 0.0, init_std);
  if (bias_.value.defined()) bias_.value.fill_zero();
  if (correction_bias_.defined()) correction_bias_.fill_zero();
  correction_bias_master_.clear();
}

std::vector<Parameter*> Gate::parameters() {
  std::vector<Parameter*> ps{&weight_};
  if (bias_.value.defined()) ps.push_back(&bias_);
  return ps;
}

GateWeights Gate::weights() const { return {weight_.value, bias_.value, correction_bias_}; }

void Gate::add_to_cumulative_load(const std::vector<std::int64_t>& expert_load) {
  FLEXEP_CHECK_ARG(expert_load.size() == static_cast<std::size_t>(config_.n_routed_experts), "expert_load", "has ",
                   expert_load.size(), " entries, expected moe.n_routed_experts = ", config_.n_routed_experts);
  if (cumulative_load_.empty()) cumulative_load_.assign(expert_load.size(), 0);
  for (std::size_t e = 0; e < cumulative_load_.size(); ++e) cumulative_load_[e] += expert_load[e];
}

GateOutput Gate::forward(const TensorView& x, const TensorView& token_mask, bool training,
                         const TensorView& replay_indices) {
  const DType param_dtype = weight_.value.dtype();
  check::shape(x, {-1, config_.dim}, "x");
  check::device(x, Device::cpu(), "x");
  check::dtype(x, kGateTypes, "x");
  FLEXEP_CHECK_ARG(x.dtype == param_dtype || x.dtype == DType::bf16 || x.dtype == DType::f16, "x", "dtype ",
                   dtype_name(x.dtype), " does not match the gate parameters' dtype ", dtype_name(param_dtype),
                   "; the CPU gate takes x in its parameter dtype, or in bf16/f16");
  GateOutput out = compute_.forward(weights(), x, token_mask, training, replay_indices);
  if (training && config_.gate_bias_update_factor > 0) add_to_cumulative_load(out.expert_load);
  return out;
}

GateOutput GateCompute::forward(const GateWeights& weights, const TensorView& x, const TensorView& token_mask,
                                bool training, const TensorView& replay_indices) const {
  check::shape(x, {-1, config_.dim}, "x");
  check::dtype(x, kGateTypes, "x");
  check::device(x, Device::cpu(), "x");
  check_gate_weights(config_, weights);
  const Tensor correction_bias = Tensor::wrap(weights.e_score_correction_bias);
  const std::int64_t T = x.size(0);
  const int E = config_.n_routed_experts, k = config_.n_activated_experts;
  std::vector<std::int64_t> replay;
  if (replay_indices.defined()) {
    FLEXEP_CHECK_ARG(config_.enable_routing_replay, "replay_indices",
                     "were given but moe.enable_routing_replay is false");
    replay = gate_rules::read_replay_indices(replay_indices, T, k, E);
  }

  auto saved = std::make_shared<GateSaved>();
  GateSaved& s = *saved;
  s.tokens = T;
  s.dim = config_.dim;
  s.experts = E;
  s.topk = k;
  s.x_dtype = x.dtype;
  s.kind = gate_rules::score_kind(config_);
  s.topk_then_softmax = gate_rules::topk_then_softmax(config_);
  s.normalized = config_.norm_topk_prob && k > 1;
  s.route_scale = config_.route_scale;
  s.mask = read_token_mask(token_mask, T);
  s.in_double = x.dtype == DType::f64 || (precision_ && *precision_ == DType::f64);

  // Automodel's Gate.forward: F.linear in the gate precision, else in x's dtype; scores in the gate
  // precision, else fp32 (sqrtsoftplus in fp32 whatever the precision); weights cast to x's dtype
  // unless router_weights_fp32. f64 inputs without a gate precision route in f64, sqrtsoftplus
  // included (the gradient-check mode; Automodel would score them in fp32).
  const DType linear = precision_ ? *precision_ : x.dtype;
  const bool round = gate_rules::rounds_logits(precision_, x.dtype);
  const std::vector<std::int64_t>* forced = replay_indices.defined() ? &replay : nullptr;
  GateOutput out;
  out.weights = Tensor::empty({T, k}, config_.router_weights_fp32 ? DType::f32 : x.dtype);
  auto emit = [&](const auto& w) {
    for (std::size_t i = 0; i < w.size(); ++i)
      write_from_double(out.weights, static_cast<std::int64_t>(i), static_cast<double>(w[i]));
  };
  if (linear == DType::f64) {
    const std::vector<double> z = logits<double>(config_, x, weights.weight, weights.bias, linear, false, s);
    if (gate_rules::routes_in_fp32(config_) && precision_)
      emit(route<float>(config_, z, correction_bias, forced, s));
    else
      emit(route<double>(config_, z, correction_bias, forced, s));
  } else {
    const std::vector<float> z = logits<float>(config_, x, weights.weight, weights.bias, linear, round, s);
    emit(route<float>(config_, z, correction_bias, forced, s));
  }
  out.indices = Tensor::from_vector(s.indices, {T, k});
  out.expert_load = count_expert_load(s.indices, s.mask, k, E);
  if (training && config_.aux_loss_coeff > 0) out.aux_loss = aux_loss(config_, s, out.expert_load);
  out.saved = std::move(saved);
  return out;
}

Tensor Gate::backward(const GateOutput& forward_output, const TensorView& grad_weights) {
  GateGradients into;
  for (Parameter* p : parameters())
    if (p->requires_grad && !p->grad.defined()) p->grad = Tensor::zeros(p->value.shape(), p->value.dtype());
  if (weight_.requires_grad) into.weight = weight_.grad;
  if (bias_.value.defined() && bias_.requires_grad) into.bias = bias_.grad;
  return compute_.backward(weights(), forward_output, grad_weights, aux_loss_scale, into);
}

Tensor GateCompute::backward(const GateWeights& weights, const GateOutput& forward_output,
                             const TensorView& grad_weights, double aux_loss_scale,
                             const GateGradients& accumulate_into) const {
  FLEXEP_CHECK_ARG(forward_output.saved != nullptr, "forward_output",
                   "has no saved state; pass the GateOutput returned by Gate::forward");
  const GateSaved& s = *forward_output.saved;
  const bool same_shape =
      s.experts == config_.n_routed_experts && s.dim == config_.dim && s.topk == config_.n_activated_experts;
  FLEXEP_CHECK_ARG(same_shape, "forward_output", "comes from a gate with ", s.experts, " experts, dim ", s.dim,
                   ", top-", s.topk, "; this gate has ", config_.n_routed_experts, ", ", config_.dim, ", ",
                   config_.n_activated_experts);
  check::shape(grad_weights, {s.tokens, s.topk}, "grad_weights");
  check::dtype(grad_weights, {DType::f32, DType::f64, DType::bf16, DType::f16}, "grad_weights");
  check::device(grad_weights, Device::cpu(), "grad_weights");
  check_gate_weights(config_, weights);
  check_target(accumulate_into.weight, weights.weight, "gate.weight");
  check_target(accumulate_into.bias, weights.bias, "gate.bias");
  // The weight as the forward's linear read it (cast to the gate precision, else to x's dtype).
  const std::vector<double> weight = cast_values<double>(weights.weight, precision_ ? *precision_ : s.x_dtype);

  // The aux loss enters like Automodel's MoEAuxLossAutoScaler: its gradient is coeff * scale,
  // with the scale read now, as the autoscaler reads it at backward time.
  const bool aux = forward_output.aux_loss.has_value() && s.has_aux;
  const double aux_scale = config_.aux_loss_coeff * aux_loss_scale;
  const bool post_topk_softmax = s.topk_then_softmax;

  const std::size_t T = static_cast<std::size_t>(s.tokens), E = static_cast<std::size_t>(s.experts),
                    k = static_cast<std::size_t>(s.topk), D = static_cast<std::size_t>(s.dim);
  Tensor grad_x = Tensor::empty({s.tokens, s.dim}, s.x_dtype);
  std::vector<double> grad_w(E * D, 0.0), grad_b(E, 0.0), gw(k), dp(E), dz(E), gx(D);
  for (std::size_t t = 0; t < T; ++t) {
    const double* w0 = s.topk_scores.data() + t * k;
    const double* p = s.scores.data() + t * E;
    const std::int64_t* idx = s.indices.data() + t * k;
    // Through route_scale and the normalisation w = w0 / (sum w0 + eps).
    for (std::size_t j = 0; j < k; ++j)
      gw[j] = s.route_scale * read_as_double(grad_weights, static_cast<std::int64_t>(t * k + j));
    if (s.normalized) {
      double sum = kNormEps, dot = 0;
      for (std::size_t j = 0; j < k; ++j) {
        sum += w0[j];
        dot += gw[j] * w0[j];
      }
      for (std::size_t j = 0; j < k; ++j) gw[j] = gw[j] / sum - dot / (sum * sum);
    }
    std::fill(dp.begin(), dp.end(), 0.0);
    std::fill(dz.begin(), dz.end(), 0.0);
    if (post_topk_softmax) {
      // w0 = softmax over the k selected logits.
      double dot = 0;
      for (std::size_t j = 0; j < k; ++j) dot += gw[j] * w0[j];
      for (std::size_t j = 0; j < k; ++j) dz[static_cast<std::size_t>(idx[j])] += w0[j] * (gw[j] - dot);
    } else {
      for (std::size_t j = 0; j < k; ++j) dp[static_cast<std::size_t>(idx[j])] += gw[j];
    }
    if (aux && s.mask[t]) {
      // dL/d original_scores, then through their own normalisation.
      const double denom = original_score_denominator(s, static_cast<std::int64_t>(t));
      double dot = 0;
      for (std::size_t e = 0; e < E; ++e) dot += aux_scale * s.aux_f_over_ctx[e] * s.original_score(t * E + e);
      for (std::size_t e = 0; e < E; ++e) {
        const double d = aux_scale * s.aux_f_over_ctx[e];
        dp[e] += s.normalized ? d / denom - dot / (denom * denom) : d;
      }
    }
    // Through the score function (the original scores differ from p by a constant at most).
    if (s.kind == gate_rules::ScoreKind::softmax) {
      double dot = 0;
      for (std::size_t e = 0; e < E; ++e) dot += dp[e] * p[e];
      for (std::size_t e = 0; e < E; ++e) dz[e] += p[e] * (dp[e] - dot);
    } else if (s.kind == gate_rules::ScoreKind::sigmoid) {
      for (std::size_t e = 0; e < E; ++e) dz[e] += dp[e] * p[e] * (1.0 - p[e]);
    } else {
      // p = sqrt(softplus(z)): dp/dz = softplus'(z) / (2 p), softplus' = sigmoid (1 past torch's
      // threshold 20, where softplus is the identity).
      const double* z = s.logits.data() + t * E;
      for (std::size_t e = 0; e < E; ++e) {
        if (dp[e] == 0) continue;
        const double ds = z[e] > 20 ? 1.0 : 1.0 / (1.0 + std::exp(-z[e]));
        dz[e] += dp[e] * ds / (2.0 * p[e]);
      }
    }
    // Through logits = x W^T + b.
    const double* xt = s.x.data() + t * D;
    std::fill(gx.begin(), gx.end(), 0.0);
    for (std::size_t e = 0; e < E; ++e) {
      const double g = dz[e];
      if (g == 0) continue;
      const double* we = weight.data() + e * D;
      double* gwe = grad_w.data() + e * D;
      for (std::size_t d = 0; d < D; ++d) {
        gx[d] += g * we[d];
        gwe[d] += g * xt[d];
      }
      grad_b[e] += g;
    }
    for (std::size_t d = 0; d < D; ++d) write_from_double(grad_x, static_cast<std::int64_t>(t * D + d), gx[d]);
  }
  if (accumulate_into.weight.defined()) accumulate_grad(accumulate_into.weight, grad_w);
  if (accumulate_into.bias.defined()) accumulate_grad(accumulate_into.bias, grad_b);
  return grad_x;
}

void Gate::update_bias(ProcessGroup* group) {
  FLEXEP_CHECK(config_.train_gate && config_.gate_bias_update_factor > 0 && correction_bias_.defined(),
               "Gate::update_bias: the correction-bias update is disabled (it needs moe.train_gate = true and "
               "moe.gate_bias_update_factor > 0; got train_gate = ", config_.train_gate ? "true" : "false",
               ", factor = ", config_.gate_bias_update_factor, ")");
  FLEXEP_CHECK(!cumulative_load_.empty(),
               "Gate::update_bias: no expert load was accumulated since the last update; run at least one "
               "training forward (training = true) before updating the bias");
  const int E = config_.n_routed_experts;
  Tensor load = Tensor::empty({E}, DType::f64);
  std::transform(cumulative_load_.begin(), cumulative_load_.end(), load.data<double>(),
                 [](std::int64_t n) { return static_cast<double>(n); });
  if (group != nullptr) group->all_reduce_sum(load, "gate.update_bias");

  float* bias = correction_bias_.data<float>();
  // The fp64 master is rebuilt from the buffer whenever the buffer was written from outside (init,
  // a checkpoint load), so such writes are never silently undone.
  bool master_current = correction_bias_master_.size() == static_cast<std::size_t>(E);
  for (int e = 0; master_current && e < E; ++e)
    master_current = static_cast<float>(correction_bias_master_[static_cast<std::size_t>(e)]) == bias[e];
  if (!master_current) correction_bias_master_.assign(bias, bias + E);

  const double* l = load.data<double>();
  double mean = 0;
  for (int e = 0; e < E; ++e) mean += l[e];
  mean /= E;
  for (int e = 0; e < E; ++e) {
    const double sign = mean > l[e] ? 1.0 : (mean < l[e] ? -1.0 : 0.0);
    double& m = correction_bias_master_[static_cast<std::size_t>(e)];
    m += sign * config_.gate_bias_update_factor;
    bias[e] = static_cast<float>(m);
  }
  cumulative_load_.clear();
}

}  // namespace flexep
