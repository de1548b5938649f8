"""MoE(nn.Module): NeMo Automodel 0.7.0's MoE layer (gate, grouped experts, dispatcher, shared experts),
computed by the C++ library: the CPU reference layer, or the CUDA layer on a GPU.

The module tree, parameter names, shapes, dtypes and state_dict keys are Automodel's (modules.py);
PyTorch owns every tensor, and each forward hands the library the tensors the module holds at that
moment (_layer_call.py). Only shapes, names and autograd plumbing live here.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from flexep import _flexep
from flexep.torch._layer_call import MoEAuxLossAutoScaler, last_routing, run_moe
from flexep.torch.config import BackendConfig, MoEConfig
from flexep.torch.dispatcher import HostRank
from flexep.torch.modules import MLP, Gate, GroupedExperts, make_gate

__all__ = ["MoE", "Gate", "MoEAuxLossAutoScaler"]


def _ep_size(group) -> int:
    if group is None:
        return 1
    if isinstance(group, HostRank):
        return group.size()
    return dist.get_world_size(group)


class MoE(nn.Module):
    """Automodel's MoE: forward(x, padding_mask=None, cp_mesh=None) -> tensor of x's shape.

    config / backend: flexep's MoEConfig / BackendConfig or Automodel's own (converted field by
    field). device: where the parameters are made (default: the current default device, so
    construction under torch.device("meta") makes meta tensors; call to_empty() and init_weights()
    later). group: None (EP size 1, or the mesh of DTensor-sharded experts), a torch.distributed
    group (GPU: this module then holds this rank's E/R experts), or HostRank(world, rank) for
    simulated ranks on the CPU. The parameters are initialised as Automodel's init_weights does
    (normal(0, init_std), biases zero) unless they are on the meta device.
    Computation follows the input: a CUDA input runs the CUDA layer (bf16), a CPU input the CPU
    reference (float64 when x is float64, else float32 arithmetic; bf16 inputs and parameters are
    accepted there too).
    """

    def __init__(self, config, backend=None, *, device=None, group=None, init_std: float = 0.02,
                 pad_multiple: int = 1):
        super().__init__()
        config = MoEConfig.from_automodel(config)
        backend = BackendConfig.from_automodel(backend) if backend is not None else BackendConfig()
        if group is not None and not isinstance(group, HostRank) and not (dist.is_available()
                                                                          and dist.is_initialized()):
            raise _flexep.ArgumentError("flexep: invalid argument 'group': a torch.distributed group needs "
                                        "torch.distributed initialised; for simulated CPU ranks pass "
                                        "HostRank(world, rank)")
        ep_size = _ep_size(group)
        # Again here: a config's fields may have changed since it was made and checked.
        _flexep.config.check_moe(config._cpp_json())
        _flexep.config.check_backend(backend._cpp_json())
        _flexep.config.check_ep(config._cpp_json(), ep_size)
        if not (isinstance(init_std, (int, float)) and math.isfinite(init_std) and init_std >= 0):
            raise _flexep.ArgumentError(f"flexep: invalid argument 'init_std': {init_std!r}; allowed: a finite "
                                        "number >= 0")
        if type(pad_multiple) is not int or not 1 <= pad_multiple <= 65536:
            raise _flexep.ArgumentError(f"flexep: invalid argument 'pad_multiple': {pad_multiple!r}; allowed: an int "
                                        "from 1 to 65536")
        self.backend = backend
        self.dim = config.dim
        self.n_routed_experts = config.n_routed_experts
        self.n_activated_experts = config.n_activated_experts
        self._flexep_config, self._flexep_backend = config, backend
        self._flexep_group, self._flexep_pad_multiple, self._flexep_warned = group, pad_multiple, set()

        self.gate = make_gate(config, backend, device)
        self.gate._flexep_load_group = group if ep_size > 1 else None
        self.experts = GroupedExperts(config, config.n_routed_experts // ep_size, device=device)
        if config.n_shared_experts > 0:
            inter = config.n_shared_experts * (config.shared_expert_inter_dim or config.moe_inter_dim)
            self.shared_experts = MLP(config.dim, inter, dtype=config.dtype, activation=config.shared_expert_activation,
                                      bias=config.expert_bias, swiglu_limit=config.swiglu_limit, device=device)
            self.shared_expert_gate = (nn.Linear(config.dim, 1, bias=False, dtype=config.dtype, device=device)
                                       if config.shared_expert_gate else None)
        else:
            self.shared_experts = None
            self.shared_expert_gate = None
        if config.moe_latent_size is not None:
            # Automodel's latent projections: the routed experts work in moe_latent_size; the gate
            # and the shared experts read x.
            latent = config.moe_latent_size
            self.fc1_latent_proj = nn.Linear(config.dim, latent, bias=config.expert_bias, dtype=config.dtype,
                                             device=device)
            self.fc2_latent_proj = nn.Linear(latent, config.dim, bias=config.expert_bias, dtype=config.dtype,
                                             device=device)
        else:
            self.fc1_latent_proj = None
            self.fc2_latent_proj = None
        self.cp_mesh = None
        if self.experts.gate_and_up_projs.device.type != "meta":
            self.init_weights(self.experts.gate_and_up_projs.device, init_std)

    @property
    def config(self) -> MoEConfig:
        return self._flexep_config

    def forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None, cp_mesh=None) -> torch.Tensor:
        if (cp_mesh if cp_mesh is not None else self.cp_mesh) is not None:
            raise _flexep.ArgumentError("flexep: invalid argument 'cp_mesh': context parallelism is not offered "
                                        "by flexep's layer; allowed: None")
        return run_moe(self, x, padding_mask)

    def init_weights(self, buffer_device: torch.device, init_std: float = 0.02) -> None:
        """Automodel's init_weights: normal(0, init_std) weights, zero biases and correction bias."""
        for m in (self.gate, self.experts, self.shared_experts):
            if m is not None:
                m.init_weights(buffer_device, init_std)
        with torch.no_grad():
            for proj in (self.fc1_latent_proj, self.fc2_latent_proj):
                if proj is not None:
                    proj.weight.normal_(mean=0.0, std=init_std)
                    if proj.bias is not None:
                        proj.bias.zero_()

    def update_bias(self) -> None:
        """Automodel's gate.update_bias() (aux-loss-free balancing)."""
        self.gate.update_bias()

    def last_routing(self):
        """(indices [T, k], weights [T, k]) of the last forward (flexep.torch.last_routing)."""
        return last_routing(self)

    def replicated_parameters(self):
        """Parameters every EP rank holds whole (gate, shared experts): with a group given at
        construction their gradients are this rank's contribution and need an all-reduce over the
        group, like any data-parallel gradient."""
        return [p for name, p in self.named_parameters() if not name.startswith("experts.")]

    def extra_repr(self) -> str:
        c = self.config
        return (f"dim={c.dim}, experts={c.n_routed_experts}, topk={c.n_activated_experts}, "
                f"dispatcher={self.backend.dispatcher}")
