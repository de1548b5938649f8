#include "flexep/layer/moe_layer.h"

#include <cstring>

#include <spdlog/spdlog.h>

#include "flexep/core/checks.h"
#include "flexep/dispatch/host.h"

namespace flexep {

struct MoESaved {
  GateOutput gate;
  Tensor masked_indices;  // [T, k] int64, padding tokens set to -1
  DispatchResult dispatched;
  ExpertsOutput experts;
  SharedOutput shared;
};

namespace {
std::vector<std::int64_t> host_counts(const Tensor& tokens_per_expert) {
  FLEXEP_CHECK(tokens_per_expert.device().is_cpu(), "the CPU reference layer needs tokens_per_expert on the host");
  const std::int64_t* p = tokens_per_expert.data<std::int64_t>();
  return std::vector<std::int64_t>(p, p + tokens_per_expert.numel());
}

void add_into(const Tensor& acc, const TensorView& x) {
  FLEXEP_CHECK(acc.dtype() == x.dtype && acc.numel() == x.numel(), "add_into: mismatched tensors");
  if (acc.dtype() == DType::f64) {
    double* a = acc.data<double>();
    const double* b = x.ptr<double>();
    for (std::int64_t i = 0; i < acc.numel(); ++i) a[i] += b[i];
  } else {
    float* a = acc.data<float>();
    const float* b = x.ptr<float>();
    for (std::int64_t i = 0; i < acc.numel(); ++i) a[i] += b[i];
  }
}
}  // namespace

MoELayer::MoELayer(const MoEConfig& config, const BackendConfig& backend, std::shared_ptr<TokenDispatcher> dispatcher,
                   const MoELayerOptions& options)
    : config_(config), backend_(backend), options_(options), dispatcher_(std::move(dispatcher)) {
  validate(config_);
  validate(backend_);
  FLEXEP_CHECK_ARG(options_.param_dtype == DType::f32 || options_.param_dtype == DType::f64, "param_dtype",
                   "the CPU reference layer computes in f32 or f64, got ", dtype_name(options_.param_dtype));
  if (dispatcher_) {
    ep_rank_ = dispatcher_->rank();
    ep_size_ = dispatcher_->world_size();
    FLEXEP_CHECK_ARG(dispatcher_->num_experts() == config_.n_routed_experts, "dispatcher",
                     "was made for ", dispatcher_->num_experts(), " experts but moe.n_routed_experts is ",
                     config_.n_routed_experts);
  }
  validate_ep(config_, ep_size_);
  // Automodel's rewrites (te/gmm experts without an EP dispatcher; EP dispatcher at EP size 1),
  // logged rather than silent.
  const Normalization norm = normalize(backend_, ep_size_);
  for (const std::string& m : norm.messages) spdlog::warn("flexep: {}", m);
  if (norm.local_fallback) dispatcher_.reset();
  if (!dispatcher_) {
    // EP size 1: the local path is the host backend over a world of one rank (same plan code).
    dispatcher_ = make_host_dispatcher(std::make_shared<HostWorld>(1), 0, config_.n_routed_experts);
  }

  if (backend_.fake_balanced_gate) fake_gate_ = std::make_unique<FakeBalancedGate>(config_, backend_.fake_gate_noise);
  else gate_ = std::make_unique<Gate>(config_, backend_.gate_precision, options_.param_dtype);
  const int local = config_.n_routed_experts / ep_size_;
  experts_ = std::make_unique<GroupedExperts>(config_, local, ep_rank_ * local, options_.param_dtype);
  if (config_.n_shared_experts > 0) shared_ = std::make_unique<SharedExperts>(config_, options_.param_dtype);

  if (gate_) gate_->init(options_.seed, options_.init_std);
  experts_->init(options_.seed, options_.init_std);
  if (shared_) shared_->init(options_.seed, options_.init_std);
}

MoEOutput MoELayer::forward(const TensorView& x, const TensorView& padding_mask, bool training) {
  check::shape(x, {-1, config_.dim}, "x");
  check::dtype(x, {options_.param_dtype}, "x");
  const std::int64_t T = x.size(0);
  Tensor token_mask;
  if (padding_mask.defined()) {
    check::shape(padding_mask, {T}, "padding_mask");
    check::dtype(padding_mask, {DType::b8}, "padding_mask");
    token_mask = Tensor::empty({T}, DType::b8);
    for (std::int64_t t = 0; t < T; ++t) token_mask.data<bool>()[t] = !padding_mask.ptr<bool>()[t];
  }
  if (options_.dispatch.check_finite) check::finite(x, "x");

  auto saved = std::make_shared<MoESaved>();
  saved->gate = gate_ ? gate_->forward(x, token_mask, training) : fake_gate_->forward(x, token_mask);

  // Padding tokens are never sent: their slots become -1 (Automodel's masked_fill(~mask, -1)).
  saved->masked_indices = saved->gate.indices.clone();
  if (token_mask.defined()) {
    const std::int64_t k = saved->masked_indices.size(1);
    for (std::int64_t t = 0; t < T; ++t)
      if (!token_mask.data<bool>()[t])
        for (std::int64_t j = 0; j < k; ++j) saved->masked_indices.data<std::int64_t>()[t * k + j] = -1;
  }

  DispatchInput in;
  in.hidden = x;
  in.indices = saved->masked_indices;
  in.weights = saved->gate.weights;
  saved->dispatched = dispatcher_->dispatch(in, options_.dispatch);
  saved->experts = experts_->forward(saved->dispatched.tokens, saved->dispatched.token_probs,
                                     host_counts(saved->dispatched.tokens_per_expert));
  Tensor y = dispatcher_->combine(saved->dispatched.handle, saved->experts.out);
  if (shared_) {
    saved->shared = shared_->forward(x);
    add_into(y, saved->shared.out);
  }
  MoEOutput out;
  out.out = y;
  out.aux_loss = saved->gate.aux_loss;
  out.saved = saved;
  return out;
}

Tensor MoELayer::backward(const MoEOutput& forward_output, const TensorView& grad_out) {
  FLEXEP_CHECK_ARG(forward_output.saved != nullptr, "forward_output", "has no saved state (was forward called?)");
  const MoESaved& s = *forward_output.saved;
  check::shape(grad_out, {forward_output.out.size(0), config_.dim}, "grad_out");
  check::dtype(grad_out, {options_.param_dtype}, "grad_out");

  Tensor grad_rows = dispatcher_->combine_backward(s.dispatched.handle, grad_out);
  ExpertsGrads eg = experts_->backward(s.experts, grad_rows);
  DispatchGrads dg = dispatcher_->dispatch_backward(s.dispatched.handle, eg.tokens, eg.probs);
  Tensor grad_x = dg.hidden;
  if (gate_) add_into(grad_x, gate_->backward(s.gate, dg.weights));
  if (shared_) add_into(grad_x, shared_->backward(s.shared, grad_out));
  return grad_x;
}

std::vector<Parameter*> MoELayer::parameters() {
  std::vector<Parameter*> all;
  auto add = [&all](Parameter* p, const std::string& prefix) {
    if (!p->value.defined()) return;
    if (p->name.rfind(prefix, 0) != 0) p->name = prefix + p->name;
    all.push_back(p);
  };
  if (gate_)
    for (Parameter* p : gate_->parameters()) add(p, "gate.");
  for (Parameter* p : experts_->parameters()) add(p, "experts.");
  if (shared_)
    for (Parameter* p : shared_->parameters()) add(p, "");
  return all;
}

std::vector<Parameter*> MoELayer::replicated_parameters() {
  std::vector<Parameter*> rep;
  for (Parameter* p : parameters())
    if (p->name.rfind("experts.", 0) != 0) rep.push_back(p);
  return rep;
}

void MoELayer::zero_grad() {
  for (Parameter* p : parameters())
    if (p->grad.defined()) p->grad.fill_zero();
}

}  // namespace flexep
