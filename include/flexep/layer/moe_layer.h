// The whole MoE layer (Automodel's MoE), CPU reference, for one rank of an expert-parallel group:
//   weights, indices = gate(x, ~padding)           (padding tokens get index -1)
//   rows = dispatch(x, indices, weights)          (expert-major on the owning ranks)
//   y_rows = experts(rows)                         (prob applied inside the FFN)
//   y = combine(y_rows) (+ shared_experts(x))
// Backward runs the same chain in reverse and accumulates the gradient of every parameter. The
// gradients of replicated parameters (gate, shared experts) are this rank's contribution; the
// training loop all-reduces them like any data-parallel gradient.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "flexep/comm/process_group.h"
#include "flexep/dispatch/dispatcher.h"
#include "flexep/layer/gate.h"
#include "flexep/layer/grouped_experts.h"
#include "flexep/layer/shared_experts.h"

namespace flexep {

struct MoELayerOptions {
  DType param_dtype = DType::f32;  // f32, or f64 for gradient checks
  std::uint64_t seed = 1234;
  double init_std = 0.02;
  DispatchOptions dispatch;
};

struct MoESaved;

struct MoEOutput {
  Tensor out;                      // [T, dim]
  std::optional<double> aux_loss;  // unscaled aux loss of this rank's tokens
  std::shared_ptr<const MoESaved> saved;
};

class MoELayer {
 public:
  // `dispatcher` may be null only for ep size 1 (local permute path). ep rank/size come from it.
  MoELayer(const MoEConfig& config, const BackendConfig& backend, std::shared_ptr<TokenDispatcher> dispatcher,
           const MoELayerOptions& options = {});

  // x [T, dim]; padding_mask [T] bool (true = padding) or undefined.
  MoEOutput forward(const TensorView& x, const TensorView& padding_mask, bool training);
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
  const MoEConfig& config() const { return config_; }
  const BackendConfig& backend_config() const { return backend_; }
  int ep_rank() const { return ep_rank_; }
  int ep_size() const { return ep_size_; }

 private:
  MoEConfig config_;
  BackendConfig backend_;
  MoELayerOptions options_;
  std::shared_ptr<TokenDispatcher> dispatcher_;
  int ep_rank_ = 0, ep_size_ = 1;
  std::unique_ptr<Gate> gate_;
  std::unique_ptr<FakeBalancedGate> fake_gate_;
  std::unique_ptr<GroupedExperts> experts_;
  std::unique_ptr<SharedExperts> shared_;
};

}  // namespace flexep
