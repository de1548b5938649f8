"""flexep.torch.MoE on the CPU (host backend, R simulated ranks) against the pure-PyTorch reference MoE:
outputs, gradients of x and of every parameter, aux loss, state_dict both ways, gradcheck in float64."""

import pytest
import torch

import flexep
import flexep.torch as ft
from flexep import _flexep
from reference_moe import AuxLossAutoScaler, ReferenceMoE

BASE = dict(n_routed_experts=8, n_shared_experts=0, n_activated_experts=2, n_expert_groups=1, n_limited_groups=1,
            train_gate=True, gate_bias_update_factor=0.0, aux_loss_coeff=0.0, score_func="softmax", route_scale=1.0,
            dim=12, inter_dim=32, moe_inter_dim=6, norm_topk_prob=False, dtype=torch.float64)

CASES = {
    "softmax-swiglu": {},
    "softmax-before-topk-aux": dict(softmax_before_topk=True, aux_loss_coeff=0.1),
    "sigmoid-bias-norm-shared": dict(score_func="sigmoid", gate_bias_update_factor=1e-3, norm_topk_prob=True,
                                     route_scale=2.5, n_shared_experts=2, shared_expert_gate=True, expert_bias=True,
                                     router_bias=True),
    "softmax-with-bias-relu2": dict(score_func="softmax_with_bias", force_e_score_correction_bias=True,
                                    expert_activation="relu2", shared_expert_activation="relu2", n_shared_experts=1),
    "quick-geglu-aux": dict(expert_activation="quick_geglu", expert_bias=True, aux_loss_coeff=0.05),
}


def config(**kw):
    return ft.MoEConfig(**{**BASE, **kw})


def reference_from(modules, cfg):
    """A reference module holding all experts: gate/shared from rank 0, experts concatenated over ranks."""
    ref = ReferenceMoE(cfg)
    sds = [m.state_dict() for m in modules]
    full = {}
    for k, v in sds[0].items():
        full[k] = torch.cat([sd[k] for sd in sds]) if k.startswith("experts.") else v
    ref.load_state_dict(full, strict=True)
    return ref


def run_flexep(cfg, R, xs, masks, grads, ranks, training=True):
    world = _flexep.HostWorld(R, 60.0)

    def rank_fn(r):
        m = ft.MoE(cfg, ft.BackendConfig(dispatcher="torch"), group=ft.HostRank(world, r), seed=7)
        m.train(training)
        x = xs[r].clone().requires_grad_()
        y = m(x, padding_mask=masks[r])
        (y * grads[r]).sum().backward()
        return m, y.detach(), x.grad

    return ranks(R, rank_fn) if R > 1 else [rank_fn(0)]


def inputs(R, shape, seed=3, padding=True):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(*shape, dtype=torch.float64, generator=g) for _ in range(R)]
    grads = [torch.randn(*shape, dtype=torch.float64, generator=g) for _ in range(R)]
    masks = [None] * R
    if padding:
        masks = [torch.zeros(shape[:-1], dtype=torch.bool) for _ in range(R)]
        for m in masks:
            m.view(-1)[-2:] = True
    return xs, masks, grads


@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_outputs_and_gradients_match_reference(ranks, R, case):
    cfg = config(**CASES[case])
    xs, masks, grads = inputs(R, (2, 5, cfg.dim))
    got = run_flexep(cfg, R, xs, masks, grads, ranks)
    modules = [g[0] for g in got]
    # Values: the reference starts from flexep's parameters (loaded from its state_dict).
    ref = reference_from(modules, cfg)
    ref.train()
    ref.zero_grad()
    for r in range(R):
        x = xs[r].clone().requires_grad_()
        y = ref(x, padding_mask=masks[r])
        torch.testing.assert_close(got[r][1], y.detach(), rtol=1e-10, atol=1e-12)
        if cfg.aux_loss_coeff > 0:
            torch.testing.assert_close(modules[r].gate._last_aux_loss, ref.last_aux.detach(), rtol=1e-10, atol=0)
        # Gate and shared-expert gradients are this rank's own contribution (replicated parameters).
        replicated_before = {n: (p.grad.clone() if p.grad is not None else None)
                             for n, p in ref.named_parameters() if not n.startswith("experts.")}
        (y * grads[r]).sum().backward()
        torch.testing.assert_close(got[r][2], x.grad, rtol=1e-9, atol=1e-12)
        for n, p in ref.named_parameters():
            if n.startswith("experts."):
                continue
            mine = dict(modules[r].named_parameters())[n].grad
            before = replicated_before[n]
            expected = p.grad - (before if before is not None else 0)
            torch.testing.assert_close(mine, expected, rtol=1e-9, atol=1e-12, msg=f"rank {r} {n}")
    # Expert gradients: each rank's slice of the full experts, from every rank's tokens.
    local = cfg.n_routed_experts // R
    for r in range(R):
        for n, p in modules[r].named_parameters():
            if n.startswith("experts."):
                ref_grad = dict(ref.named_parameters())[n].grad[r * local:(r + 1) * local]
                torch.testing.assert_close(p.grad, ref_grad, rtol=1e-9, atol=1e-12, msg=f"rank {r} {n}")


def test_aux_loss_scale_like_automodel(ranks):
    cfg = config(aux_loss_coeff=0.5)
    xs, masks, grads = inputs(1, (6, cfg.dim), padding=False)
    zero = [torch.zeros_like(grads[0])]
    try:
        ft.MoEAuxLossAutoScaler.set_loss_scale(3.0)
        AuxLossAutoScaler.scale = 3.0
        # A zero output gradient: only the aux loss reaches the gate weights.
        (m, _, _), = run_flexep(cfg, 1, xs, masks, zero, ranks)
        ref = reference_from([m], cfg)
        ref.train()
        x = xs[0].clone().requires_grad_()
        (ref(x) * 0).sum().backward()
        assert m.gate.weight.grad.abs().sum() > 0
        torch.testing.assert_close(m.gate.weight.grad, ref.gate.weight.grad, rtol=1e-9, atol=1e-14)
    finally:
        ft.MoEAuxLossAutoScaler.set_loss_scale(1.0)
        AuxLossAutoScaler.scale = 1.0


def test_gradcheck_float64():
    cfg = config(n_routed_experts=4, dim=4, moe_inter_dim=3, score_func="sigmoid", norm_topk_prob=True,
                 n_shared_experts=1, expert_bias=True, router_bias=True, shared_expert_gate=True)
    m = ft.MoE(cfg, seed=11, init_std=0.5)
    m.eval()
    from flexep.torch.moe import _MoEFunction

    params = [p for _, p in m._flat_params]
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)

    def fn(x, *ps):
        return _MoEFunction.apply(m, x, None, *ps)

    assert torch.autograd.gradcheck(fn, (x, *params), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_state_dict_round_trip_with_reference_module():
    cfg = config(**CASES["sigmoid-bias-norm-shared"])
    m = ft.MoE(cfg, seed=5)
    keys = set(m.state_dict())
    ref = ReferenceMoE(cfg)
    assert keys == set(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert m.state_dict()[k].shape == v.shape, k
    # Reference -> flexep (in place: the library sees the values) -> reference.
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_()
        ref.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    m.load_state_dict(ref.state_dict())
    back = ReferenceMoE(cfg)
    back.load_state_dict(m.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    x = torch.randn(7, cfg.dim, dtype=torch.float64)
    m.eval(), ref.eval()
    torch.testing.assert_close(m(x), ref(x), rtol=1e-10, atol=1e-12)


def test_update_bias_matches_automodel_rule():
    cfg = config(score_func="sigmoid", gate_bias_update_factor=0.01)
    m = ft.MoE(cfg)
    x = torch.randn(20, cfg.dim, dtype=torch.float64)
    with torch.no_grad():
        m(x)
    load = torch.tensor(m._layer.cumulative_load(), dtype=torch.float64)
    expected = torch.sign(load.mean() - load) * 0.01
    m.gate.update_bias()
    torch.testing.assert_close(m.gate.e_score_correction_bias, expected.float())
    with pytest.raises(flexep.Error, match="no expert load was accumulated"):
        m.update_bias()


def test_replaced_parameter_is_an_error():
    m = ft.MoE(config())
    m.gate.weight.data = torch.zeros_like(m.gate.weight)
    with pytest.raises(flexep.Error, match="no longer shares memory"):
        m(torch.randn(3, 12, dtype=torch.float64))


def test_float32_parameters_for_bf16_configs():
    m = ft.MoE(config(dtype=torch.bfloat16))
    assert m.gate.weight.dtype == torch.float32
    with pytest.raises(flexep.ArgumentError, match="'x'"):
        m(torch.randn(3, 12, dtype=torch.float64))


@pytest.mark.skipif(not flexep.HAS_CUDA, reason="CudaMoELayer exists only in CUDA builds")
def test_cuda_grad_mode_is_checked_before_any_device_work():
    # The GPU path's gradient mode reaches the library, which names it in the error (no GPU needed:
    # the string is checked before the layer is built).
    with pytest.raises(flexep.ArgumentError, match="'grad_mode'.*'fresh_bf16_weights'"):
        ft.MoE(config(dtype=torch.bfloat16), device="cuda:0", grad_mode="bf16")
