"""``kernels.mc_chunk``: MC over a whole prefill chunk against the oracle and its naive twin."""

from __future__ import annotations

import math

import pytest
import torch

from mcserve.config import MCConfig
from mcserve.kernels import cpu, mc_chunk, reference
from mcserve.kernels.cpu import twins
from mcserve.kernels.mc_chunk import mc_linear_chunk, mc_linear_chunk_naive

VARIANTS = ("grm", "soup", "ssc", "residual", "post")


def _inputs(B, T, H, K, V, gen, dtype=torch.float64):
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    q, k, u = r(B, T, H, K), r(B, T, H, K) / K ** 0.5, r(B, T, H, K)
    v = r(B, T, H, V)
    log_a = -torch.rand(B, T, H, generator=gen, dtype=dtype) * 0.3
    b = torch.rand(B, T, H, generator=gen, dtype=dtype)
    return q, k, v, u, log_a, b


def _empty(B, H, K, V, dtype=torch.float64):
    return dict(initial_state=torch.zeros(B, H, K, V, dtype=dtype),
                initial_ksum=torch.zeros(B, H, K, dtype=dtype), initial_fill=0,
                cached=torch.zeros(B, 0, H, K, V, dtype=dtype),
                cached_ksum=torch.zeros(B, 0, H, K, dtype=dtype), n_segments=0)


def _run_split(fn, q, k, v, u, log_a, b, cuts, *, variant, C, top_k, mode):
    """Feed the span in pieces, carrying the state the way the engine does between calls."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    st = _empty(B, H, K, V, q.dtype)
    ys, p = [], 0
    for e in list(cuts) + [T]:
        if e <= p:
            continue
        sl = slice(p, e)
        y, S, bs, bk = fn(q[:, sl], k[:, sl], v[:, sl], u[:, sl], log_a[:, sl], b[:, sl],
                          mc=MCConfig(variant=variant, segment_len=C, top_k=top_k, mode=mode),
                          **st)
        ys.append(y)
        fill = st["initial_fill"] + (e - p)
        ksum = st["initial_ksum"] + k[:, sl].sum(1) if fill < C else None
        n_new = bs.shape[1]
        if variant in ("residual", "post"):
            tot = st["cached"].sum(1) if st["cached"].shape[1] else torch.zeros_like(S)
            cached = (tot + bs.sum(1))[:, None] if n_new or st["cached"].shape[1] else st["cached"]
            cksum = torch.zeros(B, cached.shape[1], H, K, dtype=q.dtype)
        else:
            cached = torch.cat([st["cached"], bs], 1)
            cksum = torch.cat([st["cached_ksum"], bk], 1)
        fill %= C
        if n_new:
            ksum = k[:, e - fill:e].sum(1)
            if mode == "independent" and fill == 0:
                S = torch.zeros_like(S)
        st = dict(initial_state=S, initial_ksum=ksum, initial_fill=fill, cached=cached,
                  cached_ksum=cksum, n_segments=st["n_segments"] + n_new)
        p = e
    return torch.cat(ys, 1)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("mode", ["checkpoint", "independent"])
def test_chunk_equals_reference_whole_and_split(monkeypatch, variant, mode):
    monkeypatch.setattr(mc_chunk, "SPARSE_FACTOR", 1)  # ssc: the gathered picks
    gen = torch.Generator().manual_seed(hash((variant, mode)) % 2**31)
    B, T, H, K, V, C = 2, 53, 3, 4, 5, 8  # T not a multiple of C, several heads
    q, k, v, u, log_a, b = _inputs(B, T, H, K, V, gen)
    want = torch.stack([
        reference.mc_linear(q[i], k[i], v[i], u[i], log_a[i].exp(), b[i], variant=variant,
                            segment_len=C, top_k=2, mode=mode) for i in range(B)])
    whole = _run_split(mc_linear_chunk, q, k, v, u, log_a, b, [], variant=variant, C=C,
                       top_k=2, mode=mode)
    torch.testing.assert_close(whole, want, rtol=1e-10, atol=1e-10)
    for cuts in ([5, 8, 30], [1, 17, 40, 41], [16, 24]):  # inside, on and across boundaries
        got = _run_split(mc_linear_chunk, q, k, v, u, log_a, b, cuts, variant=variant, C=C,
                         top_k=2, mode=mode)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("variant,sparse", [("grm", 4), ("ssc", 1), ("ssc", 10**9),
                                            ("post", 4)])
def test_chunk_equals_naive_twin_from_a_carried_state(monkeypatch, variant, sparse):
    """Random carried state (online fill, key sums, cached checkpoints): fast == naive twin,
    float32, all four outputs; ssc through the gathered picks (their scores in tiles of 8 tokens,
    the last partial) and through the dense readout."""
    monkeypatch.setattr(mc_chunk, "SPARSE_FACTOR", sparse)
    monkeypatch.setattr(mc_chunk, "_SCORE_TILE", 8)
    gen = torch.Generator().manual_seed(7)
    B, T, H, K, V, C = 3, 37, 2, 8, 6, 16
    q, k, v, u, log_a, b = _inputs(B, T, H, K, V, gen, torch.float32)
    N = 1 if variant == "post" else 5
    st = dict(initial_state=torch.randn(B, H, K, V, generator=gen),
              initial_ksum=torch.randn(B, H, K, generator=gen), initial_fill=11,
              cached=torch.randn(B, N, H, K, V, generator=gen),
              cached_ksum=torch.randn(B, N, H, K, generator=gen) * 4, n_segments=5)
    for mode in ("checkpoint", "independent"):
        mc = MCConfig(variant=variant, segment_len=C, top_k=2, mode=mode)
        got = mc_linear_chunk(q, k, v, u, log_a, b, mc=mc, **st)
        want = mc_linear_chunk_naive(q, k, v, u, log_a, b, mc=mc, **st)
        for g, w in zip(got, want):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tile,tile_bytes", [(16, 3 * 8 * 2 * 16 * 6 * 4), (2048, 1 << 30)])
def test_chunk_gpu_tiling_equals_naive_twin(monkeypatch, tile, tile_bytes):
    """The GPU's large readout tiles (taken on the CPU here): several token tiles and
    checkpoint blocks of 3, or one tile holding everything; same results as the naive twin."""
    monkeypatch.setattr(mc_chunk, "_big_tiles", lambda x: True)
    monkeypatch.setattr(mc_chunk, "_GPU_TOKEN_TILE", tile)
    monkeypatch.setattr(mc_chunk, "_GPU_TILE_BYTES", tile_bytes)
    gen = torch.Generator().manual_seed(8)
    B, T, H, K, V, C = 2, 45, 2, 8, 6, 4
    q, k, v, u, log_a, b = _inputs(B, T, H, K, V, gen, torch.float32)
    st = dict(initial_state=torch.randn(B, H, K, V, generator=gen),
              initial_ksum=torch.randn(B, H, K, generator=gen), initial_fill=3,
              cached=torch.randn(B, 7, H, K, V, generator=gen),
              cached_ksum=torch.randn(B, 7, H, K, generator=gen) * 4, n_segments=7)
    mc = MCConfig(variant="grm", segment_len=C, top_k=2)
    got = mc_linear_chunk(q, k, v, u, log_a, b, mc=mc, **st)
    want = mc_linear_chunk_naive(q, k, v, u, log_a, b, mc=mc, **st)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_chunk_without_gates_and_single_token():
    gen = torch.Generator().manual_seed(3)
    B, H, K, V, C = 1, 2, 4, 4, 4
    q, k, v, u, _, _ = _inputs(B, 9, H, K, V, gen)
    want = reference.mc_linear(q[0], k[0], v[0], u[0], variant="grm", segment_len=C)
    got = _run_split(mc_linear_chunk, q, k, v, u, torch.zeros(B, 9, H, dtype=q.dtype),
                     torch.ones(B, 9, H, dtype=q.dtype), list(range(1, 9)), variant="grm", C=C,
                     top_k=2, mode="checkpoint")
    torch.testing.assert_close(got[0], want, rtol=1e-10, atol=1e-10)
    y, *_ = mc_linear_chunk(q, k, v, u, None, None, mc=MCConfig(variant="grm", segment_len=C),
                            **_empty(B, H, K, V))
    torch.testing.assert_close(y[0], want, rtol=1e-10, atol=1e-10)


def test_chunk_rejects_bad_arguments():
    gen = torch.Generator().manual_seed(0)
    q, k, v, u, log_a, b = _inputs(1, 4, 1, 2, 2, gen)
    st = _empty(1, 1, 2, 2)
    with pytest.raises(ValueError, match="constant segmentation"):
        mc_linear_chunk(q, k, v, u, log_a, b, mc=MCConfig(variant="none"), **st)
    with pytest.raises(ValueError, match="initial_fill"):
        mc_linear_chunk(q, k, v, u, log_a, b, mc=MCConfig(segment_len=4),
                        **{**st, "initial_fill": 4})
    with pytest.raises(ValueError, match="top_k"):
        mc_linear_chunk(q, k, v, u, log_a, b, mc=MCConfig(segment_len=4), top_k=0, **st)


@pytest.mark.parametrize("top_k", [1, 3, 5])
@pytest.mark.parametrize("select", ["cpu", "partial"])
def test_select_equals_the_stable_sort(top_k, select):
    """``_select`` (the CPU's one-pass selection, or topk then the stable sort only where a
    finite score ties at a row's threshold) picks what the stable sort picks: the same finite
    checkpoints, ties to the later one; among -inf scores any pick will do (zero weight)."""
    gen = torch.Generator().manual_seed(top_k)
    fn = mc_chunk._select if select == "cpu" else mc_chunk._select_partial
    for scale in (0.0, 1e6):  # integer scores (many ties), then almost surely none
        r = torch.randint(0, 4, (2, 19, 3, 11), generator=gen).float()
        r = r + scale * torch.rand(r.shape, generator=gen)
        r[:, :7, :, 6:] = float("-inf")  # early tokens see 6 checkpoints
        got = fn(r, top_k)
        want = twins.topk_later(r.reshape(-1, 11), top_k).view(2, 19, 3, top_k)
        assert got.shape == want.shape == (2, 19, 3, top_k)
        scores = r.reshape(-1, 11).tolist()

        def finite(idx, scores=scores):
            return [sorted(i for i in row if math.isfinite(s[i]))
                    for row, s in zip(idx.reshape(-1, top_k).tolist(), scores)]

        assert finite(got) == finite(want)
        assert torch.equal(r.gather(-1, got).sort(-1).values, r.gather(-1, want).sort(-1).values)


@pytest.mark.parametrize("variant", ["grm", "ssc"])
def test_chunk_cpu_tiling_equals_naive_twin(monkeypatch, variant):
    """The CPU readout (weights folded into the GEMM's left operand) over several token tiles,
    checkpoint blocks of 3 and a last partial tile and block; same results as the naive twin."""
    monkeypatch.setattr(mc_chunk, "_TOKEN_TILE", 16)
    monkeypatch.setattr(mc_chunk, "_X_BLOCK", 3)
    gen = torch.Generator().manual_seed(9)
    B, T, H, K, V, C = 2, 53, 3, 8, 5, 4
    q, k, v, u, log_a, b = _inputs(B, T, H, K, V, gen, torch.float64)
    st = dict(initial_state=torch.randn(B, H, K, V, generator=gen, dtype=torch.float64),
              initial_ksum=torch.randn(B, H, K, generator=gen, dtype=torch.float64),
              initial_fill=1,
              cached=torch.randn(B, 8, H, K, V, generator=gen, dtype=torch.float64),
              cached_ksum=torch.randn(B, 8, H, K, generator=gen, dtype=torch.float64) * 4,
              n_segments=8)
    mc = MCConfig(variant=variant, segment_len=C, top_k=40)  # ssc: dense (N < 4·top_k)
    got = mc_linear_chunk(q, k, v, u, log_a, b, mc=mc, **st)
    want = mc_linear_chunk_naive(q, k, v, u, log_a, b, mc=mc, **st)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("K,V", [(8, 5), (32, 16)], ids=["k8", "k32-amx"])
@pytest.mark.parametrize("variant,top_k", [("grm", 40), ("ssc", 40), ("ssc", 3)],
                         ids=["grm", "ssc-dense", "ssc-picks"])
def test_chunk_bf16_readout_matches_naive_twin(monkeypatch, variant, top_k, K, V):
    """``readout_dtype=bfloat16`` (the CPU's bfloat16 prefill): the cached readout's GEMMs read
    bfloat16 operands, so y moves by bfloat16 rounding (and does move: the path is taken) but
    stays within it of the float64 twin; the states and key sums are those of float32. K = 32,
    V = 16 take the AMX tiles' one pass where the CPU has them (for ``ssc`` with few picks, the
    picks' readout on them; elsewhere its picks stay float32)."""
    for tile, block in (("_TOKEN_TILE", "_X_BLOCK"), ("_AMX_TOKEN_TILE", "_AMX_X_BLOCK")):
        monkeypatch.setattr(mc_chunk, tile, 16)  # the tile sizes with and without AMX
        monkeypatch.setattr(mc_chunk, block, 3)
    monkeypatch.setattr(mc_chunk, "_SCORE_TILE", 16)  # ssc's picks: four tiles of scores
    gen = torch.Generator().manual_seed(11)
    B, T, H, C = 2, 61, 3, 4
    q, k, v, u, log_a, b = _inputs(B, T, H, K, V, gen, torch.float32)
    st = dict(initial_state=torch.randn(B, H, K, V, generator=gen),
              initial_ksum=torch.randn(B, H, K, generator=gen), initial_fill=2,
              cached=torch.randn(B, 9, H, K, V, generator=gen),
              cached_ksum=torch.randn(B, 9, H, K, generator=gen) * 4, n_segments=9)
    mc = MCConfig(variant=variant, segment_len=C, top_k=top_k)  # 40: dense (N < 2·top_k)
    low = mc_linear_chunk(q, k, v, u, log_a, b, mc=mc, readout_dtype=torch.bfloat16, **st)
    f32 = mc_linear_chunk(q, k, v, u, log_a, b, mc=mc, **st)
    d = lambda x: x.double()  # noqa: E731
    want = mc_linear_chunk_naive(*map(d, (q, k, v, u, log_a, b)), mc=mc,
                                 **{n: d(x) if torch.is_tensor(x) else x for n, x in st.items()})
    picks_f32 = top_k == 3 and not (K == 32 and cpu.readout_bf16_fused(K, V))
    assert torch.equal(low[0], f32[0]) == picks_f32
    err = (low[0].double() - want[0]).abs().max() / want[0].abs().max()
    assert err < 2e-2, err
    torch.testing.assert_close(f32[0].double(), want[0], rtol=1e-4, atol=1e-4)
    for g, w in zip(low[1:], f32[1:]):
        assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("n_carried, tile", [(0, 3), (0, 16), (5, 7)])
def test_readout_dense_matches_unfused_twin(monkeypatch, dtype, n_carried, tile):
    """The CPU's tiled dense readout (scores, softmax and weighted readout per tile of tokens)
    against its twin that builds the whole span's scores and weights: fresh random inputs,
    several heads, odd widths, tiles that see no checkpoint (tile < segment), partial tiles and
    blocks, checkpoints in two parts; every output row written (no NaN from the uninitialised
    result)."""
    monkeypatch.setattr(mc_chunk, "_TOKEN_TILE", tile)
    monkeypatch.setattr(mc_chunk, "_X_BLOCK", 3)
    gen = torch.Generator().manual_seed(17 + n_carried + tile)
    B, H, K, V, C, G = 2, 3, 8, 5, 4, 13
    L, N = G * C, n_carried + G - 1
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    S = (r(B, n_carried, H, K, V), r(B, G - 1, H, K, V))
    q, u, ksum = r(B, L, H, K), r(B, L, H, K), r(B, N, H, K) * 4
    r_on, o = r(B, L, H) * 3, r(B, L, H, V)
    got = mc_chunk._readout_dense(S, q, u, ksum, r_on, o, n_carried, C, dtype)
    want = mc_chunk._readout_dense_unfused(S, q, u, ksum, r_on, o, n_carried, C, dtype)
    assert got.shape == want.shape == (B, L, H, V)
    assert not got.isnan().any()
    tol = 1e-5 if dtype is None else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if n_carried == 0:  # the first segment's tokens see no checkpoint: the online term alone
        torch.testing.assert_close(got[:, :C], o[:, :C])


@pytest.mark.parametrize("mode", ["checkpoint", "independent"])
def test_chunk_gradients_match_naive_twin(mode):
    """Training backpropagates through the one-pass chunk (grm, carried checkpoints, a span
    crossing several boundaries): every input's gradient equals the per-token twin's."""
    gen = torch.Generator().manual_seed(5)
    B, T, H, K, V, C, N = 2, 19, 2, 4, 3, 4, 3
    q, k, v, u, log_a, b = _inputs(B, T, H, K, V, gen)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    st = dict(initial_state=r(B, H, K, V), initial_ksum=r(B, H, K), cached=r(B, N, H, K, V),
              cached_ksum=r(B, N, H, K))
    mc = MCConfig(variant="grm", segment_len=C, mode=mode)
    w = [r(B, T, H, V), r(B, H, K, V)]
    grads = []
    for fn in (mc_linear_chunk, mc_linear_chunk_naive):
        xs = [t.clone().requires_grad_() for t in (q, k, v, u, log_a, b)]
        sx = {n: t.clone().requires_grad_() for n, t in st.items()}
        y, final, _, _ = fn(*xs, mc=mc, initial_fill=1, n_segments=N, **sx)
        ((y * w[0]).sum() + (final * w[1]).sum()).backward()
        grads.append([t.grad for t in xs] + [sx[n].grad for n in st])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
