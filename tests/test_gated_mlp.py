"""The dense gated MLP in one C++ call (``kernels.cpu.gated_mlp``, ``kernels/cpu/mlp.cpp``)
against its twin and against the three products it replaces, at every instruction-set level
this CPU runs; rows independent of the batch, the chunking and the threads; SwiGLU and GatedMLP
routed through it with int8 / bfloat16 weights; bad arguments."""

from __future__ import annotations

import pytest
import torch
from test_lowp_linear import cap, levels, rel

from mcserve.kernels import cpu
from mcserve.kernels.cpu import twins
from mcserve.models import layers
from mcserve.models import lowp_linear as lp

needs_ops = pytest.mark.skipif(cpu.ops() is None,
                               reason=f"C++ CPU kernels unavailable: {cpu.status()}")

# (rows, D, I): odd widths, partial blocks of 16 and pair-steps, 1 row .. several chunks
SHAPES = [(1, 33, 24), (5, 64, 48), (37, 95, 40), (300, 256, 688), (1100, 48, 40)]


def packed(kind: str, N: int, K: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(N, K, generator=g) / K ** 0.5
    if kind == "int8":
        q, s = lp.quantize_int8(w)
        return twins.pack_pairs(q), s
    return twins.pack_pairs(w.bfloat16()), torch.rand(N, generator=g) + 0.5


def weights(kind: str, D: int, I: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (*packed(kind, I, D, g), *packed(kind, I, D, g), *packed(kind, D, I, g))


def composed(x, gate, s_gate, up, s_up, down, s_down, act):
    """The three products through the linear kernels and the activation in torch."""
    lin = cpu.linear_q8 if gate.dtype == torch.int8 else cpu.linear_bf16
    h = twins.MLP_ACTS[act](lin(x, gate, s_gate)) * lin(x, up, s_up)
    return lin(h, down, s_down)


@needs_ops
@pytest.mark.parametrize("kind", ["int8", "bf16"])
@pytest.mark.parametrize("T,D,I", SHAPES, ids=lambda v: str(v))
def test_gated_mlp_matches_its_twin_and_the_products_at_every_level(kind, T, D, I):
    w = weights(kind, D, I, T + D + I)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(T))
    for act in (0, 1, 2):
        want = twins.gated_mlp(x, *w, act)
        for level in levels(kind):
            with cap(level):
                y = cpu.gated_mlp(x, *w, act)
                assert rel(y, composed(x, *w, act)) < 1e-5, (act, level)
            # bfloat16 levels 3 and 4 round x and the hidden rows to bfloat16; int8 quantizes
            # each row to int16
            tol = 1e-2 if kind == "bf16" and level >= 3 else 1e-3
            assert rel(y, want) < tol, (act, level)


@needs_ops
@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_gated_mlp_rows_do_not_depend_on_the_batch_or_threads(kind):
    """1100 rows take several chunks over the threads; a row alone, in a short batch and under
    one thread gives the same bits; a NaN row stays in its row."""
    D, I = 48, 40
    w = weights(kind, D, I, 1)
    x = torch.randn(1100, D, generator=torch.Generator().manual_seed(2))
    for level in levels(kind):
        with cap(level):
            full = cpu.gated_mlp(x, *w)
            for a, b in ((0, 1), (7, 8), (3, 20), (1000, 1100), (1099, 1100)):
                assert torch.equal(cpu.gated_mlp(x[a:b], *w), full[a:b]), (level, a, b)
            threads = torch.get_num_threads()
            try:
                torch.set_num_threads(1)
                assert torch.equal(cpu.gated_mlp(x, *w), full), level
            finally:
                torch.set_num_threads(threads)
            xn = x.clone()
            xn[500, 3] = float("nan")
            yn = cpu.gated_mlp(xn, *w)
            assert torch.isnan(yn[500]).all()
            assert torch.equal(yn[:500], full[:500]) and torch.equal(yn[501:], full[501:])


def _counting(monkeypatch) -> list[int]:
    calls = []
    real = layers.cpu_ops.gated_mlp

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(layers.cpu_ops, "gated_mlp", counted)
    return calls


@needs_ops
@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_swiglu_and_gated_mlp_route_through_it(monkeypatch, kind):
    """With low-precision weights both MLPs take the one call at inference and give what their
    layers give one by one; under autograd they keep the plain path."""
    torch.manual_seed(0)
    swiglu = layers.SwiGLU(256, 688).eval()  # 688: the stacked weight splits at a block
    gated = layers.GatedMLP(256, 300).eval()  # separate weights: any width
    for m in (swiglu, gated):
        lp.apply_weight_precision(m, kind)
    x = torch.randn(2, 19, 256)
    with torch.no_grad():
        h = swiglu.up(x)
        g, u = h.chunk(2, dim=-1)
        want_swiglu = swiglu.down(torch.nn.functional.silu(g) * u)
        want_gated = gated.down_proj(torch.nn.functional.silu(gated.gate_proj(x))
                                     * gated.up_proj(x))
    calls = _counting(monkeypatch)
    with torch.no_grad():
        got_swiglu, got_gated = swiglu(x), gated(x)
    assert len(calls) == 2
    assert got_swiglu.shape == x.shape and got_gated.shape == x.shape
    assert rel(got_swiglu, want_swiglu) < 1e-5 and rel(got_gated, want_gated) < 1e-5
    with torch.enable_grad():
        assert rel(swiglu(x), want_swiglu) < 1e-2
    assert len(calls) == 2


@needs_ops
def test_gated_mlp_bad_arguments():
    D, I = 32, 24
    w = weights("bf16", D, I, 3)
    x = torch.randn(4, D)
    with pytest.raises(RuntimeError, match="act must be"):
        cpu.ops().gated_mlp(x, *w, 3)
    with pytest.raises(RuntimeError, match=r"gated_mlp \(down\)"):
        cpu.ops().gated_mlp(x, *w[:4], w[0], w[5], 0)  # a gate-shaped weight as down
    q = weights("int8", D, I, 3)
    with pytest.raises(RuntimeError, match=r"gated_mlp \(up\)"):
        cpu.ops().gated_mlp(x, w[0], w[1], q[2], q[3], *w[4:], 0)  # int8 up, bfloat16 gate
    with pytest.raises(RuntimeError, match="contiguous float32"):
        cpu.ops().gated_mlp(x.double(), *w, 0)
    assert cpu.ops().gated_mlp(torch.randn(0, D), *w, 0).shape == (0, D)
