"""The parameter-holding submodules of flexep.torch.MoE, shaped and named as NeMo Automodel 0.7.0's
(Gate, FakeBalancedGate, GroupedExperts, MLP): the same parameters, buffers, dtypes, state_dict keys,
attributes that Automodel's tools read (gate.topk, _track_load_balance, _last_expert_load,
_cumulative_expert_load, ...), init_weights and update_bias.

They hold ordinary PyTorch tensors and compute nothing themselves: the MoE layer hands them to the
library at every call (flexep.torch._layer_call). That is what lets FSDP2, meta-device
construction, .to(), load_state_dict(assign=True) and any optimizer treat them as their own.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from flexep import ArgumentError
from flexep.torch.config import BackendConfig, MoEConfig
from flexep.torch.fake_gate import FakeBalancedGate


def _local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The local shard of a DTensor (EP-sharded experts, replicated buffers), or t itself."""
    return t.to_local() if t is not None and hasattr(t, "to_local") else t


def _empty(shape, dtype, device) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device=device)


def is_gated_activation(activation: str) -> bool:
    """Automodel's rule: gated activations keep [gate | up] (or interleaved) columns, 2 * inter wide."""
    return activation in ("swiglu", "swigluoai", "quick_geglu", "geglu")


class Gate(nn.Module):
    """Automodel's Gate: weight [E, dim] (gate_dtype or dtype), optional bias [E], and the fp32
    e_score_correction_bias buffer [E] when the bias is updated or forced. Routing itself runs in the
    library as part of the layer's call; this module keeps the state Automodel keeps around it."""

    def __init__(self, config: MoEConfig, gate_precision: Optional[torch.dtype] = None, *, device=None):
        super().__init__()
        self.dim = config.dim
        self.n_experts = config.n_routed_experts
        self.topk = config.n_activated_experts
        self.softmax_before_topk = config.softmax_before_topk
        self.router_weights_fp32 = config.router_weights_fp32
        self.router_weight_uses_score_correction_bias = config.router_weight_uses_score_correction_bias
        self.n_groups = config.n_expert_groups
        self.topk_groups = config.n_limited_groups
        self.score_func = config.score_func
        self.route_scale = config.route_scale
        self.train_gate = config.train_gate
        self.bias_update_factor = config.gate_bias_update_factor
        self.aux_loss_coeff = config.aux_loss_coeff
        self.norm_topk_prob = config.norm_topk_prob
        self.gate_precision = gate_precision
        dtype = config.param_gate_dtype
        self.weight = nn.Parameter(_empty((config.n_routed_experts, config.dim), dtype, device),
                                   requires_grad=config.train_gate)
        self.bias = (nn.Parameter(_empty((config.n_routed_experts,), dtype, device), requires_grad=config.train_gate)
                     if config.router_bias else None)
        if config.gate_bias_update_factor > 0 or config.force_e_score_correction_bias:
            # fp32: a bf16 correction bias would change which experts win.
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(config.n_routed_experts, dtype=torch.float32, device=device))
        else:
            self.e_score_correction_bias = None
        self.e_score_correction_bias_master = None
        self._cumulative_expert_load: Optional[torch.Tensor] = None
        # Rollout routing replay: Automodel's RouterReplay handle, so its record/replay context
        # managers drive this gate like any of Automodel's (the layer call records and replays).
        self.router_replay = None
        if config.enable_routing_replay:
            try:
                from nemo_automodel.components.moe.router_replay import RouterReplay
            except ImportError as e:
                raise ArgumentError("flexep: invalid argument 'moe.enable_routing_replay': True needs "
                                    "nemo_automodel's RouterReplay (the registry that drives record and replay); "
                                    "install nemo-automodel or set it False") from e
            self.router_replay = RouterReplay()
        self._track_load_balance = False
        self._last_expert_load: Optional[torch.Tensor] = None
        self._last_aux_loss: Optional[torch.Tensor] = None

    def update_bias(self) -> None:
        """Aux-loss-free balancing, as Automodel's Gate.update_bias: the load accumulated over
        training forwards (summed over the bias's DTensor mesh when it has one) moves the correction
        bias by sign(mean - load) * factor through an fp32 master copy."""
        update_gate_bias(self)

    def init_weights(self, buffer_device: torch.device, init_std: float = 0.02) -> None:
        with torch.device(buffer_device), torch.no_grad():
            _local(self.weight).normal_(mean=0.0, std=init_std)
            if self.bias is not None:
                _local(self.bias).zero_()
            if self.e_score_correction_bias is not None:
                _local(self.e_score_correction_bias).zero_()

    def extra_repr(self) -> str:
        return f"experts={self.n_experts}, topk={self.topk}, score_func={self.score_func}"


def update_gate_bias(gate: nn.Module) -> None:
    """Automodel's update_bias on any gate holding its attributes (flexep's Gate, or Automodel's
    Gate inside a model flexep was put into)."""
    assert gate.train_gate and gate.bias_update_factor > 0, "Gate bias update is disabled"
    assert gate.training, "Gate bias update is only supported during training"
    assert gate._cumulative_expert_load is not None, (
        "Score correction bias cannot be updated without the current expert load")
    load = gate._cumulative_expert_load
    gate._cumulative_expert_load = None
    load = _sum_over_group(load, getattr(gate, "_flexep_load_group", None))
    bias = gate.e_score_correction_bias
    dtensor = hasattr(bias, "device_mesh")
    if dtensor:
        from torch.distributed.tensor import DTensor, Partial, Replicate

        load = DTensor.from_local(load, device_mesh=bias.device_mesh,
                                  placements=[Partial()] * bias.device_mesh.ndim).full_tensor()
    load = load.float()
    update = torch.sign(load.mean() - load)
    if dtensor:
        update = DTensor.from_local(update, device_mesh=bias.device_mesh,
                                    placements=[Replicate()] * bias.device_mesh.ndim).redistribute(
                                        placements=bias.placements)
    with torch.no_grad():
        if gate.e_score_correction_bias_master is None:
            gate.e_score_correction_bias_master = bias.clone().detach().float()
        gate.e_score_correction_bias_master += update * gate.bias_update_factor
        bias.copy_(gate.e_score_correction_bias_master)


def _sum_over_group(load: torch.Tensor, group) -> torch.Tensor:
    """The expert load summed over flexep's own EP group (a MoE built with group=...): a
    torch.distributed group, or simulated ranks (HostRank). Automodel sums over the bias's DTensor
    mesh instead, which update_gate_bias does as well."""
    if group is None:
        return load
    from flexep.torch.dispatcher import HostRank

    if isinstance(group, HostRank):
        total = load.to(torch.float64).contiguous()
        group.process_group.all_reduce_sum(total, "gate bias update (expert load)")
        return total.to(load.dtype)
    total = load.clone()
    torch.distributed.all_reduce(total, group=group)
    return total


class GroupedExperts(nn.Module):
    """Automodel's GroupedExperts parameters: gate_and_up_projs [E, expert_dim, up] (up = 2*inter for
    gated activations), down_projs [E, inter, expert_dim], optional biases. `num_experts` is E, or
    this rank's E_local when the module is built for one rank of an EP group (flexep's own layer);
    Automodel's parallelizer instead shards the full tensors as DTensor Shard(0)."""

    def __init__(self, config: MoEConfig, num_experts: Optional[int] = None, *, device=None):
        super().__init__()
        E = config.n_routed_experts if num_experts is None else num_experts
        up = config.moe_inter_dim * 2 if is_gated_activation(config.expert_activation) else config.moe_inter_dim
        self.n_routed_experts = config.n_routed_experts
        self.expert_bias = config.expert_bias
        self.gate_and_up_projs = nn.Parameter(_empty((E, config.expert_dim, up), config.dtype, device))
        self.down_projs = nn.Parameter(_empty((E, config.moe_inter_dim, config.expert_dim), config.dtype, device))
        if config.expert_bias:
            self.gate_up_proj_bias = nn.Parameter(_empty((E, up), config.dtype, device))
            self.down_proj_bias = nn.Parameter(_empty((E, config.expert_dim), config.dtype, device))
        else:
            self.gate_up_proj_bias = None
            self.down_proj_bias = None

    def forward(self, x: torch.Tensor, token_mask, weights, indices=None) -> torch.Tensor:
        """Runs the whole layer's library call (the MoE module passes a LayerCall as `weights`)."""
        from flexep.torch._layer_call import LayerCall, run_experts

        if not isinstance(weights, LayerCall):
            raise TypeError("flexep: GroupedExperts runs inside its MoE layer's call (router, dispatch, experts, "
                            "combine and shared experts in one library call); call the MoE module instead")
        return run_experts(self, x, weights)

    def init_weights(self, buffer_device: torch.device, init_std: float = 0.02) -> None:
        with torch.device(buffer_device), torch.no_grad():
            _local(self.gate_and_up_projs).normal_(mean=0.0, std=init_std)
            _local(self.down_projs).normal_(mean=0.0, std=init_std)
            if self.expert_bias:
                _local(self.gate_up_proj_bias).zero_()
                _local(self.down_proj_bias).zero_()


class MLP(nn.Module):
    """Automodel's MLP for the shared experts: nn.Linear gate_proj / up_proj [inter, dim] (gate_proj
    only for swiglu) and down_proj [dim, inter], biases when expert_bias."""

    def __init__(self, dim: int, inter_dim: int, *, dtype: torch.dtype, activation: str = "swiglu",
                 bias: bool = False, swiglu_limit: float = 0.0, device=None):
        super().__init__()
        if activation not in ("swiglu", "relu2"):
            raise ValueError(f"Unsupported activation: {activation}. Choose 'swiglu' or 'relu2'.")
        self.activation = activation
        self.is_gated = is_gated_activation(activation)
        self.swiglu_limit = float(swiglu_limit)
        kw = dict(bias=bias, dtype=dtype, device=device)
        self.up_proj = nn.Linear(dim, inter_dim, **kw)
        self.gate_proj = nn.Linear(dim, inter_dim, **kw) if self.is_gated else None
        self.down_proj = nn.Linear(inter_dim, dim, **kw)

    def init_weights(self, buffer_device: torch.device, init_std: float = 0.02) -> None:
        with torch.device(buffer_device), torch.no_grad():
            # As Automodel's: the weights only; the biases keep nn.Linear's own initialisation.
            for lin in (self.down_proj, self.up_proj, self.gate_proj):
                if lin is not None:
                    _local(lin.weight).normal_(mean=0.0, std=init_std)


def make_gate(config: MoEConfig, backend: BackendConfig, device=None) -> nn.Module:
    if backend.fake_balanced_gate:
        return FakeBalancedGate(config, noise=backend.fake_gate_noise)
    return Gate(config, gate_precision=backend.gate_precision, device=device)
