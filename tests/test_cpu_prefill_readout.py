"""The C++ kernels of an MC prefill's cached readout and routing (``readout.cpp``,
``amx.cpp``, ``pairs.cpp``, ``lowp_ops.cpp``: the selection of picks, their softmax, the
bfloat16 layouts and readouts) against their torch twins."""

from __future__ import annotations

import pytest
import torch
from test_cpu_kernels import rel_err

from mcserve.kernels import cpu
from mcserve.kernels.cpu import twins

pytestmark = pytest.mark.skipif(
    cpu.ops() is None, reason=f"C++ CPU kernels unavailable: {cpu.status()}")


@pytest.mark.parametrize("R,N", [(1, 1), (37, 11), (5, 513)], ids=["one", "odd", "long"])
def test_topk_later_matches_twin(R, N):
    # the one-pass selection against the stable sort: same indices in the same order (largest
    # first, the later index first among equal values), with many ties and -inf entries
    g = torch.Generator().manual_seed(R * N)
    # integer scores (ties everywhere), then distinct ones, then normal ones (most entries below
    # the kernel's floor, k <= 16, and none past it for k > 16)
    for scale in (0.0, 1.0, None):
        r = (torch.randn(R, N, generator=g) if scale is None else torch.randint(
            0, 5, (R, N), generator=g).float() + scale * torch.rand(R, N, generator=g))
        r[: R // 2, N // 2:] = float("-inf")
        for k in sorted({1, min(3, N), min(8, N), min(16, N), min(17, N), N}):
            got = cpu.ops().topk_later(r, k)
            assert torch.equal(got, twins.topk_later(r, k)), (k, scale)
            assert torch.equal(cpu.topk_later(r, k), got)
    strided = torch.randn(N, 2 * R, generator=g).t()[::2]  # rows with a stride, not contiguous
    if N > 1:
        with pytest.raises(RuntimeError, match="unit column stride"):
            cpu.ops().topk_later(strided, 1)
    with pytest.raises(RuntimeError, match="k must be"):
        cpu.ops().topk_later(r, N + 1)
    with pytest.raises(ValueError, match="k must be"):
        twins.topk_later(r, 0)


@pytest.mark.parametrize("A,T,n,N,K,V", [(1, 1, 1, 1, 32, 16), (3, 17, 5, 7, 64, 64),
                                          (2, 33, 40, 45, 5, 80), (4, 70, 33, 33, 96, 48)],
                         ids=["one", "odd", "v80", "k96"])
def test_readout_bf16_matches_twin(A, T, n, N, K, V):
    """The bfloat16 cached readout of a prefill tile on AMX tiles against its twin: token tiles
    with a partial last one, more than one step of 32 checkpoints and a partial one, an odd
    number of 16-column groups (K = 5, V = 80), checkpoints beyond n ignored, o / w / q read
    through strides and only added into."""
    info = cpu.lowp_info()
    if not cpu.readout_bf16_fused(K, V):
        pytest.skip(f"needs a CPU with AMX-BF16 (here: {info.get('amx_note') or 'capped'})")
    g = torch.Generator().manual_seed(A * 100 + T + K)
    S32 = torch.randn(A, N, K, V, generator=g)
    S = twins.ckpt_pairs(S32)
    w = torch.rand(A, T + 2, n + 3, generator=g)[:, 1:T + 1, :n]
    q = torch.randn(A, T, K + 5, generator=g)[..., 5:]
    base = torch.randn(A, T + 1, V, generator=g)
    want = twins.readout_bf16_(base[:, 1:].clone(), w, q, S)
    got_base = base.clone()
    cpu.readout_bf16_(got_base[:, 1:], w, q, S)
    torch.testing.assert_close(got_base[:, 1:], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_base[:, 0], base[:, 0])  # the row before the view untouched
    # against float32 throughout: within bfloat16's rounding of w and S
    exact = base[:, 1:] + torch.einsum("atn,atk,ankv->atv", w, q, S32[:, :n])
    assert (got_base[:, 1:] - exact).abs().max() < 2e-2 * exact.abs().max()
    with pytest.raises(RuntimeError, match="V a multiple of 16"):
        cpu.ops().readout_bf16_amx_(base[:, 1:, :V - 1], w, q, S)
    with pytest.raises(RuntimeError, match="multiple of 16 holding"):
        cpu.ops().readout_bf16_amx_(base[:, 1:], w, q, S[:, :, :-1])


@pytest.mark.parametrize("A,T,n,K", [(1, 1, 1, 1), (3, 7, 5, 37), (4, 9, 16, 64), (2, 3, 2, 48)],
                         ids=["one", "odd", "readout", "k48"])
def test_outer_bf16_matches_twin(A, T, n, K):
    # the bfloat16 readout's weighted queries: w and q read through strides (slices of larger
    # tensors, as the readout's tiles are), every level this CPU runs bit-equal to the twin
    g = torch.Generator().manual_seed(A * 1000 + T * 10 + K)
    w = torch.rand(A, T + 3, n + 2, generator=g)[:, 1:T + 1, 2:]
    q = torch.randn(A, T + 2, K, generator=g)[:, 2:] * 3
    want = twins.outer_bf16_(torch.empty(A, T, n, K, dtype=torch.bfloat16), w, q)
    for level in range(int(cpu.lowp_info()["bf16_impl"]) + 1):
        got = torch.full((A, T, n, K), float("nan"), dtype=torch.bfloat16)
        cpu.ops().outer_bf16_(got, w, q, level)
        assert torch.equal(got, want), level
    got = cpu.outer_bf16_(torch.empty(A, T, n, K, dtype=torch.bfloat16), w, q)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        cpu.ops().outer_bf16_(torch.empty(A, T, n, K), w, q)



@pytest.mark.parametrize("B,n,H,K,V,off", [(1, 1, 1, 2, 8, 0), (2, 5, 3, 6, 24, 3),
                                            (1, 9, 4, 64, 64, 2), (2, 4, 2, 4, 4, 1)],
                         ids=["one", "odd", "prefill", "even-n-odd-offset"])
def test_ckpt_pairs_bf16_matches_twin(B, n, H, K, V, off):
    # checkpoints into the readout's layout against the twin bit for bit: src a slice of a
    # larger stack (as a span's new checkpoints are), written at an offset (odd ones share a pair
    # with the checkpoint before, which must stay); values at bfloat16's rounding ties, NaN, inf
    # and float's extremes
    g = torch.Generator().manual_seed(B * n * V + off)
    stack = torch.randn(B, n + 2, H, K, V, generator=g) * 100.0
    src = stack[:, 1:n + 1]
    flat = src[0, 0, 0].view(-1)
    specials = torch.tensor([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, float("nan"), float("inf"),
                             -float("inf"), 3.4e38, -3.4e38, 1e-45])[:flat.numel()]
    flat[:specials.numel()] = specials
    P = (off + n + 2) // 2 + 1
    fill = torch.randn(B, H, K * V // 16, P, 16, 2, generator=g).to(torch.bfloat16)
    got, want = fill.clone(), fill.clone()
    cpu.ckpt_pairs_bf16_(got, src, off)
    twins.ckpt_pairs_bf16_(want, src, off)
    nan = want.isnan()  # torch's NaN bits vary with its conversion path: NaN-ness only
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    j = torch.arange(2 * P)
    outside = (j < off) | (j >= off + n)  # the checkpoints not written keep their values
    assert torch.equal(got[:, :, :, j[outside] // 2, :, j[outside] % 2],
                       fill[:, :, :, j[outside] // 2, :, j[outside] % 2])
    with pytest.raises(RuntimeError, match="past 2P"):
        cpu.ops().ckpt_pairs_bf16_(got, src, 2 * P - n + 1)

@pytest.mark.parametrize("B,L,N,H,K,V,k", [(1, 1, 1, 1, 4, 4, 1), (2, 37, 9, 3, 5, 70, 3),
                                            (1, 600, 40, 4, 64, 64, 8), (3, 11, 6, 2, 8, 8, 6)],
                         ids=["one", "odd", "tiles", "all-picked"])
def test_readout_picks_matches_twin(B, L, N, H, K, V, k):
    # each token's picked checkpoints read out grouped by checkpoint against the embedding-bag
    # twin: q and idx as strided views, some weights zero (skipped), a V past one 64-column chunk
    g = torch.Generator().manual_seed(B * 1000 + L + N)
    S = torch.randn(B, N, H, K, V, generator=g)
    q = torch.randn(B, H, L, K, generator=g).transpose(1, 2)
    idx = torch.rand(B, L, H, N, generator=g).argsort(-1)[..., :k]
    w = torch.rand(B, L, H, k, generator=g)
    w[w < 0.2] = 0.0
    y = cpu.readout_picks(S, q, idx, w)
    assert y.shape == (B, L, H, V)
    assert rel_err(y, twins.readout_picks(S, q, idx, w)) < 1e-5
    # a token's sums do not depend on the other tokens of its tile
    t = L // 2
    y1 = cpu.readout_picks(S, q[:, t:t + 1], idx[:, t:t + 1], w[:, t:t + 1])
    assert torch.equal(y1, y[:, t:t + 1])
    bad = idx.clone()
    bad[0, 0, 0, 0] = N
    with pytest.raises(RuntimeError, match="outside"):
        cpu.readout_picks(S, q, bad, w)



@pytest.mark.parametrize("B,L,N,H,K,V,k", [(1, 1, 1, 1, 32, 16, 1), (2, 37, 9, 3, 64, 80, 3),
                                            (1, 1100, 40, 4, 64, 64, 8)],
                         ids=["one", "odd", "two-tiles"])
def test_readout_picks_bf16_matches_twin(B, L, N, H, K, V, k):
    # an ssc prefill's picks on AMX tiles against the twin (the same bfloat16 operands, float32
    # sums): q and idx as strided views, zero weights skipped, V past one 64-column pass, more
    # than 16 picks of a checkpoint and a token tile past 1024; the checkpoints from two parts
    # into the key pairs (as the cached and the span's new ones are)
    info = cpu.lowp_info()
    if not cpu.readout_bf16_fused(K, V):
        pytest.skip(f"needs a CPU with AMX-BF16 (here: {info.get('amx_note') or 'capped'})")
    g = torch.Generator().manual_seed(B * 1000 + L + N)
    S32 = torch.randn(B, N, H, K, V, generator=g)
    S = torch.empty(B, H, N, K // 2, V, 2, dtype=torch.bfloat16)
    cpu.key_pairs_bf16_(S, S32[:, :N // 2], 0)
    cpu.key_pairs_bf16_(S, S32[:, N // 2:], N // 2)
    want_S = twins.key_pairs_bf16_(torch.empty_like(S), S32, 0)
    assert torch.equal(S.view(torch.int16), want_S.view(torch.int16))
    q = torch.randn(B, H, L, K, generator=g).transpose(1, 2)
    idx = torch.rand(B, L, H, N, generator=g).argsort(-1)[..., :k]
    w = torch.rand(B, L, H, k, generator=g)
    w[w < 0.2] = 0.0
    y = cpu.readout_picks_bf16(S, q, idx, w)
    assert y.shape == (B, L, H, V)
    torch.testing.assert_close(y, twins.readout_picks_bf16(S, q, idx, w), rtol=1e-4, atol=1e-4)
    exact = twins.readout_picks(S32, q, idx, w)  # float32 throughout: within bfloat16's step
    assert (y - exact).abs().max() <= 2e-2 * exact.abs().max() + 1e-6
    base = torch.randn(B, L, H, V, generator=g)  # out: the sums added to what it holds
    acc = base.clone()
    assert cpu.readout_picks_bf16(S, q, idx, w, out=acc) is acc
    torch.testing.assert_close(acc, base + y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(twins.readout_picks_bf16(S, q, idx, w, out=base.clone()),
                               base + y, rtol=1e-4, atol=1e-4)
    bad = idx.clone()
    bad[0, 0, 0, 0] = N
    with pytest.raises(RuntimeError, match="outside"):
        cpu.ops().readout_picks_bf16_amx(S, q, bad, w)

@pytest.mark.parametrize("R,N,k", [(1, 1, 1), (37, 11, 3), (64, 256, 8), (9, 20, 8)],
                         ids=["one", "odd", "prefill", "few-visible"])
def test_select_softmax_matches_twin(R, N, k):
    # the fused routing of a prefill span against mask + topk_later + softmax: rows that see
    # none, fewer than k and all of their checkpoints; integer scores (ties everywhere); the
    # hidden entries hold garbage (NaN too) that must not matter
    g = torch.Generator().manual_seed(R * N + k)
    for scale in (0.0, 1.0):
        r = torch.randint(0, 5, (R, N), generator=g).float() + scale * torch.rand(R, N, generator=g)
        visible = torch.randint(0, N + 1, (R,), generator=g)
        visible[0] = N
        r[torch.arange(N)[None, :] >= visible[:, None]] = float("nan")
        r_on = torch.randn(R, generator=g)
        idx, w, w_on = cpu.select_softmax(r, visible, r_on, k)
        t_idx, t_w, t_on = twins.select_softmax(r, visible, r_on, k)
        seen = torch.arange(k)[None, :] < visible[:, None].clamp(max=k)
        assert torch.equal(idx[seen], t_idx[seen])  # the visible picks, in order
        assert torch.allclose(w, t_w, atol=1e-6) and torch.allclose(w_on, t_on, atol=1e-6)
        assert bool((w[~seen] == 0).all())
        assert torch.allclose(w.sum(1) + w_on, torch.ones(R))
    with pytest.raises(RuntimeError, match="visible"):
        cpu.ops().select_softmax(r, visible.int(), r_on, k)


@pytest.mark.parametrize("R,N", [(1, 1), (37, 11), (64, 256), (9, 45)],
                         ids=["one", "odd", "prefill", "partial-groups"])
def test_dense_softmax_matches_twin(R, N):
    # the dense routing of a prefill tile in place against mask + softmax: rows that see none,
    # some and all of their checkpoints, visible counts past N (clamped), scores far below the
    # row's max (weights that underflow to zero), a strided row view; hidden entries hold
    # garbage (NaN, inf) that must not matter and come back zero
    g = torch.Generator().manual_seed(R * 100 + N)
    base = torch.randn(R, N + 3, generator=g) * 30.0
    r = base[:, 1:N + 1]
    visible = torch.randint(0, N + 2, (R,), generator=g)
    visible[0] = N
    hidden = torch.arange(N)[None, :] >= visible[:, None]
    r[hidden] = float("nan")
    r[hidden & (torch.arange(N)[None, :] % 2 == 0)] = float("inf")
    r_on = torch.randn(R, generator=g) * 30.0
    outside = base[:, [0, N + 1, N + 2]].clone()  # the view's neighbours stay as they are
    want = r.clone()
    t_on = twins.dense_softmax_(want, visible, r_on)
    w_on = cpu.dense_softmax_(r, visible, r_on)
    assert torch.allclose(r, want, atol=1e-6, rtol=1e-5)
    assert torch.allclose(w_on, t_on, atol=1e-6, rtol=1e-5)
    assert bool((r[hidden] == 0).all()) and not bool(r.isnan().any())
    assert torch.allclose(r.sum(1) + w_on, torch.ones(R), atol=1e-5)
    assert torch.equal(base[:, [0, N + 1, N + 2]], outside)
    with pytest.raises(RuntimeError, match="visible"):
        cpu.ops().dense_softmax_(r, visible.int(), r_on)
