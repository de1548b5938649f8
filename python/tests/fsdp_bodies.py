"""Bodies of the multi-process tests (run by distributed.run_processes on gloo CPU processes)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from automodel_pair import pair


def fsdp_training(rank: int, world: int, which: str, reshard_after_forward: bool, experts_unit: bool, steps: int,
                  config: dict):
    """SGD steps on one MoE layer under FSDP2 (the experts their own unit when experts_unit, as
    Automodel's parallelizer makes them), Automodel's layer or flexep's from the same tensors.
    Returns the losses, which parameters got a gradient at the first step, and the output before
    and after training on a fixed input."""
    torch.manual_seed(0)
    ref, ours = pair(seed=11, **config)
    module = ref if which == "automodel" else ours
    mesh = init_device_mesh("cpu", (world,))
    if experts_unit:
        fully_shard(module.experts, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(100 + rank)
    probe = torch.randn(8, config.get("dim", 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        before = module(probe).clone()
    losses, got_grad = [], None
    for step in range(steps):
        x = torch.randn(12, config.get("dim", 16), generator=g)
        target = torch.randn(12, config.get("dim", 16), generator=g)
        loss = ((module(x) - target) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:
            got_grad = {n: p.grad is not None and bool(torch.count_nonzero(p.grad.full_tensor()
                                                                            if hasattr(p.grad, "full_tensor")
                                                                            else p.grad))
                        for n, p in module.named_parameters()}
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        after = module(probe).clone()
    return {"losses": losses, "got_grad": got_grad, "before": before, "after": after}


def tiny_deepseek_v3(seed: int = 0):
    """Automodel's DeepseekV3ForCausalLM, 2 layers, small dims, float32, initialised by its own code."""
    from transformers import DeepseekV3Config

    from nemo_automodel.components.models.common.utils import BackendConfig
    from nemo_automodel.components.models.deepseek_v3.model import DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                           num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=0, q_lora_rank=16,
                           kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                           max_position_embeddings=64, n_shared_experts=1, routed_scaling_factor=2.5,
                           norm_topk_prob=True, dtype="float32")
    backend = BackendConfig(attn="sdpa", linear="torch", rms_norm="torch", experts="torch", dispatcher="torch")
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg, backend=backend)
    with torch.no_grad():
        model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    return model


def train_tiny_model(rank: int, world: int, use_flexep: bool, steps: int):
    """Automodel's pieces end to end: its DeepSeek-V3 model, its parallelizer (FSDP2 over a `dp` mesh
    of gloo processes), AdamW, `steps` steps of next-token loss on fixed random data, and the gate
    bias update after every step. With use_flexep, flexep's layer is put into the model first."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import flexep.torch.automodel as fa
    from nemo_automodel.components.moe.parallelizer import parallelize_model

    model = tiny_deepseek_v3()
    if use_flexep:
        assert fa.use_flexep(model) == 2
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=torch.float32,
                                cast_forward_inputs=False)
    parallelize_model(model, mesh, None, dp_axis_names=("dp",), mp_policy=fp32, reshard_after_forward=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1234 + rank)
    data = [torch.randint(0, 96, (2, 17), generator=g) for _ in range(4)]
    losses = []
    for step in range(steps):
        ids = data[step % len(data)]
        logits = model(ids[:, :-1])
        logits = logits.logits if hasattr(logits, "logits") else logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        for m in model.modules():
            if type(m).__name__ == "Gate" or type(m).__name__.endswith("Gate"):
                if getattr(m, "bias_update_factor", 0) > 0 and m._cumulative_expert_load is not None:
                    m.update_bias()
        losses.append(loss.item())
    return losses


def ep_state_dict_round_trip(rank: int, world: int):
    """Automodel's expert parallelism (its apply_ep over an `ep` mesh of gloo processes) on a model
    flexep was put into: the experts become DTensor Shard(0) with their global shapes, the
    state_dict round-trips, and a CPU forward names what flexep does not offer there."""
    import flexep.torch.automodel as fa
    from nemo_automodel.components.moe.layers import MoE
    from nemo_automodel.components.moe.parallelizer import apply_ep

    model = tiny_deepseek_v3()
    fa.use_flexep(model)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    apply_ep(model, mesh["ep"])
    experts = next(m for m in model.modules() if isinstance(m, MoE)).experts
    w = experts.gate_and_up_projs
    sd = {k: v.clone() if not hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    changed = {k: (v * 2 if torch.is_floating_point(v) else v) for k, v in sd.items()}
    model.load_state_dict(changed)
    after = model.state_dict()
    equal = all(torch.equal((after[k].to_local() if hasattr(after[k], "to_local") else after[k]),
                            (changed[k].to_local() if hasattr(changed[k], "to_local") else changed[k]))
                for k in changed)
    try:
        model(torch.randint(0, 96, (1, 8)))
        error = ""
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        error = str(e)
    return {"experts_shape": list(w.shape), "local_shape": list(w.to_local().shape),
            "placements": str(w.placements), "round_trip_equal": equal, "forward_error": error}
