"""flexep.torch.MoE under random (often invalid) configurations and inputs, with hypothesis, on the
CPU: config fields out of range or of the wrong kind, inputs of the wrong rank, width, dtype or
layout, padding masks of the wrong shape. Every case either runs (the output has x's shape and is
finite, and backward gives every trainable parameter a finite gradient of its shape) or raises a
ValueError (flexep.ArgumentError is one) or TypeError that names the field or argument at fault:
never another exception, never a crash.
"""

import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import flexep.torch as ft  # noqa: E402

FIELDS = ["n_routed_experts", "n_shared_experts", "n_activated_experts", "n_expert_groups", "n_limited_groups",
          "score_func", "route_scale", "dim", "moe_inter_dim", "expert_activation", "swiglu_limit",
          "activation_limit", "aux_loss_coeff", "gate_bias_update_factor", "shared_expert_inter_dim",
          "moe_latent_size", "dtype"]
ARGUMENTS = ["x", "padding_mask", "hidden", "input"]


@st.composite
def cases(draw):
    """Each value spoilt with probability 1/16, so that about half the cases run."""
    def spoilt():
        return draw(st.integers(0, 15)) == 0

    E = draw(st.sampled_from([1, 2, 4, 8])) if not spoilt() else draw(st.integers(-1, 3))
    groups = draw(st.sampled_from([g for g in (0, 1, 2) if g <= max(E, 0) and (g == 0 or E % g == 0)] or [0])) \
        if not spoilt() else draw(st.integers(-1, 5))
    dim = draw(st.integers(2, 12)) if not spoilt() else draw(st.integers(-1, 1))
    cfg = dict(
        n_routed_experts=E,
        n_shared_experts=draw(st.integers(0, 2)) if not spoilt() else -1,
        n_activated_experts=draw(st.integers(1, max(1, E))) if not spoilt() else draw(st.integers(-1, 12)),
        n_expert_groups=groups,
        n_limited_groups=draw(st.integers(min(1, max(0, groups)), max(0, groups))) if not spoilt()
        else draw(st.integers(-1, 6)),
        train_gate=True,
        gate_bias_update_factor=draw(st.sampled_from([0.0, 1e-3])),
        aux_loss_coeff=draw(st.sampled_from([0.0, 0.01])) if not spoilt() else -1.0,
        score_func=draw(st.sampled_from(["softmax", "sigmoid", "softmax_with_bias", "sigmoid_with_bias",
                                         "sqrtsoftplus"])) if not spoilt() else "bogus",
        route_scale=draw(st.sampled_from([1.0, 2.5])) if not spoilt() else draw(st.sampled_from([0.0, float("nan")])),
        dim=dim,
        inter_dim=8,
        moe_inter_dim=draw(st.integers(1, 8)) if not spoilt() else draw(st.integers(-2, 0)),
        norm_topk_prob=draw(st.booleans()),
        expert_activation=draw(st.sampled_from(["swiglu", "swigluoai", "quick_geglu", "geglu", "relu2"]))
        if not spoilt() else "bogus",
        swiglu_limit=draw(st.sampled_from([0.0, 0.7])) if not spoilt() else -1.0,
        dtype=torch.float32 if not spoilt() else draw(st.sampled_from([torch.int32, "bogus"])),
    )
    if draw(st.integers(0, 5)) == 0:
        cfg["moe_latent_size"] = draw(st.integers(1, 6)) if not spoilt() else draw(st.integers(-1, 0))
    T = draw(st.integers(0, 9))
    width = max(dim, 1) if not spoilt() else draw(st.integers(0, 14))
    shape = draw(st.sampled_from([(T, width), (2, T, width)])) if not spoilt() else draw(
        st.sampled_from([(width,), (1, 1, T, width)]))
    x_dtype = torch.float32 if not spoilt() else draw(st.sampled_from([torch.float64, torch.int64, torch.float16,
                                                                        torch.complex64]))
    mask = None
    if draw(st.booleans()):
        mask_shape = shape[:-1] if not spoilt() else (T + 1,)
        mask = torch.rand(mask_shape) < 0.3
    return cfg, shape, x_dtype, mask, draw(st.booleans()), spoilt()


def _named(e: Exception) -> bool:
    text = str(e)
    return any(name in text for name in FIELDS + ARGUMENTS)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_moe_runs_or_names_the_error(case):
    cfg, shape, x_dtype, mask, transpose, sparse = case
    try:
        moe = ft.MoE(ft.MoEConfig(**cfg))
    except (ValueError, TypeError) as e:
        hypothesis.event("config refused")
        assert _named(e), repr(e)
        return
    x = torch.randn(*shape).to(x_dtype)
    if transpose and x.dim() == 2 and x.is_floating_point():
        x = x.t().contiguous().t()  # same values, column-major strides
    if sparse:
        x = x.to_sparse()  # a COO tensor of the same values
    x.requires_grad_(x.is_floating_point())
    try:
        out = moe(x, padding_mask=mask)
    except (ValueError, TypeError) as e:
        hypothesis.event("input refused")
        assert _named(e), repr(e)
        return
    hypothesis.event("ran")
    assert out.shape == x.shape and torch.isfinite(out).all()
    out.float().square().sum().backward()
    for name, p in moe.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.shape == p.shape and torch.isfinite(p.grad).all(), name
