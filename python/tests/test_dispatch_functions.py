"""dispatch / combine / hybrid_ep_dispatch autograd Functions on the host backend (R simulated ranks as
threads) against the torch dispatcher's semantics written in PyTorch (gather, scatter-add)."""

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
@pytest.mark.parametrize("path", ["topk", "hybridep"])
def test_dispatch_combine_values_and_grads_match_reference(ranks, R, path):
    T, H, E, k = 5, 6, 4 * R, 2
    xs, idx, ws = make_inputs(R, T, H, E, k)
    world = _flexep.HostWorld(R, 60.0)
    g = torch.Generator().manual_seed(1)
    # Fixed "expert" transform (a per-row scale) and upstream grads, same on both sides.
    row_scale = [torch.rand(10 * T * R, 1, dtype=torch.float64, generator=g) for _ in range(R)]
    up_probs = [torch.randn(10 * T * R, dtype=torch.float64, generator=g) for _ in range(R)]
    up_out = [torch.randn(T + r, H, dtype=torch.float64, generator=g) for r in range(R)]
    fn = ft.hybrid_ep_dispatch if path == "hybridep" else ft.dispatch

    def rank_fn(r):
        d = _flexep.make_host_dispatcher(world, r, E)
        x = xs[r].clone().requires_grad_()
        w = ws[r].clone().requires_grad_()
        tokens, probs, tpe, handle = fn(d, x, idx[r], w)
        n = tokens.shape[0]
        y = tokens * row_scale[r][:n]
        out = ft.combine(d, handle, y)
        loss = (out * up_out[r]).sum() + (probs * up_probs[r][:n]).sum()
        loss.backward()
        return tokens.detach(), probs.detach(), tpe, out.detach(), x.grad, w.grad

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
        torch.testing.assert_close(probs, disp[r][1].detach(), rtol=0, atol=0)
        assert tpe.tolist() == disp[r][2].tolist()
        torch.testing.assert_close(out, outs[r].detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gx, rx[r].grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gw, rw[r].grad, rtol=1e-12, atol=1e-12)
        assert gw[0, -1] == 0  # the -1 slot gets no gradient


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
