"""BackendConfig and MoEConfig with NeMo Automodel's fields, defaults and rules.

The dataclasses only carry the values: every range check, allowed value and normalisation rule is
the C++ library's (core/config.h), reached through JSON, so errors are the library's messages
raised as flexep.ArgumentError (a ValueError).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from flexep import _flexep

logger = logging.getLogger("flexep")

_DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
    "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}


def dtype_from_str(value: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    """Automodel's dtype_from_str: "torch.bfloat16", "bfloat16" and torch dtypes alike."""
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).strip().lower()
    name = name[len("torch."):] if name.startswith("torch.") else name
    if name not in _DTYPES:
        raise _flexep.ArgumentError(f"flexep: invalid argument 'dtype': '{value}' is not a dtype; allowed: "
                                    + ", ".join(sorted(set(_DTYPES))))
    return _DTYPES[name]


def _dtype_name(dtype: Optional[torch.dtype]) -> Optional[str]:
    return None if dtype is None else str(dtype).replace("torch.", "")


def _default_experts() -> str:
    return "torch_mm" if torch.cuda.is_available() else "torch"


# Automodel's BackendConfig fields that select model-wide modules (attention, linear, norms, rope,
# FP8): kept so Automodel configs load unchanged; flexep's MoE layer does not read them.
_NOT_MOE_FIELDS = ("attn", "linear", "rms_norm", "rope_fusion", "enable_hf_state_dict_adapter",
                   "enable_fsdp_optimizations", "te_fp8")
# Fields the C++ BackendConfig has (config_json.cpp), in its order.
_CPP_BACKEND_FIELDS = ("dispatcher", "experts", "dispatcher_num_sms", "deepep_num_sms", "hybridep_num_sms",
                       "hybridep_dispatch_sms", "hybridep_combine_sms", "hybridep_preprocess_sms",
                       "fake_balanced_gate", "fake_gate_noise", "gate_precision")


@dataclass(kw_only=True)
class BackendConfig:
    """Automodel's BackendConfig (nemo_automodel.components.models.common.utils).

    dispatcher: "torch" (our `alltoall`), "hybridep", "deepep" (GPU backends) or "host" (CPU, the
    simulated-ranks reference). It defaults to "torch": flexep never defaults to deepep.
    """

    attn: str = "sdpa"
    linear: str = "torch"
    rms_norm: str = "torch_fp32"
    rope_fusion: bool = False
    experts: str = field(default_factory=_default_experts)
    dispatcher: str = "torch"
    dispatcher_num_sms: int = 20
    enable_deepep: Optional[bool] = None
    fake_balanced_gate: bool = False
    fake_gate_noise: float = 0.0
    enable_hf_state_dict_adapter: bool = True
    enable_fsdp_optimizations: bool = False
    te_fp8: Any = None
    gate_precision: Union[str, torch.dtype, None] = None
    # flexep's per-backend and per-phase SM counts (0 = dispatcher_num_sms).
    deepep_num_sms: int = 0
    hybridep_num_sms: int = 0
    hybridep_dispatch_sms: int = 0
    hybridep_combine_sms: int = 0
    hybridep_preprocess_sms: int = 0

    def __post_init__(self) -> None:
        self.gate_precision = dtype_from_str(self.gate_precision)
        if self.enable_deepep is not None:
            warnings.warn(
                "enable_deepep is deprecated and will be removed in a future release. Use experts='gmm' and "
                "dispatcher='deepep' instead of enable_deepep=True, or dispatcher='torch' instead of "
                "enable_deepep=False.", DeprecationWarning, stacklevel=3)
            if self.enable_deepep:
                self.experts, self.dispatcher = "gmm", "deepep"
            else:
                self.dispatcher = "torch"
            self.enable_deepep = None
        if self.te_fp8 is not None and self.linear != "te" and self.experts != "te":
            raise ValueError("te_fp8 requires at least one TE backend (linear='te' or experts='te'), but got "
                             f"linear='{self.linear}' and experts='{self.experts}'")
        # Validation and Automodel's te/gmm -> torch_mm rewrite, by the library. The EP-size-1 fallback
        # waits for the MoE layer, which knows the group.
        normalized, messages, _ = _flexep.config.normalize_backend(self._cpp_json(), 2)
        for m in messages:
            logger.info("flexep: %s", m)
        self.experts = json.loads(normalized)["experts"]

    def to_cpp(self) -> dict:
        """The fields of the C++ BackendConfig, as its JSON expects them."""
        d = {k: getattr(self, k) for k in _CPP_BACKEND_FIELDS}
        d["gate_precision"] = _dtype_name(self.gate_precision)
        return d

    def _cpp_json(self) -> str:
        return json.dumps(self.to_cpp())

    def normalized(self, ep_size: int) -> tuple["BackendConfig", list[str], bool]:
        """Automodel's rules for this EP size: (config, messages, local_fallback)."""
        normalized, messages, local_fallback = _flexep.config.normalize_backend(self._cpp_json(), ep_size)
        out = dataclasses.replace(self, experts=json.loads(normalized)["experts"])
        return out, list(messages), bool(local_fallback)


_MOE_CPP_FIELDS = ("n_routed_experts", "n_shared_experts", "n_activated_experts", "n_expert_groups",
                   "n_limited_groups", "train_gate", "gate_bias_update_factor", "aux_loss_coeff", "score_func",
                   "route_scale", "dim", "inter_dim", "moe_inter_dim", "norm_topk_prob", "router_bias",
                   "expert_bias", "expert_activation", "activation_alpha", "activation_limit",
                   "softmax_before_topk", "shared_expert_gate", "shared_expert_inter_dim",
                   "shared_expert_activation", "force_e_score_correction_bias", "dtype")


@dataclass(kw_only=True)
class MoEConfig:
    """Automodel's MoEConfig (nemo_automodel.components.moe.config): the same required fields and
    optional defaults. Validated by the library at construction."""

    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int
    n_expert_groups: int
    n_limited_groups: int
    train_gate: bool
    gate_bias_update_factor: float
    aux_loss_coeff: float
    score_func: str
    route_scale: float
    dim: int
    inter_dim: int
    moe_inter_dim: int
    norm_topk_prob: bool
    router_bias: bool = False
    expert_bias: bool = False
    expert_activation: str = "swiglu"
    activation_alpha: float = 1.702
    activation_limit: float = 7.0
    softmax_before_topk: bool = False
    dtype: Union[str, torch.dtype] = torch.bfloat16
    shared_expert_gate: bool = False
    shared_expert_inter_dim: Optional[int] = None
    shared_expert_activation: str = "swiglu"
    force_e_score_correction_bias: bool = False
    moe_latent_size: Optional[int] = None

    def __post_init__(self) -> None:
        self.dtype = dtype_from_str(self.dtype)
        if self.moe_latent_size is not None:
            raise _flexep.ArgumentError("flexep: invalid argument 'moe.moe_latent_size': latent projections "
                                        f"are not supported (got {self.moe_latent_size}); allowed: None")
        _flexep.config.check_moe(self._cpp_json())

    @property
    def expert_dim(self) -> int:
        return self.moe_latent_size if self.moe_latent_size is not None else self.dim

    def to_cpp(self) -> dict:
        d = {k: getattr(self, k) for k in _MOE_CPP_FIELDS}
        d["dtype"] = _dtype_name(self.dtype)
        return d

    def _cpp_json(self) -> str:
        return json.dumps(self.to_cpp())
