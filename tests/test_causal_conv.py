"""The short depthwise causal conv of the prefill (``causal_conv`` over a ``ConvInput``)
against torch's grouped conv1d over the concatenated tail and span."""

import pytest
import torch
import torch.nn.functional as F

from mcserve.models.importing import ConvInput, causal_conv


@pytest.mark.parametrize("T", [1, 2, 3, 4, 9], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("W", [2, 4])
def test_causal_conv_matches_conv1d(T, W):
    # spans shorter than the tail (taps reading only the tail), equal to it and longer
    g = torch.Generator().manual_seed(T * 10 + W)
    B, C = 3, 7
    tail = torch.randn(B, W - 1, C, generator=g, dtype=torch.float64)
    x = torch.randn(B, T, C, generator=g, dtype=torch.float64)
    w = torch.randn(C, W, generator=g, dtype=torch.float64)
    full = torch.cat([tail, x], 1)  # (B, W - 1 + T, C)
    want = F.conv1d(full.transpose(1, 2), w[:, None], groups=C).transpose(1, 2)  # (B, T, C)
    inp = ConvInput(tail, x)
    torch.testing.assert_close(causal_conv(inp, w), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(inp.new_tail(), full[:, T:])
    for start in range(T + 1):  # every window of W - 1 rows, straddling the parts or not
        torch.testing.assert_close(inp.rows(start, W - 1), full[:, start:start + W - 1])
