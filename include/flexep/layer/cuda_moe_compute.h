// The MoE layer on GPUs as a function of weights given per call (docs/python.md, "Who owns what"): the CUDA counterpart of
// MoECompute (moe_compute.h), same configuration, weights (MoEWeights) and results, for one rank of an
// expert-parallel group (EP size 1: the single-GPU dispatcher; larger: any GPU TokenDispatcher).
//
//   weights, indices = router(x)                   (cuda/router.h, or a routing override; padding gets -1)
//   rows = dispatch(x, indices, weights)          (expert-major on the owning ranks)
//   y_rows = experts(rows)                         (CudaGroupedExpertsCompute, prob inside the FFN)
//   y = combine(y_rows) + shared_experts(x)       (shared experts on a second stream, joined at the end)
// With moe.moe_latent_size the routed path is wrapped by Automodel's latent projections: rows are
// dispatched from fc1_latent_proj(x) and y = fc2_latent_proj(combine(y_rows)) + shared_experts(x).
// With backend.dispatch_chunks > 1 the routed path runs on chunks of rows, each through its own
// dispatcher, in a pipeline: the experts of chunk c on a second stream while the caller's stream
// dispatches chunk c + 1 and combines chunk c - 1 (backward: combine_backward of c + 1 and
// dispatch_backward of c - 1 under the experts' backward of c).
//
// The object holds the configuration, the dispatcher, a side stream, events and one routing cache
// (the fake balanced gate without noise), never a weight: every call reads the weights it is given,
// the saved state holds activations and dispatch handles only, and backward returns fresh gradients
// for exactly the weights it was given. CudaMoELayer (cuda_moe_layer.h) is the owner type built on it.
//
// Dtypes: x and grad_out bf16; expert and shared-expert weights and shared_expert_gate.weight bf16;
// gate.weight bf16; gate.bias bf16 or f32; gate.e_score_correction_bias f32; all on the device.
// Gradients come back in each weight's dtype: the expert weights' from the bf16 wgrad GEMMs (fp32
// sums, one rounding), the small ones (gate, biases, shared gate) summed in f32 and rounded once.
// Blocking dispatch mode (tokens_per_expert on the host: the grouped GEMMs take host sizes). The
// shared experts run as a one-expert grouped layer whose prob is the sigmoid gate (or 1): the same
// math as Automodel's MLP, since sigmoid(g) * (a W_d + b_d) = (a * s) W_d + b_d * s.
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "flexep/dispatch/dispatcher.h"
#include "flexep/layer/cuda_grouped_experts.h"
#include "flexep/layer/moe_compute.h"
#include "flexep/layer/moe_weights.h"

namespace flexep {

struct CudaMoESaved;  // activations and dispatch handles for backward; no weights

struct CudaMoEOutput {
  Tensor out;          // [T, dim] bf16
  Tensor aux_loss;     // [1] (f32 or f64) on the device; undefined unless training with aux_loss_coeff > 0
  Tensor expert_load;  // [E] i64 on the device: (unmasked token, slot) pairs per expert
  Tensor indices;      // [T, k] i64 on the device: the router's selection (padding tokens included)
  Tensor weights;      // [T, k] f32 on the device: the routing weights, as the experts use them
  std::shared_ptr<const CudaMoESaved> saved;
};

// Time of each phase of the last forward/backward, in microseconds (filled when timing is on).
struct CudaMoEPhaseTimes {
  double router = 0, dispatch = 0, experts = 0, combine = 0, shared = 0;
};

// An nn.Linear's gradient targets: weight [out, in] and bias [out], f32, added to.
struct CudaLinearGradTargets {
  TensorView weight, bias;
};

// Where backward_into writes the gradients; undefined members are not computed. gate_weight,
// gate_bias, shared_expert_gate and the latent projections' are f32 and added to; the experts' as
// CudaExpertGradTargets says.
struct CudaMoEGradTargets {
  TensorView gate_weight, gate_bias, shared_expert_gate;
  CudaExpertGradTargets experts, shared_experts;
  CudaLinearGradTargets fc1_latent_proj, fc2_latent_proj;
};

class CudaMoECompute {
 public:
  CudaMoECompute(const MoEConfig& config, const BackendConfig& backend, std::shared_ptr<TokenDispatcher> dispatcher,
                 int device, const DispatchOptions& dispatch = {});
  ~CudaMoECompute();
  CudaMoECompute(const CudaMoECompute&) = delete;
  CudaMoECompute& operator=(const CudaMoECompute&) = delete;

  // The weights forward and backward take (names, shapes on this rank, requires_grad).
  std::vector<MoEWeightSpec> weight_specs() const;

  // x [T, dim] bf16 on the device; padding_mask [T] bool on the device or undefined; routing: see
  // RoutingOverride (indices i64 and weights f32 on the device). Asynchronous on `stream` except for
  // the dispatcher's layout sync and the fake gate with noise (reads 4 values of x). Collective.
  CudaMoEOutput forward(const MoEWeights& weights, const TensorView& x, const TensorView& padding_mask, bool training,
                        const RoutingOverride& routing, cudaStream_t stream);
  // grad_out [T, dim] bf16. Fresh gradients (allocated on `stream`) for every given weight that
  // requires one; gate.* only with moe.train_gate and without a routing override. aux_loss_scale:
  // MoEAuxLossAutoScaler.main_loss_backward_scale. Collective.
  MoEBackward backward(const MoEWeights& weights, const CudaMoESaved& saved, const TensorView& grad_out,
                       double aux_loss_scale, cudaStream_t stream);
  // The same backward into the caller's gradient buffers (owners with persistent gradients); returns
  // grad x. The targets must stay alive until the stream has run the backward.
  Tensor backward_into(const MoEWeights& weights, const CudaMoESaved& saved, const TensorView& grad_out,
                       double aux_loss_scale, const CudaMoEGradTargets& targets, cudaStream_t stream);

  void set_timing(bool on) { timing_ = on; }
  // Whether the routed experts read their rows in place through the dispatch's row table
  // (docs/experts.md), where the dispatcher can (one GPU: the tokens themselves; deepep in blocking
  // mode: its received rank-major rows) and the sizes allow: about 470 MB less kept for backward at
  // the DeepSeek-V3-like shape on one GPU, but the layer is ~1 ms slower there today, so it is off
  // unless BackendConfig::rows_in_place asks for it. Off: the dispatcher copies the rows and the
  // experts keep the copy.
  bool rows_in_place() const { return rows_in_place_; }
  void set_rows_in_place(bool on) { rows_in_place_ = on && rows_in_place_supported_; }
  // What reading in place needs, for the messages of those who ask for it.
  static std::string rows_in_place_requirements();
  const CudaMoEPhaseTimes& phase_times() const { return times_; }
  const MoEConfig& config() const { return config_; }
  const BackendConfig& backend_config() const { return backend_; }
  int device() const { return device_; }
  int ep_rank() const { return ep_rank_; }
  int ep_size() const { return ep_size_; }
  int num_local_experts() const { return config_.n_routed_experts / ep_size_; }

 private:
  struct Events;
  void check_weights(const MoEWeights& weights, bool routing_override) const;
  // The routed path, dispatch to combine, chunk by chunk: returns y [T, width]. `source` owns
  // `hidden` (the experts' rows in place on one GPU are read from it).
  Tensor forward_routed(const MoEWeights& w, const TensorView& hidden, const Tensor& source, CudaMoESaved& s,
                        cudaStream_t stream);
  // Its backward, combine_backward to dispatch_backward: grads of hidden and of the routing weights.
  DispatchGrads backward_routed(const MoEWeights& w, const CudaMoESaved& s, const TensorView& grad,
                                const CudaExpertGradTargets& targets, cudaStream_t stream);
  // The stream chunk `c`'s experts run on: `stream` for one chunk, else the experts' stream, made
  // to wait for what `stream` has queued so far (the chunk's rows).
  cudaStream_t hand_over_to_experts(int c, cudaStream_t stream);
  MoEConfig config_;
  BackendConfig backend_;
  DispatchOptions dispatch_;
  bool rows_in_place_supported_ = false;
  bool in_place_rows_are_x_ = false;  // the single-GPU dispatcher's in-place rows are the layer's input
  bool rows_in_place_ = false;  // the experts read the tokens through the dispatch's row table
  int device_;
  std::shared_ptr<TokenDispatcher> dispatcher_;
  // One per chunk (backend.dispatch_chunks): dispatcher_ first, then siblings of it.
  std::vector<std::shared_ptr<TokenDispatcher>> chunk_dispatchers_;
  cudaStream_t expert_stream_ = nullptr;  // the chunks' experts (dispatch_chunks > 1)
  int ep_rank_ = 0, ep_size_ = 1;
  std::optional<CudaGroupedExpertsCompute> experts_, shared_;
  // The fake balanced gate without noise routes by the token index alone: its routing for the last
  // T and stream, on the device, reused while both stay the same (every use is then ordered on that
  // stream, and the memory is freed there).
  struct FixedFakeRouting {
    std::int64_t tokens = -1;
    cudaStream_t stream = nullptr;
    Tensor indices, weights;
  } fixed_fake_;
  cudaStream_t side_stream_ = nullptr;
  bool timing_ = false;
  CudaMoEPhaseTimes times_;
  std::unique_ptr<Events> events_;
};

}  // namespace flexep
