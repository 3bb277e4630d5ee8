"""chunk_gla (the chunk-parallel path) against naive_gla (its per-token twin)."""

import pytest
import torch

from mcserve.kernels.gla import chunk_gla, naive_gla

CASES = [
    pytest.param(1, 3, id="T1"),
    pytest.param(7, 3, id="T7-chunk3"),
    pytest.param(8, 8, id="T8-chunk8"),
    pytest.param(9, 8, id="T9-chunk8"),
    pytest.param(43, 8, id="T43-chunk8"),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)],
                         ids=["f64", "f32"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("T,chunk", CASES)
def test_chunk_matches_naive(T, chunk, gated, dtype, tol):
    g = torch.Generator().manual_seed(T * 31 + chunk)
    B, H, K, V = 2, 3, 5, 4
    q = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    k = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    log_a = -torch.rand(B, T, H, generator=g, dtype=dtype) if gated else None
    b = torch.rand(B, T, H, generator=g, dtype=dtype) if gated else None
    s0 = torch.randn(B, H, K, V, generator=g, dtype=dtype)
    o, s = chunk_gla(q, k, v, log_a, b, s0, chunk_size=chunk)
    o_ref, s_ref = naive_gla(q, k, v, log_a, b, s0)
    assert _rel(o, o_ref) < tol
    assert _rel(s, s_ref) < tol


def test_strong_decay_stays_finite():
    # log-decays summing to -1e4 inside a chunk must not overflow the masked exponent
    B, T, H, K = 1, 16, 2, 4
    q, k, v = (torch.randn(B, T, H, K) for _ in range(3))
    log_a = torch.full((B, T, H), -1000.0)
    o, s = chunk_gla(q, k, v, log_a, None, torch.zeros(B, H, K, K), chunk_size=16)
    o_ref, _ = naive_gla(q, k, v, log_a, None, torch.zeros(B, H, K, K))
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert _rel(o, o_ref) < 1e-4
