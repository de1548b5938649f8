#include "flexep/layer/shared_experts.h"

#include <cmath>
#include <vector>

#include "flexep/core/activation.h"
#include "flexep/core/checks.h"
#include "flexep/core/random.h"
#include "layer/linear_ref.h"

namespace flexep {

// Saved in the parameter dtype. The gate and up projections are handled as one stacked input
// projection W_in = [gate_proj; up_proj] ([2*inter, dim]), so that its output row is exactly the
// [gate | up] layout the swiglu activation reads; for relu2 W_in is up_proj alone.
struct SharedSaved {
  const SharedExpertsCompute* owner = nullptr;
  DType x_dtype = DType::f32;
  Tensor x;  // [T, dim]
  Tensor h;  // [T, up]    input projection (+ bias)
  Tensor a;  // [T, inter] activation
  Tensor m;  // [T, dim]   MLP output before the sigmoid gate (gate only)
  Tensor s;  // [T]        sigmoid gate (gate only)
};

namespace {

// Stream names are the full state_dict names, fixed here so a later rename cannot change them.
constexpr const char* kGateW = "shared_experts.gate_proj.weight";
constexpr const char* kUpW = "shared_experts.up_proj.weight";
constexpr const char* kDownW = "shared_experts.down_proj.weight";
constexpr const char* kGateB = "shared_experts.gate_proj.bias";
constexpr const char* kUpB = "shared_experts.up_proj.bias";
constexpr const char* kDownB = "shared_experts.down_proj.bias";
constexpr const char* kScalarGateW = "shared_expert_gate.weight";

template <class T>
T* ptr_or_null(const Tensor& t) {
  return t.defined() ? t.data<T>() : nullptr;
}

template <class T>
T* grad_of(Parameter& p) {
  if (!p.value.defined() || !p.requires_grad) return nullptr;
  if (!p.grad.defined()) p.grad = Tensor::zeros(p.value.shape(), p.value.dtype());
  FLEXEP_CHECK(p.grad.shape() == p.value.shape() && p.grad.dtype() == p.value.dtype(), "gradient of '", p.name,
               "' has shape ", p.grad.shape().str(), " ", dtype_name(p.grad.dtype()), ", expected ",
               p.value.shape().str(), " ", dtype_name(p.value.dtype()));
  return p.grad.data<T>();
}

// The parameters as the kernels see them. `gate` and its bias are null for relu2.
struct Params {
  std::int64_t dim, inter;
  ActivationParams act;
  Parameter *gate_w, *up_w, *down_w, *gate_b, *up_b, *down_b, *scalar_w;
  std::int64_t up() const { return is_gated(act.kind) ? 2 * inter : inter; }
};

// [gate; up] stacked row-wise (weights) or end to end (biases); just `up` without a gate.
template <class T>
std::vector<T> stacked(const Tensor& gate, const Tensor& up) {
  std::vector<T> out;
  if (gate.defined()) out.assign(gate.data<T>(), gate.data<T>() + gate.numel());
  out.insert(out.end(), up.data<T>(), up.data<T>() + up.numel());
  return out;
}

template <class T>
SharedOutput forward_impl(const Params& P, const SharedExpertsCompute* owner, const TensorView& x) {
  const DType pt = dtype_of_v<T>;
  const std::int64_t Tn = x.size(0), dim = P.dim, inter = P.inter, up = P.up();
  auto saved = std::make_shared<SharedSaved>();
  saved->owner = owner;
  saved->x_dtype = x.dtype;
  saved->x = Tensor::wrap(x).to(pt);
  saved->h = Tensor::empty({Tn, up}, pt);
  saved->a = Tensor::empty({Tn, inter}, pt);
  const std::vector<T> w_in = stacked<T>(P.gate_w->value, P.up_w->value);
  const bool has_bias = P.up_b->value.defined();
  const std::vector<T> b_in = has_bias ? stacked<T>(P.gate_b->value, P.up_b->value) : std::vector<T>();
  const T* xp = saved->x.data<T>();
  T* h = saved->h.data<T>();
  T* a = saved->a.data<T>();
  for (std::int64_t t = 0; t < Tn; ++t)
    for (std::int64_t c = 0; c < up; ++c) h[t * up + c] = has_bias ? b_in[static_cast<std::size_t>(c)] : T(0);
  ref::gemm_nt_acc(Tn, dim, up, xp, w_in.data(), h);
  for (std::int64_t t = 0; t < Tn; ++t) activation_forward(h + t * up, a + t * inter, static_cast<int>(inter), P.act);
  Tensor m = Tensor::empty({Tn, dim}, pt);
  const T* bd = ptr_or_null<T>(P.down_b->value);
  for (std::int64_t t = 0; t < Tn; ++t)
    for (std::int64_t j = 0; j < dim; ++j) m.data<T>()[t * dim + j] = bd ? bd[j] : T(0);
  ref::gemm_nt_acc(Tn, inter, dim, a, P.down_w->value.data<T>(), m.data<T>());
  Tensor z = m;
  if (P.scalar_w->value.defined()) {
    saved->m = m;
    saved->s = Tensor::empty({Tn}, pt);
    z = Tensor::empty({Tn, dim}, pt);
    const T* wg = P.scalar_w->value.data<T>();
    for (std::int64_t t = 0; t < Tn; ++t) {
      const T s = sigmoid(ref::dot(dim, xp + t * dim, wg));
      saved->s.data<T>()[t] = s;
      for (std::int64_t j = 0; j < dim; ++j) z.data<T>()[t * dim + j] = s * m.data<T>()[t * dim + j];
    }
  }
  SharedOutput out;
  out.out = x.dtype == pt ? z : z.to(x.dtype);
  out.saved = saved;
  return out;
}

template <class T>
Tensor backward_impl(const Params& P, const SharedSaved& S, const TensorView& grad_out) {
  const DType pt = dtype_of_v<T>;
  const std::int64_t Tn = S.x.size(0), dim = P.dim, inter = P.inter, up = P.up();
  const T* xp = S.x.data<T>();
  Tensor gm = Tensor::wrap(grad_out).to(pt);  // becomes the gradient reaching the MLP output
  Tensor gx = Tensor::zeros({Tn, dim}, pt);
  T* g = gm.data<T>();
  if (P.scalar_w->value.defined()) {
    const T* wg = P.scalar_w->value.data<T>();
    T* gwg = grad_of<T>(*P.scalar_w);
    for (std::int64_t t = 0; t < Tn; ++t) {
      const T s = S.s.data<T>()[t];
      const T glogit = ref::dot(dim, g + t * dim, S.m.data<T>() + t * dim) * s * (T(1) - s);
      if (gwg) ref::axpy(dim, glogit, xp + t * dim, gwg);
      ref::axpy(dim, glogit, wg, gx.data<T>() + t * dim);
      for (std::int64_t j = 0; j < dim; ++j) g[t * dim + j] *= s;
    }
  }
  if (T* gwd = grad_of<T>(*P.down_w)) ref::gemm_tn_acc(Tn, dim, inter, g, S.a.data<T>(), gwd);
  if (T* gbd = grad_of<T>(*P.down_b)) ref::sum_rows_acc(Tn, dim, g, gbd);
  std::vector<T> ga(static_cast<std::size_t>(Tn * inter), T(0));
  ref::gemm_nn_acc(Tn, dim, inter, g, P.down_w->value.data<T>(), ga.data());
  std::vector<T> gh(static_cast<std::size_t>(Tn * up));
  for (std::int64_t t = 0; t < Tn; ++t)
    activation_backward(S.h.data<T>() + t * up, ga.data() + t * inter, gh.data() + t * up, static_cast<int>(inter),
                        P.act);
  // Stacked input-projection grads, then split back into gate_proj / up_proj.
  std::vector<T> gw_in(static_cast<std::size_t>(up * dim), T(0)), gb_in(static_cast<std::size_t>(up), T(0));
  ref::gemm_tn_acc(Tn, up, dim, gh.data(), xp, gw_in.data());
  ref::sum_rows_acc(Tn, up, gh.data(), gb_in.data());
  const std::int64_t gate_rows = up - inter;  // 0 for relu2
  if (T* p = grad_of<T>(*P.gate_w)) ref::axpy(gate_rows * dim, T(1), gw_in.data(), p);
  if (T* p = grad_of<T>(*P.up_w)) ref::axpy(inter * dim, T(1), gw_in.data() + gate_rows * dim, p);
  if (T* p = grad_of<T>(*P.gate_b)) ref::axpy(gate_rows, T(1), gb_in.data(), p);
  if (T* p = grad_of<T>(*P.up_b)) ref::axpy(inter, T(1), gb_in.data() + gate_rows, p);
  const std::vector<T> w_in = stacked<T>(P.gate_w->value, P.up_w->value);
  ref::gemm_nn_acc(Tn, up, dim, gh.data(), w_in.data(), gx.data<T>());
  return S.x_dtype == pt ? gx : gx.to(S.x_dtype);
}

}  // namespace

SharedExpertsCompute::SharedExpertsCompute(const MoEConfig& config)
    : config_(config), inter_(config.shared_inter()) {
  FLEXEP_CHECK_ARG(config.dim >= 1, "moe.dim", "must be >= 1, got ", config.dim);
  FLEXEP_CHECK_ARG(config.n_shared_experts >= 1, "moe.n_shared_experts", "must be >= 1 to build shared experts, got ",
                   config.n_shared_experts);
  FLEXEP_CHECK_ARG(inter_ >= 1, "moe.shared_expert_inter_dim",
                   "the shared hidden size n_shared_experts * (shared_expert_inter_dim or moe_inter_dim) must be "
                   ">= 1, got ",
                   inter_);
  FLEXEP_CHECK_ARG(
      config.shared_expert_activation == Activation::swiglu || config.shared_expert_activation == Activation::relu2,
      "moe.shared_expert_activation", "allowed: swiglu, relu2; got ", to_string(config.shared_expert_activation));
}

DType SharedExpertsCompute::check_weights(const SharedMlpWeights& w) const {
  const std::int64_t dim = config_.dim, inter = inter_;
  const bool gated = config_.shared_expert_activation == Activation::swiglu, bias = config_.expert_bias;
  check::dtype(w.up_proj, {DType::f32, DType::f64}, kUpW);
  const DType t = w.up_proj.dtype;
  auto check = [&](const TensorView& v, std::initializer_list<std::int64_t> shape, const char* name, bool present) {
    FLEXEP_CHECK_ARG(v.defined() == present, name, v.defined() ? "was given" : "is missing",
                     " but this configuration ", present ? "needs it" : "has none",
                     " (moe.shared_expert_activation, moe.expert_bias, moe.shared_expert_gate)");
    if (!present) return;
    check::shape(v, shape, name);
    FLEXEP_CHECK_ARG(v.dtype == t, name, "has dtype ", dtype_name(v.dtype),
                     "; all shared-expert weights must share one dtype (", kUpW, " is ", dtype_name(t), ")");
    check::device(v, Device::cpu(), name);
  };
  check(w.gate_proj, {inter, dim}, kGateW, gated);
  check(w.up_proj, {inter, dim}, kUpW, true);
  check(w.down_proj, {dim, inter}, kDownW, true);
  check(w.gate_proj_bias, {inter}, kGateB, gated && bias);
  check(w.up_proj_bias, {inter}, kUpB, bias);
  check(w.down_proj_bias, {dim}, kDownB, bias);
  check(w.shared_expert_gate, {1, dim}, kScalarGateW, config_.shared_expert_gate);
  return t;
}

SharedExperts::SharedExperts(const MoEConfig& config, DType param_dtype)
    : config_(config), dtype_(param_dtype), compute_(config), inter_(config.shared_inter()) {
  FLEXEP_CHECK_ARG(param_dtype == DType::f32 || param_dtype == DType::f64, "param_dtype",
                   "the CPU reference shared experts compute in f32 or f64, got ", dtype_name(param_dtype));
  const std::int64_t dim = config.dim, inter = inter_;
  auto make = [&](Parameter& p, const char* name, Shape shape, bool present) {
    p.name = name;
    if (present) p.value = Tensor::zeros(shape, dtype_);
  };
  const bool gated = config.shared_expert_activation == Activation::swiglu;
  make(gate_w_, kGateW, {inter, dim}, gated);
  make(up_w_, kUpW, {inter, dim}, true);
  make(down_w_, kDownW, {dim, inter}, true);
  make(gate_b_, kGateB, {inter}, gated && config.expert_bias);
  make(up_b_, kUpB, {inter}, config.expert_bias);
  make(down_b_, kDownB, {dim}, config.expert_bias);
  make(gate_scalar_w_, kScalarGateW, {1, dim}, config.shared_expert_gate);
}

void SharedExperts::init(std::uint64_t seed, double init_std) {
  FLEXEP_CHECK_ARG(init_std >= 0 && std::isfinite(init_std), "init_std", "must be finite and >= 0, got ", init_std);
  auto weight = [&](Parameter& p, const char* stream) {
    if (p.value.defined()) fill_normal(p.value, seed, stream_id(stream), 0.0, init_std);
  };
  weight(gate_w_, kGateW);
  weight(up_w_, kUpW);
  weight(down_w_, kDownW);
  weight(gate_scalar_w_, kScalarGateW);
  for (Parameter* b : {&gate_b_, &up_b_, &down_b_})
    if (b->value.defined()) b->value.fill_zero();
}

namespace {

// The math body reads Parameters: stand-ins over the caller's views (values) and targets (grads;
// requires_grad marks a target to add to).
struct Standins {
  Parameter p[7];
  Params params(const MoEConfig& c, int inter) {
    return {c.dim, inter, activation_params(c, c.shared_expert_activation),
            &p[0], &p[1], &p[2], &p[3], &p[4], &p[5], &p[6]};
  }
};

Standins standins(const SharedMlpWeights& w, const SharedMlpGradients* g) {
  const char* names[7] = {kGateW, kUpW, kDownW, kGateB, kUpB, kDownB, kScalarGateW};
  const TensorView values[7] = {w.gate_proj,      w.up_proj,        w.down_proj,         w.gate_proj_bias,
                                w.up_proj_bias,   w.down_proj_bias, w.shared_expert_gate};
  const Tensor none;
  const Tensor* grads[7] = {&none, &none, &none, &none, &none, &none, &none};
  if (g) {
    const Tensor* gs[7] = {&g->gate_proj,      &g->up_proj,        &g->down_proj,         &g->gate_proj_bias,
                           &g->up_proj_bias,   &g->down_proj_bias, &g->shared_expert_gate};
    std::copy(gs, gs + 7, grads);
  }
  Standins s;
  for (int i = 0; i < 7; ++i) {
    s.p[i] = {names[i], Tensor::wrap(values[i]), *grads[i], grads[i]->defined()};
    FLEXEP_CHECK_ARG(!s.p[i].requires_grad || s.p[i].value.defined(), names[i],
                     "gradient target given, but the weight is absent");
    FLEXEP_CHECK_ARG(!s.p[i].requires_grad || s.p[i].grad.device().is_cpu(), names[i],
                     "gradient target is on ", s.p[i].grad.device().str(), ", expected cpu");
  }
  return s;
}

}  // namespace

SharedMlpWeights SharedExperts::weights() const {
  return {gate_w_.value, up_w_.value, down_w_.value, gate_b_.value, up_b_.value, down_b_.value, gate_scalar_w_.value};
}

SharedOutput SharedExperts::forward(const TensorView& x) { return compute_.forward(weights(), x); }

Tensor SharedExperts::backward(const SharedOutput& forward_output, const TensorView& grad_out) {
  FLEXEP_CHECK_ARG(forward_output.saved != nullptr, "forward_output", "has no saved state (was forward called?)");
  FLEXEP_CHECK_ARG(forward_output.saved->owner == &compute_, "forward_output",
                   "was produced by a different SharedExperts module");
  auto grad_of = [](Parameter& p) {
    if (!p.value.defined() || !p.requires_grad) return Tensor();
    if (!p.grad.defined()) p.grad = Tensor::zeros(p.value.shape(), p.value.dtype());
    return p.grad;
  };
  const SharedMlpGradients into{grad_of(gate_w_), grad_of(up_w_),   grad_of(down_w_),       grad_of(gate_b_),
                                grad_of(up_b_),   grad_of(down_b_), grad_of(gate_scalar_w_)};
  return compute_.backward(weights(), forward_output, grad_out, into);
}

SharedOutput SharedExpertsCompute::forward(const SharedMlpWeights& weights, const TensorView& x) const {
  const DType dtype = check_weights(weights);
  check::shape(x, {-1, config_.dim}, "x");
  check::dtype(x, {DType::bf16, DType::f16, DType::f32, DType::f64}, "x");
  check::device(x, Device::cpu(), "x");
  Standins s = standins(weights, nullptr);
  const Params P = s.params(config_, inter_);
  return dtype == DType::f64 ? forward_impl<double>(P, this, x) : forward_impl<float>(P, this, x);
}

Tensor SharedExpertsCompute::backward(const SharedMlpWeights& weights, const SharedOutput& forward_output,
                                      const TensorView& grad_out, const SharedMlpGradients& accumulate_into) const {
  FLEXEP_CHECK_ARG(forward_output.saved != nullptr, "forward_output", "has no saved state (was forward called?)");
  const SharedSaved& saved = *forward_output.saved;
  FLEXEP_CHECK_ARG(saved.owner == this, "forward_output", "was produced by a different shared-experts computation");
  const DType dtype = check_weights(weights);
  check::shape(grad_out, {saved.x.size(0), config_.dim}, "grad_out");
  check::dtype(grad_out, {DType::bf16, DType::f16, DType::f32, DType::f64}, "grad_out");
  check::device(grad_out, Device::cpu(), "grad_out");
  Standins s = standins(weights, &accumulate_into);
  const Params P = s.params(config_, inter_);
  return dtype == DType::f64 ? backward_impl<double>(P, saved, grad_out) : backward_impl<float>(P, saved, grad_out);
}

std::vector<Parameter*> SharedExperts::parameters() {
  std::vector<Parameter*> out;
  for (Parameter* p : {&gate_w_, &up_w_, &down_w_, &gate_b_, &up_b_, &down_b_, &gate_scalar_w_})
    if (p->value.defined()) out.push_back(p);
  return out;
}

}  // namespace flexep
