"""The fused_dispatch -> stand-in experts -> fused_combine -> backward chain the one-GPU deepep tests
compare between a torch.distributed group (flexep's deepep backend) and HostRank (the host backend)."""

import flexep.torch as ft


def fused_chain(x, idx, w, up, E, group):
    """fused_dispatch, stand-in experts (exact elementwise arithmetic), fused_combine, backward; every
    output and gradient on the CPU."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    recv_x, recv_idx, recv_w, tpe, handle = ft.fused_dispatch(x, idx, w, E, group)
    y = (recv_x.float() * 2.0 + recv_w[:, :1]).bfloat16()
    out, none = ft.fused_combine(y, group, handle)
    assert none is None
    (out.float() * up.float()).sum().backward()
    got = dict(recv_x=recv_x, recv_idx=recv_idx, recv_w=recv_w, tpe=tpe, out=out, gx=x.grad, gw=w.grad)
    return {n: t.detach().cpu() for n, t in got.items()}
