"""flexep for PyTorch: NeMo Automodel 0.7.0's MoE layer, configs and flex-dispatcher API, computed by the
C++ library (tensors cross as DLPack; the extension does not link libtorch).

- MoE, Gate, GroupedExperts, MLP, FakeBalancedGate: Automodel's module tree, PyTorch-owned tensors;
- BackendConfig, MoEConfig: every field of Automodel 0.7.0's, with its default;
- automodel.use_flexep(model): flexep's layer inside a model built by Automodel;
- fused_a2a, token_dispatcher: Automodel's dispatcher functions and MoEFlexTokenDispatcher by name;
- dispatch, combine, hybrid_ep_dispatch (flexep's own Functions), create_communicator, HostRank.
"""

from flexep import ArgumentError, Error, TimeoutError  # noqa: A004
from flexep.torch._layer_call import MoEAuxLossAutoScaler, last_routing
from flexep.torch.config import BackendConfig, MoEConfig, dtype_from_str
from flexep.torch.dispatcher import (FlexTokenDispatcher, HostRank, create_communicator, get_dispatcher,
                                     init_buffer, reset_buffer, set_num_sms)
from flexep.torch.functions import combine, dispatch
from flexep.torch.modules import MLP, FakeBalancedGate, Gate, GroupedExperts
from flexep.torch.moe import MoE
from flexep.torch.token_dispatcher import MoEFlexTokenDispatcher, TokenDispatcherConfig
from flexep.torch.fused_a2a import (fused_combine, fused_dispatch, hybrid_ep_combine, hybrid_ep_dispatch,  # noqa: E402
                                    init_hybrid_ep_buffer, reset_hybrid_ep_buffer, set_deepep_num_sms)
