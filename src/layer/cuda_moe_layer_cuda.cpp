#include "flexep/layer/cuda_moe_layer.h"

#include <cmath>
#include <cstring>

#include "flexep/core/checks.h"
#include "flexep/core/random.h"
#include "flexep/cuda/layer_ops.h"
#include "flexep/cuda/runtime.h"
#include "flexep/layer/gate.h"
#include "flexep/layer/latent_projections.h"
#include "flexep/layer/moe_layer.h"
#include "core/gate_rules.h"

namespace flexep {

namespace {

Tensor upload_as(const TensorView& host, DType dtype, int device, cudaStream_t stream) {
  Tensor h = Tensor::wrap(host).to(dtype);
  return cuda::to_device(h, device, stream);
}

Tensor download_f32(const TensorView& d, cudaStream_t stream) { return cuda::to_host(d, stream).to(DType::f32); }

MoEConfig shared_expert_config(const MoEConfig& c) {
  MoEConfig s = c;
  s.expert_activation = c.shared_expert_activation;
  s.moe_inter_dim = c.shared_inter();
  s.n_routed_experts = 1;
  s.n_activated_experts = 1;
  s.dtype = DType::bf16;
  // The shared gate scales inside the FFN (sigmoid(g) * (a W_d + b_d) = (a s) W_d + b_d s): the
  // routed experts' apply_router_weight_after_down does not concern it.
  s.apply_router_weight_after_down = false;
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
    : config_(config),
      backend_(backend),
      options_(options),
      compute_(std::make_unique<CudaMoECompute>(config, backend, std::move(dispatcher), options.device,
                                                options.dispatch)) {
  config_.dtype = DType::bf16;
  cuda::DeviceGuard guard(options_.device);
  const cudaStream_t init_stream = nullptr;
  const int E = config_.n_routed_experts, local = compute_->num_local_experts(), rank = compute_->ep_rank();
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
    // moe.gate_dtype: bf16 (the default, = dtype) or f32 storage; the router casts as Automodel does.
    const DType gd = config_.gate_storage_dtype();
    gate_weight_ = {"gate.weight", upload_as(cpu_gate.weight().value, gd, options_.device, init_stream),
                    persistent_grad({E, config_.dim}), config_.train_gate};
    if (config_.router_bias)
      gate_bias_ = {"gate.bias", upload_as(cpu_gate.bias().value, gd, options_.device, init_stream),
                    persistent_grad({E}), config_.train_gate};
    if (config_.has_correction_bias()) {
      correction_bias_ = Tensor::zeros({E}, DType::f32, Device::cuda(options_.device));
      correction_master_.assign(static_cast<std::size_t>(E), 0.0);
    }
    cumulative_load_ = Tensor::zeros({E}, DType::i64, Device::cuda(options_.device));
  }
  experts_ = std::make_unique<CudaGroupedExperts>(config_.routed_expert_config(), local, rank * local, options_.device,
                                                  options_.grad_mode);
  auto fast_fill = [&](CudaGroupedExperts& g, std::uint64_t salt) {
    for (Parameter* p : g.parameters())
      if (p->name.find("bias") == std::string::npos)
        cuda::fill_random(p->value, options_.seed ^ salt ^ stream_id(p->name.c_str()),
                          static_cast<float>(options_.init_std), init_stream);
    FLEXEP_CUDA_CHECK(cudaStreamSynchronize(init_stream));
  };
  if (options_.fast_init) fast_fill(*experts_, static_cast<std::uint64_t>(rank) * 7919);
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
  }
  if (config_.latent()) {
    LatentProjections cpu_latent(config_, DType::f32);
    cpu_latent.init(options_.seed, options_.init_std);
    auto upload = [&](Parameter& dst, const Parameter& src) {
      if (src.value.defined())
        dst = {src.name, upload_as(src.value, DType::bf16, options_.device, init_stream),
               persistent_grad(src.value.shape()), true};
    };
    upload(fc1_weight_, cpu_latent.fc1_weight());
    upload(fc1_bias_, cpu_latent.fc1_bias());
    upload(fc2_weight_, cpu_latent.fc2_weight());
    upload(fc2_bias_, cpu_latent.fc2_bias());
  }
}

CudaMoELayer::~CudaMoELayer() = default;

MoEWeights CudaMoELayer::weights() const {
  MoEWeights w;
  w.gate = {gate_weight_.value, gate_bias_.value, correction_bias_};
  w.experts = experts_->weights();
  if (shared_) w.shared_experts = shared_->weights();
  w.shared_expert_gate = shared_gate_.value;
  w.fc1_latent_proj = {fc1_weight_.value, fc1_bias_.value};
  w.fc2_latent_proj = {fc2_weight_.value, fc2_bias_.value};
  return w;
}

CudaMoEOutput CudaMoELayer::forward(const TensorView& x, const TensorView& padding_mask, bool training,
                                    cudaStream_t stream, const TensorView& replay_indices) {
  if (replay_indices.defined()) {
    // The owner's argument is named as such in errors (the computation calls it routing.indices).
    FLEXEP_CHECK_ARG(!backend_.fake_balanced_gate, "replay_indices", "were given but the fake balanced gate has no replay");
    FLEXEP_CHECK_ARG(config_.enable_routing_replay, "replay_indices", "were given but moe.enable_routing_replay is false");
    check::shape(replay_indices, {x.size(0), config_.n_activated_experts}, "replay_indices");
    check::dtype(replay_indices, {DType::i64}, "replay_indices");
    check::device(replay_indices, Device::cuda(options_.device), "replay_indices");
  }
  RoutingOverride replay;
  replay.indices = replay_indices;
  CudaMoEOutput out = compute_->forward(weights(), x, padding_mask, training, replay, stream);
  if (!backend_.fake_balanced_gate && training && config_.gate_bias_update_factor > 0) {
    cuda::DeviceGuard guard(options_.device);
    cuda::add_i64(cumulative_load_, out.expert_load, stream);
  }
  return out;
}

Tensor CudaMoELayer::backward(const CudaMoEOutput& forward_output, const TensorView& grad_out, cudaStream_t stream) {
  FLEXEP_CHECK_ARG(forward_output.saved != nullptr, "forward_output", "has no saved state (was forward called?)");
  // Before the gradient targets: preparing them renews or un-marks the buffers (grad_mode), which a
  // refused call must leave as they were.
  check::shape(grad_out, {forward_output.out.size(0), config_.dim}, "grad_out");
  check::dtype(grad_out, {DType::bf16}, "grad_out");
  check::device(grad_out, Device::cuda(options_.device), "grad_out");
  cuda::DeviceGuard guard(options_.device);
  cuda::StreamGuard sg(stream);
  // The gradients this backward writes, per grad_mode (new tensors are allocated on `stream`).
  if (options_.grad_mode == GradMode::fresh_bf16_weights) renew_own_grads();
  CudaMoEGradTargets targets;
  if (config_.train_gate && gate_weight_.value.defined()) targets.gate_weight = gate_weight_.grad;
  if (config_.train_gate && config_.router_bias && gate_bias_.value.defined()) targets.gate_bias = gate_bias_.grad;
  if (shared_gate_.value.defined()) targets.shared_expert_gate = shared_gate_.grad;
  targets.experts = experts_->grad_targets(stream);
  if (shared_) targets.shared_experts = shared_->grad_targets(stream);
  targets.fc1_latent_proj = {fc1_weight_.grad, fc1_bias_.grad};
  targets.fc2_latent_proj = {fc2_weight_.grad, fc2_bias_.grad};
  return compute_->backward_into(weights(), *forward_output.saved, grad_out, 1.0, targets, stream);
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
  for (Parameter* p : {&fc1_weight_, &fc1_bias_, &fc2_weight_, &fc2_bias_})
    if (p->value.defined()) all.push_back(p);
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
std::vector<Parameter*> CudaMoELayer::own_f32_grad_parameters() {
  return {&gate_weight_, &gate_bias_, &shared_gate_, &fc1_weight_, &fc1_bias_, &fc2_weight_, &fc2_bias_};
}

void CudaMoELayer::renew_own_grads() {
  for (Parameter* p : own_f32_grad_parameters()) {
    p->grad = Tensor();
    if (p->value.defined() && p->requires_grad)
      p->grad = Tensor::zeros(p->value.shape(), DType::f32, p->value.device());
  }
}

void CudaMoELayer::zero_grad(cudaStream_t stream) {
  cuda::DeviceGuard guard(options_.device);
  if (options_.grad_mode == GradMode::fresh_bf16_weights) {
    for (Parameter* p : own_f32_grad_parameters()) p->grad = Tensor();  // the caller's
  } else {
    for (Parameter* p : own_f32_grad_parameters())
      if (p->grad.defined()) cuda::zero_async(p->grad, stream);
  }
  experts_->zero_grad(stream);  // accumulate_f32: lazily (the next backward overwrites the weight grads)
  if (shared_) shared_->zero_grad(stream);
}

void CudaMoELayer::load_from(MoELayer& cpu, cudaStream_t stream) {
  cuda::DeviceGuard guard(options_.device);
  FLEXEP_CHECK_ARG(cpu.ep_rank() == ep_rank() && cpu.ep_size() == ep_size(), "cpu", "is rank ", cpu.ep_rank(), " of ",
                   cpu.ep_size(), ", this layer is rank ", ep_rank(), " of ", ep_size());
  if (Gate* g = cpu.gate()) {
    cuda::copy_async(gate_weight_.value, g->weight().value.to(gate_weight_.value.dtype()), stream);
    if (config_.router_bias) cuda::copy_async(gate_bias_.value, g->bias().value.to(gate_bias_.value.dtype()), stream);
    if (config_.has_correction_bias()) {
      const Tensor& cb = g->e_score_correction_bias();
      cuda::copy_async(correction_bias_, cb, stream);
      for (std::int64_t e = 0; e < cb.numel(); ++e) correction_master_[static_cast<std::size_t>(e)] = cb.data<float>()[e];
    }
  }
  FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
  experts_->load_from(cpu.experts(), stream);
  if (shared_) upload_shared(cpu.shared_experts()->parameters(), stream);
  if (LatentProjections* lp = cpu.latent_projections()) {
    const std::pair<Parameter*, Parameter*> pairs[] = {{&fc1_weight_, &lp->fc1_weight()}, {&fc1_bias_, &lp->fc1_bias()},
                                                       {&fc2_weight_, &lp->fc2_weight()}, {&fc2_bias_, &lp->fc2_bias()}};
    std::vector<Tensor> staged;  // host copies in bf16, alive until the stream has read them
    for (const auto& [dst, src] : pairs)
      if (dst->value.defined()) {
        staged.push_back(src->value.to(DType::bf16));
        cuda::copy_async(dst->value, staged.back(), stream);
      }
    FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
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
  // Backwards join their side stream back into `stream`, so this synchronisation covers it.
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
  for (Parameter* p : {&fc1_weight_, &fc1_bias_, &fc2_weight_, &fc2_bias_})
    if (p->value.defined()) out.emplace_back(p->name, grad_or_zero(*p));
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
