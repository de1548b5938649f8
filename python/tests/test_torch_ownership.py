"""PyTorch owns flexep.torch.MoE's tensors: FSDP2 (1 and 2 gloo processes), meta-device construction,
to_empty + init_weights, .to() / .double(), load_state_dict(assign=True), activation checkpointing,
micro-batch accumulation and optimizers behave as with Automodel's own layer."""

import gc
import itertools
import weakref

import pytest
import torch
import torch.utils.checkpoint as ckpt

import flexep.torch as ft
from automodel_pair import AmMoE, am_backend, am_config, assert_close_pair, pair, run
from distributed import run_processes
from fsdp_bodies import fsdp_training

CONFIG = dict(score_func="sigmoid", gate_bias_update_factor=1e-3, n_expert_groups=4, n_limited_groups=2,
              n_shared_experts=1, shared_expert_gate=True, expert_bias=True, router_bias=True, aux_loss_coeff=0.01)


def _x(seed=3, T=16):
    return torch.randn(T, 16, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("reshard_after_forward,experts_unit", [(True, True), (False, True), (True, False)])
def test_fsdp2_trains_as_automodel(world, reshard_after_forward, experts_unit):
    runs = {which: run_processes(world, fsdp_training, which, reshard_after_forward, experts_unit, 3, CONFIG)
            for which in ("automodel", "flexep")}
    for rank in range(world):
        ref, ours = runs["automodel"][rank], runs["flexep"][rank]
        assert all(ours["got_grad"].values()), ours["got_grad"]
        assert ours["got_grad"].keys() == ref["got_grad"].keys()
        assert not torch.allclose(ours["after"], ours["before"]), "a step left the output unchanged"
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(ours["after"], ref["after"], rtol=1e-5, atol=1e-6)


def _empty_then_init(module):
    """to_empty() memory made NaN (so that it is deterministic), then init_weights; returns the
    names of the tensors init_weights left uninitialised."""
    module.to_empty(device="cpu")
    tensors = dict(itertools.chain(module.named_parameters(), module.named_buffers()))
    with torch.no_grad():
        for t in tensors.values():
            t.fill_(float("nan"))
        module.init_weights(torch.device("cpu"), init_std=0.05)
    return {n for n, t in tensors.items() if t.isnan().any()}


def test_meta_device_then_to_empty_and_init_weights():
    cfg, b = am_config(**CONFIG), am_backend()
    with torch.device("meta"):
        m, ref = ft.MoE(cfg, b), AmMoE(cfg, b)
    assert all(p.device.type == "meta" for p in m.parameters())
    left = _empty_then_init(m)
    # init_weights covers what Automodel's covers, no more and no less (it leaves the shared
    # experts' biases and the shared-expert gate to nn.Linear's constructor).
    assert left == _empty_then_init(ref)
    assert "shared_experts.down_proj.bias" in left
    assert 0.03 < m.experts.gate_and_up_projs.std().item() < 0.07
    assert torch.count_nonzero(m.gate.e_score_correction_bias) == 0
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, t in m.state_dict().items():
            if n in left:
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
    ref.load_state_dict(m.state_dict())
    assert_close_pair(ref, m, _x())


def test_double_and_to_move_the_module():
    ref, ours = pair(**CONFIG)
    ref.double()
    ours.to(torch.float64)
    assert ours.experts.gate_and_up_projs.dtype == torch.float64
    assert ours.gate.e_score_correction_bias.dtype == torch.float64  # as nn.Module.double() does for buffers
    assert_close_pair(ref, ours, _x().double())


def test_load_state_dict_assign_replaces_the_tensors():
    ref, ours = pair(**CONFIG)
    new = {k: v.clone() * 1.5 for k, v in ref.state_dict().items()}
    ref.load_state_dict(new)
    ours.load_state_dict({k: v.clone() for k, v in new.items()}, assign=True)
    assert ours.experts.down_projs.data_ptr() != ref.experts.down_projs.data_ptr()
    assert_close_pair(ref, ours, _x())


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing(use_reentrant):
    _, ours = pair(**CONFIG)
    x = _x()
    y_plain, gx_plain, g_plain = run(ours, x)
    ours.zero_grad(set_to_none=True)
    xc = x.clone().requires_grad_()
    y = ckpt.checkpoint(ours, xc, use_reentrant=use_reentrant)
    (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(99))).sum().backward()
    torch.testing.assert_close(y.detach(), y_plain)
    torch.testing.assert_close(xc.grad, gx_plain)
    for n, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, g_plain[n], msg=n)


class _RecordingCompute:
    """The library's MoECompute, recording a weak reference to the state of each forward."""

    def __init__(self, inner):
        self.inner, self.states = inner, []

    def forward(self, *args):
        out = self.inner.forward(*args)
        self.states.append(weakref.ref(out[3]))
        return out

    def backward(self, *args):
        return self.inner.backward(*args)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_checkpointing_frees_the_librarys_activations_until_backward(monkeypatch, checkpointed):
    """Under torch.utils.checkpoint the library's saved state (its activations) is freed right after
    the forward and made again by the recomputation for the backward; without checkpointing it lives
    until the backward. Either way the graph frees it."""
    import flexep.torch._layer_call as lc

    _, ours = pair(**CONFIG)
    real, recorded = lc.compute_of, {}
    monkeypatch.setattr(lc, "compute_of", lambda moe, device: recorded.setdefault("c", _RecordingCompute(
        real(moe, device))))
    x = _x().requires_grad_()
    y = ckpt.checkpoint(ours, x, use_reentrant=False) if checkpointed else ours(x)
    gc.collect()
    states = recorded["c"].states
    assert len(states) == 1 and (states[0]() is None) == checkpointed
    y.square().sum().backward()
    assert len(states) == (2 if checkpointed else 1)
    gc.collect()
    assert all(s() is None for s in states)
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_micro_batches_accumulate_into_grad():
    _, ours = pair(**CONFIG)
    xs = [_x(1), _x(2)]
    singles = []
    for x in xs:
        ours.zero_grad(set_to_none=True)
        ours(x).square().sum().backward()
        singles.append({n: p.grad.clone() for n, p in ours.named_parameters()})
    ours.zero_grad(set_to_none=True)
    for x in xs:
        ours(x).square().sum().backward()
    for n, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, singles[0][n] + singles[1][n], msg=n)


@pytest.mark.parametrize("opt", [torch.optim.SGD, torch.optim.Adam])
def test_optimizer_steps_match_automodel(opt):
    ref, ours = pair(**CONFIG)
    opts = [opt(m.parameters(), lr=1e-2) for m in (ref, ours)]
    for step in range(3):
        x = _x(10 + step)
        for m, o in zip((ref, ours), opts):
            o.zero_grad(set_to_none=True)
            m(x).square().mean().backward()
            o.step()
    for (n, a), (_, b) in zip(ref.state_dict().items(), ours.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=n)


def test_a_wrong_tensor_is_an_error_naming_it():
    _, ours = pair(**CONFIG)
    ours.experts.down_projs = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ft.ArgumentError, match="experts.down_projs"):
        ours(_x())
