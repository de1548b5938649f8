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
