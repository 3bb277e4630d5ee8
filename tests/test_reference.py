"""Tests for the plain reference oracle ``mcserve.kernels.reference`` (docs/mc.md).

Layout:

1. ``segments`` helper.
2. Hand-computed cases (tiny T, H = 1, K = V = 2 or scalar deep memories), with the
   expected numbers written out in the test.
3. An independent implementation written differently (closed-form states per segment,
   a different segmentation routine, sort-based top-k, autograd gradients for the deep
   memories) compared with the oracle in float64 over every variant x mode.
4. Properties from the paper (collapses and equivalences).
5. Argument validation.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from mcserve.kernels.reference import mc_deep, mc_linear, segments

F64 = torch.float64
SQRT2 = math.sqrt(2.0)
E = math.e

VARIANT_MODES = [
    (variant, mode)
    for variant in ("none", "residual", "grm", "soup", "ssc", "loglinear", "post")
    for mode in ("checkpoint", "independent")
    if not (variant == "loglinear" and mode == "independent")
]
VM_IDS = [f"{variant}-{mode}" for variant, mode in VARIANT_MODES]
SEGMENTED = ("residual", "grm", "soup", "ssc", "post")


def t64(rows: list) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def rand_linear(T: int, H: int, K: int, V: int, *, gates: bool, seed: int) -> dict:
    """Random float64 inputs for mc_linear; gates a, b in (0.5, 1] when ``gates``."""
    g = torch.Generator().manual_seed(seed)
    out = {
        "q": torch.randn(T, H, K, generator=g, dtype=F64),
        "k": torch.randn(T, H, K, generator=g, dtype=F64),
        "v": torch.randn(T, H, V, generator=g, dtype=F64),
        "u": torch.randn(T, H, K, generator=g, dtype=F64),
        "a": None,
        "b": None,
    }
    if gates:
        out["a"] = 0.5 + 0.5 * torch.rand(T, H, generator=g, dtype=F64)
        out["b"] = 0.5 + 0.5 * torch.rand(T, H, generator=g, dtype=F64)
    return out


def rand_deep(T: int, H: int, K: int, Ex: int, *, gates: bool, seed: int) -> dict:
    """Random float64 inputs for mc_deep (V = K, hidden size Ex)."""
    g = torch.Generator().manual_seed(seed)
    out = {
        "q": torch.randn(T, H, K, generator=g, dtype=F64),
        "k": torch.randn(T, H, K, generator=g, dtype=F64),
        "v": torch.randn(T, H, K, generator=g, dtype=F64),
        "u": torch.randn(T, H, K, generator=g, dtype=F64),
        "eta": 0.05 + 0.2 * torch.rand(T, H, generator=g, dtype=F64),
        "w1_init": 0.5 * torch.randn(H, K, Ex, generator=g, dtype=F64),
        "w2_init": 0.5 * torch.randn(H, Ex, K, generator=g, dtype=F64),
        "a": None,
        "m": None,
    }
    if gates:
        out["a"] = 0.8 + 0.2 * torch.rand(T, H, generator=g, dtype=F64)
        out["m"] = 0.6 * torch.rand(T, H, generator=g, dtype=F64)
    return out


def linear(x: dict, **kw) -> torch.Tensor:
    return mc_linear(x["q"], x["k"], x["v"], x["u"], x["a"], x["b"], **kw)


def deep(x: dict, **kw) -> torch.Tensor:
    return mc_deep(
        x["q"],
        x["k"],
        x["v"],
        x["u"],
        x["eta"],
        x["w1_init"],
        x["w2_init"],
        x["a"],
        x["m"],
        **kw,
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-10) -> None:
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


# ======================================================================================
# 1. segments
# ======================================================================================


@pytest.mark.parametrize(
    ("n", "c", "variant", "expected"),
    [
        (0, 4, "grm", []),
        (1, 4, "grm", [(0, 1)]),
        (4, 4, "grm", [(0, 4)]),
        (5, 4, "residual", [(0, 4), (4, 5)]),
        (8, 4, "ssc", [(0, 4), (4, 8)]),
        (9, 4, "post", [(0, 4), (4, 8), (8, 9)]),
        (3, 1, "soup", [(0, 1), (1, 2), (2, 3)]),
        (9, 4, "none", [(0, 9)]),
        (37, 4, "loglinear", [(0, 32), (32, 36), (36, 37)]),
        (32, 4, "loglinear", [(0, 32)]),
        (7, 1, "loglinear", [(0, 4), (4, 6), (6, 7)]),
        (1, 4, "loglinear", [(0, 1)]),
    ],
    ids=lambda p: str(p) if not isinstance(p, list) else "",
)
def test_segments(n: int, c: int, variant: str, expected: list) -> None:
    assert segments(n, c, variant) == expected


def test_segments_loglinear_count() -> None:
    for n in range(1, 130):
        segs = segments(n, 3, "loglinear")
        assert len(segs) == bin(n).count("1") <= int(math.log2(n)) + 1
        assert segs[-1][1] == n and segs[0][0] == 0
        assert all(e0 == s1 for (_, e0), (s1, _) in zip(segs, segs[1:]))


# ======================================================================================
# 2. Hand-computed cases
# ======================================================================================
#
# Linear, H = 1, K = V = 2, C = 2, T = 4, a = b = 1:
#   k = (1,0) (0,1) (1,1) (1,0)      v = (1,2) (3,0) (0,1) (2,2)
#   q = (1,0) (1,1) (0,1) (1,2)      u = sqrt2 * [(0,0) (0,0) (1,1) (2,-2)]
# A single outer product reads out as (k v^T)^T q = v <k, q>.
#  n=1: one segment, y = v1 <k1,q1> = (1,2) for every variant.
#  n=2: one segment, y = v1*1 + v2*1 = (4,2).
#  n=3: segments (0,2],(2,3]. M1(q3) = v2 = (3,0); the new term v3 <k3,q3> = (0,1).
#       checkpoint online = (3,1), independent online = (0,1).
#       p1 = (.5,.5), p2 = (1,1), r = (1, 2)  ->  g1 = 1/(1+e), g2 = e/(1+e).
#  n=4: segments (0,2],(2,4]. M1(q4) = v1*1 + v2*2 = (7,2); v3 <k3,q4> = (0,3);
#       v4 <k4,q4> = (2,2); checkpoint online = (9,7), independent online = (2,5).
#       p1 = (.5,.5), p2 = (1,.5), r = (0, 1)  ->  g1 = 1/(1+e), g2 = e/(1+e).

G1 = 1 / (1 + E)
G2 = E / (1 + E)

HAND_LINEAR = {
    ("none", "checkpoint"): [(1, 2), (4, 2), (3, 1), (9, 7)],
    ("none", "independent"): [(1, 2), (4, 2), (3, 1), (9, 7)],
    ("residual", "checkpoint"): [(1, 2), (4, 2), (6, 1), (16, 9)],
    ("residual", "independent"): [(1, 2), (4, 2), (3, 1), (9, 7)],
    ("post", "checkpoint"): [(1, 2), (4, 2), (3, 0.5), (8, 4.5)],
    ("post", "independent"): [(1, 2), (4, 2), (1.5, 0.5), (4.5, 3.5)],
    ("grm", "checkpoint"): [(1, 2), (4, 2), (3, G2), (7 * G1 + 9 * G2, 2 * G1 + 7 * G2)],
    ("grm", "independent"): [(1, 2), (4, 2), (3 * G1, G2), (7 * G1 + 2 * G2, 2 * G1 + 5 * G2)],
    # one cached segment <= top_k: ssc selects it, so it equals grm
    ("ssc", "checkpoint"): [(1, 2), (4, 2), (3, G2), (7 * G1 + 9 * G2, 2 * G1 + 7 * G2)],
    ("soup", "independent"): [(1, 2), (4, 2), (3 * G1, G2), (7 * G1 + 2 * G2, 2 * G1 + 5 * G2)],
    # loglinear: n=3 -> (0,2],(2,3] as grm checkpoint; n=4 -> one segment (0,4] = none
    ("loglinear", "checkpoint"): [(1, 2), (4, 2), (3, G2), (9, 7)],
}


def hand_linear_inputs() -> dict:
    return {
        "q": t64([[[1, 0]], [[1, 1]], [[0, 1]], [[1, 2]]]),
        "k": t64([[[1, 0]], [[0, 1]], [[1, 1]], [[1, 0]]]),
        "v": t64([[[1, 2]], [[3, 0]], [[0, 1]], [[2, 2]]]),
        "u": SQRT2 * t64([[[0, 0]], [[0, 0]], [[1, 1]], [[2, -2]]]),
        "a": None,
        "b": None,
    }


@pytest.mark.parametrize(
    ("variant", "mode"), list(HAND_LINEAR), ids=[f"{v}-{m}" for v, m in HAND_LINEAR]
)
def test_hand_linear(variant: str, mode: str) -> None:
    y = linear(hand_linear_inputs(), variant=variant, segment_len=2, mode=mode, top_k=1)
    assert_close(y, t64(HAND_LINEAR[(variant, mode)])[:, None, :])


def test_hand_linear_gated_none() -> None:
    # S1 = b1 k1 v1^T; S2 = a2 S1 + b2 k2 v2^T with a2 = 0.5, b1 = 2, b2 = 0.25:
    # y2 = a2 b1 v1 <k1,q2> + b2 v2 <k2,q2> = 0.5*2*(1,2) + 0.25*(3,0) = (1.75, 2).
    x = hand_linear_inputs()
    x["a"] = t64([[1.0], [0.5], [1.0], [1.0]])
    x["b"] = t64([[2.0], [0.25], [1.0], [1.0]])
    y = linear(x, variant="none", segment_len=2)
    assert_close(y[:2, 0], t64([(2, 4), (1.75, 2)]))


# ssc with C = 1 in independent mode: memory i is k_i v_i^T and reads v_i <k_i, q>.
#   v = (1,0) (0,1) (1,1), q3 = (1,1), u3 = sqrt2 * (1,0), top_k = 1, n = 3.
#   tie:    k = (1,0) (1,0) (0,1): r = (1, 1, 0); the tie picks the more recent
#           segment 2, gamma over {2, 3} = softmax(1, 0): y3 = G2*(0,1) + G1*(1,1).
#   no tie: k = (2,0) (1,0) (0,1): r = (2, 1, 0); segment 1 wins, M1(q3) = 2*v1:
#           gamma over {1, 3} = softmax(2, 0): y3 = H1*(2,0) + H3*(1,1).
H1 = E**2 / (1 + E**2)
H3 = 1 / (1 + E**2)


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ([(1, 0), (1, 0), (0, 1)], (G1, G2 + G1)),
        ([(2, 0), (1, 0), (0, 1)], (2 * H1 + H3, H3)),
    ],
    ids=["tie-picks-recent", "no-tie"],
)
def test_hand_ssc_selection(keys: list, expected: tuple) -> None:
    q = t64([[[1, 0]], [[0, 1]], [[1, 1]]])
    k = t64([[list(kk)] for kk in keys])
    v = t64([[[1, 0]], [[0, 1]], [[1, 1]]])
    u = SQRT2 * t64([[[0, 0]], [[0, 0]], [[1, 0]]])
    y = mc_linear(q, k, v, u, variant="ssc", segment_len=1, mode="independent", top_k=1)
    assert_close(y[2, 0], t64(expected))


def _phi(z: float) -> float:  # standard normal density
    return math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


def _cdf(z: float) -> float:  # standard normal CDF
    return 0.5 * (1 + math.erf(z / SQRT2))


def _gelu(z: float) -> float:
    return z * _cdf(z)


def _scalar_deep(k: list, v: list, q: list, eta: list, a=None, m=None) -> dict:
    """H = 1, K = V = E = 1 deep inputs; W1_init = 1, W2_init = 0."""
    col = lambda xs: t64([[[x]] for x in xs])  # noqa: E731
    return {
        "q": col(q),
        "k": col(k),
        "v": col(v),
        "u": col([0.0] * len(k)),
        "eta": t64([[e] for e in eta]),
        "w1_init": t64([[[1.0]]]),
        "w2_init": t64([[[0.0]]]),
        "a": None if a is None else t64([[x] for x in a]),
        "m": None if m is None else t64([[x] for x in m]),
    }


def test_hand_dla_inner_chunk_1() -> None:
    # M(x) = x + w1 gelu(w2 x), L = <M(k), v>, z = w2 k:
    #   dL/dw1 = v gelu(z),  dL/dw2 = w1 v gelu'(z) k,  gelu'(z) = Phi(z) + z phi(z).
    # token 1 (k=1, v=2, eta=.5) at (w1, w2) = (1, 0): z = 0, gelu(0) = 0, gelu'(0) = .5
    #   -> grads (0, 1*2*.5*1 = 1) -> (w1, w2) = (1, .5); y1 = 1 + 1*gelu(.5 * 1).
    # token 2 (k=2, v=-1, eta=.25) at (1, .5): z = 1
    #   -> grads (-Phi(1), -2 (Phi(1) + phi(1)))
    #   -> w1 = 1 - .25 Phi(1), w2 = .5 - .5 (Phi(1) + phi(1)); y2 = 1 + w1 gelu(w2 * 1).
    x = _scalar_deep(k=[1, 2], v=[2, -1], q=[1, 1], eta=[0.5, 0.25])
    y = deep(x, memory="dla", variant="none", segment_len=1, inner_chunk=1)
    w1 = 1 - 0.25 * _cdf(1)
    w2 = 0.5 - 0.5 * (_cdf(1) + _phi(1))
    assert_close(y[:, 0, 0], t64([1 + _gelu(0.5), 1 + w1 * _gelu(w2)]))


def test_hand_titans_inner_chunk_2() -> None:
    # L = (M(k) - v)^2, dL/dM = 2 (M(k) - v) =: g; grads (g gelu(z), w1 g gelu'(z) k).
    # One inner chunk of 2 tokens: both gradients at W0 = (1, 0), where z = 0.
    # token 1 (k=1, v=2, eta=.5, a=1, m=0): M = 1, g = -2 -> grads (0, -1)
    #   Sigma1 = -.5 * (0, -1) = (0, .5); W = 1 * (1, 0) + Sigma1 = (1, .5)
    # token 2 (k=2, v=-1, eta=.25, a=.5, m=.5) at W0: M = 2, g = 6 -> grads (0, 6)
    #   Sigma2 = .5 * (0, .5) - .25 * (0, 6) = (0, -1.25)
    #   W = .5 * (1, .5) + Sigma2 = (.5, -1)
    # y1 = 1 + 1 * gelu(.5), y2 = 1 + .5 * gelu(-1).
    x = _scalar_deep(k=[1, 2], v=[2, -1], q=[1, 1], eta=[0.5, 0.25], a=[1, 0.5], m=[0, 0.5])
    y = deep(x, memory="titans", variant="none", segment_len=2, inner_chunk=2)
    assert_close(y[:, 0, 0], t64([1 + _gelu(0.5), 1 + 0.5 * _gelu(-1.0)]))
    # inner_chunk = 1 takes token 2's gradient at (1, .5) instead, which differs
    y1 = deep(x, memory="titans", variant="none", segment_len=2, inner_chunk=1)
    assert abs(y1[1, 0, 0].item() - y[1, 0, 0].item()) > 1e-3


# ======================================================================================
# 3. An independent implementation, written differently
# ======================================================================================


def ref_segments(n: int, c: int, variant: str) -> list[tuple[int, int]]:
    """Segments of position n, computed differently from the module's helper."""
    if variant == "none":
        return [(0, n)]
    if variant == "loglinear":
        lengths = [1 << bit for bit in reversed(range(n.bit_length())) if (n >> bit) & 1]
        ends = [sum(lengths[: i + 1]) for i in range(len(lengths))]
        return list(zip([0] + ends[:-1], ends))
    starts = list(range(0, n, c))
    return list(zip(starts, starts[1:] + [n]))


def ref_mix(variant: str, r: torch.Tensor, top_k: int) -> torch.Tensor:
    """Weights [H, s] from scores [H, s] (last column = online)."""
    H, s = r.shape
    if variant == "residual":
        return torch.ones(H, s, dtype=r.dtype)
    if variant == "post":
        return torch.ones(H, s, dtype=r.dtype) / s
    if variant != "ssc":
        return torch.softmax(r, -1)
    # ssc: masked softmax; cached scores are sorted most-recent-first with a stable sort
    # so that, among equal scores, the more recent segment comes first.
    keep = torch.zeros(H, s, dtype=torch.bool)
    keep[:, -1] = True
    recent_first = r[:, :-1].flip(-1)
    order = torch.argsort(recent_first, dim=-1, descending=True, stable=True)[:, :top_k]
    keep[torch.arange(H)[:, None], (s - 2) - order] = True
    return torch.softmax(r.masked_fill(~keep, -math.inf), -1)


def ref_linear_memory(x: dict, lo: int, hi: int) -> torch.Tensor:
    """Closed form of the linear state over rows lo..hi-1 from zero, [H, K, V]:
    sum_j (prod_{l=j+1}^{hi-1} a_l) b_j k_j v_j^T."""
    T, H, _ = x["k"].shape
    a = x["a"] if x["a"] is not None else torch.ones(T, H, dtype=F64)
    b = x["b"] if x["b"] is not None else torch.ones(T, H, dtype=F64)
    total = torch.zeros(H, x["k"].shape[2], x["v"].shape[2], dtype=F64)
    for j in range(lo, hi):
        decay = torch.prod(a[j + 1 : hi], dim=0)  # [H] (ones when empty)
        total += (decay * b[j])[:, None, None] * torch.einsum("hk,hv->hkv", x["k"][j], x["v"][j])
    return total


def ref_mc_linear(x: dict, variant: str, c: int, mode: str, top_k: int = 2) -> torch.Tensor:
    """Materialise every memory each token reads, then aggregate."""
    T, H, K = x["q"].shape
    ys = []
    for t in range(T):
        n, qt = t + 1, x["q"][t]
        segs = ref_segments(n, c, variant)
        independent = mode == "independent" and variant != "none"
        mems = [ref_linear_memory(x, lo if independent else 0, hi) for lo, hi in segs]
        pools = torch.stack([x["k"][lo:hi].sum(0) / (hi - lo) for lo, hi in segs], 1)
        r = (pools * x["u"][t][:, None, :]).sum(-1) / K**0.5
        w = ref_mix(variant, r, top_k)
        if variant == "soup":
            mixed = sum(w[:, i, None, None] * mem for i, mem in enumerate(mems))
            ys.append((mixed * qt[:, :, None]).sum(1))
        else:
            reads = [(mem * qt[:, :, None]).sum(1) for mem in mems]  # M_i(q_t), [H, V]
            ys.append(sum(w[:, i, None] * rd for i, rd in enumerate(reads)))
    return torch.stack(ys) if ys else torch.zeros(0, H, x["v"].shape[2], dtype=F64)


C = 3
T_VALUES = [1, C - 1, C, C + 1, 5 * C + 3]


@pytest.mark.parametrize("gates", [False, True], ids=["ungated", "gated"])
@pytest.mark.parametrize("T", T_VALUES, ids=[f"T{t}" for t in T_VALUES])
@pytest.mark.parametrize(("variant", "mode"), VARIANT_MODES, ids=VM_IDS)
def test_linear_matches_independent_impl(variant: str, mode: str, T: int, gates: bool) -> None:
    x = rand_linear(T, 2, 3, 4, gates=gates, seed=T)
    y = linear(x, variant=variant, segment_len=C, mode=mode, top_k=2)
    assert y.shape == (T, 2, 4) and y.dtype == F64
    assert_close(y, ref_mc_linear(x, variant, C, mode, top_k=2))


@pytest.mark.parametrize("top_k", [1, 3], ids=["top1", "top3"])
@pytest.mark.parametrize("mode", ["checkpoint", "independent"])
def test_ssc_long_matches_independent_impl(mode: str, top_k: int) -> None:
    x = rand_linear(14, 3, 2, 2, gates=True, seed=7)
    y = linear(x, variant="ssc", segment_len=2, mode=mode, top_k=top_k)
    assert_close(y, ref_mc_linear(x, "ssc", 2, mode, top_k=top_k))


def test_loglinear_long_matches_independent_impl() -> None:
    x = rand_linear(38, 2, 2, 2, gates=True, seed=3)
    y = linear(x, variant="loglinear", segment_len=5)
    assert_close(y, ref_mc_linear(x, "loglinear", 5, "checkpoint"))


# ---- deep memories: per-token loop with autograd gradients at chunk-start weights ----


def ref_deep_step(memory: str, w1, w2, k, v):
    """Autograd gradient of the inner objective at (w1, w2) for one token, all heads."""
    with torch.enable_grad():
        w1 = w1.detach().clone().requires_grad_(True)
        w2 = w2.detach().clone().requires_grad_(True)
        out = ref_deep_read(w1, w2, k)
        if memory == "dla":
            loss = (out * v).sum()
        else:
            loss = ((out - v) ** 2).sum()
        g1, g2 = torch.autograd.grad(loss, (w1, w2))
    return g1, g2


def ref_deep_read(w1, w2, x):
    """x + W1 gelu(W2 x) with torch's exact GELU; w1 [H,V,E], w2 [H,E,K], x [H,K]."""
    hidden = F.gelu(torch.bmm(w2, x[:, :, None]))
    return x + torch.bmm(w1, hidden)[:, :, 0]


def ref_deep_memory(x: dict, memory: str, lo: int, hi: int, chunk: int):
    """Weights after rows lo..hi-1 starting from W_init (momentum 0); inner chunks of
    `chunk` rows start at lo, and each chunk's gradients use the chunk-start weights."""
    T, H, _ = x["k"].shape
    a = x["a"] if x["a"] is not None else torch.ones(T, H, dtype=F64)
    m = x["m"] if x["m"] is not None else torch.zeros(T, H, dtype=F64)
    w = [x["w1_init"], x["w2_init"]]
    mom = [torch.zeros_like(w[0]), torch.zeros_like(w[1])]
    for chunk_lo in range(lo, hi, chunk):
        w0 = list(w)
        for j in range(chunk_lo, min(chunk_lo + chunk, hi)):
            grads = ref_deep_step(memory, w0[0], w0[1], x["k"][j], x["v"][j])
            lr = x["eta"][j][:, None, None]
            for p in range(2):
                if memory == "dla":
                    w[p] = w[p] + lr * grads[p]
                else:
                    mom[p] = m[j][:, None, None] * mom[p] - lr * grads[p]
                    w[p] = a[j][:, None, None] * w[p] + mom[p]
    return w


def ref_mc_deep(
    x: dict, memory: str, variant: str, c: int, mode: str, chunk: int, top_k: int = 2
) -> torch.Tensor:
    T, H, K = x["q"].shape
    cache: dict = {}

    def memory_of(lo: int, hi: int):
        if (lo, hi) not in cache:
            cache[(lo, hi)] = ref_deep_memory(x, memory, lo, hi, chunk)
        return cache[(lo, hi)]

    ys = []
    for t in range(T):
        qt = x["q"][t]
        segs = ref_segments(t + 1, c, variant)
        independent = mode == "independent" and variant != "none"
        mems = [memory_of(lo if independent else 0, hi) for lo, hi in segs]
        pools = torch.stack([x["k"][lo:hi].mean(0) for lo, hi in segs], 1)
        r = torch.einsum("hsk,hk->hs", pools, x["u"][t]) / math.sqrt(K)
        w = ref_mix(variant, r, top_k)
        if variant == "soup":
            w1 = sum(w[:, i, None, None] * mem[0] for i, mem in enumerate(mems))
            w2 = sum(w[:, i, None, None] * mem[1] for i, mem in enumerate(mems))
            ys.append(ref_deep_read(w1, w2, qt))
        else:
            reads = [ref_deep_read(mem[0], mem[1], qt) for mem in mems]
            ys.append(sum(w[:, i, None] * rd for i, rd in enumerate(reads)))
    return torch.stack(ys)


@pytest.mark.parametrize("chunk", [1, 2], ids=["ic1", "ic2"])
@pytest.mark.parametrize(("variant", "mode"), VARIANT_MODES, ids=VM_IDS)
@pytest.mark.parametrize("memory", ["dla", "titans"])
def test_deep_matches_independent_impl(memory: str, variant: str, mode: str, chunk: int) -> None:
    T = 9  # segments of 4: two full ones and a partial one; loglinear reaches 8 and 9
    x = rand_deep(T, 2, 2, 3, gates=memory == "titans", seed=11)
    y = deep(x, memory=memory, variant=variant, segment_len=4, mode=mode, inner_chunk=chunk)
    assert y.shape == (T, 2, 2) and y.dtype == F64
    assert_close(y, ref_mc_deep(x, memory, variant, 4, mode, chunk))


@pytest.mark.parametrize("memory", ["dla", "titans"])
def test_deep_inner_chunk_changes_result(memory: str) -> None:
    x = rand_deep(8, 2, 2, 3, gates=True, seed=5)
    y1 = deep(x, memory=memory, variant="none", segment_len=4, inner_chunk=1)
    y4 = deep(x, memory=memory, variant="none", segment_len=4, inner_chunk=4)
    # the first token of every inner chunk is unaffected; later tokens differ
    assert_close(y1[0], y4[0])
    assert not torch.allclose(y1[1:4], y4[1:4], atol=1e-6)
    assert_close(y4, ref_mc_deep(x, memory, "none", 4, "checkpoint", 4))


def test_deep_inner_chunks_restart_at_segments_in_independent_mode() -> None:
    # segment_len 4, inner_chunk 2: in independent mode the second segment's first token
    # takes its gradient at W_init (a fresh chunk at a fresh memory).
    x = rand_deep(6, 1, 2, 3, gates=False, seed=2)
    y = deep(x, memory="dla", variant="residual", segment_len=4, mode="independent", inner_chunk=2)
    w = ref_deep_memory(x, "dla", 4, 5, 2)
    w_first = ref_deep_memory(x, "dla", 0, 4, 2)
    expected = ref_deep_read(*w_first, x["q"][4]) + ref_deep_read(*w, x["q"][4])
    assert_close(y[4], expected)


def test_titans_plain_gradient_descent() -> None:
    # a = 1, m = 0: W <- W - eta * grad ||M_W(k) - v||^2, one token at a time.
    x = rand_deep(7, 2, 3, 4, gates=False, seed=9)
    x["a"] = torch.ones(7, 2, dtype=F64)
    x["m"] = torch.zeros(7, 2, dtype=F64)
    y = deep(x, memory="titans", variant="none", segment_len=1)
    w1, w2 = x["w1_init"], x["w2_init"]
    ys = []
    for t in range(7):
        g1, g2 = ref_deep_step("titans", w1, w2, x["k"][t], x["v"][t])
        lr = x["eta"][t][:, None, None]
        w1, w2 = w1 - lr * g1, w2 - lr * g2
        ys.append(ref_deep_read(w1, w2, x["q"][t]))
    assert_close(y, torch.stack(ys))
    # and None for a / m means exactly that
    x["a"], x["m"] = None, None
    assert_close(deep(x, memory="titans", variant="none", segment_len=1), y)


def test_dla_ignores_titans_gates() -> None:
    x = rand_deep(5, 2, 2, 3, gates=True, seed=4)
    y = deep(x, memory="dla", variant="grm", segment_len=2)
    x["a"], x["m"] = None, None
    assert_close(deep(x, memory="dla", variant="grm", segment_len=2), y)


# ======================================================================================
# 4. Paper properties
# ======================================================================================


@pytest.mark.parametrize("mode", ["checkpoint", "independent"])
@pytest.mark.parametrize("variant", SEGMENTED)
def test_one_segment_equals_none_linear(variant: str, mode: str) -> None:
    x = rand_linear(7, 2, 3, 3, gates=True, seed=1)
    y_none = linear(x, variant="none", segment_len=1)
    for c in (7, 10):
        assert_close(linear(x, variant=variant, segment_len=c, mode=mode), y_none)


@pytest.mark.parametrize("mode", ["checkpoint", "independent"])
@pytest.mark.parametrize("variant", SEGMENTED)
def test_one_segment_equals_none_deep(variant: str, mode: str) -> None:
    x = rand_deep(5, 2, 2, 3, gates=True, seed=1)
    y_none = deep(x, memory="titans", variant="none", segment_len=1)
    y = deep(x, memory="titans", variant=variant, segment_len=6, mode=mode)
    assert_close(y, y_none)


@pytest.mark.parametrize("mode", ["checkpoint", "independent"])
def test_ssc_with_large_top_k_equals_grm(mode: str) -> None:
    x = rand_linear(11, 2, 3, 2, gates=True, seed=2)
    y_grm = linear(x, variant="grm", segment_len=2, mode=mode)
    for top_k in (5, 6, 100):  # s - 1 <= 5 for T = 11, C = 2
        assert_close(linear(x, variant="ssc", segment_len=2, mode=mode, top_k=top_k), y_grm)
    # fewer selected segments than available gives something else
    y_k1 = linear(x, variant="ssc", segment_len=2, mode=mode, top_k=1)
    assert not torch.allclose(y_k1[4:], y_grm[4:], atol=1e-6)
    xd = rand_deep(6, 2, 2, 3, gates=False, seed=2)
    kw = {"memory": "dla", "segment_len": 2, "mode": mode}
    assert_close(deep(xd, variant="ssc", top_k=2, **kw), deep(xd, variant="grm", **kw))


@pytest.mark.parametrize("mode", ["checkpoint", "independent"])
def test_soup_equals_grm_for_linear(mode: str) -> None:
    x = rand_linear(10, 2, 3, 4, gates=True, seed=3)
    assert_close(
        linear(x, variant="soup", segment_len=3, mode=mode),
        linear(x, variant="grm", segment_len=3, mode=mode),
    )


@pytest.mark.parametrize("mode", ["checkpoint", "independent"])
@pytest.mark.parametrize("memory", ["dla", "titans"])
def test_soup_differs_from_grm_for_deep(memory: str, mode: str) -> None:
    x = rand_deep(6, 2, 2, 3, gates=True, seed=3)
    kw = {"memory": memory, "segment_len": 2, "mode": mode}
    y_soup, y_grm = deep(x, variant="soup", **kw), deep(x, variant="grm", **kw)
    assert_close(y_soup[:2], y_grm[:2])  # one segment: nothing to mix
    assert not torch.allclose(y_soup[2:], y_grm[2:], atol=1e-6)


@pytest.mark.parametrize("variant", ["grm", "soup", "ssc"])
def test_segment_len_1_independent_is_softmax_attention(variant: str) -> None:
    # Memory i is k_i v_i^T, read out v_i <k_i, q_t>; p_i = k_i. So
    #   y_t = sum_{i<=t} softmax_i(<u_t, k_i> / sqrt(K)) <k_i, q_t> v_i.
    T, H, K, V = 8, 2, 4, 3
    x = rand_linear(T, H, K, V, gates=False, seed=4)
    y = linear(x, variant=variant, segment_len=1, mode="independent", top_k=T)
    q, k, v, u = x["q"], x["k"], x["v"], x["u"]
    scores = torch.einsum("thd,shd->hts", u, k) / math.sqrt(K)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    attn = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1)  # [H, T, S]
    kq = torch.einsum("thd,shd->hts", q, k)  # <k_s, q_t>
    expected = torch.einsum("hts,shv->thv", attn * kq, v)
    assert_close(y, expected)


def test_segment_len_1_independent_post_is_mean() -> None:
    T, H, K, V = 6, 2, 3, 2
    x = rand_linear(T, H, K, V, gates=False, seed=5)
    y = linear(x, variant="post", segment_len=1, mode="independent")
    kq = torch.einsum("thd,shd->hts", x["q"], x["k"]).tril()
    counts = torch.arange(1, T + 1, dtype=F64)[None, :, None]
    assert_close(y, torch.einsum("hts,shv->thv", kq / counts, x["v"]))


@pytest.mark.parametrize("variant", ["residual", "post"])
@pytest.mark.parametrize("mode", ["checkpoint", "independent"])
def test_residual_and_post_collapse_to_one_state(mode: str, variant: str) -> None:
    # For a linear memory, residual = (sum of cached states + online state)^T q and
    # post = that / s: one summed state plus a count, updated at segment boundaries.
    T, H, K, V, c = 13, 2, 3, 2, 3
    x = rand_linear(T, H, K, V, gates=True, seed=6)
    y = linear(x, variant=variant, segment_len=c, mode=mode)
    state = torch.zeros(H, K, V, dtype=F64)
    cached_sum = torch.zeros(H, K, V, dtype=F64)
    n_cached = 0
    for t in range(T):
        if t > 0 and t % c == 0:  # the previous segment is complete: cache it
            cached_sum, n_cached = cached_sum + state, n_cached + 1
            if mode == "independent":
                state = torch.zeros_like(state)
        outer = torch.einsum("hk,hv->hkv", x["k"][t], x["v"][t])
        state = x["a"][t][:, None, None] * state + x["b"][t][:, None, None] * outer
        out = torch.einsum("hkv,hk->hv", cached_sum + state, x["q"][t])
        if variant == "post":
            out = out / (n_cached + 1)
        assert_close(y[t], out)


def test_residual_independent_ungated_equals_none() -> None:
    # with a = b = 1 the independent segment states sum to the full state
    x = rand_linear(10, 2, 3, 3, gates=False, seed=8)
    assert_close(
        linear(x, variant="residual", segment_len=3, mode="independent"),
        linear(x, variant="none", segment_len=3),
    )


def test_loglinear_structure() -> None:
    T = 33
    x = rand_linear(T, 2, 3, 2, gates=True, seed=9)
    y_log = linear(x, variant="loglinear", segment_len=4)
    y_none = linear(x, variant="none", segment_len=4)
    # n a power of two: a single segment, i.e. the plain recurrence
    for n in (1, 2, 4, 8, 16, 32):
        assert_close(y_log[n - 1], y_none[n - 1])
    # n = 2^j - 1: j segments of lengths 2^(j-1), ..., 1, checkpoints at the prefix sums
    n, K = 15, 3
    bounds = [(0, 8), (8, 12), (12, 14), (14, 15)]
    assert segments(n, 4, "loglinear") == bounds
    mems = [ref_linear_memory(x, 0, hi) for _, hi in bounds]
    pools = [x["k"][lo:hi].mean(0) for lo, hi in bounds]
    r = torch.stack([(x["u"][n - 1] * p).sum(-1) for p in pools], -1) / math.sqrt(K)
    gamma = torch.softmax(r, -1)
    expected = sum(
        gamma[:, i, None] * torch.einsum("hkv,hk->hv", mem, x["q"][n - 1])
        for i, mem in enumerate(mems)
    )
    assert_close(y_log[n - 1], expected)
    # segment_len does not matter for loglinear
    assert_close(linear(x, variant="loglinear", segment_len=1), y_log)


def test_modes_agree_when_one_segment_and_differ_otherwise() -> None:
    x = rand_linear(9, 2, 2, 2, gates=True, seed=10)
    for variant in SEGMENTED:
        kw = {"variant": variant, "segment_len": 9}
        assert_close(linear(x, mode="checkpoint", **kw), linear(x, mode="independent", **kw))
        kw = {"variant": variant, "segment_len": 3}
        y_c, y_i = linear(x, mode="checkpoint", **kw), linear(x, mode="independent", **kw)
        assert_close(y_c[:3], y_i[:3])
        assert not torch.allclose(y_c[3:], y_i[3:], atol=1e-6)


def test_none_ignores_segmentation_and_mode() -> None:
    x = rand_linear(7, 2, 2, 3, gates=True, seed=12)
    y = linear(x, variant="none", segment_len=1)
    assert_close(linear(x, variant="none", segment_len=3, mode="independent"), y)
    xd = rand_deep(5, 1, 2, 3, gates=True, seed=12)
    kw = {"memory": "titans", "variant": "none", "inner_chunk": 1}
    assert_close(deep(xd, segment_len=2, mode="independent", **kw), deep(xd, segment_len=4, **kw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_lower_precision_dtypes(dtype: torch.dtype) -> None:
    x = rand_linear(7, 2, 3, 3, gates=True, seed=13)
    y64 = linear(x, variant="ssc", segment_len=2, top_k=1)
    xl = {key: None if val is None else val.to(dtype) for key, val in x.items()}
    y = linear(xl, variant="ssc", segment_len=2, top_k=1)
    assert y.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(y.to(F64), y64, rtol=tol, atol=tol * y64.abs().max().item())
    xd = rand_deep(4, 1, 2, 3, gates=True, seed=13)
    yd64 = deep(xd, memory="titans", variant="soup", segment_len=2, inner_chunk=2)
    xdl = {key: None if val is None else val.to(dtype) for key, val in xd.items()}
    yd = deep(xdl, memory="titans", variant="soup", segment_len=2, inner_chunk=2)
    assert yd.dtype == dtype
    torch.testing.assert_close(yd.to(F64), yd64, rtol=tol, atol=tol)


def test_empty_sequence() -> None:
    x = rand_linear(0, 2, 3, 4, gates=True, seed=0)
    assert linear(x, variant="grm", segment_len=2).shape == (0, 2, 4)
    xd = rand_deep(0, 2, 3, 4, gates=True, seed=0)
    assert deep(xd, memory="dla", variant="grm", segment_len=2).shape == (0, 2, 3)


def test_inference_mode_is_fine() -> None:
    x = rand_deep(4, 1, 2, 3, gates=True, seed=14)
    y = deep(x, memory="titans", variant="grm", segment_len=2)
    with torch.inference_mode():
        assert_close(deep(x, memory="titans", variant="grm", segment_len=2), y)


# ======================================================================================
# 5. Argument validation
# ======================================================================================


def _bad_linear_cases() -> list:
    good = rand_linear(4, 2, 3, 2, gates=True, seed=0)
    kw = {"variant": "grm", "segment_len": 2}

    def case(arg: str, inputs: dict | None = None, **overrides):
        return (arg, {**good, **(inputs or {})}, {**kw, **overrides})

    return [
        case("variant", variant="gated"),
        case("mode", mode="parallel"),
        case("mode", variant="loglinear", mode="independent"),
        case("segment_len", segment_len=0),
        case("segment_len", segment_len=2.0),
        case("top_k", variant="ssc", top_k=0),
        case("q", {"q": good["q"][0]}),
        case("q", {"q": good["q"].to(torch.int64)}),
        case("k", {"k": good["k"][:, :, :2]}),
        case("k", {"k": good["k"].float()}),
        case("v", {"v": good["v"][:3]}),
        case("u", {"u": good["u"][:, :1]}),
        case("a", {"a": good["a"][:, :, None]}),
        case("b", {"b": good["b"][:2]}),
    ]


BAD_LINEAR = _bad_linear_cases()


@pytest.mark.parametrize(
    ("arg", "inputs", "kw"), BAD_LINEAR, ids=[f"{i}-{c[0]}" for i, c in enumerate(BAD_LINEAR)]
)
def test_bad_linear_arguments(arg: str, inputs: dict, kw: dict) -> None:
    with pytest.raises(ValueError, match=rf"^{re.escape(arg)}\b"):
        linear(inputs, **kw)


def _bad_deep_cases() -> list:
    good = rand_deep(4, 2, 3, 5, gates=True, seed=0)
    kw = {"memory": "titans", "variant": "grm", "segment_len": 2, "inner_chunk": 1}

    def case(arg: str, inputs: dict | None = None, **overrides):
        return (arg, {**good, **(inputs or {})}, {**kw, **overrides})

    return [
        case("memory", memory="linear"),
        case("variant", variant="gated"),
        case("mode", variant="loglinear", mode="independent"),
        case("segment_len", segment_len=-1),
        case("top_k", variant="ssc", top_k=0),
        case("inner_chunk", inner_chunk=0),
        case("segment_len", segment_len=3, inner_chunk=2),  # not a multiple
        case("v", {"v": torch.zeros(4, 2, 4, dtype=F64)}),  # V != K
        case("eta", {"eta": good["eta"][:, :1]}),
        case("w1_init", {"w1_init": good["w1_init"][:1]}),
        case("w2_init", {"w2_init": good["w2_init"][:, :4]}),
        case("a", {"a": good["a"][:3]}),
        case("m", {"m": good["m"].float()}),
    ]


BAD_DEEP = _bad_deep_cases()


@pytest.mark.parametrize(
    ("arg", "inputs", "kw"), BAD_DEEP, ids=[f"{i}-{c[0]}" for i, c in enumerate(BAD_DEEP)]
)
def test_bad_deep_arguments(arg: str, inputs: dict, kw: dict) -> None:
    with pytest.raises(ValueError, match=rf"^{re.escape(arg)}\b"):
        deep(inputs, **kw)


@pytest.mark.parametrize(
    ("args", "arg"),
    [((-1, 2, "grm"), "n"), ((3, 0, "grm"), "segment_len"), ((3, 2, "sum"), "variant")],
    ids=["n", "segment_len", "variant"],
)
def test_bad_segments_arguments(args: tuple, arg: str) -> None:
    with pytest.raises(ValueError, match=rf"^{arg}\b"):
        segments(*args)
