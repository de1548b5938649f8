// The whole MoE layer (Automodel's MoE), CPU reference, for one rank of an expert-parallel group, as
// an owner of its parameters: MoECompute (moe_compute.h) runs the math on views of them.
//   weights, indices = gate(x, ~padding)           (padding tokens get index -1)
//   rows = dispatch(x, indices, weights)          (expert-major on the owning ranks)
//   y_rows = experts(rows)                         (prob applied inside the FFN)
//   y = combine(y_rows) (+ shared_experts(x))
// (with moe.moe_latent_size, rows come from fc1_latent_proj(x) and fc2_latent_proj maps the combined
// rows back to dim; moe_compute.h).
// Backward runs the same chain in reverse and accumulates the gradient of every parameter
// (Parameter::grad: the fresh gradient when it was undefined, else added to it). The gradients of
// replicated parameters (gate, shared experts) are this rank's contribution; the training loop
// all-reduces them like any data-parallel gradient. The shared experts' parameters keep nn.Linear's
// layout; each call hands MoECompute a grouped-layout copy of them.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "flexep/comm/process_group.h"
#include "flexep/dispatch/dispatcher.h"
#include "flexep/layer/gate.h"
#include "flexep/layer/grouped_experts.h"
#include "flexep/layer/latent_projections.h"
#include "flexep/layer/moe_compute.h"
#include "flexep/layer/shared_experts.h"

namespace flexep {

struct MoELayerOptions {
  DType param_dtype = DType::f32;  // f32, or f64 for gradient checks
  std::uint64_t seed = 1234;
  double init_std = 0.02;
  DispatchOptions dispatch;
  // bf16 (or f16): the gate sees x cast to this dtype, with Automodel's roundings for such inputs
  // (bf16 logits and weights; layer/gate.h), as the GPU layer routes. Unset: x as given.
  std::optional<DType> gate_input_dtype;
};

class MoELayer {
 public:
  // `dispatcher` may be null only for ep size 1 (local permute path). ep rank/size come from it.
  MoELayer(const MoEConfig& config, const BackendConfig& backend, std::shared_ptr<TokenDispatcher> dispatcher,
           const MoELayerOptions& options = {});

  // x [T, dim]; padding_mask [T] bool (true = padding) or undefined; replay_indices [T, k] or
  // undefined (routing replay, see Gate::forward).
  MoEOutput forward(const TensorView& x, const TensorView& padding_mask, bool training,
                    const TensorView& replay_indices = TensorView());
  Tensor backward(const MoEOutput& forward_output, const TensorView& grad_out);  // -> grad x

  // Every parameter with Automodel's state_dict name ("gate.weight", "experts.gate_and_up_projs",
  // "shared_experts.up_proj.weight", ...). Expert tensors hold this rank's local experts.
  std::vector<Parameter*> parameters();
  // Parameters replicated on every rank (their grads need an all-reduce across the group).
  std::vector<Parameter*> replicated_parameters();
  void zero_grad();

  Gate* gate() { return gate_.get(); }  // null with the fake balanced gate
  GroupedExperts& experts() { return *experts_; }
  SharedExperts* shared_experts() { return shared_.get(); }
  LatentProjections* latent_projections() { return latent_.get(); }  // null without moe.moe_latent_size
  const MoEConfig& config() const { return config_; }
  const BackendConfig& backend_config() const { return backend_; }
  int ep_rank() const { return compute_.ep_rank(); }
  int ep_size() const { return compute_.ep_size(); }
  MoECompute& compute() { return compute_; }

 private:
  struct Views;
  Views views() const;  // every parameter as MoEWeights (the shared experts as a grouped copy)
  MoEConfig config_;
  BackendConfig backend_;
  MoELayerOptions options_;
  MoECompute compute_;
  std::unique_ptr<Gate> gate_;
  std::unique_ptr<FakeBalancedGate> fake_gate_;
  std::unique_ptr<GroupedExperts> experts_;
  std::unique_ptr<SharedExperts> shared_;
  std::unique_ptr<LatentProjections> latent_;  // moe.moe_latent_size
};

}  // namespace flexep
