// Grouped experts on one GPU: the CUDA counterpart of GroupedExperts (grouped_experts.h), same
// constructor arguments, parameter names and shapes, forward and backward. For row n of expert e
// with prob p:
//   h = x W_gu[e];  a_p = act(h + b_gu[e]) * p;  y = a_p W_down[e] + b_down[e] * p
// or, with moe.apply_router_weight_after_down (Automodel's order and roundings):
//   a = act(h + b_gu[e]);  u = bf16(bf16(a W_down[e]) + b_down[e]);  y = bf16(u * p)
// Parameters are bf16 device tensors; how backward delivers their gradients is the GradMode below.
// Tokens and grad_out are bf16, probs f32; all on `device`.
// Blocking mode: tokens_per_expert is on the host. Rows past sum(tokens_per_expert) produce zero
// output and zero gradients. Built only with CUDA.
//
// Streams: forward/backward are asynchronous on the given stream; each saved tensor is freed on the
// stream it was made on (cuda/runtime.h), so a backward on another stream must be joined back to the
// forward's before the saved state is dropped (several calls may read one tensor, the layer's x: only
// the stream that made it is ordered after all of them). Backward must be ordered after its forward
// (same stream, or joined). Parameters are allocated at construction on the legacy default
// stream (construction synchronises it); release the module only when its work is done.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "flexep/core/activation.h"
#include "flexep/core/config.h"
#include "flexep/core/tensor.h"
#include "flexep/layer/moe_weights.h"

namespace flexep {

class GroupedExperts;
class CudaGroupedExpertsCompute;

// Which kernel runs backward's two data-gradient GEMMs (dh W_gu^T and dy W_down^T) where its shapes
// allow: cuBLAS (grouped_gemm_dgrad, per-expert GEMMs) or flexep's Hopper grouped GEMM reading the
// weights transposed (gather_gemm.h, GatherGemmBLayout::m_by_k; the group sizes stay on the device).
// Process-wide, for measuring both in one run (flexep bench experts / layer); docs/experts.md says
// which is faster where.
enum class ExpertDgrad { cublas, gather_gemm };
void set_expert_dgrad(ExpertDgrad kernel);
ExpertDgrad expert_dgrad();

// Which kernel runs backward's two weight-gradient GEMMs (x^T dh and a^T dy per expert): cuBLAS
// (per-expert GEMMs for f32 gradients, a grouped call for bf16 ones; in-place rows are first gathered
// into a copy) or flexep's Hopper kernel (wgrad_gemm.h: one persistent launch for all experts,
// reading in-place rows through their table). Process-wide, as ExpertDgrad.
enum class ExpertWgrad { cublas, wgrad_gemm };
void set_expert_wgrad(ExpertWgrad kernel);
ExpertWgrad expert_wgrad();

// Where backward puts the parameter gradients (Parameter::grad), fixed at construction.
enum class GradMode {
  // f32 buffers owned by the module: allocated zero on the first backward, then every backward adds
  // to them; zero_grad clears them (lazily for the two weight gradients, see zero_grad). Callers
  // that keep a gradient past the next backward must copy it.
  accumulate_f32,
  // Every backward hands over new tensors: it replaces each p.grad with a tensor allocated for this
  // backward alone and holding its gradient only (never a sum with earlier ones); the module writes
  // such a tensor inside that backward and never afterwards. So a caller may keep it (zero-copy, no
  // copy before the next backward) and accumulate micro-batches itself, as PyTorch's autograd does.
  // Weight gradients (gate_and_up_projs, down_projs) are bf16, the parameters' dtype, written by
  // grouped_gemm_wgrad_bf16 (fp32 sums, one rounding; experts without rows get exact zeros): no f32
  // buffer and no conversion pass for the big tensors. Bias gradients stay f32 (new zero tensors the
  // bias kernels add to in f32; they are small): callers convert them if they need bf16.
  fresh_bf16_weights,
};

// What backward needs (device tensors, covering only the rows of an expert).
struct CudaExpertsSaved {
  const CudaGroupedExpertsCompute* owner = nullptr;
  std::vector<std::int64_t> tokens_per_expert;
  std::int64_t rows = 0;    // N, including the ignored tail
  std::int64_t active = 0;  // sum(tokens_per_expert)
  Tensor x;                 // [>= active, dim] bf16: the caller's tokens (Tensor overload) or a copy;
                            // gathered forward: the source rows, read through row_ids
  Tensor row_ids;           // gathered forward only: [>= active] int32, the source row of each row
  Tensor p;                 // [active] f32
  Tensor offsets;           // [E + 1] i64, row -> expert
  Tensor h;                 // [active, up] bf16, x W_gu before the bias
  Tensor ap;                // [active, inter] bf16, act(h + b) * p (after-down: act(h + b))
  Tensor u;                 // [active, dim] bf16, after-down only: the expert rows before the prob
  CudaExpertsSaved() = default;
  CudaExpertsSaved(const CudaExpertsSaved&) = delete;
  CudaExpertsSaved& operator=(const CudaExpertsSaved&) = delete;
};

struct CudaExpertsOutput {
  Tensor out;  // [N, dim] bf16
  std::shared_ptr<const CudaExpertsSaved> saved;
};

struct CudaExpertsGrads {
  Tensor tokens;  // [N, dim] bf16
  Tensor probs;   // [N] f32
};

// Where CudaGroupedExpertsCompute::backward writes the weight gradients; undefined members are not
// computed. The weight gradients (gate_and_up_projs, down_projs) are bf16 (written by
// grouped_gemm_wgrad_bf16: fp32 sums, one rounding; experts without rows get exact zeros) or f32
// (added to when accumulate_weights, else overwritten: no zero fill needed). bf16 ones are added to
// only when add_to_bf16_weights (in bf16, one rounding per call, on cuBLAS: how the chunks of one
// backward add up). The bias gradients are f32 and always added to (zero them for a fresh gradient).
struct CudaExpertGradTargets {
  TensorView gate_and_up_projs, down_projs;
  TensorView gate_up_proj_bias, down_proj_bias;
  bool accumulate_weights = true;
  bool add_to_bf16_weights = false;
};

// The grouped experts on one GPU as a function of weights given per call (what CudaMoECompute runs;
// CudaGroupedExperts below calls it with its own parameters). Holds sizes, the activation and the
// device only. Streams and the saved state as described above.
class CudaGroupedExpertsCompute {
 public:
  // `name` prefixes the weights' names in errors ("experts." or "shared_experts.").
  CudaGroupedExpertsCompute(const MoEConfig& config, int num_local_experts, int device,
                            std::string name = "experts.");

  // weights: bf16 on `device`, the shapes of CudaGroupedExperts' parameters, biases given iff
  // moe.expert_bias. tokens, probs, tokens_per_expert and the two overloads as CudaGroupedExperts'.
  CudaExpertsOutput forward(const ExpertWeights& weights, const TensorView& tokens, const TensorView& probs,
                            const std::vector<std::int64_t>& tokens_per_expert, cudaStream_t stream) const;
  CudaExpertsOutput forward(const ExpertWeights& weights, const Tensor& tokens, const TensorView& probs,
                            const std::vector<std::int64_t>& tokens_per_expert, cudaStream_t stream) const;
  // The same experts on rows read in place (gather_gemm.h): row i of the expert-major input is
  // source[row_ids[i]], a zero row where row_ids[i] is -1. source [R, dim] bf16, row_ids [N] int32 and
  // probs [N] f32 on `device`. No permuted copy is made; backward keeps references to source and
  // row_ids (do not modify them before backward) and gathers the rows the weight gradient needs then.
  // Same outputs and gradients as forward() on the gathered rows, up to the GEMMs' summation order.
  CudaExpertsOutput forward_gathered(const ExpertWeights& weights, const Tensor& source, const Tensor& row_ids,
                                     const TensorView& probs, const std::vector<std::int64_t>& tokens_per_expert,
                                     cudaStream_t stream) const;
  // grad_out [N, dim] bf16 -> grads of tokens and probs; the weight gradients go to `targets`.
  // `weights` hold the forward's values (they need not be the same tensors).
  CudaExpertsGrads backward(const ExpertWeights& weights, const CudaExpertsOutput& forward_output,
                            const TensorView& grad_out, const CudaExpertGradTargets& targets,
                            cudaStream_t stream) const;

  int num_local_experts() const { return local_; }
  int device() const { return device_; }
  const ActivationParams& activation() const { return act_; }

 private:
  // row_ids undefined: tokens are the expert-major rows; defined: the source rows of a gathered forward.
  CudaExpertsOutput forward_impl(const ExpertWeights& weights, const TensorView& tokens, const Tensor* keep,
                                 const Tensor* row_ids, const TensorView& probs,
                                 const std::vector<std::int64_t>& tokens_per_expert, cudaStream_t stream) const;
  void check_weights(const ExpertWeights& weights) const;
  void check_targets(const ExpertWeights& weights, const CudaExpertGradTargets& targets) const;
  MoEConfig config_;
  int local_, device_;
  std::string name_;
  ActivationParams act_;
};

class CudaGroupedExperts {
 public:
  // Like GroupedExperts (first_expert = global id of local expert 0), on CUDA device `device`.
  // moe.dtype must be bf16. Parameters start at zero.
  CudaGroupedExperts(const MoEConfig& config, int num_local_experts, int first_expert, int device,
                     GradMode grad_mode = GradMode::accumulate_f32);

  // Draws exactly the numbers GroupedExperts::init draws (same streams and offsets, in f32), rounds
  // them to bf16 and uploads them; biases zero. Blocking.
  void init(std::uint64_t seed, double init_std, cudaStream_t stream);
  // Uploads the values of a CPU module of the same shape (rounded to bf16). Blocking.
  void load_from(GroupedExperts& cpu, cudaStream_t stream);
  // Writes the (bf16) values into a CPU module of the same shape. Blocking.
  void copy_values_to(GroupedExperts& cpu, cudaStream_t stream);

  // tokens [N, dim] bf16, probs [N] f32, tokens_per_expert: one count per local expert, sum <= N.
  // The TensorView overload copies the active token rows for backward; the Tensor overload keeps a
  // reference instead (do not modify the tokens before backward).
  CudaExpertsOutput forward(const TensorView& tokens, const TensorView& probs,
                            const std::vector<std::int64_t>& tokens_per_expert, cudaStream_t stream);
  CudaExpertsOutput forward(const Tensor& tokens, const TensorView& probs,
                            const std::vector<std::int64_t>& tokens_per_expert, cudaStream_t stream);
  // Rows read in place through row_ids (CudaGroupedExpertsCompute::forward_gathered).
  CudaExpertsOutput forward_gathered(const Tensor& source, const Tensor& row_ids, const TensorView& probs,
                                     const std::vector<std::int64_t>& tokens_per_expert, cudaStream_t stream);
  // grad_out [N, dim] bf16. Accumulates the parameter grads (accumulate_f32) or replaces them with
  // new tensors (fresh_bf16_weights); returns grads of tokens and probs. The new tensors are
  // allocated on `stream`.
  CudaExpertsGrads backward(const CudaExpertsOutput& forward_output, const TensorView& grad_out,
                            cudaStream_t stream);
  // accumulate_f32: zeroes the gradients. The two weight gradients are not filled: they are marked,
  // and the next backward overwrites them instead of accumulating (saving a fill and a read of GBs).
  // Call materialize_grads before reading gradients that no backward has written since the
  // zero_grad. fresh_bf16_weights: releases the module's references (every p.grad becomes
  // undefined) without writing the tensors, which belong to whoever holds them; materialize_grads
  // does nothing.
  void zero_grad(cudaStream_t stream);
  void materialize_grads(cudaStream_t stream);

  Parameter& gate_and_up_projs() { return gate_and_up_; }  // [E_local, dim, up_dim]
  Parameter& down_projs() { return down_; }                // [E_local, inter, dim]
  Parameter& gate_up_proj_bias() { return gate_up_bias_; }  // [E_local, up_dim]; undefined without expert_bias
  Parameter& down_proj_bias() { return down_bias_; }        // [E_local, dim]; undefined without expert_bias
  std::vector<Parameter*> parameters();
  ExpertWeights weights() const;  // views of the values above
  // What the next backward writes, per grad_mode: fresh_bf16_weights renews every p.grad (allocated on
  // `stream`); accumulate_f32 allocates missing buffers and overwrites the weight gradients once after
  // a zero_grad. backward calls this; an owner that runs CudaGroupedExpertsCompute itself calls it
  // once per backward instead.
  CudaExpertGradTargets grad_targets(cudaStream_t stream);
  const CudaGroupedExpertsCompute& compute() const { return compute_; }
  int num_local_experts() const { return local_; }
  int first_expert() const { return first_; }
  int device() const { return device_; }
  const ActivationParams& activation() const { return compute_.activation(); }
  GradMode grad_mode() const { return grad_mode_; }

 private:
  void renew_grads();

  MoEConfig config_;
  int local_, first_, device_;
  GradMode grad_mode_;
  CudaGroupedExpertsCompute compute_;
  Parameter gate_and_up_, down_, gate_up_bias_, down_bias_;
  bool weight_grads_stale_ = false;  // zero_grad ran; the weight grads hold stale values until backward
};

}  // namespace flexep
