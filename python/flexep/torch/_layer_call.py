"""One MoE layer call into the library, from the tensors a module holds at that moment.

`run_moe(moe, x, padding_mask)` serves flexep's own MoE and an Automodel MoE that flexep was put into
alike: both have Automodel's module tree (gate, experts, shared_experts, shared_expert_gate,
fc1_latent_proj, fc2_latent_proj) and parameter names. Every call reads the module's current tensors (the local shard of a DTensor, the
unsharded parameter FSDP2 put in place for this forward), casts them as Automodel's layer does,
passes them as DLPack views to the library's MoECompute and gets a gradient back for each of them.
The library keeps no pointer to them between calls.

The library call runs inside `experts.forward`: Automodel's parallelizer makes the experts their own
FSDP2 unit, whose parameters exist unsharded only while that module's forward runs (and again from
its pre-backward hook on). The gate's, shared experts' and latent projections' tensors, which belong to the enclosing
block's unit, travel into that forward inside a `LayerCall`, an object FSDP2's input casting does
not look into (it would otherwise cast the fp32 correction bias to the compute dtype).
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from flexep import _flexep
from flexep.torch.config import MoEConfig
from flexep.torch.dispatcher import HostRank, get_dispatcher
from flexep.torch.functions import no_double_backward, require_strided
from flexep.torch.fake_gate import FakeBalancedGate, fake_gate_routing


def _local(t):
    return t.to_local() if t is not None and hasattr(t, "to_local") else t


# -- the aux-loss scale ----------------------------------------------------------------------------

class MoEAuxLossAutoScaler:
    """Automodel's MoEAuxLossAutoScaler knob: main_loss_backward_scale (None means 1.0), read at
    backward. When Automodel's own class is loaded (its recipes set the scale there), its value wins
    whenever it is set; `set_loss_scale` sets both."""

    main_loss_backward_scale = None

    @staticmethod
    def set_loss_scale(scale) -> None:
        MoEAuxLossAutoScaler.main_loss_backward_scale = torch.as_tensor(scale)
        automodel = _automodel_scaler()
        if automodel is not None:
            automodel.main_loss_backward_scale = torch.as_tensor(scale)


def _automodel_scaler():
    mod = sys.modules.get("nemo_automodel.components.moe.megatron.moe_utils")
    return getattr(mod, "MoEAuxLossAutoScaler", None) if mod is not None else None


def aux_loss_scale() -> float:
    for cls in (_automodel_scaler(), MoEAuxLossAutoScaler):
        if cls is not None and cls.main_loss_backward_scale is not None:
            return float(cls.main_loss_backward_scale)
    return 1.0


# -- the expert-parallel group and the library object of a module ----------------------------------

def ep_group_of(moe) -> tuple[object, int]:
    """(group, size) of the module's expert parallelism: the group flexep's MoE was built with, or
    the mesh of DTensor-sharded experts (Automodel's ExpertParallel), else (None, 1)."""
    group = getattr(moe, "_flexep_group", None)
    if isinstance(group, HostRank):
        return group, group.size()
    if group is not None:
        return group, dist.get_world_size(group)
    w = moe.experts.gate_and_up_projs
    mesh = getattr(w, "device_mesh", None)
    if mesh is not None and mesh.size() > 1:
        return mesh.get_group(), mesh.size()
    return None, 1


_computes: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def compute_of(moe, device: torch.device):
    """The library's MoECompute of this module on `device`, made on first use (so construction on
    the meta device, to_empty() and moves cost nothing) and remade when the device changes."""
    entry = _computes.get(moe)
    if entry is not None and entry[0] == device:
        return entry[1]
    config: MoEConfig = moe._flexep_config
    group, ep_size = ep_group_of(moe)
    backend, messages, local_fallback = moe._flexep_backend.normalized(ep_size)
    for m in messages:
        if m not in moe._flexep_warned:
            moe._flexep_warned.add(m)
            import warnings

            warnings.warn(f"flexep: {m}", UserWarning, stacklevel=4)
    if device.type == "cuda" and not _flexep.HAS_CUDA:
        raise _flexep.Error("flexep: this build has no CUDA (build with FLEXEP_CUDA=ON); the input is on "
                            f"{device}")
    if device.type not in ("cpu", "cuda"):
        raise _flexep.ArgumentError(f"flexep: invalid argument 'x': on device {device}; allowed: cpu, cuda")
    if device.type == "cpu" and ep_size > 1 and not isinstance(group, HostRank):
        raise _flexep.ArgumentError(
            "flexep: invalid argument 'group': expert parallelism over processes on the CPU is not offered; "
            "use GPUs (dispatcher torch/hybridep), or HostRank(world, rank) for simulated ranks")
    dispatcher = None
    if not local_fallback and ep_size > 1:
        dispatcher = get_dispatcher(backend, config.n_routed_experts, group, device, hidden=config.expert_dim,
                                    max_tokens_per_rank=int(os.environ.get("FLEXEP_MAX_TOKENS_PER_RANK", "8192")),
                                    max_topk=config.n_activated_experts, owner=moe)
    compute = _flexep.MoECompute(config._cpp_json(), backend._cpp_json(), dispatcher,
                                 device.index if device.type == "cuda" else -1, moe._flexep_pad_multiple)
    _computes[moe] = (device, compute)
    return compute


# -- the tensors of one call -----------------------------------------------------------------------

def _shared_grouped(mlp, dtype) -> dict:
    """Automodel's nn.Linear-shaped shared experts in the library's one-expert grouped layout
    ([1, dim, up] = [gate_proj^T | up_proj^T], [1, inter, dim] = down_proj^T), built with autograd
    ops so the gradients reach the nn.Linear parameters by themselves."""
    up = torch.cat([_local(mlp.gate_proj.weight), _local(mlp.up_proj.weight)]) if mlp.is_gated else \
        _local(mlp.up_proj.weight)
    out = {"shared_experts.gate_and_up_projs": up.to(dtype).t().unsqueeze(0).contiguous(),
           "shared_experts.down_projs": _local(mlp.down_proj.weight).to(dtype).t().unsqueeze(0).contiguous()}
    if mlp.up_proj.bias is not None:
        b = torch.cat([_local(mlp.gate_proj.bias), _local(mlp.up_proj.bias)]) if mlp.is_gated else \
            _local(mlp.up_proj.bias)
        out["shared_experts.gate_up_proj_bias"] = b.to(dtype).unsqueeze(0).contiguous()
        out["shared_experts.down_proj_bias"] = _local(mlp.down_proj.bias).to(dtype).unsqueeze(0).contiguous()
    return out


class LayerCall:
    """What experts.forward needs besides its own parameters: the MoE module, the token mask and the
    gate's and shared experts' tensors, gathered by the MoE's forward (while its FSDP unit holds
    them unsharded)."""

    __slots__ = ("moe", "padding_mask", "weights", "routing")

    def __init__(self, moe, x: torch.Tensor, padding_mask: Optional[torch.Tensor]):
        self.moe, self.padding_mask, self.routing = moe, padding_mask, None
        dtype = x.dtype
        gate, w = moe.gate, {}
        if isinstance(gate, FakeBalancedGate) or getattr(gate, "noise", None) is not None:
            if gate.noise > 0:
                self.routing = fake_gate_routing(gate, x)
        else:
            gw, gb = _local(gate.weight), _local(gate.bias)
            if gate.gate_precision is None:  # Automodel: the gate runs in x's dtype
                gw = gw.to(dtype)
                gb = gb.to(dtype) if gb is not None else None
            w["gate.weight"] = gw.contiguous()
            if gb is not None:
                w["gate.bias"] = gb.contiguous()
            if gate.e_score_correction_bias is not None:
                w["gate.e_score_correction_bias"] = _local(gate.e_score_correction_bias).detach().float().contiguous()
        if moe.shared_experts is not None:
            w.update(_shared_grouped(moe.shared_experts, dtype))
            if moe.shared_expert_gate is not None:
                w["shared_expert_gate.weight"] = _local(moe.shared_expert_gate.weight).to(dtype).contiguous()
        for name in ("fc1_latent_proj", "fc2_latent_proj"):
            proj = getattr(moe, name, None)
            if proj is not None:
                w[f"{name}.weight"] = _local(proj.weight).to(dtype).contiguous()
                if proj.bias is not None:
                    w[f"{name}.bias"] = _local(proj.bias).to(dtype).contiguous()
        self.weights = w


def expert_tensors(experts, dtype) -> dict:
    """The routed experts' tensors, cast to the compute dtype as Automodel's GroupedExperts does."""
    w = {"experts.gate_and_up_projs": _local(experts.gate_and_up_projs).to(dtype).contiguous(),
         "experts.down_projs": _local(experts.down_projs).to(dtype).contiguous()}
    if experts.gate_up_proj_bias is not None:
        w["experts.gate_up_proj_bias"] = _local(experts.gate_up_proj_bias).to(dtype).contiguous()
        w["experts.down_proj_bias"] = _local(experts.down_proj_bias).to(dtype).contiguous()
    return w


# -- the autograd Function -------------------------------------------------------------------------

def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


class _Outputs:
    """Non-differentiable results of a forward, handed back past autograd (whose outputs must be
    tensors that it tracks)."""

    __slots__ = ("aux_loss", "expert_load", "routing")


def _state_token(state) -> torch.Tensor:
    """An empty tensor that owns the library's saved state. It is saved for backward like any
    activation, so whatever autograd does with saved tensors it does with the library's activations
    too: activation checkpointing (torch.utils.checkpoint) drops it after the forward, which frees
    the state, and its recomputation makes a new one for the backward."""
    token = torch.empty(0)
    token._flexep_state = state
    return token


def _state_of(token: torch.Tensor):
    state = getattr(token, "_flexep_state", None)
    if state is None:
        raise _flexep.Error("flexep: the MoE layer's saved state did not come back from autograd's saved-tensor "
                            "hooks: a hook that copies saved tensors (e.g. torch.autograd.graph.save_on_cpu) cannot "
                            "carry it; activation checkpointing (torch.utils.checkpoint) can")
    return state


class _MoEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, compute, names, mask, routing, training, outputs, x, *tensors):
        weights = dict(zip(names, tensors))
        out, aux, load, state = compute.forward(weights, x, mask, training, routing, _stream(x))
        outputs.aux_loss = None if aux is None else torch.from_dlpack(aux).reshape(()).float()  # fp32 scalar, as Automodel
        outputs.expert_load = None if load is None else torch.from_dlpack(load)
        outputs.routing = tuple(torch.from_dlpack(t) for t in state.routing())
        ctx.compute, ctx.names = compute, names
        ctx.save_for_backward(_state_token(state), *tensors)
        return torch.from_dlpack(out)

    @staticmethod
    def backward(ctx, grad_out):
        no_double_backward("flexep's MoE layer")
        token, *tensors = ctx.saved_tensors
        weights = dict(zip(ctx.names, tensors))
        g = grad_out.contiguous()
        # The state stays with the graph (freed with it), so backward can run again under retain_graph.
        grad_x, grads = ctx.compute.backward(weights, _state_of(token), g, aux_loss_scale(), _stream(g))
        result = [None] * 6 + [torch.from_dlpack(grad_x)]
        for i, name in enumerate(ctx.names):
            grad = grads.get(name)
            result.append(torch.from_dlpack(grad) if grad is not None and ctx.needs_input_grad[7 + i] else None)
        return tuple(result)


def run_experts(experts, x: torch.Tensor, call: LayerCall) -> torch.Tensor:
    """The body of experts.forward: the whole layer in one library call."""
    moe = call.moe
    compute = compute_of(moe, x.device)
    weights = {**call.weights, **expert_tensors(experts, x.dtype)}
    names = tuple(weights)
    outputs = _Outputs()
    routing = call.routing
    replay = getattr(moe.gate, "router_replay", None)
    if routing is None and _replay_mode(replay) == "replay":
        if replay.target_indices is None:
            raise RuntimeError("RouterReplay is in REPLAY mode but no target indices were set for this layer. "
                               "Call RouterReplay.replay(indices) / set_replay_indices(...) with one tensor per "
                               "MoE layer.")
        routing = (replay.target_indices.to(x.device, torch.int64), None)
    routing = None if routing is None else tuple(None if t is None else t.contiguous() for t in routing)
    y = _MoEFunction.apply(compute, names, call.padding_mask, routing, moe.training, outputs, x,
                           *(weights[n] for n in names))
    _record_gate_state(moe.gate, outputs, moe.training)
    if _replay_mode(replay) == "record":
        replay.recorded_indices = outputs.routing[0].detach()
    moe._flexep_last_routing = tuple(t.detach() for t in outputs.routing)
    return y


def _replay_mode(replay) -> Optional[str]:
    """Automodel's RouterReplay mode of a gate ("record", "replay" or None)."""
    mode = getattr(replay, "mode", None)
    return getattr(mode, "value", mode)


def last_routing(moe) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(indices [T, k], weights [T, k]) of the module's last forward: the router's selection
    (padding tokens included) and the weights the experts used; None before the first forward."""
    return getattr(moe, "_flexep_last_routing", None)


def _record_gate_state(gate, outputs: _Outputs, training: bool) -> None:
    """What Automodel's Gate keeps from a forward: the cumulative load for update_bias, and the last
    load and aux loss for the load-balance metrics when tracking is on."""
    load = outputs.expert_load
    if load is None:
        return
    if getattr(gate, "bias_update_factor", 0) > 0 and training:
        prev = gate._cumulative_expert_load
        gate._cumulative_expert_load = load if prev is None else prev + load  # out of place, as Automodel
    if getattr(gate, "_track_load_balance", False):
        gate._last_expert_load = load.detach()
        if outputs.aux_loss is not None:
            gate._last_aux_loss = outputs.aux_loss.detach()


def run_moe(moe, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Automodel's MoE.forward: x [..., dim] -> the same shape, padding_mask [...] True = padding."""
    for name, t in (("x", x), ("padding_mask", padding_mask)):
        if not isinstance(t, torch.Tensor) and not (name == "padding_mask" and t is None):
            raise _flexep.ArgumentError(f"flexep: invalid argument '{name}': a {type(t).__name__}; allowed: a "
                                        "torch.Tensor" + (" or None" if name == "padding_mask" else ""))
    shape, dim = x.shape, moe._flexep_config.dim
    require_strided(x, "x")
    if not x.dtype.is_floating_point:
        raise _flexep.ArgumentError(f"flexep: invalid argument 'x': dtype {x.dtype}; allowed: floating point "
                                    "(torch.float32, torch.float64, torch.bfloat16)")
    if x.dim() < 1 or shape[-1] != dim:
        raise _flexep.ArgumentError(f"flexep: invalid argument 'x': has shape {list(shape)}; expected [..., {dim}] "
                                    "(the last dimension the config's dim)")
    if padding_mask is not None and padding_mask.numel() != x.numel() // max(dim, 1):
        raise _flexep.ArgumentError(f"flexep: invalid argument 'padding_mask': has shape {list(padding_mask.shape)}; "
                                    f"expected x's leading dimensions {list(shape[:-1])} (flattened as Automodel does)")
    x2 = x.reshape(-1, dim).contiguous()
    mask = None if padding_mask is None else padding_mask.reshape(-1).to(torch.bool).contiguous()
    y = moe.experts(x2, None, LayerCall(moe, x2, mask))
    return y.view(shape)

