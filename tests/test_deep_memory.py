"""Deep memory families ``dla`` / ``titans``: dual form vs per-token twin, associativity, soup.

Oracles: the per-token twins in :mod:`mcserve.kernels.deep` (``*_naive``), closed-form gradient
updates written out by hand, explicit loops that materialise the per-token weights, and
:func:`mcserve.kernels.reference.mc_deep` (docs/deep-memory.md).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from mcserve.kernels.deep import (
    deep_init_state,
    deep_online_apply,
    deep_online_apply_naive,
    deep_scan,
    deep_scan_naive,
)
from mcserve.kernels.reference import mc_deep
from mcserve.models.memory.base import MemoryFamily
from mcserve.models.memory.deep import DLAMemory, TitansMemory

MEMORIES = ("dla", "titans")
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
DTYPES = [pytest.param(torch.float64, id="f64"), pytest.param(torch.float32, id="f32")]
H, K, E = 2, 4, 16  # heads, key (= value) dim, expansion 4


def _rel(x: Tensor, ref: Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def _family(memory: str, inner_chunk: int) -> DLAMemory | TitansMemory:
    return DLAMemory(inner_chunk) if memory == "dla" else TitansMemory(inner_chunk)


def _init(dtype: torch.dtype, gen: torch.Generator) -> dict[str, Tensor]:
    w1 = torch.randn(H, K, E, generator=gen, dtype=torch.float64) * 0.5 / math.sqrt(E)
    w2 = torch.randn(H, E, K, generator=gen, dtype=torch.float64) * 0.5 / math.sqrt(K)
    return {"w1": w1.to(dtype), "w2": w2.to(dtype)}


def _inputs(
    memory: str, B: int, T: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor]]:
    """q, k (unit norm), v ``(B, T, H, K)`` and random gates in their documented ranges."""

    def rand(*shape: int) -> Tensor:
        return torch.rand(*shape, generator=gen, dtype=torch.float64)

    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(
        torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1
    )
    v = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) / math.sqrt(K)
    gates = {"eta": 0.5 * rand(B, T, H)}  # [0, 0.5]
    if memory == "titans":
        gates["a"] = 1.0 - 0.5 * rand(B, T, H)  # (0.5, 1]
        gates["m"] = 0.9 * rand(B, T, H)  # [0, 0.9)
    cast = [x.to(dtype) for x in (q, k, v)]
    return cast[0], cast[1], cast[2], {n: g.to(dtype) for n, g in gates.items()}


def _slice(gates: dict[str, Tensor], sl: slice) -> dict[str, Tensor]:
    return {n: g[:, sl] for n, g in gates.items()}


def _start_state(
    memory: str, inner_chunk: int, B: int, dtype: torch.dtype, start: str,
    gen: torch.Generator,
) -> dict[str, Tensor]:
    """A fresh state, or one in the middle of an inner chunk (after a warm-up prefix)."""
    init = _init(dtype, gen)
    state = deep_init_state(memory, B, init["w1"], init["w2"], dtype=dtype, device="cpu")
    if start == "mid":
        P = inner_chunk + inner_chunk // 2 + 1
        q, k, v, gates = _inputs(memory, B, P, dtype, gen)
        _, state = deep_scan_naive(
            state, q, k, v, gates["eta"], gates.get("a"), gates.get("m"),
            memory=memory, inner_chunk=inner_chunk,
        )
        assert int(state["fill"][0]) == P % inner_chunk
    return state


def _assert_states_close(st: dict[str, Tensor], ref: dict[str, Tensor], tol: float) -> None:
    assert set(st) == set(ref)
    assert torch.equal(st["fill"], ref["fill"])
    for key in ref:
        if key != "fill":
            assert st[key].dtype == ref[key].dtype
            assert _rel(st[key], ref[key]) <= tol, key


# --------------------------------------------------------------------------------------
# Dual form == per-token twin
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("start", ["fresh", "mid"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3, 16, 37], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("inner_chunk", [1, 4, 16], ids=lambda c: f"ic{c}")
@pytest.mark.parametrize("memory", MEMORIES)
def test_dual_form_matches_naive(
    memory: str, inner_chunk: int, T: int, dtype: torch.dtype, start: str
) -> None:
    gen = torch.Generator().manual_seed(1000 * inner_chunk + T)
    B = 2
    state = _start_state(memory, inner_chunk, B, dtype, start, gen)
    q, k, v, gates = _inputs(memory, B, T, dtype, gen)
    args = (state, q, k, v, gates["eta"], gates.get("a"), gates.get("m"))
    o, st = deep_scan(*args, memory=memory, inner_chunk=inner_chunk)
    o_ref, st_ref = deep_scan_naive(*args, memory=memory, inner_chunk=inner_chunk)
    assert o.shape == (B, T, H, K) and o.dtype == dtype
    tol = TOL[dtype]
    # Compare the memory part (o - q) so the identity term does not hide errors.
    assert _rel(o - q, o_ref - q) <= tol
    _assert_states_close(st, st_ref, tol)
    assert int(st["fill"][0]) == (int(state["fill"][0]) + T) % inner_chunk


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inner_chunk", [1, 4], ids=lambda c: f"ic{c}")
@pytest.mark.parametrize("memory", MEMORIES)
def test_online_apply_matches_naive(memory: str, inner_chunk: int, dtype: torch.dtype) -> None:
    """Arbitrary per-token vectors and a token-dependent ``mid`` (not the gelu of a scan)."""
    gen = torch.Generator().manual_seed(7 + inner_chunk)
    B, T = 2, 11
    state = _start_state(memory, inner_chunk, B, dtype, "mid", gen)
    q, k, v, gates = _inputs(memory, B, T, dtype, gen)
    scale = torch.rand(B, T, H, 1, generator=gen, dtype=torch.float64).to(dtype)

    def mid(h: Tensor, t0: int, t1: int) -> Tensor:
        return torch.tanh(h) * scale[:, t0:t1]

    args = (state, k, v, q, mid, gates["eta"], gates.get("a"), gates.get("m"))
    out, y, st = deep_online_apply(*args, memory=memory, inner_chunk=inner_chunk)
    out_ref, y_ref, st_ref = deep_online_apply_naive(*args, memory=memory, inner_chunk=inner_chunk)
    assert out.shape == (B, T, H, K) and y.shape == (B, T, H, E)
    assert _rel(out, out_ref) <= TOL[dtype]
    assert _rel(y, y_ref) <= TOL[dtype]
    _assert_states_close(st, st_ref, TOL[dtype])


# --------------------------------------------------------------------------------------
# Associativity (decode == prefill == any split)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", ["random", "per-token"])
@pytest.mark.parametrize("inner_chunk", [1, 4, 16], ids=lambda c: f"ic{c}")
@pytest.mark.parametrize("memory", MEMORIES)
def test_scan_split_equals_one_scan(memory: str, inner_chunk: int, split: str) -> None:
    gen = torch.Generator().manual_seed(3 + inner_chunk)
    B, T = 2, 37
    fam = _family(memory, inner_chunk)
    init = _init(torch.float64, gen)
    state0 = fam.init_state(B, H, K, K, dtype=torch.float64, device="cpu", init=init)
    before = {key: val.clone() for key, val in state0.items()}
    q, k, v, gates = _inputs(memory, B, T, torch.float64, gen)
    o_full, st_full = fam.scan(state0, q, k, v, gates)

    if split == "per-token":
        cuts = list(range(T + 1))
    else:
        inner = torch.randperm(T - 1, generator=gen)[:6] + 1
        cuts = [0, *sorted(int(c) for c in inner), T]
    outs, state = [], state0
    for c0, c1 in zip(cuts[:-1], cuts[1:], strict=True):
        sl = slice(c0, c1)
        o, state = fam.scan(state, q[:, sl], k[:, sl], v[:, sl], _slice(gates, sl))
        outs.append(o)
    assert _rel(torch.cat(outs, dim=1) - q, o_full - q) <= 1e-10
    _assert_states_close(state, st_full, 1e-10)
    for key, val in before.items():  # the input state is not modified in place
        assert torch.equal(state0[key], val), key


def test_empty_scan_and_fill_checks() -> None:
    fam = TitansMemory(4)
    gen = torch.Generator().manual_seed(0)
    init = _init(torch.float64, gen)
    state = fam.init_state(2, H, K, K, dtype=torch.float64, device="cpu", init=init)
    q, k, v, gates = _inputs("titans", 2, 0, torch.float64, gen)
    o, st = fam.scan(state, q, k, v, gates)
    assert o.shape == (2, 0, H, K)
    _assert_states_close(st, state, 0.0)
    bad = dict(state, fill=torch.tensor([0, 1]))
    q, k, v, gates = _inputs("titans", 2, 1, torch.float64, gen)
    with pytest.raises(AssertionError):
        fam.scan(bad, q, k, v, gates)
    with pytest.raises(ValueError):
        fam.scan(dict(state, fill=torch.tensor([4, 4])), q, k, v, gates)
    with pytest.raises(ValueError):
        fam.init_state(2, H, K, K, dtype=torch.float64, device="cpu", init=None)


def test_protocol_attributes() -> None:
    dla, titans = DLAMemory(), TitansMemory()
    fams: list[MemoryFamily] = [dla, titans]
    assert [f.name for f in fams] == ["dla", "titans"]
    assert dla.gate_names == ("eta",) and titans.gate_names == ("eta", "a", "m")
    assert all(f.readout_keys == ("W1", "W2") and not f.linear for f in fams)
    assert dla.inner_chunk == titans.inner_chunk == 16
    state = titans.init_state(3, H, K, K, dtype=torch.float32, device="cpu",
                              init=_init(torch.float32, torch.Generator().manual_seed(0)))
    assert state["W1"].shape == (3, H, K, E) and state["W2"].shape == (3, H, E, K)
    assert state["Z1"].abs().sum() == 0 and state["fill"].dtype == torch.long
    dla_state = dla.init_state(1, H, K, K, dtype=torch.float64, device="cpu",
                               init=_init(torch.float64, torch.Generator()))
    assert set(dla_state) == {"W1", "W2", "W1_0", "W2_0", "fill"}


# --------------------------------------------------------------------------------------
# Hand check: one token, closed-form gradient
# --------------------------------------------------------------------------------------


def _gelu_and_grad(z: Tensor) -> tuple[Tensor, Tensor]:
    cdf = 0.5 * (1.0 + torch.erf(z / math.sqrt(2.0)))
    pdf = torch.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    return z * cdf, cdf + z * pdf


@pytest.mark.parametrize("memory", MEMORIES)
def test_one_token_closed_form(memory: str) -> None:
    gen = torch.Generator().manual_seed(11)
    dt = torch.float64
    init = _init(dt, gen)
    fam = _family(memory, 1)
    state = fam.init_state(1, H, K, K, dtype=dt, device="cpu", init=init)
    q, k, v, gates = _inputs(memory, 1, 1, dt, gen)
    o, st = fam.scan(state, q, k, v, gates)
    for h in range(H):
        W1, W2 = init["w1"][h], init["w2"][h]  # (V, E), (E, K)
        kk, vv, qq = k[0, 0, h], v[0, 0, h], q[0, 0, h]
        eta = gates["eta"][0, 0, h]
        z = W2 @ kk
        act, dact = _gelu_and_grad(z)
        if memory == "dla":  # ascent on <M(k), v>: dW1 = v act^T, dW2 = ((W1^T v) * gelu'(z)) k^T
            W1n = W1 + eta * torch.outer(vv, act)
            W2n = W2 + eta * torch.outer((W1.T @ vv) * dact, kk)
        else:  # Z = -eta grad ||M(k) - v||^2 (m * 0), W = a W + Z
            r = kk + W1 @ act - vv
            Z1 = -eta * torch.outer(2 * r, act)
            Z2 = -eta * torch.outer((W1.T @ (2 * r)) * dact, kk)
            a = gates["a"][0, 0, h]
            W1n, W2n = a * W1 + Z1, a * W2 + Z2
            assert _rel(st["Z1"][0, h], Z1) <= 1e-12
            assert _rel(st["Z2"][0, h], Z2) <= 1e-12
        assert _rel(st["W1"][0, h], W1n) <= 1e-12
        assert _rel(st["W2"][0, h], W2n) <= 1e-12
        assert _rel(st["W1_0"][0, h], W1n) <= 1e-12  # inner chunk of 1 is full: W0 := W
        y = qq + W1n @ _gelu_and_grad(W2n @ qq)[0]  # readout after the token's own update
        assert _rel(o[0, 0, h], y) <= 1e-12
    # The same gradients by autograd (the loss has no 1/2).
    w1 = init["w1"].clone().requires_grad_(True)
    w2 = init["w2"].clone().requires_grad_(True)
    x = k[0, 0]  # (H, K)
    mk = x + torch.einsum("hve,he->hv", w1, torch.nn.functional.gelu(
        torch.einsum("hek,hk->he", w2, x)))
    loss = (mk * v[0, 0]).sum() if memory == "dla" else ((mk - v[0, 0]) ** 2).sum()
    g1, g2 = torch.autograd.grad(loss, (w1, w2))
    lr = gates["eta"][0, 0][:, None, None]
    if memory == "dla":
        w1n, w2n = init["w1"] + lr * g1, init["w2"] + lr * g2
    else:
        a = gates["a"][0, 0][:, None, None]
        w1n, w2n = a * init["w1"] - lr * g1, a * init["w2"] - lr * g2
    assert _rel(st["W1"][0], w1n) <= 1e-12 and _rel(st["W2"][0], w2n) <= 1e-12


# --------------------------------------------------------------------------------------
# Cached memories: readout_mix and memory soup
# --------------------------------------------------------------------------------------


def _mlp(w1: Tensor, w2: Tensor, x: Tensor) -> Tensor:
    """``x + W1 gelu(W2 x)`` for one head: w1 ``(V, E)``, w2 ``(E, K)``, x ``(K,)``."""
    return x + w1 @ torch.nn.functional.gelu(w2 @ x)


def _cached(B: int, N: int, dtype: torch.dtype, gen: torch.Generator) -> dict[str, Tensor]:
    w1 = torch.randn(B, N, H, K, E, generator=gen, dtype=torch.float64) / math.sqrt(E)
    w2 = torch.randn(B, N, H, E, K, generator=gen, dtype=torch.float64) / math.sqrt(K)
    return {"W1": w1.to(dtype), "W2": w2.to(dtype)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [0, 1, 3], ids=lambda n: f"N{n}")
def test_readout_mix_explicit(N: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(N)
    B, T = 2, 5
    mem = _cached(B, N, dtype, gen)
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64).to(dtype)
    w = torch.rand(B, T, N, H, generator=gen, dtype=torch.float64).to(dtype)  # not normalised
    out = DLAMemory().readout_mix(mem, q, w)
    assert out.shape == (B, T, H, K) and out.dtype == dtype
    ref = torch.zeros(B, T, H, K, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            for h in range(H):
                for n in range(N):
                    ref[b, t, h] += w[b, t, n, h].double() * _mlp(
                        mem["W1"][b, n, h].double(), mem["W2"][b, n, h].double(),
                        q[b, t, h].double())
    if N == 0:
        assert torch.equal(out, torch.zeros_like(out))
    else:
        assert _rel(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [0, 3], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("inner_chunk", [1, 4], ids=lambda c: f"ic{c}")
@pytest.mark.parametrize("memory", MEMORIES)
def test_scan_soup_explicit(memory: str, inner_chunk: int, N: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(100 + N + inner_chunk)
    B, T = 2, 9
    fam = _family(memory, inner_chunk)
    state = _start_state(memory, inner_chunk, B, dtype, "mid", gen)
    q, k, v, gates = _inputs(memory, B, T, dtype, gen)
    mem = _cached(B, N, dtype, gen)
    w_on = torch.rand(B, T, H, generator=gen, dtype=torch.float64).to(dtype)
    w_cached = torch.rand(B, T, N, H, generator=gen, dtype=torch.float64).to(dtype)
    y, st = fam.scan_soup(state, q, k, v, gates, w_on, mem, w_cached)
    o_plain, st_plain = fam.scan(state, q, k, v, gates)
    _assert_states_close(st, st_plain, TOL[dtype])  # soup reads, it does not change the update

    # Explicit: materialise theta_t by scanning one token at a time, mix, read out.
    ref = torch.zeros(B, T, H, K, dtype=torch.float64)
    cur = state
    for t in range(T):
        _, cur = fam.scan(cur, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1],
                          _slice(gates, slice(t, t + 1)))
        for b in range(B):
            for h in range(H):
                w1 = w_on[b, t, h] * cur["W1"][b, h]
                w2 = w_on[b, t, h] * cur["W2"][b, h]
                for n in range(N):
                    w1 = w1 + w_cached[b, t, n, h] * mem["W1"][b, n, h]
                    w2 = w2 + w_cached[b, t, n, h] * mem["W2"][b, n, h]
                ref[b, t, h] = _mlp(w1.double(), w2.double(), q[b, t, h].double())
    assert y.shape == (B, T, H, K) and y.dtype == dtype
    assert _rel(y - q, ref - q.double()) <= TOL[dtype]

    # Associativity of the soup over a split.
    c = 4
    y1, s1 = fam.scan_soup(state, q[:, :c], k[:, :c], v[:, :c], _slice(gates, slice(0, c)),
                           w_on[:, :c], mem, w_cached[:, :c])
    y2, s2 = fam.scan_soup(s1, q[:, c:], k[:, c:], v[:, c:], _slice(gates, slice(c, None)),
                           w_on[:, c:], mem, w_cached[:, c:])
    assert _rel(torch.cat([y1, y2], dim=1) - q, y - q) <= TOL[dtype]
    _assert_states_close(s2, st, TOL[dtype])
    if N == 0:  # with w_on == 1 the soup is the plain scan
        y_one, _ = fam.scan_soup(state, q, k, v, gates, torch.ones_like(w_on), mem, w_cached)
        assert _rel(y_one - q, o_plain - q) <= TOL[dtype]


# --------------------------------------------------------------------------------------
# Against the reference oracle (docs/deep-memory.md)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("inner_chunk", [1, 4, 16], ids=lambda c: f"ic{c}")
@pytest.mark.parametrize("memory", MEMORIES)
def test_scan_matches_reference_none(memory: str, inner_chunk: int) -> None:
    gen = torch.Generator().manual_seed(21 + inner_chunk)
    dt, T = torch.float64, 21
    fam = _family(memory, inner_chunk)
    init = _init(dt, gen)
    state = fam.init_state(1, H, K, K, dtype=dt, device="cpu", init=init)
    q, k, v, gates = _inputs(memory, 1, T, dt, gen)
    o, _ = fam.scan(state, q, k, v, gates)
    ref = mc_deep(
        q[0], k[0], v[0], q[0], gates["eta"][0], init["w1"], init["w2"],
        gates["a"][0] if memory == "titans" else None,
        gates["m"][0] if memory == "titans" else None,
        memory=memory, variant="none", segment_len=inner_chunk, inner_chunk=inner_chunk,
    )
    assert _rel(o[0] - q[0], ref - q[0]) <= 1e-10


@pytest.mark.parametrize("mode", ["checkpoint", "independent"])
@pytest.mark.parametrize("variant", ["grm", "soup"])
@pytest.mark.parametrize("memory", MEMORIES)
def test_segments_match_reference(memory: str, variant: str, mode: str) -> None:
    """grm (scan + readout_mix) and soup (scan_soup) driven segment by segment as the MC layer
    would, against ``mc_deep``."""
    gen = torch.Generator().manual_seed(5)
    dt, T, C, ic = torch.float64, 13, 4, 2
    fam = _family(memory, ic)
    init = _init(dt, gen)
    q, k, v, gates = _inputs(memory, 1, T, dt, gen)
    u = torch.randn(1, T, H, K, generator=gen, dtype=dt)
    fresh = fam.init_state(1, H, K, K, dtype=dt, device="cpu", init=init)
    state, cached_w1, cached_w2, pooled, ys = fresh, [], [], [], []
    for s0 in range(0, T, C):
        sl = slice(s0, min(s0 + C, T))
        L = sl.stop - s0
        if mode == "independent":
            state = fresh
        counts = torch.arange(1, L + 1, dtype=dt)[None, :, None, None]
        p_on = k[:, sl].cumsum(dim=1) / counts  # (1, L, H, K)
        r_on = (u[:, sl] * p_on).sum(-1) / math.sqrt(K)  # (1, L, H)
        N = len(pooled)
        if N:
            p = torch.stack(pooled, dim=1)  # (1, N, H, K)
            r_c = torch.einsum("bthk,bnhk->btnh", u[:, sl], p) / math.sqrt(K)
        else:
            r_c = torch.zeros(1, L, 0, H, dtype=dt)
        w = torch.softmax(torch.cat([r_c, r_on[:, :, None]], dim=2), dim=2)  # (1, L, N+1, H)
        mem = {
            "W1": torch.stack(cached_w1, dim=1) if N else torch.zeros(1, 0, H, K, E, dtype=dt),
            "W2": torch.stack(cached_w2, dim=1) if N else torch.zeros(1, 0, H, E, K, dtype=dt),
        }
        g = _slice(gates, sl)
        if variant == "soup":
            y, state = fam.scan_soup(state, q[:, sl], k[:, sl], v[:, sl], g, w[:, :, N], mem,
                                     w[:, :, :N])
        else:
            o, state = fam.scan(state, q[:, sl], k[:, sl], v[:, sl], g)
            y = w[:, :, N, :, None] * o + fam.readout_mix(mem, q[:, sl], w[:, :, :N])
        ys.append(y)
        cached_w1.append(state["W1"])
        cached_w2.append(state["W2"])
        pooled.append(k[:, sl].mean(dim=1))
    ref = mc_deep(
        q[0], k[0], v[0], u[0], gates["eta"][0], init["w1"], init["w2"],
        gates["a"][0] if memory == "titans" else None,
        gates["m"][0] if memory == "titans" else None,
        memory=memory, variant=variant, segment_len=C, mode=mode, inner_chunk=ic,
    )
    assert _rel(torch.cat(ys, dim=1)[0], ref) <= 1e-10
