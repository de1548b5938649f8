"""Dispatchers from Python: the communicator of a torch.distributed group, the dispatcher cache
(Automodel's process-global managers), and Automodel's flex-dispatcher call names.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from flexep import _flexep
from flexep.torch import functions as F
from flexep.torch.config import BackendConfig

# Automodel's `torch` dispatcher is our `alltoall`; `host` is the CPU reference.
_GPU_BACKEND_NAMES = {"torch": "alltoall", "alltoall": "alltoall", "hybridep": "hybridep", "deepep": "deepep"}

_communicators: dict = {}
_dispatchers: dict = {}
# fused_dispatch's deepep dispatchers: (group, E, H, k) -> (tokens per rank its windows hold, dispatcher).
_deepep_buffers: dict = {}
_num_sms: Optional[int] = None


class HostRank:
    """One simulated rank of a host world (CPU): MoE(..., group=HostRank(world, r)) on thread r."""

    def __init__(self, world: "_flexep.HostWorld", rank: int):
        self.world, self.rank = world, rank
        self.process_group = _flexep.HostProcessGroup(world, rank)

    def size(self) -> int:
        return self.world.size


def _group_key(group) -> int:
    return id(group if group is not None else dist.group.WORLD)


def _torch_comm_ptr(group, device: torch.device) -> int:
    """The group's ncclComm_t where PyTorch exposes it (ProcessGroupNCCL._comm_ptr), else 0."""
    try:
        pg = group if group is not None else dist.group.WORLD
        backend = pg._get_backend(device)
        return int(backend._comm_ptr()) if hasattr(backend, "_comm_ptr") else 0
    except Exception:  # noqa: BLE001 - any failure means "not exposed": fall back to our own
        return 0


def create_communicator(group=None, device: Optional[torch.device] = None, *, reuse_nccl: bool = False,
                        timeout_seconds: float = 300.0):
    """flexep's NCCL communicator for a torch.distributed group (collective over the group).

    By default flexep creates its own ncclComm_t from a unique id that rank 0 makes and broadcasts over
    `group` (so its non-blocking mode and deadline waits are its own). With reuse_nccl=True it borrows
    the group's NCCL communicator when PyTorch exposes it (ProcessGroupNCCL._comm_ptr(); the group must
    have run a collective, or be created with device_id, so the comm exists), and falls back to a new
    one otherwise. The NCCL flexep was built against must be the one PyTorch loads (checked at start).
    """
    if not _flexep.HAS_CUDA:
        raise _flexep.Error("flexep: this build has no CUDA (build with FLEXEP_CUDA=ON)")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    key = (_group_key(group), device.index)
    if key in _communicators:
        return _communicators[key]
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    comm = None
    if reuse_nccl:
        ptr = _torch_comm_ptr(group, device)
        if ptr:
            comm = _flexep.Communicator.borrow(ptr, device.index, timeout_seconds)
    if comm is None:
        uid = [_flexep.Communicator.new_unique_id() if rank == 0 else None]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(uid, src=src, group=group)
        comm = _flexep.Communicator.create(uid[0], rank, size, device.index, timeout_seconds)
    _communicators[key] = comm
    return comm


def set_num_sms(num_sms: int) -> None:
    """Automodel's set_deepep_num_sms: the SM count of dispatchers created from now on (process-wide)."""
    global _num_sms
    if type(num_sms) is not int or not 0 <= num_sms <= 1024:  # bool and '16' are not SM counts
        raise _flexep.ArgumentError(f"flexep: invalid argument 'num_sms': {num_sms!r}; allowed: an int from 0 to "
                                    "1024 (0 = the backend's default)")
    _num_sms = num_sms


def get_dispatcher(backend: BackendConfig, num_experts: int, group=None, device: Optional[torch.device] = None,
                   hidden: int = 0, max_tokens_per_rank: int = 0, max_topk: int = 0, owner=None):
    """The process-wide dispatcher of (backend, group, E), created on first use and shared by every
    layer (Automodel's shared managers); backward state lives in autograd ctx, never here.

    CPU: a HostRank group gives the host backend; no group means EP size 1 (returns None: the layer's
    local path). GPU: EP size 1 returns None too; otherwise the backend named by backend.dispatcher.

    hybridep sizes its buffers once (hidden, max_tokens_per_rank, max_topk are required), and its
    dispatch outputs are views of those buffers, valid until the next dispatch on the same
    dispatcher: a layer that keeps its dispatched rows for backward passes itself as `owner` so it
    gets a dispatcher of its own.
    """
    if isinstance(group, HostRank):
        key = ("host", id(group.world), group.rank, num_experts)
        if key not in _dispatchers:
            _dispatchers[key] = _flexep.make_host_dispatcher(group.world, group.rank, num_experts)
        return _dispatchers[key]
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size(group) == 1:
        return None
    if backend.dispatcher == "host":
        raise _flexep.ArgumentError("flexep: invalid argument 'backend.dispatcher': 'host' runs simulated ranks on "
                                    "the CPU (pass group=HostRank(world, rank)); a torch.distributed group needs "
                                    "'torch', 'hybridep' or 'deepep'")
    name = _GPU_BACKEND_NAMES.get(backend.dispatcher, backend.dispatcher)
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    key = (name, _group_key(group), device.index, num_experts)
    if name in ("hybridep", "deepep"):  # buffers sized once
        key += (hidden, max_tokens_per_rank, max_topk, id(owner) if owner is not None else None)
    if key not in _dispatchers:
        _dispatchers[key] = new_gpu_dispatcher(name, backend, num_experts, group, device, hidden, max_tokens_per_rank,
                                               max_topk)
    return _dispatchers[key]


def new_gpu_dispatcher(name: str, backend: BackendConfig, num_experts: int, group, device: torch.device,
                       hidden: int = 0, max_tokens_per_rank: int = 0, max_topk: int = 0):
    """A new GPU dispatcher of backend `name` over the group's communicator (collective; not cached,
    any group size, one rank included)."""
    comm = create_communicator(group, device, reuse_nccl=os.environ.get("FLEXEP_REUSE_NCCL") == "1")
    cfg = backend.to_cpp()
    if _num_sms is not None:
        cfg["dispatcher_num_sms"] = _num_sms
    import json

    return _flexep.make_gpu_dispatcher(name, comm, num_experts, json.dumps(cfg), hidden, max_tokens_per_rank, max_topk)


def init_buffer(group=None, num_experts: int = 0, backend: Optional[BackendConfig] = None,
                device: Optional[torch.device] = None):
    """Automodel's init_hybrid_ep_buffer: creates the group's communicator and dispatcher now (before
    activation checkpointing or CUDA-graph capture) instead of on the first forward."""
    backend = backend if backend is not None else BackendConfig(dispatcher="hybridep")
    return get_dispatcher(backend, num_experts, group, device)


def reset_buffer() -> None:
    """Automodel's reset_hybrid_ep_buffer: drops every cached dispatcher and communicator."""
    _dispatchers.clear()
    _deepep_buffers.clear()
    _communicators.clear()


def deepep_buffer(group, num_experts: int, x: torch.Tensor, topk: int):
    """The deepep dispatcher fused_dispatch runs on, as DeepEP's Buffer: sized for the group's largest
    token count so far, rounded up to a power of two. Every rank must size its windows alike, so the
    group's largest T of this call is agreed first (one all-reduce; the dispatch syncs the host anyway);
    a larger one re-creates the dispatcher on every rank."""
    t = torch.tensor([x.size(0)], dtype=torch.int64, device=x.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    need = max(int(t.item()), 1)
    key = (_group_key(group), x.device.index, int(num_experts), x.size(-1), int(topk))
    have = _deepep_buffers.get(key)
    if have is None or have[0] < need:
        _deepep_buffers.pop(key, None)  # its windows go before the new ones are made
        cap = 1 << (need - 1).bit_length()
        d = new_gpu_dispatcher("deepep", BackendConfig(dispatcher="deepep"), int(num_experts), group, x.device,
                               hidden=x.size(-1), max_tokens_per_rank=cap, max_topk=int(topk))
        _deepep_buffers[key] = (cap, d)
    return _deepep_buffers[key][1]


class FlexTokenDispatcher:
    """Automodel's MoEFlexTokenDispatcher call names over one flexep dispatcher:
    token_permutation2(hidden, num_local_tokens, token_probs, token_indices) ->
    (permuted tokens, tokens_per_expert, permuted_probs [N,1]); token_unpermutation(expert_out) -> out.
    Every backend takes the top-k indices as they are (no [T, E] round trip)."""

    def __init__(self, dispatcher, backend: str = "torch"):
        allowed = ("torch", "alltoall", "host", "hybridep", "deepep")
        if backend not in allowed:
            raise _flexep.ArgumentError(f"flexep: invalid argument 'backend': {backend!r}; allowed: "
                                        + ", ".join(allowed))
        self.dispatcher, self.backend = dispatcher, backend
        self._handle, self._hidden_shape = None, None

    def token_permutation2(self, hidden_states, num_local_tokens, token_probs, token_indices):
        del num_local_tokens  # implied by hidden_states (kept for Automodel's signature)
        self._hidden_shape = hidden_states.shape
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        tokens, probs, tpe, self._handle = F.dispatch(self.dispatcher, x, token_indices, token_probs.float())
        return tokens, tpe, probs.unsqueeze(-1)

    def token_unpermutation(self, hidden_states):
        out = F.combine(self.dispatcher, self._handle, hidden_states)
        self._handle = None  # consumed, as Automodel's managers clear it; backward keeps its own in ctx
        return out.view(self._hidden_shape)
