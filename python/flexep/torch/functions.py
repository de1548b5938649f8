"""Autograd Functions around the C++ TokenDispatcher, with Automodel's contracts (fused_a2a.py):

- dispatch: (x [T,H], weights [T,k]) -> (tokens [N,H], token_probs [N], tokens_per_expert, handle);
  backward returns gradients for both the hidden states and the probs (a combine of grad_tokens plus
  the probs' gather back to the k slots), with the handle kept in ctx;
- combine: expert_out [N,H] -> out [T,H]; backward re-dispatches grad_out along the saved handle;
- every backend takes the top-k form (indices, weights) straight; the multihot form (routing_map,
  probs [T,E]) is what Automodel's hybrid_ep_dispatch passes when it has a dense map (fused_a2a.py).

Every backend (host, alltoall, hybridep, the single-GPU one) goes through the same two Functions:
the math is the library's.
"""

from __future__ import annotations

from typing import Optional

import torch

from flexep import _flexep


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def require_strided(t: torch.Tensor, name: str) -> None:
    """An ArgumentError naming `name` for a sparse (or other non-strided) tensor, whose reshape and
    .contiguous() would otherwise raise PyTorch's own errors."""
    if t.layout != torch.strided:
        raise _flexep.ArgumentError(f"flexep: invalid argument '{name}': a {t.layout} tensor; "
                                    "allowed: dense (torch.strided) tensors")


def _dense(t, name: str):
    """t as the library takes it (dense, C-contiguous, with data), or an ArgumentError naming it: a
    sparse tensor's .contiguous() and a meta tensor's missing data would otherwise surface as
    PyTorch's or DLPack's errors."""
    if isinstance(t, torch.Tensor):
        require_strided(t, name)
        if t.is_meta:
            raise _flexep.ArgumentError(f"flexep: invalid argument '{name}': on the meta device, which holds no "
                                        "data; allowed: tensors on cpu or cuda")
        return t.contiguous()
    return t


def no_double_backward(what: str) -> None:
    """Called first in every backward here: with create_graph=True the gradient would need a
    backward of its own, which flexep's kernels do not have; said at once, by name, instead of
    PyTorch's "element 0 of tensors does not require grad" at the second backward."""
    if torch.is_grad_enabled():
        raise _flexep.ArgumentError(f"flexep: invalid argument 'create_graph': True; {what} has a first "
                                    "derivative only (no double backward); allowed: False")


def _check_call(dispatcher, handle=None, mode: str = "blocking", overflow: str = "error", **tensors) -> None:
    """The dispatcher, the handle (when given), the modes and the tensors of a call, each checked by
    name before anything reaches the library (a wrong kind of object there fails as a nanobind
    TypeError listing signatures, or an AttributeError)."""
    if not isinstance(dispatcher, _flexep.TokenDispatcher):
        raise _flexep.ArgumentError(f"flexep: invalid argument 'dispatcher': a {type(dispatcher).__name__}; "
                                    "allowed: a flexep dispatcher (make_dispatcher, make_host_dispatcher, ...)")
    if handle is not None and not isinstance(handle, _flexep.Handle):
        raise _flexep.ArgumentError(f"flexep: invalid argument 'handle': a {type(handle).__name__}; allowed: the "
                                    "handle a dispatch returned")
    if mode not in ("blocking", "budget"):
        raise _flexep.ArgumentError(f"flexep: invalid argument 'mode': {mode!r}; allowed: 'blocking', 'budget'")
    if overflow not in ("error", "drop"):
        raise _flexep.ArgumentError(f"flexep: invalid argument 'overflow': {overflow!r}; allowed: 'error', 'drop'")
    _check_tensors(**tensors)


def _check_tensors(**tensors) -> None:
    """Each argument is a torch.Tensor, or an ArgumentError naming it (a list or a numpy array would
    otherwise fail deep inside autograd with an AttributeError)."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise _flexep.ArgumentError(f"flexep: invalid argument '{name}': a {type(t).__name__}; allowed: a "
                                        "torch.Tensor")


def _out(obj) -> Optional[torch.Tensor]:
    return None if obj is None else torch.from_dlpack(obj)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weights, indices, routing_map, dispatcher, options):
        # Top-k form (indices/weights) or multihot form (routing_map/probs in `weights`).
        if routing_map is None:
            res = dispatcher.dispatch(_dense(x, "hidden"), indices=_dense(indices, "indices"),
                                      weights=_dense(weights, "weights"), stream=_stream(x), **options)
        else:
            res = dispatcher.dispatch(_dense(x, "hidden"), routing_map=_dense(routing_map, "routing_map"),
                                      probs=_dense(weights, "probs"), stream=_stream(x), **options)
        tokens, probs, tokens_per_expert, dropped, handle = res
        ctx.dispatcher, ctx.handle = dispatcher, handle
        tokens, probs, tpe = _out(tokens), _out(probs), _out(tokens_per_expert)
        dropped = torch.tensor(dropped)
        ctx.mark_non_differentiable(tpe, dropped)
        return tokens, probs, tpe, dropped

    @staticmethod
    def backward(ctx, grad_tokens, grad_probs, _tpe, _dropped):
        no_double_backward("flexep's dispatch")
        gx, gw = ctx.dispatcher.dispatch_backward(ctx.handle, grad_tokens.contiguous(), grad_probs.contiguous(),
                                                  stream=_stream(grad_tokens))
        return _out(gx), _out(gw), None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, dispatcher, handle):
        ctx.dispatcher, ctx.handle = dispatcher, handle
        return _out(dispatcher.combine(handle, _dense(expert_out, "expert_out"), stream=_stream(expert_out)))

    @staticmethod
    def backward(ctx, grad_out):
        no_double_backward("flexep's combine")
        g = ctx.dispatcher.combine_backward(ctx.handle, grad_out.contiguous(), stream=_stream(grad_out))
        return _out(g), None, None


def dispatch(dispatcher, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, *, pad_multiple: int = 1,
             mode: str = "blocking", budget_rows: int = 0, overflow: str = "error"):
    """Dispatches x [T,H] to the experts' owners along top-k (indices, weights).

    Returns (tokens [N,H], token_probs [N], tokens_per_expert [E_local], handle); differentiable in x
    and weights. The handle is what combine() needs.
    """
    _check_call(dispatcher, mode=mode, overflow=overflow, x=x, indices=indices, weights=weights)
    if mode != "budget" and (budget_rows != 0 or overflow != "error"):
        name, value = ("budget_rows", budget_rows) if budget_rows != 0 else ("overflow", overflow)
        raise _flexep.ArgumentError(f"flexep: invalid argument '{name}': {value!r} given with mode={mode!r}; "
                                    "it applies to mode='budget' only")
    opts = dict(pad_multiple=pad_multiple, mode=mode, budget_rows=budget_rows, overflow=overflow)
    holder = _HandleHolder()
    tokens, probs, tpe, _ = _DispatchWithHandle.apply(x, weights, indices, None, dispatcher, opts, holder)
    return tokens, probs, tpe, holder.handle


def combine(dispatcher, handle, expert_out: torch.Tensor) -> torch.Tensor:
    """expert_out [N,H] -> out [T,H], the unweighted sum of each token's rows; backward re-dispatches."""
    _check_call(dispatcher, handle, expert_out=expert_out)
    return _Combine.apply(expert_out, dispatcher, handle)


class _HandleHolder:
    handle = None


class _RankMajorDispatch(torch.autograd.Function):
    """DeepEP's dispatch (docs/semantics.md, "Rank-major dispatch"): x [T,H], top-k (indices,
    weights) -> recv_x [N,H], recv_topk_idx [N,k] int64, recv_topk_weights [N,k] float32,
    tokens_per_expert, expert_rows. Backward: grad_x is the sum of grad_recv_x over the ranks, the
    weights' gradient that of recv_topk_weights at each slot's owner."""

    @staticmethod
    def forward(ctx, x, weights, indices, dispatcher, options, holder):
        res = dispatcher.dispatch_rank_major(_dense(x, "hidden"), _dense(indices, "indices"),
                                             _dense(weights, "weights"), stream=_stream(x), **options)
        recv_x, recv_idx, recv_w, tpe, expert_rows, dropped, handle = res
        ctx.dispatcher, ctx.handle = dispatcher, handle
        holder.handle = handle
        recv_idx, tpe, expert_rows = _out(recv_idx).long(), _out(tpe), _out(expert_rows)
        recv_x, recv_w = _out(recv_x), _out(recv_w)
        if recv_x.is_cuda:  # the deepep backend's are views of its receive window: fresh tensors, as DeepEP's
            recv_x, recv_w = recv_x.clone(), recv_w.clone()
        ctx.mark_non_differentiable(recv_idx, tpe, expert_rows)
        return recv_x, recv_idx, recv_w, tpe, expert_rows

    @staticmethod
    def backward(ctx, grad_x, _idx, grad_w, _tpe, _rows):
        no_double_backward("flexep's rank-major dispatch")
        if grad_w is None:
            grad_w = torch.zeros(ctx.handle.rows, ctx.handle.topk, dtype=torch.float32, device=grad_x.device)
        gx, gw = ctx.dispatcher.dispatch_backward(ctx.handle, grad_x.contiguous(), grad_w.contiguous(),
                                                  stream=_stream(grad_x))
        return _out(gx), _out(gw), None, None, None, None


def dispatch_rank_major(dispatcher, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, *,
                        pad_multiple: int = 1, mode: str = "blocking", budget_rows: int = 0,
                        overflow: str = "error"):
    """DeepEP's rank-major dispatch on a dispatcher that writes it (host; deepep): returns (recv_x,
    recv_topk_idx, recv_topk_weights, tokens_per_expert, expert_rows, handle), differentiable in x
    and weights. combine() of this handle takes one row per received token, summed over this rank's
    experts."""
    opts = dict(pad_multiple=pad_multiple, mode=mode, budget_rows=budget_rows, overflow=overflow)
    holder = _HandleHolder()
    out = _RankMajorDispatch.apply(x, weights, indices, dispatcher, opts, holder)
    return (*out, holder.handle)


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
