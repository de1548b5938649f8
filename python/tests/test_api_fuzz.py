"""The Python dispatch API under random (often invalid) arguments, with hypothesis: shapes, dtypes,
strides, aliasing, sparse and meta tensors, out-of-range ids and options on the host backend (one
simulated rank). Every call
either succeeds with outputs of consistent shapes whose combine gives the analytic result, or raises
flexep.ArgumentError naming an argument: never another exception, never a crash.
"""

import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import flexep  # noqa: E402
import flexep.torch as ft  # noqa: E402
from flexep import _flexep  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.bool]
ID_DTYPES = [torch.int64, torch.int32, torch.int16, torch.float32, torch.bool]


@st.composite
def calls(draw):
    """Each argument spoilt with probability 1/10, so that valid calls, named errors and their
    combinations all occur."""
    def spoilt():
        return draw(st.integers(0, 9)) == 0

    E = draw(st.integers(1, 5))
    T = draw(st.integers(0, 6))
    H = draw(st.integers(0, 5))
    k = draw(st.integers(1, 4)) if not spoilt() else 0
    x_rows = draw(st.integers(0, 6)) if spoilt() else T
    x_shape = draw(st.sampled_from([(x_rows,), (x_rows, H, 1)])) if spoilt() else (x_rows, H)
    low, high = (-3, E + 2) if spoilt() else (-1, E - 1)
    ids = draw(st.lists(st.integers(low, high), min_size=T * k, max_size=T * k))
    if not spoilt():  # distinct ids per token (a repeat is an error)
        ids = [ids[t * k + j] if ids[t * k + j] not in ids[t * k:t * k + j] else -1 for t in range(T) for j in range(k)]
    w_cols = draw(st.integers(0, 4)) if spoilt() else k
    return dict(
        E=E,
        x=torch.randn(*x_shape, dtype=torch.float64).to(draw(st.sampled_from(DTYPES)) if spoilt() else torch.float32),
        idx=torch.tensor(ids, dtype=torch.int64).reshape(T, k).to(
            draw(st.sampled_from(ID_DTYPES)) if spoilt() else torch.int64),
        w=torch.rand(T, w_cols, dtype=torch.float64).to(draw(st.sampled_from(DTYPES)) if spoilt() else torch.float32),
        transpose=draw(st.booleans()),
        pad=(pad := draw(st.sampled_from([0, -1, 3])) if spoilt() else draw(st.sampled_from([1, 2]))),
        mode="bogus" if spoilt() else draw(st.sampled_from(["blocking", "budget"])),
        budget=draw(st.integers(-1, 40)) if spoilt() else max(pad, 1) * draw(st.integers(0, 20)),
        overflow="bogus" if spoilt() else draw(st.sampled_from(["error", "drop"])),
        alias=spoilt(),
        # one argument sparse (COO) or on the meta device (no data)
        odd=(draw(st.sampled_from(["x", "idx", "w"])), draw(st.sampled_from(["sparse", "meta"]))) if spoilt() else None,
    )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls())
def test_dispatch_gives_results_or_named_errors(c):
    d = _flexep.make_host_dispatcher(_flexep.HostWorld(1, 30.0), 0, c["E"])
    x, idx, w = c["x"], c["idx"], c["w"]
    if c["transpose"] and x.dim() == 2:
        x = x.t().contiguous().t()  # same values, column-major strides
    if c["alias"] and w.shape == idx.shape and w.dtype == idx.dtype:
        w = idx  # one tensor passed twice
    if c["odd"] is not None:
        which, kind = c["odd"]
        t = {"x": x, "idx": idx, "w": w}[which]
        try:
            t = t.to_sparse() if kind == "sparse" else t.to("meta")
        except (RuntimeError, TypeError):  # a dtype with no sparse form: the call stays as drawn
            pass
        x, idx, w = (t if which == "x" else x), (t if which == "idx" else idx), (t if which == "w" else w)
    try:
        tokens, probs, tpe, handle = ft.dispatch(d, x, idx, w, pad_multiple=c["pad"], mode=c["mode"],
                                                 budget_rows=c["budget"], overflow=c["overflow"])
    except flexep.ArgumentError as e:
        hypothesis.event("named error")
        assert "invalid argument '" in str(e), str(e)
        return
    except flexep.Error as e:  # the budget overflow: an Error naming the rank, its rows and the budget
        hypothesis.event("overflow")
        assert "overflow" in str(e), str(e)
        return
    hypothesis.event(f"dispatched ({c['mode']})")
    # Success: consistent shapes, and with identity experts the combine counts each token's experts.
    assert tokens.dim() == 2 and tokens.shape[1] == x.shape[1] and probs.shape == (tokens.shape[0],)
    assert int(tpe.sum()) <= tokens.shape[0]
    out = ft.combine(d, handle, tokens)
    assert out.shape == x.shape
    if c["mode"] == "blocking":
        kept = (idx.long() >= 0).sum(dim=1, keepdim=True).to(torch.float64)
        torch.testing.assert_close(out.to(torch.float64), x.to(torch.float64) * kept, rtol=1e-2, atol=1e-2)
