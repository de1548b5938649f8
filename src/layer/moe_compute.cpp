#include "flexep/layer/moe_compute.h"

#include <cstring>

#include "flexep/core/checks.h"
#include "flexep/core/warn_once.h"
#include "flexep/dispatch/host.h"
#include "layer/add_into.h"
#include "layer/linear.h"
#include "layer/rank_major_rows.h"
#include "layer/shared_layout.h"

namespace flexep {

// One chunk of the routed path (backend.dispatch_chunks): rows [begin, end) of the batch, through
// the chunk's own dispatcher.
struct MoEChunk {
  std::int64_t begin = 0, end = 0;
  DispatchResult dispatched;
  std::optional<ref::ExpertMajorRows> rank_major;  // a rank-major dispatch's rows, as the experts read them
  ExpertsOutput experts;
};

struct MoESaved {
  const MoECompute* owner = nullptr;
  std::int64_t tokens = 0;
  DType x_dtype = DType::f32, compute = DType::f32;
  bool routing_override = false;
  GateOutput gate;
  Tensor masked_indices;  // [T, k] int64, padding tokens set to -1
  std::vector<MoEChunk> chunks;
  SharedOutput shared;
  Tensor latent_x;  // [T, dim]: fc1_latent_proj's input (moe.moe_latent_size), a copy
  Tensor latent_y;  // [T, latent]: the combined routed output, fc2_latent_proj's input
};

namespace {

const std::initializer_list<DType> kFloatTypes = {DType::bf16, DType::f16, DType::f32, DType::f64};

std::vector<std::int64_t> host_counts(const Tensor& tokens_per_expert) {
  FLEXEP_CHECK(tokens_per_expert.device().is_cpu(), "the CPU reference layer needs tokens_per_expert on the host");
  const std::int64_t* p = tokens_per_expert.data<std::int64_t>();
  return std::vector<std::int64_t>(p, p + tokens_per_expert.numel());
}

// `t` in dtype `to`: the caller's memory when it already is, else a converted copy.
Tensor as_dtype(const TensorView& t, DType to) {
  if (!t.defined()) return Tensor();
  return t.dtype == to ? Tensor::wrap(t) : Tensor::wrap(t).to(to);
}

Tensor as_dtype(const Tensor& t, DType to) { return t.defined() && t.dtype() != to ? t.to(to) : t; }

Tensor zeros_like(const TensorView& t, DType dtype) { return t.defined() ? Tensor::zeros(t.shape, dtype) : Tensor(); }

// Rows [begin, end) of `whole` (contiguous, [T, ...]) := `part`; a single chunk is the whole itself.
void put_rows(Tensor& whole, std::int64_t T, std::int64_t begin, std::int64_t end, const Tensor& part) {
  if (begin == 0 && end == T) {
    whole = part;
    return;
  }
  std::vector<std::int64_t> dims{T};
  for (int i = 1; i < part.shape().rank(); ++i) dims.push_back(part.size(i));
  if (!whole.defined()) whole = Tensor::empty(Shape(dims), part.dtype());
  if (part.numel() > 0) std::memcpy(whole.view().rows(begin, end).data, part.raw(), part.nbytes());
}

// The weights as the pieces compute with them, for one call: expert and shared weights in the
// compute dtype (shared ones in nn.Linear layout), the gate's as given, the correction bias in f32. Converted copies live here; weights already in the right dtype are the caller's memory.
struct ComputeWeights {
  GateWeights gate;
  ExpertWeights experts;
  SharedMlpGradients shared;  // tensors (layout copies)
  LinearWeights fc1, fc2;     // latent projections
  std::vector<Tensor> keep;

  ComputeWeights(const MoEConfig& c, const MoEWeights& w, DType compute) {
    auto view = [&](const TensorView& t, DType to) {
      if (!t.defined() || t.dtype == to) return t;
      keep.push_back(Tensor::wrap(t).to(to));
      return keep.back().view();
    };
    // The gate casts its weights itself, as Automodel's F.linear does (gate.h).
    gate = {w.gate.weight, w.gate.bias, view(w.gate.e_score_correction_bias, DType::f32)};
    experts = {view(w.experts.gate_and_up_projs, compute), view(w.experts.down_projs, compute),
               view(w.experts.gate_up_proj_bias, compute), view(w.experts.down_proj_bias, compute)};
    if (w.shared_experts.gate_and_up_projs.defined()) {
      const ExpertWeights grouped{view(w.shared_experts.gate_and_up_projs, compute),
                                  view(w.shared_experts.down_projs, compute),
                                  view(w.shared_experts.gate_up_proj_bias, compute),
                                  view(w.shared_experts.down_proj_bias, compute)};
      shared = shared_to_linear(c, grouped, view(w.shared_expert_gate, compute));
    }
    fc1 = {view(w.fc1_latent_proj.weight, compute), view(w.fc1_latent_proj.bias, compute)};
    fc2 = {view(w.fc2_latent_proj.weight, compute), view(w.fc2_latent_proj.bias, compute)};
  }
};

// Gradients computed in the compute dtype, handed back in each weight's dtype.
ExpertGradients in_weight_dtypes(const ExpertGradients& g, const ExpertWeights& w) {
  return {as_dtype(g.gate_and_up_projs, w.gate_and_up_projs.dtype), as_dtype(g.down_projs, w.down_projs.dtype),
          as_dtype(g.gate_up_proj_bias, w.gate_up_proj_bias.dtype), as_dtype(g.down_proj_bias, w.down_proj_bias.dtype)};
}

void check_routing(const RoutingOverride& r, std::int64_t T, const MoEConfig& c, bool fake_gate) {
  const std::int64_t k = c.n_activated_experts;
  check::shape(r.indices, {T, k}, "routing.indices");
  check::dtype(r.indices, {DType::i64}, "routing.indices");
  check::device(r.indices, Device::cpu(), "routing.indices");
  check::expert_indices(r.indices, c.n_routed_experts, "routing.indices");
  if (r.replay()) {
    FLEXEP_CHECK_ARG(c.enable_routing_replay, "routing.indices",
                     "were given without routing.weights (a routing replay) but moe.enable_routing_replay is false");
    FLEXEP_CHECK_ARG(!fake_gate, "routing.indices",
                     "were given without routing.weights (a routing replay), but the fake balanced gate has no "
                     "router to replay; give the weights too");
    return;
  }
  check::shape(r.weights, {T, k}, "routing.weights");
  check::dtype(r.weights, {DType::f32}, "routing.weights");
  check::device(r.weights, Device::cpu(), "routing.weights");
}

// load[e] = (unmasked token, slot) pairs routed to e, -1 slots skipped (Gate._compute_expert_load).
Tensor expert_load_of(const Tensor& masked_indices, int experts) {
  Tensor load = Tensor::zeros({experts}, DType::i64);
  const std::int64_t* idx = masked_indices.data<std::int64_t>();
  for (std::int64_t i = 0; i < masked_indices.numel(); ++i)
    if (idx[i] >= 0) ++load.data<std::int64_t>()[idx[i]];
  return load;
}

}  // namespace

MoECompute::MoECompute(const MoEConfig& config, const BackendConfig& backend,
                       std::shared_ptr<TokenDispatcher> dispatcher, const DispatchOptions& dispatch)
    : config_(config), backend_(backend), dispatch_(dispatch), dispatcher_(std::move(dispatcher)) {
  validate(config_);
  validate(backend_);
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
  for (const std::string& m : norm.messages) warn_once(m);
  if (backend_.rows_in_place) warn_once("rows_in_place applies to the GPU layer; the CPU layer computes on copied rows");
  if (norm.local_fallback) dispatcher_.reset();
  if (!dispatcher_) {
    // EP size 1: the local path is the host backend over a world of one rank (same plan code).
    dispatcher_ = make_host_dispatcher(std::make_shared<HostWorld>(1), 0, config_.n_routed_experts);
  }
  chunk_dispatchers_ = make_chunk_dispatchers(dispatcher_, backend_.dispatch_chunks);
  if (backend_.fake_balanced_gate) fake_gate_.emplace(config_, backend_.fake_gate_noise);
  else gate_.emplace(config_, backend_.gate_precision);
  experts_.emplace(config_.routed_expert_config(), num_local_experts());
  if (config_.n_shared_experts > 0) shared_.emplace(config_);
}

std::vector<MoEWeightSpec> MoECompute::weight_specs() const {
  return moe_weight_specs(config_, backend_, num_local_experts());
}

void MoECompute::check_weights(const MoEWeights& weights, bool routing_override) const {
  check_moe_weights(
      weights, weight_specs(),
      [](const MoEWeightSpec&) { return MoEWeightRule{{kFloatTypes.begin(), kFloatTypes.end()}, Device::cpu()}; },
      routing_override);
}

MoEOutput MoECompute::forward(const MoEWeights& weights, const TensorView& x, const TensorView& padding_mask,
                              bool training, const RoutingOverride& routing) {
  check::shape(x, {-1, config_.dim}, "x");
  check::dtype(x, {DType::f32, DType::f64, DType::bf16}, "x");
  check::device(x, Device::cpu(), "x");
  const std::int64_t T = x.size(0);
  Tensor token_mask;
  if (padding_mask.defined()) {
    check::shape(padding_mask, {T}, "padding_mask");
    check::dtype(padding_mask, {DType::b8}, "padding_mask");
    check::device(padding_mask, Device::cpu(), "padding_mask");
    token_mask = Tensor::empty({T}, DType::b8);
    for (std::int64_t t = 0; t < T; ++t) token_mask.data<bool>()[t] = !padding_mask.ptr<bool>()[t];
  }
  if (routing.given()) check_routing(routing, T, config_, fake_gate_.has_value());
  check_weights(weights, routing.replaces_router());
  if (dispatch_.check_finite) check::finite(x, "x");

  const DType compute = x.dtype == DType::f64 ? DType::f64 : DType::f32;
  const ComputeWeights w(config_, weights, compute);
  const Tensor xc = as_dtype(x, compute);

  auto saved = std::make_shared<MoESaved>();
  saved->owner = this;
  saved->tokens = T;
  saved->x_dtype = x.dtype;
  saved->compute = compute;
  saved->routing_override = routing.replaces_router();
  if (routing.replaces_router()) {
    saved->gate.indices = Tensor::wrap(routing.indices).clone();
    saved->gate.weights = Tensor::wrap(routing.weights).to(compute);
  } else if (gate_) {
    // The gate reads x as given (or cast to gate_input_dtype) and rounds as Automodel's does.
    const Tensor gate_x = gate_input_dtype_ ? as_dtype(x, *gate_input_dtype_) : Tensor::wrap(x);
    saved->gate = gate_->forward(w.gate, gate_x, token_mask, training, routing.indices);
    // The weights keep the gate's rounding (x's dtype, or fp32) but travel in the compute dtype.
    saved->gate.weights = as_dtype(saved->gate.weights, compute);
  } else {
    saved->gate = fake_gate_->forward(xc, token_mask);
  }

  // Padding tokens are never sent: their slots become -1 (Automodel's masked_fill(~mask, -1)).
  saved->masked_indices = saved->gate.indices.clone();
  if (token_mask.defined()) {
    const std::int64_t k = saved->masked_indices.size(1);
    for (std::int64_t t = 0; t < T; ++t)
      if (!token_mask.data<bool>()[t])
        for (std::int64_t j = 0; j < k; ++j) saved->masked_indices.data<std::int64_t>()[t * k + j] = -1;
  }

  // Latent experts (moe.moe_latent_size): the routed path runs in the latent width; the router
  // and the shared experts read x.
  Tensor routed_x = xc;
  if (config_.latent()) {
    saved->latent_x = xc.raw() == x.data ? xc.clone() : xc;
    routed_x = ref::linear_forward(xc, w.fc1.weight, w.fc1.bias);
  }
  // The routed path in chunks of rows, one after another (the GPU layer pipelines them); every
  // row's result is the same however the batch is cut.
  Tensor y;
  const int C = static_cast<int>(chunk_dispatchers_.size());
  for (int c = 0; c < C; ++c) {
    MoEChunk& ch = saved->chunks.emplace_back();
    ch.begin = chunk_begin(T, c, C);
    ch.end = chunk_begin(T, c + 1, C);
    TokenDispatcher& d = *chunk_dispatchers_[static_cast<std::size_t>(c)];
    DispatchInput in;
    in.hidden = routed_x.view().rows(ch.begin, ch.end);
    in.indices = saved->masked_indices.view().rows(ch.begin, ch.end);
    in.weights = saved->gate.weights.view().rows(ch.begin, ch.end);
    ch.dispatched = d.dispatch(in, dispatch_);
    const std::vector<std::int64_t> counts = host_counts(ch.dispatched.tokens_per_expert);
    Tensor yc;
    if (dispatch_.layout == DispatchLayout::rank_major) {
      // As Automodel's GroupedExpertsDeepEP: the experts read the received rows in expert order, and
      // their rows are summed back per received token before the combine.
      const ref::ExpertMajorRows& m = ch.rank_major.emplace(ref::gather_expert_major(ch.dispatched));
      ch.experts = experts_->forward(w.experts, m.tokens, m.probs, counts);
      yc = d.combine(ch.dispatched.handle, ref::sum_per_received_row(ch.experts.out, m));
    } else {
      ch.experts = experts_->forward(w.experts, ch.dispatched.tokens, ch.dispatched.token_probs, counts);
      yc = d.combine(ch.dispatched.handle, ch.experts.out);
    }
    ch.experts.out = Tensor();  // the backward does not read it
    put_rows(y, T, ch.begin, ch.end, yc);
  }
  if (config_.latent()) {
    saved->latent_y = y;
    y = ref::linear_forward(y, w.fc2.weight, w.fc2.bias);
  }
  if (shared_) {
    saved->shared = shared_->forward(views_of(w.shared), xc);
    ref::add_into(y, saved->shared.out);
    saved->shared.out = Tensor();
  }
  MoEOutput out;
  out.out = as_dtype(y, x.dtype);
  out.aux_loss = saved->gate.aux_loss;
  out.expert_load = expert_load_of(saved->masked_indices, config_.n_routed_experts);
  out.indices = saved->gate.indices;
  out.weights = saved->gate.weights;
  out.saved = saved;
  return out;
}

MoEBackward MoECompute::backward(const MoEWeights& weights, const MoESaved& s, const TensorView& grad_out,
                                 double aux_loss_scale) {
  FLEXEP_CHECK_ARG(s.owner == this, "saved", "comes from another MoECompute; pass the state of this one's forward");
  check::shape(grad_out, {s.tokens, config_.dim}, "grad_out");
  check::dtype(grad_out, {s.x_dtype}, "grad_out");
  check::device(grad_out, Device::cpu(), "grad_out");
  check_weights(weights, s.routing_override);
  const DType compute = s.compute;
  const ComputeWeights w(config_, weights, compute);
  const Tensor g = as_dtype(grad_out, compute);

  MoEBackward out;
  auto linear_grads = [&](const LinearWeights& lw) {
    return LinearGradients{zeros_like(lw.weight, compute), zeros_like(lw.bias, compute)};
  };
  auto in_dtypes = [](const LinearGradients& lg, const LinearWeights& lw) {
    return LinearGradients{as_dtype(lg.weight, lw.weight.dtype), as_dtype(lg.bias, lw.bias.dtype)};
  };
  Tensor grad_routed = g;
  if (config_.latent()) {
    const LinearGradients fc2 = linear_grads(w.fc2);
    grad_routed = ref::linear_backward(s.latent_y, w.fc2.weight, g, fc2.weight, fc2.bias);
    out.gradients.fc2_latent_proj = in_dtypes(fc2, weights.fc2_latent_proj);
  }
  // The chunks in forward's order; the experts' weight gradients add up over them.
  const ExpertGradients experts_grads{
      zeros_like(w.experts.gate_and_up_projs, compute), zeros_like(w.experts.down_projs, compute),
      zeros_like(w.experts.gate_up_proj_bias, compute), zeros_like(w.experts.down_proj_bias, compute)};
  DispatchGrads dg;
  const std::int64_t T = s.tokens;
  for (std::size_t c = 0; c < s.chunks.size(); ++c) {
    const MoEChunk& ch = s.chunks[c];
    TokenDispatcher& d = *chunk_dispatchers_[c];
    Tensor grad_rows = d.combine_backward(ch.dispatched.handle, grad_routed.view().rows(ch.begin, ch.end));
    if (ch.rank_major) grad_rows = ref::gather_rows(grad_rows, *ch.rank_major);
    ExpertsGrads eg = experts_->backward(w.experts, ch.experts, grad_rows, experts_grads);
    DispatchGrads dgc;
    if (ch.rank_major) {
      const ref::RankMajorGrads rg =
          ref::scatter_to_received(eg.tokens, eg.probs, *ch.rank_major, ch.dispatched.topk_weights.dtype());
      dgc = d.dispatch_backward(ch.dispatched.handle, rg.rows, rg.topk_weights);
    } else {
      dgc = d.dispatch_backward(ch.dispatched.handle, eg.tokens, eg.probs);
    }
    put_rows(dg.hidden, T, ch.begin, ch.end, dgc.hidden);
    put_rows(dg.weights, T, ch.begin, ch.end, dgc.weights);
  }
  out.gradients.experts = in_weight_dtypes(experts_grads, weights.experts);
  Tensor grad_x = dg.hidden;
  if (config_.latent()) {
    const LinearGradients fc1 = linear_grads(w.fc1);
    grad_x = ref::linear_backward(s.latent_x, w.fc1.weight, dg.hidden, fc1.weight, fc1.bias);
    out.gradients.fc1_latent_proj = in_dtypes(fc1, weights.fc1_latent_proj);
  }
  if (gate_ && !s.routing_override) {
    // Straight into the weights' dtypes: the gate sums in f64 and rounds once.
    GateGradients gate_grads;
    if (config_.train_gate) {
      gate_grads.weight = zeros_like(weights.gate.weight, weights.gate.weight.dtype);
      gate_grads.bias = zeros_like(weights.gate.bias, weights.gate.bias.dtype);
    }
    ref::add_into(grad_x, as_dtype(gate_->backward(w.gate, s.gate, dg.weights, aux_loss_scale, gate_grads), compute));
    out.gradients.gate = gate_grads;
  }
  if (shared_) {
    const SharedMlpWeights lin = views_of(w.shared);
    auto zeros = [&](const TensorView& t) { return zeros_like(t, compute); };
    const SharedMlpGradients shared_grads{zeros(lin.gate_proj),      zeros(lin.up_proj),
                                          zeros(lin.down_proj),      zeros(lin.gate_proj_bias),
                                          zeros(lin.up_proj_bias),   zeros(lin.down_proj_bias),
                                          zeros(lin.shared_expert_gate)};
    ref::add_into(grad_x, shared_->backward(lin, s.shared, g, shared_grads));
    out.gradients.shared_experts =
        in_weight_dtypes(shared_to_grouped(config_, views_of(shared_grads)), weights.shared_experts);
    out.gradients.shared_expert_gate = as_dtype(shared_grads.shared_expert_gate, weights.shared_expert_gate.dtype);
  }
  out.grad_x = as_dtype(grad_x, s.x_dtype);
  return out;
}

}  // namespace flexep
