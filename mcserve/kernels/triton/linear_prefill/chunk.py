"""Triton kernels: chunk-parallel gated linear prefill with segment checkpoints
(``impl="chunk"``).

The sequence-walking kernel (``scan.py``) runs one program per (sequence, head, V tile)
through all of its chunks in order: no parallelism along T. Here the work is split as in
flash-linear-attention's chunk form (``chunk_fwd_h`` / ``chunk_fwd_o``), three launches:

1. ``_chunk_state_kernel``, grid (chunks, H, ⌈V/BV⌉): every chunk of BT tokens at once, its
   local state contribution ΔS_c = (k·b·e^{A_last − A})ᵀ v (A the in-chunk cumulative
   log-decay), its total log-decay A_last and its key sum Σk;
2. ``_chunk_scan_kernel``, grid (N, H, ⌈V/BV⌉): the short inter-chunk scan carrying only the
   (K, BV) state: S_c (the state entering chunk c) overwrites ΔS_c in its buffer, then
   S ← e^{A_last}·S + ΔS_c; at each completed segment the state and the segment's key sum go
   straight into the pool rows ``block_ids`` (and, in independent mode, S restarts from 0);
3. ``_chunk_out_kernel``, grid (chunks, H, ⌈V/BV⌉): every chunk's output at once,
   o = (q·e^A)·S_c + ((q kᵀ) ⊙ e^{A_t − A_s} ⊙ [t ≥ s] ⊙ b_s)·v (all exponents ≤ 0).

Chunks never straddle a segment boundary: each segment piece of a sequence is cut into chunks
of at most BT tokens (``chunk_layout``, built on the host from the shapes, with the per-sequence
layout ``check_prefill_args`` already computes). Signature and semantics are those of
``twin.chunk_linear_prefill_torch``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mcserve.kernels.triton._jit import jitted
from mcserve.kernels.triton.linear_prefill.scan import prepare_prefill


def _chunk_state_kernel(
    k_ptr, v_ptr, la_ptr, bw_ptr, cseq_ptr, ct0_ptr, clen_ptr, dS_ptr, ga_ptr, kc_ptr,
    K, V,
    sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sa_b, sa_t, sa_h, sb_b, sb_t, sb_h,
    sd_c, sd_h, sd_k, sg_c, skc_c, skc_h,
    VARLEN: tl.constexpr, HAS_A: tl.constexpr, HAS_B: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, F64: tl.constexpr,
):
    c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    pv = tl.program_id(2)
    if F64:
        acc_t = tl.float64
    else:
        acc_t = tl.float32
    seq = tl.load(cseq_ptr + c).to(tl.int64)
    if VARLEN:
        row = seq * 0
    else:
        row = seq
    t0 = tl.load(ct0_ptr + c).to(tl.int64)
    ln = tl.load(clen_ptr + c).to(tl.int64)
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, BK)
    offs_v = pv * BV + tl.arange(0, BV)
    mt = offs_t < ln
    mk = offs_k < K
    mv = offs_v < V
    tg = t0 + offs_t
    kv = tl.load(k_ptr + row * sk_b + h * sk_h + tg[:, None] * sk_t + offs_k[None, :],
                 mask=mt[:, None] & mk[None, :], other=0.0).to(acc_t)  # (BT, BK)
    vv = tl.load(v_ptr + row * sv_b + h * sv_h + tg[:, None] * sv_t + offs_v[None, :],
                 mask=mt[:, None] & mv[None, :], other=0.0).to(acc_t)  # (BT, BV)
    if HAS_A:
        la = tl.load(la_ptr + row * sa_b + tg * sa_t + h * sa_h, mask=mt, other=0.0).to(acc_t)
    else:
        la = tl.zeros([BT], dtype=acc_t)
    kd = kv
    if HAS_B:
        bw = tl.load(bw_ptr + row * sb_b + tg * sb_t + h * sb_h, mask=mt, other=0.0).to(acc_t)
        kd = kd * bw[:, None]
    A = tl.cumsum(la, 0)
    A_last = tl.sum(la, 0)
    kd = kd * tl.exp(A_last - A)[:, None]  # decay from each token to the chunk's end (≤ 0)
    dS = tl.dot(tl.trans(kd), vv, input_precision="ieee")  # (BK, BV)
    tl.store(dS_ptr + c * sd_c + h * sd_h + offs_k[:, None] * sd_k + offs_v[None, :], dS,
             mask=mk[:, None] & mv[None, :])
    if pv == 0:
        tl.store(ga_ptr + c * sg_c + h, A_last)
        tl.store(kc_ptr + c * skc_c + h * skc_h + offs_k, tl.sum(kv, 0), mask=mk)


def _chunk_scan_kernel(
    dS_ptr, ga_ptr, kc_ptr, cbid_ptr, c0_ptr, nc_ptr, h0_ptr, ks0_ptr, ht_ptr, bs_ptr, bk_ptr,
    K, V,
    sd_c, sd_h, sd_k, sg_c, skc_c, skc_h, sh0_n, sh0_h, sh0_k, sks0_n, sks0_h,
    sht_n, sht_h, sht_k, sbs_n, sbs_h, sbs_k, sbk_n, sbk_h,
    HAS_H0: tl.constexpr, HAS_KS0: tl.constexpr, STORE_FINAL: tl.constexpr,
    INDEP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, F64: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    pv = tl.program_id(2)
    if F64:
        acc_t = tl.float64
    else:
        acc_t = tl.float32
    offs_k = tl.arange(0, BK)
    offs_v = pv * BV + tl.arange(0, BV)
    mk = offs_k < K
    mv = offs_v < V
    mkv = mk[:, None] & mv[None, :]
    first_tile = (offs_k * 0 + pv) == 0  # one V tile writes the key sums
    S = tl.zeros([BK, BV], dtype=acc_t)
    if HAS_H0:
        S = tl.load(h0_ptr + i * sh0_n + h * sh0_h + offs_k[:, None] * sh0_k + offs_v[None, :],
                    mask=mkv, other=0.0).to(acc_t)
    ks = tl.zeros([BK], dtype=acc_t)
    if HAS_KS0:
        ks = tl.load(ks0_ptr + i * sks0_n + h * sks0_h + offs_k, mask=mk, other=0.0).to(acc_t)
    c0 = tl.load(c0_ptr + i).to(tl.int64)
    nc = tl.load(nc_ptr + i).to(tl.int64)
    s_off = h * sd_h + offs_k[:, None] * sd_k + offs_v[None, :]
    for c in range(c0, c0 + nc):
        dS = tl.load(dS_ptr + c * sd_c + s_off, mask=mkv, other=0.0)
        tl.store(dS_ptr + c * sd_c + s_off, S, mask=mkv)  # the state entering chunk c
        S = S * tl.exp(tl.load(ga_ptr + c * sg_c + h)) + dS
        ks += tl.load(kc_ptr + c * skc_c + h * skc_h + offs_k, mask=mk, other=0.0)
        bid = tl.load(cbid_ptr + c).to(tl.int64)
        if bid >= 0:  # the chunk completes a segment: checkpoint it into the pool
            tl.store(bs_ptr + bid * sbs_n + h * sbs_h + offs_k[:, None] * sbs_k
                     + offs_v[None, :], S, mask=mkv)
            tl.store(bk_ptr + bid * sbk_n + h * sbk_h + offs_k, ks, mask=mk & first_tile)
            ks = ks * 0.0
            if INDEP:
                S = S * 0.0
    if STORE_FINAL:
        tl.store(ht_ptr + i * sht_n + h * sht_h + offs_k[:, None] * sht_k + offs_v[None, :], S,
                 mask=mkv)


def _chunk_out_kernel(
    q_ptr, k_ptr, v_ptr, la_ptr, bw_ptr, cseq_ptr, ct0_ptr, clen_ptr, hs_ptr, o_ptr,
    K, V,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sa_b, sa_t, sa_h, sb_b, sb_t, sb_h,
    sd_c, sd_h, sd_k, so_b, so_t, so_h,
    VARLEN: tl.constexpr, HAS_A: tl.constexpr, HAS_B: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, F64: tl.constexpr,
):
    c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    pv = tl.program_id(2)
    if F64:
        acc_t = tl.float64
    else:
        acc_t = tl.float32
    seq = tl.load(cseq_ptr + c).to(tl.int64)
    if VARLEN:
        row = seq * 0
    else:
        row = seq
    t0 = tl.load(ct0_ptr + c).to(tl.int64)
    ln = tl.load(clen_ptr + c).to(tl.int64)
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, BK)
    offs_v = pv * BV + tl.arange(0, BV)
    mt = offs_t < ln
    mk = offs_k < K
    mv = offs_v < V
    tg = t0 + offs_t
    mtk = mt[:, None] & mk[None, :]
    qv = tl.load(q_ptr + row * sq_b + h * sq_h + tg[:, None] * sq_t + offs_k[None, :],
                 mask=mtk, other=0.0).to(acc_t)  # (BT, BK)
    kv = tl.load(k_ptr + row * sk_b + h * sk_h + tg[:, None] * sk_t + offs_k[None, :],
                 mask=mtk, other=0.0).to(acc_t)
    vv = tl.load(v_ptr + row * sv_b + h * sv_h + tg[:, None] * sv_t + offs_v[None, :],
                 mask=mt[:, None] & mv[None, :], other=0.0).to(acc_t)  # (BT, BV)
    if HAS_A:
        la = tl.load(la_ptr + row * sa_b + tg * sa_t + h * sa_h, mask=mt, other=0.0).to(acc_t)
    else:
        la = tl.zeros([BT], dtype=acc_t)
    if HAS_B:
        bw = tl.load(bw_ptr + row * sb_b + tg * sb_t + h * sb_h, mask=mt, other=0.0).to(acc_t)
        kv = kv * bw[:, None]
    A = tl.cumsum(la, 0)
    S0 = tl.load(hs_ptr + c * sd_c + h * sd_h + offs_k[:, None] * sd_k + offs_v[None, :],
                 mask=mk[:, None] & mv[None, :], other=0.0).to(acc_t)  # (BK, BV)
    causal = offs_t[:, None] >= offs_t[None, :]
    att = tl.dot(qv, tl.trans(kv), input_precision="ieee")  # (BT, BT)
    att = att * tl.exp(tl.where(causal, A[:, None] - A[None, :], float("-inf")))
    o = tl.dot(qv * tl.exp(A)[:, None], S0, input_precision="ieee")
    o += tl.dot(att, vv, input_precision="ieee")
    tl.store(o_ptr + row * so_b + h * so_h + tg[:, None] * so_t + offs_v[None, :], o,
             mask=mt[:, None] & mv[None, :])


def chunk_layout(lay: dict, block_ids: Tensor, segment_len: int, block_t: int
                 ) -> dict[str, Tensor]:
    """The chunks of a prefill call, sequence-major, oldest first (all int64, on the device).

    Each sequence's tokens are cut at its segment boundaries into pieces, and each piece into
    chunks of at most ``block_t`` tokens. Keys: ``seq``, ``t0`` (first token's index along dim 1,
    ``cu_seqlens`` offset included), ``len``, ``bid`` (the pool row of the boundary the chunk
    completes, else -1), all ``(chunks,)``; ``c0``, ``nc`` ``(N,)`` each sequence's chunk range.
    """
    C, BT = segment_len, block_t
    lens, off, bos, offsets = lay["lens"], lay["off"], lay["bos"], lay["offsets"]
    N = lens.numel()
    dev = lens.device
    npc = torch.where(lens > 0, (off + lens + C - 1) // C, 0)  # (N,) segment pieces
    seq_p = torch.repeat_interleave(torch.arange(N, device=dev), npc)  # (P,)
    j = torch.arange(seq_p.numel(), device=dev) - (torch.cumsum(npc, 0) - npc)[seq_p]
    off_p, len_p = off[seq_p], lens[seq_p]
    lo = (j * C - off_p).clamp_min(0)
    hi = torch.minimum((j + 1) * C - off_p, len_p)
    complete = (j + 1) * C - off_p <= len_p
    nch = (hi - lo + BT - 1) // BT  # (P,) ≥ 1: every piece holds a token
    piece = torch.repeat_interleave(torch.arange(seq_p.numel(), device=dev), nch)  # (NC,)
    m = torch.arange(piece.numel(), device=dev) - (torch.cumsum(nch, 0) - nch)[piece]
    t0 = lo[piece] + m * BT
    ln = torch.minimum(hi[piece] - t0, torch.full_like(t0, BT))
    ends = (m == nch[piece] - 1) & complete[piece]
    if block_ids.numel():
        slot = (offsets[seq_p] + j)[piece].clamp(0, block_ids.numel() - 1)
        bid = torch.where(ends, block_ids.to(torch.int64)[slot], -1)
    else:
        bid = torch.full_like(t0, -1)
    seq = seq_p[piece]
    nc = torch.bincount(seq, minlength=N) if seq.numel() else torch.zeros_like(lens)
    return dict(seq=seq, t0=bos[seq] + t0, len=ln, bid=bid, c0=torch.cumsum(nc, 0) - nc,
                nc=nc)


def chunk_linear_prefill_chunked(
    q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None = None, b: Tensor | None = None,
    initial_state: Tensor | None = None, *, segment_len: int, cu_seqlens: Tensor | None = None,
    mode: str = "checkpoint", initial_seg_len: Tensor | int = 0,
    initial_ksum: Tensor | None = None, output_final_state: bool = True,
    block_ids: Tensor | None = None, state_pool: Tensor | None = None,
    ksum_pool: Tensor | None = None, out: Tensor | None = None, chunk_size: int = 64,
    block_v: int | None = None,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """Chunk-parallel Triton twin of ``twin.chunk_linear_prefill_torch`` (same signature and
    result). Three launches: chunk states (chunks, H, ⌈V/BV⌉), scan (N, H, ⌈V/BV⌉), outputs
    (chunks, H, ⌈V/BV⌉). ``chunk_size`` bounds the token tile BT (a power of two in [16, 64],
    at most 32 when K > 64); ``block_v`` sets the V tile. Scratch: one (K, V) state per chunk
    and head in the accumulation dtype.
    """
    prep = prepare_prefill(q, k, v, log_a, b, initial_state, segment_len=segment_len,
                           cu_seqlens=cu_seqlens, mode=mode, initial_seg_len=initial_seg_len,
                           initial_ksum=initial_ksum, output_final_state=output_final_state,
                           block_ids=block_ids, state_pool=state_pool, ksum_pool=ksum_pool,
                           out=out, chunk_size=chunk_size, block_v=block_v)
    if prep.empty:
        return prep.out, prep.final, prep.state_pool, prep.ksum_pool
    (lay, out, final, block_ids, state_pool, ksum_pool, q, k, v, initial_state, initial_ksum,
     BK, BV, BT) = prep.args
    H, K = q.shape[2], q.shape[3]
    V = v.shape[-1]
    N = lay["N"]
    f64 = q.dtype == torch.float64
    acc_dt = torch.float64 if f64 else torch.float32
    cl = chunk_layout(lay, block_ids, segment_len, BT)
    NC = cl["seq"].numel()
    hs = torch.empty(NC, H, K, V, dtype=acc_dt, device=q.device)  # ΔS_c, then S entering c
    ga = torch.empty(NC, H, dtype=acc_dt, device=q.device)  # log-decay over chunk c
    kc = torch.empty(NC, H, K, dtype=acc_dt, device=q.device)  # Σk over chunk c
    dummy = q
    st = lambda x, n: (x.stride(0), x.stride(1), x.stride(2))[:n]  # noqa: E731
    z3 = (0, 0, 0)
    gate_strides = ((st(log_a, 3) if log_a is not None else z3)
                    + (st(b, 3) if b is not None else z3))
    consts = dict(VARLEN=cu_seqlens is not None, HAS_A=log_a is not None, HAS_B=b is not None,
                  BT=BT, BK=BK, BV=BV, F64=f64)
    la = log_a if log_a is not None else dummy
    bw = b if b is not None else dummy
    nv = triton.cdiv(V, BV)
    if NC:
        jitted(_chunk_state_kernel)[(NC, H, nv)](
            k, v, la, bw, cl["seq"], cl["t0"], cl["len"], hs, ga, kc,
            K, V, *st(k, 3), *st(v, 3), *gate_strides,
            *st(hs, 3), ga.stride(0), *st(kc, 2), **consts)
    jitted(_chunk_scan_kernel)[(N, H, nv)](
        hs, ga, kc, cl["bid"], cl["c0"], cl["nc"],
        initial_state if initial_state is not None else dummy,
        initial_ksum if initial_ksum is not None else dummy,
        final if final is not None else dummy, state_pool, ksum_pool,
        K, V, *st(hs, 3), ga.stride(0), *st(kc, 2),
        *(st(initial_state, 3) if initial_state is not None else z3),
        *(st(initial_ksum, 2) if initial_ksum is not None else z3[:2]),
        *(st(final, 3) if final is not None else z3),
        *st(state_pool, 3), *st(ksum_pool, 2),
        HAS_H0=initial_state is not None, HAS_KS0=initial_ksum is not None,
        STORE_FINAL=final is not None, INDEP=mode == "independent", BK=BK, BV=BV, F64=f64)
    if NC:
        jitted(_chunk_out_kernel)[(NC, H, nv)](
            q, k, v, la, bw, cl["seq"], cl["t0"], cl["len"], hs, out,
            K, V, *st(q, 3), *st(k, 3), *st(v, 3), *gate_strides, *st(hs, 3), *st(out, 3),
            **consts)
    return out, final, state_pool, ksum_pool
