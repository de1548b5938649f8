"""flexep._flexep.MoECompute driven directly with torch tensors that PyTorch owns (weights passed per call
as {state_dict name: tensor}) against the owner binding _flexep.MoELayer holding the same values: the
same outputs, aux losses, grad x and gradients bit for bit, on 1 and 2 simulated ranks; the weight specs;
unknown and missing names; bf16 on the CPU; the routing override; a backward given clones of the weights
while the forward's tensors hold NaN; fresh gradient tensors per backward."""

import json

import pytest
import torch

from flexep import _flexep

BASE = dict(n_routed_experts=8, n_activated_experts=2, dim=12, inter_dim=32, moe_inter_dim=6, dtype="float64")
CASES = {
    "softmax": {},
    "sigmoid-correction-groups": dict(score_func="sigmoid", gate_bias_update_factor=1e-3, n_expert_groups=4,
                                      n_limited_groups=2, norm_topk_prob=True, route_scale=2.5),
    "shared-gate-biases-aux": dict(n_shared_experts=2, shared_expert_gate=True, expert_bias=True, router_bias=True,
                                   aux_loss_coeff=0.05),
    "relu2-shared-relu2": dict(expert_activation="relu2", shared_expert_activation="relu2", n_shared_experts=1,
                               expert_bias=True),
}
BACKEND = json.dumps({})


def moe_json(case):
    return json.dumps({**BASE, **CASES[case]})


def owner(case, world=None, rank=0, dtype="float64"):
    """An owner MoELayer with random biases and correction bias (init leaves them zero)."""
    cfg = {**BASE, **CASES[case]}
    d = None if world is None else _flexep.make_host_dispatcher(world, rank, cfg["n_routed_experts"])
    layer = _flexep.MoELayer(moe_json(case), BACKEND, d, dtype, 7, 0.3)
    g = torch.Generator().manual_seed(100 + rank)
    for name, value, _ in layer.parameters():
        if "bias" in name:
            torch.from_dlpack(value).copy_(torch.randn(torch.from_dlpack(value).shape, generator=g))
    cb = layer.e_score_correction_bias()
    if cb is not None:
        torch.from_dlpack(cb).copy_(0.1 * torch.randn(torch.from_dlpack(cb).shape, generator=g))
    return layer, cfg


def grouped_shared(cfg, t):
    """nn.Linear-shaped shared-expert tensors {leaf: tensor} -> the grouped one-expert layout."""
    gated = cfg.get("shared_expert_activation", "swiglu") != "relu2"
    out = {}
    if "up_proj.weight" in t:
        parts = [t["gate_proj.weight"].t(), t["up_proj.weight"].t()] if gated else [t["up_proj.weight"].t()]
        out["gate_and_up_projs"] = torch.cat(parts, 1)[None].contiguous()
        out["down_projs"] = t["down_proj.weight"].t()[None].contiguous()
    if "up_proj.bias" in t:
        parts = [t["gate_proj.bias"], t["up_proj.bias"]] if gated else [t["up_proj.bias"]]
        out["gate_up_proj_bias"] = torch.cat(parts)[None].contiguous()
        out["down_proj_bias"] = t["down_proj.bias"][None].contiguous()
    return {"shared_experts." + k: v for k, v in out.items()}


def as_grouped(cfg, named):
    """{owner name: tensor} -> {MoECompute name: tensor} (shared experts regrouped)."""
    out, shared = {}, {}
    for name, t in named.items():
        if name.startswith("shared_experts."):
            shared[name[len("shared_experts."):]] = t
        else:
            out[name] = t
    out.update(grouped_shared(cfg, shared))
    return out


def owner_weights(layer, cfg):
    w = as_grouped(cfg, {name: torch.from_dlpack(v) for name, v, _ in layer.parameters()})
    cb = layer.e_score_correction_bias()
    if cb is not None:
        w["gate.e_score_correction_bias"] = torch.from_dlpack(cb)
    return w


def inputs(cfg, rank, T=7, dtype=torch.float64):
    g = torch.Generator().manual_seed(3 + rank)
    x = torch.randn(T, cfg["dim"], dtype=torch.float64, generator=g).to(dtype)
    grad = torch.randn(T, cfg["dim"], dtype=torch.float64, generator=g).to(dtype)
    pad = torch.zeros(T, dtype=torch.bool)
    pad[-2:] = True
    return x, pad, grad


def run_owner(layer, x, pad, grad, aux_scale):
    layer.aux_loss_scale = aux_scale
    out, aux, state = layer.forward(x, pad, True)
    gx, grads = layer.backward(state, grad)
    return torch.from_dlpack(out), aux, torch.from_dlpack(gx), {k: torch.from_dlpack(v) for k, v in grads.items()}


def run_compute(m, fwd_w, bwd_w, x, pad, grad, aux_scale=1.0, routing=None, between=None):
    out, aux, load, state = m.forward(fwd_w, x, pad, True, routing)
    if between is not None:
        between()
    gx, grads = m.backward(bwd_w, state, grad, aux_scale)
    aux = None if aux is None else torch.from_dlpack(aux)
    return (torch.from_dlpack(out), aux, torch.from_dlpack(load), torch.from_dlpack(gx),
            {k: torch.from_dlpack(v) for k, v in grads.items()})


@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_owner_binding_bitwise(ranks, R, case):
    worlds = (_flexep.HostWorld(R, 60.0), _flexep.HostWorld(R, 60.0)) if R > 1 else (None, None)

    def rank_fn(r):
        layer, cfg = owner(case, worlds[0], r)
        x, pad, grad = inputs(cfg, r)
        want = run_owner(layer, x, pad, grad, 0.7)
        d = None if worlds[1] is None else _flexep.make_host_dispatcher(worlds[1], r, cfg["n_routed_experts"])
        m = _flexep.MoECompute(moe_json(case), BACKEND, d)
        w = owner_weights(layer, cfg)
        return cfg, pad, want, run_compute(m, w, w, x, pad, grad, 0.7), m

    for cfg, pad, want, got, m in (ranks(R, rank_fn) if R > 1 else [rank_fn(0)]):
        out, aux, gx, grads = want
        g_out, g_aux, g_load, g_gx, g_grads = got
        assert torch.equal(g_out, out) and g_out.dtype == torch.float64
        assert (g_aux is None) == (aux is None)
        if aux is not None:
            assert g_aux.item() == aux
        assert torch.equal(g_gx, gx)
        want_grads = as_grouped(cfg, grads)
        assert sorted(g_grads) == sorted(want_grads)
        for k, v in want_grads.items():
            assert torch.equal(g_grads[k], v), k
        assert g_load.dtype == torch.int64 and g_load.shape == (cfg["n_routed_experts"],)
        assert g_load.sum().item() == int((~pad).sum()) * cfg["n_activated_experts"]
        assert m.ep_size == R and m.num_local_experts == cfg["n_routed_experts"] // R


def test_parameter_specs_name_every_weight():
    layer, cfg = owner("shared-gate-biases-aux")
    m = _flexep.MoECompute(moe_json("shared-gate-biases-aux"), BACKEND)
    specs = m.parameter_specs()
    w = owner_weights(layer, cfg)
    assert [s[0] for s in specs] == list(dict.fromkeys(s[0] for s in specs))  # no repeats
    assert {s[0] for s in specs} == set(w)
    for name, shape, requires_grad in specs:
        assert tuple(w[name].shape) == shape, name
        assert requires_grad
    assert m.ep_rank == 0 and m.ep_size == 1 and m.device == -1
    sig = _flexep.MoECompute(moe_json("sigmoid-correction-groups"), BACKEND).parameter_specs()
    assert ("gate.e_score_correction_bias", (8,), False) in sig


def test_unknown_and_missing_names_are_argument_errors():
    layer, cfg = owner("shared-gate-biases-aux")
    m = _flexep.MoECompute(moe_json("shared-gate-biases-aux"), BACKEND)
    w = owner_weights(layer, cfg)
    x, pad, _ = inputs(cfg, 0)
    with pytest.raises(_flexep.ArgumentError, match="'shared_experts.up_proj.weight'.*not a weight"):
        m.forward({**w, "shared_experts.up_proj.weight": torch.zeros(6, 12, dtype=torch.float64)}, x, pad)
    missing = dict(w)
    del missing["experts.down_proj_bias"]
    with pytest.raises(_flexep.ArgumentError, match="'experts.down_proj_bias'.*missing"):
        m.forward(missing, x, pad)
    wrong = {**w, "gate.weight": torch.zeros(8, 13, dtype=torch.float64)}
    with pytest.raises(_flexep.ArgumentError, match=r"'gate.weight'.*\[8, 13\].*\[8, 12\]"):
        m.forward(wrong, x, pad)
    _, _, _, state = m.forward(w, x, pad)
    with pytest.raises(_flexep.ArgumentError, match="'experts.gate_and_up_projs'.*i64"):
        m.backward({**w, "experts.gate_and_up_projs": w["experts.gate_and_up_projs"].long()}, state, x)
    other = _flexep.MoECompute(moe_json("shared-gate-biases-aux"), BACKEND)
    with pytest.raises(_flexep.ArgumentError, match="'state'"):
        other.backward(w, state, x)


def test_rows_in_place_is_refused_on_the_cpu():
    m = _flexep.MoECompute(moe_json("softmax"), BACKEND)
    assert m.rows_in_place is False
    m.rows_in_place = False
    with pytest.raises(_flexep.ArgumentError, match="'rows_in_place'.*GPU option.*device -1"):
        m.rows_in_place = True
    assert m.rows_in_place is False


def test_bf16_on_the_cpu():
    layer, cfg = owner("shared-gate-biases-aux", dtype="float32")
    m = _flexep.MoECompute(moe_json("shared-gate-biases-aux"), BACKEND)
    w16 = {k: (v if k == "gate.e_score_correction_bias" else v.to(torch.bfloat16)) for k, v in owner_weights(layer, cfg).items()}
    w32 = {k: v.float() for k, v in w16.items()}
    x, pad, grad = inputs(cfg, 0, dtype=torch.bfloat16)
    # A fixed routing: the router itself reads a bf16 x as Automodel's does (bf16 logits and weights,
    # tests/cpu/test_moe_compute.cpp), an f32 x not; the rest is the f32 computation on bf16 values.
    T, k, E = x.shape[0], cfg["n_activated_experts"], cfg["n_routed_experts"]
    routing = (torch.stack([torch.arange(T) % E, (torch.arange(T) + 5) % E], 1),
               torch.rand(T, k, generator=torch.Generator().manual_seed(2)))
    w16 = {n: t for n, t in w16.items() if not n.startswith("gate.")}
    w32 = {n: t for n, t in w32.items() if not n.startswith("gate.")}
    out, aux, load, gx, grads = run_compute(m, w16, w16, x, pad, grad, routing=routing)
    r_out, r_aux, r_load, r_gx, r_grads = run_compute(m, w32, w32, x.float(), pad, grad.float(), routing=routing)
    assert out.dtype == torch.bfloat16 and gx.dtype == torch.bfloat16
    assert torch.equal(out, r_out.to(torch.bfloat16))  # the f32 computation on the bf16 values, rounded
    assert torch.equal(gx, r_gx.to(torch.bfloat16))
    assert torch.equal(load, r_load)
    assert sorted(grads) == sorted(r_grads)
    for k, g in grads.items():
        assert g.dtype == torch.bfloat16 and g.shape == w16[k].shape, k
        torch.testing.assert_close(g.float(), r_grads[k], rtol=2 ** -8, atol=1e-6 * r_grads[k].abs().max().item())


def test_routing_override():
    layer, cfg = owner("shared-gate-biases-aux")
    m = _flexep.MoECompute(moe_json("shared-gate-biases-aux"), BACKEND)
    w = owner_weights(layer, cfg)
    x, pad, grad = inputs(cfg, 0)
    T, k, E = x.shape[0], cfg["n_activated_experts"], cfg["n_routed_experts"]
    idx = torch.stack([torch.arange(T) % E, (torch.arange(T) + 3) % E], 1)
    idx[1, 1] = -1
    weights = torch.rand(T, k, generator=torch.Generator().manual_seed(5))
    no_gate = {n: t for n, t in w.items() if not n.startswith("gate.")}
    out, aux, load, gx, grads = run_compute(m, no_gate, no_gate, x, pad, grad, routing=(idx, weights))
    assert aux is None
    kept = idx[~pad]
    assert torch.equal(load, torch.bincount(kept[kept >= 0], minlength=E))
    assert not any(n.startswith("gate.") for n in grads)
    # Another routing gives another output: the override is what routes.
    out2, *_ = run_compute(m, no_gate, no_gate, x, pad, grad, routing=((idx + 1) % E, weights))
    assert not torch.equal(out, out2)
    with pytest.raises(_flexep.ArgumentError, match="routing"):
        m.forward(no_gate, x, pad, True, idx)


def test_backward_reads_the_weights_it_is_given():
    layer, cfg = owner("shared-gate-biases-aux")
    w = owner_weights(layer, cfg)
    x, pad, grad = inputs(cfg, 0)
    m = _flexep.MoECompute(moe_json("shared-gate-biases-aux"), BACKEND)
    want = run_compute(m, w, w, x, pad, grad)
    fwd = {k: v.clone() for k, v in w.items()}
    bwd = {k: v.clone() for k, v in w.items()}

    def reshard():
        for t in fwd.values():
            t.fill_(float("nan"))

    got = run_compute(m, fwd, bwd, x, pad, grad, between=reshard)
    assert torch.equal(got[0], want[0]) and torch.equal(got[3], want[3])
    for k, v in want[4].items():
        assert torch.equal(got[4][k], v), k
    assert torch.isnan(fwd["experts.down_projs"]).all()


def test_gradients_are_fresh_tensors():
    layer, cfg = owner("softmax")
    w = owner_weights(layer, cfg)
    x, pad, grad = inputs(cfg, 0)
    m = _flexep.MoECompute(moe_json("softmax"), BACKEND)
    first = run_compute(m, w, w, x, pad, grad)[4]
    kept = {k: v.clone() for k, v in first.items()}
    second = run_compute(m, w, w, x, pad, 2 * grad)[4]
    for k in first:
        assert first[k].data_ptr() != second[k].data_ptr()
        assert first[k].data_ptr() != w[k].data_ptr()
        assert torch.equal(first[k], kept[k]), k
        assert torch.allclose(second[k], 2 * kept[k]), k


needs_cuda = pytest.mark.skipif(not (_flexep.HAS_CUDA and torch.cuda.is_available()), reason="needs a CUDA build and GPU")
GPU_BASE = dict(n_routed_experts=8, n_activated_experts=2, dim=64, inter_dim=128, moe_inter_dim=32)


@needs_cuda
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_matches_owner_binding_bitwise(case):
    """device=0 against the owner binding CudaMoELayer ('fresh_bf16_weights') holding the same tensors:
    the same kernels, so the same bytes (its f32 small gradients rounded to bf16)."""
    cfg = {**GPU_BASE, **CASES[case]}
    js = json.dumps(cfg)
    layer = _flexep.CudaMoELayer(js, BACKEND, None, 0, 7, 0.1, False, 1, "fresh_bf16_weights")
    w = {name: torch.from_dlpack(v) for name, v, _ in layer.parameters()}
    g = torch.Generator(device="cuda").manual_seed(9)
    for name, t in w.items():
        if "bias" in name:
            t.copy_(torch.randn(t.shape, device="cuda", generator=g))
    cb = layer.e_score_correction_bias()
    if cb is not None:
        w["gate.e_score_correction_bias"] = torch.from_dlpack(cb)
        w["gate.e_score_correction_bias"].copy_(0.05 * torch.randn(cb.shape, device="cuda", generator=g))
    T = 96
    x = torch.randn(T, cfg["dim"], device="cuda", generator=g).bfloat16()
    grad = torch.randn(T, cfg["dim"], device="cuda", generator=g).bfloat16()
    pad = torch.zeros(T, dtype=torch.bool, device="cuda")
    pad[-5:] = True
    stream = torch.cuda.current_stream().cuda_stream
    out, aux, state = layer.forward(x, pad, True, stream)
    gx, grads = layer.backward(state, grad, stream)
    m = _flexep.MoECompute(js, BACKEND, None, 0)
    assert {s[0] for s in m.parameter_specs()} == set(w)
    out2, aux2, load2, state2 = m.forward(w, x, pad, True, None, stream)
    gx2, grads2 = m.backward(w, state2, grad, 1.0, stream)
    assert torch.equal(torch.from_dlpack(out2), torch.from_dlpack(out))
    assert torch.equal(torch.from_dlpack(gx2), torch.from_dlpack(gx))
    assert (aux is None) == (aux2 is None)
    if aux is not None:
        assert torch.equal(torch.from_dlpack(aux2), torch.from_dlpack(aux))
    load2 = torch.from_dlpack(load2)
    assert load2.sum().item() == (T - 5) * cfg["n_activated_experts"]
    assert sorted(grads2) == sorted(grads)
    for name, want in grads.items():
        got = torch.from_dlpack(grads2[name])
        assert got.dtype == torch.bfloat16, name
        assert torch.equal(got, torch.from_dlpack(want).to(torch.bfloat16)), name
