"""BackendConfig / MoEConfig against the real NeMo Automodel 0.7.0 classes: every field and default,
Automodel's rules, conversion of Automodel's own instances, and the library's named errors."""

import dataclasses
import logging
import warnings

import pytest
import torch

import flexep
from flexep.torch import BackendConfig, MoEConfig
from nemo_automodel.components.models.common.utils import BackendConfig as AmBackendConfig
from nemo_automodel.components.moe.config import MoEConfig as AmMoEConfig

BASE = dict(n_routed_experts=8, n_shared_experts=0, n_activated_experts=2, n_expert_groups=1, n_limited_groups=1,
            train_gate=True, gate_bias_update_factor=0.0, aux_loss_coeff=0.0, score_func="softmax", route_scale=1.0,
            dim=16, inter_dim=32, moe_inter_dim=8, norm_topk_prob=False)

# flexep's documented departures from Automodel's defaults (docs/python.md): it never defaults to
# DeepEP (Automodel picks it when deep_ep imports), and it carries these extra fields.
FLEXEP_ONLY_BACKEND = {"deepep_num_sms", "hybridep_num_sms", "hybridep_dispatch_sms", "hybridep_combine_sms",
                       "hybridep_preprocess_sms", "rows_in_place", "dispatch_chunks"}
FLEXEP_ONLY_MOE = {"group_mask"}


def moe(**kw):
    return MoEConfig(**{**BASE, **kw})


def _default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        v = f.default_factory()
        return dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
    return dataclasses.MISSING


@pytest.mark.parametrize("ours,theirs,extra", [(BackendConfig, AmBackendConfig, FLEXEP_ONLY_BACKEND),
                                               (MoEConfig, AmMoEConfig, FLEXEP_ONLY_MOE)])
def test_every_automodel_field_with_its_default(ours, theirs, extra):
    mine = {f.name: f for f in dataclasses.fields(ours)}
    for f in dataclasses.fields(theirs):
        assert f.name in mine, f"{ours.__name__} lacks Automodel's field {f.name}"
        assert _default(mine[f.name]) == _default(f), f"{f.name}: {_default(mine[f.name])} != {_default(f)}"
    assert set(mine) - {f.name for f in dataclasses.fields(theirs)} == extra


def test_instances_convert_field_by_field():
    am = AmBackendConfig(dispatcher="hybridep", dispatcher_num_sms=24, fake_balanced_gate=True, fake_gate_noise=0.3,
                         gate_precision="float32", dispatcher_hybridep_num_sms_preprocessing=8)
    b = BackendConfig.from_automodel(am)
    assert (b.dispatcher, b.dispatcher_num_sms, b.fake_gate_noise, b.gate_precision) == ("hybridep", 24, 0.3,
                                                                                          torch.float32)
    assert b.hybridep_preprocess_sms == 8 and b.cuda_graph.modules == []
    am_moe = AmMoEConfig(**BASE, swiglu_limit=3.0)
    mine = dataclasses.asdict(MoEConfig.from_automodel(am_moe))
    assert mine.pop("group_mask") == "automodel"
    assert mine == dataclasses.asdict(am_moe)


def test_enable_deepep_is_ignored_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="flexep"):
        b = BackendConfig(enable_deepep=True, dispatcher="torch", experts="torch")
    assert (b.dispatcher, b.experts, b.enable_deepep) == ("torch", "torch", None)
    assert any("enable_deepep is no longer supported" in r.message for r in caplog.records)


def test_gmm_is_deprecated_and_falls_back_without_an_ep_dispatcher():
    with pytest.warns(FutureWarning, match="experts='gmm' is deprecated"):
        b = BackendConfig(experts="gmm", dispatcher="torch")
    assert (b.experts, b.dispatcher) == ("torch_mm", "torch")
    with pytest.warns(FutureWarning):
        assert BackendConfig(experts="gmm", dispatcher="hybridep").experts == "gmm"


@pytest.mark.parametrize("kw,message", [
    (dict(benchmark_static_routing=True), "benchmark_static_routing=True requires fake_balanced_gate"),
    (dict(sparse_attn="dense"), "Unsupported sparse_attn"),
    (dict(te_grouped_tensor=True), "te_grouped_tensor=True requires experts='te'"),
    (dict(te_fp8={"recipe": "current"}), "te_fp8 requires at least one TE backend"),
    (dict(cuda_graph={"modules": ["moe_preprocess"]}), "requires 'moe_router'"),
    (dict(cuda_graph={"modules": ["moe_router", "moe_preprocess"]}), "requires dispatcher='hybridep'"),
    (dict(mok={"precision": "fp4"}), "mok.precision must be"),
])
def test_automodel_rules_raise_as_automodel(kw, message):
    with pytest.raises((ValueError, TypeError), match=message):
        BackendConfig(**kw)
    with pytest.raises((ValueError, TypeError), match=message):
        AmBackendConfig(**kw)


def test_values_automodel_accepts_are_accepted():
    assert BackendConfig(dispatcher_num_sms=0).dispatcher_num_sms == 0
    assert BackendConfig(fake_balanced_gate=True, fake_gate_noise=1.5).fake_gate_noise == 1.5
    b = BackendConfig(fake_balanced_gate=True, benchmark_static_routing=True)
    assert b.benchmark_static_routing
    assert BackendConfig(rope_fusion=True).rope_fusion is False  # force-disabled, as Automodel does


@pytest.mark.parametrize("dispatcher", ["uccl_ep", "mok"])
def test_backends_flexep_cannot_serve_name_what_it_offers(dispatcher):
    with pytest.raises(flexep.ArgumentError, match=r"backend\.dispatcher.*" + dispatcher + r".*hybridep"):
        BackendConfig(dispatcher=dispatcher)


@pytest.mark.parametrize("spelling,dtype", [("torch.float32", torch.float32), ("float32", torch.float32),
                                            ("torch.float64", torch.float64), (torch.float64, torch.float64)])
def test_gate_precision_parsed(spelling, dtype):
    assert BackendConfig(gate_precision=spelling).gate_precision == dtype


def test_ep_size_one_falls_back_to_local_path():
    b, messages, fallback = BackendConfig(dispatcher="hybridep").normalized(1)
    assert fallback and any("expert-parallel size is 1" in m for m in messages)


def test_rows_in_place_is_a_boolean_for_one_gpu_or_deepep():
    assert BackendConfig().rows_in_place is False
    b = BackendConfig(rows_in_place=True)
    assert b.to_cpp()["rows_in_place"] is True
    _, messages, _ = b.normalized(1)
    assert messages == []
    _, messages, _ = b.normalized(2)
    assert messages == ["rows_in_place reads the rows in place on one GPU or with the deepep dispatcher; with "
                        "dispatcher='alltoall' and an expert-parallel size of 2 the experts take the dispatcher's rows"]
    _, messages, _ = BackendConfig(rows_in_place=True, dispatcher="deepep").normalized(2)
    assert messages == []
    with pytest.raises(flexep.ArgumentError, match=r"'backend.rows_in_place'.*boolean.*\"yes\""):
        BackendConfig(rows_in_place="yes")


def test_moe_dtype_strings_and_gate_dtype():
    c = moe(dtype="torch.float16", gate_dtype="float32")
    assert c.dtype == torch.float16 and c.gate_dtype == torch.float32 and c.param_gate_dtype == torch.float32
    assert moe().dtype == torch.bfloat16 and moe().gate_dtype is None


@pytest.mark.parametrize("kw", [dict(n_expert_groups=0), dict(n_expert_groups=0, n_limited_groups=0),
                                dict(score_func="softmax", n_expert_groups=4, n_limited_groups=2),
                                dict(score_func="sigmoid_with_bias", force_e_score_correction_bias=True),
                                dict(score_func="sqrtsoftplus"), dict(expert_activation="swigluoai"),
                                dict(expert_activation="geglu"), dict(swiglu_limit=7.0),
                                dict(router_weights_fp32=True), dict(apply_router_weight_after_down=True),
                                dict(router_weight_uses_score_correction_bias=True)])
def test_configs_automodel_writes_are_accepted(kw):
    c = moe(**kw)
    for k, v in kw.items():
        assert getattr(c, k) == v


@pytest.mark.parametrize("kw,field", [
    (dict(n_activated_experts=9), "moe.n_activated_experts"),
    (dict(score_func="tanh"), "moe.score_func"),
    (dict(expert_activation="gelu"), "moe.expert_activation"),
    (dict(dim=0), "moe.dim"),
    (dict(swiglu_limit=-1.0), "moe.swiglu_limit"),
    (dict(group_mask="zero"), "moe.group_mask"),
    (dict(route_scale=float("nan")), "moe.route_scale"),
])
def test_moe_errors_name_the_field(kw, field):
    with pytest.raises(flexep.ArgumentError, match=field.replace(".", r"\.")):
        moe(**kw)


def test_ep_divisibility_checked_by_the_library():
    with pytest.raises(flexep.ArgumentError, match="divisible|divide"):
        flexep._flexep.config.check_ep(moe()._cpp_json(), 3)
