"""flexep put into a model built by NeMo Automodel 0.7.0 (flexep.torch.automodel.use_flexep), on its tiny
DeepSeek-V3 class: the module tree, state_dict, isinstance checks, load-balance metrics and bias
update stay Automodel's; the outputs and gradients equal the original model's; Automodel's own EP
layout (DTensor Shard(0) over a mesh of gloo processes) round-trips; and 20 training steps under
Automodel's parallelizer (FSDP2 on 2 processes) give Automodel's losses."""

import copy

import pytest
import torch

import flexep
import flexep.torch.automodel as fa
from distributed import run_processes
from fsdp_bodies import ep_state_dict_round_trip, tiny_deepseek_v3, train_tiny_model
from nemo_automodel.components.moe import load_balance_metrics as lbm
from nemo_automodel.components.moe.experts import GroupedExperts
from nemo_automodel.components.moe.layers import Gate, MoE


def _ids(seed=0):
    return torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(seed))


def _swapped_pair():
    ref = tiny_deepseek_v3()
    ours = copy.deepcopy(ref)
    assert fa.use_flexep(ours) == 2
    return ref, ours


def _logits(model, ids):
    out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def test_module_tree_and_state_dict_stay_automodels():
    ref, ours = _swapped_pair()
    moes = [m for m in ours.modules() if isinstance(m, MoE)]
    assert len(moes) == 2 and all(isinstance(m.experts, GroupedExperts) and isinstance(m.gate, Gate) for m in moes)
    a, b = ref.state_dict(), ours.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert (a[k].shape, a[k].dtype) == (b[k].shape, b[k].dtype), k
        torch.testing.assert_close(a[k], b[k])


def test_outputs_and_gradients_equal_the_original_model():
    ref, ours = _swapped_pair()
    ids = _ids()
    for m in (ref, ours):
        m.train()
        _logits(m, ids).float().logsumexp(-1).sum().backward()
    torch.testing.assert_close(_logits(ours, ids), _logits(ref, ids), rtol=1e-5, atol=1e-5)
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for n, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_load_balance_metrics_and_bias_update_work_as_before():
    ref, ours = _swapped_pair()
    for m in (ref, ours):
        lbm.enable_load_balance_tracking(m)
        m.train()
        _logits(m, _ids(1)).sum().backward()
    loads_ref, loads = lbm.collect_expert_loads(ref), lbm.collect_expert_loads(ours)
    assert loads.keys() == loads_ref.keys() and len(loads) == 2
    for k in loads:
        torch.testing.assert_close(loads[k]["expert_load"], loads_ref[k]["expert_load"])
    assert lbm.compute_brief_metrics(loads) == lbm.compute_brief_metrics(loads_ref)
    for m in (ref, ours):
        for g in m.modules():
            if isinstance(g, Gate):
                g.update_bias()
    for (n, a), (_, b) in zip(ref.named_buffers(), ours.named_buffers()):
        torch.testing.assert_close(b, a, msg=n)


def test_experts_keep_automodels_own_call():
    _, ours = _swapped_pair()
    experts = next(m for m in ours.modules() if isinstance(m, MoE)).experts
    x = torch.randn(6, 32)
    w, idx = torch.full((6, 2), 0.5), torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [0, 7], [1, 6]])
    y = experts(x, torch.ones(6, dtype=torch.bool), w, idx)
    assert y.shape == (6, 32) and torch.isfinite(y).all()


def test_unsupported_layers_are_named():
    model = tiny_deepseek_v3()
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    moe.experts = torch.nn.Linear(32, 32)
    with pytest.raises(flexep.ArgumentError, match="experts is Linear"):
        fa.use_flexep(model)


def test_latent_projection_layer_runs_flexep_with_automodels_tensors():
    """An Automodel MoE with moe_latent_size (its fc1/fc2_latent_proj nn.Linear, biases on), swapped
    in place: same state_dict, outputs and every gradient as Automodel's own forward."""
    from automodel_pair import am_backend, am_config, randomize

    cfg = am_config(moe_latent_size=12, expert_bias=True, n_shared_experts=1, shared_expert_gate=True)
    ref = torch.nn.ModuleDict({"moe": MoE(cfg, am_backend())})
    randomize(ref, 3)
    ours = copy.deepcopy(ref)
    assert fa.use_flexep(ours) == 1
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert ours["moe"].fc1_latent_proj.weight.shape == (12, 16)
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(4))
    outs = []
    for m in (ref, ours):
        xi = x.clone().requires_grad_()
        y = m["moe"](xi)
        (y * torch.arange(y.numel()).reshape(y.shape).sin()).sum().backward()
        outs.append((y.detach(), xi.grad, {n: p.grad for n, p in m.named_parameters()}))
    (y_ref, gx_ref, g_ref), (y, gx, g) = outs
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-6)
    assert g.keys() == g_ref.keys() and "moe.fc2_latent_proj.bias" in g
    for n in g_ref:
        torch.testing.assert_close(g[n], g_ref[n], rtol=1e-4, atol=1e-6, msg=n)


def test_expert_parallel_state_dict_round_trips_in_automodels_layout():
    results = run_processes(2, ep_state_dict_round_trip)
    for r in results:
        assert r["experts_shape"] == [8, 32, 32] and r["local_shape"] == [4, 32, 32]
        assert r["placements"] == "(Shard(dim=0),)"
        assert r["round_trip_equal"]
        assert "expert parallelism over processes on the CPU" in r["forward_error"]


def test_training_under_automodels_parallelizer_gives_automodels_losses():
    ref = run_processes(2, train_tiny_model, False, 20)
    ours = run_processes(2, train_tiny_model, True, 20)
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(ours[rank]), torch.tensor(ref[rank]), rtol=1e-4, atol=0)
        assert ours[rank][-1] < ours[rank][0]
