// The whole MoE layer (Automodel's MoE) as a function of weights given per call, CPU reference, for
// one rank of an expert-parallel group (the caller owns the parameters: docs/python.md, "Who owns what"):
//   weights, indices = gate(x, ~padding)           (or a routing override; padding gets index -1)
//   rows = dispatch(x, indices, weights)          (expert-major on the owning ranks)
//   y_rows = experts(rows)                         (prob applied inside the FFN)
//   y = combine(y_rows) (+ shared_experts(x))
// With moe.moe_latent_size, Automodel's latent projections wrap the routed path: rows are
// dispatched from fc1_latent_proj(x) and y = fc2_latent_proj(combine(y_rows)) (+ shared_experts(x)).
// The object holds the configuration and the dispatcher, never a weight: forward and backward read
// the MoEWeights (moe_weights.h) they are given during the call, the saved state holds activations
// only, and backward returns fresh gradients for exactly the weights it was given. MoELayer
// (moe_layer.h) is the owner type built on it.
//
// Precision: the layer computes in f64 when x is f64, else in f32. x may be f32, f64 or bf16; every
// weight any float dtype (bf16, f16, f32, f64), converted to the compute dtype for the call. The
// gate reads x and its weights as given and rounds where Automodel's Gate rounds (the logits of a
// bf16 linear, weights cast to x's dtype unless moe.router_weights_fp32; gate.h); the correction
// bias is rounded to f32, its dtype in Automodel. The output and grad x come back in x's dtype, each gradient in its
// weight's dtype. The shared experts take the grouped one-expert layout (moe_weights.h) and compute
// Automodel's MLP formula (SharedExperts) on it.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "flexep/dispatch/dispatcher.h"
#include "flexep/layer/gate.h"
#include "flexep/layer/grouped_experts.h"
#include "flexep/layer/moe_weights.h"
#include "flexep/layer/shared_experts.h"

namespace flexep {

struct MoESaved;  // activations and dispatch handles for backward; no weights

struct MoEOutput {
  Tensor out;                      // [T, dim], x's dtype
  std::optional<double> aux_loss;  // unscaled aux loss of this rank's tokens (training, aux_loss_coeff > 0)
  Tensor expert_load;              // [E] i64: (unmasked token, slot) pairs per expert (Gate._compute_expert_load)
  Tensor indices;                  // [T, k] i64: the router's selection (padding tokens included, as
                                   // Automodel's Gate returns it; they are masked before dispatch)
  Tensor weights;                  // [T, k]: the routing weights, as the experts use them
  std::shared_ptr<const MoESaved> saved;
};

// Replaces the router's decision for one call. Both given (e.g. a fake gate whose noise comes from
// the caller's RNG): indices [T, k] i64 (global expert ids, -1 for none), weights [T, k] f32,
// k = moe.n_activated_experts, on the layer's device; padding tokens are still masked; no router
// backward and no aux loss; the gate weights are not read and get no gradient. Indices alone
// (routing replay, moe.enable_routing_replay): the router runs but takes this selection instead of
// its top-k and gathers its weights there, with its backward (Automodel's replay_selection).
// Neither: the router runs.
struct RoutingOverride {
  TensorView indices;
  TensorView weights;
  bool given() const { return indices.defined() || weights.defined(); }
  bool replay() const { return indices.defined() && !weights.defined(); }
  bool replaces_router() const { return weights.defined(); }
};

struct MoEBackward {
  Tensor grad_x;  // [T, dim], x's dtype
  MoEGradients gradients;
};

class MoECompute {
 public:
  // `dispatcher` may be null only for ep size 1 (local path); ep rank and size come from it.
  MoECompute(const MoEConfig& config, const BackendConfig& backend, std::shared_ptr<TokenDispatcher> dispatcher,
             const DispatchOptions& dispatch = {});
  MoECompute(const MoECompute&) = delete;
  MoECompute& operator=(const MoECompute&) = delete;

  // The weights forward and backward take (names, shapes on this rank, requires_grad).
  std::vector<MoEWeightSpec> weight_specs() const;

  // x [T, dim]; padding_mask [T] bool (true = padding) or undefined. Collective over the EP group.
  MoEOutput forward(const MoEWeights& weights, const TensorView& x, const TensorView& padding_mask, bool training,
                    const RoutingOverride& routing = {});
  // grad_out [T, dim] in x's dtype. `weights` hold the forward's values (they may live elsewhere).
  // Returns a fresh gradient for every given weight that requires one (gate.* only with
  // moe.train_gate and without a routing override). aux_loss_scale:
  // MoEAuxLossAutoScaler.main_loss_backward_scale. Collective over the EP group.
  MoEBackward backward(const MoEWeights& weights, const MoESaved& saved, const TensorView& grad_out,
                       double aux_loss_scale = 1.0);

  // The gate reads x cast to this dtype (bf16 or f16) instead of x itself: how an f32 reference
  // routes like a bf16 layer (the CPU-against-GPU tests). Unset: x as given.
  void set_gate_input_dtype(std::optional<DType> dtype) { gate_input_dtype_ = dtype; }

  const MoEConfig& config() const { return config_; }
  const BackendConfig& backend_config() const { return backend_; }
  int ep_rank() const { return ep_rank_; }
  int ep_size() const { return ep_size_; }
  int num_local_experts() const { return config_.n_routed_experts / ep_size_; }

 private:
  void check_weights(const MoEWeights& weights, bool routing_override) const;
  MoEConfig config_;
  BackendConfig backend_;
  DispatchOptions dispatch_;
  std::shared_ptr<TokenDispatcher> dispatcher_;
  // One per chunk (backend.dispatch_chunks): dispatcher_ first, then its siblings.
  std::vector<std::shared_ptr<TokenDispatcher>> chunk_dispatchers_;
  int ep_rank_ = 0, ep_size_ = 1;
  std::optional<GateCompute> gate_;
  std::optional<FakeBalancedGate> fake_gate_;
  std::optional<GroupedExpertsCompute> experts_;
  std::optional<SharedExpertsCompute> shared_;
  std::optional<DType> gate_input_dtype_;
};

}  // namespace flexep
