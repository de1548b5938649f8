"""Pure-PyTorch reference of Automodel's MoE (test oracle only): Gate, GroupedExperts' per-expert loop
(gather, FFN with the prob inside, scatter-add), the shared MLP, the aux loss through
MoEAuxLossAutoScaler, and the torch dispatcher's expert-major gather / scatter-add."""

from __future__ import annotations

import torch
import torch.nn.functional as Fn
from torch import nn


class AuxLossAutoScaler(torch.autograd.Function):
    scale = 1.0

    @staticmethod
    def forward(ctx, output, aux_loss):
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss) * AuxLossAutoScaler.scale


def activation(name, h, alpha=1.702, limit=7.0):
    if name == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return Fn.silu(gate) * up
    if name == "relu2":
        return Fn.relu(h) ** 2
    if name == "quick_geglu":
        gate, up = h[..., ::2].clamp(max=limit), h[..., 1::2].clamp(-limit, limit)
        return gate * torch.sigmoid(alpha * gate) * (up + 1)
    raise ValueError(name)


def _round_bf16(t):
    """t rounded to bf16, the gradient passed straight through (what the library's backward does)."""
    return t + (t.to(torch.bfloat16).to(t.dtype) - t).detach()


class ReferenceMoE(nn.Module):
    """Automodel's MoE with all E experts local; parameters under Automodel's state_dict names.

    bf16_router: route as Automodel's Gate does for bf16 x without a gate precision (the GPU layer):
    logits rounded to bf16, weights rounded to bf16 unless router_weights_fp32."""

    def __init__(self, cfg, dtype=torch.float64, bf16_router=False):
        super().__init__()
        self.cfg = cfg
        self.bf16_router = bf16_router
        E, D, I = cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim
        up = I if cfg.expert_activation == "relu2" else 2 * I
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.zeros(E, D, dtype=dtype))
        if cfg.router_bias:
            self.gate.bias = nn.Parameter(torch.zeros(E, dtype=dtype))
        if cfg.gate_bias_update_factor > 0 or cfg.force_e_score_correction_bias:
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))
        self.experts = nn.Module()
        self.experts.gate_and_up_projs = nn.Parameter(torch.zeros(E, D, up, dtype=dtype))
        self.experts.down_projs = nn.Parameter(torch.zeros(E, I, D, dtype=dtype))
        if cfg.expert_bias:
            self.experts.gate_up_proj_bias = nn.Parameter(torch.zeros(E, up, dtype=dtype))
            self.experts.down_proj_bias = nn.Parameter(torch.zeros(E, D, dtype=dtype))
        if cfg.n_shared_experts > 0:
            SI = cfg.n_shared_experts * (cfg.shared_expert_inter_dim or I)
            self.shared_experts = nn.Module()
            if cfg.shared_expert_activation != "relu2":
                self.shared_experts.gate_proj = nn.Linear(D, SI, bias=cfg.expert_bias, dtype=dtype)
            self.shared_experts.up_proj = nn.Linear(D, SI, bias=cfg.expert_bias, dtype=dtype)
            self.shared_experts.down_proj = nn.Linear(SI, D, bias=cfg.expert_bias, dtype=dtype)
            if cfg.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(D, 1, bias=False, dtype=dtype)

    # Automodel's Gate.forward (no groups): weights [T,k], indices [T,k], aux loss or None.
    def route(self, x, token_mask):
        cfg, g = self.cfg, self.gate
        logits = Fn.linear(x, g.weight, getattr(g, "bias", None))
        if self.bf16_router:
            logits = _round_bf16(logits)
        k, E = cfg.n_activated_experts, cfg.n_routed_experts
        bias = getattr(g, "e_score_correction_bias", None)
        if cfg.score_func == "softmax" and not cfg.softmax_before_topk:
            scores = logits.softmax(dim=-1)
            top, indices = logits.topk(k, dim=-1)
            weights = top.softmax(dim=-1)
        elif cfg.score_func == "softmax":
            scores = logits.softmax(dim=-1)
            weights, indices = scores.topk(k, dim=-1)
        else:
            scores = logits.softmax(dim=-1) if cfg.score_func == "softmax_with_bias" else logits.sigmoid()
            sel = scores + bias if bias is not None else scores
            indices = sel.topk(k, dim=-1)[1]
            weights = scores.gather(1, indices)
        if cfg.norm_topk_prob and k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * cfg.route_scale
        if self.bf16_router and not getattr(cfg, "router_weights_fp32", False):
            weights = _round_bf16(weights)
        aux = None
        if self.training and cfg.aux_loss_coeff > 0:
            m = token_mask.to(x.dtype)
            ctx_len = token_mask.sum().clamp(min=1)
            load = torch.zeros(E, dtype=x.dtype).scatter_add_(
                0, indices[token_mask].reshape(-1), torch.ones(int(token_mask.sum()) * k, dtype=x.dtype))
            f = load * E / (k * ctx_len)
            P = (scores * m[:, None]).sum(0) / ctx_len
            aux = (f * P).sum()
            weights = AuxLossAutoScaler.apply(weights, cfg.aux_loss_coeff * aux)
        return weights, indices, aux

    def experts_loop(self, x, token_mask, weights, indices):
        cfg, ex = self.cfg, self.experts
        y = torch.zeros_like(x)
        for e in range(cfg.n_routed_experts):
            t, j = torch.where((indices == e) & token_mask[:, None])
            if t.numel() == 0:
                continue
            w = weights[t, j][:, None]
            h = x[t] @ ex.gate_and_up_projs[e]
            if cfg.expert_bias:
                h = h + ex.gate_up_proj_bias[e]
            a = activation(cfg.expert_activation, h, cfg.activation_alpha, cfg.activation_limit) * w
            out = a @ ex.down_projs[e]
            if cfg.expert_bias:
                out = out + ex.down_proj_bias[e] * w
            y = y.index_add(0, t, out)
        return y

    def shared(self, x):
        cfg, s = self.cfg, self.shared_experts
        if cfg.shared_expert_activation == "relu2":
            z = s.down_proj(Fn.relu(s.up_proj(x)) ** 2)
        else:
            z = s.down_proj(Fn.silu(s.gate_proj(x)) * s.up_proj(x))
        if cfg.shared_expert_gate:
            z = torch.sigmoid(self.shared_expert_gate(x)) * z
        return z

    def forward(self, x, padding_mask=None):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        token_mask = (torch.ones(x.shape[0], dtype=torch.bool) if padding_mask is None
                      else ~padding_mask.reshape(-1))
        weights, indices, self.last_aux = self.route(x, token_mask)
        y = self.experts_loop(x, token_mask, weights, indices)
        if self.cfg.n_shared_experts > 0:
            y = y + self.shared(x)
        return y.view(shape)


def reference_dispatch(xs, indices, weights, num_experts, rank):
    """The torch dispatcher's semantics for rank `rank` of R = len(xs): rows of its local experts,
    expert-major, by (source rank, source token); returns (tokens, probs, tokens_per_expert, rows) with
    rows = [(source, token)] for the matching reference combine."""
    R = len(xs)
    local = num_experts // R
    tokens, probs, counts, rows = [], [], [], []
    for e in range(rank * local, (rank + 1) * local):
        n = 0
        for s in range(R):
            t, j = torch.where(indices[s] == e)
            order = torch.argsort(t, stable=True)
            t, j = t[order], j[order]
            tokens.append(xs[s][t])
            probs.append(weights[s][t, j])
            rows += [(s, int(i)) for i in t]
            n += t.numel()
        counts.append(n)
    return torch.cat(tokens), torch.cat(probs), torch.tensor(counts), rows


def reference_combine(expert_rows_per_rank, rows_per_rank, T, rank):
    """out[t] on `rank` = the sum of every expert row (on any rank) that came from its token t."""
    out = torch.zeros(T, expert_rows_per_rank[0].shape[1], dtype=expert_rows_per_rank[0].dtype)
    for y, rows in zip(expert_rows_per_rank, rows_per_rank):
        for i, (s, t) in enumerate(rows):
            if s == rank:
                out = out.index_add(0, torch.tensor([t]), y[i:i + 1])
    return out
