"""One rank of the 2-GPU tests (torchrun). Prints PASS on success; any mismatch raises."""

import sys

import torch
import torch.distributed as dist

import flexep.torch as ft
from reference_moe import ReferenceMoE, reference_combine, reference_dispatch

BASE = dict(n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, n_expert_groups=1, n_limited_groups=1,
            train_gate=True, gate_bias_update_factor=1e-3, aux_loss_coeff=0.0, score_func="sigmoid",
            route_scale=1.0, dim=64, inter_dim=128, moe_inter_dim=32, norm_topk_prob=True, dtype=torch.bfloat16,
            shared_expert_gate=True)


def gather(t):
    """Every rank's tensor (ragged first dimension) on the CPU."""
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, t.shape[0])
    buf = [torch.empty(s, *t.shape[1:], dtype=t.dtype, device=t.device) for s in sizes]
    dist.all_gather(buf, t.contiguous())
    return [b.cpu() for b in buf]


def functions(backend, rank, dev):
    E, k, H = 8, 2, 128
    g = torch.Generator().manual_seed(100 + rank)
    T = 33 + 7 * rank
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    idx[0, 1] = -1
    w = torch.rand(T, k, generator=g)
    up_out = torch.randn(T, H, generator=g).to(torch.bfloat16)
    d = ft.get_dispatcher(ft.BackendConfig(dispatcher=backend), E, None, dev, hidden=H, max_tokens_per_rank=64,
                          max_topk=k)
    xd, wd = x.to(dev).requires_grad_(), w.to(dev).requires_grad_()
    tokens, probs, tpe, handle = ft.dispatch(d, xd, idx.to(dev), wd)
    out = ft.combine(d, handle, tokens * 2)
    loss = (out.float() * up_out.to(dev).float()).sum() + (probs * torch.arange(probs.shape[0], device=dev)).sum()
    loss.backward()
    # Reference on the CPU in f64 from every rank's inputs.
    xs = [a.double() for a in gather(x.to(dev))]
    idxs, ws = gather(idx.to(dev)), [a.double() for a in gather(w.to(dev))]
    rx = [a.clone().requires_grad_() for a in xs]
    rw = [a.clone().requires_grad_() for a in ws]
    disp = [reference_dispatch(rx, idxs, rw, E, r) for r in range(2)]
    outs = [reference_combine([dd[0] * 2 for dd in disp], [dd[3] for dd in disp], xs[r].shape[0], r) for r in range(2)]
    ups = [a.double() for a in gather(up_out.to(dev))]
    rloss = sum((outs[r] * ups[r]).sum() + (disp[r][1] * torch.arange(disp[r][1].shape[0])).sum() for r in range(2))
    rloss.backward()
    assert torch.equal(tokens.detach().cpu().double(), disp[rank][0].detach()), "dispatched rows differ"
    assert torch.equal(probs.detach().cpu().double(), disp[rank][1].detach().float().double())
    assert tpe.cpu().tolist() == disp[rank][2].tolist()
    torch.testing.assert_close(out.detach().cpu().double(), outs[rank].detach(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(xd.grad.cpu().double(), rx[rank].grad, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(wd.grad.cpu().double(), rw[rank].grad, rtol=1e-2, atol=5e-2)


def reference_with(m, cfg):
    """A CPU f64 reference holding all experts (gathered) and rank 0's replicated parameters, routing
    with the GPU layer's (Automodel's) bf16 logits and weights."""
    ref = ReferenceMoE(cfg, bf16_router=True)
    sd = m.state_dict()
    full = {k: (torch.cat(gather(v)) if k.startswith("experts.") else v.cpu()).double()
            if v.is_floating_point() and k != "gate.e_score_correction_bias" else v.cpu() for k, v in sd.items()}
    ref.load_state_dict(full)
    return ref


def make(cfg, backend, dev, seed=3):
    """flexep's layer with this rank's experts; the same seed on every rank, so the replicated
    parameters (gate, shared experts) start equal, as a data-parallel job's do."""
    torch.manual_seed(seed)
    return ft.MoE(cfg, ft.BackendConfig(dispatcher=backend), device=dev, group=dist.group.WORLD, init_std=0.05)


def layer(backend, rank, dev):
    cfg = ft.MoEConfig(**BASE)
    m = make(cfg, backend, dev)
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(4, 16, cfg.dim, generator=g).to(torch.bfloat16)
    gy = torch.randn(4, 16, cfg.dim, generator=g).to(torch.bfloat16)
    xd = x.to(dev).requires_grad_()
    y = m(xd)
    (y.float() * gy.to(dev).float()).sum().backward()
    ref = reference_with(m, cfg)
    ref.train()
    rx = x.double().requires_grad_()
    ry = ref(rx)
    torch.testing.assert_close(y.detach().cpu().double(), ry.detach(), rtol=3e-2, atol=3e-2)
    (ry * gy.double()).sum().backward()
    torch.testing.assert_close(xd.grad.cpu().double(), rx.grad, rtol=5e-2, atol=5e-2)
    # Expert gradients summed over both ranks' tokens: compare this rank's slice after an all-reduce of the
    # reference's own grads (each rank ran the reference on its tokens only).
    local = cfg.n_routed_experts // 2
    grads = {n: p.grad for n, p in m.named_parameters()}
    assert set(grads) == {n for n, _ in ref.named_parameters()}, set(grads) ^ {n for n, _ in ref.named_parameters()}
    for n, grad in grads.items():
        if n.startswith("experts."):
            rg = dict(ref.named_parameters())[n].grad.to(dev)
            dist.all_reduce(rg)
            rg = rg[rank * local:(rank + 1) * local].cpu()
        else:
            rg = dict(ref.named_parameters())[n].grad
        scale = rg.abs().max().item() + 1e-6
        torch.testing.assert_close(grad.cpu().double() / scale, rg.double() / scale, rtol=0, atol=5e-2,
                                   msg=lambda s: f"{n}: {s}")


def micro_batches(backend, rank, dev):
    """Two micro-batches that autograd accumulates into .grad give the sum of the two single-batch
    gradients. Each backward's gradients are new tensors the library never writes again: were one
    written after its backward (it becomes .grad, which the second micro-batch adds to in place), the
    sum would differ."""
    cfg = ft.MoEConfig(**{**BASE, "expert_bias": True})
    m = make(cfg, backend, dev)
    g = torch.Generator().manual_seed(11 + rank)
    batches = [(torch.randn(32, cfg.dim, generator=g).to(torch.bfloat16), torch.randn(32, cfg.dim, generator=g))
               for _ in range(2)]
    singles = []
    for x, gy in batches:
        m.zero_grad(set_to_none=True)
        (m(x.to(dev)).float() * gy.to(dev)).sum().backward()
        singles.append({n: p.grad.clone() for n, p in m.named_parameters()})
    m.zero_grad(set_to_none=True)
    for x, gy in batches:
        (m(x.to(dev)).float() * gy.to(dev)).sum().backward()
    for n, p in m.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype, (n, p.grad)
        assert torch.equal(p.grad, singles[0][n] + singles[1][n]), n


def state_dict(backend, rank, dev):
    cfg = ft.MoEConfig(**{**BASE, "gate_bias_update_factor": 0.0, "expert_bias": True})
    m = make(cfg, backend, dev)
    ref = ReferenceMoE(cfg, dtype=torch.bfloat16)
    local = cfg.n_routed_experts // 2
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_()
        # Unsaturated gate scores: with N(0, 1) weights many sigmoid scores round to 1.0 in fp32 and
        # the top-k tie-break (lower index) picks differently from the f64 reference.
        ref.gate.weight.mul_(0.02)
    sd = {k: (v[rank * local:(rank + 1) * local] if k.startswith("experts.") else v) for k, v in ref.state_dict().items()}
    m.load_state_dict(sd)
    back = m.state_dict()
    assert set(back) == set(sd), (set(back) ^ set(sd))
    for k, v in sd.items():
        assert torch.equal(back[k].cpu(), v), k
    # The loaded values are the library's: the output follows them.
    x = torch.randn(5, cfg.dim).to(torch.bfloat16)
    m.eval()
    y = m(x.to(dev))
    full = {k: (torch.cat(gather(v.to(dev))) if k.startswith("experts.") else v).double() for k, v in sd.items()}
    r = ReferenceMoE(cfg, bf16_router=True)
    r.load_state_dict(full)
    r.eval()
    # N(0, 1) weights make large intermediates that the bf16 layer rounds (the f64 reference does not):
    # compare relative to the output's scale.
    ry = r(x.double())
    scale = ry.abs().max().item() + 1e-6
    torch.testing.assert_close(y.cpu().double() / scale, ry / scale, rtol=0, atol=2e-2)


def correction_bias(backend, rank, dev):
    """The correction bias is the module's buffer: update_bias() (the load summed over the EP group)
    shows in state_dict(), and a loaded value is what the next update_bias() starts from."""
    f = 1e-3
    cfg = ft.MoEConfig(**{**BASE, "gate_bias_update_factor": f})
    m = make(cfg, backend, dev, seed=5)
    key = "gate.e_score_correction_bias"
    assert torch.equal(m.state_dict()[key].cpu(), torch.zeros(cfg.n_routed_experts)), m.state_dict()[key]

    def train_and_update():
        m.train()
        m(torch.randn(64, cfg.dim, device=dev).to(torch.bfloat16)).float().sum().backward()
        m.update_bias()
        torch.cuda.synchronize(dev)
        return m.state_dict()[key].cpu()

    first = train_and_update()
    steps = [-f, 0.0, f]
    assert all(any(abs(x - s) < 1e-9 for s in steps) for x in first.tolist()), first
    assert first.abs().sum() > 0, "the load of a random batch is never perfectly balanced"
    both = gather(first.to(dev))
    assert torch.equal(both[0].cpu(), both[1].cpu()), "the update uses the load summed over the group"

    loaded = torch.arange(cfg.n_routed_experts, dtype=torch.float32) * 0.25
    m.load_state_dict({**m.state_dict(), key: loaded})
    m.gate.e_score_correction_bias_master = None  # a checkpoint load starts the fp32 master afresh
    assert torch.equal(m.state_dict()[key].cpu(), loaded)
    second = train_and_update()
    step = second - loaded
    assert all(any(abs(x - s) < 1e-6 for s in steps) for x in step.tolist()), (second, loaded)


def main():
    case, backend = sys.argv[1], sys.argv[2]
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    cases = {"functions": functions, "layer": layer, "micro_batches": micro_batches, "state_dict": state_dict,
             "correction_bias": correction_bias}
    cases[case](backend, rank, dev)
    torch.cuda.synchronize()
    print(f"PASS rank {rank} {case} {backend}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
