"""Automodel's FakeBalancedGate (a gate for benchmarks, with no parameters) and its noisy routing,
drawn from torch's generator as Automodel draws it."""

from __future__ import annotations

import torch
from torch import nn

from flexep.torch.config import MoEConfig


class FakeBalancedGate(nn.Module):
    """Automodel's FakeBalancedGate (benchmarks): no parameters. noise 0: token t goes to experts
    (t*k + j) mod (E - skip) + skip with weights 1/k (computed on the device by the library); noise
    > 0: routes drawn from torch's generator seeded by the first four input values, exactly as
    Automodel draws them (fake_gate_routing)."""

    def __init__(self, config: MoEConfig, skip_first_n_experts: int = 0, noise: float = 0.0):
        super().__init__()
        self.n_routed_experts = config.n_routed_experts
        self.n_activated_experts = config.n_activated_experts
        self.skip_first_n_experts = skip_first_n_experts
        self.noise = noise
        self.bias_update_factor = 0.0

    def update_bias(self) -> None:
        pass

    def init_weights(self, buffer_device: torch.device, init_std: float = 0.02) -> None:
        pass


def fake_gate_routing(gate: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FakeBalancedGate's noisy routing for x [T, dim]: (indices [T, k] int64, weights [T, k] f32).
    The seed comes from the input's first four values, so an activation-checkpoint recompute routes
    the same way; the draws are torch's, so the routes are Automodel's bit for bit."""
    n, k = x.size(0), gate.n_activated_experts
    available = gate.n_routed_experts - gate.skip_first_n_experts
    seed = int(x.view(-1)[:4].to(torch.float32).sum().item() * 1e6) & 0x7FFFFFFF
    gen = torch.Generator(device=x.device).manual_seed(seed)
    uniform = torch.ones(n, k, device=x.device) / k
    raw = torch.rand(n, k, device=x.device, generator=gen)
    raw = raw / raw.sum(dim=-1, keepdim=True)
    weights = (1 - gate.noise) * uniform + gate.noise * raw
    popularity = torch.randn(available, device=x.device, generator=gen) * gate.noise * 0.1
    scores = torch.rand(n, available, device=x.device, generator=gen) + popularity
    indices = scores.topk(k, dim=-1)[1] + gate.skip_first_n_experts
    # Automodel hands the experts weights.type_as(x); they use them as float32.
    return indices, weights.type_as(x).float()
