"""The delta-rule memories: the chunked kernel against its per-token twin, the twin against
flash-linear-attention's own naive recurrences, and Memory Caching over the ``delta`` /
``gated_delta`` families (``MCMemory``) against the per-token oracle ``reference.mc_delta``.

float64 to 1e-10, float32 to 1e-4 relative, odd lengths, several heads (docs/mc.md).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from mcserve.config import MCConfig
from mcserve.kernels import reference
from mcserve.kernels.delta import chunk_delta_rule, naive_delta_rule
from mcserve.models.mc import MCMemory
from mcserve.models.memory.delta import DeltaMemory, GatedDeltaMemory

DTYPES = [pytest.param(torch.float64, 1e-10, id="f64"), pytest.param(torch.float32, 1e-4, id="f32")]


def _rel(a: Tensor, b: Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _inputs(B, T, H, K, V, dtype, seed, gated):
    """Unit keys (as both models feed the rule), β ∈ (0, 2) (negative eigenvalues allowed)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, K, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    beta = 2 * torch.rand(B, T, H, generator=g, dtype=dtype)
    log_a = -torch.rand(B, T, H, generator=g, dtype=dtype) if gated else None
    S0 = torch.randn(B, H, K, V, generator=g, dtype=dtype)
    return q, k, v, beta, log_a, S0


# ------------------------------------------------------------------ kernel vs twin
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("gated", [False, True], ids=["delta", "gated"])
@pytest.mark.parametrize("T,chunk", [(1, 16), (7, 16), (16, 16), (37, 16), (70, 64)])
def test_chunk_equals_naive(dtype, tol, gated, T, chunk):
    q, k, v, beta, log_a, S0 = _inputs(2, T, 3, 8, 6, dtype, T, gated)
    o1, S1 = chunk_delta_rule(q, k, v, beta, log_a, S0, chunk_size=chunk)
    o2, S2 = naive_delta_rule(q, k, v, beta, log_a, S0)
    assert o1.dtype == dtype and S1.dtype == dtype
    assert _rel(o1, o2) <= tol and _rel(S1, S2) <= tol


@pytest.mark.parametrize("gated", [False, True], ids=["delta", "gated"])
def test_chunk_defaults_and_splits(gated):
    q, k, v, beta, log_a, _ = _inputs(1, 29, 2, 4, 5, torch.float64, 1, gated)
    # no initial state = zeros; no beta = ones
    o1, S1 = chunk_delta_rule(q, k, v, None, log_a, chunk_size=8)
    o2, S2 = naive_delta_rule(q, k, v, torch.ones_like(beta), log_a,
                              torch.zeros(1, 2, 4, 5, dtype=torch.float64))
    assert _rel(o1, o2) <= 1e-10 and _rel(S1, S2) <= 1e-10
    # associative: scanning [:11] then [11:] from the carried state is one scan
    la = (lambda sl: None) if log_a is None else (lambda sl: log_a[:, sl])
    oa, Sa = chunk_delta_rule(q[:, :11], k[:, :11], v[:, :11], beta[:, :11], la(slice(0, 11)))
    ob, Sb = chunk_delta_rule(q[:, 11:], k[:, 11:], v[:, 11:], beta[:, 11:], la(slice(11, None)),
                              Sa)
    o, S = chunk_delta_rule(q, k, v, beta, log_a)
    assert _rel(torch.cat([oa, ob], 1), o) <= 1e-10 and _rel(Sb, S) <= 1e-10
    # empty span: the state passes through
    e, Se = chunk_delta_rule(q[:, :0], k[:, :0], v[:, :0], beta[:, :0],
                             None if log_a is None else log_a[:, :0], S)
    assert e.shape == (1, 0, 2, 5) and torch.equal(Se, S)


def test_chunk_half_precision_runs_in_float32():
    q, k, v, beta, log_a, S0 = _inputs(1, 20, 2, 8, 8, torch.float32, 2, True)
    want, _ = naive_delta_rule(q, k, v, beta, log_a, S0)
    bf = [x.bfloat16() for x in (q, k, v, beta, log_a, S0)]
    o, S = chunk_delta_rule(*bf, chunk_size=8)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.bfloat16
    assert _rel(o.float(), want) <= 5e-2


# ------------------------------------------------------------------ twin vs fla's naive ops
fla_delta = pytest.importorskip("fla.ops.delta_rule.naive")
fla_gated = pytest.importorskip("fla.ops.gated_delta_rule.naive")


@pytest.mark.parametrize("T", [1, 9, 33])
def test_naive_matches_fla_delta_rule(T):
    # fla's delta_rule_recurrence: (B, H, T, K) layout, q scaled by K^-0.5, float32 inside
    q, k, v, beta, _, S0 = _inputs(2, T, 3, 8, 6, torch.float32, 10 + T, False)
    want_o, want_S = fla_delta.delta_rule_recurrence(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), beta.transpose(1, 2),
        initial_state=S0.clone())
    o, S = naive_delta_rule(q * 8 ** -0.5, k, v, beta, None, S0)
    assert _rel(o, want_o.transpose(1, 2)) <= 1e-5 and _rel(S, want_S) <= 1e-5
    o, S = chunk_delta_rule(q * 8 ** -0.5, k, v, beta, None, S0, chunk_size=8)
    assert _rel(o, want_o.transpose(1, 2)) <= 1e-4 and _rel(S, want_S) <= 1e-4


@pytest.mark.parametrize("T", [1, 9, 33])
def test_naive_matches_fla_gated_delta_rule(T):
    # fla's naive_recurrent_gated_delta_rule: (B, T, H, K) layout, g = log α, scale given
    q, k, v, beta, log_a, S0 = _inputs(2, T, 3, 8, 6, torch.float32, 20 + T, True)
    want_o, want_S = fla_gated.naive_recurrent_gated_delta_rule(
        q, k, v, beta, log_a, scale=0.5, initial_state=S0.clone(), output_final_state=True)
    o, S = naive_delta_rule(q * 0.5, k, v, beta, log_a, S0)
    assert _rel(o, want_o) <= 1e-5 and _rel(S, want_S) <= 1e-5
    o, S = chunk_delta_rule(q * 0.5, k, v, beta, log_a, S0, chunk_size=8)
    assert _rel(o, want_o) <= 1e-4 and _rel(S, want_S) <= 1e-4


# ------------------------------------------------------------------ MC over the families
C = 4
COMBOS = [
    pytest.param(var, mode, id=f"{var}-{mode}")
    for var in reference.VARIANTS
    for mode in reference.MODES
    if not (var == "loglinear" and mode == "independent")
]


def _family(gated: bool):
    return GatedDeltaMemory() if gated else DeltaMemory()


def _gates(beta: Tensor, log_a: Tensor | None) -> dict[str, Tensor]:
    return {"beta": beta} if log_a is None else {"beta": beta, "log_a": log_a}


def test_reference_mc_delta_none_is_the_recurrence():
    q, k, v, beta, log_a, _ = _inputs(1, 13, 2, 4, 3, torch.float64, 3, True)
    u = torch.randn_like(q)
    want, _ = reference.delta_rule_recurrent(q, k, v, beta, log_a)
    for variant, seg in (("none", 4), ("post", 13), ("grm", 13), ("residual", 20)):
        y = reference.mc_delta(q[0], k[0], v[0], u[0], beta[0], log_a[0], variant=variant,
                               segment_len=seg)
        assert _rel(y, want[0]) <= 1e-12, variant
    # independent post over two segments: the mean of two restarted recurrences
    y = reference.mc_delta(q[0], k[0], v[0], u[0], beta[0], log_a[0], variant="post",
                           segment_len=8, mode="independent")
    o1, _ = reference.delta_rule_recurrent(q[:, :8], k[:, :8], v[:, :8], beta[:, :8],
                                           log_a[:, :8])
    _, S8 = reference.delta_rule_recurrent(q[:, :8], k[:, :8], v[:, :8], beta[:, :8],
                                           log_a[:, :8])
    o2, _ = reference.delta_rule_recurrent(q[:, 8:], k[:, 8:], v[:, 8:], beta[:, 8:],
                                           log_a[:, 8:])
    cached = torch.einsum("thk,hkv->thv", q[0, 8:], S8[0])
    assert _rel(y[:8], o1[0]) <= 1e-12
    assert _rel(y[8:], (o2[0] + cached) / 2) <= 1e-12


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("gated", [False, True], ids=["delta", "gated"])
@pytest.mark.parametrize("variant,mode", COMBOS)
def test_mc_memory_matches_oracle(variant, mode, gated, dtype, tol):
    H, K, V, T = 3, 4, 5, 5 * C + 3
    q, k, v, beta, log_a, _ = _inputs(2, T, H, K, V, dtype, 7, gated)
    u = torch.randn(2, T, H, K, dtype=dtype, generator=torch.Generator().manual_seed(8))
    mc = MCMemory(_family(gated), MCConfig(variant=variant, mode=mode, segment_len=C, top_k=2))
    state = mc.init_state(2, H, K, V, dtype=dtype, device="cpu")
    y, _ = mc.forward(state, q, k, v, u, _gates(beta, log_a))
    for b in range(2):
        want = reference.mc_delta(q[b], k[b], v[b], u[b], beta[b],
                                  None if log_a is None else log_a[b], variant=variant,
                                  segment_len=C, top_k=2, mode=mode)
        assert _rel(y[b], want) <= tol, b


@pytest.mark.parametrize("gated", [False, True], ids=["delta", "gated"])
@pytest.mark.parametrize("variant,mode", COMBOS)
def test_mc_memory_full_equals_split(variant, mode, gated):
    H, K, V, T = 2, 4, 3, 4 * C + 2
    q, k, v, beta, log_a, _ = _inputs(2, T, H, K, V, torch.float64, 9, gated)
    u = torch.randn(2, T, H, K, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    mc = MCMemory(_family(gated), MCConfig(variant=variant, mode=mode, segment_len=C, top_k=1))
    gates = _gates(beta, log_a)
    state = mc.init_state(2, H, K, V, dtype=torch.float64, device="cpu")
    full, _ = mc.forward(state, q, k, v, u, gates)
    rng = random.Random(variant + mode)
    cuts = sorted(rng.sample(range(1, T), 4))
    for bounds in ([0, *cuts, T], list(range(T + 1))):  # random pieces; one token at a time
        st, ys = state, []
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            sl = slice(a, b)
            y, st = mc.forward(st, q[:, sl], k[:, sl], v[:, sl], u[:, sl],
                               {n: g[:, sl] for n, g in gates.items()})
            ys.append(y)
        assert _rel(torch.cat(ys, 1), full) <= 1e-10, bounds
