"""The loglinear span path of the linear family (``MCMemory.forward_loglinear_linear``).

It must equal the per-token loop (``loglinear_fast = False``) and the oracle
``reference.mc_linear(variant="loglinear")`` in its outputs, leave exactly the loop's state
(cached stack, online segment, position) so that later spans and decode continue identically,
and carry gradients like the loop (experiments/recall/mqar.py trains through it).
"""

import random

import pytest
import torch

import mcserve.models.mc_loglinear as mc_log
from mcserve.config import MCConfig
from mcserve.kernels import reference
from mcserve.models.mc import MCMemory
from mcserve.models.mc_state import MCLayerState
from mcserve.models.memory.deep import DLAMemory
from mcserve.models.memory.linear import LinearMemory, SWLAMemory

DTYPES = [pytest.param(torch.float64, 1e-10, id="f64"), pytest.param(torch.float32, 1e-4, id="f32")]
LENGTHS = [1, 2, 3, 7, 64, 100, 257]  # 257 spans five chunks of _LOG_CHUNK = 64
H, K, V = 3, 5, 4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _mc() -> MCMemory:
    return MCMemory(LinearMemory(), MCConfig(variant="loglinear"))


def _inputs(B, T, dtype, seed, gated, decay_scale=1.0):
    """q, k, v, u ``(B, T, H, ·)`` and gates as the model passes them (log of a, and b)."""
    g = torch.Generator().manual_seed(seed)
    q, k, u = (torch.randn(B, T, H, K, generator=g, dtype=dtype) for _ in range(3))
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    if not gated:
        return q, k, v, u, None, None
    a = 0.5 + 0.5 * torch.rand(B, T, H, generator=g, dtype=dtype)
    b = torch.rand(B, T, H, generator=g, dtype=dtype)
    return q, k, v, u, a.log() * decay_scale, b


def _gates(log_a, b, sl=slice(None)):
    out = {}
    if log_a is not None:
        out["log_a"] = log_a[:, sl]
    if b is not None:
        out["b"] = b[:, sl]
    return out


def _loop(mc: MCMemory, st: MCLayerState, q, k, v, u, gates):
    """The per-token twin, whatever the span length."""
    mc.loglinear_fast = False
    try:
        return mc.forward(st, q, k, v, u, gates)
    finally:
        mc.loglinear_fast = True


def _assert_same_state(a: MCLayerState, b: MCLayerState, tol: float) -> None:
    assert (a.pos, a.seg_len, a.n_segments) == (b.pos, b.seg_len, b.n_segments)
    assert a.cached_pos == b.cached_pos == mc_log.log_boundaries(a.pos)
    assert a.cached_len == b.cached_len
    assert a.num_cached == b.num_cached
    assert _rel(a.mem["S"], b.mem["S"]) < tol
    assert _rel(a.seg_ksum, b.seg_ksum) < tol
    if a.num_cached:
        assert _rel(a.cached["S"], b.cached["S"]) < tol
        assert _rel(a.cached_ksum, b.cached_ksum) < tol


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("T", LENGTHS, ids=[f"T{t}" for t in LENGTHS])
def test_fast_matches_loop_and_reference(T, gated, dtype, tol):
    B = 2
    q, k, v, u, log_a, b = _inputs(B, T, dtype, seed=T, gated=gated)
    mc = _mc()
    st0 = mc.init_state(B, H, K, V, dtype=dtype, device="cpu")
    y_fast, st_fast = mc.forward_loglinear_linear(st0, q, k, v, u, _gates(log_a, b))
    y_loop, st_loop = _loop(mc, st0, q, k, v, u, _gates(log_a, b))
    assert y_fast.shape == y_loop.shape == (B, T, H, V)
    assert _rel(y_fast, y_loop) < tol
    _assert_same_state(st_fast, st_loop, tol)
    assert st0.pos == 0 and st0.num_cached == 0  # the input state is left alone
    for i in range(B):
        a_i = None if log_a is None else log_a[i].exp()
        b_i = None if b is None else b[i]
        y_ref = reference.mc_linear(q[i], k[i], v[i], u[i], a_i, b_i, variant="loglinear",
                                    segment_len=4)
        assert _rel(y_fast[i], y_ref) < tol


@pytest.mark.parametrize("chunk", [1, 3, 5, 16])
def test_odd_chunk_sizes(chunk, monkeypatch):
    # chunks that end off powers of two carry long stacks and segments that straddle the chunk
    # start into every chunk
    monkeypatch.setattr(mc_log, "_LOG_CHUNK", chunk)
    q, k, v, u, log_a, b = _inputs(2, 77, torch.float64, seed=chunk, gated=True)
    mc = _mc()
    st0 = mc.init_state(2, H, K, V, dtype=torch.float64, device="cpu")
    y_fast, st_fast = mc.forward_loglinear_linear(st0, q, k, v, u, _gates(log_a, b))
    y_loop, st_loop = _loop(mc, st0, q, k, v, u, _gates(log_a, b))
    assert _rel(y_fast, y_loop) < 1e-10
    _assert_same_state(st_fast, st_loop, 1e-10)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_split_invariance(seed, dtype, tol):
    # whole sequence == prefill in random pieces (each piece by the fast path, the loop, or the
    # forward dispatch) then token-by-token decode; the states agree after every piece
    B, T, n_pre = 2, 150, 120
    q, k, v, u, log_a, b = _inputs(B, T, dtype, seed=10 + seed, gated=seed != 2)
    mc = _mc()
    st0 = mc.init_state(B, H, K, V, dtype=dtype, device="cpu")
    y_full, st_full = mc.forward(st0, q, k, v, u, _gates(log_a, b))
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, n_pre), 6)) + [n_pre] + list(range(n_pre + 1, T + 1))
    st, prev, ys = st0, 0, []
    for i, c in enumerate(cuts):
        sl = slice(prev, c)
        args = (q[:, sl], k[:, sl], v[:, sl], u[:, sl], _gates(log_a, b, sl))
        how = i % 3
        if how == 0:
            y, st_next = mc.forward_loglinear_linear(st, *args)
        elif how == 1:
            y, st_next = _loop(mc, st, *args)
        else:
            y, st_next = mc.forward(st, *args)
        # the same piece by the other path, from the same state, gives the same state
        _, st_twin = (_loop(mc, st, *args) if how == 0 else
                      mc.forward_loglinear_linear(st, *args))
        _assert_same_state(st_next, st_twin, tol)
        st = st_next
        ys.append(y)
        prev = c
    assert _rel(torch.cat(ys, 1), y_full) < tol
    _assert_same_state(st, st_full, tol)


def test_two_continuations_share_the_stack():
    # the fast path writes new checkpoints into the shared append-only stack: a second
    # continuation of the same state must not see the first one's blocks
    q, k, v, u, log_a, b = _inputs(1, 90, torch.float64, seed=5, gated=True)
    q2, k2, v2, u2, log_a2, b2 = _inputs(1, 40, torch.float64, seed=6, gated=True)
    mc = _mc()
    st0 = mc.init_state(1, H, K, V, dtype=torch.float64, device="cpu")
    with torch.no_grad():
        _, st = mc.forward(st0, q[:, :50], k[:, :50], v[:, :50], u[:, :50],
                           _gates(log_a, b, slice(0, 50)))
        sl = slice(50, 90)
        y_a, _ = mc.forward(st, q[:, sl], k[:, sl], v[:, sl], u[:, sl], _gates(log_a, b, sl))
        y_b, _ = mc.forward(st, q2, k2, v2, u2, _gates(log_a2, b2))
        y_a2, _ = mc.forward(st, q[:, sl], k[:, sl], v[:, sl], u[:, sl], _gates(log_a, b, sl))
        y_b_loop, _ = _loop(mc, st, q2, k2, v2, u2, _gates(log_a2, b2))
    assert _rel(y_a2, y_a) < 1e-12
    assert _rel(y_b, y_b_loop) < 1e-10


@pytest.mark.parametrize("prefix", [0, 37])
def test_gradients_match_loop(prefix):
    # float64 grads of every input, through the outputs and the returned state, from a fresh
    # state and from a state with a non-empty cached stack (prefix run without grad)
    B, T = 2, 100
    q, k, v, u, log_a, b = _inputs(B, prefix + T, torch.float64, seed=prefix, gated=True)
    mc = _mc()
    st0 = mc.init_state(B, H, K, V, dtype=torch.float64, device="cpu")
    if prefix:
        with torch.no_grad():
            _, st0 = mc.forward(st0, q[:, :prefix], k[:, :prefix], v[:, :prefix],
                                u[:, :prefix], _gates(log_a, b, slice(0, prefix)))
        assert st0.num_cached > 0
    sl = slice(prefix, None)
    leaves = [x[:, sl].clone().requires_grad_(True) for x in (q, k, v, u, log_a, b)]
    g = torch.Generator().manual_seed(1)
    w_y = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    w_s = torch.randn(B, H, K, V, generator=g, dtype=torch.float64)

    def grads(fast: bool) -> list[torch.Tensor]:
        qq, kk, vv, uu, la, bb = leaves
        if fast:
            y, st = mc.forward_loglinear_linear(st0, qq, kk, vv, uu, {"log_a": la, "b": bb})
        else:
            y, st = _loop(mc, st0, qq, kk, vv, uu, {"log_a": la, "b": bb})
        loss = (y * w_y).sum() + (st.mem["S"] * w_s).sum() + st.cached["S"].square().sum() \
            + st.cached_ksum.sum() + st.seg_ksum.square().sum()
        return torch.autograd.grad(loss, leaves)

    for gf, gl in zip(grads(True), grads(False), strict=True):
        assert torch.isfinite(gf).all()
        assert _rel(gf, gl) < 1e-8


def test_strong_decay_stays_finite():
    # Mamba2-like gates: log a down to -30 a token; exponents of later-minus-earlier sums would
    # overflow if they were ever formed unmasked
    B, T = 1, 130
    q, k, v, u, log_a, b = _inputs(B, T, torch.float64, seed=9, gated=True, decay_scale=60.0)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, u, log_a, b)]
    mc = _mc()
    st0 = mc.init_state(B, H, K, V, dtype=torch.float64, device="cpu")
    qq, kk, vv, uu, la, bb = leaves
    y, _ = mc.forward_loglinear_linear(st0, qq, kk, vv, uu, {"log_a": la, "b": bb})
    with torch.no_grad():
        y_loop, _ = _loop(mc, st0, q, k, v, u, _gates(log_a, b))
    assert _rel(y, y_loop) < 1e-10
    y.square().sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in leaves)


def test_only_the_linear_family_takes_the_span_path():
    assert _mc().loglinear_fast
    assert not MCMemory(LinearMemory(), MCConfig(variant="grm")).loglinear_fast
    assert not MCMemory(SWLAMemory(), MCConfig(variant="loglinear")).loglinear_fast
    assert not MCMemory(DLAMemory(2), MCConfig(variant="loglinear", segment_len=4)).loglinear_fast
