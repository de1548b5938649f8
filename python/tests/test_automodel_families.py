"""flexep.torch.MoE against NeMo Automodel 0.7.0's own MoE layer for the MoEConfig that each of
Automodel's MoE model families writes, at tiny sizes (dim 16, moe_inter_dim 8, 8 or 16 routed
experts, float32, CPU): outputs, the input's gradient and every parameter's gradient, on an input
with a padding mask.

Each entry of FAMILIES is the family's own MoEConfig (its ``moe_defaults`` or builder in
nemo_automodel/components/models/<family>/), field for field, with only the sizes made tiny;
FAMILY_BACKENDS holds the BackendConfig fields that reach the MoE layer which the family's code sets
(``gate_precision=float32`` where the model forces it). Where a family replaces parts of the layer
after building it (DeepSeek-V4/V4.1 vision or hash gates, Gemma4Gate, InklingGate and its
interleaved SwiGLU, Step-3.5's, HunyuanImage-3's and MiniMax-M3's shared experts kept outside the
MoE), what is compared is the layer that Automodel's ``MoE`` builds from that MoEConfig.

The latent-projection families (kimi_k3, and nemotron_v3 with a NemotronH config that sets
``moe_latent_size``) are compared like the others: their routed experts run in the latent width
between Automodel's fc1_latent_proj and fc2_latent_proj.

No family sets ``enable_routing_replay`` (it is a recipe switch, default False), needs TE-only
experts or the MoK dispatcher by default, so none is in that group for those reasons.

Not included: qwen3_5 (its MoEConfig has 0 experts; the dense backbone never builds a MoE layer).
"""

import zlib

import pytest
import torch

import flexep
import flexep.torch as ft
from automodel_pair import am_backend, am_config, assert_close_pair, pair
from nemo_automodel.components.moe.layers import MoE as AmMoE

F32 = torch.float32

# Paths below are relative to nemo_automodel/components/models/ of Automodel 0.7.0.
FAMILIES = {
    # deepseek_v3/model.py:147 (moe_defaults); backend gate_precision=fp32 at :321. DeepSeek-V3's
    # checkpoint: n_group 8, topk_group 4, routed_scaling_factor 2.5, norm_topk_prob True, 1 shared.
    # 16 experts so that 8 groups keep 2 experts each (the group score sums a top-2).
    "deepseek_v3": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=16, n_shared_experts=1, n_activated_experts=2,
        n_expert_groups=8, n_limited_groups=4, train_gate=True, gate_bias_update_factor=1e-3, score_func="sigmoid",
        route_scale=2.5, aux_loss_coeff=0, norm_topk_prob=True, router_weights_fp32=True, dtype=F32),
    # deepseek_v32/model.py:123 (its own moe_defaults, same as V3); gate_precision=fp32 at :230.
    # HF fields as DeepSeek-V3.2's checkpoint (n_group 8, topk_group 4, scaling 2.5, norm True).
    "deepseek_v32": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=16, n_shared_experts=1, n_activated_experts=2,
        n_expert_groups=8, n_limited_groups=4, train_gate=True, gate_bias_update_factor=1e-3, score_func="sigmoid",
        route_scale=2.5, aux_loss_coeff=0, norm_topk_prob=True, router_weights_fp32=True, dtype=F32),
    # deepseek_v4/model.py:590; inter_dim is moe_intermediate_size there. DeepseekV4Config defaults
    # (deepseek_v4/config.py:56-65): routed_scaling_factor 1.5, norm_topk_prob True, 1 shared,
    # swiglu_limit 10.0. The first num_hash_layers swap in DeepseekV4HashGate (model.py:240).
    "deepseek_v4": dict(
        dim=16, inter_dim=8, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
        n_expert_groups=0, n_limited_groups=0, train_gate=True, gate_bias_update_factor=1e-3,
        score_func="sqrtsoftplus", route_scale=1.5, aux_loss_coeff=0, norm_topk_prob=True, swiglu_limit=10.0,
        dtype=F32),
    # deepseek_v41/model.py:474; DeepseekV41 text config defaults (deepseek_v41/config.py:77-93):
    # routed_scaling_factor 1.5, norm_topk_prob True, 1 shared, swiglu_limit 10.0. The block swaps
    # in DeepseekV4VisionGate with an fp32 projection (model.py:123); the backend is left as given.
    "deepseek_v41": dict(
        dim=16, inter_dim=8, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
        n_expert_groups=0, n_limited_groups=0, train_gate=True, gate_bias_update_factor=0.0, aux_loss_coeff=0.0,
        score_func="sqrtsoftplus", route_scale=1.5, norm_topk_prob=True, router_weights_fp32=True,
        force_e_score_correction_bias=True, swiglu_limit=10.0, dtype=F32),
    # deepseek_v41/dspark.py:354 (the DSpark drafter's own MoEConfig): dspark_num_experts_per_tok 3
    # (config.py:122), so top-3 here; otherwise as deepseek_v41.
    "deepseek_v41_dspark": dict(
        dim=16, inter_dim=8, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=1, n_activated_experts=3,
        n_expert_groups=0, n_limited_groups=0, train_gate=True, gate_bias_update_factor=0.0, aux_loss_coeff=0.0,
        score_func="sqrtsoftplus", route_scale=1.5, norm_topk_prob=True, router_weights_fp32=True,
        force_e_score_correction_bias=True, swiglu_limit=10.0, dtype=F32),
    # diffusion_gemma/layers.py:217 (_build_moe_config); used inside Gemma4MoE (Gemma4Gate swapped in).
    "diffusion_gemma": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=0, n_activated_experts=2,
        n_expert_groups=0, n_limited_groups=0, train_gate=True, gate_bias_update_factor=0.0, score_func="softmax",
        route_scale=1.0, aux_loss_coeff=0.0, norm_topk_prob=True, expert_activation="geglu",
        softmax_before_topk=False, dtype=F32),
    # ernie4_5/model.py:341; gate_precision=fp32 at :335. Ernie4_5_MoeConfig defaults (= ERNIE-4.5
    # 21B-A3B): moe_num_shared_experts 2, router_aux_loss_coef 0.001, use_bias False.
    # shared_expert_inter_dim is moe_intermediate_size there.
    "ernie4_5": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=2, n_activated_experts=2,
        n_expert_groups=0, n_limited_groups=0, train_gate=True, gate_bias_update_factor=0.0,
        score_func="softmax_with_bias", route_scale=1.0, aux_loss_coeff=0.001, norm_topk_prob=True,
        expert_bias=False, router_bias=False, expert_activation="swiglu", softmax_before_topk=False,
        shared_expert_inter_dim=8, shared_expert_activation="swiglu", force_e_score_correction_bias=True,
        dtype=F32),
    # gemma4_moe/model.py:678 (moe_defaults); Gemma4MoE swaps in Gemma4Gate (model.py:295).
    "gemma4_moe": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=0, n_activated_experts=2,
        n_expert_groups=0, n_limited_groups=0, train_gate=True, gate_bias_update_factor=0.0, score_func="softmax",
        route_scale=1.0, aux_loss_coeff=0.0, norm_topk_prob=True, expert_activation="geglu",
        softmax_before_topk=False, dtype=F32),
    # glm4_moe/model.py:132; gate_precision=fp32 at :285. GLM-4.5's checkpoint: n_group 1,
    # topk_group 1, routed_scaling_factor 2.5, norm_topk_prob True, 1 shared.
    "glm4_moe": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
        n_expert_groups=1, n_limited_groups=1, train_gate=True, gate_bias_update_factor=1e-3, score_func="sigmoid",
        route_scale=2.5, aux_loss_coeff=0.0, norm_topk_prob=True, expert_bias=False, router_bias=False,
        expert_activation="swiglu", apply_router_weight_after_down=True, softmax_before_topk=False,
        router_weights_fp32=True, dtype=F32),
    # glm4_moe_lite/model.py:139; gate_precision=fp32 at :289. Glm4MoeLiteConfig defaults
    # (GLM-4.7-Flash): routed_scaling_factor 1.8, n_group 1, topk_group 1, norm_topk_prob True.
    "glm4_moe_lite": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
        n_expert_groups=1, n_limited_groups=1, train_gate=True, gate_bias_update_factor=1e-3, score_func="sigmoid",
        route_scale=1.8, aux_loss_coeff=0.0, norm_topk_prob=True, expert_bias=False, router_bias=False,
        expert_activation="swiglu", apply_router_weight_after_down=True, softmax_before_topk=False,
        router_weights_fp32=True, dtype=F32),
    # glm5_next/model.py:50 (build_glm5_next_moe_config); gate_precision=fp32 at :266.
    # Glm5NextTextConfig defaults (glm5_next/config.py:45-69): routed_scaling_factor 2.5, n_group 1,
    # norm_topk_prob True, swiglu_limit 10.0; shared_expert_inter_dim is moe_intermediate_size.
    "glm5_next": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
        n_expert_groups=1, n_limited_groups=1, train_gate=True, gate_bias_update_factor=1e-3,
        score_func="sigmoid_with_bias", route_scale=2.5, aux_loss_coeff=0.0, norm_topk_prob=True,
        router_bias=False, expert_bias=False, expert_activation="swiglu", apply_router_weight_after_down=True,
        swiglu_limit=10.0, softmax_before_topk=False, router_weights_fp32=True,
        router_weight_uses_score_correction_bias=False, shared_expert_gate=False, shared_expert_inter_dim=8,
        force_e_score_correction_bias=True, dtype=F32),
    # glm_moe_dsa/model.py:156; gate_precision=fp32 at :380. GlmMoeDsaConfig defaults (GLM-5):
    # routed_scaling_factor 2.5, n_group 1, norm_topk_prob True, 1 shared.
    "glm_moe_dsa": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
        n_expert_groups=1, n_limited_groups=1, train_gate=True, gate_bias_update_factor=1e-3, score_func="sigmoid",
        route_scale=2.5, aux_loss_coeff=0.0, norm_topk_prob=True, expert_bias=False, router_bias=False,
        expert_activation="swiglu", softmax_before_topk=False, router_weights_fp32=True, dtype=F32),
    # gpt_oss/model.py:114; inter_dim = moe_inter_dim = intermediate_size there. GptOssConfig:
    # router_aux_loss_coef 0.001 (HF default), swiglu_limit 7.0, no norm_topk_prob field (-> False).
    # The model's default backend only changes attn ("flex", model.py:263).
    "gpt_oss": dict(
        dim=16, inter_dim=8, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=0, n_activated_experts=2,
        n_expert_groups=0, n_limited_groups=0, train_gate=True, gate_bias_update_factor=0, score_func="softmax",
        route_scale=1.0, aux_loss_coeff=0.001, norm_topk_prob=False, expert_bias=True, router_bias=True,
        expert_activation="quick_geglu", activation_alpha=1.702, activation_limit=7.0, dtype=F32),
    # hunyuan_image3/model.py:87 (build_moe_config); the shared expert is the block's own
    # HunyuanSharedMLP (model.py:127), so n_shared_experts 0. HunyuanImage3Config defaults
    # (config.py:59-70): norm_topk_prob True, router_aux_loss_coef 0.0, mlp_bias False.
    "hunyuan_image3": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=0, n_activated_experts=2,
        n_expert_groups=0, n_limited_groups=0, train_gate=True, gate_bias_update_factor=0.0, score_func="softmax",
        softmax_before_topk=True, route_scale=1.0, aux_loss_coeff=0.0, norm_topk_prob=True, expert_bias=False,
        router_bias=False, expert_activation="swiglu", gate_dtype=F32, dtype=F32),
    # hy_mt2/model.py:168. HyMT2Config defaults (hy_mt2/config.py:59-63, "from tencent/Hy-MT2-30B-A3B
    # config.json"): moe_router_use_sigmoid -> "sigmoid", router_scaling_factor 2.826, route_norm True,
    # moe_router_enable_expert_bias True, 1 shared. The family passes no dtype (MoEConfig's bf16).
    "hy_mt2": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
        n_expert_groups=0, n_limited_groups=0, train_gate=True, gate_bias_update_factor=0.0, score_func="sigmoid",
        route_scale=2.826, aux_loss_coeff=0.0, norm_topk_prob=True, expert_bias=False, router_bias=False,
        expert_activation="swiglu", softmax_before_topk=False, force_e_score_correction_bias=True, dtype=F32),
    # hy_v3/model.py:125. HYV3Config defaults (Hy3-preview, hy_v3/config.py:46-51):
    # router_scaling_factor 1.0, route_norm False, moe_router_enable_expert_bias True, 1 shared.
    # The family passes no dtype (MoEConfig's bf16).
    "hy_v3": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
        n_expert_groups=0, n_limited_groups=0, train_gate=True, gate_bias_update_factor=0.0, score_func="sigmoid",
        route_scale=1.0, aux_loss_coeff=0.0, norm_topk_prob=False, expert_bias=False, router_bias=False,
        expert_activation="swiglu", softmax_before_topk=False, force_e_score_correction_bias=True, dtype=F32),
    # inkling/layers.py:214 (build_inkling_moe_config); route_scale from InklingTextConfig (8.0,
    # inkling/configuration.py:67). InklingMoE then swaps in InklingGate, its shared experts and an
    # interleaved SwiGLU (layers.py:431-440).
    "inkling": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=0, n_activated_experts=2,
        n_expert_groups=1, n_limited_groups=1, train_gate=True, gate_bias_update_factor=0.0, aux_loss_coeff=0.0,
        score_func="sigmoid", route_scale=8.0, norm_topk_prob=False, router_bias=False, expert_bias=False,
        expert_activation="swiglu", dtype=F32),
    # kimi_linear/model.py:972; gate_precision=fp32 at :1210. KimiLinear48BConfig leaves the sizes to
    # the checkpoint: moe_router_activation_func "sigmoid", moe_renormalize True, num_expert_group 1,
    # 1 shared; routed_scaling_factor picked as 2.446 (a non-default value; the code does not say it).
    "kimi_linear": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
        n_expert_groups=1, n_limited_groups=1, train_gate=True, gate_bias_update_factor=0.0, score_func="sigmoid",
        route_scale=2.446, aux_loss_coeff=0.0, norm_topk_prob=True, router_bias=False, expert_bias=False,
        expert_activation="swiglu", router_weights_fp32=True, router_weight_uses_score_correction_bias=True,
        apply_router_weight_after_down=True, shared_expert_gate=False, shared_expert_inter_dim=8,
        force_e_score_correction_bias=True, dtype=F32),
    # laguna/model.py:648; gate_precision=fp32 at :644. LagunaConfig defaults (laguna/config.py:98-103,
    # HF configuration_laguna.py): moe_routed_scaling_factor 1.0, norm_topk_prob True,
    # router_aux_loss_coef 0.001. shared_expert_intermediate_size is its own HF field (equal to
    # moe_intermediate_size in the checkpoint); 12 here so that a mix-up shows.
    "laguna": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
        n_expert_groups=1, n_limited_groups=1, train_gate=True, gate_bias_update_factor=0.0, score_func="sigmoid",
        route_scale=1.0, aux_loss_coeff=0.001, norm_topk_prob=True, router_bias=False, expert_bias=False,
        expert_activation="swiglu", shared_expert_inter_dim=12, shared_expert_activation="swiglu",
        softmax_before_topk=False, force_e_score_correction_bias=True, dtype=F32),
    # ling_v2/model.py:161; gate_precision=fp32 at :369. BailingMoeV2Config defaults, which its
    # docstring says are Ling-mini-2.0's (ling_v2/config.py:62-78): n_group 8, topk_group 4,
    # routed_scaling_factor 1.0, norm_topk_prob True, score_function "sigmoid", expert bias on.
    # 16 experts so that 8 groups keep 2 experts each.
    "ling_v2": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=16, n_shared_experts=1, n_activated_experts=2,
        n_expert_groups=8, n_limited_groups=4, train_gate=True, gate_bias_update_factor=0.0,
        force_e_score_correction_bias=True, score_func="sigmoid", route_scale=1.0, aux_loss_coeff=0.0,
        norm_topk_prob=True, expert_bias=False, router_bias=False, expert_activation="swiglu",
        shared_expert_inter_dim=8, shared_expert_activation="swiglu", softmax_before_topk=False,
        router_weights_fp32=True, dtype=F32),
    # mimo_v25/model.py:654; gate_precision=fp32 at :438. MiMoV2Config leaves n_group, scaling and
    # n_shared_experts to the checkpoint: picked n_group 1 / topk_group 1 (the MiMo-V2-Flash backbone
    # it keeps), routed_scaling_factor None -> 1.0, no shared expert; scoring "sigmoid" ->
    # "sigmoid_with_bias".
    "mimo_v25": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=0, n_activated_experts=2,
        n_expert_groups=1, n_limited_groups=1, train_gate=True, gate_bias_update_factor=0.0,
        score_func="sigmoid_with_bias", route_scale=1.0, aux_loss_coeff=0.0, norm_topk_prob=True,
        router_bias=False, expert_bias=False, expert_activation="swiglu", softmax_before_topk=False,
        force_e_score_correction_bias=True, dtype=F32),
    # mimo_v2_flash/model.py:718; gate_precision=fp32 at :715. MiMoV2FlashConfig defaults
    # (mimo_v2_flash/config.py:71-80): n_group 1, norm_topk_prob True, routed_scaling_factor 1.0,
    # apply_router_weight_after_down False (True only for the V2.5/V2.6 subclass, config.py:187),
    # n_shared_experts None -> 0.
    "mimo_v2_flash": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=0, n_activated_experts=2,
        n_expert_groups=1, n_limited_groups=1, train_gate=True, gate_bias_update_factor=0.0,
        score_func="sigmoid_with_bias", route_scale=1.0, aux_loss_coeff=0.0, norm_topk_prob=True,
        router_bias=False, expert_bias=False, expert_activation="swiglu", apply_router_weight_after_down=False,
        softmax_before_topk=False, force_e_score_correction_bias=True, dtype=F32),
    # minimax_m2/model.py:124; gate_precision=fp32 at :107; inter_dim = moe_inter_dim =
    # intermediate_size there. MiniMax-M2's scoring_func is "sigmoid".
    "minimax_m2": dict(
        dim=16, inter_dim=8, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=0, n_activated_experts=2,
        n_expert_groups=0, n_limited_groups=0, train_gate=True, gate_bias_update_factor=1e-3, score_func="sigmoid",
        route_scale=1.0, aux_loss_coeff=0, norm_topk_prob=True, router_bias=False, expert_bias=False,
        expert_activation="swiglu", softmax_before_topk=False, force_e_score_correction_bias=True,
        router_weights_fp32=True, gate_dtype=F32, dtype=F32),
    # minimax_m3_vl/model.py:79 (build_moe_config); gate_precision=fp32 at :126; shared experts live
    # in the block. MiniMax-M3 config defaults (minimax_m3_vl/config.py:73-82): scoring "sigmoid",
    # use_routing_bias True, routed_scaling_factor 2.0, swiglu_alpha 1.702, swiglu_limit 7.0.
    "minimax_m3_vl": dict(
        dim=16, inter_dim=8, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=0, n_activated_experts=2,
        n_expert_groups=0, n_limited_groups=0, train_gate=True, gate_bias_update_factor=1e-3, score_func="sigmoid",
        route_scale=2.0, aux_loss_coeff=0.0, norm_topk_prob=True, router_bias=False, expert_bias=False,
        expert_activation="swigluoai", activation_alpha=1.702, activation_limit=7.0, softmax_before_topk=False,
        force_e_score_correction_bias=True, gate_dtype=F32, dtype=F32),
    # mistral4/model.py:203 (_build_moe_config). Mistral4Config defaults (Mistral-Small-4): n_group 1,
    # topk_group 1, routed_scaling_factor 1.0, norm_topk_prob True, 1 shared.
    "mistral4": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
        n_expert_groups=1, n_limited_groups=1, train_gate=True, gate_bias_update_factor=0.0,
        force_e_score_correction_bias=True, score_func="softmax_with_bias", route_scale=1.0, aux_loss_coeff=0,
        norm_topk_prob=True, router_weights_fp32=True, dtype=F32),
    # nemotron_v3/model.py:119; gate_precision=fp32 at nemotron_v3/layers.py:702. Nemotron-3-Nano
    # (moe_latent_size None): n_group 1, norm_topk_prob True, mlp_bias False; routed_scaling_factor
    # picked as 2.5 (non-default; the code does not say it); moe_shared_expert_intermediate_size is its
    # own HF field (twice moe_intermediate_size in the Nano checkpoint): 16.
    "nemotron_v3": dict(
        n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, n_expert_groups=1, n_limited_groups=1,
        train_gate=True, gate_bias_update_factor=0.0, aux_loss_coeff=0.0, score_func="sigmoid", route_scale=2.5,
        dim=16, inter_dim=32, moe_inter_dim=8, norm_topk_prob=True, router_bias=False, expert_bias=False,
        expert_activation="relu2", dtype=F32, shared_expert_gate=False, shared_expert_inter_dim=16,
        shared_expert_activation="relu2", force_e_score_correction_bias=True, moe_latent_size=None),
    # qwen3_5_moe/model.py:679 (inter_dim is hidden_size there, unused). Qwen3_5MoeTextConfig
    # defaults: router_aux_loss_coef 0.001; shared_expert_intermediate_size is its own HF field
    # (equal to moe_intermediate_size in the checkpoint): 12 here so that a mix-up shows.
    "qwen3_5_moe": dict(
        dim=16, inter_dim=16, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
        n_expert_groups=0, n_limited_groups=0, train_gate=True, gate_bias_update_factor=0.0, score_func="softmax",
        route_scale=1.0, aux_loss_coeff=0.001, norm_topk_prob=True, expert_bias=False, router_bias=False,
        expert_activation="swiglu", softmax_before_topk=True, shared_expert_gate=True, shared_expert_inter_dim=12,
        dtype=F32),
    # qwen3_8_flash_next/model.py:138 (inter_dim is hidden_size there). Qwen3_8_FlashNextTextConfig
    # defaults (qwen3_8_flash_next/config.py:65-71): norm_topk_prob True, router_aux_loss_coef 0.001;
    # shared_expert_intermediate_size 12 (see qwen3_5_moe). The model's own BackendConfig subclass
    # changes only attention/RoPE.
    "qwen3_8_flash_next": dict(
        dim=16, inter_dim=16, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
        n_expert_groups=0, n_limited_groups=0, train_gate=True, gate_bias_update_factor=0.0, score_func="softmax",
        route_scale=1.0, aux_loss_coeff=0.001, norm_topk_prob=True, expert_bias=False, router_bias=False,
        expert_activation="swiglu", softmax_before_topk=True, shared_expert_gate=True, shared_expert_inter_dim=12,
        dtype=F32),
    # qwen3_moe/model.py:137. Qwen3-30B-A3B's checkpoint: norm_topk_prob True (HF's default is False),
    # router_aux_loss_coef 0.001.
    "qwen3_moe": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=0, n_activated_experts=2,
        n_expert_groups=0, n_limited_groups=0, train_gate=True, gate_bias_update_factor=0.0, score_func="softmax",
        route_scale=1.0, aux_loss_coeff=0.001, norm_topk_prob=True, expert_bias=False, router_bias=False,
        expert_activation="swiglu", softmax_before_topk=True, dtype=F32),
    # qwen3_next/model.py:165. Qwen3NextConfig defaults (Qwen3-Next-80B-A3B): norm_topk_prob True,
    # router_aux_loss_coef 0.001; shared_expert_intermediate_size 12 (see qwen3_5_moe).
    "qwen3_next": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
        n_expert_groups=0, n_limited_groups=0, train_gate=True, gate_bias_update_factor=0.0, score_func="softmax",
        route_scale=1.0, aux_loss_coeff=0.001, norm_topk_prob=True, expert_bias=False, router_bias=False,
        expert_activation="swiglu", softmax_before_topk=True, shared_expert_gate=True, shared_expert_inter_dim=12,
        dtype=F32),
    # qwen3_omni_moe/model.py:91 (writes n_expert_groups 1 / n_limited_groups 1). The thinker's text
    # config defaults (HF configuration_qwen3_omni_moe.py:176): norm_topk_prob True, aux 0.001.
    "qwen3_omni_moe": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=0, n_activated_experts=2,
        n_expert_groups=1, n_limited_groups=1, train_gate=True, gate_bias_update_factor=0.0, score_func="softmax",
        route_scale=1.0, aux_loss_coeff=0.001, norm_topk_prob=True, expert_bias=False, router_bias=False,
        expert_activation="swiglu", softmax_before_topk=True, dtype=F32),
    # qwen3_vl_moe/model.py:332 (writes n_expert_groups 1 / n_limited_groups 1).
    # Qwen3VLMoeTextConfig has no norm_topk_prob field, so getattr(..., False) gives False; aux 0.001.
    "qwen3_vl_moe": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=0, n_activated_experts=2,
        n_expert_groups=1, n_limited_groups=1, train_gate=True, gate_bias_update_factor=0.0, score_func="softmax",
        route_scale=1.0, aux_loss_coeff=0.001, norm_topk_prob=False, expert_bias=False, router_bias=False,
        expert_activation="swiglu", softmax_before_topk=True, dtype=F32),
    # step3p5/model.py:127 (the per-layer MoEConfig each MoE layer builds from moe_defaults at :257);
    # gate_precision=fp32 from need_fp32_gate at :95; the shared expert is the block's own Step3p5MLP.
    # Step-3.5-Flash: moe_router_activation "sigmoid" with use_moe_router_bias -> "sigmoid_with_bias"
    # and the bias buffer; picked moe_router_scaling_factor 3.0 (non-default) and a per-layer
    # swiglu_limits entry of 7.0, which becomes activation_limit (read by Automodel only for
    # swigluoai / quick_geglu, so it has no effect with swiglu).
    "step3p5": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=0, n_activated_experts=2,
        n_expert_groups=0, n_limited_groups=0, train_gate=True, gate_bias_update_factor=0.0,
        score_func="sigmoid_with_bias", route_scale=3.0, aux_loss_coeff=0.0, norm_topk_prob=True,
        router_bias=False, expert_bias=False, expert_activation="swiglu", activation_limit=7.0, dtype=F32,
        softmax_before_topk=False, force_e_score_correction_bias=True),
}

# The families whose MoEConfig sets moe_latent_size (Automodel's fc1/fc2 latent projections).
LATENT_FAMILIES = {
    # kimi_k3/model.py:1494 (_build_moe_config). KimiK3TextConfig defaults (kimi_k3/config.py:60-73):
    # moe_router_activation_func "sigmoid" -> "sigmoid_with_bias", moe_renormalize True,
    # num_shared_experts 2, routed_scaling_factor 1.0, num_expert_group 1; routed_expert_hidden_size
    # (3584 there) is moe_latent_size: 12 here. KimiK3MoE builds its own gate (fp32), SiTU experts and
    # latent projections (model.py:1147-1200).
    "kimi_k3": dict(
        dim=16, inter_dim=32, moe_inter_dim=8, n_routed_experts=8, n_shared_experts=2, n_activated_experts=2,
        n_expert_groups=1, n_limited_groups=1, train_gate=True, gate_bias_update_factor=0.0,
        score_func="sigmoid_with_bias", route_scale=1.0, aux_loss_coeff=0.0, norm_topk_prob=True,
        router_bias=False, expert_bias=False, expert_activation="swiglu", apply_router_weight_after_down=True,
        dtype=F32, shared_expert_gate=False, shared_expert_inter_dim=8, force_e_score_correction_bias=True,
        moe_latent_size=12),
    # nemotron_v3/model.py:119 with a NemotronH config that sets moe_latent_size (picked: 12);
    # otherwise as nemotron_v3.
    "nemotron_v3_latent": dict(
        n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, n_expert_groups=1, n_limited_groups=1,
        train_gate=True, gate_bias_update_factor=0.0, aux_loss_coeff=0.0, score_func="sigmoid", route_scale=2.5,
        dim=16, inter_dim=32, moe_inter_dim=8, norm_topk_prob=True, router_bias=False, expert_bias=False,
        expert_activation="relu2", dtype=F32, shared_expert_gate=False, shared_expert_inter_dim=16,
        shared_expert_activation="relu2", force_e_score_correction_bias=True, moe_latent_size=12),
}
FAMILIES.update(LATENT_FAMILIES)

# BackendConfig fields reaching the MoE layer that the family's code sets (see the comments above).
_FP32_GATE = dict(gate_precision=torch.float32)
FAMILY_BACKENDS = {name: _FP32_GATE for name in (
    "deepseek_v3", "deepseek_v32", "ernie4_5", "glm4_moe", "glm4_moe_lite", "glm5_next", "glm_moe_dsa",
    "kimi_linear", "laguna", "ling_v2", "mimo_v25", "mimo_v2_flash", "minimax_m2", "minimax_m3_vl",
    "nemotron_v3", "nemotron_v3_latent", "step3p5")}


def _inputs(T=24, dim=16, seed=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, T // 2, dim, generator=g)
    mask = torch.rand(2, T // 2, generator=g) < 0.2
    return x, mask


def _positive_correction_bias(module):
    """Scores tied at zero make the top-k order arbitrary in torch.topk (dropped groups score 0 for
    the sigmoid families); keep the correction bias positive so that no tie decides anything."""
    b = getattr(module.gate, "e_score_correction_bias", None)
    if b is not None:
        with torch.no_grad():
            b.abs_().mul_(0.2)


def test_family_lists_cover_the_backends():
    assert set(FAMILY_BACKENDS) <= set(FAMILIES)
    assert all(FAMILIES[f]["moe_latent_size"] for f in LATENT_FAMILIES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_layer_matches_automodel(family):
    ref, ours = pair(seed=zlib.crc32(family.encode()), backend=FAMILY_BACKENDS.get(family), **FAMILIES[family])
    _positive_correction_bias(ref)
    ours.load_state_dict(ref.state_dict())
    x, mask = _inputs()
    assert_close_pair(ref, ours, x, mask)
