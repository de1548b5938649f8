"""BackendConfig / MoEConfig: Automodel's fields, defaults and rules; the C++ messages as exceptions."""

import warnings

import pytest
import torch

import flexep
from flexep.torch import BackendConfig, MoEConfig

BASE = dict(n_routed_experts=8, n_shared_experts=0, n_activated_experts=2, n_expert_groups=1, n_limited_groups=1,
            train_gate=True, gate_bias_update_factor=0.0, aux_loss_coeff=0.0, score_func="softmax", route_scale=1.0,
            dim=16, inter_dim=32, moe_inter_dim=8, norm_topk_prob=False)


def moe(**kw):
    return MoEConfig(**{**BASE, **kw})


def test_backend_defaults_match_automodel():
    b = BackendConfig()
    assert b.dispatcher == "torch" and b.dispatcher_num_sms == 20
    assert b.experts == ("torch_mm" if torch.cuda.is_available() else "torch")
    assert b.fake_balanced_gate is False and b.fake_gate_noise == 0.0 and b.gate_precision is None


def test_hybridep_dispatcher_and_sms():
    assert BackendConfig(dispatcher="hybridep").dispatcher == "hybridep"
    assert BackendConfig(dispatcher="hybridep", dispatcher_num_sms=24).dispatcher_num_sms == 24


@pytest.mark.parametrize("spelling,dtype", [("torch.float32", torch.float32), ("float32", torch.float32),
                                            ("torch.float64", torch.float64), (torch.float64, torch.float64)])
def test_gate_precision_parsed(spelling, dtype):
    assert BackendConfig(gate_precision=spelling).gate_precision == dtype


@pytest.mark.parametrize("experts", ["te", "gmm"])
def test_te_gmm_without_ep_dispatcher_become_torch_mm(experts):
    b = BackendConfig(experts=experts, dispatcher="torch")
    assert (b.experts, b.dispatcher) == ("torch_mm", "torch")


@pytest.mark.parametrize("experts", ["te", "gmm", "torch", "torch_mm"])
def test_ep_dispatchers_keep_experts(experts):
    assert BackendConfig(experts=experts, dispatcher="hybridep").experts == experts


def test_enable_deepep_deprecation():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        b = BackendConfig(enable_deepep=True, dispatcher="torch", experts="torch")
    assert (b.dispatcher, b.experts, b.enable_deepep) == ("deepep", "gmm", None)
    assert sum("enable_deepep is deprecated" in str(x.message) for x in w) == 1
    with pytest.warns(DeprecationWarning):
        assert BackendConfig(enable_deepep=False, dispatcher="hybridep").dispatcher == "torch"


def test_ep_size_one_falls_back_to_local_path():
    b, messages, fallback = BackendConfig(dispatcher="hybridep").normalized(1)
    assert fallback and "falling back to the local path" in messages[0]
    assert not BackendConfig(dispatcher="hybridep").normalized(2)[2]


def test_te_fp8_requires_te_backend():
    with pytest.raises(ValueError, match="te_fp8 requires at least one TE backend"):
        BackendConfig(te_fp8={"recipe": "current"})


@pytest.mark.parametrize("kw,message", [
    (dict(dispatcher="nccl"), "invalid argument 'backend.dispatcher'"),
    (dict(experts="cutlass"), "invalid argument 'backend.experts'"),
    (dict(dispatcher_num_sms=0), "invalid argument 'backend.dispatcher_num_sms'"),
    (dict(fake_gate_noise=1.5), "invalid argument 'backend.fake_gate_noise'"),
])
def test_backend_errors_carry_the_cpp_message(kw, message):
    with pytest.raises(flexep.ArgumentError, match=message) as e:
        BackendConfig(**kw)
    assert isinstance(e.value, ValueError) and str(e.value).startswith("flexep: invalid argument")


def test_moe_defaults_and_dtype_strings():
    c = moe()
    assert c.dtype == torch.bfloat16 and c.expert_activation == "swiglu" and c.activation_alpha == 1.702
    assert c.activation_limit == 7.0 and c.shared_expert_inter_dim is None and c.expert_dim == 16
    assert moe(dtype="torch.float16").dtype == torch.float16 and moe(dtype="bfloat16").dtype == torch.bfloat16
    assert moe(expert_activation="quick_geglu").expert_activation == "quick_geglu"


def test_moe_required_fields_like_automodel():
    with pytest.raises(TypeError):
        MoEConfig(n_routed_experts=8)


@pytest.mark.parametrize("kw,field,detail", [
    (dict(n_activated_experts=9), "moe.n_activated_experts", "allowed: 1 <= value <= n_routed_experts (8)"),
    (dict(score_func="relu"), "moe.score_func", "allowed"),
    (dict(expert_activation="gelu"), "moe.expert_activation", "allowed"),
    (dict(route_scale=0.0), "moe.route_scale", ""),
    (dict(train_gate=False, gate_bias_update_factor=1e-3), "moe.gate_bias_update_factor", "train_gate is false"),
    (dict(n_expert_groups=3, n_limited_groups=1, score_func="sigmoid"), "moe.n_expert_groups", ""),
])
def test_moe_errors_carry_the_cpp_message(kw, field, detail):
    with pytest.raises(flexep.ArgumentError) as e:
        moe(**kw)
    assert f"flexep: invalid argument '{field}'" in str(e.value) and detail in str(e.value)


def test_unsupported_latent_projection_is_an_error():
    with pytest.raises(ValueError, match="moe_latent_size"):
        moe(moe_latent_size=4)


def test_ep_divisibility_checked_by_the_library():
    with pytest.raises(flexep.ArgumentError, match="n_routed_experts"):
        flexep._flexep.config.check_ep(moe()._cpp_json(), 3)
