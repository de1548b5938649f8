// The router (NeMo Automodel's Gate) on the GPU: logits by cuBLAS, then one warp per token for the
// scores, the selection and the weights, expert load by integer atomics, the aux loss by fixed-order
// reductions. It computes what the CPU reference Gate computes (include/flexep/layer/gate.h holds the
// formulas); the CPU Gate is its test oracle.
//
// Precision (backend.gate_precision), as Automodel's Gate.forward with bf16 x:
//   unset: logits = x W^T as a bf16 linear: W (and the bias) rounded to bf16 if stored in f32, fp32
//          accumulation, the logits (bias included) rounded to bf16; routing in fp32 from them.
//   f32:   x and W are cast to fp32 first and the GEMM is fp32 (pedantic: no TF32, no emulation);
//          the logits are not rounded.
//   f64:   x and W are cast to fp64, fp64 GEMM, and the routing runs in double end to end, except
//          sqrtsoftplus, which routes in fp32 from the f64 logits rounded to fp32 (logits.float()).
// The score dtype S (logits, scores, topk_scores, aux_loss, grad_logits) is f64 for f64 (f32 for
// sqrtsoftplus) and f32 otherwise. weights are always f32 tensors (what the dispatchers take),
// rounded from S, and hold bf16 values (Automodel's cast to x's dtype) unless
// moe.router_weights_fp32. Backward passes the roundings straight through (the derivative of the
// unrounded formulas at the rounded values).
//
// Score functions, group limiting (with moe.group_mask), router_weight_uses_score_correction_bias
// and routing replay follow include/flexep/layer/gate.h exactly.
//
// Limits: n_routed_experts <= 512 (kMaxExperts: one warp holds a token's scores, 16 per lane) and
// n_activated_experts <= 32 (one slot per lane). NaN logits give NaN scores; a NaN never displaces a
// real number in the selection (as on the CPU).
//
// Streams: every function enqueues on `stream` and never synchronises; allocations are ordered on
// `stream` (cuda::StreamGuard), so the outputs may be used on `stream` right away. Device errors are
// impossible here: every index the kernels use is computed, never read from user data unchecked.
#pragma once

#include <cuda_runtime.h>

#include <optional>

#include "flexep/core/config.h"
#include "flexep/core/tensor.h"

namespace flexep::cuda {

inline constexpr int kRouterMaxExperts = 512;
inline constexpr int kRouterMaxTopK = 32;

struct RouterOutput {
  Tensor weights;      // [T, k] f32: final routing weights (normalised, times route_scale)
  Tensor indices;      // [T, k] int64: experts in descending selection-score order
  Tensor expert_load;  // [E] int64: (unmasked token, slot) pairs per expert
  Tensor aux_loss;     // [1] S, the unscaled L = sum_e f_e P_e; undefined unless training with coeff > 0

  // Saved for router_backward (and useful to callers).
  Tensor logits;          // [T, E] S, bias included, rounded as the scores saw them
  Tensor scores;          // [T, E] S: full softmax or sigmoid of the logits (original_scores, unnormalised)
  Tensor topk_scores;     // [T, k] S: the weights before normalisation and route_scale
  Tensor token_mask;      // [T] b8, a copy of the forward's mask; undefined = every token valid
  Tensor aux_f_over_ctx;  // [E] f64: f_e / Lctx, dL/d original_scores; undefined without aux loss
  Tensor score_offset;    // [E] f32: the correction bias when the original scores are biased
                          // (router_weight_uses_score_correction_bias), a copy; else undefined
  MoEConfig config;       // the configuration and precision the forward ran with
  std::optional<DType> gate_precision;
  std::int64_t tokens = 0;
};

// x [T, dim] bf16; weight [E, dim] bf16 or f32 (moe.gate_dtype float32); bias [E] bf16 or f32, given
// iff config.router_bias; correction_bias [E] f32, given iff config.has_correction_bias() (used for
// selection only, and ignored by plain softmax like the CPU gate); token_mask [T] b8 or undefined
// (every token valid); replay_indices [T, k] i64 or undefined: routing replay (needs
// moe.enable_routing_replay), the selection is taken from there instead of the top-k. Its ids are
// not validated here (that would need a host sync; CudaMoELayer checks them on the host first): an
// id outside [0, E) is passed on to `indices` with a NaN weight and no load, and a dispatcher reports
// it (and a repeated id) as an ArgumentError naming 'indices', except -1, which it takes as "no
// expert".
// All tensors on one CUDA device. The aux loss is computed when training && config.aux_loss_coeff > 0.
RouterOutput router_forward(const MoEConfig& config, std::optional<DType> gate_precision, const TensorView& x,
                            const TensorView& weight, const TensorView& bias, const TensorView& correction_bias,
                            const TensorView& token_mask, bool training, cudaStream_t stream,
                            const TensorView& replay_indices = TensorView());

struct RouterGrads {
  Tensor grad_x;       // [T, dim] bf16
  Tensor grad_logits;  // [T, E] S: dLoss/dlogits including the aux-loss term
};

// grad_weights [T, k] f32 -> grad_logits -> grad_x = grad_logits W (fp32 accumulation, rounded to
// bf16; W as the forward's linear used it, i.e. rounded to bf16 for the unset precision). grad_weight
// [E, dim] f32 (whatever the weight's dtype) += grad_logits^T x and grad_bias [E] f32 += column sums of
// grad_logits (a fixed-order reduction); either may be undefined to skip it (frozen gate), and
// grad_bias must be undefined when the forward ran without a bias. With an aux loss in `forward`,
// its gradient config.aux_loss_coeff * aux_loss_scale * dL (Automodel's MoEAuxLossAutoScaler) is
// added through the original scores, masked tokens excluded. x and weight must be the forward's.
//
// Unset precision: grad_logits (fp32) enter the bf16 GEMMs as an exact-to-2^-17 two-term bf16 split
// g = hi + lo, so grad_x and grad_weight keep fp32-level accuracy on the tensor cores.
RouterGrads router_backward(const RouterOutput& forward, const TensorView& grad_weights, const TensorView& x,
                            const TensorView& weight, const TensorView& grad_weight, const TensorView& grad_bias,
                            double aux_loss_scale, cudaStream_t stream);

}  // namespace flexep::cuda
