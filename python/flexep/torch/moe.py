"""MoE(nn.Module): Automodel's MoE layer (gate, grouped experts, dispatcher, shared experts) on top of
the C++ MoELayer (CPU, f32/f64) or CudaMoELayer (GPU, bf16 parameters).

The nn.Parameters share memory with the library's parameters (DLPack, zero-copy), under Automodel's
state_dict names and shapes; one autograd Function runs the library's forward and backward. Only
shapes, names and autograd plumbing live here.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from flexep import _flexep
from flexep.torch.config import BackendConfig, MoEConfig
from flexep.torch.dispatcher import HostRank, get_dispatcher


class MoEAuxLossAutoScaler:
    """Automodel's MoEAuxLossAutoScaler knob: the aux loss's backward scale (default 1.0), read by every
    MoE layer at its forward. The aux loss itself is attached inside the library's gate backward:
    its gradient coeff * scale * dL reaches the gate weights whenever the layer's output is
    back-propagated, as Automodel's identity-forward scaler does."""

    main_loss_backward_scale: float = 1.0

    @staticmethod
    def set_loss_scale(scale) -> None:
        MoEAuxLossAutoScaler.main_loss_backward_scale = float(scale)


class Gate(nn.Module):
    """Holds gate.weight, gate.bias and the e_score_correction_bias buffer (names as Automodel's)."""

    def __init__(self, owner: "MoE"):
        super().__init__()
        self._owner = weakref.ref(owner)
        self._last_aux_loss = None

    def update_bias(self) -> None:
        self._owner().update_bias()


class _Container(nn.Module):
    """A name level of the state_dict (experts, shared_experts, shared_experts.gate_proj, ...)."""


class _MoEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module, x, padding_mask, *params):
        layer = module._layer
        if module._cuda:
            stream = torch.cuda.current_stream(x.device).cuda_stream
            out, aux, state = layer.forward(x, padding_mask, module.training, stream)
            aux = None if aux is None else torch.from_dlpack(aux)
        else:
            out, aux, state = layer.forward(x, padding_mask, module.training)
            aux = None if aux is None else torch.tensor(aux, dtype=x.dtype)
        module.gate._last_aux_loss = aux
        ctx.module, ctx.state = module, state
        return torch.from_dlpack(out)

    @staticmethod
    def backward(ctx, grad_out):
        module = ctx.module
        g = grad_out.contiguous()
        if module._cuda:
            grad_x, grads = module._layer.backward(ctx.state, g, torch.cuda.current_stream(g.device).cuda_stream)
        else:
            grad_x, grads = module._layer.backward(ctx.state, g)
        result = [None, torch.from_dlpack(grad_x), None]
        for i, (name, p) in enumerate(module._flat_params):
            cpp_grad = grads.get(name)
            if cpp_grad is None or not ctx.needs_input_grad[3 + i]:
                result.append(None)
                continue
            t = torch.from_dlpack(cpp_grad)
            if module._copy_grads:
                # grad_mode "accumulate_f32": the library's f32 buffers are reused by the next
                # backward, so copy (into the parameter's dtype, as autograd would).
                t = t.to(p.dtype, copy=True)
            elif t.dtype != p.dtype:
                # A fresh f32 gradient of a bf16 parameter (gate, biases: small); the expert weights'
                # come in bf16 and, like the CPU path's, pass zero-copy.
                t = t.to(p.dtype)
            result.append(t)
        return tuple(result)


def _ep_size(group) -> int:
    if isinstance(group, HostRank):
        return group.size()
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


class MoE(nn.Module):
    """Automodel's MoE: forward(x, padding_mask=None, cp_mesh=None) -> tensor of x's shape.

    device: "cpu" (the C++ reference layer; parameters f64 when config.dtype is float64, else f32) or
    a CUDA device (bf16 parameters). group: None (EP size 1, or the default torch.distributed group
    when one is initialised and device is CUDA), a torch.distributed group, or HostRank(world, rank)
    for simulated ranks on the CPU. Expert tensors hold this rank's experts [E_local, ...].
    grad_mode (CUDA only): "fresh_bf16_weights" (default: every backward's gradients are new tensors,
    the expert weights' in bf16 straight from the wgrad GEMMs, handed to autograd without a copy) or
    "accumulate_f32" (the library's f32 buffers, copied into the parameters' dtype at each backward).
    """

    def __init__(self, config: MoEConfig, backend: Optional[BackendConfig] = None, *, device=None, group=None,
                 seed: int = 1234, init_std: float = 0.02, fast_init: bool = False, pad_multiple: int = 1,
                 grad_mode: str = "fresh_bf16_weights"):
        super().__init__()
        backend = backend if backend is not None else BackendConfig()
        device = torch.device(device if device is not None else "cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.config, self.device_ = config, device
        self._cuda = device.type == "cuda"
        if not self._cuda and group is not None and not isinstance(group, HostRank):
            raise _flexep.ArgumentError("flexep: invalid argument 'group': on the CPU, expert parallelism runs "
                                        "simulated ranks: pass HostRank(world, rank)")
        if self._cuda and isinstance(group, HostRank):
            raise _flexep.ArgumentError("flexep: invalid argument 'group': HostRank is for the CPU; pass a "
                                        "torch.distributed group")
        ep_size = _ep_size(group) if (self._cuda or isinstance(group, HostRank)) else 1
        backend, messages, local_fallback = backend.normalized(ep_size)
        for m in messages:
            warnings.warn(f"flexep: {m}", UserWarning, stacklevel=2)
        self.backend = backend
        self._group = group
        dispatcher = None if local_fallback or ep_size == 1 else get_dispatcher(
            backend, config.n_routed_experts, group, device, hidden=config.dim,
            max_tokens_per_rank=int(os.environ.get("FLEXEP_MAX_TOKENS_PER_RANK", "8192")),
            max_topk=config.n_activated_experts, owner=self)
        moe_json, backend_json = config._cpp_json(), backend._cpp_json()
        if self._cuda:
            if not _flexep.HAS_CUDA:
                raise _flexep.Error("flexep: this build has no CUDA (build with FLEXEP_CUDA=ON)")
            self._layer = _flexep.CudaMoELayer(moe_json, backend_json, dispatcher, device.index, seed, init_std,
                                               fast_init, pad_multiple, grad_mode)
        else:
            param_dtype = "float64" if config.dtype == torch.float64 else "float32"
            self._layer = _flexep.MoELayer(moe_json, backend_json, dispatcher, param_dtype, seed, init_std,
                                           pad_multiple)
        # Only the GPU's accumulate_f32 mode returns buffers the library reuses; the CPU layer and
        # fresh_bf16_weights return new tensors per backward.
        self._copy_grads = self._cuda and not self._layer.fresh_grads
        self.gate = Gate(self)
        self._flat_params = []
        self._register_library_parameters()

    # -- parameters ------------------------------------------------------------------------------
    def _submodule(self, path: list[str]) -> nn.Module:
        mod: nn.Module = self
        for part in path:
            if not hasattr(mod, part) or not isinstance(getattr(mod, part), nn.Module):
                mod.add_module(part, _Container())
            mod = getattr(mod, part)
        return mod

    def _register_library_parameters(self) -> None:
        for name, value, requires_grad in self._layer.parameters():
            t = torch.from_dlpack(value)
            p = nn.Parameter(t, requires_grad=requires_grad)
            *path, leaf = name.split(".")
            self._submodule(path).register_parameter(leaf, p)
            self._flat_params.append((name, p))
        self._data_ptrs = [p.data_ptr() for _, p in self._flat_params]
        # The library's own buffer, shared (CPU and GPU): update_bias() changes what state_dict()
        # returns, and load_state_dict() writes the library's values in place.
        bias = self._layer.e_score_correction_bias()
        if bias is not None:
            self.gate.register_buffer("e_score_correction_bias", torch.from_dlpack(bias))
        elif self._cuda and (self.config.gate_bias_update_factor > 0 or self.config.force_e_score_correction_bias):
            # The fake balanced gate has no router, hence no bias: the key is kept for state_dict
            # parity with Automodel.
            self.gate.register_buffer("e_score_correction_bias",
                                      torch.zeros(self.config.n_routed_experts, dtype=torch.float32,
                                                  device=self.device_))
        if self._cuda and self.config.n_shared_experts > 0:
            from flexep.torch import _shared_layout

            _shared_layout.install_hooks(self)

    def _check_shared_memory(self) -> None:
        for (name, p), ptr in zip(self._flat_params, self._data_ptrs):
            if p.data_ptr() != ptr:
                raise _flexep.Error(
                    f"flexep: parameter '{name}' no longer shares memory with the library (was it replaced, "
                    "e.g. by .to(), load_state_dict(assign=True) or a new .data?); update it in place instead")

    def replicated_parameters(self):
        """Parameters every EP rank holds whole (gate, shared experts): their gradients are this rank's
        contribution and need an all-reduce over the group, like any data-parallel gradient."""
        return [p for name, p in self._flat_params if not name.startswith("experts.")]

    # -- forward / bias update --------------------------------------------------------------------
    def forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None, cp_mesh=None) -> torch.Tensor:
        if cp_mesh is not None:
            raise _flexep.ArgumentError("flexep: invalid argument 'cp_mesh': context parallelism is not supported")
        self._check_shared_memory()
        if not self._cuda:
            self._layer.aux_loss_scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        mask = None if padding_mask is None else padding_mask.reshape(-1).to(torch.bool).contiguous()
        params = [p for _, p in self._flat_params]
        out = _MoEFunction.apply(self, x2, mask, *params)
        return out.view(shape)

    def update_bias(self) -> None:
        """Aux-loss-free balancing (Automodel's Gate.update_bias): the load accumulated over training
        forwards, summed over the EP group, moves the correction bias by sign(mean - load) * factor."""
        if isinstance(self._group, HostRank):
            group = self._group.process_group
        elif self._cuda and self._layer.ep_size > 1:
            from flexep.torch.dispatcher import create_communicator

            group = create_communicator(self._group, self.device_)
        else:
            group = None
        with torch.no_grad():
            if self._cuda:
                self._layer.update_bias(group, torch.cuda.current_stream(self.device_).cuda_stream)
            else:
                self._layer.update_bias(group)

    def extra_repr(self) -> str:
        c = self.config
        return (f"dim={c.dim}, experts={c.n_routed_experts} (local {c.n_routed_experts // self._layer.ep_size}), "
                f"topk={c.n_activated_experts}, dispatcher={self.backend.dispatcher}, device={self.device_}")
