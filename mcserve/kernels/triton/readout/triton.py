"""Triton kernel: the cached-memory readout of a prefill chunk, fused (flash-style).

For a span of L tokens (segment-aligned, ``mc_chunk``'s padded layout) and N cached
checkpoints S_n ``(K, V)`` per head, every token reads y_t = Σ_n w[t, n]·S_nᵀ q_t over the
checkpoints it can see (n < n_carried + t // C; w is zero beyond). The torch form reads a tile
of checkpoints for a tile of tokens into a ``(tokens, checkpoints, V)`` temporary and weights it
after (``mc_chunk._readout_reads``), hundreds of megabytes through memory at 32K. Here one
program holds a tile of BT tokens' queries and a (BT, BV) accumulator on chip and walks the
checkpoints its last token sees: per checkpoint one ``(BT, K) @ (K, BV)`` product, scaled by
the tokens' weights and added in. Nothing but q, w, S and y touches memory.

Grid (B·H, ⌈L/BT⌉, ⌈V/BV⌉). Signature and result: ``mc_chunk._readout_blocks`` (the CPU form,
its twin).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mcserve.kernels.triton._jit import jitted
from mcserve.kernels.triton._launch import _pow2


def _readout_kernel(
    S_ptr, q_ptr, w_ptr, o_ptr,
    L, H, N, K, V, n_carried, C,
    sS_b, sS_n, sS_h, sS_k, sq_b, sq_t, sq_h, sw_b, sw_t, sw_h, so_b, so_t, so_h,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, F64: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    pt = tl.program_id(1).to(tl.int64)
    pv = tl.program_id(2)
    b = bh // H
    h = bh % H
    if F64:
        acc_t = tl.float64
    else:
        acc_t = tl.float32
    offs_t = pt * BT + tl.arange(0, BT)
    offs_k = tl.arange(0, BK)
    offs_v = pv * BV + tl.arange(0, BV)
    mt = offs_t < L
    mk = offs_k < K
    mv = offs_v < V
    qv = tl.load(q_ptr + b * sq_b + h * sq_h + offs_t[:, None] * sq_t + offs_k[None, :],
                 mask=mt[:, None] & mk[None, :], other=0.0).to(acc_t)  # (BT, BK)
    acc = tl.zeros([BT, BV], dtype=acc_t)
    # checkpoints the tile's last token sees; earlier tokens of the tile have w = 0 past theirs
    t_last = tl.minimum(L, (pt + 1) * BT) - 1
    n_vis = tl.minimum(N, n_carried + t_last // C)
    w_row = w_ptr + b * sw_b + h * sw_h + offs_t * sw_t  # (BT,) pointers to w[b, t, h, 0]
    S_head = S_ptr + b * sS_b + h * sS_h + offs_k[:, None] * sS_k + offs_v[None, :]
    for n in range(0, n_vis):
        Sn = tl.load(S_head + n * sS_n, mask=mk[:, None] & mv[None, :], other=0.0).to(acc_t)
        wn = tl.load(w_row + n, mask=mt, other=0.0).to(acc_t)  # (BT,)
        acc += wn[:, None] * tl.dot(qv, Sn, input_precision="ieee")  # (BT, BV)
    tl.store(o_ptr + b * so_b + h * so_h + offs_t[:, None] * so_t + offs_v[None, :],
             acc.to(o_ptr.dtype.element_ty), mask=mt[:, None] & mv[None, :])


def mc_chunk_readout(S: Tensor, q: Tensor, w: Tensor, n_carried: int, segment_len: int,
                     out: Tensor | None = None) -> Tensor:
    """Σ_n w[:, t, :, n] S_nᵀ q_t: S ``(B, N, H, K, V)``, q ``(B, L, H, K)``, w ``(B, L, H, N)``
    (zero where token t cannot see checkpoint n) → ``(B, L, H, V)`` (into ``out`` if given,
    every element written); token t sees checkpoints n < n_carried + t // segment_len."""
    B, L, H, K = q.shape
    N, V = S.shape[1], S.shape[-1]
    if S.shape != (B, N, H, K, V) or w.shape != (B, L, H, N):
        raise ValueError(f"mc_chunk_readout: S (B, N, H, K, V) = {tuple(S.shape)}, q (B, L, H, "
                         f"K) = {tuple(q.shape)} and w (B, L, H, N) = {tuple(w.shape)} disagree")
    if out is None:
        out = torch.empty(B, L, H, V, dtype=q.dtype, device=q.device)
    elif out.shape != (B, L, H, V) or out.stride(-1) != 1:
        raise ValueError(f"mc_chunk_readout: out must be (B, L, H, V) = {(B, L, H, V)} with a "
                         f"unit last stride, got {tuple(out.shape)}")
    if not (B and L and H and V):
        return out
    if not N:
        return out.zero_()
    S = S if S.stride(-1) == 1 else S.contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    BK, BV = _pow2(K, 16), min(64, _pow2(V, 16))
    BT = 64 if max(BK, BV) <= 64 else 32  # the (BT, BK) queries and (BT, BV) sums stay on chip
    grid = (B * H, triton.cdiv(L, BT), triton.cdiv(V, BV))
    jitted(_readout_kernel)[grid](
        S, q, w, out, L, H, N, K, V, n_carried, segment_len,
        S.stride(0), S.stride(1), S.stride(2), S.stride(3),
        q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        BT=BT, BK=BK, BV=BV, F64=q.dtype == torch.float64,
    )
    return out
