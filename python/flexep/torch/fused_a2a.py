"""NeMo Automodel 0.7.0's flex-dispatcher functions (nemo_automodel.components.moe.megatron.fused_a2a)
by their own names and signatures, computed by flexep's dispatchers.

- hybrid_ep_dispatch / hybrid_ep_combine: HybridEP's expert-major contract (dense routing_map and
  probs [T, E], or compact topk_idx [T, k]); served by flexep's `hybridep` backend on GPUs and by the
  `host` backend for simulated CPU ranks (group=HostRank(world, rank)).
- init_hybrid_ep_buffer / reset_hybrid_ep_buffer: make the group's dispatcher now / drop it.
- set_deepep_num_sms: the SM count of dispatchers made afterwards.
- fused_dispatch / fused_combine: DeepEP's rank-major contract; served by flexep's `deepep` backend
  over a torch.distributed group (any size, one rank included) and by the `host` backend for
  simulated CPU ranks.

The handle they return is flexep's: it carries the dispatcher, so combine needs nothing else.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from flexep import _flexep
from flexep.torch import dispatcher as _dispatchers
from flexep.torch import functions as F
from flexep.torch.config import BackendConfig
from flexep.torch.dispatcher import HostRank


class HybridEPHandle:
    """What hybrid_ep_dispatch leaves for hybrid_ep_combine: the dispatcher and its handle."""

    __slots__ = ("dispatcher", "handle", "pad_multiple")

    def __init__(self, dispatcher, handle, pad_multiple):
        self.dispatcher, self.handle, self.pad_multiple = dispatcher, handle, pad_multiple


# The buffer init_hybrid_ep_buffer made: (group key, sizes and SM counts) -> dispatcher.
_buffer: dict = {}


def _group_size(group) -> int:
    return group.size() if isinstance(group, HostRank) else dist.get_world_size(group)


def _dispatcher(group, num_experts: int, device: torch.device, hidden: int, seq_len: int, topk: int,
                dispatch_sms: int, combine_sms: int, preprocess_sms: Optional[int]):
    if isinstance(group, HostRank):
        return _dispatchers.get_dispatcher(BackendConfig(dispatcher="host"), num_experts, group)
    if not _buffer:
        init_hybrid_ep_buffer(group, hidden, seq_len, num_experts // _group_size(group), dispatch_sms, combine_sms,
                              False, preprocess_sms, _topk=topk, _device=device)
    return next(iter(_buffer.values()))


def init_hybrid_ep_buffer(group, hidden_dim: int, seq_len: int, num_local_experts: int, num_sms_dispatch_api: int,
                          num_sms_combine_api: int, fp8_dispatch: bool, num_sms_preprocessing_api: Optional[int] = None,
                          num_blocks_permute: Optional[int] = None, num_blocks_unpermute: Optional[int] = None, *,
                          _topk: int = 0, _device: Optional[torch.device] = None) -> None:
    """Automodel's init_hybrid_ep_buffer: sizes and creates the group's hybridep dispatcher now
    (buffers for seq_len tokens per rank of hidden_dim; a larger call later is an error that says
    so). num_blocks_permute / num_blocks_unpermute have no flexep equivalent (its permute is fused
    into the dispatch and combine kernels) and are accepted without effect."""
    del num_blocks_permute, num_blocks_unpermute
    if fp8_dispatch:
        raise _flexep.ArgumentError("flexep: invalid argument 'fp8_dispatch': True is not offered (HybridEP "
                                    "dispatcher does not support fp8 dispatch); allowed: False")
    ep = _group_size(group)
    backend = BackendConfig(dispatcher="hybridep", hybridep_dispatch_sms=int(num_sms_dispatch_api),
                            hybridep_combine_sms=int(num_sms_combine_api),
                            hybridep_preprocess_sms=int(num_sms_preprocessing_api or 0))
    reset_hybrid_ep_buffer()
    _buffer["dispatcher"] = _dispatchers.get_dispatcher(
        backend, num_local_experts * ep, group, _device, hidden=hidden_dim, max_tokens_per_rank=seq_len,
        max_topk=_topk or num_local_experts * ep, owner=_buffer)


def reset_hybrid_ep_buffer() -> None:
    """Automodel's reset_hybrid_ep_buffer: drops the dispatcher init_hybrid_ep_buffer made."""
    _buffer.clear()


def set_deepep_num_sms(num_sms: int) -> None:
    """Automodel's set_deepep_num_sms (DeepEP's Buffer.set_num_sms): the SM count of the dispatchers
    flexep makes from now on."""
    _dispatchers.set_num_sms(num_sms)


def hybrid_ep_dispatch(x: torch.Tensor, routing_map: Optional[torch.Tensor], probs: torch.Tensor, group,
                       num_local_experts: int, num_sms_dispatch_api: int = 24, num_sms_combine_api: int = 24,
                       num_permuted_tokens: Optional[int] = None, pad_multiple: Optional[int] = None, *,
                       topk_idx: Optional[torch.Tensor] = None, num_experts: Optional[int] = None,
                       fuse_permute: bool = False, num_sms_preprocessing_api: Optional[int] = None,
                       num_blocks_permute: Optional[int] = None, num_blocks_unpermute: Optional[int] = None):
    """Automodel's hybrid_ep_dispatch: x [T, H], routing_map [T, E] bool (or topk_idx [T, k] with -1
    for none, when routing_map is None), probs [T, E]. Returns (dispatched_hidden [N, H] grouped by
    local expert, dispatched_probs [N] float32, None (no FP8 scales), tokens_per_expert [E_local],
    handle). num_permuted_tokens fixes N in advance (flexep's budget mode: no host sync).
    fuse_permute has no effect: flexep's dispatch always writes the expert-major rows directly.
    Differentiable in x and probs (the probs' gradient is dense [T, E], as Automodel's)."""
    del fuse_permute, num_blocks_permute, num_blocks_unpermute
    E = num_experts if num_experts is not None else probs.size(-1)
    topk = topk_idx.size(1) if topk_idx is not None else E
    d = _dispatcher(group, E, x.device, x.size(-1), x.size(0), topk, num_sms_dispatch_api, num_sms_combine_api,
                    num_sms_preprocessing_api)
    ranks = d.world_size if d is not None else 1
    if num_local_experts != E // ranks:
        raise _flexep.ArgumentError(f"flexep: invalid argument 'num_local_experts': {num_local_experts!r}, but "
                                    f"{E} experts on {ranks} ranks are {E // ranks} per rank")
    opts = dict(pad_multiple=int(pad_multiple or 1))
    if num_permuted_tokens is not None:
        opts.update(mode="budget", budget_rows=int(num_permuted_tokens))
    holder = F._HandleHolder()
    if routing_map is not None:
        out = F._DispatchWithHandle.apply(x, probs.float(), None, routing_map, d, opts, holder)
    else:
        if topk_idx is None:
            raise _flexep.ArgumentError("flexep: invalid argument 'routing_map': None needs topk_idx (compact "
                                        "routing); pass one of them")
        valid = topk_idx >= 0
        weights = probs.float().gather(1, topk_idx.clamp(min=0)) * valid  # autograd scatters back to [T, E]
        out = F._DispatchWithHandle.apply(x, weights, topk_idx, None, d, opts, holder)
    tokens, tprobs, tpe, _ = out
    return tokens, tprobs, None, tpe, HybridEPHandle(d, holder.handle, opts["pad_multiple"])


def hybrid_ep_combine(x: torch.Tensor, handle: HybridEPHandle, num_permuted_tokens: Optional[int] = None,
                      pad_multiple: Optional[int] = None, *, fuse_permute: bool = False) -> torch.Tensor:
    """Automodel's hybrid_ep_combine: expert outputs [N, H] -> [T, H] in token order (the unweighted
    sum of each token's rows); backward re-dispatches along the saved handle."""
    del num_permuted_tokens, pad_multiple, fuse_permute
    if not isinstance(handle, HybridEPHandle):
        raise _flexep.ArgumentError("flexep: invalid argument 'handle': expected what hybrid_ep_dispatch returned, "
                                    f"got {type(handle).__name__}")
    return F.combine(handle.dispatcher, handle.handle, x)


class DeepEPHandle:
    """What fused_dispatch returns as its handle: the dispatcher and the library's handle."""

    def __init__(self, dispatcher, handle):
        self.dispatcher, self.handle = dispatcher, handle


def fused_dispatch(x, token_indices, token_probs, num_experts, group, async_finish=False,
                   allocate_on_comm_stream=False):
    """Automodel's fused_dispatch (DeepEP normal mode, rank-major output): (recv_x [N,H],
    recv_token_indices [N,k] int64 local ids with -1 elsewhere, recv_token_probs [N,k] float32,
    tokens_per_expert (a CPU int64 tensor, as Automodel's), handle). Differentiable in x and
    token_probs. async_finish / allocate_on_comm_stream: flexep's calls are stream-ordered, so they
    change nothing. A torch.distributed group runs flexep's deepep backend (its buffer sized as
    dispatcher.deepep_buffer says); group=HostRank(world, rank) the host backend's simulated ranks."""
    del async_finish, allocate_on_comm_stream
    if isinstance(group, HostRank):
        d = _dispatchers.get_dispatcher(BackendConfig(dispatcher="host"), int(num_experts), group)
    else:
        if not x.is_cuda:
            raise _flexep.ArgumentError(
                f"flexep: invalid argument 'x': a tensor on {x.device}; fused_dispatch over a torch.distributed "
                "group runs flexep's deepep backend, which takes CUDA tensors (simulated CPU ranks: "
                "group=HostRank(world, rank))")
        # The buffer is sized from x's rows and token_indices' columns: their ranks first, named.
        for name, t in (("x", x), ("token_indices", token_indices)):
            if t.dim() != 2:
                raise _flexep.ArgumentError(
                    f"flexep: invalid argument '{name}': a tensor of shape {tuple(t.shape)}; fused_dispatch takes "
                    "it 2-D ([T, H] for x, [T, k] for token_indices)")
        d = _dispatchers.deepep_buffer(group, int(num_experts), x, token_indices.size(1))
    holder = F._HandleHolder()
    recv_x, recv_idx, recv_w, tpe, _ = F._RankMajorDispatch.apply(x, token_probs.float(), token_indices, d, {},
                                                                  holder)
    return recv_x, recv_idx, recv_w, tpe.cpu(), DeepEPHandle(d, holder.handle)


def fused_combine(x, group, handle, async_finish=False, allocate_on_comm_stream=False):
    """Automodel's fused_combine (DeepEP normal mode): x [N,H], one row per received token (the
    experts' rows already summed), -> (combined_x [T,H], None), the sum over the ranks in
    ascending order; backward re-dispatches along the handle."""
    del group, async_finish, allocate_on_comm_stream
    if not isinstance(handle, DeepEPHandle):
        raise _flexep.ArgumentError("flexep: invalid argument 'handle': expected what fused_dispatch returned, "
                                    f"got {type(handle).__name__}")
    return F.combine(handle.dispatcher, handle.handle, x), None
