"""Triton kernels: one decode token per row through a gated-linear-memory mixer, fused.

``fused_linear_decode`` takes the token's projections (the GEMMs stay with cuBLAS) and does the
rest of the mixer in one launch per layer, two when a q/k group or a norm group spans several
heads (Mamba2 with n_groups < n_heads):

1. ``_fused_decode_kernel``, grid (B, H): one program per row and head, the whole K×V state in
   registers. Conv step of the head's channels (depthwise causal conv over the tail and the new
   input, + bias, SiLU; the tail shifted in place for the channels only this head reads),
   q/k L2 norm, gates (given / sigmoid / softplus), key sum advanced in place, state update in
   place and online readout, then MC: the collapsed sum (residual/post), an online softmax over
   the cached blocks read through the block table (grm/soup: scores ⟨u, ksum_i⟩/(C·√K) against
   the online ⟨u, p_on⟩/√K, one pass, each block's key sum and state read once), or the top-k
   picks (ssc, as in ``mc_decode/single.py``); D skip; output gate and per-head RMSNorm;
2. ``_fused_finish_kernel``, grid (B, groups), only when needed: the RMSNorm over norm groups of
   several heads (the first launch leaves the gated, unnormalised y in ``out``) and the tail
   shift of q/k channels shared by several heads (every head's program had to read the old tail
   first).

In-place buffers (conv tail, key sum, state) are read, then a CTA barrier, then written: a
warp never overwrites what another warp of the program has yet to read. Semantics and signature
are those of the torch twin, ``twin.fused_linear_decode_torch``.
"""

from __future__ import annotations

import math

import torch
import triton.language as tl
from torch import Tensor

from mcserve.kernels.triton._jit import jitted
from mcserve.kernels.triton._launch import _pow2, _variant_code
from mcserve.kernels.triton.common import _head_table, check_fused_args, rows_views

_VARIANT = {"none": -1}  # the rest: _launch._variant_code (0 ones, 1 1/(n+1), 2 softmax, 3 top-k)
_GATE = {"given": 0, "sigmoid": 1, "softplus": 2}


def _fused_decode_kernel(
    x_ptr, tail_ptr, cw_ptr, cb_ptr, u_ptr, la_ptr, bw_ptr, dtb_ptr, alog_ptr,
    S_ptr, ks_ptr, slen_ptr, nseg_ptr, tab_ptr, stab_ptr, P_ptr, kp_ptr, cs_ptr, krow_ptr,
    D_ptr, z_ptr, nw_ptr, y_ptr, rows_ptr,
    H, K, V, N, C, REP, q_off, k_off, v_off,
    decay_scale, dt_min, dt_max, dt_scale, eps, GS,
    sx_b, st_b, st_w, scw_c, su_b, su_h, sla_b, sla_h, sbw_b, sbw_h,
    sS_b, sS_h, sS_k, sks_b, sks_h, stb_b, stb_h, stb_n, ssb_b, ssb_h, ssb_n,
    sP_n, sP_h, sP_k, skp_n, skp_h, scs_b, scs_h, scs_k, sz_b, sy_b,
    W: tl.constexpr, HAS_CB: tl.constexpr, SHIFT_QK: tl.constexpr, NORM_QK: tl.constexpr,
    HAS_U: tl.constexpr, GATE: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_WRITE: tl.constexpr,
    VARIANT: tl.constexpr, TOP_K: tl.constexpr, HAS_KROW: tl.constexpr, HAS_CSUM: tl.constexpr,
    HAS_D: tl.constexpr, D_PER_CH: tl.constexpr, HAS_Z: tl.constexpr, NORM: tl.constexpr,
    NORM_FIRST: tl.constexpr, NW_FULL: tl.constexpr, BW: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, F64: tl.constexpr, HAS_ROWS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    if HAS_ROWS:  # row b's state, conv tail, key sum and summed state live at rows[b]
        srow = tl.load(rows_ptr + b).to(tl.int64)
    else:
        srow = b
    if F64:
        acc_t = tl.float64
    else:
        acc_t = tl.float32
    offs_k = tl.arange(0, BK)
    offs_v = tl.arange(0, BV)
    mk = offs_k < K
    mv = offs_v < V
    mkv = mk[:, None] & mv[None, :]
    g = h // REP  # the q/k group
    ch_q = q_off + g * K + offs_k
    ch_k = k_off + g * K + offs_k
    ch_v = v_off + h * V + offs_v
    xq = tl.load(x_ptr + b * sx_b + ch_q, mask=mk, other=0.0).to(acc_t)
    xk = tl.load(x_ptr + b * sx_b + ch_k, mask=mk, other=0.0).to(acc_t)
    xv = tl.load(x_ptr + b * sx_b + ch_v, mask=mv, other=0.0).to(acc_t)

    # ---- 1. conv step: conv = Σ_r tail[r]·w[:, r] + x·w[:, W-1] (+ bias), SiLU
    if W > 0:
        offs_w = tl.arange(0, BW)
        mw = offs_w < W - 1
        tq = tl.load(tail_ptr + srow * st_b + offs_w[:, None] * st_w + ch_q[None, :],
                     mask=mw[:, None] & mk[None, :], other=0.0)  # (BW, BK)
        tk = tl.load(tail_ptr + srow * st_b + offs_w[:, None] * st_w + ch_k[None, :],
                     mask=mw[:, None] & mk[None, :], other=0.0)
        tv = tl.load(tail_ptr + srow * st_b + offs_w[:, None] * st_w + ch_v[None, :],
                     mask=mw[:, None] & mv[None, :], other=0.0)  # (BW, BV)
        # the shifted tails: row r takes row r + 1, the last row takes x
        nq = tl.load(tail_ptr + srow * st_b + (offs_w[:, None] + 1) * st_w + ch_q[None, :],
                     mask=(offs_w[:, None] + 1 < W - 1) & mk[None, :], other=0.0)
        nk = tl.load(tail_ptr + srow * st_b + (offs_w[:, None] + 1) * st_w + ch_k[None, :],
                     mask=(offs_w[:, None] + 1 < W - 1) & mk[None, :], other=0.0)
        nv = tl.load(tail_ptr + srow * st_b + (offs_w[:, None] + 1) * st_w + ch_v[None, :],
                     mask=(offs_w[:, None] + 1 < W - 1) & mv[None, :], other=0.0)
        last = offs_w[:, None] == W - 2
        nq = tl.where(last, xq[None, :].to(nq.dtype), nq)
        nk = tl.where(last, xk[None, :].to(nk.dtype), nk)
        nv = tl.where(last, xv[None, :].to(nv.dtype), nv)
        wq = tl.load(cw_ptr + ch_q[None, :] * scw_c + offs_w[:, None],
                     mask=mw[:, None] & mk[None, :], other=0.0).to(acc_t)
        wk = tl.load(cw_ptr + ch_k[None, :] * scw_c + offs_w[:, None],
                     mask=mw[:, None] & mk[None, :], other=0.0).to(acc_t)
        wv = tl.load(cw_ptr + ch_v[None, :] * scw_c + offs_w[:, None],
                     mask=mw[:, None] & mv[None, :], other=0.0).to(acc_t)
        cq = tl.sum(tq.to(acc_t) * wq, 0) + xq * tl.load(cw_ptr + ch_q * scw_c + (W - 1),
                                                         mask=mk, other=0.0).to(acc_t)
        ck = tl.sum(tk.to(acc_t) * wk, 0) + xk * tl.load(cw_ptr + ch_k * scw_c + (W - 1),
                                                         mask=mk, other=0.0).to(acc_t)
        cv = tl.sum(tv.to(acc_t) * wv, 0) + xv * tl.load(cw_ptr + ch_v * scw_c + (W - 1),
                                                         mask=mv, other=0.0).to(acc_t)
        if HAS_CB:
            cq += tl.load(cb_ptr + ch_q, mask=mk, other=0.0).to(acc_t)
            ck += tl.load(cb_ptr + ch_k, mask=mk, other=0.0).to(acc_t)
            cv += tl.load(cb_ptr + ch_v, mask=mv, other=0.0).to(acc_t)
        q = cq / (1.0 + tl.exp(-cq))
        k = ck / (1.0 + tl.exp(-ck))
        v = cv / (1.0 + tl.exp(-cv))
    else:
        q = xq
        k = xk
        v = xv

    # ---- 2. q, k L2 norm; u
    if NORM_QK:
        q = q / tl.maximum(tl.sqrt(tl.sum(q * q, 0)), 1e-12)
        k = k / tl.maximum(tl.sqrt(tl.sum(k * k, 0)), 1e-12)
    if HAS_U:
        u = tl.load(u_ptr + b * su_b + h * su_h + offs_k, mask=mk, other=0.0).to(acc_t)
    else:
        u = q

    # ---- 3. gates
    one = tl.sum(tl.zeros([1], dtype=acc_t), 0) + 1.0
    decay = one
    write = one
    if GATE == 2:
        t = tl.load(la_ptr + b * sla_b + h * sla_h).to(acc_t) + tl.load(dtb_ptr + h).to(acc_t)
        # softplus with torch's threshold (t > 20: t)
        sp = tl.where(t > 20.0, t, tl.log(1.0 + tl.exp(tl.minimum(t, 20.0))))
        delta = tl.minimum(tl.maximum(sp, dt_min), dt_max) * dt_scale
        decay = tl.exp(-delta * tl.exp(tl.load(alog_ptr + h).to(acc_t)))
        write = delta
    else:
        if HAS_DECAY:
            la = tl.load(la_ptr + b * sla_b + h * sla_h).to(acc_t)
            if GATE == 1:  # log a = decay_scale · logsigmoid(raw)
                la = decay_scale * (tl.minimum(la, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(la))))
            decay = tl.exp(la)
        if HAS_WRITE:
            bw = tl.load(bw_ptr + b * sbw_b + h * sbw_h).to(acc_t)
            if GATE == 1:
                bw = 1.0 / (1.0 + tl.exp(-bw))
            write = bw

    # ---- 4. state update and online readout (stored after the barrier below)
    s_ptrs = S_ptr + srow * sS_b + h * sS_h + offs_k[:, None] * sS_k + offs_v[None, :]
    S = tl.load(s_ptrs, mask=mkv, other=0.0).to(acc_t)  # (BK, BV)
    S = decay * S + (write * k)[:, None] * v[None, :]
    o = tl.sum(q[:, None] * S, 0)  # (BV,)
    denom = tl.sum(tl.sqrt(tl.zeros([1], dtype=acc_t) + K), 0)  # √K in the accumulation dtype
    if VARIANT >= 0:
        cum = tl.load(ks_ptr + srow * sks_b + h * sks_h + offs_k, mask=mk, other=0.0).to(acc_t) + k
    y = o
    if VARIANT == 0 or VARIANT == 1:  # collapsed: one summed state
        if HAS_CSUM:
            Cs = tl.load(cs_ptr + srow * scs_b + h * scs_h + offs_k[:, None] * scs_k
                         + offs_v[None, :], mask=mkv, other=0.0).to(acc_t)
            y = o + tl.sum(q[:, None] * Cs, 0)
        if VARIANT == 1:
            y = y / (tl.load(nseg_ptr + b).to(acc_t) + 1.0)
    elif VARIANT >= 2:
        p_on = cum / (tl.load(slen_ptr + b).to(acc_t) + 1.0)
        r_on = tl.sum(u * p_on, 0) / denom
        s_off = h * sP_h + offs_k[:, None] * sP_k + offs_v[None, :]
        if VARIANT == 2:  # online softmax over the cached blocks and the online memory
            mx = r_on
            lsum = one
            acc = o
            for n in range(0, N):
                tid = tl.load(tab_ptr + b * stb_b + h * stb_h + n * stb_n).to(tl.int64)
                if tid >= 0:
                    ksn = tl.load(kp_ptr + tid * skp_n + h * skp_h + offs_k, mask=mk,
                                  other=0.0).to(acc_t)
                    r = tl.sum(ksn * u, 0) / (denom * C)
                    m_new = tl.maximum(mx, r)
                    alpha = tl.exp(mx - m_new)
                    wn = tl.exp(r - m_new)
                    sid = tl.load(stab_ptr + b * ssb_b + h * ssb_h + n * ssb_n).to(tl.int64)
                    Sn = tl.load(P_ptr + sid * sP_n + s_off, mask=mkv, other=0.0).to(acc_t)
                    acc = acc * alpha + wn * tl.sum(q[:, None] * Sn, 0)
                    lsum = lsum * alpha + wn
                    mx = m_new
            y = acc / lsum
        else:  # ssc: top-k of the scores (ties → the larger column), softmax with the online
            offs_n = tl.arange(0, BN)
            ids = tl.load(tab_ptr + b * stb_b + h * stb_h + offs_n * stb_n, mask=offs_n < N,
                          other=-1).to(tl.int64)
            valid = ids >= 0
            kss = tl.load(kp_ptr + tl.where(valid, ids, 0)[:, None] * skp_n + h * skp_h
                          + offs_k[None, :], mask=valid[:, None] & mk[None, :],
                          other=0.0).to(acc_t)
            r = tl.sum(kss * u[None, :], 1) / (denom * C)  # (BN,)
            neg_inf = float("-inf")
            if HAS_KROW:
                kb = tl.load(krow_ptr + b).to(tl.int32)
            else:
                kb = tl.sum(tl.zeros([1], dtype=tl.int32), 0) + TOP_K
            rem = valid
            sel = offs_n < 0
            for j in tl.static_range(TOP_K):
                m = tl.max(tl.where(rem, r, neg_inf), 0)
                ij = tl.max(tl.where(rem & (r == m), offs_n, -1), 0)
                ij = tl.where(kb > j, ij, -1)
                sel = sel | (offs_n == ij)
                rem = rem & (offs_n != ij)
            mx = tl.maximum(tl.max(tl.where(sel, r, neg_inf), 0), r_on)
            e = tl.exp(tl.where(sel, r - mx, neg_inf))
            e_on = tl.exp(r_on - mx)
            den = tl.sum(e, 0) + e_on
            acc = (e_on / den) * o
            rem2 = sel
            for _j in tl.static_range(TOP_K):
                ij = tl.max(tl.where(rem2, offs_n, -1), 0)
                rem2 = rem2 & (offs_n != ij)
                if ij >= 0:
                    gj = tl.sum(tl.where(offs_n == ij, e, 0.0), 0) / den
                    sid = tl.load(stab_ptr + b * ssb_b + h * ssb_h + ij * ssb_n).to(tl.int64)
                    Sn = tl.load(P_ptr + sid * sP_n + s_off, mask=mkv, other=0.0).to(acc_t)
                    acc += gj * tl.sum(q[:, None] * Sn, 0)
            y = acc

    # ---- 5. D skip; 6. output gate and norm
    if HAS_D:
        if D_PER_CH:
            y += v * tl.load(D_ptr + h * V + offs_v, mask=mv, other=0.0).to(acc_t)
        else:
            y += v * tl.load(D_ptr + h).to(acc_t)
    if HAS_Z:
        zz = tl.load(z_ptr + b * sz_b + h * V + offs_v, mask=mv, other=0.0).to(acc_t)
        zz = zz / (1.0 + tl.exp(-zz))
        if NORM == 0 or not NORM_FIRST:
            y = y * zz
    if NORM == 1:  # the norm group is this head
        y = tl.where(mv, y, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(y * y, 0) / GS + eps)
        if NW_FULL:
            nw = tl.load(nw_ptr + h * V + offs_v, mask=mv, other=0.0).to(acc_t)
        else:
            nw = tl.load(nw_ptr + offs_v, mask=mv, other=0.0).to(acc_t)
        y = y * rstd * nw
        if HAS_Z and NORM_FIRST:
            y = y * zz

    # ---- every read of the in-place buffers is done: write them
    tl.debug_barrier()
    tl.store(s_ptrs, S, mask=mkv)
    if VARIANT >= 0:
        tl.store(ks_ptr + srow * sks_b + h * sks_h + offs_k, cum, mask=mk)
    if W > 0:
        mrow = offs_w[:, None] < W - 1
        tl.store(tail_ptr + srow * st_b + offs_w[:, None] * st_w + ch_v[None, :], nv,
                 mask=mrow & mv[None, :])
        if SHIFT_QK:
            tl.store(tail_ptr + srow * st_b + offs_w[:, None] * st_w + ch_q[None, :], nq,
                     mask=mrow & mk[None, :])
            tl.store(tail_ptr + srow * st_b + offs_w[:, None] * st_w + ch_k[None, :], nk,
                     mask=mrow & mk[None, :])
    tl.store(y_ptr + b * sy_b + h * V + offs_v, y, mask=mv)


def _fused_finish_kernel(
    y_ptr, z_ptr, nw_ptr, tail_ptr, x_ptr, rows_ptr,
    K, GS, NNG, NQG, q_off, k_off, eps,
    sy_b, sz_b, st_b, st_w, sx_b,
    DO_NORM: tl.constexpr, NORM_FIRST: tl.constexpr, HAS_Z: tl.constexpr,
    NW_FULL: tl.constexpr, DO_SHIFT: tl.constexpr, W: tl.constexpr, BW: tl.constexpr,
    BD: tl.constexpr, BK: tl.constexpr, F64: tl.constexpr, HAS_ROWS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    if HAS_ROWS:
        srow = tl.load(rows_ptr + b).to(tl.int64)
    else:
        srow = b
    if F64:
        acc_t = tl.float64
    else:
        acc_t = tl.float32
    if DO_NORM:
        if g < NNG:  # RMSNorm over the group's channels [g·GS, (g+1)·GS) of y, in place
            offs = tl.arange(0, BD)
            base = g * GS
            ss = tl.zeros([BD], dtype=acc_t)
            for c0 in range(0, GS, BD):
                m = c0 + offs < GS
                yv = tl.load(y_ptr + b * sy_b + base + c0 + offs, mask=m, other=0.0).to(acc_t)
                ss += yv * yv
            rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / GS + eps)
            for c0 in range(0, GS, BD):
                m = c0 + offs < GS
                yv = tl.load(y_ptr + b * sy_b + base + c0 + offs, mask=m, other=0.0).to(acc_t)
                if NW_FULL:
                    nw = tl.load(nw_ptr + base + c0 + offs, mask=m, other=0.0).to(acc_t)
                else:
                    nw = tl.load(nw_ptr + c0 + offs, mask=m, other=0.0).to(acc_t)
                yv = yv * rstd * nw
                if HAS_Z and NORM_FIRST:
                    zz = tl.load(z_ptr + b * sz_b + base + c0 + offs, mask=m,
                                 other=0.0).to(acc_t)
                    yv = yv * (zz / (1.0 + tl.exp(-zz)))
                tl.store(y_ptr + b * sy_b + base + c0 + offs, yv, mask=m)
    if DO_SHIFT:
        if g < NQG:  # the q/k tail channels of group g, read by every head of the group
            offs_k = tl.arange(0, BK)
            offs_w = tl.arange(0, BW)
            mk = offs_k < K
            mrow = offs_w[:, None] < W - 1
            mnext = (offs_w[:, None] + 1 < W - 1) & mk[None, :]
            last = offs_w[:, None] == W - 2
            ch_q = q_off + g * K + offs_k
            ch_k = k_off + g * K + offs_k
            nq = tl.load(tail_ptr + srow * st_b + (offs_w[:, None] + 1) * st_w + ch_q[None, :],
                         mask=mnext, other=0.0)
            nk = tl.load(tail_ptr + srow * st_b + (offs_w[:, None] + 1) * st_w + ch_k[None, :],
                         mask=mnext, other=0.0)
            xq = tl.load(x_ptr + b * sx_b + ch_q, mask=mk, other=0.0)
            xk = tl.load(x_ptr + b * sx_b + ch_k, mask=mk, other=0.0)
            nq = tl.where(last, xq[None, :].to(nq.dtype), nq)
            nk = tl.where(last, xk[None, :].to(nk.dtype), nk)
            tl.debug_barrier()
            tl.store(tail_ptr + srow * st_b + offs_w[:, None] * st_w + ch_q[None, :], nq,
                     mask=mrow & mk[None, :])
            tl.store(tail_ptr + srow * st_b + offs_w[:, None] * st_w + ch_k[None, :], nk,
                     mask=mrow & mk[None, :])


def fused_linear_decode(
    x: Tensor, z: Tensor | None, S: Tensor, *, q_offset: int, k_offset: int, v_offset: int,
    qk_heads: int = 1, conv_tail: Tensor | None = None, conv_weight: Tensor | None = None,
    conv_bias: Tensor | None = None, normalize_qk: bool = False, u: Tensor | None = None,
    gate_mode: str = "given", log_a: Tensor | None = None, b: Tensor | None = None,
    decay_scale: float = 1.0, dt: Tensor | None = None, dt_bias: Tensor | None = None,
    A_log: Tensor | None = None, dt_min: float = 0.0, dt_max: float = math.inf,
    dt_scale: float = 1.0, D: Tensor | None = None, norm_weight: Tensor | None = None,
    norm_eps: float = 1e-6, norm_group: int | None = None, norm_before_gate: bool = False,
    variant: str = "none", segment_len: int = 1, top_k: int = 2,
    seg_ksum: Tensor | None = None, seg_len: Tensor | None = None, n_seg: Tensor | None = None,
    table: Tensor | None = None, state_table: Tensor | None = None,
    pool_S: Tensor | None = None, ksum_pool: Tensor | None = None, csum: Tensor | None = None,
    row_top_k: Tensor | None = None, out: Tensor | None = None,
    state_rows: Tensor | None = None,
) -> Tensor:
    """Triton twin of ``twin.fused_linear_decode_torch`` (same signature and result).

    Launch 1 grid (B, H); launch 2 grid (B, max(norm groups, q/k groups)) only when a norm
    group or a q/k group spans several heads. With ``state_rows`` both read and write the
    state, tail, key sum and summed state at row ``state_rows[b]`` of those tensors.
    """
    rv = rows_views(x.shape[0], state_rows, S=S, conv_tail=conv_tail, seg_ksum=seg_ksum,
                    csum=csum)
    dims = check_fused_args(
        x, z, rv["S"], q_offset=q_offset, k_offset=k_offset, v_offset=v_offset,
        qk_heads=qk_heads, conv_tail=rv["conv_tail"], conv_weight=conv_weight,
        conv_bias=conv_bias, u=u, gate_mode=gate_mode, log_a=log_a, b=b, dt=dt,
        dt_bias=dt_bias, A_log=A_log, D=D, norm_weight=norm_weight, norm_group=norm_group,
        variant=variant, segment_len=segment_len, top_k=top_k, seg_ksum=rv["seg_ksum"],
        seg_len=seg_len, n_seg=n_seg, table=table, state_table=state_table, pool_S=pool_S,
        ksum_pool=ksum_pool, csum=rv["csum"], row_top_k=row_top_k)
    B, H, K, V, G, GS = (dims[n] for n in ("B", "H", "K", "V", "G", "GS"))
    for name, t in (("x", x), ("z", z), ("S", S), ("seg_ksum", seg_ksum), ("u", u),
                    ("conv_tail", conv_tail), ("conv_weight", conv_weight), ("csum", csum),
                    ("pool_S", pool_S), ("ksum_pool", ksum_pool)):
        if t is not None and t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dim")
    if out is None:
        out = torch.empty(B, H * V, dtype=x.dtype, device=x.device)
    elif out.shape != (B, H * V) or out.stride(-1) != 1:
        raise ValueError(f"out must be ({B}, {H * V}) with unit stride")
    if B == 0 or H == 0:
        return out
    code = _VARIANT.get(variant)
    if code is None:
        code = _variant_code(variant)
    routed = code >= 2
    tab = stab = None
    if routed:
        tab = _head_table(table, B, H)
        stab = tab if state_table is None else _head_table(state_table, B, H, "state_table")
    N = tab.shape[-1] if routed else 0
    W = conv_weight.shape[-1] if conv_weight is not None else 0
    rep = H // G
    norm = 0 if norm_weight is None else (1 if GS == V else 2)
    shift_later = W > 0 and rep > 1
    dummy = x
    z0 = (0, 0, 0)
    pick = lambda t: dummy if t is None else t  # noqa: E731
    s2 = lambda t: z0[:2] if t is None else (t.stride(0), t.stride(1))  # noqa: E731
    s3 = lambda t: z0 if t is None else (t.stride(0), t.stride(1), t.stride(2))  # noqa: E731
    gate_a = dt if gate_mode == "softplus" else log_a
    f64 = x.dtype == torch.float64
    BK, BV = _pow2(K, 16), _pow2(V, 16)
    BW = _pow2(max(W - 1, 1))
    jitted(_fused_decode_kernel)[(B, H)](
        x, pick(conv_tail), pick(conv_weight), pick(conv_bias), pick(u), pick(gate_a), pick(b),
        pick(dt_bias), pick(A_log), S, pick(seg_ksum), pick(seg_len), pick(n_seg), pick(tab),
        pick(stab), pick(pool_S), pick(ksum_pool), pick(csum), pick(row_top_k), pick(D),
        pick(z), pick(norm_weight), out, pick(state_rows),
        H, K, V, N, segment_len, rep, q_offset, k_offset, v_offset,
        float(decay_scale), float(dt_min), float(min(dt_max, 3e38)), float(dt_scale),
        float(norm_eps), GS,
        x.stride(0), *(s3(conv_tail)[:2] if conv_tail is not None else z0[:2]),
        conv_weight.stride(0) if conv_weight is not None else 0,
        *s2(u), *s2(gate_a), *s2(b), *s3(S), *s2(seg_ksum), *s3(tab), *s3(stab), *s3(pool_S),
        *s2(ksum_pool), *s3(csum), z.stride(0) if z is not None else 0, out.stride(0),
        W=W, HAS_CB=conv_bias is not None, SHIFT_QK=rep == 1, NORM_QK=normalize_qk,
        HAS_U=u is not None, GATE=_GATE[gate_mode], HAS_DECAY=log_a is not None,
        HAS_WRITE=b is not None, VARIANT=code, TOP_K=top_k,
        HAS_KROW=row_top_k is not None and code == 3, HAS_CSUM=csum is not None,
        HAS_D=D is not None, D_PER_CH=D is not None and D.numel() == H * V,
        HAS_Z=z is not None, NORM=norm, NORM_FIRST=norm_before_gate,
        NW_FULL=norm_weight is not None and norm_weight.numel() == H * V,
        BW=BW, BN=_pow2(N), BK=BK, BV=BV, F64=f64, HAS_ROWS=state_rows is not None,
    )
    if norm == 2 or shift_later:
        nng = (H * V) // GS if norm == 2 else 0
        nqg = G if shift_later else 0
        jitted(_fused_finish_kernel)[(B, max(nng, nqg))](
            out, pick(z), pick(norm_weight), pick(conv_tail), x, pick(state_rows),
            K, GS, nng, nqg, q_offset, k_offset, float(norm_eps),
            out.stride(0), z.stride(0) if z is not None else 0,
            *(s3(conv_tail)[:2] if conv_tail is not None else z0[:2]), x.stride(0),
            DO_NORM=norm == 2, NORM_FIRST=norm_before_gate, HAS_Z=z is not None,
            NW_FULL=norm_weight is not None and norm_weight.numel() == H * V,
            DO_SHIFT=shift_later, W=W, BW=BW, BD=min(_pow2(GS, 16), 1024), BK=BK, F64=f64,
            HAS_ROWS=state_rows is not None,
        )
    return out
