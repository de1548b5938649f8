"""One GPU (a CUDA build): Automodel's fused_dispatch / fused_combine over a one-rank NCCL group run
flexep's deepep backend. Against the host backend (group=HostRank) on the same bf16 inputs: recv_x,
recv_token_indices, recv_token_probs, tokens_per_expert, the combine and the gradient of x bit for
bit, the gradient of token_probs to fp32 summation order (the stand-in experts' reduction over H runs
in another order on the GPU). Also the buffer re-made for a larger T, and outputs that stay valid
after the next dispatch (fresh tensors, as DeepEP's).

Run: PYTHONPATH=build/python python -m pytest -q python/tests/gpu/test_deepep_1gpu.py
"""

import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import flexep  # noqa: E402
import flexep.torch as ft  # noqa: E402
from fused_chain import fused_chain  # noqa: E402
from flexep import _flexep  # noqa: E402
from flexep.torch import dispatcher as dispatchers  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not flexep.HAS_CUDA or not torch.cuda.is_available(),
                                 reason="needs a CUDA build of flexep and a GPU")]

DEV = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def group():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29537")
    torch.cuda.set_device(DEV)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=DEV)
    yield dist.group.WORLD
    dispatchers.reset_buffer()
    dist.destroy_process_group()


def _inputs(T, H, E, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k).long()
    if T:
        idx[torch.rand(T, k, generator=g) < 0.1] = -1  # some slots route nowhere
    w = torch.rand(T, k, generator=g)
    up = torch.randn(T, H, generator=g).bfloat16()
    return x, idx, w, up


@pytest.mark.parametrize("T,H,E,k", [(64, 64, 8, 2), (300, 7168, 16, 8), (1, 8, 4, 4), (0, 64, 8, 2)])
def test_fused_dispatch_on_deepep_matches_host(group, T, H, E, k):
    x, idx, w, up = _inputs(T, H, E, k, seed=T + H)
    want = fused_chain(x, idx, w, up, E, ft.HostRank(_flexep.HostWorld(1, 60.0), 0))
    got = fused_chain(x.to(DEV), idx.to(DEV), w.to(DEV), up.to(DEV), E, group)
    assert got["tpe"].device.type == "cpu" and got["recv_idx"].dtype == torch.int64
    for name in ("recv_x", "recv_idx", "recv_w", "tpe", "out", "gx"):
        assert torch.equal(got[name], want[name]), name
    torch.testing.assert_close(got["gw"], want["gw"], rtol=1e-5, atol=1e-5)


def test_buffer_grows_and_outputs_stay_valid(group):
    E, k, H = 8, 2, 128
    x1, idx1, w1, _ = _inputs(40, H, E, k, seed=1)
    recv1 = ft.fused_dispatch(x1.to(DEV), idx1.to(DEV), w1.to(DEV), E, group)
    kept = recv1[0].clone()
    x2, idx2, w2, _ = _inputs(700, H, E, k, seed=2)  # more tokens than the first buffer (64) holds
    recv2 = ft.fused_dispatch(x2.to(DEV), idx2.to(DEV), w2.to(DEV), E, group)
    ft.fused_combine(recv2[0], group, recv2[4])
    assert torch.equal(recv1[0], kept), "recv_x of the first call changed"
    caps = [cap for key, (cap, _) in dispatchers._deepep_buffers.items() if key[2:] == (E, H, k)]
    assert caps == [1024], caps
    host = ft.fused_dispatch(x2, idx2, w2, E, ft.HostRank(_flexep.HostWorld(1, 60.0), 0))
    assert torch.equal(recv2[0].cpu(), host[0])
