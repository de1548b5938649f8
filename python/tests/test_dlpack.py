"""DLPack both ways, zero-copy: NumPy and PyTorch into the library and back."""

import numpy as np
import torch

from flexep import _flexep


def host_dispatcher(E=4):
    return _flexep.make_host_dispatcher(_flexep.HostWorld(1), 0, E)


def test_numpy_round_trip_through_the_library():
    d = host_dispatcher()
    x = np.arange(12, dtype=np.float64).reshape(3, 4)
    idx = np.array([[0, 2], [1, -1], [3, 0]], dtype=np.int32)
    w = np.ones((3, 2), dtype=np.float64)
    tokens, probs, tpe, dropped, h = d.dispatch(x, indices=idx, weights=w)
    t = np.from_dlpack(tokens)
    assert t.dtype == np.float64 and t.shape == (5, 4) and dropped == 0
    np.testing.assert_array_equal(np.from_dlpack(tpe), [2, 1, 1, 1])
    # expert 0: tokens 0 and 2; expert 1: token 1; expert 2: token 0; expert 3: token 2
    np.testing.assert_array_equal(t, x[[0, 2, 1, 0, 2]])
    out = np.from_dlpack(d.combine(h, t))
    np.testing.assert_array_equal(out, x * np.array([[2], [1], [2]]))


def test_outputs_are_zero_copy_and_keep_their_memory_alive():
    d = host_dispatcher()
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    idx = np.array([[0], [1], [2], [3]], dtype=np.int64)
    tokens, *_ = d.dispatch(x, indices=idx, weights=np.ones((4, 1), np.float32))
    a = np.from_dlpack(tokens)
    b = torch.from_dlpack(a)  # numpy -> torch: the same library buffer
    assert a.__array_interface__["data"][0] == b.data_ptr()
    del tokens, d
    b.add_(1.0)  # the buffer is still owned (by the capsule) after the dispatcher is gone
    np.testing.assert_allclose(a, x + 1.0)


def test_torch_inputs_are_views_and_parameters_share_memory():
    layer = _flexep.MoELayer('{"n_routed_experts": 4, "n_activated_experts": 2, "dim": 8, "moe_inter_dim": 4}',
                             '{}', None, "float32")
    params = {name: torch.from_dlpack(v) for name, v, _ in layer.parameters()}
    w = params["gate.weight"]
    assert w.shape == (4, 8) and w.dtype == torch.float32
    again = torch.from_dlpack(dict((n, v) for n, v, _ in layer.parameters())["gate.weight"])
    assert again.data_ptr() == w.data_ptr()
    w.zero_()  # written through torch, seen by the library: every token's logits are now equal
    out, _, _ = layer.forward(torch.randn(3, 8), None, False)
    assert torch.from_dlpack(out).shape == (3, 8)


def test_bfloat16_and_bool_cross():
    rm, probs = _flexep.topk_to_multihot(torch.tensor([[1, -1]]), torch.tensor([[0.5, 0.0]]), 3)
    rm = torch.from_dlpack(rm)
    assert rm.dtype == torch.bool and rm.tolist() == [[False, True, False]]
    d = host_dispatcher(2)
    x = torch.randn(2, 4).to(torch.bfloat16)
    tokens, *_ = d.dispatch(x, indices=torch.tensor([[0], [1]]), weights=torch.ones(2, 1))
    t = torch.from_dlpack(tokens)
    assert t.dtype == torch.bfloat16 and torch.equal(t, x)


def test_empty_tensors_cross():
    d = host_dispatcher(2)
    tokens, probs, tpe, _, h = d.dispatch(np.zeros((0, 4), np.float32), indices=np.zeros((0, 1), np.int64),
                                          weights=np.zeros((0, 1), np.float32))
    assert torch.from_dlpack(tokens).shape == (0, 4) and torch.from_dlpack(tpe).tolist() == [0, 0]
