"""Triton kernels: the paged MC decode readout split over the cached blocks (flash-decoding).

At batch 1 the single-launch readout (``single.py``) has B·H·⌈V/BV⌉ programs, each walking
all N blocks of its row in turn: for N in the hundreds most of the GPU idles. Here the table's
columns are cut into splits of ``BN`` columns, two launches:

1. ``_split_partial_kernel``, grid (B·H, ⌈V/BV⌉, ⌈N/BN⌉): each program scores its split's
   blocks from the key sums and keeps, per split, the local maximum m_s of the scores, the local
   sum of exponentials l_s = Σ e^{r_i − m_s} and the partial readout Σ e^{r_i − m_s}·S_iᵀq
   (softmax variants); for the fixed-weight variants the plain sum Σ S_iᵀq and the count;
2. ``_split_merge_kernel``, grid (B·H, ⌈V/BV⌉): the log-sum-exp merge of the splits and the
   online memory: M = max(r_on, max_s m_s), y = (e^{r_on−M}·o_online + Σ_s e^{m_s−M}·acc_s) /
   (e^{r_on−M} + Σ_s e^{m_s−M}·l_s); the fixed weights as in the single kernel.

``ssc`` reads only its ``top_k`` picks, so it has nothing to split: it goes to the single
kernel. Signature and result are those of ``twin.paged_mc_decode_linear_torch``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mcserve.kernels.triton._jit import jitted
from mcserve.kernels.triton._launch import _last_contig, _pow2, _variant_code
from mcserve.kernels.triton.common import check_decode_args
from mcserve.kernels.triton.mc_decode.single import paged_mc_decode_linear as _single

#: programs below which a batch leaves the GPU mostly idle (about the SM count of current
#: cards): the split is worth its second launch only when B·H·⌈V/BV⌉ is well under this
SPLIT_MAX_PROGRAMS = 128
#: cached blocks from which a row's walk dominates the readout's time (tune on the GPU)
SPLIT_MIN_BLOCKS = 32


def _split_partial_kernel(
    q_ptr, u_ptr, tab_ptr, stab_ptr, S_ptr, ks_ptr, acc_ptr, m_ptr, l_ptr,
    H, N, K, V, C,
    sq_b, sq_h, su_b, su_h, st_b, st_h, st_n, ss_b, ss_h, ss_n,
    sS_n, sS_h, sS_k, sk_n, sk_h, sa_bh, sa_s, sm_bh,
    SOFTMAX: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    F64: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    pv = tl.program_id(1)
    sp = tl.program_id(2).to(tl.int64)
    b = bh // H
    h = bh % H
    if F64:
        acc_t = tl.float64
    else:
        acc_t = tl.float32
    offs_n = sp * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    offs_v = pv * BV + tl.arange(0, BV)
    mn = offs_n < N
    mk = offs_k < K
    mv = offs_v < V
    ids = tl.load(tab_ptr + b * st_b + h * st_h + offs_n * st_n, mask=mn, other=-1).to(tl.int64)
    valid = ids >= 0
    neg_inf = float("-inf")
    if SOFTMAX:
        u = tl.load(u_ptr + b * su_b + h * su_h + offs_k, mask=mk, other=0.0).to(acc_t)
        ks = tl.load(ks_ptr + tl.where(valid, ids, 0)[:, None] * sk_n + h * sk_h
                     + offs_k[None, :], mask=valid[:, None] & mk[None, :], other=0.0).to(acc_t)
        # 1/(C·√K) in the accumulation dtype (host floats would arrive as fp32)
        denom = tl.sum(tl.sqrt(tl.zeros([1], dtype=acc_t) + K), 0) * C
        r = tl.where(valid, tl.sum(ks * u[None, :], 1) / denom, neg_inf)
        m = tl.max(r, 0)
        # a split without blocks: m = -inf, weights 0 (exp(-inf − 0)), l = 0
        e = tl.exp(r - tl.where(m == neg_inf, 0.0, m))
        lsum = tl.sum(e, 0)
    else:
        e = tl.where(valid, 1.0, 0.0).to(acc_t)
        m = tl.sum(e, 0)  # the fixed weights need only the count
        lsum = m
    q = tl.load(q_ptr + b * sq_b + h * sq_h + offs_k, mask=mk, other=0.0).to(acc_t)
    acc = tl.zeros([BV], dtype=acc_t)
    mkv = mk[:, None] & mv[None, :]
    s_off = h * sS_h + offs_k[:, None] * sS_k + offs_v[None, :]
    lo = sp * BN
    for j in range(0, BN):
        n = lo + j
        if n < N:
            tid = tl.load(tab_ptr + b * st_b + h * st_h + n * st_n)
            if tid >= 0:
                wn = tl.sum(tl.where(offs_n == n, e, 0.0), 0)
                sid = tl.load(stab_ptr + b * ss_b + h * ss_h + n * ss_n).to(tl.int64)
                S = tl.load(S_ptr + sid * sS_n + s_off, mask=mkv, other=0.0).to(acc_t)
                acc += wn * tl.sum(q[:, None] * S, 0)
    tl.store(acc_ptr + bh * sa_bh + sp * sa_s + offs_v, acc, mask=mv)
    if pv == 0:
        tl.store(m_ptr + bh * sm_bh + sp, m)
        tl.store(l_ptr + bh * sm_bh + sp, lsum)


def _split_merge_kernel(
    u_ptr, oon_ptr, pon_ptr, nseg_ptr, acc_ptr, m_ptr, l_ptr, y_ptr,
    H, K, V, NS,
    su_b, su_h, so_b, so_h, sp_b, sp_h, sa_bh, sa_s, sm_bh, sy_b, sy_h,
    VARIANT: tl.constexpr, HAS_NSEG: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, F64: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    pv = tl.program_id(1)
    b = bh // H
    h = bh % H
    if F64:
        acc_t = tl.float64
    else:
        acc_t = tl.float32
    offs_s = tl.arange(0, BS)
    offs_k = tl.arange(0, BK)
    offs_v = pv * BV + tl.arange(0, BV)
    ms = offs_s < NS
    mk = offs_k < K
    mv = offs_v < V
    neg_inf = float("-inf")
    acc = tl.load(acc_ptr + bh * sa_bh + offs_s[:, None] * sa_s + offs_v[None, :],
                  mask=ms[:, None] & mv[None, :], other=0.0).to(acc_t)  # (BS, BV)
    o = tl.load(oon_ptr + b * so_b + h * so_h + offs_v, mask=mv, other=0.0).to(acc_t)
    if VARIANT == 2:
        m_s = tl.load(m_ptr + bh * sm_bh + offs_s, mask=ms, other=neg_inf).to(acc_t)
        l_s = tl.load(l_ptr + bh * sm_bh + offs_s, mask=ms, other=0.0).to(acc_t)
        u = tl.load(u_ptr + b * su_b + h * su_h + offs_k, mask=mk, other=0.0).to(acc_t)
        pon = tl.load(pon_ptr + b * sp_b + h * sp_h + offs_k, mask=mk, other=0.0).to(acc_t)
        r_on = tl.sum(u * pon, 0) / tl.sum(tl.sqrt(tl.zeros([1], dtype=acc_t) + K), 0)
        mx = tl.maximum(tl.max(m_s, 0), r_on)
        f = tl.exp(m_s - mx)  # 0 for splits without blocks
        e_on = tl.exp(r_on - mx)
        den = tl.sum(f * l_s, 0) + e_on
        y = (e_on * o + tl.sum(f[:, None] * acc, 0)) / den
    else:
        cached = tl.sum(acc, 0)
        if VARIANT == 1:
            if HAS_NSEG:
                cnt = tl.load(nseg_ptr + b).to(acc_t)
            else:
                cnt = tl.sum(tl.load(m_ptr + bh * sm_bh + offs_s, mask=ms,
                                     other=0.0).to(acc_t), 0)
            y = (o + cached) / (cnt + 1.0)
        else:
            y = o + cached
    tl.store(y_ptr + b * sy_b + h * sy_h + offs_v, y, mask=mv)


def split_blocks(B: int, H: int, V: int, N: int, block_v: int = 64) -> int:
    """Columns per split for a (B, H, V) batch over N table columns: enough splits to give
    about ``2·SPLIT_MAX_PROGRAMS`` programs, at least 8 blocks each (a power of two)."""
    progs = max(1, B * H * triton.cdiv(V, block_v))
    n_split = max(1, (2 * SPLIT_MAX_PROGRAMS) // progs)
    return _pow2(triton.cdiv(N, n_split), 8)


def use_split(B: int, H: int, V: int, N: int, variant: str, block_v: int = 64) -> bool:
    """The shape heuristic of ``dispatch.paged_mc_decode_linear``: split over N when the batch
    gives few programs and the rows have many blocks (no data is read: shapes only)."""
    if _variant_code(variant) == 3:  # ssc reads top_k blocks: nothing to split
        return False
    return (B * H * triton.cdiv(V, block_v) < SPLIT_MAX_PROGRAMS and N >= SPLIT_MIN_BLOCKS)


def paged_mc_decode_linear_split(
    q: Tensor, u: Tensor, o_online: Tensor, p_online: Tensor, table: Tensor, pool_S: Tensor,
    ksum_pool: Tensor, *, variant: str, segment_len: int, top_k: int = 2,
    n_seg: Tensor | None = None, state_table: Tensor | None = None, out: Tensor | None = None,
    row_top_k: Tensor | None = None, block_n: int | None = None, block_v: int | None = None,
) -> Tensor:
    """Split-N Triton twin of ``twin.paged_mc_decode_linear_torch`` (same signature, result).

    Two launches: partials grid (B·H, ⌈V/BV⌉, ⌈N/BN⌉), merge grid (B·H, ⌈V/BV⌉). ``block_n``
    (a power of two) sets the columns per split (default :func:`split_blocks`), ``block_v``
    the V tile. ``ssc`` takes the single-launch kernel (it reads only its picks).
    """
    code = _variant_code(variant)
    if code == 3:
        return _single(q, u, o_online, p_online, table, pool_S, ksum_pool, variant=variant,
                       segment_len=segment_len, top_k=top_k, n_seg=n_seg,
                       state_table=state_table, out=out, row_top_k=row_top_k, block_v=block_v)
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
    BN = block_n or split_blocks(B, H, V, N, BV)
    NS = max(1, triton.cdiv(N, BN))
    f64 = q.dtype == torch.float64
    acc_dt = torch.float64 if f64 else torch.float32
    # partials: (B·H, NS, V) readouts, (B·H, NS) local maxima (counts) and sums
    acc = torch.empty(B * H, NS, V, dtype=acc_dt, device=q.device)
    m = torch.empty(B * H, NS, dtype=acc_dt, device=q.device)
    lse = torch.empty(B * H, NS, dtype=acc_dt, device=q.device)
    nv = triton.cdiv(V, BV)
    jitted(_split_partial_kernel)[(B * H, nv, NS)](
        q, u, tab, stab, pool_S, ksum_pool, acc, m, lse,
        H, N, K, V, segment_len,
        q.stride(0), q.stride(1), u.stride(0), u.stride(1),
        tab.stride(0), tab.stride(1), tab.stride(2), stab.stride(0), stab.stride(1),
        stab.stride(2), pool_S.stride(0), pool_S.stride(1), pool_S.stride(2),
        ksum_pool.stride(0), ksum_pool.stride(1), acc.stride(0), acc.stride(1), m.stride(0),
        SOFTMAX=code == 2, BN=BN, BK=BK, BV=BV, F64=f64,
    )
    nseg = n_seg if n_seg is not None else m  # a dummy pointer when absent
    jitted(_split_merge_kernel)[(B * H, nv)](
        u, o_online, p_online, nseg, acc, m, lse, out,
        H, K, V, NS,
        u.stride(0), u.stride(1), o_online.stride(0), o_online.stride(1), p_online.stride(0),
        p_online.stride(1), acc.stride(0), acc.stride(1), m.stride(0), out.stride(0),
        out.stride(1),
        VARIANT=code, HAS_NSEG=n_seg is not None, BS=_pow2(NS), BK=BK, BV=BV, F64=f64,
    )
    return out
