"""dispatch / combine / hybrid_ep_dispatch autograd Functions on the host backend (R simulated ranks as
threads) against the torch dispatcher's semantics written in PyTorch (gather, scatter-add); flexep's
own functions and Automodel's names (hybrid_ep_dispatch with a dense routing map or compact top-k,
hybrid_ep_combine, MoEFlexTokenDispatcher)."""

import pytest
import torch

import flexep
import flexep.torch as ft
from flexep import _flexep
from reference_moe import reference_combine, reference_dispatch


def make_inputs(R, T, H, E, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs, idx, ws = [], [], []
    for r in range(R):
        xs.append(torch.randn(T + r, H, dtype=torch.float64, generator=g))  # ragged T per rank
        i = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T + r)])
        i[0, -1] = -1  # a padding slot
        idx.append(i)
        ws.append(torch.rand(T + r, k, dtype=torch.float64, generator=g))
    return xs, idx, ws


@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("path", ["topk", "automodel_map", "automodel_compact"])
def test_dispatch_combine_values_and_grads_match_reference(ranks, R, path):
    T, H, E, k = 5, 6, 4 * R, 2
    xs, idx, ws = make_inputs(R, T, H, E, k)
    world = _flexep.HostWorld(R, 60.0)
    g = torch.Generator().manual_seed(1)
    # Fixed "expert" transform (a per-row scale) and upstream grads, same on both sides.
    row_scale = [torch.rand(10 * T * R, 1, dtype=torch.float64, generator=g) for _ in range(R)]
    up_probs = [torch.randn(10 * T * R, dtype=torch.float64, generator=g) for _ in range(R)]
    up_out = [torch.randn(T + r, H, dtype=torch.float64, generator=g) for r in range(R)]
    def rank_fn(r):
        x = xs[r].clone().requires_grad_()
        w = ws[r].clone().requires_grad_()
        if path.startswith("automodel"):
            # Automodel's call: dense probs [T, E] (and the dense map, or the compact top-k ids).
            valid = idx[r] >= 0
            rows = torch.arange(idx[r].shape[0]).unsqueeze(1).expand_as(idx[r])
            dense = torch.zeros(idx[r].shape[0], E, dtype=w.dtype).index_put((rows[valid], idx[r][valid]), w[valid])
            routing_map = dense != 0
            group = ft.HostRank(world, r)
            if path == "automodel_map":
                out4 = ft.hybrid_ep_dispatch(x, routing_map, dense, group, E // R)
            else:
                out4 = ft.hybrid_ep_dispatch(x, None, dense, group, E // R, topk_idx=idx[r], num_experts=E)
            tokens, probs, scales, tpe, handle = out4
            assert scales is None
            combine = lambda y: ft.hybrid_ep_combine(y, handle)  # noqa: E731
        else:
            d = _flexep.make_host_dispatcher(world, r, E)
            tokens, probs, tpe, handle = ft.dispatch(d, x, idx[r], w)
            combine = lambda y: ft.combine(d, handle, y)  # noqa: E731
        n = tokens.shape[0]
        out = combine(tokens * row_scale[r][:n])
        loss = (out * up_out[r]).sum() + (probs.to(up_probs[r].dtype) * up_probs[r][:n]).sum()
        loss.backward()
        return tokens.detach(), probs.detach().double(), tpe, out.detach(), x.grad, w.grad

    got = ranks(R, rank_fn)

    # Reference: the same chain in PyTorch, autograd through gather and index_add.
    rx = [x.clone().requires_grad_() for x in xs]
    rw = [w.clone().requires_grad_() for w in ws]
    masked = [i.clone() for i in idx]
    disp = [reference_dispatch(rx, masked, rw, E, r) for r in range(R)]
    ys = [disp[r][0] * row_scale[r][:disp[r][0].shape[0]] for r in range(R)]
    outs = [reference_combine(ys, [d[3] for d in disp], xs[r].shape[0], r) for r in range(R)]
    loss = sum((outs[r] * up_out[r]).sum() + (disp[r][1] * up_probs[r][:disp[r][1].shape[0]]).sum()
               for r in range(R))
    loss.backward()
    for r in range(R):
        tokens, probs, tpe, out, gx, gw = got[r]
        torch.testing.assert_close(tokens, disp[r][0].detach(), rtol=0, atol=0)
        # Automodel's hybrid_ep_dispatch returns float32 probs (HybridEP's contract).
        exact = 0 if not path.startswith("automodel") else 1e-7
        torch.testing.assert_close(probs, disp[r][1].detach(), rtol=exact, atol=exact)
        assert tpe.tolist() == disp[r][2].tolist()
        torch.testing.assert_close(out, outs[r].detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gx, rx[r].grad, rtol=1e-12, atol=1e-12)
        tol = 1e-12 if not path.startswith("automodel") else 1e-6
        torch.testing.assert_close(gw, rw[r].grad, rtol=tol, atol=tol)
        assert gw[0, -1] == 0  # the -1 slot gets no gradient


def test_moe_flex_token_dispatcher_by_automodels_names(ranks):
    E, k, R = 4, 2, 2
    xs, idx, ws = make_inputs(R, 4, 3, E, k)
    world = _flexep.HostWorld(R, 60.0)
    cfg = ft.TokenDispatcherConfig(moe_flex_dispatcher_backend="hybridep", moe_router_topk=k, num_moe_experts=E)

    def rank_fn(r):
        d = ft.MoEFlexTokenDispatcher(E // R, [r * (E // R) + i for i in range(E // R)], cfg, ft.HostRank(world, r))
        x = xs[r].clone().requires_grad_()
        tokens, tpe, probs = d.token_permutation2(x, x.shape[0], ws[r], idx[r])
        assert probs.shape == (tokens.shape[0], 1) and int(tpe.sum()) == tokens.shape[0]
        out = d.token_unpermutation(tokens)
        out.sum().backward()
        return out.detach(), x.grad

    counts = [(i >= 0).sum(1, keepdim=True).to(torch.float64) for i in idx]
    for r, (out, gx) in enumerate(ranks(R, rank_fn)):
        torch.testing.assert_close(out, xs[r] * counts[r])
        torch.testing.assert_close(gx, counts[r].expand_as(gx))


def test_fused_dispatch_over_a_group_needs_cuda_tensors():
    with pytest.raises(flexep.ArgumentError, match="'x'.*deepep backend, which takes CUDA tensors"):
        ft.fused_dispatch(torch.zeros(2, 2), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), 4, None)


def test_flex_token_dispatcher_names(ranks):
    E, k = 4, 2
    xs, idx, ws = make_inputs(1, 4, 3, E, k)
    d = ft.FlexTokenDispatcher(_flexep.make_host_dispatcher(_flexep.HostWorld(1), 0, E), backend="hybridep")
    x = xs[0].view(2, 2, 3)
    tokens, tpe, probs = d.token_permutation2(x, 4, ws[0], idx[0])
    assert probs.shape == (tokens.shape[0], 1) and int(tpe.sum()) == tokens.shape[0]
    out = d.token_unpermutation(tokens)
    counts = (idx[0] >= 0).sum(1, keepdim=True).to(x.dtype)
    torch.testing.assert_close(out.view(4, 3), xs[0] * counts)


def test_handle_and_argument_errors_name_the_argument():
    d = _flexep.make_host_dispatcher(_flexep.HostWorld(1), 0, 4)
    x = torch.randn(3, 2)
    with pytest.raises(flexep.ArgumentError, match="'indices'"):
        d.dispatch(x, indices=torch.tensor([[0], [7], [1]]), weights=torch.ones(3, 1))
    _, _, _, _, h = d.dispatch(x, indices=torch.tensor([[0], [1], [2]]), weights=torch.ones(3, 1))
    with pytest.raises(flexep.ArgumentError, match="expert_out"):
        d.combine(h, torch.randn(5, 2))
    with pytest.raises(flexep.ArgumentError, match="handle"):
        d.combine(None, torch.randn(3, 2))
    other = _flexep.make_host_dispatcher(_flexep.HostWorld(1), 0, 4)
    with pytest.raises(flexep.ArgumentError, match="handle"):
        other.combine(h, torch.randn(3, 2))


def test_missing_rank_is_a_timeout_error():
    world = _flexep.HostWorld(2, 0.5)
    d = _flexep.make_host_dispatcher(world, 0, 4)
    with pytest.raises(flexep.TimeoutError, match="timeout") as e:
        d.dispatch(torch.randn(2, 2), indices=torch.tensor([[0], [1]]), weights=torch.ones(2, 1))
    assert isinstance(e.value, TimeoutError)


def test_python_arguments_of_the_wrong_kind_are_named():
    """Arguments that used to be ignored or to fail deep inside (AttributeError) are named errors."""
    import numpy as np
    from automodel_pair import am_config

    d = _flexep.make_host_dispatcher(_flexep.HostWorld(1, 5.0), 0, 4)
    x, i, w = torch.randn(4, 8), torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]]), torch.rand(4, 2)
    for kw, name in [(dict(budget_rows=5), "budget_rows"), (dict(overflow="drop"), "overflow")]:
        with pytest.raises(flexep.ArgumentError, match=f"'{name}'.*mode='budget' only"):
            ft.dispatch(d, x, i, w, **kw)
    with pytest.raises(flexep.ArgumentError, match="'pad_multiple'.*1 to 65536"):
        ft.dispatch(d, x, i, w, pad_multiple=2**63 - 1)
    with pytest.raises(flexep.ArgumentError, match="'budget_rows'.*2147483647"):
        ft.dispatch(d, x, i, w, mode="budget", budget_rows=2**62)
    with pytest.raises(flexep.ArgumentError, match="'x': a ndarray"):
        ft.dispatch(d, x.numpy(), i, w)
    with pytest.raises(flexep.ArgumentError, match="'indices': a list"):
        ft.dispatch(d, x, i.tolist(), w)
    with pytest.raises(flexep.ArgumentError, match="'expert_out': a NoneType"):
        ft.combine(d, None, None)
    for v in (-1, 10**6, "16", True):
        with pytest.raises(flexep.ArgumentError, match="'num_sms'"):
            ft.set_num_sms(v)
    with pytest.raises(flexep.ArgumentError, match="'backend': 'bogus'"):
        ft.FlexTokenDispatcher(d, backend="bogus")
    with pytest.raises(flexep.ArgumentError, match="'backend': a str"):
        ft.MoE(am_config(), "host", device="cpu")
    m = ft.MoE(am_config(), device="cpu")
    with pytest.raises(flexep.ArgumentError, match="'x': a ndarray"):
        m(np.zeros((2, am_config().dim), dtype=np.float32))
    with pytest.raises(flexep.ArgumentError, match="'padding_mask': a list"):
        m(torch.randn(2, am_config().dim), padding_mask=[False, False])
    world = _flexep.HostWorld(1, 5.0)
    with pytest.raises(flexep.ArgumentError, match="'num_local_experts': 99.*4 per rank"):
        ft.hybrid_ep_dispatch(x, None, torch.rand(4, 4), ft.HostRank(world, 0), num_local_experts=99, topk_idx=i,
                              num_experts=4)


def test_layer_arguments_and_changed_configs_are_named():
    """ft.MoE checks its own arguments and the config as it is when the layer is made (a field
    changed after the config was checked included); numpy's scalars count as numbers."""
    import numpy as np
    from automodel_pair import am_config

    for kw, name in [(dict(init_std=-1.0), "init_std"), (dict(init_std=float("nan")), "init_std"),
                     (dict(pad_multiple=2.5), "pad_multiple"), (dict(pad_multiple=0), "pad_multiple")]:
        with pytest.raises(flexep.ArgumentError, match=f"'{name}'"):
            ft.MoE(am_config(), device="cpu", **kw)
    c = ft.MoEConfig.from_automodel(am_config())
    c.dim = -5
    with pytest.raises(flexep.ArgumentError, match="'moe.dim': is -5"):
        ft.MoE(c, device="cpu")
    with pytest.raises(flexep.ArgumentError, match="'backend.gate_precision': 'int8'"):
        ft.BackendConfig(gate_precision="int8")
    with pytest.raises(flexep.ArgumentError, match="'moe.dim': a object"):
        ft.MoE(ft.MoEConfig.from_automodel(am_config(dim=object())), device="cpu")
    m = ft.MoE(am_config(dim=np.int64(16)), device="cpu")
    assert m(torch.randn(3, 16)).shape == (3, 16)


def test_dispatchers_handles_modes_and_double_backward_are_named():
    from automodel_pair import am_config
    from flexep.torch.token_dispatcher import MoEFlexTokenDispatcher, TokenDispatcherConfig

    d = _flexep.make_host_dispatcher(_flexep.HostWorld(1, 5.0), 0, 4)
    x, i, w = torch.randn(4, 8), torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]]), torch.rand(4, 2)
    tokens, _, _, handle = ft.dispatch(d, x, i, w)
    for call, name in [(lambda: ft.combine(d, "h", tokens), "'handle': a str"),
                       (lambda: ft.combine(None, handle, tokens), "'dispatcher': a NoneType"),
                       (lambda: ft.dispatch(None, x, i, w), "'dispatcher': a NoneType"),
                       (lambda: ft.dispatch(d, x, i, w, mode=None), "'mode': None"),
                       (lambda: ft.dispatch(d, x, i, w, mode="budget", budget_rows=8, overflow="skip"),
                        "'overflow': 'skip'"),
                       (lambda: MoEFlexTokenDispatcher(2, [0, 1], TokenDispatcherConfig(), None), "'ep_group'")]:
        with pytest.raises(flexep.ArgumentError, match=name):
            call()
    # One backward is what the layer and the dispatch functions give: asking for a graph of the
    # gradient (create_graph=True, a double backward) is refused by name at once.
    m = ft.MoE(am_config(), device="cpu")
    xx = torch.randn(3, am_config().dim, requires_grad=True)
    with pytest.raises(flexep.ArgumentError, match="'create_graph'.*MoE layer has a first derivative only"):
        torch.autograd.grad(m(xx).sum(), xx, create_graph=True)
    xd = x.clone().requires_grad_()
    t2, _, _, h2 = ft.dispatch(d, xd, i, w)
    with pytest.raises(flexep.ArgumentError, match="'create_graph'.*combine"):
        torch.autograd.grad(ft.combine(d, h2, t2).sum(), xd, create_graph=True)
    assert torch.autograd.grad(m(xx).sum(), xx)[0].shape == xx.shape  # a plain backward still works
