"""One GPU (a CUDA build): Automodel's fused_dispatch / fused_combine over a one-rank NCCL group
(flexep's deepep backend) under hypothesis.

- Valid calls (T 0..300, H 8, 64, 136 and rarely 7168, E 1..16, k 1..min(E, 8), distinct ids per
  token with empty slots and unrouted tokens, int64 or int32 ids, row- or column-major x): the chain
  of test_deepep_1gpu.py against the host backend (group=HostRank) on the same bf16 inputs, with the
  same rules: recv_x, recv_token_indices, recv_token_probs, tokens_per_expert, the combine and the
  gradient of x bit for bit, the gradient of token_probs to 1e-5; and what one rank implies (each
  routed token received once, in token order).
- Invalid calls on the GPU group, each argument spoilt with probability 1/10 as in test_api_fuzz.py:
  shapes (x, token_indices and token_probs of another rank or size), dtypes (float64, float16,
  float32, int, bool), column-major strides, a misaligned x, aliasing (token_probs the indices
  themselves or a view of x, token_indices x itself), sparse (COO) and meta tensors, tensors on the
  CPU beside CUDA ones, out-of-range and repeated ids, num_experts, and the combine's rows and handle.
  Every call either succeeds with consistent outputs (shapes; one rank: recv_x the routed rows of x,
  tokens_per_expert the slots' count, the combine each routed row back, the gradient of x 2 per
  routed token) or raises flexep.ArgumentError naming an argument this call spoilt (or the option it
  determines: num_experts, options.hidden, options.max_topk); any other exception fails the test.

The group is this module's own (port MASTER_PORT as set at collection, else 29541) or, when another
module's fixture still holds an initialised one-rank NCCL group in this process, that one, which is
then left to its owner.

Run: PYTHONPATH=build/python python -m pytest -q python/tests/gpu/test_fuzz_1gpu.py
"""

import os
import re

import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
import torch.distributed as dist  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import flexep  # noqa: E402
import flexep.torch as ft  # noqa: E402
from fused_chain import fused_chain  # noqa: E402
from flexep import _flexep  # noqa: E402
from flexep.torch import dispatcher as dispatchers  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not flexep.HAS_CUDA or not torch.cuda.is_available(),
                                 reason="needs a CUDA build of flexep and a GPU")]

DEV = torch.device("cuda", 0)
# Read at collection: test_deepep_1gpu.py's fixture sets MASTER_PORT (29537) in os.environ when it
# runs, and that port may still be held after its group is destroyed.
ADDR = os.environ.get("MASTER_ADDR", "127.0.0.1")
PORT = os.environ.get("MASTER_PORT", "29541")


@pytest.fixture(scope="module")
def group():
    torch.cuda.set_device(DEV)
    if dist.is_available() and dist.is_initialized():  # another module's group (one process): use it, keep it
        if dist.get_world_size() != 1 or dist.get_backend() != "nccl":
            pytest.skip("a process group other than one NCCL rank is initialised in this process")
        yield dist.group.WORLD
        return
    dist.init_process_group("nccl", init_method=f"tcp://{ADDR}:{PORT}", rank=0, world_size=1, device_id=DEV)
    yield dist.group.WORLD
    dispatchers.reset_buffer()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def host():
    return ft.HostRank(_flexep.HostWorld(1, 60.0), 0)


def _bound_buffers(most=8):
    """fused_dispatch keeps a deepep dispatcher (NCCL windows) per (E, H, k); a fuzz makes many."""
    if len(dispatchers._deepep_buffers) > most:
        dispatchers._deepep_buffers.clear()


def _ids(T, E, k, empty, unrouted, g):
    """[T, k] int64: distinct expert ids per token, a fraction `empty` of the slots -1 and a fraction
    `unrouted` of the tokens all -1."""
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :k]
    ids[torch.rand(T, k, generator=g) < empty] = -1
    ids[torch.rand(T, generator=g) < unrouted] = -1
    return ids


# -- valid calls: the deepep backend against the host backend ------------------------------------


@st.composite
def valid_calls(draw):
    E = draw(st.integers(1, 16))
    return dict(
        T=draw(st.integers(0, 300)),
        H=7168 if draw(st.integers(0, 9)) == 0 else draw(st.sampled_from([8, 64, 136])),
        E=E,
        k=draw(st.integers(1, min(E, 8))),
        empty=draw(st.sampled_from([0.0, 0.1, 0.5])),
        unrouted=draw(st.sampled_from([0.0, 0.2, 1.0])),
        idx_dtype=draw(st.sampled_from([torch.int64, torch.int32])),
        transpose=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _valid_inputs(c):
    g = torch.Generator().manual_seed(c["seed"])
    T, H, E, k = c["T"], c["H"], c["E"], c["k"]
    x = torch.randn(T, H, generator=g).bfloat16()
    if c["transpose"]:
        x = x.t().contiguous().t()  # same values, column-major strides
    idx = _ids(T, E, k, c["empty"], c["unrouted"], g).to(c["idx_dtype"])
    w = torch.rand(T, k, generator=g)
    up = torch.randn(T, H, generator=g).bfloat16()
    return x, idx, w, up


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
@given(c=valid_calls())
def test_fuzz_fused_dispatch_on_deepep_matches_host(group, host, c):
    x, idx, w, up = _valid_inputs(c)
    want = fused_chain(x, idx, w, up, c["E"], host)
    got = fused_chain(x.to(DEV), idx.to(DEV), w.to(DEV), up.to(DEV), c["E"], group)
    _bound_buffers()
    assert got["tpe"].device.type == "cpu" and got["recv_idx"].dtype == torch.int64
    for name in ("recv_x", "recv_idx", "recv_w", "tpe", "out", "gx"):
        assert torch.equal(got[name], want[name]), name
    torch.testing.assert_close(got["gw"], want["gw"], rtol=1e-5, atol=1e-5)
    # One rank: every routed token once, in token order, its slots' ids and weights as given.
    ids = idx.long()
    routed = (ids >= 0).any(dim=1)
    hypothesis.event("no token routed" if not routed.any() else "tokens routed")
    assert torch.equal(got["recv_x"], x[routed])
    assert torch.equal(got["recv_idx"], ids[routed])
    assert torch.equal(got["recv_w"], (w * (ids >= 0))[routed])
    assert torch.equal(got["tpe"].long(), torch.bincount(ids[ids >= 0], minlength=c["E"]))


# -- invalid calls: results or named errors ---------------------------------------------------------

X_DTYPES = [torch.float32, torch.float64, torch.float16, torch.int64, torch.int16, torch.bool]
ID_DTYPES = [torch.int32, torch.int16, torch.float32, torch.float64, torch.bool]  # int32 is allowed
W_DTYPES = [torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.bool]  # .float()ed: allowed
WHERE = ["cpu", "meta", "sparse"]


@st.composite
def bad_calls(draw):
    """A call with each argument spoilt with probability 1/10, and the argument names an
    ArgumentError may give for the spoils drawn (`allowed`). Plain values: the tensors are made in
    the test, so that a falsifying example reads as a list of spoils."""
    allowed = set()

    def spoilt(*names):
        if draw(st.integers(0, 9)) == 0:
            allowed.update(names)
            return True
        return False

    T, H, E = draw(st.integers(0, 24)), draw(st.sampled_from([8, 16, 64])), draw(st.integers(1, 8))
    k = draw(st.integers(1, min(E, 4)))
    c = dict(T=T, H=H, E=E, k=k, seed=draw(st.integers(0, 2**31 - 1)), transpose=draw(st.booleans()))
    # x: rows unlike the ids' name 'indices'; an H that is no multiple of 8 sizes no deepep buffer
    c["x_shape"] = draw(st.sampled_from([(), (T,), (T, H, 1), (T + 1, H), (T, 12), (T, 4)])) \
        if spoilt("x", "hidden", "options.hidden", "indices") else (T, H)
    c["x_dtype"] = draw(st.sampled_from(X_DTYPES)) if spoilt("hidden") else torch.bfloat16
    c["x_where"] = draw(st.sampled_from(WHERE + ["misaligned"])) if spoilt("x", "hidden") else None
    # token_indices: k columns size the dispatcher (max_topk); the weights must follow them
    c["idx_values"] = draw(st.sampled_from(["high", "low", "repeat"])) if spoilt("indices") else None
    c["idx_shape"] = draw(st.sampled_from(["flat", "scalar", "rows+1", "cols0", "cols+1", "3d"])) \
        if spoilt("indices", "token_indices", "options.max_topk", "weights") else None
    c["idx_dtype"] = draw(st.sampled_from(ID_DTYPES)) if spoilt("indices") else torch.int64
    c["idx_where"] = draw(st.sampled_from(WHERE)) if spoilt("indices", "token_indices") else None
    # token_probs: fused_dispatch takes token_probs.float(), so any dtype is allowed
    c["w_shape"] = draw(st.sampled_from([(T,), (T, k + 1), (T + 1, k), (T, k, 1), (T, 0)])) \
        if spoilt("weights", "token_probs") else (T, k)
    c["w_dtype"] = draw(st.sampled_from(W_DTYPES)) if spoilt("weights") else torch.float32
    c["w_nan"] = spoilt("weights")
    c["w_where"] = draw(st.sampled_from(WHERE)) if spoilt("weights", "token_probs") else None
    c["alias"] = draw(st.sampled_from(["w_is_idx", "w_view_of_x", "idx_is_x"])) \
        if spoilt("weights", "indices", "token_indices", "options.max_topk") else None
    c["num_experts"] = draw(st.sampled_from([0, -1, max(1, E // 2), float(E)])) \
        if spoilt("num_experts", "options.max_topk", "indices") else E
    # the combine's rows [N, H] bf16 and its handle
    c["y"] = draw(st.sampled_from(["float32", "float16", "rows+1", "rows-1", "cols+8", "transpose", "misaligned"]
                                  + WHERE)) if spoilt("expert_out") else None
    c["handle"] = draw(st.sampled_from(["none", "raw", "tuple"])) if spoilt("handle") else None
    c["allowed"] = sorted(allowed)
    return c


def _misaligned(t):
    """t's values, C-contiguous, starting one element past an aligned address."""
    return torch.cat([t.new_zeros(1), t.reshape(-1)])[1:].view(t.shape)


def _place(t, where):
    """t on the CPU, on the meta device, sparse (COO), misaligned or column-major, as `where` says."""
    if where == "cpu":
        return t.cpu()
    if where == "meta":
        return t.to("meta")
    if where == "sparse":
        try:
            return t.to_sparse()
        except (RuntimeError, TypeError, NotImplementedError):  # a dtype with no sparse form: as drawn
            return t
    if where == "misaligned":
        return _misaligned(t)
    if where == "transpose" and t.dim() == 2:
        return t.t().contiguous().t()
    return t


def _leaf(t):
    return t.detach().requires_grad_(t.is_floating_point())


def _reshaped(idx, how):
    """[T, k] ids as the call spoils their shape."""
    T, k = idx.shape
    if how == "flat":
        return idx.reshape(-1)
    if how == "scalar":
        return idx.new_tensor(0)
    if how == "rows+1":
        return torch.cat([idx, idx.new_full((1, k), -1)])
    if how == "cols0":
        return idx[:, :0]
    if how == "cols+1":
        return torch.cat([idx, idx.new_full((T, 1), -1)], dim=1)
    if how == "3d":
        return idx.unsqueeze(-1)
    return idx


def _bad_inputs(c):
    g = torch.Generator().manual_seed(c["seed"])
    T, E, k = c["T"], c["E"], c["k"]
    x = torch.randn(c["x_shape"], generator=g).to(c["x_dtype"]).to(DEV)
    if c["transpose"]:
        x = _place(x, "transpose")
    x = _leaf(_place(x, c["x_where"]))

    idx = _ids(T, E, k, 0.2, 0.1, g)
    if c["idx_values"] is not None and T:
        t = int(torch.randint(T, (1,), generator=g))
        if c["idx_values"] == "repeat" and k > 1:
            idx[t, 0] = idx[t, 1] = int(torch.randint(E, (1,), generator=g))
        else:
            idx[t, k - 1] = E + int(torch.randint(3, (1,), generator=g)) if c["idx_values"] != "low" else -2
    idx = _reshaped(idx, c["idx_shape"])
    idx = _place(idx.to(c["idx_dtype"]).to(DEV), c["idx_where"])

    w = torch.rand(c["w_shape"], generator=g)
    if c["w_nan"] and w.numel():
        w.view(-1)[0] = float("nan")
    w = _leaf(_place(w.to(c["w_dtype"]).to(DEV), c["w_where"]))

    if c["alias"] == "w_is_idx":  # one tensor passed twice
        w = idx
    elif c["alias"] == "w_view_of_x" and x.layout == torch.strided and x.dim() == 2 and x.size(1) >= k:
        w = x[:, :k]
    elif c["alias"] == "idx_is_x":
        idx = x
    return x, idx, w


def _named(e, c):
    """An ArgumentError whose message names one of the arguments this call spoilt."""
    m = re.search(r"invalid argument '([^']*)'", str(e))
    assert m, str(e)
    assert m.group(1) in c["allowed"], f"names {m.group(1)!r}, but the spoilt arguments are {c['allowed']}: {e}"
    hypothesis.event(f"ArgumentError naming {m.group(1)}")


def _rows(y, how):
    """The combine's rows as the call spoils them."""
    N, H = y.shape
    if how in ("float32", "float16"):
        return y.to(getattr(torch, how))
    if how == "rows+1":
        return torch.cat([y, y.new_zeros(1, H)])
    if how == "rows-1":
        return y[1:] if N else torch.cat([y, y.new_zeros(1, H)])
    if how == "cols+8":
        return torch.cat([y, y.new_zeros(N, 8)], dim=1)
    return _place(y, how)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
@given(c=bad_calls())
def test_fuzz_fused_dispatch_gives_results_or_named_errors(group, c):
    x, idx, w = _bad_inputs(c)
    try:
        try:
            recv_x, recv_idx, recv_w, tpe, handle = ft.fused_dispatch(x, idx, w, c["num_experts"], group)
        except flexep.ArgumentError as e:
            return _named(e, c)
        hypothesis.event("dispatched")
        # Success: x was [T, H] bf16 on the GPU, the ids [T, k] int on the GPU, the weights [T, k].
        assert x.dim() == 2 and idx.dim() == 2, f"succeeded with x {tuple(x.shape)}, token_indices {tuple(idx.shape)}"
        T, H = x.shape
        k = idx.shape[1]
        ids = idx.long()
        routed = (ids >= 0).any(dim=1)
        N = int(routed.sum())
        assert recv_x.shape == (N, H) and recv_x.dtype == torch.bfloat16 and recv_x.is_cuda
        assert recv_idx.shape == (N, k) and recv_idx.dtype == torch.int64
        assert recv_w.shape == (N, k) and recv_w.dtype == torch.float32
        assert tpe.device.type == "cpu" and tpe.shape == (int(c["num_experts"]),)
        assert int(tpe.sum()) == int((ids >= 0).sum()) == int((recv_idx >= 0).sum())
        assert torch.equal(recv_x, x.detach()[routed]) and torch.equal(recv_idx, ids[routed])

        y = (recv_x.float() * 2.0 + recv_w[:, :1]).bfloat16()
        want = torch.zeros(T, H, dtype=torch.bfloat16, device=DEV)
        want[routed] = y.detach()
        y = _rows(y, c["y"])
        h = {None: handle, "none": None, "raw": handle.handle, "tuple": (handle.dispatcher, handle.handle)}[c["handle"]]
        try:
            out, none = ft.fused_combine(y, group, h)
        except flexep.ArgumentError as e:
            return _named(e, c)
        hypothesis.event("combined")
        assert none is None and out.shape == (T, H) and out.dtype == torch.bfloat16 and out.is_cuda
        torch.testing.assert_close(out.detach(), want, rtol=0, atol=0, equal_nan=True)  # a NaN weight: NaN rows
        if out.requires_grad:
            out.float().sum().backward()
            assert x.grad is not None and x.grad.shape == x.shape
            if c["alias"] != "w_view_of_x":  # 2 for each routed token (y = 2 x + w), 0 elsewhere
                assert torch.equal(x.grad, (2.0 * routed).bfloat16()[:, None].expand(T, H))
            if w.is_leaf and w.grad is not None:
                assert w.grad.shape == w.shape
    finally:
        _bound_buffers()


@pytest.mark.parametrize("case", ["token_indices 1-D", "token_indices 0-D", "x 0-D"])
def test_fused_dispatch_names_arguments_of_too_few_dimensions(group, case):
    """fused_dispatch reads token_indices.size(1) and x.size(0) (to size the deepep buffer) before
    anything checks their shapes: an ArgumentError naming them, not PyTorch's IndexError."""
    x = torch.randn(4, 8, device=DEV).bfloat16()
    idx = torch.tensor([[0], [1], [-1], [0]], device=DEV)
    w = torch.rand(4, 1, device=DEV)
    if case == "token_indices 1-D":
        idx = idx.reshape(-1)
    elif case == "token_indices 0-D":
        idx = idx[0, 0]
    else:
        x = x[0, 0]
    with pytest.raises(flexep.ArgumentError, match=r"invalid argument '(x|hidden|indices|token_indices)'"):
        ft.fused_dispatch(x, idx, w, 2, group)
