"""Swap Automodel's MoE for flexep.torch.MoE and train a few steps, expert-parallel over the GPUs.
Run: torchrun --nproc-per-node 2 examples/train_moe_torchrun.py   (PYTHONPATH=build/python after a build)"""
import torch
import torch.distributed as dist

from flexep.torch import BackendConfig, MoE, MoEConfig  # was: nemo_automodel.components.moe.{config,layers}

dist.init_process_group("nccl")
rank, dev = dist.get_rank(), torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
torch.cuda.set_device(dev)
cfg = MoEConfig(n_routed_experts=16, n_shared_experts=1, n_activated_experts=4, n_expert_groups=1, n_limited_groups=1,
                train_gate=True, gate_bias_update_factor=1e-3, aux_loss_coeff=1e-3, score_func="sigmoid",
                route_scale=1.0, dim=256, inter_dim=1024, moe_inter_dim=128, norm_topk_prob=True)
torch.manual_seed(0)  # the same replicated parameters (gate, shared experts) on every rank
moe = MoE(cfg, BackendConfig(dispatcher="torch", dispatcher_num_sms=20), device=dev, group=dist.group.WORLD)
opt = torch.optim.AdamW(moe.parameters(), lr=1e-3)
# the same teacher on every rank; each rank draws its own tokens below
teacher = torch.randn(cfg.dim, cfg.dim, device=dev) / cfg.dim**0.5
for step in range(20):
    x = torch.randn(8, 128, cfg.dim, device=dev, generator=torch.Generator(dev).manual_seed(rank * 1000 + step))
    loss = torch.nn.functional.mse_loss(moe(x.bfloat16()).float(), torch.tanh(x @ teacher))
    opt.zero_grad()
    loss.backward()
    for p in moe.replicated_parameters():  # gate and shared experts: average over the EP group
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    opt.step()
    moe.update_bias()  # Automodel's aux-loss-free balancing, load summed over the group
    if rank == 0 and step % 5 == 0:
        print(f"step {step:2d}  loss {loss.item():.4f}")
dist.destroy_process_group()
