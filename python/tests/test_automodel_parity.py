"""flexep.torch.MoE against NeMo Automodel 0.7.0's own MoE layer on the CPU in float32, with the same
tensors: outputs, the input's gradient and every parameter's gradient, over the configurations
Automodel accepts (every score function, group setting, activation, shared experts, aux loss and its
scale, the router-weight options, the fake balanced gate, padding)."""

import itertools
import random
import zlib

import pytest
import torch

from automodel_pair import assert_close_pair, pair

SCORES = [
    dict(score_func="softmax"),
    dict(score_func="softmax", softmax_before_topk=True),
    dict(score_func="softmax_with_bias", force_e_score_correction_bias=True),
    dict(score_func="softmax_with_bias"),
    dict(score_func="sigmoid"),
    dict(score_func="sigmoid", gate_bias_update_factor=1e-3),
    dict(score_func="sigmoid", force_e_score_correction_bias=True, router_weight_uses_score_correction_bias=True),
    dict(score_func="sigmoid_with_bias", force_e_score_correction_bias=True),
    dict(score_func="sigmoid_with_bias"),
    dict(score_func="sqrtsoftplus", force_e_score_correction_bias=True),
    dict(score_func="sqrtsoftplus"),
]
GROUPS = [dict(n_expert_groups=0, n_limited_groups=0), dict(n_expert_groups=1, n_limited_groups=1),
          dict(n_expert_groups=4, n_limited_groups=2), dict(n_expert_groups=2, n_limited_groups=1)]
ACTIVATIONS = [dict(expert_activation="swiglu"), dict(expert_activation="swiglu", swiglu_limit=0.6),
               dict(expert_activation="swigluoai", activation_limit=0.8), dict(expert_activation="quick_geglu",
                                                                               activation_limit=0.8),
               dict(expert_activation="geglu"), dict(expert_activation="relu2")]
SHARED = [dict(), dict(n_shared_experts=1), dict(n_shared_experts=2, shared_expert_gate=True),
          dict(n_shared_experts=1, shared_expert_activation="relu2", shared_expert_inter_dim=12)]
OPTIONS = [dict(norm_topk_prob=True), dict(route_scale=2.5), dict(router_bias=True), dict(expert_bias=True),
           dict(aux_loss_coeff=0.1), dict(apply_router_weight_after_down=True), dict(router_weights_fp32=True),
           dict(n_activated_experts=1), dict(n_activated_experts=3)]


def _sampled(n: int, seed: int = 2026):
    """n configurations drawn from the product above (fixed seed: the same list on every run)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        cfg = {**rng.choice(SCORES), **rng.choice(GROUPS), **rng.choice(ACTIVATIONS), **rng.choice(SHARED)}
        for opt in rng.sample(OPTIONS, rng.randint(0, 3)):
            cfg.update(opt)
        out.append(cfg)
    return out


def _covering():
    """Every score function with every group setting, and every activation with every shared-expert
    setting: the pairs that matter, each at least once."""
    return ([{**s, **g} for s, g in itertools.product(SCORES, GROUPS)]
            + [{**a, **sh} for a, sh in itertools.product(ACTIVATIONS, SHARED)]
            + [dict(o) for o in OPTIONS])


CONFIGS = _covering() + _sampled(60)


def _name(cfg: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items())


def _inputs(T=24, dim=16, seed=5, padding=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, T // 2, dim, generator=g)
    mask = torch.rand(2, T // 2, generator=g) < 0.2 if padding else None
    return x, mask


def _positive_correction_bias(module):
    """Scores tied at zero make the top-k order arbitrary in torch.topk; keep the correction bias
    positive in the randomized cases (the dropped-group semantics with negative biases has its own
    test below, built so that no tie decides anything)."""
    b = getattr(module.gate, "e_score_correction_bias", None)
    if b is not None:
        with torch.no_grad():
            b.abs_().mul_(0.2)


@pytest.mark.parametrize("cfg", CONFIGS, ids=[_name(c) for c in CONFIGS])
def test_layer_matches_automodel(cfg):
    ref, ours = pair(seed=zlib.crc32(_name(cfg).encode()), **cfg)
    _positive_correction_bias(ref)
    ours.load_state_dict(ref.state_dict())
    x, mask = _inputs()
    assert_close_pair(ref, ours, x, mask)


@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_fake_balanced_gate_routes_as_automodel(noise):
    ref, ours = pair(backend=dict(fake_balanced_gate=True, fake_gate_noise=noise), n_shared_experts=1)
    x, _ = _inputs(T=32)
    assert_close_pair(ref, ours, x)


def test_gate_precision_float64():
    ref, ours = pair(backend=dict(gate_precision="float64"), score_func="sigmoid", n_expert_groups=4,
                     n_limited_groups=2, gate_bias_update_factor=1e-3, norm_topk_prob=True)
    _positive_correction_bias(ref)
    ours.load_state_dict(ref.state_dict())
    x, mask = _inputs()
    assert_close_pair(ref, ours, x, mask)


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax_with_bias"])
def test_dropped_groups_score_zero_as_automodel(score_func):
    """With a negative correction bias everywhere, Automodel's sigmoid and softmax_with_bias still
    select from the dropped groups (multiplied by 0, they outscore every kept expert): with k equal to
    the number of dropped experts, the selected set is exactly the dropped groups."""
    ref, ours = pair(score_func=score_func, force_e_score_correction_bias=True, n_expert_groups=4,
                     n_limited_groups=2, n_activated_experts=4)
    with torch.no_grad():
        ref.gate.e_score_correction_bias.copy_(-2.0 - torch.arange(8) * 0.01)
    ours.load_state_dict(ref.state_dict())
    x, _ = _inputs()
    assert_close_pair(ref, ours, x)


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_aux_loss_scale_is_automodels(scale):
    """The aux loss's gradient follows Automodel's MoEAuxLossAutoScaler.main_loss_backward_scale,
    read at backward time."""
    from nemo_automodel.components.moe.megatron.moe_utils import MoEAuxLossAutoScaler

    ref, ours = pair(aux_loss_coeff=0.5, score_func="softmax")
    x, _ = _inputs()
    old = MoEAuxLossAutoScaler.main_loss_backward_scale
    try:
        MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(scale)
        assert_close_pair(ref, ours, x)
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = old


def test_eval_mode_has_no_aux_loss_and_no_load():
    ref, ours = pair(aux_loss_coeff=0.5, gate_bias_update_factor=1e-3, score_func="sigmoid")
    x, _ = _inputs()
    assert_close_pair(ref, ours, x, training=False)
    assert ours.gate._cumulative_expert_load is None and ref.gate._cumulative_expert_load is None


def test_bias_update_as_automodel():
    ref, ours = pair(score_func="sigmoid", gate_bias_update_factor=0.01, n_expert_groups=4, n_limited_groups=2)
    _positive_correction_bias(ref)
    ours.load_state_dict(ref.state_dict())
    for step in range(3):
        x, mask = _inputs(seed=step)
        for m in (ref, ours):
            m.train()
            m(x, padding_mask=mask).sum().backward()
        torch.testing.assert_close(ours.gate._cumulative_expert_load, ref.gate._cumulative_expert_load)
        ref.gate.update_bias()
        ours.gate.update_bias()
        torch.testing.assert_close(ours.gate.e_score_correction_bias, ref.gate.e_score_correction_bias)


def test_load_balance_tracking_attributes():
    ref, ours = pair(score_func="softmax", aux_loss_coeff=0.1)
    for m in (ref, ours):
        m.gate._track_load_balance = True
    x, mask = _inputs()
    assert_close_pair(ref, ours, x, mask)
    torch.testing.assert_close(ours.gate._last_expert_load, ref.gate._last_expert_load)
    torch.testing.assert_close(ours.gate._last_aux_loss, ref.gate._last_aux_loss)
