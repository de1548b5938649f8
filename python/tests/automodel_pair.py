"""Helpers: NeMo Automodel 0.7.0's own MoE layer and flexep's, built from the same config with the
same tensors, and a comparison of their outputs and gradients."""

from __future__ import annotations

import dataclasses

import torch

import flexep.torch as ft
from nemo_automodel.components.models.common.utils import BackendConfig as AmBackendConfig
from nemo_automodel.components.moe.config import MoEConfig as AmMoEConfig
from nemo_automodel.components.moe.layers import MoE as AmMoE

BASE = dict(n_routed_experts=8, n_shared_experts=0, n_activated_experts=2, n_expert_groups=1, n_limited_groups=1,
            train_gate=True, gate_bias_update_factor=0.0, aux_loss_coeff=0.0, score_func="softmax", route_scale=1.0,
            dim=16, inter_dim=32, moe_inter_dim=8, norm_topk_prob=False, dtype=torch.float32)
BACKEND = dict(attn="sdpa", linear="torch", rms_norm="torch", experts="torch", dispatcher="torch")


def am_config(**kw) -> AmMoEConfig:
    return AmMoEConfig(**{**BASE, **kw})


def am_backend(**kw) -> AmBackendConfig:
    return AmBackendConfig(**{**BACKEND, **kw})


def randomize(module: torch.nn.Module, seed: int, scale: float = 0.3) -> None:
    """Random values for every parameter and buffer (biases and the correction bias included, so
    that their paths are exercised; the correction bias gets negative entries too)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, t in list(module.named_parameters()) + list(module.named_buffers()):
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float64).mul(scale).to(t.dtype))


def pair(seed: int = 0, backend: dict | None = None, **config):
    """(Automodel's MoE, flexep's MoE) with the same config and tensors."""
    cfg, b = am_config(**config), am_backend(**(backend or {}))
    ref = AmMoE(cfg, b)
    randomize(ref, seed)
    ours = ft.MoE(cfg, b, device="cpu")
    missing, unexpected = ours.load_state_dict(ref.state_dict(), strict=True)
    assert not missing and not unexpected
    return ref, ours


def run(module, x, padding_mask=None, grad=None, training=True):
    module.train(training)
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = module(x, padding_mask=padding_mask)
    if grad is None:
        grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(99), dtype=y.dtype)
    (y * grad).sum().backward()
    grads = {n: p.grad for n, p in module.named_parameters()}
    return y.detach(), x.grad, grads


def assert_close(actual, expected, *, rel=1e-5, msg=""):
    """Equal up to float32 summation order: every element within rel * (the largest magnitude of the
    expected tensor), so that a sum's rounding, which scales with its terms rather than its result,
    cannot fail the test, while any wrong term (orders of magnitude larger) does."""
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, atol=rel * max(scale, 1e-30), rtol=rel * 10,
                               msg=(lambda m: f"{msg}: {m}") if msg else None)


def assert_close_pair(ref, ours, x, padding_mask=None, *, rel=1e-5, training=True):
    """Outputs, the input's gradient and every parameter's gradient, name by name."""
    y_ref, gx_ref, g_ref = run(ref, x, padding_mask, training=training)
    y, gx, g = run(ours, x, padding_mask, training=training)
    assert_close(y, y_ref, rel=rel, msg="output")
    assert_close(gx, gx_ref, rel=rel, msg="grad x")
    assert g.keys() == g_ref.keys()
    for name in g_ref:
        if g_ref[name] is None:
            assert g[name] is None or torch.count_nonzero(g[name]) == 0, name
            continue
        assert g[name] is not None, f"no gradient for {name}"
        assert_close(g[name], g_ref[name], rel=rel, msg=name)
    return y_ref


def config_dict(cfg) -> dict:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
