"""Putting flexep's layer into a model built by NeMo Automodel 0.7.0.

    model = build_model(...)                  # any Automodel model with MoE layers
    flexep.torch.automodel.use_flexep(model)  # in place; before or after Automodel's parallelizer
    parallelize_model(model, ...)             # Automodel's own EP (DeviceMesh) and FSDP2, unchanged

Each Automodel `MoE` module keeps its submodules, parameters, buffers, state_dict keys, dtypes and
Automodel's expert-parallel DTensor layout; only two classes change: the MoE module and its experts
module become subclasses of their own classes whose forward runs flexep's layer call
(_layer_call.py). So everything that finds MoE layers by isinstance on Automodel's classes (its
parallelizer, checkpointing, load-balance metrics) and every attribute it reads (gate.topk,
gate._cumulative_expert_load, gate._last_expert_load, ...) keeps working.

The experts' forward still accepts Automodel's own call (x, token_mask, weights, indices), which
runs Automodel's own code, so calling the experts module directly keeps its meaning.
"""

from __future__ import annotations

from typing import Optional

from flexep import _flexep
from flexep.torch._layer_call import LayerCall, run_experts, run_moe
from flexep.torch.config import BackendConfig, MoEConfig

_classes: dict = {}


def _flexep_class(cls: type, make_forward) -> type:
    """A subclass of `cls` whose forward is make_forward(cls), made once per class. The base is
    bound when the class is made, not looked up from type(self): FSDP2 subclasses the module's class
    again when it wraps it."""
    if getattr(cls, "_flexep_swapped", False):
        return cls
    if cls not in _classes:
        _classes[cls] = type(f"Flexep{cls.__name__}", (cls,), {"forward": make_forward(cls), "_flexep_swapped": True,
                                                                "__module__": __name__})
    return _classes[cls]


def _moe_forward(base: type):
    def forward(self, x, padding_mask=None, cp_mesh=None):
        if (cp_mesh if cp_mesh is not None else getattr(self, "cp_mesh", None)) is not None:
            raise _flexep.ArgumentError("flexep: invalid argument 'cp_mesh': context parallelism is not offered by "
                                        "flexep's layer; allowed: None")
        return run_moe(self, x, padding_mask)

    return forward


def _experts_forward(base: type):
    def forward(self, x, token_mask, weights, indices=None):
        if isinstance(weights, LayerCall):
            return run_experts(self, x, weights)
        return base.forward(self, x, token_mask, weights, indices)

    return forward


def _check_supported(name: str, module) -> None:
    from nemo_automodel.components.moe.experts import GroupedExperts, GroupedExpertsDeepEP

    experts = module.experts
    if not isinstance(experts, (GroupedExperts, GroupedExpertsDeepEP)):
        raise _flexep.ArgumentError(
            f"flexep: invalid argument 'model': {name}.experts is {type(experts).__name__}; flexep's layer takes "
            "the experts of GroupedExperts or GroupedExpertsDeepEP (backend.experts 'torch', 'torch_mm' or 'gmm')")


def use_flexep(model, backend: Optional[BackendConfig] = None, *, pad_multiple: int = 1) -> int:
    """Makes every Automodel MoE layer of `model` run flexep's layer; returns how many it changed.

    backend: the dispatcher and SM settings for flexep (flexep's or Automodel's BackendConfig);
    default: each layer's own Automodel backend. Raises flexep.ArgumentError naming the first layer
    whose parts flexep cannot serve (TE or MoK experts). Routing replay
    (Automodel's RouterReplay on the gate) is honoured: recorded and replayed as Automodel does.
    """
    from nemo_automodel.components.moe.layers import MoE as AutomodelMoE

    found = [(name, m) for name, m in model.named_modules() if isinstance(m, AutomodelMoE)]
    for name, m in found:
        _check_supported(name or "model", m)
    for _, m in found:
        m._flexep_config = MoEConfig.from_automodel(m.experts.config)
        m._flexep_backend = BackendConfig.from_automodel(backend if backend is not None else m.backend)
        m._flexep_group, m._flexep_pad_multiple, m._flexep_warned = None, pad_multiple, set()
        m.__class__ = _flexep_class(type(m), _moe_forward)
        m.experts.__class__ = _flexep_class(type(m.experts), _experts_forward)
    return len(found)
