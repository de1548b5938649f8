#include "flexep/layer/cuda_moe_compute.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "flexep/core/checks.h"
#include "flexep/core/warn_once.h"
#include "flexep/cuda/gather_gemm.h"
#include "flexep/cuda/layer_ops.h"
#include "flexep/cuda/router.h"
#include "flexep/cuda/runtime.h"
#include "flexep/dispatch/local_cuda.h"
#include "flexep/layer/gate.h"
#include "core/gate_rules.h"
#include "layer/cuda_linear.h"

namespace flexep {

// One chunk of the routed path (backend.dispatch_chunks): rows [begin, end) of the batch, through
// the chunk's own dispatcher.
struct CudaMoEChunk {
  std::int64_t begin = 0, end = 0;
  DispatchResult dispatched;
  CudaExpertsOutput experts;
};

// The forward's state for backward. Each device tensor is freed on the stream it was made on (or
// the one cuda::free_on moved it to), whichever thread drops it: cuda/runtime.h.
struct CudaMoESaved {
  const CudaMoECompute* owner = nullptr;
  bool routing_override = false;
  std::int64_t tokens = 0;
  Tensor x;            // [T, dim] bf16, a copy when the backward reads it (router, shared experts)
  Tensor padding;      // [T] bool or undefined
  cuda::RouterOutput router;
  GateOutput fake;     // fake balanced gate: routing computed on the host
  Tensor indices;      // [T, k] i64, padding slots -1
  Tensor weights;      // [T, k] f32
  std::vector<CudaMoEChunk> chunks;
  Tensor shared_gate;  // [T] f32: sigmoid gate or ones
  CudaExpertsOutput shared;
  Tensor latent_y;     // [T, latent] bf16: the combined routed output, fc2_latent_proj's input
};

// Events of the phase timing (enabled by set_timing), of the side-stream joins and of the chunks'
// hand-overs between the caller's stream and the experts' (rows_ready[c]: chunk c's rows are there
// for the experts; computed[c]: its experts are done).
struct CudaMoECompute::Events {
  static constexpr int kMarks = 6;
  cudaEvent_t mark[kMarks] = {};
  cudaEvent_t x_ready = nullptr, shared_done = nullptr;
  std::vector<cudaEvent_t> rows_ready, computed;
  explicit Events(int chunks) {
    for (cudaEvent_t& e : mark) FLEXEP_CUDA_CHECK(cudaEventCreate(&e));
    FLEXEP_CUDA_CHECK(cudaEventCreateWithFlags(&x_ready, cudaEventDisableTiming));
    FLEXEP_CUDA_CHECK(cudaEventCreateWithFlags(&shared_done, cudaEventDisableTiming));
    for (auto* v : {&rows_ready, &computed}) {
      v->assign(static_cast<std::size_t>(chunks), nullptr);
      for (cudaEvent_t& e : *v) FLEXEP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
  }
  ~Events() {
    for (cudaEvent_t e : mark) cudaEventDestroy(e);
    cudaEventDestroy(x_ready);
    cudaEventDestroy(shared_done);
    for (auto* v : {&rows_ready, &computed})
      for (cudaEvent_t e : *v) cudaEventDestroy(e);
  }
  // Elapsed microseconds between consecutive marks 0..n-1 (synchronises on the last).
  std::vector<double> elapsed(int n) const {
    FLEXEP_CUDA_CHECK(cudaEventSynchronize(mark[n - 1]));
    std::vector<double> us;
    for (int i = 0; i + 1 < n; ++i) {
      float ms = 0;
      FLEXEP_CUDA_CHECK(cudaEventElapsedTime(&ms, mark[i], mark[i + 1]));
      us.push_back(1000.0 * ms);
    }
    return us;
  }
};

namespace {

// What the router takes as its weight: bf16, or f32 (moe.gate_dtype float32; the router casts it
// as Automodel's F.linear does).
const std::vector<DType> kGateWeightTypes = {DType::bf16, DType::f32};

std::vector<std::int64_t> host_counts(const Tensor& t, cudaStream_t stream) {
  const Tensor h = t.device().is_cpu() ? t : cuda::to_host(t, stream);
  return std::vector<std::int64_t>(h.data<std::int64_t>(), h.data<std::int64_t>() + h.numel());
}

MoEConfig shared_expert_config(const MoEConfig& c) {
  MoEConfig s = c;
  s.expert_activation = c.shared_expert_activation;
  s.moe_inter_dim = c.shared_inter();
  s.n_routed_experts = 1;
  s.n_activated_experts = 1;
  s.dtype = DType::bf16;
  return s;
}

// Rows [begin, end) of `t`, holding `t`'s memory.
Tensor rows_of(const Tensor& t, std::int64_t begin, std::int64_t end) {
  return Tensor::wrap(t.view().rows(begin, end), std::make_shared<Tensor>(t));
}

// Rows [begin, end) of the [T, ...] tensor `whole` := `part`, on `stream`; allocated (on the current
// stream) by the first part. A single chunk is the whole itself.
void put_rows(Tensor& whole, std::int64_t T, std::int64_t begin, std::int64_t end, const Tensor& part,
              cudaStream_t stream) {
  if (begin == 0 && end == T) {
    whole = part;
    return;
  }
  std::vector<std::int64_t> dims{T};
  for (int i = 1; i < part.shape().rank(); ++i) dims.push_back(part.size(i));
  if (!whole.defined()) whole = Tensor::empty(Shape(dims), part.dtype(), part.device());
  if (end > begin) cuda::copy_async(whole.view().rows(begin, end), part, stream);
}

// Drops `t`, last read on `stream` (which has joined the stream `t` was made on, if another): its
// memory goes back to the pool behind that read.
void release_after_read(Tensor& t, cudaStream_t stream) {
  cuda::free_on(t, stream);
  t = Tensor();
}

// A copy of `src` on the current stream (saved state must not alias the caller's tensors).
Tensor device_copy(const TensorView& src, cudaStream_t stream) {
  Tensor t = Tensor::empty(src.shape, src.dtype, src.device);
  cuda::copy_async(t, src, stream);
  return t;
}

Tensor zeros_f32_like(const TensorView& t) {
  return t.defined() ? Tensor::zeros(t.shape, DType::f32, t.device) : Tensor();
}

// An f32 gradient in its weight's dtype (bf16: one rounding; f32: as it is).
Tensor in_dtype_of(const Tensor& grad32, const TensorView& weight, cudaStream_t stream) {
  if (!grad32.defined() || weight.dtype == DType::f32) return grad32;
  FLEXEP_CHECK(weight.dtype == DType::bf16, "CudaMoECompute: no conversion of gradients to ", dtype_name(weight.dtype));
  Tensor g = Tensor::empty(grad32.shape(), DType::bf16, grad32.device());
  cuda::convert_f32_to_bf16(grad32, g, stream);
  return g;
}

}  // namespace

std::string CudaMoECompute::rows_in_place_requirements() {
  return fmt::format("the single-GPU dispatcher (EP size 1) or deepep's, a token width and expert widths that are "
                     "multiples of 8, and at most {} local experts",
                     cuda::kGatherGemmMaxGroups);
}

CudaMoECompute::CudaMoECompute(const MoEConfig& config, const BackendConfig& backend,
                               std::shared_ptr<TokenDispatcher> dispatcher, int device, const DispatchOptions& dispatch)
    : config_(config), backend_(backend), dispatch_(dispatch), device_(device), dispatcher_(std::move(dispatcher)) {
  config_.dtype = DType::bf16;
  validate(config_);
  validate(backend_);
  FLEXEP_CHECK_ARG(config_.gate_storage_dtype() == DType::bf16 || config_.gate_storage_dtype() == DType::f32,
                   "moe.gate_dtype", "is ", dtype_name(config_.gate_storage_dtype()),
                   "; the GPU router reads its weight in bf16 or f32; allowed: bfloat16, float32 or null");
  cuda::init();
  FLEXEP_CHECK_ARG(device_ >= 0 && device_ < cuda::device_count(), "device", device_, " is out of range [0, ",
                   cuda::device_count(), ")");
  if (dispatcher_) {
    ep_rank_ = dispatcher_->rank();
    ep_size_ = dispatcher_->world_size();
    FLEXEP_CHECK_ARG(dispatcher_->num_experts() == config_.n_routed_experts, "dispatcher", "was made for ",
                     dispatcher_->num_experts(), " experts but moe.n_routed_experts is ", config_.n_routed_experts);
  }
  validate_ep(config_, ep_size_);
  const Normalization norm = normalize(backend_, ep_size_);
  for (const std::string& m : norm.messages) warn_once(m);
  if (norm.local_fallback || !dispatcher_) dispatcher_ = make_local_cuda_dispatcher(device_, config_.n_routed_experts);
  // The CPU gate's configuration checks (the router repeats them, plus its kernel limits, per call).
  if (!backend_.fake_balanced_gate) static_cast<void>(GateCompute(config_, backend_.gate_precision));

  // The single-GPU dispatcher can leave the tokens in place, deepep its received rank-major rows, for
  // experts that read them through the row table (gather_gemm.h): no expert-major copy is made or
  // kept for backward. Off by default while the gathered kernel is slower than cuBLAS on copied rows
  // (docs/experts.md): backend.rows_in_place, or set_rows_in_place.
  const std::int64_t width = config_.latent() ? config_.moe_latent_size : config_.dim;
  const std::string_view kind = dispatcher_->backend();
  rows_in_place_supported_ = (kind == "local" || kind == "deepep") && width % 8 == 0 && config_.up_dim() % 8 == 0 &&
                             num_local_experts() <= cuda::kGatherGemmMaxGroups;
  in_place_rows_are_x_ = kind == "local";
  rows_in_place_ = backend_.rows_in_place && rows_in_place_supported_;
  if (backend_.rows_in_place && !rows_in_place_supported_)
    warn_once("rows_in_place needs " + rows_in_place_requirements() + "; the experts take the dispatcher's rows");
  cuda::DeviceGuard guard(device_);
  experts_.emplace(config_.routed_expert_config(), num_local_experts(), device_, "experts.");
  if (config_.n_shared_experts > 0) {
    shared_.emplace(shared_expert_config(config_), 1, device_, "shared_experts.");
    FLEXEP_CUDA_CHECK(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking));
  }
  chunk_dispatchers_ = make_chunk_dispatchers(dispatcher_, backend_.dispatch_chunks);
  if (backend_.dispatch_chunks > 1)
    FLEXEP_CUDA_CHECK(cudaStreamCreateWithFlags(&expert_stream_, cudaStreamNonBlocking));
  events_ = std::make_unique<Events>(backend_.dispatch_chunks);
}

CudaMoECompute::~CudaMoECompute() {
  // Before the members: tensors made on the side streams are freed after they are gone (retired first).
  if (side_stream_) cuda::destroy_stream(side_stream_);
  if (expert_stream_) cuda::destroy_stream(expert_stream_);
}

std::vector<MoEWeightSpec> CudaMoECompute::weight_specs() const {
  return moe_weight_specs(config_, backend_, num_local_experts());
}

void CudaMoECompute::check_weights(const MoEWeights& weights, bool routing_override) const {
  const Device dev = Device::cuda(device_);
  check_moe_weights(
      weights, weight_specs(),
      [&](const MoEWeightSpec& s) {
        if (s.name == "gate.weight") return MoEWeightRule{kGateWeightTypes, dev};
        if (s.name == "gate.bias") return MoEWeightRule{{DType::bf16, DType::f32}, dev};
        if (s.name == "gate.e_score_correction_bias") return MoEWeightRule{{DType::f32}, dev};
        return MoEWeightRule{{DType::bf16}, dev};
      },
      routing_override);
}

CudaMoEOutput CudaMoECompute::forward(const MoEWeights& w, const TensorView& x, const TensorView& padding_mask,
                                      bool training, const RoutingOverride& routing, cudaStream_t stream) {
  const Device dev = Device::cuda(device_);
  check::shape(x, {-1, config_.dim}, "x");
  check::dtype(x, {DType::bf16}, "x");
  check::device(x, dev, "x");
  const std::int64_t T = x.size(0);
  if (padding_mask.defined()) {
    check::shape(padding_mask, {T}, "padding_mask");
    check::dtype(padding_mask, {DType::b8}, "padding_mask");
    check::device(padding_mask, dev, "padding_mask");
  }
  const bool override = routing.replaces_router();
  if (routing.given()) {
    const std::int64_t k = config_.n_activated_experts;
    check::shape(routing.indices, {T, k}, "routing.indices");
    check::dtype(routing.indices, {DType::i64}, "routing.indices");
    check::device(routing.indices, dev, "routing.indices");
  }
  if (override) {
    const std::int64_t k = config_.n_activated_experts;
    check::shape(routing.weights, {T, k}, "routing.weights");
    check::dtype(routing.weights, {DType::f32}, "routing.weights");
    check::device(routing.weights, dev, "routing.weights");
  } else if (routing.replay()) {
    FLEXEP_CHECK_ARG(config_.enable_routing_replay, "routing.indices",
                     "were given without routing.weights (a routing replay) but moe.enable_routing_replay is false");
    FLEXEP_CHECK_ARG(!backend_.fake_balanced_gate, "routing.indices",
                     "were given without routing.weights (a routing replay), but the fake balanced gate has no "
                     "router to replay; give the weights too");
    // The router passes bad ids on unchecked (it never syncs); check them first, as the CPU gate
    // does (one small copy and a sync: replay is a rollout-matching forward, not the hot path).
    gate_rules::read_replay_indices(cuda::to_host(routing.indices, stream), T, config_.n_activated_experts,
                                    config_.n_routed_experts);
  }
  check_weights(w, override);
  cuda::DeviceGuard guard(device_);
  cuda::StreamGuard sg(stream);
  auto s = std::make_shared<CudaMoESaved>();
  s->owner = this;
  s->routing_override = override;
  Events& ev = *events_;
  if (timing_) FLEXEP_CUDA_CHECK(cudaEventRecord(ev.mark[0], stream));

  s->tokens = T;
  const bool router = !override && !backend_.fake_balanced_gate;
  // Only the router's, the shared experts' and fc1_latent_proj's backwards read x: without them the
  // forward reads the caller's x and keeps no copy, unless x is not 16-byte aligned (the dispatchers
  // move rows as 16-byte words; the copy is).
  const bool aligned = reinterpret_cast<std::uintptr_t>(x.data) % 16 == 0;
  const bool keep_x = shared_.has_value() || router || config_.latent() || !aligned ||
                      (rows_in_place_ && in_place_rows_are_x_);  // the experts read x itself then
  if (keep_x) {
    s->x = Tensor::empty({T, config_.dim}, DType::bf16, dev);
    cuda::copy_async(s->x, x, stream);
  }
  const TensorView x_in = keep_x ? s->x.view() : x;
  if (padding_mask.defined()) {
    s->padding = Tensor::empty({T}, DType::b8, dev);
    cuda::copy_async(s->padding, padding_mask, stream);
  }

  // Shared experts overlap with routing and dispatch on the side stream.
  if (shared_) {
    FLEXEP_CUDA_CHECK(cudaEventRecord(ev.x_ready, stream));
    FLEXEP_CUDA_CHECK(cudaStreamWaitEvent(side_stream_, ev.x_ready, 0));
    cuda::StreamGuard side(side_stream_);
    s->shared_gate = Tensor::empty({T}, DType::f32, dev);
    if (config_.shared_expert_gate)
      cuda::sigmoid_gate_forward(s->x, w.shared_expert_gate.reshape({config_.dim}), s->shared_gate, side_stream_);
    else
      cuda::fill(s->shared_gate, 1.0f, side_stream_);
    s->shared = shared_->forward(w.shared_experts, s->x, s->shared_gate, {T}, side_stream_);
    FLEXEP_CUDA_CHECK(cudaEventRecord(ev.shared_done, side_stream_));
  }

  // Router.
  Tensor token_mask;
  if (s->padding.defined()) {
    token_mask = Tensor::empty({T}, DType::b8, dev);
    cuda::logical_not(s->padding, token_mask, stream);
  }
  if (override) {
    s->router.indices = device_copy(routing.indices, stream);
    s->weights = device_copy(routing.weights, stream);
  } else if (backend_.fake_balanced_gate && backend_.fake_gate_noise == 0) {
    // Without noise the fake routing is a fixed pattern of the token index (fake_balanced_gate.cpp):
    // computed and uploaded once per T, then reused, with no readback of x and no host sync.
    if (fixed_fake_.tokens != T || fixed_fake_.stream != stream) {
      fixed_fake_.indices = Tensor();
      fixed_fake_.weights = Tensor();
      const GateOutput g = FakeBalancedGate(config_, 0.0).forward(Tensor::zeros({T, 1}, DType::f32), Tensor());
      fixed_fake_.indices = cuda::to_device(g.indices, device_, stream);
      fixed_fake_.weights = cuda::to_device(g.weights, device_, stream);
      fixed_fake_.tokens = T;
      fixed_fake_.stream = stream;
    }
    s->router.indices = fixed_fake_.indices;
    s->weights = fixed_fake_.weights;
  } else if (backend_.fake_balanced_gate) {
    // Fake routing with noise depends only on T and the first 4 values of x: compute it on the host
    // from a [T, min(dim, 4)] probe (the same first 4 values; a [T, dim] one costs ~80 ms of page
    // faults at T 4096, dim 7168).
    Tensor probe = Tensor::zeros({T, std::min<std::int64_t>(config_.dim, 4)}, DType::f32);
    if (T * config_.dim > 0) {
      const std::int64_t n = std::min<std::int64_t>(4, T * config_.dim);
      Tensor head = cuda::to_host(x_in.reshape({T * config_.dim}).rows(0, n), stream).to(DType::f32);
      std::memcpy(probe.raw(), head.raw(), static_cast<std::size_t>(n) * sizeof(float));
    }
    FakeBalancedGate fake(config_, backend_.fake_gate_noise);
    s->fake = fake.forward(probe, Tensor());
    s->router.indices = cuda::to_device(s->fake.indices, device_, stream);
    s->weights = cuda::to_device(s->fake.weights, device_, stream);
  } else {
    s->router = cuda::router_forward(config_, backend_.gate_precision, s->x, w.gate.weight, w.gate.bias,
                                     w.gate.e_score_correction_bias, token_mask, training, stream,
                                     routing.replay() ? routing.indices : TensorView());
    s->weights = s->router.weights;
  }
  if (s->padding.defined()) {
    s->indices = Tensor::empty(s->router.indices.shape(), DType::i64, dev);
    cuda::mask_padding_indices(s->router.indices, s->padding, s->indices, stream);
  } else {
    s->indices = s->router.indices;
  }
  Tensor expert_load = s->router.expert_load;
  if (!router) {
    expert_load = Tensor::empty({config_.n_routed_experts}, DType::i64, dev);
    cuda::count_expert_load(s->indices, expert_load, stream);
  }
  if (timing_) FLEXEP_CUDA_CHECK(cudaEventRecord(ev.mark[1], stream));

  // Dispatch, experts, combine; in the latent width with moe.moe_latent_size.
  const Tensor latent_x =
      config_.latent() ? cuda::linear_forward(x_in, w.fc1_latent_proj.weight, w.fc1_latent_proj.bias, stream) : Tensor();
  // The single-GPU dispatcher's in-place rows are a view of the dispatch's hidden: the experts keep
  // the tensor that owns it for backward.
  const Tensor& source = config_.latent() ? latent_x : s->x;
  Tensor y = forward_routed(w, config_.latent() ? latent_x.view() : x_in, source, *s, stream);
  if (config_.latent()) {
    s->latent_y = y;
    y = cuda::linear_forward(s->latent_y, w.fc2_latent_proj.weight, w.fc2_latent_proj.bias, stream);
  }
  if (timing_) FLEXEP_CUDA_CHECK(cudaEventRecord(ev.mark[4], stream));
  if (shared_) {
    FLEXEP_CUDA_CHECK(cudaStreamWaitEvent(stream, ev.shared_done, 0));
    cuda::add_into(y, s->shared.out, stream);
    release_after_read(s->shared.out, stream);  // not read by the backward
  }
  if (timing_) {
    FLEXEP_CUDA_CHECK(cudaEventRecord(ev.mark[5], stream));
    const std::vector<double> us = ev.elapsed(6);
    times_ = {us[0], us[1], us[2], us[3], us[4]};
  }
  CudaMoEOutput out;
  out.out = y;
  out.aux_loss = s->router.aux_loss;
  out.expert_load = expert_load;
  out.indices = s->router.indices;
  out.weights = s->weights;
  out.saved = s;
  return out;
}

Tensor CudaMoECompute::backward_into(const MoEWeights& w, const CudaMoESaved& s, const TensorView& grad_out,
                                     double aux_loss_scale, const CudaMoEGradTargets& targets, cudaStream_t stream) {
  FLEXEP_CHECK_ARG(s.owner == this, "saved", "comes from another CudaMoECompute; pass the state of this one's forward");
  const Device dev = Device::cuda(device_);
  const std::int64_t T = s.tokens;
  check::shape(grad_out, {T, config_.dim}, "grad_out");
  check::dtype(grad_out, {DType::bf16}, "grad_out");
  check::device(grad_out, dev, "grad_out");
  check_weights(w, s.routing_override);
  const bool router = !s.routing_override && !backend_.fake_balanced_gate;
  cuda::DeviceGuard guard(device_);
  cuda::StreamGuard sg(stream);
  Events& ev = *events_;
  if (timing_) FLEXEP_CUDA_CHECK(cudaEventRecord(ev.mark[0], stream));
  // The shared gate's kernel always writes a weight gradient: a scratch one when none is wanted
  // (zeroed on `stream`, before the side stream forks).
  Tensor shared_gate_scratch;
  TensorView shared_gate_grad = targets.shared_expert_gate;
  if (shared_ && config_.shared_expert_gate && !shared_gate_grad.defined()) {
    shared_gate_scratch = Tensor::zeros({1, config_.dim}, DType::f32, dev);
    shared_gate_grad = shared_gate_scratch;
  }

  Tensor grad_x_shared;
  if (shared_) {
    FLEXEP_CUDA_CHECK(cudaEventRecord(ev.x_ready, stream));
    FLEXEP_CUDA_CHECK(cudaStreamWaitEvent(side_stream_, ev.x_ready, 0));
    cuda::StreamGuard side(side_stream_);
    CudaExpertsGrads sgr =
        shared_->backward(w.shared_experts, s.shared, grad_out, targets.shared_experts, side_stream_);
    grad_x_shared = sgr.tokens;
    if (config_.shared_expert_gate)
      cuda::sigmoid_gate_backward(s.x, w.shared_expert_gate.reshape({config_.dim}), s.shared_gate, sgr.probs,
                                  shared_gate_grad.reshape({config_.dim}), grad_x_shared, side_stream_);
    FLEXEP_CUDA_CHECK(cudaEventRecord(ev.shared_done, side_stream_));
  }

  Tensor grad_routed;  // [T, latent]: through fc2_latent_proj's backward (moe.moe_latent_size)
  if (config_.latent())
    grad_routed = cuda::linear_backward(s.latent_y, w.fc2_latent_proj.weight, grad_out, targets.fc2_latent_proj.weight,
                                        targets.fc2_latent_proj.bias, stream);
  DispatchGrads dg =
      backward_routed(w, s, config_.latent() ? grad_routed.view() : grad_out, targets.experts, stream);
  if (timing_) FLEXEP_CUDA_CHECK(cudaEventRecord(ev.mark[3], stream));
  Tensor grad_x = dg.hidden;
  if (config_.latent())
    grad_x = cuda::linear_backward(s.x, w.fc1_latent_proj.weight, dg.hidden, targets.fc1_latent_proj.weight,
                                   targets.fc1_latent_proj.bias, stream);
  if (router) {
    cuda::RouterGrads rg = cuda::router_backward(s.router, dg.weights, s.x, w.gate.weight, targets.gate_weight,
                                                 targets.gate_bias, aux_loss_scale, stream);
    cuda::add_into(grad_x, rg.grad_x, stream);
  }
  if (timing_) FLEXEP_CUDA_CHECK(cudaEventRecord(ev.mark[4], stream));
  if (shared_) {
    FLEXEP_CUDA_CHECK(cudaStreamWaitEvent(stream, ev.shared_done, 0));
    cuda::add_into(grad_x, grad_x_shared, stream);
  }
  if (timing_) {
    FLEXEP_CUDA_CHECK(cudaEventRecord(ev.mark[5], stream));
    const std::vector<double> us = ev.elapsed(6);
    // Backward phases add to the forward's: combine (its backward), experts, dispatch, router.
    times_.combine += us[0];
    times_.experts += us[1];
    times_.dispatch += us[2];
    times_.router += us[3];
    times_.shared += us[4];
  }
  return grad_x;
}

MoEBackward CudaMoECompute::backward(const MoEWeights& w, const CudaMoESaved& s, const TensorView& grad_out,
                                     double aux_loss_scale, cudaStream_t stream) {
  FLEXEP_CHECK_ARG(s.owner == this, "saved", "comes from another CudaMoECompute; pass the state of this one's forward");
  check_weights(w, s.routing_override);
  const bool router = !s.routing_override && !backend_.fake_balanced_gate;
  cuda::DeviceGuard guard(device_);
  cuda::StreamGuard sg(stream);  // every gradient below is allocated on `stream`
  // The expert weights' gradients are written whole by the bf16 wgrad GEMMs (no fill); the small
  // ones are f32 zeros that their kernels add to, rounded to the weights' dtype at the end.
  auto expert_targets = [&](const ExpertWeights& e, ExpertGradients& fresh, Tensor& bgu32, Tensor& bd32) {
    CudaExpertGradTargets t;
    fresh.gate_and_up_projs = Tensor::empty(e.gate_and_up_projs.shape, DType::bf16, e.gate_and_up_projs.device);
    fresh.down_projs = Tensor::empty(e.down_projs.shape, DType::bf16, e.down_projs.device);
    bgu32 = zeros_f32_like(e.gate_up_proj_bias);
    bd32 = zeros_f32_like(e.down_proj_bias);
    t.gate_and_up_projs = fresh.gate_and_up_projs;
    t.down_projs = fresh.down_projs;
    t.gate_up_proj_bias = bgu32.defined() ? bgu32.view() : TensorView();
    t.down_proj_bias = bd32.defined() ? bd32.view() : TensorView();
    t.accumulate_weights = false;
    return t;
  };
  MoEBackward out;
  MoEGradients& g = out.gradients;
  CudaMoEGradTargets targets;
  Tensor bgu32, bd32, sbgu32, sbd32, gate_w32, gate_b32, shared_gate32;
  Tensor fc1_w32 = zeros_f32_like(w.fc1_latent_proj.weight), fc1_b32 = zeros_f32_like(w.fc1_latent_proj.bias);
  Tensor fc2_w32 = zeros_f32_like(w.fc2_latent_proj.weight), fc2_b32 = zeros_f32_like(w.fc2_latent_proj.bias);
  targets.fc1_latent_proj = {fc1_w32, fc1_b32};
  targets.fc2_latent_proj = {fc2_w32, fc2_b32};
  targets.experts = expert_targets(w.experts, g.experts, bgu32, bd32);
  if (shared_) targets.shared_experts = expert_targets(w.shared_experts, g.shared_experts, sbgu32, sbd32);
  if (router && config_.train_gate) {
    gate_w32 = zeros_f32_like(w.gate.weight);
    gate_b32 = zeros_f32_like(w.gate.bias);
    if (gate_w32.defined()) targets.gate_weight = gate_w32;
    if (gate_b32.defined()) targets.gate_bias = gate_b32;
  }
  shared_gate32 = zeros_f32_like(w.shared_expert_gate);
  if (shared_gate32.defined()) targets.shared_expert_gate = shared_gate32;

  out.grad_x = backward_into(w, s, grad_out, aux_loss_scale, targets, stream);

  g.experts.gate_up_proj_bias = in_dtype_of(bgu32, w.experts.gate_up_proj_bias, stream);
  g.experts.down_proj_bias = in_dtype_of(bd32, w.experts.down_proj_bias, stream);
  g.shared_experts.gate_up_proj_bias = in_dtype_of(sbgu32, w.shared_experts.gate_up_proj_bias, stream);
  g.shared_experts.down_proj_bias = in_dtype_of(sbd32, w.shared_experts.down_proj_bias, stream);
  g.gate.weight = in_dtype_of(gate_w32, w.gate.weight, stream);
  g.gate.bias = in_dtype_of(gate_b32, w.gate.bias, stream);
  g.shared_expert_gate = in_dtype_of(shared_gate32, w.shared_expert_gate, stream);
  g.fc1_latent_proj = {in_dtype_of(fc1_w32, w.fc1_latent_proj.weight, stream),
                       in_dtype_of(fc1_b32, w.fc1_latent_proj.bias, stream)};
  g.fc2_latent_proj = {in_dtype_of(fc2_w32, w.fc2_latent_proj.weight, stream),
                       in_dtype_of(fc2_b32, w.fc2_latent_proj.bias, stream)};
  return out;
}

cudaStream_t CudaMoECompute::hand_over_to_experts(int c, cudaStream_t stream) {
  if (chunk_dispatchers_.size() == 1) return stream;
  cudaEvent_t ready = events_->rows_ready[static_cast<std::size_t>(c)];
  FLEXEP_CUDA_CHECK(cudaEventRecord(ready, stream));
  FLEXEP_CUDA_CHECK(cudaStreamWaitEvent(expert_stream_, ready, 0));
  return expert_stream_;
}

// Chunk c's experts run on expert_stream_ (its rows handed over by rows_ready[c]) while the caller's
// stream dispatches chunk c + 1 and combines chunk c - 1 (joined by computed[c - 1]):
//
//   caller's stream:  D0 D1 [E0 done] C0 D2 [E1 done] C1 ...
//   experts' stream:     [D0] E0 [D1] E1 [D2] E2 ...
//
// Blocking dispatches and combines wait on the host (for their counts, and for the GPU's errors), so
// the host queues chunk c + 1's dispatch and experts before combine c: the experts' stream always
// has the next chunk's GEMMs while the host waits. One chunk is the plain path on the caller's stream.
Tensor CudaMoECompute::forward_routed(const MoEWeights& w, const TensorView& hidden, const Tensor& source,
                                      CudaMoESaved& s, cudaStream_t stream) {
  const int C = static_cast<int>(chunk_dispatchers_.size());
  const std::int64_t T = s.tokens;
  Events& ev = *events_;
  DispatchOptions options = dispatch_;
  options.rows_in_place = rows_in_place_;
  s.chunks.resize(static_cast<std::size_t>(C));
  for (int c = 0; c < C; ++c) {
    s.chunks[static_cast<std::size_t>(c)].begin = chunk_begin(T, c, C);
    s.chunks[static_cast<std::size_t>(c)].end = chunk_begin(T, c + 1, C);
  }
  auto dispatch = [&](int c) {
    CudaMoEChunk& ch = s.chunks[static_cast<std::size_t>(c)];
    DispatchInput in;
    in.hidden = hidden.rows(ch.begin, ch.end);
    in.indices = s.indices.view().rows(ch.begin, ch.end);
    in.weights = s.weights.view().rows(ch.begin, ch.end);
    ch.dispatched = chunk_dispatchers_[static_cast<std::size_t>(c)]->dispatch(in, options);
  };
  auto experts = [&](int c) {
    CudaMoEChunk& ch = s.chunks[static_cast<std::size_t>(c)];
    const std::vector<std::int64_t> counts = host_counts(ch.dispatched.tokens_per_expert, stream);
    const cudaStream_t es = hand_over_to_experts(c, stream);
    cuda::StreamGuard on_experts(es);
    if (rows_in_place_ && ch.dispatched.expert_rows.defined()) {
      // deepep's in-place rows are its own copy of the received rows; the single-GPU dispatcher's
      // index the chunk's rows of `source`.
      const Tensor rows = in_place_rows_are_x_ ? rows_of(source, ch.begin, ch.end) : ch.dispatched.tokens;
      ch.experts = experts_->forward_gathered(w.experts, rows, ch.dispatched.expert_rows, ch.dispatched.token_probs,
                                              counts, es);
    } else {
      ch.experts = experts_->forward(w.experts, ch.dispatched.tokens, ch.dispatched.token_probs, counts, es);
    }
    if (C > 1) FLEXEP_CUDA_CHECK(cudaEventRecord(ev.computed[static_cast<std::size_t>(c)], es));
  };
  dispatch(0);
  if (timing_) FLEXEP_CUDA_CHECK(cudaEventRecord(ev.mark[2], stream));
  experts(0);
  Tensor y;
  for (int c = 0; c < C; ++c) {
    CudaMoEChunk& ch = s.chunks[static_cast<std::size_t>(c)];
    if (c + 1 < C) {
      dispatch(c + 1);
      experts(c + 1);
    }
    if (C > 1) FLEXEP_CUDA_CHECK(cudaStreamWaitEvent(stream, ev.computed[static_cast<std::size_t>(c)], 0));
    if (timing_ && c == C - 1) FLEXEP_CUDA_CHECK(cudaEventRecord(ev.mark[3], stream));
    const Tensor yc = chunk_dispatchers_[static_cast<std::size_t>(c)]->combine(ch.dispatched.handle, ch.experts.out);
    put_rows(y, T, ch.begin, ch.end, yc, stream);
    // The backward does not read the experts' output: [rows, dim] less kept per layer.
    release_after_read(ch.experts.out, stream);
  }
  return y;
}

// The forward's pipeline backwards: the experts' backward of chunk c + 1 is queued before
// dispatch_backward of c, so that it runs while that and combine_backward of c + 2 do. The expert
// weight gradients add up over the chunks (the experts' stream runs them in order): f32 targets as
// asked, bf16 ones (written whole by one backward) written by the first chunk and added to in bf16
// by the others, as autograd adds bf16 gradients. (Sums in f32, rounded once, read and write f32
// weight gradients once per chunk: 3.7 GB each at the DSV3-like shape of `bench layer`.)
DispatchGrads CudaMoECompute::backward_routed(const MoEWeights& w, const CudaMoESaved& s, const TensorView& grad,
                                              const CudaExpertGradTargets& targets, cudaStream_t stream) {
  const int C = static_cast<int>(s.chunks.size());
  const std::int64_t T = s.tokens;
  Events& ev = *events_;
  CudaExpertGradTargets t = targets;
  std::vector<Tensor> rows(static_cast<std::size_t>(C));  // each chunk's grad of its expert rows
  std::vector<CudaExpertsGrads> eg(static_cast<std::size_t>(C));
  auto combine_backward = [&](int c) {
    const CudaMoEChunk& ch = s.chunks[static_cast<std::size_t>(c)];
    rows[static_cast<std::size_t>(c)] = chunk_dispatchers_[static_cast<std::size_t>(c)]->combine_backward(
        ch.dispatched.handle, grad.rows(ch.begin, ch.end));
  };
  auto experts = [&](int c) {
    const cudaStream_t es = hand_over_to_experts(c, stream);
    {
      cuda::StreamGuard on_experts(es);
      eg[static_cast<std::size_t>(c)] =
          experts_->backward(w.experts, s.chunks[static_cast<std::size_t>(c)].experts,
                             rows[static_cast<std::size_t>(c)], t, es);
    }
    t.accumulate_weights = true;  // later chunks add to the first's
    t.add_to_bf16_weights = true;
    if (C > 1) FLEXEP_CUDA_CHECK(cudaEventRecord(ev.computed[static_cast<std::size_t>(c)], es));
  };
  combine_backward(0);
  if (timing_) FLEXEP_CUDA_CHECK(cudaEventRecord(ev.mark[1], stream));
  experts(0);
  DispatchGrads dg;
  for (int c = 0; c < C; ++c) {
    const CudaMoEChunk& ch = s.chunks[static_cast<std::size_t>(c)];
    if (c + 1 < C) {
      combine_backward(c + 1);
      experts(c + 1);
    }
    if (C > 1) FLEXEP_CUDA_CHECK(cudaStreamWaitEvent(stream, ev.computed[static_cast<std::size_t>(c)], 0));
    if (timing_ && c == C - 1) FLEXEP_CUDA_CHECK(cudaEventRecord(ev.mark[2], stream));
    CudaExpertsGrads& g = eg[static_cast<std::size_t>(c)];
    const DispatchGrads dgc =
        chunk_dispatchers_[static_cast<std::size_t>(c)]->dispatch_backward(ch.dispatched.handle, g.tokens, g.probs);
    put_rows(dg.hidden, T, ch.begin, ch.end, dgc.hidden, stream);
    put_rows(dg.weights, T, ch.begin, ch.end, dgc.weights, stream);
    // rows[c] was read on the experts' stream, which the caller's has joined; g was made there.
    rows[static_cast<std::size_t>(c)] = Tensor();
    release_after_read(g.tokens, stream);
    release_after_read(g.probs, stream);
  }
  return dg;
}

}  // namespace flexep
