"""chunk_gla (the chunk-parallel path, and on the CPU the C++ token-by-token scan it takes for
float32) against naive_gla (its per-token twin)."""

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
@pytest.mark.parametrize("path", ["default", "chunked"])
def test_chunk_matches_naive(monkeypatch, T, chunk, gated, dtype, tol, path):
    from mcserve.kernels import gla

    if path == "chunked":  # the products even where the CPU scan would take the span
        monkeypatch.setattr(gla.cpu_ops, "scans", lambda *ts: False)
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


@pytest.mark.parametrize("path", ["default", "chunked"])
def test_strong_decay_stays_finite(monkeypatch, path):
    # log-decays summing to -1e4 inside a chunk must not overflow the masked exponent
    from mcserve.kernels import gla

    if path == "chunked":
        monkeypatch.setattr(gla.cpu_ops, "scans", lambda *ts: False)
    B, T, H, K = 1, 16, 2, 4
    q, k, v = (torch.randn(B, T, H, K) for _ in range(3))
    log_a = torch.full((B, T, H), -1000.0)
    o, s = chunk_gla(q, k, v, log_a, None, torch.zeros(B, H, K, K), chunk_size=16)
    o_ref, _ = naive_gla(q, k, v, log_a, None, torch.zeros(B, H, K, K))
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert _rel(o, o_ref) < 1e-4


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_linear_step_inplace_matches_scan(gated):
    # the engine's in-place decode step (LinearMemory.step_) against the family's scan of one
    # token, on a strided view as the slot pool hands it over
    from mcserve.models.memory.linear import LinearMemory

    g = torch.Generator().manual_seed(7)
    B, H, K, V = 3, 4, 5, 6
    pool = torch.randn(B + 2, H, K, V, generator=g, dtype=torch.float64)
    q, k = (torch.randn(B, 1, H, K, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, 1, H, V, generator=g, dtype=torch.float64)
    gates = ({"log_a": -torch.rand(B, 1, H, generator=g, dtype=torch.float64),
              "b": torch.rand(B, 1, H, generator=g, dtype=torch.float64)} if gated else {})
    fam = LinearMemory()
    want_o, want = fam.scan({"S": pool[1:B + 1].clone()}, q, k, v, gates)
    view = pool[1:B + 1]
    o = fam.step_({"S": view}, q, k, v, gates)
    assert torch.allclose(o, want_o, rtol=1e-12, atol=1e-12)
    assert torch.allclose(pool[1:B + 1], want["S"], rtol=1e-12, atol=1e-12)  # written in place


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_chunk_state_groups_match_naive(monkeypatch, gated):
    # start states read out a group of chunks at a time: groups of one and of two chunks (the
    # last group partial) give the same result as holding them all
    from mcserve.kernels import gla

    g = torch.Generator().manual_seed(5)
    B, T, H, K, V = 2, 45, 3, 4, 6
    q, k = (torch.randn(B, T, H, K, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    log_a = -torch.rand(B, T, H, generator=g, dtype=torch.float64) if gated else None
    b = torch.rand(B, T, H, generator=g, dtype=torch.float64) if gated else None
    s0 = torch.randn(B, H, K, V, generator=g, dtype=torch.float64)
    o_ref, s_ref = naive_gla(q, k, v, log_a, b, s0)
    for chunks in (1, 2):
        monkeypatch.setattr(gla, "_GROUP_BYTES", chunks * B * 8 * H * V * 8)
        o, s = chunk_gla(q, k, v, log_a, b, s0, chunk_size=8)
        assert _rel(o, o_ref) < 1e-10
        assert _rel(s, s_ref) < 1e-10


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_chunk_gradients_match_naive(gated):
    # training backpropagates through the chunked form (in-place ops on its own temporaries):
    # the gradients of every input equal the per-token twin's
    g = torch.Generator().manual_seed(11)
    B, T, H, K, V = 2, 21, 3, 4, 5
    leaves = [torch.randn(B, T, H, K, generator=g, dtype=torch.float64),
              torch.randn(B, T, H, K, generator=g, dtype=torch.float64),
              torch.randn(B, T, H, V, generator=g, dtype=torch.float64),
              -torch.rand(B, T, H, generator=g, dtype=torch.float64) if gated else None,
              torch.rand(B, T, H, generator=g, dtype=torch.float64) if gated else None,
              torch.randn(B, H, K, V, generator=g, dtype=torch.float64)]
    w_o = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    w_s = torch.randn(B, H, K, V, generator=g, dtype=torch.float64)
    grads = []
    for fn in (chunk_gla, naive_gla):
        xs = [None if x is None else x.clone().requires_grad_() for x in leaves]
        o, s = fn(*xs[:5], xs[5], chunk_size=8) if fn is chunk_gla else fn(*xs[:5], xs[5])
        ((o * w_o).sum() + (s * w_s).sum()).backward()
        grads.append([None if x is None else x.grad for x in xs])
    for got, want in zip(*grads):
        if want is not None:
            assert _rel(got, want) < 1e-10
