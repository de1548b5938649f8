"""flexep.torch.MoE with expert parallelism on R simulated CPU ranks (HostRank: threads meeting inside
the library) against NeMo Automodel 0.7.0's own layer holding all experts: each rank's output and
input gradient, each rank's share of the replicated gradients (gate, shared experts), and each
rank's slice of the expert gradients; a float64 gradcheck through the module's own tensors."""

import pytest
import torch
from torch.func import functional_call

import flexep.torch as ft
from automodel_pair import am_backend, am_config, assert_close, randomize
from flexep import _flexep
from nemo_automodel.components.moe.layers import MoE as AmMoE

CASES = {
    "softmax": dict(),
    "softmax-before-topk-aux": dict(softmax_before_topk=True, aux_loss_coeff=0.1),
    "sigmoid-groups-shared": dict(score_func="sigmoid", gate_bias_update_factor=1e-3, norm_topk_prob=True,
                                  route_scale=2.5, n_expert_groups=4, n_limited_groups=2, n_shared_experts=2,
                                  shared_expert_gate=True, expert_bias=True, router_bias=True),
    "softmax-with-bias-relu2": dict(score_func="softmax_with_bias", force_e_score_correction_bias=True,
                                    expert_activation="relu2", shared_expert_activation="relu2",
                                    n_shared_experts=1),
    "quick-geglu-aux": dict(expert_activation="quick_geglu", expert_bias=True, aux_loss_coeff=0.05),
}


def _inputs(R, T=10, dim=16, seed=3):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(T + r, dim, generator=g) for r in range(R)]  # ragged tokens per rank
    grads = [torch.randn(T + r, dim, generator=g) for r in range(R)]
    masks = [torch.arange(T + r) >= T + r - 2 for r in range(R)]  # the last two tokens are padding
    return xs, grads, masks


def _ranks_match_automodel(ranks, R, case, seed, backend=None):
    """flexep.torch.MoE on R simulated ranks (`backend`: flexep's BackendConfig, default Automodel's
    own) against Automodel's layer holding all experts."""
    cfg, b = am_config(**CASES[case]), am_backend()
    ref = AmMoE(cfg, b)
    randomize(ref, seed=seed)
    if ref.gate.e_score_correction_bias is not None:
        with torch.no_grad():
            ref.gate.e_score_correction_bias.abs_().mul_(0.2)  # no score ties at zero (see test_automodel_parity)
    full = ref.state_dict()
    local = cfg.n_routed_experts // R
    xs, grads, masks = _inputs(R)
    world = _flexep.HostWorld(R, 60.0)

    def rank_fn(r):
        m = ft.MoE(cfg, backend or b, device="cpu", group=ft.HostRank(world, r))
        m.load_state_dict({k: (v[r * local:(r + 1) * local] if k.startswith("experts.") else v)
                           for k, v in full.items()})
        x = xs[r].clone().requires_grad_()
        y = m(x, padding_mask=masks[r])
        (y * grads[r]).sum().backward()
        return y.detach(), x.grad, {n: p.grad for n, p in m.named_parameters()}

    got = ranks(R, rank_fn)
    ref.train()
    totals = {}
    for r in range(R):
        ref.zero_grad(set_to_none=True)
        x = xs[r].clone().requires_grad_()
        y = ref(x, padding_mask=masks[r])
        (y * grads[r]).sum().backward()
        assert_close(got[r][0], y.detach(), msg=f"rank {r} output")
        assert_close(got[r][1], x.grad, msg=f"rank {r} grad x")
        for n, p in ref.named_parameters():
            totals[n] = p.grad.clone() if n not in totals else totals[n] + p.grad
            if not n.startswith("experts."):  # replicated: this rank's own contribution
                assert_close(got[r][2][n], p.grad, msg=f"rank {r} {n}")
    for r in range(R):  # experts: this rank's slice, from every rank's tokens
        for n, g in got[r][2].items():
            if n.startswith("experts."):
                assert_close(g, totals[n][r * local:(r + 1) * local], msg=f"rank {r} {n}")


@pytest.mark.parametrize("R", [1, 2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_ranks_match_automodel(ranks, R, case):
    _ranks_match_automodel(ranks, R, case, seed=R)


def test_gradcheck_float64():
    cfg = am_config(n_routed_experts=4, dim=4, moe_inter_dim=3, score_func="sigmoid", norm_topk_prob=True,
                    n_shared_experts=1, expert_bias=True, router_bias=True, shared_expert_gate=True,
                    dtype=torch.float64)
    m = ft.MoE(cfg, am_backend(), device="cpu", init_std=0.5)
    m.eval()
    names = [n for n, _ in m.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for _, p in m.named_parameters())
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)

    def fn(x, *ps):
        return functional_call(m, dict(zip(names, ps)), (x,))

    assert torch.autograd.gradcheck(fn, (x, *params), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_bias_update_sums_the_load_over_the_group(ranks):
    cfg, b = am_config(score_func="sigmoid", gate_bias_update_factor=0.01), am_backend()
    R = 2
    xs, _, _ = _inputs(R)
    world = _flexep.HostWorld(R, 60.0)

    def rank_fn(r):
        m = ft.MoE(cfg, b, device="cpu", group=ft.HostRank(world, r))
        m.train()
        m(xs[r]).sum().backward()
        load = m.gate._cumulative_expert_load.clone()
        m.gate.update_bias()
        return load, m.gate.e_score_correction_bias.clone()

    (l0, b0), (l1, b1) = ranks(R, rank_fn)
    total = (l0 + l1).double()
    torch.testing.assert_close(b0, (torch.sign(total.mean() - total) * 0.01).float())
    torch.testing.assert_close(b1, b0)


@pytest.mark.parametrize("R,chunks", [(1, 3), (2, 3), (2, 7)])
def test_dispatch_chunks_match_automodel(ranks, R, chunks):
    """backend.dispatch_chunks (flexep's): each rank's tokens in chunks of rows, each chunk through
    its own host dispatcher; with 7 chunks of 10 or 11 tokens some chunks are a single token."""
    import dataclasses
    fb = dataclasses.replace(ft.BackendConfig.from_automodel(am_backend()), dispatch_chunks=chunks)
    _ranks_match_automodel(ranks, R, "sigmoid-groups-shared", seed=11, backend=fb)
