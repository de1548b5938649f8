"""flexep for PyTorch: NeMo Automodel's MoE layer, configs and flex-dispatcher Functions, backed by the
C++ library (tensors cross as DLPack; the extension does not link libtorch)."""

from flexep import ArgumentError, Error, TimeoutError  # noqa: A004
from flexep.torch.config import BackendConfig, MoEConfig, dtype_from_str
from flexep.torch.dispatcher import (FlexTokenDispatcher, HostRank, create_communicator, get_dispatcher,
                                     init_buffer, reset_buffer, set_num_sms)
from flexep.torch.functions import combine, dispatch, hybrid_ep_dispatch
from flexep.torch.moe import Gate, MoE, MoEAuxLossAutoScaler

__all__ = [
    "ArgumentError", "Error", "TimeoutError", "BackendConfig", "MoEConfig", "dtype_from_str", "FlexTokenDispatcher",
    "HostRank", "create_communicator", "get_dispatcher", "init_buffer", "reset_buffer", "set_num_sms", "combine",
    "dispatch", "hybrid_ep_dispatch", "Gate", "MoE", "MoEAuxLossAutoScaler",
]
