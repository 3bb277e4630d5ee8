"""Triton kernel: MC decode readout over a paged block pool, one launch (``impl="single"``).

One program per (row, head, V tile). It scores the row's cached blocks from their key sums
(``ksum_pool``, read through the block table), forms the gates (softmax / top-k + softmax /
uniform / ones), and accumulates y = γ_on·o_online + Σ_i γ_i·S_iᵀq reading each needed state
block once, in place, from ``pool_S``. For ``ssc`` only the ``top_k`` selected blocks are read.
The ssc router (``ssc_router/triton.py``) is the same kernel stopped after the selection
(``ROUTE_ONLY``).

Signature and semantics are those of the torch twin, ``twin.paged_mc_decode_linear_torch``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mcserve.kernels.triton._jit import jitted
from mcserve.kernels.triton._launch import _last_contig, _pow2, _variant_code
from mcserve.kernels.triton.common import check_decode_args


def _paged_decode_kernel(
    q_ptr, u_ptr, oon_ptr, pon_ptr, tab_ptr, stab_ptr, S_ptr, ks_ptr, nseg_ptr, krow_ptr, y_ptr,
    idx_ptr, sc_ptr,
    N, K, V, C,
    sq_b, sq_h, su_b, su_h, so_b, so_h, sp_b, sp_h,
    st_b, st_h, st_n, ss_b, ss_h, ss_n,
    sS_n, sS_h, sS_k, sk_n, sk_h, sy_b, sy_h, si_b, si_h,
    VARIANT: tl.constexpr, TOP_K: tl.constexpr, HAS_NSEG: tl.constexpr, HAS_KROW: tl.constexpr,
    ROUTE_ONLY: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    F64: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    pv = tl.program_id(2)
    if F64:
        acc_t = tl.float64
    else:
        acc_t = tl.float32
    offs_n = tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    offs_v = pv * BV + tl.arange(0, BV)
    mn = offs_n < N
    mk = offs_k < K
    mv = offs_v < V
    ids = tl.load(tab_ptr + b * st_b + h * st_h + offs_n * st_n, mask=mn, other=-1).to(tl.int64)
    valid = ids >= 0
    neg_inf = float("-inf")

    # ---- gates g (per table column) and g_on
    g = tl.zeros([BN], dtype=acc_t)
    g_on = tl.sum(tl.zeros([1], dtype=acc_t), 0) + 1.0
    sel = offs_n < 0  # ssc: the selected columns
    if VARIANT >= 2:
        u = tl.load(u_ptr + b * su_b + h * su_h + offs_k, mask=mk, other=0.0).to(acc_t)
        ks = tl.load(ks_ptr + tl.where(valid, ids, 0)[:, None] * sk_n + h * sk_h
                     + offs_k[None, :], mask=valid[:, None] & mk[None, :], other=0.0).to(acc_t)
        # 1/(C·√K) in the accumulation dtype (host floats would arrive as fp32)
        denom = tl.sum(tl.sqrt(tl.zeros([1], dtype=acc_t) + K), 0) * C
        r = tl.sum(ks * u[None, :], 1) / denom
        use = valid
        if VARIANT == 3:
            if HAS_KROW:  # this row's own number of picks (≤ TOP_K)
                kb = tl.load(krow_ptr + b).to(tl.int32)
            else:
                kb = tl.sum(tl.zeros([1], dtype=tl.int32), 0) + TOP_K
            rem = valid
            for j in tl.static_range(TOP_K):
                m = tl.max(tl.where(rem, r, neg_inf), 0)
                ij = tl.max(tl.where(rem & (r == m), offs_n, -1), 0)  # ties: larger column
                ij = tl.where(kb > j, ij, -1)
                sel = sel | (offs_n == ij)
                rem = rem & (offs_n != ij)
                if ROUTE_ONLY:
                    tl.store(idx_ptr + b * si_b + h * si_h + j, ij.to(tl.int64))
                    tl.store(sc_ptr + b * si_b + h * si_h + j, tl.where(ij >= 0, m, neg_inf))
            use = sel
        if not ROUTE_ONLY:
            pon = tl.load(pon_ptr + b * sp_b + h * sp_h + offs_k, mask=mk, other=0.0).to(acc_t)
            r_on = tl.sum(u * pon, 0) * C / denom
            mx = tl.maximum(tl.max(tl.where(use, r, neg_inf), 0), r_on)
            e = tl.exp(tl.where(use, r - mx, neg_inf))
            e_on = tl.exp(r_on - mx)
            den = tl.sum(e, 0) + e_on
            g = e / den
            g_on = e_on / den
    elif VARIANT == 1:
        if HAS_NSEG:
            cnt = tl.load(nseg_ptr + b).to(acc_t)
        else:
            cnt = tl.sum(valid.to(acc_t), 0)
        g_on = 1.0 / (cnt + 1.0)
        g = tl.where(valid, g_on, 0.0)
    else:
        g = tl.where(valid, 1.0, 0.0).to(acc_t)

    # ---- readout
    if not ROUTE_ONLY:
        q = tl.load(q_ptr + b * sq_b + h * sq_h + offs_k, mask=mk, other=0.0).to(acc_t)
        acc = g_on * tl.load(oon_ptr + b * so_b + h * so_h + offs_v, mask=mv,
                             other=0.0).to(acc_t)
        mkv = mk[:, None] & mv[None, :]
        s_off = h * sS_h + offs_k[:, None] * sS_k + offs_v[None, :]
        if VARIANT == 3:
            rem2 = sel
            for _j in tl.static_range(TOP_K):
                ij = tl.max(tl.where(rem2, offs_n, -1), 0)
                rem2 = rem2 & (offs_n != ij)
                if ij >= 0:
                    gj = tl.sum(tl.where(offs_n == ij, g, 0.0), 0)
                    sid = tl.load(stab_ptr + b * ss_b + h * ss_h + ij * ss_n).to(tl.int64)
                    S = tl.load(S_ptr + sid * sS_n + s_off, mask=mkv, other=0.0).to(acc_t)
                    acc += gj * tl.sum(q[:, None] * S, 0)
        else:
            for n in range(0, N):
                tid = tl.load(tab_ptr + b * st_b + h * st_h + n * st_n)
                if tid >= 0:
                    gn = tl.sum(tl.where(offs_n == n, g, 0.0), 0)
                    sid = tl.load(stab_ptr + b * ss_b + h * ss_h + n * ss_n).to(tl.int64)
                    S = tl.load(S_ptr + sid * sS_n + s_off, mask=mkv, other=0.0).to(acc_t)
                    acc += gn * tl.sum(q[:, None] * S, 0)
        tl.store(y_ptr + b * sy_b + h * sy_h + offs_v, acc, mask=mv)




def paged_mc_decode_linear(
    q: Tensor, u: Tensor, o_online: Tensor, p_online: Tensor, table: Tensor, pool_S: Tensor,
    ksum_pool: Tensor, *, variant: str, segment_len: int, top_k: int = 2,
    n_seg: Tensor | None = None, state_table: Tensor | None = None, out: Tensor | None = None,
    row_top_k: Tensor | None = None, block_v: int | None = None,
) -> Tensor:
    """Triton twin of ``twin.paged_mc_decode_linear_torch`` (same signature and result).

    One launch, grid (B, H, ⌈V/BV⌉). ``block_v`` overrides the V tile (a power of two).
    """
    tab, stab = check_decode_args(q, u, o_online, p_online, table, pool_S, ksum_pool, variant,
                                  segment_len, top_k, n_seg, state_table, row_top_k)
    B, H, K = q.shape
    V = o_online.shape[-1]
    N = tab.shape[-1]
    q, u, o_online, p_online, ksum_pool = map(_last_contig, (q, u, o_online, p_online, ksum_pool))
    if pool_S.stride(-1) != 1:
        raise ValueError("pool_S must be contiguous in its last (V) dim")
    if out is None:
        out = torch.empty(B, H, V, dtype=q.dtype, device=q.device)
    elif out.shape != (B, H, V) or out.stride(-1) != 1:
        raise ValueError(f"out must be ({B}, {H}, {V}) with unit stride in V")
    if B == 0 or H == 0 or V == 0:
        return out
    BK = _pow2(K, 16)
    BV = block_v or min(_pow2(V, 16), 64)
    BN = _pow2(N)
    code = _variant_code(variant)
    nseg = n_seg if n_seg is not None else tab  # dummy pointers when absent
    krow = row_top_k if row_top_k is not None else tab
    grid = (B, H, triton.cdiv(V, BV))
    jitted(_paged_decode_kernel)[grid](
        q, u, o_online, p_online, tab, stab, pool_S, ksum_pool, nseg, krow, out, out, out,
        N, K, V, segment_len,
        q.stride(0), q.stride(1), u.stride(0), u.stride(1), o_online.stride(0),
        o_online.stride(1), p_online.stride(0), p_online.stride(1),
        tab.stride(0), tab.stride(1), tab.stride(2), stab.stride(0), stab.stride(1),
        stab.stride(2),
        pool_S.stride(0), pool_S.stride(1), pool_S.stride(2), ksum_pool.stride(0),
        ksum_pool.stride(1), out.stride(0), out.stride(1), 0, 0,
        VARIANT=code, TOP_K=top_k, HAS_NSEG=n_seg is not None,
        HAS_KROW=row_top_k is not None and code == 3, ROUTE_ONLY=False,
        BN=BN, BK=BK, BV=BV, F64=q.dtype == torch.float64,
    )
    return out
