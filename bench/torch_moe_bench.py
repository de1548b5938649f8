"""MoE layer forward + backward from PyTorch on 2 GPUs: flexep (hybridep, or any backend given) against a
pure-PyTorch reference (NCCL all_to_all_single + torch._grouped_mm), in the same run, on the same routing.
Writes one JSON per run to bench/results/ in the format of docs/benchmarks.md ("The JSON files") (the reference as backend
"torch_reference"; phase "layer_fwd_bwd", timing "call": CUDA events around forward + backward).

Run: PYTHONPATH=build/python torchrun --nproc-per-node 2 bench/torch_moe_bench.py [--backends hybridep,alltoall] [--sms 64]
(`--backends` takes Automodel's dispatcher names too: "torch" is flexep's alltoall, recorded under that name.)
Routing: Automodel's FakeBalancedGate (noise 0) on both sides, so both move exactly the same rows.
"""

import argparse
import datetime
import json
import os
import subprocess

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn

import flexep.torch as ft


class ReferenceMoE(torch.nn.Module):
    """Automodel's torch dispatcher path: permute by expert, all-to-all, grouped GEMMs, all-to-all back."""

    def __init__(self, E, k, dim, inter, world, rank, dev):
        super().__init__()
        self.E, self.k, self.world, self.rank, self.local = E, k, world, rank, E // world
        std = 0.02
        self.w_gu = torch.nn.Parameter(torch.randn(self.local, dim, 2 * inter, device=dev, dtype=torch.bfloat16) * std)
        self.w_d = torch.nn.Parameter(torch.randn(self.local, inter, dim, device=dev, dtype=torch.bfloat16) * std)

    def forward(self, x):
        T, E, k, R, L = x.shape[0], self.E, self.k, self.world, self.local
        t = torch.arange(T, device=x.device)
        idx = ((t[:, None] * k + torch.arange(k, device=x.device)) % E).reshape(-1)  # FakeBalancedGate
        probs = torch.full((T * k,), 1.0 / k, device=x.device)
        order = torch.argsort(idx, stable=True)
        rows, p = x[order // k], probs[order]
        send = torch.bincount(idx, minlength=E).view(R, L)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        got = dnn.all_to_all_single(torch.empty(sum(out_splits), x.shape[1], device=x.device, dtype=x.dtype), rows,
                                    out_splits, in_splits)
        gp = dnn.all_to_all_single(torch.empty(sum(out_splits), device=x.device), p, out_splits, in_splits)
        # received [source rank][local expert] -> expert-major
        counts = recv  # [R, L]
        src_expert = torch.repeat_interleave(torch.arange(L, device=x.device).repeat(R), counts.reshape(-1))
        perm = torch.argsort(src_expert, stable=True)
        xe, pe = got[perm], gp[perm]
        offs = torch.cumsum(counts.sum(0), 0).to(torch.int32)
        h = torch._grouped_mm(xe, self.w_gu, offs=offs)
        gate, up = h.chunk(2, dim=-1)
        a = (torch.nn.functional.silu(gate) * up * pe[:, None].to(h.dtype))
        ye = torch._grouped_mm(a, self.w_d, offs=offs)
        back = torch.empty_like(ye).index_copy(0, perm, ye)
        ret = dnn.all_to_all_single(torch.empty(rows.shape[0], x.shape[1], device=x.device, dtype=x.dtype), back,
                                    in_splits, out_splits)
        return torch.zeros(T, x.shape[1], device=x.device, dtype=torch.float32).index_add(
            0, order // k, ret.float()).to(x.dtype)


def time_fwd_bwd(module, x, grad, iters, warmup):
    times = []
    for i in range(warmup + iters):
        xi = x.detach().requires_grad_()
        module.zero_grad(set_to_none=True)  # as an optimizer step leaves them: no accumulation kernels
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        module(xi).backward(grad)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) * 1000.0)
    # The slowest rank defines a collective layer's time.
    t = torch.tensor(times, device=x.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    t = sorted(t.tolist())
    return {"min": t[0], "median": t[len(t) // 2] if len(t) % 2 else 0.5 * (t[len(t) // 2 - 1] + t[len(t) // 2]),
            "max": t[-1]}


def profile_table(module, x, grad, rank, title):
    """Rank 0 prints where one forward + backward spends its GPU time (kernels, copies, syncs)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            module(x.detach().requires_grad_()).backward(grad)
        torch.cuda.synchronize()
    if rank == 0:
        print(f"=== profile: {title} (2 iterations)")
        for key in ("self_device_time_total", "self_cuda_time_total"):
            try:
                print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
                break
            except (AttributeError, KeyError, RuntimeError):
                continue
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="hybridep")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--sms", type=int, default=16)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler kernel table per module")
    ap.add_argument("--own-gemm-min-work", type=int, default=None,
                    help="experts with at least this many multiply-adds get their own GEMM (0: all; 2**63-1: none)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args()
    if a.own_gemm_min_work is not None:
        from flexep import _flexep
        _flexep.set_grouped_gemm_own_gemm_min_work(a.own_gemm_min_work)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    g = torch.Generator(dev).manual_seed(rank)
    x = torch.randn(a.tokens, a.hidden, device=dev, generator=g).to(torch.bfloat16)
    grad = torch.randn(a.tokens, a.hidden, device=dev, generator=g).to(torch.bfloat16)
    common = dict(case="dsv3-ep2", routing="balanced", timing="call", tokens_per_rank=a.tokens, hidden=a.hidden,
                  topk=a.topk, experts=a.experts, dtype="bf16", algo_gbps=None, nvlink_gbps=None,
                  phase="layer_fwd_bwd")
    records = []
    ref = ReferenceMoE(a.experts, a.topk, a.hidden, a.inter, world, rank, dev)
    records.append(dict(common, backend="torch_reference", sms=None, time_us=time_fwd_bwd(ref, x, grad, a.iters, a.warmup),
                        note="pure PyTorch: argsort permute, NCCL all_to_all_single, torch._grouped_mm, index_add"))
    if a.profile:
        profile_table(ref, x, grad, rank, "torch_reference")
    del ref
    torch.cuda.empty_cache()
    cfg = ft.MoEConfig(n_routed_experts=a.experts, n_shared_experts=0, n_activated_experts=a.topk, n_expert_groups=1,
                       n_limited_groups=1, train_gate=True, gate_bias_update_factor=0.0, aux_loss_coeff=0.0,
                       score_func="softmax", route_scale=1.0, dim=a.hidden, inter_dim=4 * a.inter,
                       moe_inter_dim=a.inter, norm_topk_prob=False)
    for backend in a.backends.split(","):
        bc = ft.BackendConfig(dispatcher=backend, dispatcher_num_sms=a.sms, fake_balanced_gate=True)
        torch.manual_seed(0)
        m = ft.MoE(cfg, bc, device=dev, group=dist.group.WORLD)
        records.append(dict(common, backend=backend, sms=a.sms if backend == "hybridep" else None,
                            time_us=time_fwd_bwd(m, x, grad, a.iters, a.warmup),
                            own_gemm_min_work=a.own_gemm_min_work,
                            note="flexep.torch.MoE forward + backward (one autograd Function over the "
                                 "library's MoECompute; PyTorch-owned parameters)"))
        if a.profile:
            profile_table(m, x, grad, rank, backend)
        del m
        torch.cuda.empty_cache()
    if rank == 0:
        now = datetime.datetime.now(datetime.timezone.utc)
        commit_file = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "COMMIT")
        commit = os.environ.get("FLEXEP_COMMIT") or (
            open(commit_file).read().strip() if os.path.exists(commit_file) else "") or subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True,
            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
        run = {"run_id": f"{now:%Y%m%d-%H%M%S}-{commit[:8]}-{os.getpid()}", "date": f"{now:%Y-%m-%dT%H:%M:%SZ}",
               "commit": commit, "device": f"{world}x {torch.cuda.get_device_name(dev)}", "gpus": world,
               "records": records}
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, run["run_id"] + ".json")
        with open(path, "w") as f:
            json.dump(run, f, indent=1)
        for r in records:
            print(f"{r['backend']:<16} {r['phase']} median {r['time_us']['median']:.1f} us")
        print("wrote", path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
