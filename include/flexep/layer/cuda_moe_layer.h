// The MoE layer on GPUs: the CUDA counterpart of MoELayer (moe_layer.h), same configuration, same
// parameter names and shapes, forward and backward, for one rank of an expert-parallel group (EP size
// 1: the single-GPU dispatcher; larger: any GPU TokenDispatcher). An owner of its parameters:
// CudaMoECompute (cuda_moe_compute.h) runs the math on views of them.
//
//   weights, indices = router(x)                   (cuda/router.h; padding tokens get index -1)
//   rows = dispatch(x, indices, weights)          (expert-major on the owning ranks)
//   y_rows = experts(rows)                         (CudaGroupedExperts, prob inside the FFN)
//   y = combine(y_rows) + shared_experts(x)       (shared experts on a second stream, joined at the end)
// (with moe.moe_latent_size, between fc1_latent_proj and fc2_latent_proj: cuda_moe_compute.h)
//
// Parameters are bf16 device tensors (the gate weight and bias f32 with moe.gate_dtype float32);
// inputs and outputs bf16. Routing rounds as Automodel's Gate with bf16 x (cuda/router.h).
// Gradients follow options.grad_mode (GradMode, cuda_grouped_experts.h) for every parameter of the
// layer: accumulate_f32 (the default) keeps f32 buffers that backward adds to; fresh_bf16_weights
// gives every parameter a new gradient tensor per backward, owned by the caller, bf16 for the
// expert weights (routed and shared gate_and_up_projs, down_projs) and f32 for the rest (gate weight
// and bias, expert biases, shared-expert gate: small, accumulated in f32 by their kernels).
// Blocking dispatch mode (tokens_per_expert on the host: the grouped GEMMs take host sizes). The
// shared experts run as a one-expert CudaGroupedExperts whose prob is the sigmoid gate (or 1): the
// same math as Automodel's MLP, since sigmoid(g) * (a W_d + b_d) = (a * s) W_d + b_d * s.
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <optional>
#include <vector>

#include "flexep/comm/process_group.h"
#include "flexep/dispatch/dispatcher.h"
#include "flexep/layer/cuda_grouped_experts.h"
#include "flexep/layer/cuda_moe_compute.h"

namespace flexep {

class MoELayer;

struct CudaMoELayerOptions {
  int device = 0;
  std::uint64_t seed = 1234;
  double init_std = 0.02;
  DispatchOptions dispatch;
  // Benchmarks: fill the expert weights on the device with a fast hash generator (same std) instead
  // of drawing the CPU reference's numbers on the host (minutes for DeepSeek-V3-sized experts).
  bool fast_init = false;
  GradMode grad_mode = GradMode::accumulate_f32;
};

class CudaMoELayer {
 public:
  CudaMoELayer(const MoEConfig& config, const BackendConfig& backend, std::shared_ptr<TokenDispatcher> dispatcher,
               const CudaMoELayerOptions& options = {});
  ~CudaMoELayer();

  // x [T, dim] bf16 on the layer's device; padding_mask [T] bool on the device or undefined;
  // replay_indices [T, k] i64 on the device or undefined (routing replay, cuda::router_forward; checked
  // on the host like the CPU gate's: ids in [0, E), distinct per token, ArgumentError "replay_indices").
  CudaMoEOutput forward(const TensorView& x, const TensorView& padding_mask, bool training, cudaStream_t stream,
                        const TensorView& replay_indices = TensorView());
  Tensor backward(const CudaMoEOutput& forward_output, const TensorView& grad_out, cudaStream_t stream);

  // Automodel names: "gate.weight" [E, dim], "gate.bias", "experts.gate_and_up_projs" [E_local, dim, up],
  // "experts.down_projs", expert biases, "shared_experts.*" (stored in the grouped layout, see
  // copy_values_to for the nn.Linear-shaped view), "shared_expert_gate.weight" [1, dim].
  std::vector<Parameter*> parameters();
  std::vector<Parameter*> replicated_parameters();
  // accumulate_f32: zeroes every gradient (the expert weights lazily, see CudaGroupedExperts).
  // fresh_bf16_weights: releases the layer's references to the last backward's gradients without
  // writing them (undefined until the next backward).
  void zero_grad(cudaStream_t stream);

  // Copies every parameter value from / to a CPU reference layer of the same configuration and rank
  // (values rounded to bf16 on the way in). Blocking.
  void load_from(MoELayer& cpu, cudaStream_t stream);
  // Gradients in the CPU layer's shapes and names, as f32 host tensors (for comparisons). Blocking.
  std::vector<std::pair<std::string, Tensor>> host_gradients(cudaStream_t stream);

  // Aux-loss-free balancing (as Gate::update_bias): load accumulated over training forwards, summed
  // over `group` (nullptr: this rank). Blocking.
  void update_bias(ProcessGroup* group, cudaStream_t stream);

  // The fp32 correction bias [E] on the device (undefined without one), and a setter that also
  // resets the fp64 master the bias update accumulates into (checkpoint loads). Blocking.
  // The device buffer itself [E] f32 (undefined without a correction bias). Writes into it from
  // outside are taken over by the next update_bias().
  const Tensor& e_score_correction_bias() const { return correction_bias_; }
  void set_e_score_correction_bias(const TensorView& host_f32, cudaStream_t stream);

  void set_timing(bool on) { compute_->set_timing(on); }
  const CudaMoEPhaseTimes& phase_times() const { return compute_->phase_times(); }

  const MoEConfig& config() const { return config_; }
  int device() const { return options_.device; }
  GradMode grad_mode() const { return options_.grad_mode; }
  int ep_rank() const { return compute_->ep_rank(); }
  int ep_size() const { return compute_->ep_size(); }
  CudaGroupedExperts& experts() { return *experts_; }
  CudaMoECompute& compute() { return *compute_; }
  MoEWeights weights() const;  // views of every parameter and the correction bias

 private:
  void upload_shared(const std::vector<Parameter*>& cpu_shared_params, cudaStream_t stream);
  void renew_own_grads();
  // The parameters whose f32 gradients the layer itself holds (not the grouped experts').
  std::vector<Parameter*> own_f32_grad_parameters();
  MoEConfig config_;
  BackendConfig backend_;
  CudaMoELayerOptions options_;
  std::unique_ptr<CudaMoECompute> compute_;  // first: outlives the parameters (its streams retire last)
  Parameter gate_weight_, gate_bias_, shared_gate_;
  Parameter fc1_weight_, fc1_bias_, fc2_weight_, fc2_bias_;  // moe.moe_latent_size: f32 gradients
  Tensor correction_bias_;                  // [E] f32 device
  Tensor cumulative_load_;                  // [E] i64 device
  std::vector<double> correction_master_;  // fp64 master of the correction bias
  std::unique_ptr<CudaGroupedExperts> experts_, shared_;
};

}  // namespace flexep
