"""oneDNN-packed ``nn.Linear`` (mcserve/models/packed_linear.py) against its twin ``F.linear``."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mcserve.models import packed_linear as pl

pytestmark = pytest.mark.skipif(not pl.available(),
                                reason="this torch build has no oneDNN (x86 CPU) linear ops")


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("rows", [0, 1, 3, 8, 17, 600], ids=lambda r: f"M{r}")
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("hint", [1, 8])
def test_packed_matches_linear(rows, bias, hint):
    g = torch.Generator().manual_seed(rows * 3 + hint)
    w = torch.randn(37, 29, generator=g)
    b = torch.randn(37, generator=g) if bias else None
    x = torch.randn(rows, 29, generator=g)
    y = pl.packed_linear(x, pl.pack_weight(w, hint), b)
    assert y.shape == (rows, 37)
    if rows:
        assert _rel(y, F.linear(x, w, b)) < 1e-5


def test_packed_batched_shapes():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 48, generator=g)
    x = torch.randn(2, 5, 48, generator=g)
    assert _rel(pl.packed_linear(x, pl.pack_weight(w), None), F.linear(x, w)) < 1e-5


def _bf16_skip_reason() -> str:
    return f"bfloat16 oneDNN packing unavailable: {pl.bf16_unsupported_reason()}"


def test_packed_bf16(monkeypatch):
    monkeypatch.delenv(pl.NO_BF16_PACKING_ENV, raising=False)
    monkeypatch.setattr(pl, "force_bf16_fallback", False)
    if not pl.bf16_packing_supported():  # e.g. an AVX2-only CPU: say which feature is missing
        pytest.skip(_bf16_skip_reason())
    g = torch.Generator().manual_seed(0)
    wb = torch.randn(64, 48, generator=g).bfloat16()
    xb = torch.randn(2, 5, 48, generator=g).bfloat16()
    y = pl.packed_linear(xb, pl.pack_weight(wb), None)
    assert y.dtype == torch.bfloat16 and _rel(y, F.linear(xb, wb)) < 2e-2
    lin = nn.Linear(48, 64).bfloat16()
    assert pl.pack_linears(lin, min_numel=1) == 1 and pl.is_packed(lin)


def _bf16_model() -> nn.Sequential:
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 32, bias=False)).bfloat16()


@pytest.mark.parametrize("how", ["flag", "env"])
def test_forced_bf16_fallback_keeps_plain_linears(how, monkeypatch):
    """With the fallback forced (as on a CPU without AVX-512 BF16 support) bfloat16 linears are
    left plain and compute what nn.Linear computes; float32 ones are still packed."""
    if how == "flag":
        monkeypatch.setattr(pl, "force_bf16_fallback", True)
    else:
        monkeypatch.setenv(pl.NO_BF16_PACKING_ENV, "1")
    assert not pl.bf16_packing_supported()
    assert pl.NO_BF16_PACKING_ENV in pl.bf16_unsupported_reason()
    model = _bf16_model()
    x = torch.randn(3, 5, 48).bfloat16()
    with torch.no_grad():
        want = model(x)
        assert pl.pack_linears(model, min_numel=1) == 0  # bf16: nothing wrapped
        assert not any(pl.is_packed(m) for m in model)
        got = model(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    f32 = nn.Linear(48, 64)
    assert pl.pack_linears(f32, min_numel=1) == 1 and pl.is_packed(f32)


def test_bf16_packed_and_plain_agree(monkeypatch):
    """Packed where the CPU can, plain where the fallback is forced: the same outputs (to bf16
    rounding); the packed half skips, naming the missing CPU feature, where unsupported."""
    x = torch.randn(4, 48).bfloat16()
    monkeypatch.setattr(pl, "force_bf16_fallback", True)
    plain = _bf16_model()
    pl.pack_linears(plain, min_numel=1)
    with torch.no_grad():
        y_plain = plain(x)
    monkeypatch.setattr(pl, "force_bf16_fallback", False)
    monkeypatch.delenv(pl.NO_BF16_PACKING_ENV, raising=False)
    if not pl.bf16_packing_supported():
        pytest.skip(_bf16_skip_reason())
    packed = _bf16_model()
    assert pl.pack_linears(packed, min_numel=1) == 2
    with torch.no_grad():
        y_packed = packed(x)
    assert _rel(y_packed, y_plain) < 2e-2


def test_pack_inference_mode_weights():
    # weights created under inference_mode have no version counter
    with torch.inference_mode():
        lin = nn.Linear(8, 4)
        x = torch.randn(3, 8)
        want = F.linear(x, lin.weight, lin.bias)
        assert pl.pack_linears(lin, min_numel=1) == 1
        assert _rel(lin(x), want) < 1e-5


def test_pack_linears_routes_inference_and_falls_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False))
    x = torch.randn(4, 16)
    want = model(x).detach()
    assert pl.pack_linears(model, min_numel=1) == 2
    assert pl.pack_linears(model, min_numel=1) == 0  # idempotent
    calls = []
    real = pl.packed_linear
    try:
        pl.packed_linear = lambda *a: calls.append(1) or real(*a)
        with torch.no_grad():
            assert _rel(model(x), want) < 1e-5
        assert len(calls) == 2  # both layers took the packed path
        # autograd on: the plain path, gradients flow to the real parameters
        model(x).sum().backward()
        assert len(calls) == 2 and model[0].weight.grad is not None
        # a weight changed in place after packing: the stale packed copy is not used
        with torch.no_grad():
            model[2].weight.mul_(2)
            assert _rel(model(x), 2 * want) < 1e-5
        assert len(calls) == 3  # only the first layer was still packed-valid
        # float64 weights are never packed; unpack restores the class forward
        assert pl.unpack_linears(model) == 2 and "forward" not in model[0].__dict__
        assert pl.pack_linears(nn.Linear(3, 3).double(), min_numel=1) == 0
        small = nn.Linear(3, 3)  # below the size threshold: wrapped for the C++ GEMV only
        assert pl.pack_linears(small) == int(pl.cpu_ops.enabled())
        if pl.cpu_ops.enabled():
            assert small.forward.packed is None
    finally:
        pl.packed_linear = real
    sd = model.state_dict()
    assert set(sd) == {"0.weight", "0.bias", "2.weight"}  # no extra state


@pytest.mark.skipif(not pl.cpu_ops.enabled(), reason="C++ CPU kernels not built here")
def test_one_and_two_rows_take_the_cpp_gemv():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8, bias=False))
    pl.pack_linears(model, min_numel=1)
    calls = []
    real = pl.cpu_ops.linear
    try:
        pl.cpu_ops.linear = lambda *a: calls.append(a[0].shape) or real(*a)
        with torch.no_grad():
            for shape in [(1, 16), (2, 1, 16), (3, 16)]:
                x = torch.randn(*shape)
                want = F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight)
                assert _rel(model(x), want) < 1e-5
    finally:
        pl.cpu_ops.linear = real
    assert len(calls) == 4  # 1 and 2 rows through both layers; 3 rows took oneDNN
