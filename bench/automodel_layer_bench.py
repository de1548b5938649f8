"""The MoE layer forward + backward on one GPU: flexep.torch.MoE against NeMo Automodel 0.7.0's own MoE
layer (experts="torch_mm", dispatcher "torch", EP 1), same weights, same inputs, in the same run.

Shape (DSV3-like by default): dim 7168, moe_inter 2048, 64 experts, top-8, sigmoid routing with
groups 8/4 and a correction bias, route_scale 2.5, one shared expert, 4096 tokens, bf16. Records per
layer: the median of CUDA-event times around forward + backward (gradients set to None before each,
as after an optimizer step), the peak memory of one iteration, the memory one forward keeps for backward
beyond its output (saved_mb), and, for flexep, how many tokens the
two routers send to the same experts (same expert set per token) and how close the outputs are.
flexep runs twice: the routed experts on the dispatcher's copy of the rows ("flexep") and reading
the tokens in place ("flexep-in-place", MoECompute.rows_in_place). Also runs the fake balanced gate
(no router) for all. Writes one JSON to bench/results/ (phase
"layer_fwd_bwd", timing "call"; Automodel's layer as backend "automodel").

Run: PYTHONPATH=build/python python bench/automodel_layer_bench.py [--tokens 4096] [--iters 10]
"""

import argparse
import datetime
import json
import os
import subprocess

import torch

import flexep.torch as ft
from flexep import _flexep
from flexep.torch._layer_call import compute_of
from nemo_automodel.components.models.common.utils import BackendConfig as AmBackendConfig
from nemo_automodel.components.moe.config import MoEConfig as AmMoEConfig
from nemo_automodel.components.moe.layers import MoE as AmMoE


def time_fwd_bwd(module, x, grad, iters, warmup):
    """Median of CUDA-event times and the peak memory above what was allocated before: PyTorch's
    allocator's peak plus the library's pool peak (flexep's kernels allocate there; the sum bounds
    the process's peak from above)."""
    times = []
    # Gradients left from an earlier measurement of the same module would count in the base, not the peak.
    module.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    _flexep.cuda_reset_pool_peak_bytes(x.device.index)
    base = torch.cuda.memory_allocated()
    pool_base = _flexep.cuda_pool_peak_bytes(x.device.index)
    for i in range(warmup + iters):
        xi = x.detach().requires_grad_()
        module.zero_grad(set_to_none=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        module(xi).backward(grad)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) * 1000.0)
    peak = torch.cuda.max_memory_allocated() - base
    pool = _flexep.cuda_pool_peak_bytes(x.device.index) - pool_base
    t = sorted(times)
    return {"min": t[0], "median": t[len(t) // 2], "max": t[-1]}, {"torch": peak, "library": pool}


def saved_bytes(module, x):
    """Device memory one forward's result keeps for backward beyond its output: PyTorch's allocator
    plus the library's pool, measured with nothing else in flight."""
    xi = x.detach().requires_grad_()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated() + _flexep.cuda_pool_used_bytes(x.device.index)
    y = module(xi)
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated() + _flexep.cuda_pool_used_bytes(x.device.index)
    kept = after - before - y.numel() * y.element_size()
    del y
    return kept


def routing_agreement(ref, x):
    """Fraction of tokens for which Automodel's router and flexep's (run as the layer's router on
    the same weights) pick the same set of experts."""
    with torch.no_grad():
        _, idx_ref, _ = ref.gate(x, torch.ones(x.size(0), dtype=torch.bool, device=x.device), None)
    return idx_ref


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    g = torch.Generator(dev).manual_seed(0)
    x = torch.randn(a.tokens, a.hidden, device=dev, generator=g).to(torch.bfloat16)
    grad = torch.randn(a.tokens, a.hidden, device=dev, generator=g).to(torch.bfloat16)
    cfg = AmMoEConfig(n_routed_experts=a.experts, n_shared_experts=1, n_activated_experts=a.topk, n_expert_groups=8,
                      n_limited_groups=4, train_gate=True, gate_bias_update_factor=1e-3, aux_loss_coeff=0.0,
                      score_func="sigmoid", route_scale=2.5, dim=a.hidden, inter_dim=4 * a.inter,
                      moe_inter_dim=a.inter, norm_topk_prob=True, dtype=torch.bfloat16)
    records = []
    common = dict(case="dsv3-layer-1gpu", timing="call", tokens_per_rank=a.tokens, hidden=a.hidden, topk=a.topk,
                  experts=a.experts, dtype="bf16", algo_gbps=None, nvlink_gbps=None, phase="layer_fwd_bwd", sms=None)
    for gate in ("router", "fake_balanced"):
        backend = AmBackendConfig(attn="sdpa", linear="torch", rms_norm="torch", experts="torch_mm",
                                  dispatcher="torch", fake_balanced_gate=gate == "fake_balanced")
        with torch.device(dev):
            ref = AmMoE(cfg, backend)
        with torch.no_grad():
            ref.init_weights(dev, init_std=0.02)
            if ref.gate.__class__.__name__ == "Gate":
                ref.gate.e_score_correction_bias.copy_(torch.randn(a.experts, device=dev, generator=g) * 0.01)
        t_ref, mem_ref = time_fwd_bwd(ref, x, grad, a.iters, a.warmup)
        saved_ref = saved_bytes(ref, x)
        with torch.no_grad():
            y_ref = ref(x)
            idx_ref = routing_agreement(ref, x) if gate == "router" else None
        ours = ft.MoE(cfg, backend, device=dev)
        ours.load_state_dict(ref.state_dict())
        sd = ref.state_dict()
        del ref
        torch.cuda.empty_cache()
        routing = "router" if gate == "router" else "balanced"
        records.append(dict(common, routing=routing, backend="automodel", time_us=t_ref,
                            peak_bytes=sum(mem_ref.values()), peak_bytes_by_allocator=mem_ref,
                            saved_mb=saved_ref / 1e6,
                            note="Automodel 0.7.0 MoE, experts=torch_mm, dispatcher torch, EP 1"))
        # The routed experts on the dispatcher's copy of the rows, then reading the tokens in place.
        for in_place in (False, True):
            compute_of(ours, dev).rows_in_place = in_place
            t_ours, mem_ours = time_fwd_bwd(ours, x, grad, a.iters, a.warmup)
            saved_ours = saved_bytes(ours, x)
            with torch.no_grad():
                y = ours(x)
            # Per token: the output row's distance from Automodel's, relative to that row's size.
            rel = (y.float() - y_ref.float()).norm(dim=-1) / y_ref.float().norm(dim=-1).clamp_min(1e-30)
            extra = {"tokens_within_1pct": float((rel <= 1e-2).float().mean()),
                     "tokens_within_5pct": float((rel <= 5e-2).float().mean()), "max_token_rel_diff": float(rel.max()),
                     "output_rel_diff": float((y.float() - y_ref.float()).norm() / y_ref.float().norm())}
            if idx_ref is not None:
                idx = ours.last_routing()[0]
                same = (idx.sort(-1).values == idx_ref.sort(-1).values).all(-1)
                extra["same_experts_fraction"] = float(same.float().mean())
            records.append(dict(common, routing=routing, backend="flexep-in-place" if in_place else "flexep",
                                time_us=t_ours, peak_bytes=sum(mem_ours.values()), peak_bytes_by_allocator=mem_ours,
                                saved_mb=saved_ours / 1e6, ratio_vs_automodel=t_ref["median"] / t_ours["median"],
                                **extra,
                                note="flexep.torch.MoE, same weights (EP 1), the routed experts "
                                     + ("reading the tokens in place (rows_in_place)" if in_place
                                        else "on the dispatcher's copy of the rows")))
        del ours, sd
        torch.cuda.empty_cache()
    now = datetime.datetime.now(datetime.timezone.utc)
    # The commit: FLEXEP_COMMIT, else the COMMIT file the device runs carry (their .git may lag), else git.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit_file = os.path.join(root, "COMMIT")
    commit = os.environ.get("FLEXEP_COMMIT") or (
        open(commit_file).read().strip() if os.path.exists(commit_file) else "") or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=root).stdout.strip() or "unknown"
    run = {"run_id": f"{now:%Y%m%d-%H%M%S}-{commit[:8]}-{os.getpid()}", "date": f"{now:%Y-%m-%dT%H:%M:%SZ}",
           "commit": commit, "device": f"1x {torch.cuda.get_device_name(dev)}", "gpus": 1, "records": records}
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, run["run_id"] + ".json")
    with open(path, "w") as f:
        json.dump(run, f, indent=1)
    for r in records:
        print(f"{r['routing']:<9} {r['backend']:<15} median {r['time_us']['median'] / 1000:.2f} ms  "
              f"peak {r['peak_bytes'] / 2**30:.2f} GiB  saved {r['saved_mb']:.0f} MB  "
              + " ".join(f"{k}={v:.4g}" for k, v in r.items() if k in ("ratio_vs_automodel", "tokens_within_1pct",
                                                                          "same_experts_fraction", "output_rel_diff")))
    print("wrote", path)


if __name__ == "__main__":
    main()
