"""One GPU (a CUDA build): flexep.torch.MoE on the GPU against NeMo Automodel 0.7.0's own layer
(experts="torch_mm") in bf16 with the same tensors, the routers' agreement at the DSV3-like shape,
and the tiny Automodel DeepSeek-V3 trained in bf16 with flexep put in, against the original.

Run: PYTHONPATH=build/python python -m pytest -q python/tests/gpu/test_torch_1gpu.py
"""

import copy
import dataclasses
import os
import sys

import pytest

torch = pytest.importorskip("torch")
import flexep  # noqa: E402
import flexep.torch as ft  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not flexep.HAS_CUDA or not torch.cuda.is_available(),
                                 reason="needs a CUDA build of flexep and a GPU")]

from automodel_pair import am_backend, am_config, randomize  # noqa: E402
from nemo_automodel.components.moe.layers import MoE as AmMoE  # noqa: E402
from flexep.torch._layer_call import compute_of  # noqa: E402

DEV = torch.device("cuda", 0)

CASES = {
    "sigmoid-groups-bias-shared": dict(score_func="sigmoid", gate_bias_update_factor=1e-3, n_expert_groups=4,
                                       n_limited_groups=2, norm_topk_prob=True, route_scale=2.5, n_shared_experts=1,
                                       router_weights_fp32=True),
    "softmax-aux": dict(score_func="softmax", aux_loss_coeff=0.01, n_shared_experts=2, shared_expert_gate=True),
    "sigmoid-with-bias-swigluoai": dict(score_func="sigmoid_with_bias", force_e_score_correction_bias=True,
                                        n_expert_groups=4, n_limited_groups=2, expert_activation="swigluoai",
                                        expert_bias=True, activation_limit=2.0),
    "sqrtsoftplus-after-down": dict(score_func="sqrtsoftplus", force_e_score_correction_bias=True,
                                    apply_router_weight_after_down=True, swiglu_limit=1.0),
    "softmax-before-topk-geglu-relu2-shared": dict(score_func="softmax", softmax_before_topk=True,
                                                   expert_activation="geglu", n_shared_experts=1,
                                                   shared_expert_activation="relu2"),
    "latent-bias-shared": dict(score_func="sigmoid", force_e_score_correction_bias=True, moe_latent_size=96,
                               expert_bias=True, n_shared_experts=1),
}


def _bf16_pair(config, backend=None, dim=256, inter=128, experts=16):
    cfg = am_config(**{**config, "dim": dim, "moe_inter_dim": inter, "n_routed_experts": experts,
                       "n_activated_experts": config.get("n_activated_experts", 4), "dtype": torch.bfloat16})
    b = am_backend(experts="torch_mm", **(backend or {}))
    with torch.device(DEV):
        ref = AmMoE(cfg, b)
    randomize(ref, seed=1, scale=0.05)
    b_bias = getattr(ref.gate, "e_score_correction_bias", None)
    if b_bias is not None:
        with torch.no_grad():
            b_bias.abs_()
    ours = ft.MoE(cfg, b, device=DEV)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _run(m, x, gy):
    m.train()
    m.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    y = m(xi)
    (y.float() * gy).sum().backward()
    return y.detach().float(), xi.grad.float(), {n: p.grad.float() for n, p in m.named_parameters()}


def _close(a, b, what, tol=3e-2):
    """Within bf16 noise of Automodel's: the relative distance of the tensors (bf16 arithmetic in a
    different order gives ~4e-3, up to 2e-2 where clamped activations (swigluoai, swiglu_limit) see
    a pre-activation on the other side of the limit after rounding; a wrong term gives far more)."""
    err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    assert err <= tol, f"{what}: relative distance {err:.3g}"


@pytest.mark.parametrize("in_place", [False, True], ids=["copied-rows", "rows-in-place"])
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_layer_matches_automodel_in_bf16(case, in_place):
    """Both ways of feeding the routed experts: the dispatcher's copy of the rows, and the tokens read
    in place through the row table (the gathered GEMM)."""
    ref, ours = _bf16_pair(CASES[case])
    compute = compute_of(ours, DEV)
    compute.rows_in_place = in_place
    assert compute.rows_in_place == in_place
    g = torch.Generator(DEV).manual_seed(3)
    x = torch.randn(512, 256, device=DEV, generator=g).to(torch.bfloat16)
    gy = torch.randn(512, 256, device=DEV, generator=g)
    y_ref, gx_ref, g_ref = _run(ref, x, gy)
    y, gx, gr = _run(ours, x, gy)
    _close(y, y_ref, "output")
    _close(gx, gx_ref, "grad x")
    for n, v in g_ref.items():
        _close(gr[n], v, n)


def test_backend_rows_in_place_reaches_the_gpu_layer():
    """BackendConfig.rows_in_place turns the in-place rows on for the GPU layer, with the same results."""
    ref, ours = _bf16_pair(CASES["sigmoid-groups-bias-shared"])
    cfg = am_config(**{**CASES["sigmoid-groups-bias-shared"], "dim": 256, "moe_inter_dim": 128, "n_routed_experts": 16,
                       "n_activated_experts": 4, "dtype": torch.bfloat16})
    backend = dataclasses.replace(ft.BackendConfig.from_automodel(am_backend(experts="torch_mm")), rows_in_place=True)
    in_place = ft.MoE(cfg, backend, device=DEV)
    in_place.load_state_dict(ref.state_dict())
    assert compute_of(in_place, DEV).rows_in_place and not compute_of(ours, DEV).rows_in_place
    g = torch.Generator(DEV).manual_seed(5)
    x = torch.randn(384, 256, device=DEV, generator=g).to(torch.bfloat16)
    gy = torch.randn(384, 256, device=DEV, generator=g)
    y, gx, gr = _run(ours, x, gy)
    y2, gx2, gr2 = _run(in_place, x, gy)
    _close(y2, y, "output", tol=1e-2)
    _close(gx2, gx, "grad x", tol=1e-2)
    for n, v in gr.items():
        _close(gr2[n], v, n, tol=1e-2)


@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_fake_balanced_gate_on_the_gpu(noise):
    ref, ours = _bf16_pair(dict(n_shared_experts=1), backend=dict(fake_balanced_gate=True, fake_gate_noise=noise))
    g = torch.Generator(DEV).manual_seed(4)
    x = torch.randn(256, 256, device=DEV, generator=g).to(torch.bfloat16)
    gy = torch.randn(256, 256, device=DEV, generator=g)
    y_ref, _, _ = _run(ref, x, gy)
    y, _, _ = _run(ours, x, gy)
    _close(y, y_ref, "output")


def test_routers_agree_at_the_dsv3_like_shape():
    """The same gate weights select the same experts for at least 99.9% of the tokens (sigmoid with
    groups 8/4 and a correction bias, 64 experts, top-8, dim 7168, bf16)."""
    cfg = am_config(n_routed_experts=64, n_activated_experts=8, n_expert_groups=8, n_limited_groups=4,
                    score_func="sigmoid", gate_bias_update_factor=1e-3, norm_topk_prob=True, route_scale=2.5,
                    dim=7168, moe_inter_dim=64, dtype=torch.bfloat16)
    b = am_backend(experts="torch_mm")
    with torch.device(DEV):
        ref = AmMoE(cfg, b)
    with torch.no_grad():
        ref.gate.weight.normal_(0, 0.02)
        ref.gate.e_score_correction_bias.copy_(torch.randn(64, device=DEV) * 0.01)
    ours = ft.MoE(cfg, b, device=DEV)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(4096, 7168, device=DEV, generator=torch.Generator(DEV).manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        _, idx_ref, _ = ref.gate(x, torch.ones(4096, dtype=torch.bool, device=DEV), None)
        ours(x)
    idx = ours.last_routing()[0]
    same = (idx.sort(-1).values == idx_ref.sort(-1).values).all(-1).float().mean().item()
    print(f"routers agree on {same:.5f} of the tokens")
    assert same >= 0.999, same


def test_tiny_deepseek_v3_trains_as_automodels_in_bf16():
    from fsdp_bodies import tiny_deepseek_v3

    import flexep.torch.automodel as fa

    ref = tiny_deepseek_v3().to(DEV).to(torch.bfloat16)
    ours = copy.deepcopy(ref)
    assert fa.use_flexep(ours) == 2
    losses = {}
    for name, model in (("automodel", ref), ("flexep", ours)):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(1234)
        data = [torch.randint(0, 96, (4, 33), generator=g).to(DEV) for _ in range(4)]
        out = []
        for step in range(20):
            ids = data[step % 4]
            logits = model(ids[:, :-1])
            logits = logits.logits if hasattr(logits, "logits") else logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                                                     ids[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            out.append(loss.item())
        losses[name] = torch.tensor(out)
    print("losses", losses)
    assert losses["flexep"][-1] < losses["flexep"][0]
    torch.testing.assert_close(losses["flexep"], losses["automodel"], rtol=3e-2, atol=0)
