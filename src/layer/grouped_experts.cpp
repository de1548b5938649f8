#include "flexep/layer/grouped_experts.h"

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "flexep/core/checks.h"
#include "flexep/core/random.h"
#include "layer/linear_ref.h"

namespace flexep {

// What backward needs, all in the parameter dtype and covering only the rows that belong to an
// expert (rows past the sum of tokens_per_expert are neither stored nor differentiated).
struct ExpertsSaved {
  const GroupedExpertsCompute* owner = nullptr;
  std::vector<std::int64_t> tokens_per_expert;
  std::int64_t rows = 0;  // N, including the ignored tail
  DType tokens_dtype = DType::f32, probs_dtype = DType::f32;
  Tensor x;  // [active, dim]
  Tensor p;  // [active]
  Tensor h;  // [active, up_dim]  pre-activation
  Tensor a;  // [active, inter]   activation, before the prob
  Tensor u;  // [active, dim]     apply_router_weight_after_down: a W_down + b_down, before the prob
};

namespace {

// Stream names are fixed here rather than read from Parameter::name, which owners may prefix
// ("experts."): initial values must not depend on who renamed the parameter.
constexpr const char* kGateUp = "gate_and_up_projs";
constexpr const char* kDown = "down_projs";
constexpr const char* kGateUpBias = "gate_up_proj_bias";
constexpr const char* kDownBias = "down_proj_bias";

const std::initializer_list<DType> kFloatTypes = {DType::bf16, DType::f16, DType::f32, DType::f64};

// Rows [0, rows) of v converted to dtype `to` (always a fresh copy: saved state must not alias the
// caller's buffers).
Tensor rows_as(const TensorView& v, std::int64_t rows, DType to) { return Tensor::wrap(v.rows(0, rows)).to(to); }

// The owner's gradient of p for backward to add to: zero-allocated on first use; undefined when p
// has no value or does not require grad.
Tensor grad_of(Parameter& p) {
  if (!p.value.defined() || !p.requires_grad) return Tensor();
  if (!p.grad.defined()) p.grad = Tensor::zeros(p.value.shape(), p.value.dtype());
  FLEXEP_CHECK(p.grad.shape() == p.value.shape() && p.grad.dtype() == p.value.dtype(), "gradient of '", p.name,
               "' has shape ", p.grad.shape().str(), " ", dtype_name(p.grad.dtype()), ", expected ",
               p.value.shape().str(), " ", dtype_name(p.value.dtype()));
  return p.grad;
}

// A gradient target (or null when undefined) checked against its weight.
template <class T>
T* target(const Tensor& grad, const TensorView& weight, const std::string& name) {
  if (!grad.defined()) return nullptr;
  FLEXEP_CHECK_ARG(weight.defined(), name, "gradient target given, but the weight is absent");
  FLEXEP_CHECK_ARG(grad.shape() == weight.shape && grad.dtype() == weight.dtype && grad.device().is_cpu(), name,
                   "gradient target has shape ", grad.shape().str(), " ", dtype_name(grad.dtype()), " on ",
                   grad.device().str(), ", expected ", weight.shape.str(), " ", dtype_name(weight.dtype), " on cpu");
  return grad.data<T>();
}

struct Dims {
  std::int64_t dim, up, inter;
};

// The module as the kernels see it: sizes, activation and the (read-only) weight values.
struct Module {
  Dims d;
  ActivationParams act;
  bool after_down;  // the prob multiplies the expert's output row instead of its activation
  int local, first;
  TensorView wgu, wd, bgu, bd;
};

// One expert's weights (or weight gradients); null biases where the experts have none.
template <class T>
struct ExpertTensors {
  T* wgu = nullptr;  // [dim, up]
  T* wd = nullptr;   // [inter, dim]
  T* bgu = nullptr;  // [up]
  T* bd = nullptr;   // [dim]
};

Module make_module(const MoEConfig& c, const ActivationParams& act, int local, int first, const ExpertWeights& w) {
  return {{c.dim, c.up_dim(), c.moe_inter_dim}, act, c.apply_router_weight_after_down, local, first,
          w.gate_and_up_projs, w.down_projs, w.gate_up_proj_bias, w.down_proj_bias};
}

template <class T>
T* slice(const TensorView& t, std::int64_t e, std::int64_t per_expert) {
  return t.defined() ? t.ptr<T>() + e * per_expert : nullptr;
}

template <class T>
ExpertTensors<T> expert_values(const Module& m, int e) {
  const Dims& d = m.d;
  return {slice<T>(m.wgu, e, d.dim * d.up), slice<T>(m.wd, e, d.inter * d.dim), slice<T>(m.bgu, e, d.up),
          slice<T>(m.bd, e, d.dim)};
}

// M rows of one expert: h = x Wgu + bgu, a = act(h), y = (a * p) Wd + bd * p; or, after_down,
// u = a Wd + bd and y = u * p (u is kept when the pointer is not null).
template <class T>
void expert_forward(const Dims& d, const ActivationParams& act, bool after_down, const ExpertTensors<T>& w,
                    std::int64_t M, const T* x, const T* p, T* h, T* a, T* y, T* u = nullptr) {
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t c = 0; c < d.up; ++c) h[m * d.up + c] = w.bgu ? w.bgu[c] : T(0);
  ref::gemm_nn_acc(M, d.dim, d.up, x, w.wgu, h);
  std::vector<T> ap(static_cast<std::size_t>(M * d.inter));
  for (std::int64_t m = 0; m < M; ++m) {
    activation_forward(h + m * d.up, a + m * d.inter, static_cast<int>(d.inter), act);
    const T scale = after_down ? T(1) : p[m];
    for (std::int64_t i = 0; i < d.inter; ++i)
      ap[static_cast<std::size_t>(m * d.inter + i)] = a[m * d.inter + i] * scale;
    for (std::int64_t j = 0; j < d.dim; ++j) y[m * d.dim + j] = w.bd ? w.bd[j] * scale : T(0);
  }
  ref::gemm_nn_acc(M, d.inter, d.dim, ap.data(), w.wd, y);
  if (!after_down) return;
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t j = 0; j < d.dim; ++j) {
      if (u) u[m * d.dim + j] = y[m * d.dim + j];
      y[m * d.dim + j] *= p[m];
    }
}

// Backward of expert_forward for M rows; gx and gp are written, parameter grads (non-null
// members of gw) accumulated. u is the saved pre-prob output (after_down only).
template <class T>
void expert_backward(const Dims& d, const ActivationParams& act, bool after_down, const ExpertTensors<T>& w,
                     const ExpertTensors<T>& gw, std::int64_t M, const T* x, const T* p, const T* h, const T* a,
                     const T* u, const T* g_in, T* gx, T* gp) {
  // after_down: y = u * p, so grad p = <g, u> and the FFN sees g * p with a prob of 1.
  std::vector<T> gu;
  const T* g = g_in;
  if (after_down) {
    gu.resize(static_cast<std::size_t>(M * d.dim));
    for (std::int64_t m = 0; m < M; ++m) {
      gp[m] = ref::dot(d.dim, g_in + m * d.dim, u + m * d.dim);
      for (std::int64_t j = 0; j < d.dim; ++j) gu[static_cast<std::size_t>(m * d.dim + j)] = g_in[m * d.dim + j] * p[m];
    }
    g = gu.data();
  }
  // ga = g Wd^T: the gradient reaching (a * p); gives grad p and, times p, grad a.
  std::vector<T> ga(static_cast<std::size_t>(M * d.inter), T(0));
  ref::gemm_nt_acc(M, d.dim, d.inter, g, w.wd, ga.data());
  std::vector<T> ap(static_cast<std::size_t>(M * d.inter));
  for (std::int64_t m = 0; m < M; ++m) {
    T* gam = ga.data() + m * d.inter;
    const T* am = a + m * d.inter;
    const T scale = after_down ? T(1) : p[m];
    if (!after_down) gp[m] = ref::dot(d.inter, gam, am) + (w.bd ? ref::dot(d.dim, g + m * d.dim, w.bd) : T(0));
    for (std::int64_t i = 0; i < d.inter; ++i) {
      ap[static_cast<std::size_t>(m * d.inter + i)] = am[i] * scale;
      gam[i] *= scale;
    }
    if (gw.bd) ref::axpy(d.dim, scale, g + m * d.dim, gw.bd);
  }
  if (gw.wd) ref::gemm_tn_acc(M, d.inter, d.dim, ap.data(), g, gw.wd);
  std::vector<T> gh(static_cast<std::size_t>(M * d.up));
  for (std::int64_t m = 0; m < M; ++m)
    activation_backward(h + m * d.up, ga.data() + m * d.inter, gh.data() + m * d.up, static_cast<int>(d.inter), act);
  if (gw.wgu) ref::gemm_tn_acc(M, d.dim, d.up, x, gh.data(), gw.wgu);
  if (gw.bgu) ref::sum_rows_acc(M, d.up, gh.data(), gw.bgu);
  for (std::int64_t i = 0; i < M * d.dim; ++i) gx[i] = T(0);
  ref::gemm_nt_acc(M, d.up, d.dim, gh.data(), w.wgu, gx);
}

template <class T>
ExpertsOutput forward_impl(const Module& m, const GroupedExpertsCompute* owner, const TensorView& tokens,
                           const TensorView& probs, const std::vector<std::int64_t>& counts, std::int64_t active) {
  const DType pt = dtype_of_v<T>;
  const Dims& d = m.d;
  auto saved = std::make_shared<ExpertsSaved>();
  saved->owner = owner;
  saved->tokens_per_expert = counts;
  saved->rows = tokens.size(0);
  saved->tokens_dtype = tokens.dtype;
  saved->probs_dtype = probs.dtype;
  saved->x = rows_as(tokens, active, pt);
  saved->p = rows_as(probs, active, pt);
  saved->h = Tensor::empty({active, d.up}, pt);
  saved->a = Tensor::empty({active, d.inter}, pt);
  if (m.after_down) saved->u = Tensor::empty({active, d.dim}, pt);
  Tensor y = Tensor::zeros({saved->rows, d.dim}, pt);
  std::int64_t row = 0;
  for (int e = 0; e < m.local; ++e) {
    const std::int64_t M = counts[static_cast<std::size_t>(e)];
    expert_forward(d, m.act, m.after_down, expert_values<T>(m, e), M, saved->x.data<T>() + row * d.dim,
                   saved->p.data<T>() + row, saved->h.data<T>() + row * d.up, saved->a.data<T>() + row * d.inter,
                   y.data<T>() + row * d.dim, m.after_down ? saved->u.data<T>() + row * d.dim : nullptr);
    row += M;
  }
  ExpertsOutput out;
  out.out = tokens.dtype == pt ? y : y.to(tokens.dtype);
  out.saved = saved;
  return out;
}

template <class T>
ExpertsGrads backward_impl(const Module& m, const ExpertGradients& into, const std::string& name, const ExpertsSaved& s,
                           const TensorView& grad_out) {
  const DType pt = dtype_of_v<T>;
  const Dims& d = m.d;
  const std::int64_t active = s.x.size(0);
  Tensor g = rows_as(grad_out, active, pt);
  Tensor gx = Tensor::zeros({s.rows, d.dim}, pt);
  Tensor gp = Tensor::zeros({s.rows}, pt);
  T* gwgu = target<T>(into.gate_and_up_projs, m.wgu, name + "gate_and_up_projs");
  T* gwd = target<T>(into.down_projs, m.wd, name + "down_projs");
  T* gbgu = target<T>(into.gate_up_proj_bias, m.bgu, name + "gate_up_proj_bias");
  T* gbd = target<T>(into.down_proj_bias, m.bd, name + "down_proj_bias");
  std::int64_t row = 0;
  for (int e = 0; e < m.local; ++e) {
    const std::int64_t M = s.tokens_per_expert[static_cast<std::size_t>(e)];
    ExpertTensors<T> gw{gwgu ? gwgu + e * d.dim * d.up : nullptr, gwd ? gwd + e * d.inter * d.dim : nullptr,
                        gbgu ? gbgu + e * d.up : nullptr, gbd ? gbd + e * d.dim : nullptr};
    expert_backward(d, m.act, m.after_down, expert_values<T>(m, e), gw, M, s.x.data<T>() + row * d.dim,
                    s.p.data<T>() + row, s.h.data<T>() + row * d.up, s.a.data<T>() + row * d.inter,
                    m.after_down ? s.u.data<T>() + row * d.dim : nullptr, g.data<T>() + row * d.dim,
                    gx.data<T>() + row * d.dim, gp.data<T>() + row);
    row += M;
  }
  ExpertsGrads out;
  out.tokens = s.tokens_dtype == pt ? gx : gx.to(s.tokens_dtype);
  out.probs = s.probs_dtype == pt ? gp : gp.to(s.probs_dtype);
  return out;
}

template <class T>
Tensor forward_loop_impl(const Module& m, const TensorView& x, const TensorView& token_mask, const TensorView& weights,
                         const TensorView& indices) {
  const DType pt = dtype_of_v<T>;
  const Dims& d = m.d;
  const std::int64_t Tn = x.size(0), k = weights.size(1);
  Tensor xp = rows_as(x, Tn, pt);
  Tensor y = Tensor::zeros({Tn, d.dim}, pt);
  for (int e = 0; e < m.local; ++e) {
    const std::int64_t global = m.first + e;
    std::vector<std::int64_t> token;
    std::vector<T> prob;
    for (std::int64_t t = 0; t < Tn; ++t) {
      if (token_mask.defined() && !token_mask.ptr<bool>()[t]) continue;
      for (std::int64_t j = 0; j < k; ++j)
        if (static_cast<std::int64_t>(read_as_double(indices, t * k + j)) == global) {
          token.push_back(t);
          prob.push_back(static_cast<T>(read_as_double(weights, t * k + j)));
        }
    }
    const auto M = static_cast<std::int64_t>(token.size());
    if (M == 0) continue;
    std::vector<T> xe(static_cast<std::size_t>(M * d.dim)), h(static_cast<std::size_t>(M * d.up)),
        a(static_cast<std::size_t>(M * d.inter)), ye(static_cast<std::size_t>(M * d.dim));
    for (std::int64_t r = 0; r < M; ++r)
      for (std::int64_t c = 0; c < d.dim; ++c)
        xe[static_cast<std::size_t>(r * d.dim + c)] = xp.data<T>()[token[static_cast<std::size_t>(r)] * d.dim + c];
    expert_forward(d, m.act, m.after_down, expert_values<T>(m, e), M, xe.data(), prob.data(), h.data(), a.data(),
                   ye.data());
    for (std::int64_t r = 0; r < M; ++r)
      ref::axpy(d.dim, T(1), ye.data() + r * d.dim, y.data<T>() + token[static_cast<std::size_t>(r)] * d.dim);
  }
  return x.dtype == pt ? y : y.to(x.dtype);
}

}  // namespace

GroupedExpertsCompute::GroupedExpertsCompute(const MoEConfig& config, int num_local_experts, std::string name)
    : config_(config), local_(num_local_experts), name_(std::move(name)) {
  FLEXEP_CHECK_ARG(config.dim >= 1, "moe.dim", "must be >= 1, got ", config.dim);
  FLEXEP_CHECK_ARG(config.moe_inter_dim >= 1, "moe.moe_inter_dim", "must be >= 1, got ", config.moe_inter_dim);
  FLEXEP_CHECK_ARG(num_local_experts >= 1 && num_local_experts <= config.n_routed_experts, "num_local_experts",
                   "must be in [1, moe.n_routed_experts = ", config.n_routed_experts, "], got ", num_local_experts);
  act_ = activation_params(config, config.expert_activation);
}

DType GroupedExpertsCompute::check_weights(const ExpertWeights& w) const {
  const std::int64_t E = local_, dim = config_.dim, up = config_.up_dim(), inter = config_.moe_inter_dim;
  const std::string wgu = name_ + "gate_and_up_projs";
  check::shape(w.gate_and_up_projs, {E, dim, up}, wgu);
  check::dtype(w.gate_and_up_projs, {DType::f32, DType::f64}, wgu);
  check::device(w.gate_and_up_projs, Device::cpu(), wgu);
  const DType t = w.gate_and_up_projs.dtype;
  auto check = [&](const TensorView& v, std::initializer_list<std::int64_t> shape, const char* leaf, bool present) {
    const std::string name = name_ + leaf;
    FLEXEP_CHECK_ARG(v.defined() == present, name, v.defined() ? "was given" : "is missing", " but moe.expert_bias is ",
                     config_.expert_bias ? "true" : "false");
    if (!present) return;
    check::shape(v, shape, name);
    FLEXEP_CHECK_ARG(v.dtype == t, name, "has dtype ", dtype_name(v.dtype),
                     "; all expert weights must share one dtype (", wgu, " is ", dtype_name(t), ")");
    check::device(v, Device::cpu(), name);
  };
  check(w.down_projs, {E, inter, dim}, "down_projs", true);
  check(w.gate_up_proj_bias, {E, up}, "gate_up_proj_bias", config_.expert_bias);
  check(w.down_proj_bias, {E, dim}, "down_proj_bias", config_.expert_bias);
  return t;
}

GroupedExperts::GroupedExperts(const MoEConfig& config, int num_local_experts, int first_expert, DType param_dtype)
    : config_(config),
      local_(num_local_experts),
      first_(first_expert),
      dtype_(param_dtype),
      compute_(config, num_local_experts) {
  FLEXEP_CHECK_ARG(param_dtype == DType::f32 || param_dtype == DType::f64, "param_dtype",
                   "the CPU reference experts compute in f32 or f64, got ", dtype_name(param_dtype));
  FLEXEP_CHECK_ARG(first_expert >= 0 && first_expert + num_local_experts <= config.n_routed_experts, "first_expert",
                   "local experts [", first_expert, ", ", first_expert + num_local_experts,
                   ") must lie in [0, moe.n_routed_experts = ", config.n_routed_experts, ")");
  const std::int64_t E = local_, dim = config.dim, up = config.up_dim(), inter = config.moe_inter_dim;
  gate_and_up_ = {kGateUp, Tensor::zeros({E, dim, up}, dtype_), Tensor(), true};
  down_ = {kDown, Tensor::zeros({E, inter, dim}, dtype_), Tensor(), true};
  if (config.expert_bias) {
    gate_up_bias_ = {kGateUpBias, Tensor::zeros({E, up}, dtype_), Tensor(), true};
    down_bias_ = {kDownBias, Tensor::zeros({E, dim}, dtype_), Tensor(), true};
  } else {
    gate_up_bias_.name = kGateUpBias;
    down_bias_.name = kDownBias;
  }
}

void GroupedExperts::init(std::uint64_t seed, double init_std) {
  FLEXEP_CHECK_ARG(init_std >= 0 && std::isfinite(init_std), "init_std", "must be finite and >= 0, got ", init_std);
  auto fill = [&](Parameter& p, const char* stream) {
    const std::int64_t per_expert = p.value.numel() / local_;
    for (int e = 0; e < local_; ++e)
      fill_normal(p.value.view().rows(e, e + 1), seed, stream_id(stream), 0.0, init_std,
                  static_cast<std::uint64_t>((first_ + e) * per_expert));
  };
  fill(gate_and_up_, kGateUp);
  fill(down_, kDown);
  if (gate_up_bias_.value.defined()) gate_up_bias_.value.fill_zero();
  if (down_bias_.value.defined()) down_bias_.value.fill_zero();
}

ExpertWeights GroupedExperts::weights() const {
  return {gate_and_up_.value, down_.value, gate_up_bias_.value, down_bias_.value};
}

ExpertsOutput GroupedExperts::forward(const TensorView& tokens, const TensorView& probs,
                                      const std::vector<std::int64_t>& tokens_per_expert) {
  return compute_.forward(weights(), tokens, probs, tokens_per_expert);
}

ExpertsOutput GroupedExpertsCompute::forward(const ExpertWeights& weights, const TensorView& tokens,
                                             const TensorView& probs,
                                             const std::vector<std::int64_t>& tokens_per_expert) const {
  const DType dtype = check_weights(weights);
  check::shape(tokens, {-1, config_.dim}, "tokens");
  check::dtype(tokens, kFloatTypes, "tokens");
  check::device(tokens, Device::cpu(), "tokens");
  const std::int64_t N = tokens.size(0);
  check::shape(probs, {N}, "probs");
  check::dtype(probs, kFloatTypes, "probs");
  check::device(probs, Device::cpu(), "probs");
  FLEXEP_CHECK_ARG(tokens_per_expert.size() == static_cast<std::size_t>(local_), "tokens_per_expert", "has ",
                   tokens_per_expert.size(), " entries, expected one per local expert (", local_, ")");
  std::int64_t active = 0;
  for (std::size_t e = 0; e < tokens_per_expert.size(); ++e) {
    FLEXEP_CHECK_ARG(tokens_per_expert[e] >= 0, "tokens_per_expert", "entry ", e, " is ", tokens_per_expert[e],
                     "; counts must be >= 0");
    active += tokens_per_expert[e];
  }
  FLEXEP_CHECK_ARG(active <= N, "tokens_per_expert", "sums to ", active, " but tokens has only ", N,
                   " rows; the sum must be <= the number of rows");
  const Module m = make_module(config_, act_, local_, 0, weights);
  return dtype == DType::f64 ? forward_impl<double>(m, this, tokens, probs, tokens_per_expert, active)
                             : forward_impl<float>(m, this, tokens, probs, tokens_per_expert, active);
}

ExpertsGrads GroupedExperts::backward(const ExpertsOutput& forward_output, const TensorView& grad_out) {
  FLEXEP_CHECK_ARG(forward_output.saved != nullptr, "forward_output", "has no saved state (was forward called?)");
  FLEXEP_CHECK_ARG(forward_output.saved->owner == &compute_, "forward_output",
                   "was produced by a different GroupedExperts module");
  const ExpertGradients into{grad_of(gate_and_up_), grad_of(down_), grad_of(gate_up_bias_), grad_of(down_bias_)};
  return compute_.backward(weights(), forward_output, grad_out, into);
}

ExpertsGrads GroupedExpertsCompute::backward(const ExpertWeights& weights, const ExpertsOutput& forward_output,
                                             const TensorView& grad_out, const ExpertGradients& accumulate_into) const {
  FLEXEP_CHECK_ARG(forward_output.saved != nullptr, "forward_output", "has no saved state (was forward called?)");
  const ExpertsSaved& s = *forward_output.saved;
  FLEXEP_CHECK_ARG(s.owner == this, "forward_output", "was produced by a different grouped-experts computation");
  const DType dtype = check_weights(weights);
  check::shape(grad_out, {s.rows, config_.dim}, "grad_out");
  check::dtype(grad_out, kFloatTypes, "grad_out");
  check::device(grad_out, Device::cpu(), "grad_out");
  const Module m = make_module(config_, act_, local_, 0, weights);
  return dtype == DType::f64 ? backward_impl<double>(m, accumulate_into, name_, s, grad_out)
                             : backward_impl<float>(m, accumulate_into, name_, s, grad_out);
}

Tensor GroupedExperts::forward_loop(const TensorView& x, const TensorView& token_mask, const TensorView& weights,
                                    const TensorView& indices) const {
  check::shape(x, {-1, config_.dim}, "x");
  check::dtype(x, kFloatTypes, "x");
  check::device(x, Device::cpu(), "x");
  const std::int64_t Tn = x.size(0);
  if (token_mask.defined()) {
    check::shape(token_mask, {Tn}, "token_mask");
    check::dtype(token_mask, {DType::b8}, "token_mask");
  }
  check::shape(weights, {Tn, -1}, "weights");
  check::dtype(weights, kFloatTypes, "weights");
  check::shape(indices, {Tn, weights.size(1)}, "indices");
  check::expert_indices(indices, config_.n_routed_experts, "indices");
  const Module m = make_module(config_, compute_.activation(), local_, first_, this->weights());
  return dtype_ == DType::f64 ? forward_loop_impl<double>(m, x, token_mask, weights, indices)
                              : forward_loop_impl<float>(m, x, token_mask, weights, indices);
}

std::vector<Parameter*> GroupedExperts::parameters() {
  std::vector<Parameter*> out = {&gate_and_up_, &down_};
  if (gate_up_bias_.value.defined()) out.push_back(&gate_up_bias_);
  if (down_bias_.value.defined()) out.push_back(&down_bias_);
  return out;
}

}  // namespace flexep
