"""BackendConfig and MoEConfig with NeMo Automodel 0.7.0's fields, defaults and rules, field by field.

Every field of Automodel's two dataclasses is accepted with its default, so a config written for
Automodel (a recipe's YAML, an Automodel model's own MoEConfig) means the same here. The fields that
select model-wide modules (attention, norms, RoPE, TE, compile switches) are carried but read by no
part of flexep's MoE layer; docs/python.md says, field by field, what each one does here.

The range checks and allowed values of the fields that reach the library are the C++ library's
(core/config.h), reached through JSON, so their errors are the library's own messages, raised as
flexep.ArgumentError (a ValueError). Automodel's instances convert with ``from_automodel``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
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


def dtype_from_str(value: Union[str, torch.dtype, None], arg: str = "dtype") -> Optional[torch.dtype]:
    """Automodel's dtype_from_str: "torch.bfloat16", "bfloat16" and torch dtypes alike. `arg` names
    the field in the error."""
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).strip().lower()
    name = name[len("torch."):] if name.startswith("torch.") else name
    if name not in _DTYPES:
        raise _flexep.ArgumentError(f"flexep: invalid argument '{arg}': '{value}' is not a dtype; allowed: "
                                    + ", ".join(sorted(set(_DTYPES))))
    return _DTYPES[name]


def _dtype_name(dtype: Optional[torch.dtype]) -> Optional[str]:
    return None if dtype is None else str(dtype).replace("torch.", "")


def _default_experts() -> str:
    return "torch_mm" if torch.cuda.is_available() else "torch"


def _to_json(values: dict, section: str) -> str:
    """JSON for the library; a float that JSON cannot carry (nan, inf) is refused here by name, and
    numpy's scalars (np.int64(16)) are taken as the Python numbers they hold."""
    values = {k: v.item() if type(v).__module__ == "numpy" and hasattr(v, "item") else v for k, v in values.items()}
    for k, v in values.items():
        if isinstance(v, float) and not math.isfinite(v):
            raise _flexep.ArgumentError(f"flexep: invalid argument '{section}.{k}': must be a finite number, got {v}")
        try:
            json.dumps(v)
        except TypeError:
            raise _flexep.ArgumentError(f"flexep: invalid argument '{section}.{k}': a {type(v).__name__} "
                                        f"({v!r:.60}); allowed: a number, string, bool or None") from None
    return json.dumps(values, allow_nan=False)


def _from_fields(cls, obj):
    """An instance of `cls` from any object with (some of) its field names: an Automodel config,
    another dataclass, a dict."""
    if isinstance(obj, cls):
        return obj
    get = obj.get if isinstance(obj, dict) else (lambda k, d: getattr(obj, k, d))
    missing = object()
    kwargs = {}
    for f in dataclasses.fields(cls):
        v = get(f.name, missing)
        if v is not missing:
            kwargs[f.name] = v
    return cls(**kwargs)


@dataclass
class CudaGraphConfig:
    """Automodel's CudaGraphConfig: which per-layer modules are captured in CUDA graphs. flexep's MoE
    layer does not capture graphs itself; the value is validated as Automodel does."""

    modules: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.modules, list):
            raise TypeError("cuda_graph.modules must be a list")
        if not all(isinstance(m, str) for m in self.modules):
            raise TypeError("cuda_graph.modules entries must be strings")
        supported = {"attn", "te_dpa", "moe_router", "moe_preprocess"}
        unknown = set(self.modules) - supported
        if unknown:
            raise ValueError(f"Unsupported cuda_graph.modules: {sorted(unknown)}; supported modules are "
                             f"{sorted(supported)}")
        if len(self.modules) != len(set(self.modules)):
            raise ValueError("cuda_graph.modules must not contain duplicates")
        if {"attn", "te_dpa"}.issubset(self.modules):
            raise ValueError("cuda_graph.modules cannot contain both 'attn' and 'te_dpa'")
        if "moe_preprocess" in self.modules and "moe_router" not in self.modules:
            raise ValueError("'moe_preprocess' in cuda_graph.modules requires 'moe_router'")


@dataclass
class MoKBackendConfig:
    """Automodel's Mixture-of-Kittens settings. Carried and validated; flexep has no MoK backend, so
    dispatcher='mok' is refused (see BackendConfig)."""

    precision: str = "bf16"
    fwd_num_comm_sms: int = 40
    bwd_num_comm_sms: int = 28
    minibatch_size: int = 4096
    macrobatch_size: int = 131072
    schedule_capacity_multiplier: float = 0.5
    all_gather_top_experts_chunk_bytes: int = 2048

    def __post_init__(self) -> None:
        if self.precision not in ("bf16", "mxfp8"):
            raise ValueError(f"mok.precision must be 'bf16' or 'mxfp8'; got {self.precision!r}")
        for name in ("fwd_num_comm_sms", "bwd_num_comm_sms"):
            v = getattr(self, name)
            if type(v) is not int or v <= 0 or v % 2 != 0:
                raise ValueError(f"mok.{name} must be a positive even integer")
        if type(self.minibatch_size) is not int or self.minibatch_size <= 0 or self.minibatch_size % 256 != 0:
            raise ValueError("mok.minibatch_size must be a positive multiple of 256")
        if (type(self.macrobatch_size) is not int or self.macrobatch_size <= 0
                or self.macrobatch_size % self.minibatch_size != 0):
            raise ValueError("mok.macrobatch_size must be a positive multiple of mok.minibatch_size")


# Fields the C++ BackendConfig has (config_json.cpp), in its order.
_CPP_BACKEND_FIELDS = ("dispatcher", "experts", "dispatcher_num_sms", "deepep_num_sms", "hybridep_num_sms",
                       "hybridep_dispatch_sms", "hybridep_combine_sms", "hybridep_preprocess_sms",
                       "fake_balanced_gate", "fake_gate_noise", "gate_precision", "rows_in_place",
                       "dispatch_chunks")
_EP_DISPATCHERS = ("deepep", "hybridep", "uccl_ep", "mok")


@dataclass(kw_only=True)
class BackendConfig:
    """Automodel 0.7.0's BackendConfig (nemo_automodel.components.models.common.utils), every field.

    dispatcher: "torch" (flexep's `alltoall`), "hybridep", "deepep" (GPU backends) or "host" (CPU, the
    simulated-ranks reference); "uccl_ep" and "mok" are refused with the list of what flexep offers.
    It defaults to "torch": flexep never defaults to deepep. The fields flexep adds at the end are
    per-backend and per-phase SM counts (0 = dispatcher_num_sms), `rows_in_place` (the GPU layer's
    experts read the tokens through the row table, no permuted copy kept; one GPU only) and
    `dispatch_chunks` (each rank's tokens in this many chunks, pipelined so that one chunk's
    communication runs under another's expert GEMMs).
    """

    attn: str = "sdpa"
    sparse_attn: str = "generic"
    linear: str = "torch"
    rms_norm: str = "torch_fp32"
    rope: str = "torch"
    rope_fusion: bool = False
    experts: str = field(default_factory=_default_experts)
    dispatcher: str = "torch"
    te_grouped_tensor: bool = False
    dispatcher_num_sms: int = 20
    dispatcher_share_token_dispatcher: bool = True
    dispatcher_async_dispatch: bool = False
    mok: Any = field(default_factory=MoKBackendConfig)
    dispatcher_hybridep_permute_fusion: bool = False
    dispatcher_hybridep_compact_routing: bool = False
    dispatcher_hybridep_num_sms_preprocessing: Optional[int] = None
    dispatcher_hybridep_num_blocks_permute: Optional[int] = None
    dispatcher_hybridep_num_blocks_unpermute: Optional[int] = None
    enable_deepep: Optional[bool] = None
    fake_balanced_gate: bool = False
    fake_gate_noise: float = 0.0
    enable_hf_state_dict_adapter: bool = True
    enable_fsdp_optimizations: bool = False
    te_fp8: Any = None
    gate_precision: Union[str, torch.dtype, None] = None
    compile_attn: bool = False
    compile_situ: bool = False
    compile_norm: bool = False
    shared_expert_overlap: bool = False
    compile_router_weight: bool = False
    benchmark_static_routing: bool = False
    cuda_graph: Any = field(default_factory=CudaGraphConfig)
    # flexep's per-backend and per-phase SM counts (0 = dispatcher_num_sms).
    deepep_num_sms: int = 0
    hybridep_num_sms: int = 0
    hybridep_dispatch_sms: int = 0
    hybridep_combine_sms: int = 0
    hybridep_preprocess_sms: int = 0
    # flexep's: the GPU layer's routed experts read the tokens in place (EP size 1; docs/experts.md).
    rows_in_place: bool = False
    # flexep's: tokens split into this many chunks, each with its own dispatcher, pipelined (1 to 16).
    dispatch_chunks: int = 1

    @classmethod
    def from_automodel(cls, backend) -> "BackendConfig":
        """flexep's BackendConfig with the values of Automodel's (or any object with these fields)."""
        if isinstance(backend, cls):
            return backend
        if isinstance(backend, (str, bytes, int, float, bool, list, tuple, dict)):
            # getattr would find none of the fields and quietly give the defaults.
            raise _flexep.ArgumentError(f"flexep: invalid argument 'backend': a {type(backend).__name__} "
                                        f"({backend!r:.60}); allowed: a BackendConfig (flexep's or Automodel's), e.g. "
                                        "BackendConfig(dispatcher='hybridep')")
        values = {f.name: getattr(backend, f.name) for f in dataclasses.fields(cls) if hasattr(backend, f.name)}
        for name in ("mok", "cuda_graph"):  # Automodel's own dataclasses: carried as their fields
            if name in values and dataclasses.is_dataclass(values[name]):
                values[name] = dataclasses.asdict(values[name])
        return cls(**values)

    def __post_init__(self) -> None:
        # Automodel 0.7.0's rules, in its order.
        if self.benchmark_static_routing and not (self.fake_balanced_gate and self.fake_gate_noise == 0.0):
            raise ValueError("benchmark_static_routing=True requires fake_balanced_gate=True and fake_gate_noise=0.0; "
                             "with a learned or noisy gate the cached routing metadata would go stale and corrupt "
                             "expert dispatch.")
        if self.sparse_attn not in ("generic", "msa"):
            raise ValueError(f"Unsupported sparse_attn={self.sparse_attn!r}; expected 'generic' or 'msa'.")
        if self.rope_fusion:
            logger.warning("rope_fusion is temporarily force-disabled globally (as in Automodel 0.7.0).")
        self.rope_fusion = False
        if isinstance(self.cuda_graph, dict):
            self.cuda_graph = CudaGraphConfig(**self.cuda_graph)
        elif dataclasses.is_dataclass(self.cuda_graph) and not isinstance(self.cuda_graph, CudaGraphConfig):
            self.cuda_graph = CudaGraphConfig(**dataclasses.asdict(self.cuda_graph))
        elif not isinstance(self.cuda_graph, CudaGraphConfig):
            raise TypeError("cuda_graph must be a CudaGraphConfig or mapping")
        if isinstance(self.mok, dict):
            self.mok = MoKBackendConfig(**self.mok)
        elif dataclasses.is_dataclass(self.mok) and not isinstance(self.mok, MoKBackendConfig):
            self.mok = MoKBackendConfig(**dataclasses.asdict(self.mok))
        elif not isinstance(self.mok, MoKBackendConfig):
            raise TypeError("mok must be a MoKBackendConfig or mapping")
        self.gate_precision = dtype_from_str(self.gate_precision, "backend.gate_precision")
        if self.experts == "gmm":
            warnings.warn("experts='gmm' is deprecated; use experts='torch_mm' instead.", FutureWarning, stacklevel=3)
        if self.enable_deepep is not None:
            logger.warning("enable_deepep is no longer supported and is ignored. Set 'dispatcher' "
                           "(deepep/hybridep/torch) and 'experts' explicitly instead.")
            self.enable_deepep = None
        if self.te_grouped_tensor:
            if self.experts != "te":
                raise ValueError("te_grouped_tensor=True requires experts='te'.")
            if self.dispatcher not in ("deepep", "hybridep", "uccl_ep"):
                raise ValueError("te_grouped_tensor=True requires dispatcher='deepep', 'hybridep', or 'uccl_ep'; "
                                 f"got dispatcher='{self.dispatcher}'.")
        graph_modules = self.cuda_graph.modules
        if {"attn", "te_dpa"}.intersection(graph_modules) and self.attn != "te":
            raise ValueError(f"{sorted({'attn', 'te_dpa'}.intersection(graph_modules))} in cuda_graph.modules "
                             "requires attn='te'")
        if "moe_router" in graph_modules and self.fake_balanced_gate:
            raise ValueError("'moe_router' in cuda_graph.modules requires the learned Gate (fake_balanced_gate=False)")
        if "moe_preprocess" in graph_modules and self.dispatcher != "hybridep":
            raise ValueError("'moe_preprocess' in cuda_graph.modules requires dispatcher='hybridep'")
        if self.te_fp8 is not None and self.linear != "te" and self.experts != "te":
            raise ValueError("te_fp8 requires at least one TE backend (linear='te' or experts='te'), but got "
                             f"linear='{self.linear}', experts='{self.experts}'")
        # HybridEP's preprocessing SM count is flexep's hybridep_preprocess_sms.
        if self.dispatcher_hybridep_num_sms_preprocessing is not None and self.hybridep_preprocess_sms == 0:
            self.hybridep_preprocess_sms = int(self.dispatcher_hybridep_num_sms_preprocessing)
        # Validation, the refusal of uccl_ep / mok, and Automodel's te/gmm -> torch_mm rewrite, by the
        # library. The EP-size-1 fallback waits for the MoE layer, which knows the group.
        normalized, messages, _ = _flexep.config.normalize_backend(self._cpp_json(), 2)
        for m in messages:
            logger.info("flexep: %s", m)
        cpp = json.loads(normalized)
        self.experts = cpp["experts"]
        if self.dispatcher != "host" and cpp["dispatcher"] == "alltoall":
            self.dispatcher = "torch"

    def to_cpp(self) -> dict:
        """The fields of the C++ BackendConfig, as its JSON expects them."""
        d = {k: getattr(self, k) for k in _CPP_BACKEND_FIELDS}
        d["gate_precision"] = _dtype_name(self.gate_precision)
        return d

    def _cpp_json(self) -> str:
        return _to_json(self.to_cpp(), "backend")

    def normalized(self, ep_size: int) -> tuple["BackendConfig", list[str], bool]:
        """Automodel's rules for this EP size: (config, messages, local_fallback)."""
        normalized, messages, local_fallback = _flexep.config.normalize_backend(self._cpp_json(), ep_size)
        out = dataclasses.replace(self, experts=json.loads(normalized)["experts"])
        return out, list(messages), bool(local_fallback)


# Fields the C++ MoEConfig has (config_json.cpp).
_MOE_CPP_FIELDS = ("n_routed_experts", "n_shared_experts", "n_activated_experts", "n_expert_groups",
                   "n_limited_groups", "train_gate", "gate_bias_update_factor", "aux_loss_coeff", "score_func",
                   "route_scale", "dim", "inter_dim", "moe_inter_dim", "norm_topk_prob", "router_bias",
                   "expert_bias", "expert_activation", "apply_router_weight_after_down", "activation_alpha",
                   "activation_limit", "swiglu_limit", "softmax_before_topk", "router_weights_fp32",
                   "router_weight_uses_score_correction_bias", "shared_expert_gate", "shared_expert_inter_dim",
                   "shared_expert_activation", "force_e_score_correction_bias", "moe_latent_size",
                   "enable_routing_replay", "dtype", "gate_dtype", "group_mask")


@dataclass(kw_only=True)
class MoEConfig:
    """Automodel 0.7.0's MoEConfig (nemo_automodel.components.moe.config): the same required fields
    and optional defaults, validated by the library at construction. `group_mask` is flexep's own:
    "automodel" (default: dropped groups scored as Automodel does per score function) or "neg_inf"
    (dropped groups masked with -inf for every score function, as HF transformers' DeepSeek-V3 does)."""

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
    apply_router_weight_after_down: bool = False
    activation_alpha: float = 1.702
    activation_limit: float = 7.0
    swiglu_limit: float = 0.0
    softmax_before_topk: bool = False
    router_weights_fp32: bool = False
    router_weight_uses_score_correction_bias: bool = False
    dtype: Union[str, torch.dtype] = torch.bfloat16
    gate_dtype: Union[str, torch.dtype, None] = None
    shared_expert_gate: bool = False
    shared_expert_inter_dim: Optional[int] = None
    shared_expert_activation: str = "swiglu"
    force_e_score_correction_bias: bool = False
    moe_latent_size: Optional[int] = None
    enable_routing_replay: bool = False
    group_mask: str = "automodel"

    @classmethod
    def from_automodel(cls, config) -> "MoEConfig":
        """flexep's MoEConfig with the values of Automodel's (or any object with these fields)."""
        return _from_fields(cls, config)

    def __post_init__(self) -> None:
        self.dtype = dtype_from_str(self.dtype, "moe.dtype") if self.dtype is not None else torch.bfloat16
        self.gate_dtype = dtype_from_str(self.gate_dtype, "moe.gate_dtype")
        _flexep.config.check_moe(self._cpp_json())

    @property
    def expert_dim(self) -> int:
        """Dimension of the expert projections: the latent size when set, otherwise the model dim."""
        return self.moe_latent_size if self.moe_latent_size is not None else self.dim

    @property
    def param_gate_dtype(self) -> torch.dtype:
        """The gate's storage dtype: gate_dtype when set, else dtype (Automodel's rule)."""
        return self.gate_dtype or self.dtype

    def to_cpp(self) -> dict:
        d = {k: getattr(self, k) for k in _MOE_CPP_FIELDS}
        d["dtype"] = _dtype_name(self.dtype)
        d["gate_dtype"] = _dtype_name(self.gate_dtype)
        return d

    def _cpp_json(self) -> str:
        return _to_json(self.to_cpp(), "moe")
