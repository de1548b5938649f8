#include "flexep/layer/gate.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "flexep/core/checks.h"
#include "flexep/core/random.h"
#include "layer/gate_rules.h"
#include "layer/gate_saved.h"

namespace flexep {

namespace {

constexpr double kNormEps = 1e-20;  // Automodel's denominator guard for norm_topk_prob

using gate_rules::top2_group_score;
using gate_rules::uses_groups;

void validate_gate(const MoEConfig& c, std::optional<DType> precision, DType param_dtype) {
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
  FLEXEP_CHECK_ARG(param_dtype == DType::f32 || param_dtype == DType::f64, "param_dtype", "dtype ",
                   dtype_name(param_dtype), " is not supported by the CPU gate; allowed: f32, f64");
  gate_rules::validate_precision_and_groups(c, precision);
}

template <class S>
std::vector<S> to_vector(const TensorView& t) {
  std::vector<S> v(static_cast<std::size_t>(t.numel()));
  if (t.dtype == DType::f32) {
    const float* p = t.ptr<float>();
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<S>(p[i]);
  } else {
    const double* p = t.ptr<double>();
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<S>(p[i]);
  }
  return v;
}

template <class S>
void softmax(const S* z, int n, S* out) {
  S m = z[0];
  for (int i = 1; i < n; ++i) m = std::max(m, z[i]);
  S sum = 0;
  for (int i = 0; i < n; ++i) sum += (out[i] = std::exp(z[i] - m));
  for (int i = 0; i < n; ++i) out[i] /= sum;
}

// Excludes all but the n_limited_groups best groups from `choice` (set to -inf).
template <class S>
void limit_groups(const MoEConfig& c, S* choice, std::vector<S>& group_score, std::vector<std::int64_t>& kept,
                  std::vector<unsigned char>& scratch) {
  const int G = c.n_expert_groups, size = c.n_routed_experts / G;
  const bool top2 = top2_group_score(c);
  group_score.resize(static_cast<std::size_t>(G));
  for (int g = 0; g < G; ++g) {
    const S* v = choice + g * size;
    S first = -std::numeric_limits<S>::infinity(), second = first;
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
  for (int g = 0; g < G; ++g)
    if (!keep[static_cast<std::size_t>(g)])
      std::fill(choice + g * size, choice + (g + 1) * size, -std::numeric_limits<S>::infinity());
}

// Logits, scores, selection and weights for every token, in precision S. Fills the saved state
// (indices, pre-normalisation top-k scores, full scores) and returns the final weights [T, k].
template <class S>
std::vector<S> route(const MoEConfig& c, const TensorView& x, const TensorView& w, const TensorView& b,
                     const Tensor& correction_bias, GateSaved& s) {
  const std::size_t T = static_cast<std::size_t>(x.size(0));
  const std::size_t E = static_cast<std::size_t>(c.n_routed_experts);
  const std::size_t k = static_cast<std::size_t>(c.n_activated_experts), D = static_cast<std::size_t>(c.dim);
  const std::vector<S> xs = to_vector<S>(x), ws = to_vector<S>(w);
  const std::vector<S> bs = b.defined() ? to_vector<S>(b) : std::vector<S>(E, S(0));
  std::vector<S> cb(E, S(0));
  if (correction_bias.defined() && c.score_func != ScoreFunc::softmax)
    for (std::size_t e = 0; e < E; ++e) cb[e] = static_cast<S>(correction_bias.data<float>()[e]);

  s.x.assign(xs.begin(), xs.end());
  s.weight.assign(ws.begin(), ws.end());
  s.indices.resize(T * k);
  s.topk_scores.resize(T * k);
  s.scores.resize(T * E);

  std::vector<S> out(T * k), z(E), p(E), choice(E), w0(k), group_score;
  std::vector<std::int64_t> kept;
  std::vector<unsigned char> scratch;
  const S scale = static_cast<S>(c.route_scale);
  for (std::size_t t = 0; t < T; ++t) {
    const S* xt = xs.data() + t * D;
    for (std::size_t e = 0; e < E; ++e) {
      const S* we = ws.data() + e * D;
      S acc = 0;
      for (std::size_t d = 0; d < D; ++d) acc += xt[d] * we[d];
      z[e] = acc + bs[e];
    }
    std::int64_t* idx = s.indices.data() + t * k;
    if (c.score_func == ScoreFunc::sigmoid) {
      for (std::size_t e = 0; e < E; ++e) p[e] = S(1) / (S(1) + std::exp(-z[e]));
    } else {
      softmax(z.data(), c.n_routed_experts, p.data());
    }
    if (c.score_func == ScoreFunc::softmax && !c.softmax_before_topk) {
      // Top-k of the raw logits, then a softmax over just those k.
      select_top_k(z.data(), c.n_routed_experts, c.n_activated_experts, idx, scratch);
      for (std::size_t j = 0; j < k; ++j) w0[j] = z[static_cast<std::size_t>(idx[j])];
      softmax(w0.data(), c.n_activated_experts, w0.data());
    } else {
      // Selection on the (biased, group-limited) scores; weights gathered from the unbiased ones.
      for (std::size_t e = 0; e < E; ++e) choice[e] = p[e] + cb[e];
      if (uses_groups(c)) limit_groups(c, choice.data(), group_score, kept, scratch);
      select_top_k(choice.data(), c.n_routed_experts, c.n_activated_experts, idx, scratch);
      for (std::size_t j = 0; j < k; ++j) w0[j] = p[static_cast<std::size_t>(idx[j])];
    }
    S denom = 1;
    if (s.normalized) {
      denom = 0;
      for (std::size_t j = 0; j < k; ++j) denom += w0[j];
      denom += static_cast<S>(kNormEps);
    }
    for (std::size_t j = 0; j < k; ++j) {
      s.topk_scores[t * k + j] = w0[j];
      out[t * k + j] = w0[j] / denom * scale;
    }
    std::copy(p.begin(), p.end(), s.scores.begin() + static_cast<std::ptrdiff_t>(t * E));
  }
  return out;
}

// original_scores after Automodel's normalisation (norm_topk_prob, k > 1: divided by their own sum).
double original_score_denominator(const GateSaved& s, std::int64_t t) {
  if (!s.normalized) return 1.0;
  double sum = 0;
  for (int e = 0; e < s.experts; ++e) sum += s.scores[static_cast<std::size_t>(t * s.experts + e)];
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
    for (std::size_t e = 0; e < E; ++e) score_sum[e] += s.scores[t * E + e] / denom;
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

void accumulate_grad(Parameter& p, const std::vector<double>& g) {
  if (!p.grad.defined()) p.grad = Tensor::zeros(p.value.shape(), p.value.dtype());
  if (p.grad.dtype() == DType::f64) {
    double* d = p.grad.data<double>();
    for (std::size_t i = 0; i < g.size(); ++i) d[i] += g[i];
  } else {
    float* d = p.grad.data<float>();
    for (std::size_t i = 0; i < g.size(); ++i) d[i] = static_cast<float>(d[i] + g[i]);
  }
}

}  // namespace

Gate::Gate(const MoEConfig& config, std::optional<DType> gate_precision, DType param_dtype)
    : config_(config), precision_(gate_precision) {
  validate_gate(config, gate_precision, param_dtype);
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

GateOutput Gate::forward(const TensorView& x, const TensorView& token_mask, bool training) {
  const DType param_dtype = weight_.value.dtype();
  check::shape(x, {-1, config_.dim}, "x");
  check::device(x, Device::cpu(), "x");
  FLEXEP_CHECK_ARG(x.dtype == param_dtype, "x", "dtype ", dtype_name(x.dtype),
                   " does not match the gate parameters' dtype ", dtype_name(param_dtype),
                   "; the CPU gate takes x in its parameter dtype");
  const std::int64_t T = x.size(0);
  const int E = config_.n_routed_experts, k = config_.n_activated_experts;

  auto saved = std::make_shared<GateSaved>();
  GateSaved& s = *saved;
  s.tokens = T;
  s.dim = config_.dim;
  s.experts = E;
  s.topk = k;
  s.x_dtype = x.dtype;
  s.score_func = config_.score_func;
  s.softmax_before_topk = config_.softmax_before_topk;
  s.normalized = config_.norm_topk_prob && k > 1;
  s.route_scale = config_.route_scale;
  s.mask = read_token_mask(token_mask, T);

  GateOutput out;
  out.weights = Tensor::empty({T, k}, x.dtype);
  const bool in_double = x.dtype == DType::f64 || (precision_ && *precision_ == DType::f64);
  if (in_double) {
    const std::vector<double> w = route<double>(config_, x, weight_.value, bias_.value.view(), correction_bias_, s);
    for (std::size_t i = 0; i < w.size(); ++i) write_from_double(out.weights, static_cast<std::int64_t>(i), w[i]);
  } else {
    const std::vector<float> w = route<float>(config_, x, weight_.value, bias_.value.view(), correction_bias_, s);
    std::copy(w.begin(), w.end(), out.weights.data<float>());
  }
  out.indices = Tensor::from_vector(s.indices, {T, k});
  out.expert_load = count_expert_load(s.indices, s.mask, k, E);

  if (training && config_.gate_bias_update_factor > 0) {
    if (cumulative_load_.empty()) cumulative_load_.assign(static_cast<std::size_t>(E), 0);
    for (std::size_t e = 0; e < cumulative_load_.size(); ++e) cumulative_load_[e] += out.expert_load[e];
  }
  if (training && config_.aux_loss_coeff > 0) out.aux_loss = aux_loss(config_, s, out.expert_load);
  out.saved = std::move(saved);
  return out;
}

Tensor Gate::backward(const GateOutput& forward_output, const TensorView& grad_weights) {
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

  // The aux loss enters like Automodel's MoEAuxLossAutoScaler: its gradient is coeff * scale,
  // with the scale read now, as the autoscaler reads it at backward time.
  const bool aux = forward_output.aux_loss.has_value() && s.has_aux;
  const double aux_scale = config_.aux_loss_coeff * aux_loss_scale;
  const bool softmax_family = s.score_func != ScoreFunc::sigmoid;
  const bool post_topk_softmax = s.score_func == ScoreFunc::softmax && !s.softmax_before_topk;

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
      for (std::size_t e = 0; e < E; ++e) dot += aux_scale * s.aux_f_over_ctx[e] * p[e];
      for (std::size_t e = 0; e < E; ++e) {
        const double d = aux_scale * s.aux_f_over_ctx[e];
        dp[e] += s.normalized ? d / denom - dot / (denom * denom) : d;
      }
    }
    if (softmax_family) {
      double dot = 0;
      for (std::size_t e = 0; e < E; ++e) dot += dp[e] * p[e];
      for (std::size_t e = 0; e < E; ++e) dz[e] += p[e] * (dp[e] - dot);
    } else {
      for (std::size_t e = 0; e < E; ++e) dz[e] += dp[e] * p[e] * (1.0 - p[e]);
    }
    // Through logits = x W^T + b.
    const double* xt = s.x.data() + t * D;
    std::fill(gx.begin(), gx.end(), 0.0);
    for (std::size_t e = 0; e < E; ++e) {
      const double g = dz[e];
      if (g == 0) continue;
      const double* we = s.weight.data() + e * D;
      double* gwe = grad_w.data() + e * D;
      for (std::size_t d = 0; d < D; ++d) {
        gx[d] += g * we[d];
        gwe[d] += g * xt[d];
      }
      grad_b[e] += g;
    }
    for (std::size_t d = 0; d < D; ++d) write_from_double(grad_x, static_cast<std::int64_t>(t * D + d), gx[d]);
  }
  if (weight_.requires_grad) accumulate_grad(weight_, grad_w);
  if (bias_.value.defined() && bias_.requires_grad) accumulate_grad(bias_, grad_b);
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
