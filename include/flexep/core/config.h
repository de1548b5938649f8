// Configuration, mirroring NeMo Automodel's BackendConfig and MoEConfig field by field (names,
// defaults and normalisation rules), so a config written for Automodel means the same here.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "flexep/core/dtype.h"

namespace flexep {

// Communication backend of the token dispatcher. `torch` (Automodel's name) is our `alltoall`.
enum class DispatcherKind { host, alltoall, deepep, hybridep };
// Expert GEMM implementation. On our side every value runs our grouped experts; the value is kept
// for Automodel compatibility and drives the normalisation rules.
enum class ExpertsKind { torch, torch_mm, gmm, te };
enum class ScoreFunc { softmax, softmax_with_bias, sigmoid, sigmoid_with_bias, sqrtsoftplus };
enum class Activation { swiglu, swigluoai, quick_geglu, geglu, relu2 };
// How group-limited routing excludes the dropped groups (flexep's own field). `automodel`: as
// Automodel 0.7.0 does per score function (softmax_with_bias and sigmoid multiply the dropped
// scores by 0, sigmoid_with_bias sets them to -inf); `neg_inf`: -inf for every score function, as
// HF transformers' DeepSeek-V3 and Megatron-LM do.
enum class GroupMask { automodel, neg_inf };

std::string_view to_string(DispatcherKind k);
std::string_view to_string(ExpertsKind k);
std::string_view to_string(ScoreFunc k);
std::string_view to_string(Activation k);
std::string_view to_string(GroupMask k);
// Parsers throw ArgumentError naming `arg` and listing the allowed values.
DispatcherKind parse_dispatcher(std::string_view s, const std::string& arg = "backend.dispatcher");
ExpertsKind parse_experts(std::string_view s, const std::string& arg = "backend.experts");
ScoreFunc parse_score_func(std::string_view s, const std::string& arg = "moe.score_func");
Activation parse_activation(std::string_view s, const std::string& arg = "moe.expert_activation");
GroupMask parse_group_mask(std::string_view s, const std::string& arg = "moe.group_mask");

// True for the dispatchers Automodel calls "EP dispatchers" (deepep, hybridep).
inline bool is_ep_dispatcher(DispatcherKind k) { return k == DispatcherKind::deepep || k == DispatcherKind::hybridep; }

struct BackendConfig {
  DispatcherKind dispatcher = DispatcherKind::host;
  ExpertsKind experts = ExpertsKind::torch_mm;
  // 0 = the backend's own default (hybridep: the process-wide count of set_hybridep_num_sms, 20
  // unless changed; alltoall and host use no SM count).
  int dispatcher_num_sms = 20;
  // Per-backend and per-phase SM counts; 0 means "use dispatcher_num_sms".
  int deepep_num_sms = 0;
  int hybridep_num_sms = 0;
  int hybridep_dispatch_sms = 0;
  int hybridep_combine_sms = 0;
  int hybridep_preprocess_sms = 0;
  bool fake_balanced_gate = false;
  double fake_gate_noise = 0.0;  // finite, >= 0 (Automodel documents [0, 1] but takes any value)
  // Precision of the router (logits, softmax/sigmoid): f32 or f64; nullopt = input dtype.
  std::optional<DType> gate_precision;
  // The GPU layer's routed experts read the tokens in place through the dispatch's row table instead
  // of a permuted copy (docs/experts.md): ~470 MB less kept for backward per DeepSeek-V3 layer, ~1 ms
  // slower today. One GPU only (EP size 1: normalize turns it off otherwise, with a message); the CPU
  // layers compute on copied rows either way.
  bool rows_in_place = false;
  // Splits each rank's tokens into this many chunks, each dispatched, computed and combined by its
  // own dispatcher (the layer makes the others as siblings of the one it is given), in a pipeline
  // on the GPU layer: one chunk's communication runs while another's expert GEMMs do. 1 = no split.
  // The CPU layers split the same way, one chunk after another (the same results).
  int dispatch_chunks = 1;

  // Effective SM counts after the fallbacks above.
  int dispatch_sms() const;
  int combine_sms() const;
  int preprocess_sms() const;
};

struct MoEConfig {
  int n_routed_experts = 16;
  int n_shared_experts = 0;
  int n_activated_experts = 4;
  int n_expert_groups = 1;
  int n_limited_groups = 1;
  bool train_gate = true;
  double gate_bias_update_factor = 0.0;
  double aux_loss_coeff = 0.0;
  ScoreFunc score_func = ScoreFunc::softmax;
  double route_scale = 1.0;
  int dim = 64;
  int inter_dim = 128;
  int moe_inter_dim = 64;
  bool norm_topk_prob = false;
  bool router_bias = false;
  bool expert_bias = false;
  Activation expert_activation = Activation::swiglu;
  // Routing prob applied to the expert output row after the down projection (in fp32) instead of
  // inside the FFN.
  bool apply_router_weight_after_down = false;
  double activation_alpha = 1.702;
  double activation_limit = 7.0;
  // > 0: swiglu (routed and shared experts) clamps gate <= limit and up to [-limit, limit], in fp32.
  double swiglu_limit = 0.0;
  bool softmax_before_topk = false;
  // The gate's weights leave in fp32; otherwise they are rounded to the input dtype.
  bool router_weights_fp32 = false;
  // sigmoid only: weights (and original scores) gathered from the scores plus the correction bias.
  bool router_weight_uses_score_correction_bias = false;
  bool shared_expert_gate = false;
  int shared_expert_inter_dim = 0;  // 0 = use moe_inter_dim
  Activation shared_expert_activation = Activation::swiglu;
  bool force_e_score_correction_bias = false;
  DType dtype = DType::bf16;  // parameter dtype on the GPU path
  // Storage dtype of the gate weight and bias; nullopt = dtype.
  std::optional<DType> gate_dtype;
  // Automodel's latent projection size; 0 = none (JSON null). When set, the routed experts work in
  // this width: x is projected dim -> latent (fc1_latent_proj) before dispatch and the combined
  // output latent -> dim (fc2_latent_proj) after it; the router and the shared experts read x.
  int moe_latent_size = 0;
  // Rollout routing replay: the gates accept forced expert indices (Gate::forward, replay_indices).
  bool enable_routing_replay = false;
  GroupMask group_mask = GroupMask::automodel;

  bool has_correction_bias() const { return gate_bias_update_factor > 0 || force_e_score_correction_bias; }
  bool grouped_routing() const { return n_expert_groups > 1; }
  // Group limiting acts: groups > 1 under a score function that has it (softmax and sqrtsoftplus
  // ignore the groups, as Automodel's branches do).
  bool group_limited() const {
    return grouped_routing() && (score_func == ScoreFunc::softmax_with_bias || score_func == ScoreFunc::sigmoid ||
                                 score_func == ScoreFunc::sigmoid_with_bias);
  }
  // Group score: the sum of its top-2 selection scores, except plain sigmoid without a correction
  // bias (its max).
  bool top2_group_score() const { return score_func != ScoreFunc::sigmoid || has_correction_bias(); }
  // Dropped groups become -inf (else their scores are multiplied by 0).
  bool group_mask_neg_inf() const {
    return group_mask == GroupMask::neg_inf || score_func == ScoreFunc::sigmoid_with_bias;
  }
  DType gate_storage_dtype() const { return gate_dtype ? *gate_dtype : dtype; }
  bool latent() const { return moe_latent_size > 0; }
  // The width the routed experts and the dispatcher see: the latent size when set, else dim.
  int expert_dim() const { return latent() ? moe_latent_size : dim; }
  // This configuration as the routed experts see it (dim = expert_dim()).
  MoEConfig routed_expert_config() const {
    MoEConfig c = *this;
    c.dim = expert_dim();
    c.moe_latent_size = 0;
    return c;
  }
  // Columns of gate_and_up_projs: 2*moe_inter_dim for gated activations, moe_inter_dim for relu2.
  int up_dim() const { return expert_activation == Activation::relu2 ? moe_inter_dim : 2 * moe_inter_dim; }
  int shared_inter() const {
    return n_shared_experts * (shared_expert_inter_dim > 0 ? shared_expert_inter_dim : moe_inter_dim);
  }
};

// Throws ArgumentError naming the first invalid field ("moe.n_activated_experts") and its range.
void validate(const BackendConfig& c);
void validate(const MoEConfig& c);
// Checks what depends on the expert-parallel size (E divisible by ep_size).
void validate_ep(const MoEConfig& c, int ep_size);

// Automodel's silent rewrites, made visible: returns one message per change (callers log them).
// - te/gmm experts without an EP dispatcher become torch_mm (and a deepep/hybridep-less
//   dispatcher stays as it is);
// - EP size 1 with an EP dispatcher falls back to the local path (`local_fallback` set);
// - rows_in_place with EP size > 1 is turned off unless the dispatcher is deepep (the experts take
//   the dispatcher's rows).
struct Normalization {
  std::vector<std::string> messages;
  bool local_fallback = false;
};
Normalization normalize(BackendConfig& c, int ep_size);

}  // namespace flexep
