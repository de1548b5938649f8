"""GPU only: the shared experts live in the library as a one-expert grouped layer
(shared_experts.gate_and_up_projs [1, dim, up], down_projs [1, inter, dim], biases [1, up] / [1, dim]).
These state_dict hooks present and accept Automodel's nn.Linear names instead
(shared_experts.{gate,up,down}_proj.{weight,bias}), by slicing and transposing: a layout change, no
arithmetic. Loading copies into the library's memory in place.
"""

from __future__ import annotations

import torch

_GROUPED = ("gate_and_up_projs", "down_projs", "gate_up_proj_bias", "down_proj_bias")


def _gated(module) -> bool:
    return module.config.shared_expert_activation != "relu2"


def _inter(module) -> int:
    c = module.config
    return c.n_shared_experts * (c.shared_expert_inter_dim or c.moe_inter_dim)


def to_automodel(module, grouped: dict) -> dict:
    """{grouped name: tensor} -> {Automodel name: tensor} (views where possible)."""
    inter, out = _inter(module), {}
    gu, dn = grouped["gate_and_up_projs"][0], grouped["down_projs"][0]
    if _gated(module):
        out["gate_proj.weight"], out["up_proj.weight"] = gu[:, :inter].t(), gu[:, inter:].t()
    else:
        out["up_proj.weight"] = gu.t()
    out["down_proj.weight"] = dn.t()
    if "gate_up_proj_bias" in grouped:
        gb = grouped["gate_up_proj_bias"][0]
        if _gated(module):
            out["gate_proj.bias"], out["up_proj.bias"] = gb[:inter], gb[inter:]
        else:
            out["up_proj.bias"] = gb
        out["down_proj.bias"] = grouped["down_proj_bias"][0]
    return out


def install_hooks(module) -> None:
    shared = module.shared_experts

    def save_hook(mod, state_dict, prefix, local_metadata):
        grouped = {k: state_dict.pop(prefix + k) for k in _GROUPED if prefix + k in state_dict}
        for k, v in to_automodel(module, grouped).items():
            state_dict[prefix + k] = v.contiguous()
        return state_dict

    def load_pre_hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        if prefix + "down_proj.weight" not in state_dict:
            return
        grouped = {k: getattr(shared, k) for k in _GROUPED if hasattr(shared, k)}
        targets = to_automodel(module, grouped)
        with torch.no_grad():
            for k, view in targets.items():
                view.copy_(state_dict.pop(prefix + k))
        # The grouped parameters are now loaded: hand them to the default loader as they are.
        for k, p in grouped.items():
            state_dict[prefix + k] = p.detach()

    shared._register_state_dict_hook(save_hook)
    shared._register_load_state_dict_pre_hook(load_pre_hook)
