"""DeepEP's rank-major layout through the binding (TokenDispatcher.dispatch_rank_major) on the host
backend, R simulated ranks as threads, against DeepEP's contract written in PyTorch: recv_x ordered
by (source rank, source token), recv_topk_idx as local ids with -1 elsewhere, per-expert row lists
padded with -1, and the combine of per-received-row sums over ranks."""

import pytest
import torch

from flexep import _flexep


def make_inputs(R, E, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs, idx, ws = [], [], []
    for r in range(R):
        T = (5, 0, 7, 3)[r % 4]  # ragged, a rank without tokens
        xs.append(torch.randn(T, 6, dtype=torch.float64, generator=g))
        i = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.int64)
        if T:
            i[0, -1] = -1
        idx.append(i)
        ws.append(torch.rand(T, k, dtype=torch.float64, generator=g))
    return xs, idx, ws


def deepep_reference(xs, idx, ws, E, d, pad):
    """Receiver d's recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert, expert_rows."""
    L = E // len(xs)
    rows, ids, wts = [], [], []
    for s in range(len(xs)):
        for t in range(xs[s].shape[0]):
            mine = (idx[s][t] >= d * L) & (idx[s][t] < (d + 1) * L)
            if mine.any():
                rows.append(xs[s][t])
                ids.append(torch.where(mine, idx[s][t] - d * L, -1))
                wts.append(torch.where(mine, ws[s][t], 0.0))
    k = idx[0].shape[1]
    recv_x = torch.stack(rows) if rows else torch.zeros(0, 6, dtype=torch.float64)
    recv_idx = torch.stack(ids).int() if ids else torch.zeros(0, k, dtype=torch.int32)
    recv_w = torch.stack(wts) if wts else torch.zeros(0, k, dtype=torch.float64)
    lists, tpe = [], []
    for e in range(L):
        rows_e = (recv_idx == e).any(dim=1).nonzero().flatten().int()
        n = -(-rows_e.numel() // pad) * pad
        lists.append(torch.cat([rows_e, torch.full((n - rows_e.numel(),), -1, dtype=torch.int32)]))
        tpe.append(n)
    return recv_x, recv_idx, recv_w, torch.tensor(tpe), torch.cat(lists)


@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("pad", [1, 4])
def test_rank_major_dispatch_and_combine_match_deepeps_contract(ranks, R, pad):
    E, k = 2 * R, 3
    xs, idx, ws = make_inputs(R, E, k, seed=R + pad)
    world = _flexep.HostWorld(R, 60.0)

    def rank_fn(r):
        d = _flexep.make_host_dispatcher(world, r, E)
        recv_x, recv_idx, recv_w, tpe, expert_rows, dropped, handle = d.dispatch_rank_major(
            xs[r], idx[r], ws[r], pad_multiple=pad)
        recv_x, recv_idx, recv_w = (torch.from_dlpack(t) for t in (recv_x, recv_idx, recv_w))
        tpe, expert_rows = torch.from_dlpack(tpe), torch.from_dlpack(expert_rows)
        # The experts' side: each received row scaled by (1 + its number of local experts).
        partial = recv_x * (1 + (recv_idx >= 0).sum(dim=1, keepdim=True)).double()
        out = torch.from_dlpack(d.combine(handle, partial))
        return recv_x, recv_idx, recv_w, tpe, expert_rows, dropped, out

    got = ranks(R, rank_fn)
    for r in range(R):
        recv_x, recv_idx, recv_w, tpe, expert_rows, dropped, out = got[r]
        want = deepep_reference(xs, idx, ws, E, r, pad)
        torch.testing.assert_close(recv_x, want[0], rtol=0, atol=0)
        assert torch.equal(recv_idx, want[1])
        torch.testing.assert_close(recv_w, want[2], rtol=0, atol=0)
        assert torch.equal(tpe, want[3])
        assert torch.equal(expert_rows, want[4])
        assert dropped == 0
        # combine: token t of rank r gets sum over ranks d that received it of (1 + #experts on d) * x[t]
        L = E // R
        per_rank = torch.stack([((idx[r] >= d * L) & (idx[r] < (d + 1) * L)).sum(dim=1) for d in range(R)], dim=1)
        scale = ((1 + per_rank) * (per_rank > 0)).sum(dim=1, keepdim=True).double()
        torch.testing.assert_close(out, xs[r] * scale, rtol=1e-15, atol=0)


@pytest.mark.parametrize("R", [1, 3])
def test_fused_dispatch_and_combine_values_and_grads(ranks, R):
    """Automodel's fused_dispatch / fused_combine (DeepEP normal mode) on simulated ranks: values and
    the gradients of x and token_probs against the same chain written with PyTorch indexing."""
    import flexep.torch as ft

    E, k, H = 2 * R, 2, 6
    xs, idx, ws = make_inputs(R, E, k, seed=11)
    L = E // R
    g = torch.Generator().manual_seed(5)
    scale = [torch.rand(64, 1, dtype=torch.float64, generator=g) for _ in range(R)]
    c = [torch.randn(64, H, dtype=torch.float64, generator=g) for _ in range(R)]
    up = [torch.randn(x.shape[0], H, dtype=torch.float64, generator=g) for x in xs]
    world = _flexep.HostWorld(R, 60.0)

    def experts(d, recv_x, recv_w):  # a stand-in for the experts, differentiable in both inputs
        n = recv_x.shape[0]
        return recv_x * scale[d][:n] + recv_w.sum(1, keepdim=True) * c[d][:n]

    def rank_fn(r):
        x, w = xs[r].clone().requires_grad_(), ws[r].clone().requires_grad_()
        recv_x, recv_idx, recv_w, tpe, handle = ft.fused_dispatch(x, idx[r], w, E, ft.HostRank(world, r))
        assert recv_idx.dtype == torch.int64 and recv_w.dtype == torch.float32 and tpe.device.type == "cpu"
        out, none = ft.fused_combine(experts(r, recv_x, recv_w.double()), None, handle)
        assert none is None
        (out * up[r]).sum().backward()
        return out.detach(), x.grad, w.grad

    got = ranks(R, rank_fn)
    rx = [x.clone().requires_grad_() for x in xs]
    rw = [w.clone().requires_grad_() for w in ws]
    outs = [torch.zeros_like(x) for x in xs]
    for d in range(R):
        rows = [(s, t) for s in range(R) for t in range(xs[s].shape[0])
                if ((idx[s][t] >= d * L) & (idx[s][t] < (d + 1) * L)).any()]
        if not rows:
            continue
        recv_x = torch.stack([rx[s][t] for s, t in rows])
        mine = torch.stack([(idx[s][t] >= d * L) & (idx[s][t] < (d + 1) * L) for s, t in rows])
        # float32 weights on the wire, as DeepEP's
        recv_w = torch.where(mine, torch.stack([rw[s][t] for s, t in rows]).float().double(), 0.0)
        part = experts(d, recv_x, recv_w)
        for i, (s, t) in enumerate(rows):
            outs[s] = outs[s].index_add(0, torch.tensor([t]), part[i:i + 1])
    sum((o * u).sum() for o, u in zip(outs, up)).backward()
    for r in range(R):
        out, gx, gw = got[r]
        torch.testing.assert_close(out, outs[r].detach(), rtol=1e-6, atol=1e-6)
        # A rank without tokens: the reference never used its (empty) inputs.
        want_gx = rx[r].grad if rx[r].grad is not None else torch.zeros_like(xs[r])
        want_gw = rw[r].grad if rw[r].grad is not None else torch.zeros_like(ws[r])
        torch.testing.assert_close(gx, want_gx, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gw, want_gw, rtol=1e-6, atol=1e-6)
