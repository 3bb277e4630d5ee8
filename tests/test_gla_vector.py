"""The vector-gated linear memory (``gla``: a decay per key dimension): the chunked kernel
against its per-token twin and against flash-linear-attention's own naive op, and Memory Caching
over the family against the reference oracle and across splits."""

from __future__ import annotations

import pytest
import torch

from mcserve.config import MCConfig
from mcserve.kernels import reference
from mcserve.kernels.gla_vector import chunk_gla_vec, naive_gla_vec
from mcserve.models.mc import MCMemory
from mcserve.models.memory.gla import VectorGatedMemory


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _inputs(B, T, H, K, V, dtype, seed, strong=False):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    # per-dim decays from almost none to strong; ``strong`` adds dims that decay by e^-30 a token
    log_a = -torch.rand(B, T, H, K, generator=g, dtype=dtype) * (30.0 if strong else 1.0)
    b = torch.rand(B, T, H, generator=g, dtype=dtype)
    S0 = torch.randn(B, H, K, V, generator=g, dtype=dtype)
    return q, k, v, log_a, b, S0


DTYPES = [pytest.param(torch.float64, 1e-10, id="f64"), pytest.param(torch.float32, 1e-4, id="f32")]
LENGTHS = [1, 2, 7, 16, 37, 64, 100, 131]


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("V", [1, 3, 20], ids=["V1", "V3", "V20"])  # scan form, matmul form
@pytest.mark.parametrize("T", LENGTHS, ids=[f"T{t}" for t in LENGTHS])
def test_chunk_matches_naive(T, V, dtype, tol):
    q, k, v, log_a, b, S0 = _inputs(2, T, 3, 5, V, dtype, seed=T * 31 + V)
    o, S = chunk_gla_vec(q, k, v, log_a, b, S0)
    o_ref, S_ref = naive_gla_vec(q, k, v, log_a, b, S0)
    assert o.shape == o_ref.shape and S.shape == S_ref.shape
    assert _rel(o, o_ref) < tol and _rel(S, S_ref) < tol


@pytest.mark.parametrize("V", [1, 20])
@pytest.mark.parametrize("gates", ["none", "decay", "write"])
def test_chunk_optional_gates_and_strong_decay(V, gates):
    q, k, v, log_a, b, S0 = _inputs(1, 77, 2, 6, V, torch.float64, seed=V, strong=True)
    la = None if gates != "decay" else log_a
    bb = None if gates != "write" else b
    o, S = chunk_gla_vec(q, k, v, la, bb, S0, chunk_size=32)
    o_ref, S_ref = naive_gla_vec(q, k, v, la, bb, S0)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert _rel(o, o_ref) < 1e-10 and _rel(S, S_ref) < 1e-10


@pytest.mark.parametrize("T", [1, 19, 70])
def test_naive_matches_fla(T):
    naive = pytest.importorskip("fla.ops.gla.naive")
    q, k, v, log_a, _, S0 = _inputs(2, T, 3, 8, 4, torch.float32, seed=T)
    # fla's op scales q by K^-0.5 and takes the same (B, T, H, K) layout, state (B, H, K, V)
    o_fla, S_fla = naive.naive_recurrent_gla(q, k, v, log_a, initial_state=S0,
                                             output_final_state=True)
    o, S = naive_gla_vec(q * 8 ** -0.5, k, v, log_a, None, S0)
    assert _rel(o, o_fla) < 1e-5 and _rel(S, S_fla) < 1e-5
    o2, S2 = chunk_gla_vec(q * 8 ** -0.5, k, v, log_a, None, S0)
    assert _rel(o2, o_fla) < 1e-4 and _rel(S2, S_fla) < 1e-4


# ------------------------------------------------------------------ Memory Caching
C = 4
COMBOS = [
    pytest.param(var, mode, id=f"{var}-{mode}")
    for var in reference.VARIANTS
    for mode in reference.MODES
    if not (var == "loglinear" and mode == "independent")
]


def _mc(variant, mode, top_k=2):
    return MCMemory(VectorGatedMemory(), MCConfig(variant=variant, mode=mode, segment_len=C,
                                                  top_k=top_k, share_uq=False))


@pytest.mark.parametrize("V", [1, 4])
@pytest.mark.parametrize("variant,mode", COMBOS)
def test_mc_equal_decays_match_reference(variant, mode, V):
    T, H, K = 5 * C + 3, 3, 5
    g = torch.Generator().manual_seed(len(variant) + V)
    q, k, u = (torch.randn(T, H, K, generator=g, dtype=torch.float64) for _ in range(3))
    v = torch.randn(T, H, V, generator=g, dtype=torch.float64)
    a = 0.5 + 0.5 * torch.rand(T, H, generator=g, dtype=torch.float64)
    b = torch.rand(T, H, generator=g, dtype=torch.float64)
    mc = _mc(variant, mode)
    state = mc.init_state(1, H, K, V, dtype=q.dtype, device="cpu")
    gates = {"log_a": a.log()[None, :, :, None].expand(1, T, H, K), "b": b[None]}
    y, _ = mc.forward(state, q[None], k[None], v[None], u[None], gates)
    y_ref = reference.mc_linear(q, k, v, u, a, b, variant=variant, segment_len=C, top_k=2,
                                mode=mode)
    assert _rel(y[0], y_ref) < 1e-10


@pytest.mark.parametrize("variant,mode", COMBOS)
def test_mc_full_equals_split(variant, mode):
    B, T, H, K, V = 2, 6 * C + 1, 2, 4, 3
    q, k, v, log_a, b, _ = _inputs(B, T, H, K, V, torch.float64, seed=len(variant) * 3,
                                   strong=False)
    u = torch.randn(B, T, H, K, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    mc = _mc(variant, mode, top_k=1)
    st0 = mc.init_state(B, H, K, V, dtype=q.dtype, device="cpu")
    y_full, _ = mc.forward(st0, q, k, v, u, {"log_a": log_a, "b": b})
    for cuts in ([5, 6, 13], [1, 2, 3, 4, 9, 17, 24], list(range(1, T))):
        st, ys, t0 = st0, [], 0
        for t1 in cuts + [T]:
            sl = slice(t0, t1)
            y, st = mc.forward(st, q[:, sl], k[:, sl], v[:, sl], u[:, sl],
                               {"log_a": log_a[:, sl], "b": b[:, sl]})
            ys.append(y)
            t0 = t1
        assert _rel(torch.cat(ys, 1), y_full) < 1e-10, cuts
