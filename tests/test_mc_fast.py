"""The vectorised torch path (what the model runs) against the reference oracle.

float64 to 1e-10, float32 to 1e-4 relative, odd lengths, several heads (docs/mc.md).
"""

import pytest
import torch
from torch import Tensor

from mcserve.config import MCConfig
from mcserve.kernels import reference
from mcserve.models.mc import MCMemory
from mcserve.models.memory.deep import DLAMemory, TitansMemory
from mcserve.models.memory.linear import LinearMemory


def mc_linear(q: Tensor, k: Tensor, v: Tensor, u: Tensor, a: Tensor | None = None,
              b: Tensor | None = None, *, variant: str, segment_len: int, top_k: int = 2,
              mode: str = "checkpoint") -> Tensor:
    """``reference.mc_linear`` computed by the layer code the model runs (``MCMemory`` over the
    linear family) for one unbatched sequence: testing it tests the serving path itself."""
    mc = MCMemory(LinearMemory(), MCConfig(variant=variant, mode=mode, segment_len=segment_len,
                                           top_k=top_k))
    T, H, K = q.shape
    state = mc.init_state(1, H, K, v.shape[-1], dtype=q.dtype, device=q.device)
    gates = {}
    if a is not None:
        gates["log_a"] = a.log()[None]
    if b is not None:
        gates["b"] = b[None]
    y, _ = mc.forward(state, q[None], k[None], v[None], u[None], gates)
    return y[0]


def mc_deep(q: Tensor, k: Tensor, v: Tensor, u: Tensor, eta: Tensor, w1_init: Tensor,
            w2_init: Tensor, a: Tensor | None = None, m: Tensor | None = None, *, memory: str,
            variant: str, segment_len: int, top_k: int = 2, mode: str = "checkpoint",
            inner_chunk: int = 1) -> Tensor:
    """``reference.mc_deep`` computed by ``MCMemory`` over the ``dla``/``titans`` family."""
    family = DLAMemory(inner_chunk) if memory == "dla" else TitansMemory(inner_chunk)
    mc = MCMemory(family, MCConfig(variant=variant, mode=mode, segment_len=segment_len,
                                   top_k=top_k))
    T, H, K = q.shape
    init = {"w1": w1_init, "w2": w2_init}
    state = mc.init_state(1, H, K, v.shape[-1], dtype=q.dtype, device=q.device, init=init)
    gates = {"eta": eta[None]}
    if memory == "titans":
        if a is not None:
            gates["a"] = a[None]
        if m is not None:
            gates["m"] = m[None]
    y, _ = mc.forward(state, q[None], k[None], v[None], u[None], gates, init=init)
    return y[0]


C = 4
LENGTHS = [1, C - 1, C, C + 1, 5 * C + 3]
LINEAR_COMBOS = [
    pytest.param(var, mode, id=f"{var}-{mode}")
    for var in reference.VARIANTS
    for mode in reference.MODES
    if not (var == "loglinear" and mode == "independent")
]
DTYPES = [pytest.param(torch.float64, 1e-10, id="f64"), pytest.param(torch.float32, 1e-4, id="f32")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _inputs(T, H, K, V, dtype, seed, gated):
    g = torch.Generator().manual_seed(seed)
    q, k, u = (torch.randn(T, H, K, generator=g, dtype=dtype) for _ in range(3))
    v = torch.randn(T, H, V, generator=g, dtype=dtype)
    a = 0.5 + 0.5 * torch.rand(T, H, generator=g, dtype=dtype) if gated else None
    b = torch.rand(T, H, generator=g, dtype=dtype) if gated else None
    return q, k, v, u, a, b


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("T", LENGTHS, ids=[f"T{t}" for t in LENGTHS])
@pytest.mark.parametrize("variant,mode", LINEAR_COMBOS)
def test_mc_linear_matches_reference(variant, mode, T, gated, dtype, tol):
    q, k, v, u, a, b = _inputs(T, 3, 5, 4, dtype, seed=T * 7 + len(variant), gated=gated)
    kw = dict(variant=variant, segment_len=C, top_k=2, mode=mode)
    y = mc_linear(q, k, v, u, a, b, **kw)
    y_ref = reference.mc_linear(q, k, v, u, a, b, **kw)
    assert y.shape == y_ref.shape
    assert _rel(y, y_ref) < tol


@pytest.mark.parametrize("top_k", [1, 3])
def test_ssc_many_segments(top_k):
    # many cached segments relative to top_k, so the selection really drops blocks
    q, k, v, u, a, b = _inputs(45, 2, 4, 4, torch.float64, seed=3, gated=True)
    kw = dict(variant="ssc", segment_len=3, top_k=top_k)
    assert _rel(mc_linear(q, k, v, u, a, b, **kw),
                reference.mc_linear(q, k, v, u, a, b, **kw)) < 1e-10


DEEP_COMBOS = [
    pytest.param(mem, var, mode, id=f"{mem}-{var}-{mode}")
    for mem in ("dla", "titans")
    for var in reference.VARIANTS
    for mode in reference.MODES
    if not (var == "loglinear" and mode == "independent")
]


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("T", [1, C + 1, 3 * C + 2], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("memory,variant,mode", DEEP_COMBOS)
def test_mc_deep_matches_reference(memory, variant, mode, T, dtype, tol):
    g = torch.Generator().manual_seed(T + len(variant))
    H, K, E = 2, 4, 6
    q, k, u = (torch.randn(T, H, K, generator=g, dtype=dtype) for _ in range(3))
    k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(T, H, K, generator=g, dtype=dtype)
    eta = 0.3 * torch.rand(T, H, generator=g, dtype=dtype)
    w1 = torch.randn(H, K, E, generator=g, dtype=dtype) / 3
    w2 = torch.randn(H, E, K, generator=g, dtype=dtype) / 3
    a = 0.8 + 0.2 * torch.rand(T, H, generator=g, dtype=dtype)
    m = 0.5 * torch.rand(T, H, generator=g, dtype=dtype)
    kw = dict(memory=memory, variant=variant, segment_len=C, top_k=1, mode=mode, inner_chunk=2)
    y = mc_deep(q, k, v, u, eta, w1, w2, a, m, **kw)
    y_ref = reference.mc_deep(q, k, v, u, eta, w1, w2, a, m, **kw)
    assert _rel(y, y_ref) < tol


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_paged_readout_matches_gathered(dtype, tol):
    # the engine's in-place pool readout (embedding bags) against gather + readout_mix, with
    # block ids that are scattered, repeated across rows and different per head
    from mcserve.models.memory.linear import LinearMemory

    g = torch.Generator().manual_seed(0)
    NB, H, K, V, B, n = 11, 3, 4, 5, 4, 6
    pool = {"S": torch.randn(NB, H, K, V, generator=g, dtype=dtype)}
    ids = torch.randint(0, NB, (B, n, H), generator=g)
    q = torch.randn(B, 1, H, K, generator=g, dtype=dtype)
    w = torch.rand(B, 1, n, H, generator=g, dtype=dtype)
    fam = LinearMemory()
    h = torch.arange(H)[None, None, :]
    want = fam.readout_mix({"S": pool["S"][ids, h]}, q, w)
    assert _rel(fam.readout_mix_paged(pool, ids, q, w), want) < tol
