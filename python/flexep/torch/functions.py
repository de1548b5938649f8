"""Autograd Functions around the C++ TokenDispatcher, with Automodel's contracts (fused_a2a.py):

- dispatch: (x [T,H], weights [T,k]) -> (tokens [N,H], token_probs [N], tokens_per_expert, handle);
  backward returns gradients for both the hidden states and the probs (a combine of grad_tokens plus
  the probs' gather back to the k slots), with the handle kept in ctx;
- combine: expert_out [N,H] -> out [T,H]; backward re-dispatches grad_out along the saved handle;
- hybridep: top-k indices in, the multihot conversion done inside (C++), [T,E] prob gradients mapped
  back to the k slots in backward.

Every backend (host, alltoall, hybridep, the single-GPU one) goes through the same two Functions:
the math is the library's.
"""

from __future__ import annotations

from typing import Optional

import torch

from flexep import _flexep


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def _out(obj) -> Optional[torch.Tensor]:
    return None if obj is None else torch.from_dlpack(obj)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weights, indices, routing_map, dispatcher, options):
        # Top-k form (indices/weights) or multihot form (routing_map/probs in `weights`).
        if routing_map is None:
            res = dispatcher.dispatch(x.contiguous(), indices=indices.contiguous(), weights=weights.contiguous(),
                                      stream=_stream(x), **options)
        else:
            res = dispatcher.dispatch(x.contiguous(), routing_map=routing_map.contiguous(),
                                      probs=weights.contiguous(), stream=_stream(x), **options)
        tokens, probs, tokens_per_expert, dropped, handle = res
        ctx.dispatcher, ctx.handle = dispatcher, handle
        tokens, probs, tpe = _out(tokens), _out(probs), _out(tokens_per_expert)
        dropped = torch.tensor(dropped)
        ctx.mark_non_differentiable(tpe, dropped)
        return tokens, probs, tpe, dropped

    @staticmethod
    def backward(ctx, grad_tokens, grad_probs, _tpe, _dropped):
        gx, gw = ctx.dispatcher.dispatch_backward(ctx.handle, grad_tokens.contiguous(), grad_probs.contiguous(),
                                                  stream=_stream(grad_tokens))
        return _out(gx), _out(gw), None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, dispatcher, handle):
        ctx.dispatcher, ctx.handle = dispatcher, handle
        return _out(dispatcher.combine(handle, expert_out.contiguous(), stream=_stream(expert_out)))

    @staticmethod
    def backward(ctx, grad_out):
        g = ctx.dispatcher.combine_backward(ctx.handle, grad_out.contiguous(), stream=_stream(grad_out))
        return _out(g), None, None


class _TopkToMultihot(torch.autograd.Function):
    """indices [T,k], weights [T,k] -> routing_map [T,E] bool, probs [T,E] (C++ / CUDA kernels)."""

    @staticmethod
    def forward(ctx, weights, indices, num_experts):
        routing_map, probs = _flexep.topk_to_multihot(indices.contiguous(), weights.contiguous(), num_experts,
                                                      stream=_stream(indices))
        ctx.save_for_backward(indices)
        routing_map = _out(routing_map)
        ctx.mark_non_differentiable(routing_map)
        return routing_map, _out(probs)

    @staticmethod
    def backward(ctx, _grad_map, grad_probs):
        (indices,) = ctx.saved_tensors
        g = _flexep.multihot_backward(grad_probs.contiguous(), indices, stream=_stream(indices))
        return _out(g), None, None


def dispatch(dispatcher, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, *, pad_multiple: int = 1,
             mode: str = "blocking", budget_rows: int = 0, overflow: str = "error"):
    """Dispatches x [T,H] to the experts' owners along top-k (indices, weights).

    Returns (tokens [N,H], token_probs [N], tokens_per_expert [E_local], handle); differentiable in x
    and weights. The handle is what combine() needs.
    """
    opts = dict(pad_multiple=pad_multiple, mode=mode, budget_rows=budget_rows, overflow=overflow)
    holder = _HandleHolder()
    tokens, probs, tpe, _ = _DispatchWithHandle.apply(x, weights, indices, None, dispatcher, opts, holder)
    return tokens, probs, tpe, holder.handle


def hybrid_ep_dispatch(dispatcher, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, *,
                       pad_multiple: int = 1, mode: str = "blocking", budget_rows: int = 0,
                       overflow: str = "error"):
    """Automodel's hybridep path: top-k indices in, multihot [T,E] built inside (C++ or CUDA kernels),
    dispatched in the multihot form; the [T,E] prob gradient flows back to weights [T,k]."""
    routing_map, probs = _TopkToMultihot.apply(weights, indices, dispatcher.num_experts)
    opts = dict(pad_multiple=pad_multiple, mode=mode, budget_rows=budget_rows, overflow=overflow)
    holder = _HandleHolder()
    tokens, tprobs, tpe, _ = _DispatchWithHandle.apply(x, probs, None, routing_map, dispatcher, opts, holder)
    return tokens, tprobs, tpe, holder.handle


def combine(dispatcher, handle, expert_out: torch.Tensor) -> torch.Tensor:
    """expert_out [N,H] -> out [T,H], the unweighted sum of each token's rows; backward re-dispatches."""
    return _Combine.apply(expert_out, dispatcher, handle)


class _HandleHolder:
    handle = None


class _DispatchWithHandle(_Dispatch):
    # autograd outputs must be tensors: the handle leaves through a holder object (and stays in ctx).
    @staticmethod
    def forward(ctx, x, weights, indices, routing_map, dispatcher, options, holder):
        out = _Dispatch.forward(ctx, x, weights, indices, routing_map, dispatcher, options)
        holder.handle = ctx.handle
        return out

    @staticmethod
    def backward(ctx, *grads):
        return (*_Dispatch.backward(ctx, *grads), None)
