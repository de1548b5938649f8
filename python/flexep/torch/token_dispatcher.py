"""NeMo Automodel 0.7.0's MoEFlexTokenDispatcher and TokenDispatcherConfig
(nemo_automodel.components.moe.megatron.token_dispatcher) by their own names and signatures, over a
flexep dispatcher.

Whatever `moe_flex_dispatcher_backend` names (deepep, hybridep), the dispatcher's contract at its
surface is the same: token_permutation2 returns the tokens grouped by local expert, the tokens per
expert and the permuted probs, and token_unpermutation sums each token's expert outputs back. flexep
serves both names with its expert-major dispatchers (`hybridep` on GPUs; the `host` backend when the
group is HostRank(world, rank)); "uccl_ep" is refused with what flexep offers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from flexep import _flexep
from flexep.torch import dispatcher as _dispatchers
from flexep.torch import functions as F
from flexep.torch.config import BackendConfig
from flexep.torch.dispatcher import HostRank


@dataclass
class TokenDispatcherConfig:
    """Automodel's TokenDispatcherConfig, every field with its default. flexep reads
    moe_flex_dispatcher_backend, moe_router_topk, num_moe_experts, moe_router_expert_pad_multiple,
    moe_deepep_num_sms / moe_hybridep_num_sms, moe_hybridep_num_sms_preprocessing and
    moe_share_token_dispatcher; moe_expert_capacity_factor other than None is refused (flexep's
    dispatch is dropless unless asked for budget mode); the rest have no flexep counterpart."""

    moe_enable_deepep: bool = True
    moe_permute_fusion: bool = False
    moe_expert_capacity_factor: Optional[float] = None
    moe_router_topk: int = 2
    moe_router_expert_pad_multiple: Optional[int] = None
    num_moe_experts: int = 64
    moe_router_dtype: str = "fp32"
    moe_flex_dispatcher_backend: str = "deepep"
    moe_deepep_num_sms: int = 20
    moe_hybridep_num_sms: int = 24
    moe_hybridep_permute_fusion: bool = False
    moe_hybridep_compact_routing: bool = False
    moe_hybridep_num_sms_preprocessing: Optional[int] = None
    moe_hybridep_num_blocks_permute: Optional[int] = None
    moe_hybridep_num_blocks_unpermute: Optional[int] = None
    moe_share_token_dispatcher: bool = True
    moe_deepep_async_dispatch: bool = False
    moe_benchmark_static_routing: bool = False


class MoEFlexTokenDispatcher:
    """Automodel's MoEFlexTokenDispatcher(num_local_experts, local_expert_indices, config, ep_group):
    token_permutation2(hidden_states, num_local_tokens, token_probs, token_indices) ->
    (tokens [N, H], tokens_per_expert [E_local], permuted_probs [N, 1]) and
    token_unpermutation(expert_out) -> hidden_states of the input's shape. Every call is collective
    over ep_group; gradients flow back through both (the handle of a dispatch lives in autograd)."""

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config: TokenDispatcherConfig,
                 ep_group):
        backend = config.moe_flex_dispatcher_backend
        if backend not in ("deepep", "hybridep"):
            raise _flexep.ArgumentError(f"flexep: invalid argument 'config.moe_flex_dispatcher_backend': '{backend}' "
                                        "is not offered; allowed: deepep, hybridep (both served by flexep's "
                                        "expert-major dispatchers)")
        if config.moe_expert_capacity_factor is not None:
            raise _flexep.ArgumentError("flexep: invalid argument 'config.moe_expert_capacity_factor': "
                                        f"{config.moe_expert_capacity_factor} (token dropping) is not offered; "
                                        "allowed: None (dropless)")
        if not hasattr(ep_group, "size") and not (torch.distributed.is_available()
                                                  and torch.distributed.is_initialized()):
            raise _flexep.ArgumentError(f"flexep: invalid argument 'ep_group': {ep_group!r}, and torch.distributed "
                                        "is not initialised; allowed: a process group (or HostRank for simulated "
                                        "CPU ranks)")
        self.config, self.group = config, ep_group
        self.ep_size = ep_group.size() if hasattr(ep_group, "size") else torch.distributed.get_world_size(ep_group)
        self.tp_size = 1
        self.num_local_experts, self.local_expert_indices = num_local_experts, list(local_expert_indices)
        if self.ep_size * num_local_experts != config.num_moe_experts:
            raise _flexep.ArgumentError(
                f"flexep: invalid argument 'num_local_experts': {num_local_experts} experts on each of {self.ep_size} "
                f"ranks do not make config.num_moe_experts = {config.num_moe_experts}")
        sms = config.moe_hybridep_num_sms if backend == "hybridep" else config.moe_deepep_num_sms
        if isinstance(ep_group, HostRank):
            cfg = BackendConfig(dispatcher="host")
        else:
            cfg = BackendConfig(dispatcher="hybridep", dispatcher_num_sms=int(sms),
                                hybridep_preprocess_sms=int(config.moe_hybridep_num_sms_preprocessing or 0))
        self._backend = cfg
        self._dispatcher = None
        self._handle, self._hidden_shape = None, None
        self.tokens_per_expert = None

    def _get_dispatcher(self, x: torch.Tensor):
        if self._dispatcher is None:
            owner = None if self.config.moe_share_token_dispatcher else self
            self._dispatcher = _dispatchers.get_dispatcher(
                self._backend, self.config.num_moe_experts, self.group, x.device, hidden=x.size(-1),
                max_tokens_per_rank=max(x.size(0), 1), max_topk=self.config.moe_router_topk, owner=owner)
        return self._dispatcher

    def token_permutation2(self, hidden_states: torch.Tensor, num_local_tokens: int, token_probs: torch.Tensor,
                           token_indices: torch.Tensor):
        del num_local_tokens  # implied by hidden_states (kept for Automodel's signature)
        self._hidden_shape = hidden_states.shape
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        pad = int(self.config.moe_router_expert_pad_multiple or 1)
        tokens, probs, tpe, self._handle = F.dispatch(self._get_dispatcher(x), x, token_indices,
                                                      token_probs.float(), pad_multiple=pad)
        self.tokens_per_expert = tpe
        return tokens, tpe, probs.unsqueeze(-1)

    def token_unpermutation(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self._handle is None:
            raise _flexep.ArgumentError("flexep: invalid argument 'hidden_states': token_unpermutation needs a "
                                        "token_permutation2 first")
        out = F.combine(self._dispatcher, self._handle, hidden_states)
        self._handle = None  # consumed, as Automodel's managers clear it; backward keeps its own in ctx
        return out.view(self._hidden_shape)
