"""The short depthwise causal conv of the prefill (``causal_conv`` over a ``ConvInput``)
against torch's grouped conv1d over the concatenated tail and span."""

import pytest
import torch
import torch.nn.functional as F

from mcserve.models.importing import ConvInput, causal_conv


@pytest.mark.parametrize("T", [1, 2, 3, 4, 9, 133], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_causal_conv_matches_conv1d(T, W, dtype):
    # spans shorter than the tail (taps reading only the tail), equal to it and longer (past
    # one of the C++ pass's token tiles); float32 takes the C++ pass, float64 its twin
    g = torch.Generator().manual_seed(T * 10 + W)
    B, C = 3, 7
    tail = torch.randn(B, W - 1, C, generator=g, dtype=dtype)
    x = torch.randn(B, T, C, generator=g, dtype=dtype)
    w = torch.randn(C, W, generator=g, dtype=dtype)
    full = torch.cat([tail, x], 1)  # (B, W - 1 + T, C)
    want = F.conv1d(full.transpose(1, 2), w[:, None], groups=C).transpose(1, 2)  # (B, T, C)
    inp = ConvInput(tail, x)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(causal_conv(inp, w), want, rtol=tol, atol=tol)
    torch.testing.assert_close(inp.new_tail(), full[:, T:])
    for start in range(T + 1):  # every window of W - 1 rows, straddling the parts or not
        torch.testing.assert_close(inp.rows(start, W - 1), full[:, start:start + W - 1])


@pytest.mark.parametrize("B,T,C,W", [(1, 1, 1, 2), (2, 70, 33, 4), (1, 5, 768, 3)],
                         ids=["one", "tiles", "wide"])
def test_conv_span_matches_twin(B, T, C, W):
    # the C++ span conv against its torch twin: a bias, rows of x and the tail strided (views
    # of wider buffers with contiguous channels), the weight a transposed view; tail unchanged
    from mcserve.kernels import cpu
    from mcserve.kernels.cpu import twins

    g = torch.Generator().manual_seed(B * T + C)
    x = torch.randn(B, T, 2 * C, generator=g)[..., :C]
    tail = torch.randn(B, W + 1, C, generator=g)[:, 2:]
    w = torch.randn(W, C, generator=g).t()
    bias = torch.randn(C, generator=g)
    keep = tail.clone()
    got = cpu.conv_span(tail, x, w, bias)
    torch.testing.assert_close(got, twins.conv_span(tail, x, w, bias), rtol=1e-5, atol=1e-5)
    assert torch.equal(tail, keep)
    # with the SiLU in the same pass (16 channels at a time, the rest one by one): against the
    # twin and against F.silu of the plain conv
    act = cpu.conv_span(tail, x, w, bias, silu=True)
    want = twins.conv_span(tail, x, w, bias, True)
    torch.testing.assert_close(act, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(act, F.silu(got), rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="conv_span"):
        cpu.ops().conv_span(tail[:, 1:], x, w, bias, False)
