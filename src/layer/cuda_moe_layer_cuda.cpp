#include "flexep/layer/cuda_moe_layer.h"

#include <spdlog/spdlog.h>

#include <cmath>
#include <cstring>

#include "flexep/core/checks.h"
#include "flexep/core/random.h"
#include "flexep/cuda/layer_ops.h"
#include "flexep/cuda/router.h"
#include "flexep/cuda/runtime.h"
#include "flexep/dispatch/local_cuda.h"
#include "flexep/layer/gate.h"
#include "flexep/layer/moe_layer.h"

namespace flexep {

// Frees the saved tensors on the layer's stream: device memory is stream-ordered, and every use of
// these tensors (side-stream ones included, which are joined back) is ordered before that point of
// the stream.
struct ReleaseOn {
  cudaStream_t stream = nullptr;
  std::optional<cuda::StreamGuard> guard;
  void activate() { guard.emplace(stream); }
};

struct CudaMoESaved {
  ReleaseOn release;  // first member: destroyed last, so it is active while the tensors are freed
  ~CudaMoESaved() { release.activate(); }
  std::int64_t tokens = 0;
  Tensor x;            // [T, dim] bf16, a copy when the backward reads it (router, shared experts)
  Tensor padding;      // [T] bool or undefined
  cuda::RouterOutput router;
  GateOutput fake;     // fake balanced gate: routing computed on the host
  Tensor indices;      // [T, k] i64, padding slots -1
  Tensor weights;      // [T, k] f32
  DispatchResult dispatched;
  CudaExpertsOutput experts;
  Tensor shared_gate;  // [T] f32: sigmoid gate or ones
  CudaExpertsOutput shared;
};

// Events of the phase timing (enabled by set_timing) and of the side-stream joins.
struct CudaMoELayer::Events {
  static constexpr int kMarks = 6;
  cudaEvent_t mark[kMarks] = {};
  cudaEvent_t x_ready = nullptr, shared_done = nullptr;
  Events() {
    for (cudaEvent_t& e : mark) FLEXEP_CUDA_CHECK(cudaEventCreate(&e));
    FLEXEP_CUDA_CHECK(cudaEventCreateWithFlags(&x_ready, cudaEventDisableTiming));
    FLEXEP_CUDA_CHECK(cudaEventCreateWithFlags(&shared_done, cudaEventDisableTiming));
  }
  ~Events() {
    for (cudaEvent_t e : mark) cudaEventDestroy(e);
    cudaEventDestroy(x_ready);
    cudaEventDestroy(shared_done);
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

Tensor upload_bf16(const TensorView& host, int device, cudaStream_t stream) {
  Tensor h = Tensor::wrap(host).to(DType::bf16);
  return cuda::to_device(h, device, stream);
}

Tensor download_f32(const TensorView& d, cudaStream_t stream) { return cuda::to_host(d, stream).to(DType::f32); }

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

Parameter* find(std::vector<Parameter*> ps, const std::string& name) {
  for (Parameter* p : ps)
    if (p->name == name) return p;
  return nullptr;
}

}  // namespace

CudaMoELayer::CudaMoELayer(const MoEConfig& config, const BackendConfig& backend,
                           std::shared_ptr<TokenDispatcher> dispatcher, const CudaMoELayerOptions& options)
    : config_(config), backend_(backend), options_(options), dispatcher_(std::move(dispatcher)) {
  config_.dtype = DType::bf16;
  validate(config_);
  validate(backend_);
  cuda::init();
  FLEXEP_CHECK_ARG(options_.device >= 0 && options_.device < cuda::device_count(), "device", options_.device,
                   " is out of range [0, ", cuda::device_count(), ")");
  if (dispatcher_) {
    ep_rank_ = dispatcher_->rank();
    ep_size_ = dispatcher_->world_size();
    FLEXEP_CHECK_ARG(dispatcher_->num_experts() == config_.n_routed_experts, "dispatcher", "was made for ",
                     dispatcher_->num_experts(), " experts but moe.n_routed_experts is ", config_.n_routed_experts);
  }
  validate_ep(config_, ep_size_);
  const Normalization norm = normalize(backend_, ep_size_);
  for (const std::string& m : norm.messages) spdlog::warn("flexep: {}", m);
  if (norm.local_fallback || !dispatcher_) dispatcher_ = make_local_cuda_dispatcher(options_.device, config_.n_routed_experts);

  cuda::DeviceGuard guard(options_.device);
  const cudaStream_t init_stream = nullptr;
  const int E = config_.n_routed_experts, local = E / ep_size_;
  // accumulate_f32: the layer's own gradient buffers, zero, for backward to add to. Fresh mode
  // allocates them per backward instead.
  auto persistent_grad = [&](Shape shape) {
    return options_.grad_mode == GradMode::accumulate_f32
               ? Tensor::zeros(shape, DType::f32, Device::cuda(options_.device))
               : Tensor();
  };
  // Initial values: the CPU modules' draws (same streams), rounded to bf16, so a CPU layer with the
  // same seed starts from the same numbers.
  if (!backend_.fake_balanced_gate) {
    Gate cpu_gate(config_, backend_.gate_precision, DType::f32);
    cpu_gate.init(options_.seed, options_.init_std);
    gate_weight_ = {"gate.weight", upload_bf16(cpu_gate.weight().value, options_.device, init_stream),
                    persistent_grad({E, config_.dim}), config_.train_gate};
    if (config_.router_bias)
      gate_bias_ = {"gate.bias", upload_bf16(cpu_gate.bias().value, options_.device, init_stream),
                    persistent_grad({E}), config_.train_gate};
    if (config_.has_correction_bias()) {
      correction_bias_ = Tensor::zeros({E}, DType::f32, Device::cuda(options_.device));
      correction_master_.assign(static_cast<std::size_t>(E), 0.0);
    }
    cumulative_load_ = Tensor::zeros({E}, DType::i64, Device::cuda(options_.device));
  }
  experts_ = std::make_unique<CudaGroupedExperts>(config_, local, ep_rank_ * local, options_.device,
                                                  options_.grad_mode);
  auto fast_fill = [&](CudaGroupedExperts& g, std::uint64_t salt) {
    for (Parameter* p : g.parameters())
      if (p->name.find("bias") == std::string::npos)
        cuda::fill_random(p->value, options_.seed ^ salt ^ stream_id(p->name.c_str()),
                          static_cast<float>(options_.init_std), init_stream);
    FLEXEP_CUDA_CHECK(cudaStreamSynchronize(init_stream));
  };
  if (options_.fast_init) fast_fill(*experts_, static_cast<std::uint64_t>(ep_rank_) * 7919);
  else experts_->init(options_.seed, options_.init_std, init_stream);
  if (config_.n_shared_experts > 0) {
    shared_ = std::make_unique<CudaGroupedExperts>(shared_expert_config(config_), 1, 0, options_.device,
                                                   options_.grad_mode);
    SharedExperts cpu_shared(config_, DType::f32);
    if (config_.shared_expert_gate)
      shared_gate_ = {"shared_expert_gate.weight",
                      Tensor::empty({1, config_.dim}, DType::bf16, Device::cuda(options_.device)),
                      persistent_grad({1, config_.dim}), true};
    if (options_.fast_init) {
      fast_fill(*shared_, 0x5ead);
      if (config_.shared_expert_gate)
        cuda::fill_random(shared_gate_.value, options_.seed ^ 0x6a7e, static_cast<float>(options_.init_std), init_stream);
    } else {
      cpu_shared.init(options_.seed, options_.init_std);
      upload_shared(cpu_shared.parameters(), init_stream);
    }
    FLEXEP_CUDA_CHECK(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking));
  }
  events_ = std::make_unique<Events>();
}

CudaMoELayer::~CudaMoELayer() {
  // Before the members: tensors made on the side stream are freed after it is gone (retired first).
  if (side_stream_) cuda::destroy_stream(side_stream_);
}

CudaMoEOutput CudaMoELayer::forward(const TensorView& x, const TensorView& padding_mask, bool training,
                                    cudaStream_t stream) {
  const Device dev = Device::cuda(options_.device);
  check::shape(x, {-1, config_.dim}, "x");
  check::dtype(x, {DType::bf16}, "x");
  check::device(x, dev, "x");
  const std::int64_t T = x.size(0);
  if (padding_mask.defined()) {
    check::shape(padding_mask, {T}, "padding_mask");
    check::dtype(padding_mask, {DType::b8}, "padding_mask");
    check::device(padding_mask, dev, "padding_mask");
  }
  cuda::DeviceGuard guard(options_.device);
  cuda::StreamGuard sg(stream);
  auto s = std::make_shared<CudaMoESaved>();
  s->release.stream = stream;
  Events& ev = *events_;
  if (timing_) FLEXEP_CUDA_CHECK(cudaEventRecord(ev.mark[0], stream));

  s->tokens = T;
  // Only the router's and the shared experts' backwards read x: without them (the fake gate, no
  // shared experts) the forward reads the caller's x and keeps no copy, unless x is not 16-byte
  // aligned (the dispatchers move rows as 16-byte words; the copy is).
  const bool aligned = reinterpret_cast<std::uintptr_t>(x.data) % 16 == 0;
  const bool keep_x = shared_ != nullptr || !backend_.fake_balanced_gate || !aligned;
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
      cuda::sigmoid_gate_forward(s->x, shared_gate_.value.view().reshape({config_.dim}), s->shared_gate, side_stream_);
    else
      cuda::fill(s->shared_gate, 1.0f, side_stream_);
    s->shared = shared_->forward(s->x, s->shared_gate, {T}, side_stream_);
    FLEXEP_CUDA_CHECK(cudaEventRecord(ev.shared_done, side_stream_));
  }

  // Router.
  Tensor token_mask;
  if (s->padding.defined()) {
    token_mask = Tensor::empty({T}, DType::b8, dev);
    cuda::logical_not(s->padding, token_mask, stream);
  }
  if (backend_.fake_balanced_gate && backend_.fake_gate_noise == 0) {
    // Without noise the fake routing is a fixed pattern of the token index (fake_balanced_gate.cpp):
    // computed and uploaded once per T, then reused, with no readback of x and no host sync.
    if (fixed_fake_.tokens != T || fixed_fake_.stream != stream) {
      {
        cuda::StreamGuard last_use(fixed_fake_.stream);  // freed after the work that read them
        fixed_fake_.indices = Tensor();
        fixed_fake_.weights = Tensor();
      }
      const GateOutput g = FakeBalancedGate(config_, 0.0).forward(Tensor::zeros({T, 1}, DType::f32), Tensor());
      fixed_fake_.indices = cuda::to_device(g.indices, options_.device, stream);
      fixed_fake_.weights = cuda::to_device(g.weights, options_.device, stream);
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
    s->router.indices = cuda::to_device(s->fake.indices, options_.device, stream);
    s->weights = cuda::to_device(s->fake.weights, options_.device, stream);
  } else {
    s->router = cuda::router_forward(config_, backend_.gate_precision, s->x, gate_weight_.value, gate_bias_.value,
                                     correction_bias_, token_mask, training, stream);
    s->weights = s->router.weights;
    if (training && config_.gate_bias_update_factor > 0)
      cuda::add_i64(cumulative_load_, s->router.expert_load, stream);
  }
  if (s->padding.defined()) {
    s->indices = Tensor::empty(s->router.indices.shape(), DType::i64, dev);
    cuda::mask_padding_indices(s->router.indices, s->padding, s->indices, stream);
  } else {
    s->indices = s->router.indices;
  }
  if (timing_) FLEXEP_CUDA_CHECK(cudaEventRecord(ev.mark[1], stream));

  // Dispatch, experts, combine.
  DispatchInput in;
  in.hidden = x_in;
  in.indices = s->indices;
  in.weights = s->weights;
  s->dispatched = dispatcher_->dispatch(in, options_.dispatch);
  if (timing_) FLEXEP_CUDA_CHECK(cudaEventRecord(ev.mark[2], stream));
  s->experts = experts_->forward(s->dispatched.tokens, s->dispatched.token_probs,
                                 host_counts(s->dispatched.tokens_per_expert, stream), stream);
  if (timing_) FLEXEP_CUDA_CHECK(cudaEventRecord(ev.mark[3], stream));
  Tensor y = dispatcher_->combine(s->dispatched.handle, s->experts.out);
  if (timing_) FLEXEP_CUDA_CHECK(cudaEventRecord(ev.mark[4], stream));
  if (shared_) {
    FLEXEP_CUDA_CHECK(cudaStreamWaitEvent(stream, ev.shared_done, 0));
    cuda::add_into(y, s->shared.out, stream);
    s->shared.saved->stream = stream;  // joined: free on the main stream from now on
  }
  if (timing_) {
    FLEXEP_CUDA_CHECK(cudaEventRecord(ev.mark[5], stream));
    const std::vector<double> us = ev.elapsed(6);
    times_ = {us[0], us[1], us[2], us[3], us[4]};
  }
  CudaMoEOutput out;
  out.out = y;
  out.aux_loss = s->router.aux_loss;
  out.saved = s;
  return out;
}

Tensor CudaMoELayer::backward(const CudaMoEOutput& forward_output, const TensorView& grad_out, cudaStream_t stream) {
  FLEXEP_CHECK_ARG(forward_output.saved != nullptr, "forward_output", "has no saved state (was forward called?)");
  const CudaMoESaved& s = *forward_output.saved;
  const Device dev = Device::cuda(options_.device);
  const std::int64_t T = s.tokens;
  check::shape(grad_out, {T, config_.dim}, "grad_out");
  check::dtype(grad_out, {DType::bf16}, "grad_out");
  check::device(grad_out, dev, "grad_out");
  cuda::DeviceGuard guard(options_.device);
  cuda::StreamGuard sg(stream);
  Events& ev = *events_;
  if (timing_) FLEXEP_CUDA_CHECK(cudaEventRecord(ev.mark[0], stream));
  // Before the side stream forks: the shared-expert gate's new gradient is zeroed on `stream`.
  if (options_.grad_mode == GradMode::fresh_bf16_weights) renew_own_grads();

  Tensor grad_x_shared;
  if (shared_) {
    FLEXEP_CUDA_CHECK(cudaEventRecord(ev.x_ready, stream));
    FLEXEP_CUDA_CHECK(cudaStreamWaitEvent(side_stream_, ev.x_ready, 0));
    cuda::StreamGuard side(side_stream_);
    CudaExpertsGrads sgr = shared_->backward(s.shared, grad_out, side_stream_);
    grad_x_shared = sgr.tokens;
    if (config_.shared_expert_gate)
      cuda::sigmoid_gate_backward(s.x, shared_gate_.value.view().reshape({config_.dim}), s.shared_gate, sgr.probs,
                                  shared_gate_.grad.view().reshape({config_.dim}), grad_x_shared, side_stream_);
    FLEXEP_CUDA_CHECK(cudaEventRecord(ev.shared_done, side_stream_));
  }

  Tensor grad_rows = dispatcher_->combine_backward(s.dispatched.handle, grad_out);
  if (timing_) FLEXEP_CUDA_CHECK(cudaEventRecord(ev.mark[1], stream));
  CudaExpertsGrads eg = experts_->backward(s.experts, grad_rows, stream);
  if (timing_) FLEXEP_CUDA_CHECK(cudaEventRecord(ev.mark[2], stream));
  DispatchGrads dg = dispatcher_->dispatch_backward(s.dispatched.handle, eg.tokens, eg.probs);
  if (timing_) FLEXEP_CUDA_CHECK(cudaEventRecord(ev.mark[3], stream));
  Tensor grad_x = dg.hidden;
  if (!backend_.fake_balanced_gate) {
    cuda::RouterGrads rg = cuda::router_backward(s.router, dg.weights, s.x, gate_weight_.value,
                                                 config_.train_gate ? gate_weight_.grad.view() : TensorView(),
                                                 config_.train_gate && config_.router_bias ? gate_bias_.grad.view()
                                                                                           : TensorView(),
                                                 1.0, stream);
    cuda::add_into(grad_x, rg.grad_x, stream);
  }
  if (timing_) FLEXEP_CUDA_CHECK(cudaEventRecord(ev.mark[4], stream));
  if (shared_) {
    FLEXEP_CUDA_CHECK(cudaStreamWaitEvent(stream, ev.shared_done, 0));
    cuda::add_into(grad_x, grad_x_shared, stream);
    s.shared.saved->stream = stream;
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

std::vector<Parameter*> CudaMoELayer::parameters() {
  std::vector<Parameter*> all;
  if (gate_weight_.value.defined()) all.push_back(&gate_weight_);
  if (gate_bias_.value.defined()) all.push_back(&gate_bias_);
  for (Parameter* p : experts_->parameters()) {
    if (p->name.rfind("experts.", 0) != 0) p->name = "experts." + p->name;
    all.push_back(p);
  }
  if (shared_)
    for (Parameter* p : shared_->parameters()) {
      if (p->name.rfind("shared_experts.", 0) != 0) p->name = "shared_experts." + p->name;
      all.push_back(p);
    }
  if (shared_gate_.value.defined()) all.push_back(&shared_gate_);
  return all;
}

std::vector<Parameter*> CudaMoELayer::replicated_parameters() {
  std::vector<Parameter*> rep;
  for (Parameter* p : parameters())
    if (p->name.rfind("experts.", 0) != 0) rep.push_back(p);
  return rep;
}

// fresh_bf16_weights: new f32 zeros for the gate and shared-gate gradients, which the router and
// shared-gate kernels add to (on the current stream). The old tensors are released first.
void CudaMoELayer::renew_own_grads() {
  for (Parameter* p : {&gate_weight_, &gate_bias_, &shared_gate_}) {
    p->grad = Tensor();
    if (p->value.defined() && p->requires_grad)
      p->grad = Tensor::zeros(p->value.shape(), DType::f32, p->value.device());
  }
}

void CudaMoELayer::zero_grad(cudaStream_t stream) {
  cuda::DeviceGuard guard(options_.device);
  if (options_.grad_mode == GradMode::fresh_bf16_weights) {
    for (Parameter* p : {&gate_weight_, &gate_bias_, &shared_gate_}) p->grad = Tensor();  // the caller's
  } else {
    for (Parameter* p : {&gate_weight_, &gate_bias_, &shared_gate_})
      if (p->grad.defined()) cuda::zero_async(p->grad, stream);
  }
  experts_->zero_grad(stream);  // accumulate_f32: lazily (the next backward overwrites the weight grads)
  if (shared_) shared_->zero_grad(stream);
}

void CudaMoELayer::load_from(MoELayer& cpu, cudaStream_t stream) {
  cuda::DeviceGuard guard(options_.device);
  FLEXEP_CHECK_ARG(cpu.ep_rank() == ep_rank_ && cpu.ep_size() == ep_size_, "cpu",
                   "is rank ", cpu.ep_rank(), " of ", cpu.ep_size(), ", this layer is rank ", ep_rank_, " of ", ep_size_);
  if (Gate* g = cpu.gate()) {
    cuda::copy_async(gate_weight_.value, g->weight().value.to(DType::bf16), stream);
    if (config_.router_bias) cuda::copy_async(gate_bias_.value, g->bias().value.to(DType::bf16), stream);
    if (config_.has_correction_bias()) {
      const Tensor& cb = g->e_score_correction_bias();
      cuda::copy_async(correction_bias_, cb, stream);
      for (std::int64_t e = 0; e < cb.numel(); ++e) correction_master_[static_cast<std::size_t>(e)] = cb.data<float>()[e];
    }
  }
  FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
  experts_->load_from(cpu.experts(), stream);
  if (shared_) upload_shared(cpu.shared_experts()->parameters(), stream);
}

// The CPU shared MLP's nn.Linear-shaped weights into the one-expert grouped layout:
// gate_and_up [1, dim, up] = [gate_proj^T | up_proj^T] (relu2: up_proj^T), down [1, inter, dim] =
// down_proj^T, biases concatenated the same way.
void CudaMoELayer::upload_shared(const std::vector<Parameter*>& ps, cudaStream_t stream) {
  const int I = config_.shared_inter(), D = config_.dim;
  const bool gated = config_.shared_expert_activation != Activation::relu2;
  const int up = gated ? 2 * I : I;
  Tensor gu = Tensor::zeros({1, D, up}, DType::f32), dn = Tensor::zeros({1, I, D}, DType::f32);
  const Parameter* gw = find(ps, "shared_experts.gate_proj.weight");
  const Parameter* uw = find(ps, "shared_experts.up_proj.weight");
  const Parameter* dw = find(ps, "shared_experts.down_proj.weight");
  for (int d = 0; d < D; ++d)
    for (int i = 0; i < I; ++i) {
      if (gated) {
        gu.data<float>()[d * up + i] = static_cast<float>(read_as_double(gw->value, i * D + d));
        gu.data<float>()[d * up + I + i] = static_cast<float>(read_as_double(uw->value, i * D + d));
      } else {
        gu.data<float>()[d * up + i] = static_cast<float>(read_as_double(uw->value, i * D + d));
      }
      dn.data<float>()[i * D + d] = static_cast<float>(read_as_double(dw->value, d * I + i));
    }
  cuda::copy_async(shared_->gate_and_up_projs().value, gu.to(DType::bf16), stream);
  cuda::copy_async(shared_->down_projs().value, dn.to(DType::bf16), stream);
  if (config_.expert_bias) {
    Tensor gb = Tensor::zeros({1, up}, DType::f32), db = Tensor::zeros({1, D}, DType::f32);
    const Parameter* gbp = find(ps, "shared_experts.gate_proj.bias");
    const Parameter* ubp = find(ps, "shared_experts.up_proj.bias");
    const Parameter* dbp = find(ps, "shared_experts.down_proj.bias");
    for (int i = 0; i < I; ++i) {
      if (gated) {
        gb.data<float>()[i] = static_cast<float>(read_as_double(gbp->value, i));
        gb.data<float>()[I + i] = static_cast<float>(read_as_double(ubp->value, i));
      } else {
        gb.data<float>()[i] = static_cast<float>(read_as_double(ubp->value, i));
      }
    }
    for (int d = 0; d < D; ++d) db.data<float>()[d] = static_cast<float>(read_as_double(dbp->value, d));
    cuda::copy_async(shared_->gate_up_proj_bias().value, gb.to(DType::bf16), stream);
    cuda::copy_async(shared_->down_proj_bias().value, db.to(DType::bf16), stream);
  }
  if (config_.shared_expert_gate)
    cuda::copy_async(shared_gate_.value, find(ps, "shared_expert_gate.weight")->value.to(DType::bf16), stream);
  // The host staging tensors die at the end of this function: finish the copies first.
  FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
}

std::vector<std::pair<std::string, Tensor>> CudaMoELayer::host_gradients(cudaStream_t stream) {
  cuda::DeviceGuard guard(options_.device);
  experts_->materialize_grads(stream);
  if (shared_) shared_->materialize_grads(stream);
  FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (side_stream_) FLEXEP_CUDA_CHECK(cudaStreamSynchronize(side_stream_));
  std::vector<std::pair<std::string, Tensor>> out;
  auto grad_or_zero = [&](Parameter& p) {
    return p.grad.defined() ? download_f32(p.grad, stream) : Tensor::zeros(p.value.shape(), DType::f32);
  };
  if (gate_weight_.value.defined()) out.emplace_back("gate.weight", grad_or_zero(gate_weight_));
  if (gate_bias_.value.defined()) out.emplace_back("gate.bias", grad_or_zero(gate_bias_));
  for (Parameter* p : experts_->parameters()) {
    const std::string name = p->name.rfind("experts.", 0) == 0 ? p->name : "experts." + p->name;
    out.emplace_back(name, grad_or_zero(*p));
  }
  if (shared_) {
    const int I = config_.shared_inter(), D = config_.dim;
    const bool gated = config_.shared_expert_activation != Activation::relu2;
    const int up = gated ? 2 * I : I;
    const Tensor gu = grad_or_zero(shared_->gate_and_up_projs()), dn = grad_or_zero(shared_->down_projs());
    Tensor gw = Tensor::zeros({I, D}, DType::f32), uw = Tensor::zeros({I, D}, DType::f32),
           dw = Tensor::zeros({D, I}, DType::f32);
    for (int d = 0; d < D; ++d)
      for (int i = 0; i < I; ++i) {
        if (gated) {
          gw.data<float>()[i * D + d] = gu.data<float>()[d * up + i];
          uw.data<float>()[i * D + d] = gu.data<float>()[d * up + I + i];
        } else {
          uw.data<float>()[i * D + d] = gu.data<float>()[d * up + i];
        }
        dw.data<float>()[d * I + i] = dn.data<float>()[i * D + d];
      }
    if (gated) out.emplace_back("shared_experts.gate_proj.weight", gw);
    out.emplace_back("shared_experts.up_proj.weight", uw);
    out.emplace_back("shared_experts.down_proj.weight", dw);
    if (config_.expert_bias) {
      const Tensor gb = grad_or_zero(shared_->gate_up_proj_bias()), db = grad_or_zero(shared_->down_proj_bias());
      Tensor g = Tensor::zeros({I}, DType::f32), u = Tensor::zeros({I}, DType::f32), dd = Tensor::zeros({D}, DType::f32);
      for (int i = 0; i < I; ++i) {
        if (gated) {
          g.data<float>()[i] = gb.data<float>()[i];
          u.data<float>()[i] = gb.data<float>()[I + i];
        } else {
          u.data<float>()[i] = gb.data<float>()[i];
        }
      }
      for (int d = 0; d < D; ++d) dd.data<float>()[d] = db.data<float>()[d];
      if (gated) out.emplace_back("shared_experts.gate_proj.bias", g);
      out.emplace_back("shared_experts.up_proj.bias", u);
      out.emplace_back("shared_experts.down_proj.bias", dd);
    }
    if (config_.shared_expert_gate) out.emplace_back("shared_expert_gate.weight", grad_or_zero(shared_gate_));
  }
  return out;
}

void CudaMoELayer::set_e_score_correction_bias(const TensorView& host_f32, cudaStream_t stream) {
  FLEXEP_CHECK_ARG(correction_bias_.defined(), "e_score_correction_bias",
                   "this layer has none (needs gate_bias_update_factor > 0 or force_e_score_correction_bias)");
  check::shape(host_f32, {config_.n_routed_experts}, "e_score_correction_bias");
  check::dtype(host_f32, {DType::f32}, "e_score_correction_bias");
  check::device(host_f32, Device::cpu(), "e_score_correction_bias");
  cuda::DeviceGuard guard(options_.device);
  for (std::int64_t e = 0; e < host_f32.numel(); ++e)
    correction_master_[static_cast<std::size_t>(e)] = host_f32.ptr<float>()[e];
  cuda::copy_async(correction_bias_, host_f32, stream);
  FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void CudaMoELayer::update_bias(ProcessGroup* group, cudaStream_t stream) {
  FLEXEP_CHECK(config_.train_gate && config_.gate_bias_update_factor > 0 && correction_bias_.defined(),
               "update_bias: the gate bias update is disabled (needs train_gate and gate_bias_update_factor > 0)");
  cuda::DeviceGuard guard(options_.device);
  const Tensor load = cuda::to_host(cumulative_load_, stream);
  Tensor sum = Tensor::empty({load.numel()}, DType::f64);
  for (std::int64_t e = 0; e < load.numel(); ++e) sum.data<double>()[e] = static_cast<double>(load.data<std::int64_t>()[e]);
  if (group) group->all_reduce_sum(sum, "gate bias update (expert load)");
  double mean = 0;
  for (std::int64_t e = 0; e < sum.numel(); ++e) mean += sum.data<double>()[e] / static_cast<double>(sum.numel());
  // The device buffer is shared with callers (PyTorch registers it as a buffer without a copy):
  // an entry that no longer equals its master's f32 value was written from outside (e.g.
  // load_state_dict), and that value is the new master.
  const Tensor current = cuda::to_host(correction_bias_, stream);
  Tensor bias = Tensor::empty({sum.numel()}, DType::f32);
  for (std::int64_t e = 0; e < sum.numel(); ++e) {
    const double diff = mean - sum.data<double>()[e];
    double& m = correction_master_[static_cast<std::size_t>(e)];
    const float now = current.data<float>()[e];
    if (static_cast<float>(m) != now) m = now;
    m += (diff > 0 ? 1.0 : diff < 0 ? -1.0 : 0.0) * config_.gate_bias_update_factor;
    bias.data<float>()[e] = static_cast<float>(m);
  }
  cuda::copy_async(correction_bias_, bias, stream);
  cuda::zero_async(cumulative_load_, stream);
  FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace flexep
