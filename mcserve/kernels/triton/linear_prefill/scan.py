"""Triton kernel: chunked gated linear attention that emits segment checkpoints, one program
walking each sequence (``impl="scan"``).

One program per (sequence, head, V tile) walks its sequence segment by segment and, inside a
segment, chunk by chunk (``BT`` tokens): with A the in-chunk cumulative log-decay,
o = (q·e^A) S + ((q kᵀ) ⊙ e^{A_t − A_s} ⊙ [t ≥ s]) v and S ← e^{A_last} S + (k·b·e^{A_last − A})ᵀ v
(flash-linear-attention's simple-GLA chunk form; every exponent is ≤ 0). At each completed
segment it stores S into ``state_pool[block_ids[j]]`` and the segment's key sum into
``ksum_pool[block_ids[j]]`` — straight into the engine's block pool — and, in independent
mode, restarts S from zero. Chunks never straddle a segment boundary.

Signature and semantics are those of the torch twin, ``twin.chunk_linear_prefill_torch``.
``prepare_prefill`` (argument checks, outputs, per-sequence layout) serves ``chunk.py`` too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mcserve.kernels.triton._jit import jitted
from mcserve.kernels.triton.common import _prefill_outputs, check_prefill_args


def _chunk_prefill_kernel(
    q_ptr, k_ptr, v_ptr, la_ptr, bw_ptr, h0_ptr, ks0_ptr, o_ptr, ht_ptr, bs_ptr, bk_ptr,
    bid_ptr, bos_ptr, len_ptr, off_ptr, boff_ptr,
    K, V, C,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sa_b, sa_t, sa_h, sb_b, sb_t, sb_h,
    so_b, so_t, so_h, sh0_n, sh0_h, sh0_k, sks0_n, sks0_h, sht_n, sht_h, sht_k,
    sbs_n, sbs_h, sbs_k, sbk_n, sbk_h,
    VARLEN: tl.constexpr, HAS_A: tl.constexpr, HAS_B: tl.constexpr, HAS_H0: tl.constexpr,
    HAS_KS0: tl.constexpr, STORE_FINAL: tl.constexpr, INDEP: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, F64: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    pv = tl.program_id(2)
    if F64:
        acc_t = tl.float64
    else:
        acc_t = tl.float32
    if VARLEN:
        row = i * 0
    else:
        row = i
    bos = tl.load(bos_ptr + i).to(tl.int64)
    L = tl.load(len_ptr + i).to(tl.int64)
    off = tl.load(off_ptr + i).to(tl.int64)
    boff = tl.load(boff_ptr + i).to(tl.int64)
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, BK)
    offs_v = pv * BV + tl.arange(0, BV)
    mk = offs_k < K
    mv = offs_v < V
    mkv = mk[:, None] & mv[None, :]
    causal = offs_t[:, None] >= offs_t[None, :]
    neg_inf = float("-inf")

    S = tl.zeros([BK, BV], dtype=acc_t)
    if HAS_H0:
        S = tl.load(h0_ptr + i * sh0_n + h * sh0_h + offs_k[:, None] * sh0_k + offs_v[None, :],
                    mask=mkv, other=0.0).to(acc_t)
    ks_first = tl.zeros([BK], dtype=acc_t)
    if HAS_KS0:
        ks_first = tl.load(ks0_ptr + i * sks0_n + h * sks0_h + offs_k, mask=mk,
                           other=0.0).to(acc_t)

    q_base = q_ptr + row * sq_b + h * sq_h
    k_base = k_ptr + row * sk_b + h * sk_h
    v_base = v_ptr + row * sv_b + h * sv_h
    o_base = o_ptr + row * so_b + h * so_h
    n_pieces = (off + L + C - 1) // C
    for s in range(0, n_pieces):
        lo = tl.maximum(s * C - off, 0)
        hi = tl.minimum((s + 1) * C - off, L)
        ksum = tl.where(s == 0, ks_first, 0.0)
        for c0 in range(lo, hi, BT):
            t = c0 + offs_t
            mt = t < hi
            tg = bos + t
            qv = tl.load(q_base + tg[:, None] * sq_t + offs_k[None, :],
                         mask=mt[:, None] & mk[None, :], other=0.0).to(acc_t)
            kv = tl.load(k_base + tg[:, None] * sk_t + offs_k[None, :],
                         mask=mt[:, None] & mk[None, :], other=0.0).to(acc_t)
            vv = tl.load(v_base + tg[:, None] * sv_t + offs_v[None, :],
                         mask=mt[:, None] & mv[None, :], other=0.0).to(acc_t)
            if HAS_A:
                la = tl.load(la_ptr + row * sa_b + tg * sa_t + h * sa_h, mask=mt,
                             other=0.0).to(acc_t)
            else:
                la = tl.zeros([BT], dtype=acc_t)
            if HAS_B:
                bw = tl.load(bw_ptr + row * sb_b + tg * sb_t + h * sb_h, mask=mt,
                             other=0.0).to(acc_t)
                kb = kv * bw[:, None]
            else:
                kb = kv
            A = tl.cumsum(la, 0)
            A_last = tl.sum(la, 0)
            att = tl.dot(qv, tl.trans(kb), input_precision="ieee")
            att = att * tl.exp(tl.where(causal, A[:, None] - A[None, :], neg_inf))
            o = tl.dot(qv * tl.exp(A)[:, None], S, input_precision="ieee")
            o += tl.dot(att, vv, input_precision="ieee")
            tl.store(o_base + tg[:, None] * so_t + offs_v[None, :], o,
                     mask=mt[:, None] & mv[None, :])
            kd = kb * tl.exp(A_last - A)[:, None]
            S = S * tl.exp(A_last) + tl.dot(tl.trans(kd), vv, input_precision="ieee")
            ksum += tl.sum(kv, 0)
        if (s + 1) * C - off <= L:  # this segment is complete: checkpoint it
            bid = tl.load(bid_ptr + boff + s).to(tl.int64)
            tl.store(bs_ptr + bid * sbs_n + h * sbs_h + offs_k[:, None] * sbs_k
                     + offs_v[None, :], S, mask=mkv)
            first_tile = (offs_k * 0 + pv) == 0  # one V tile writes the key sum
            tl.store(bk_ptr + bid * sbk_n + h * sbk_h + offs_k, ksum, mask=mk & first_tile)
            if INDEP:
                S = S * 0.0
    if STORE_FINAL:
        tl.store(ht_ptr + i * sht_n + h * sht_h + offs_k[:, None] * sht_k + offs_v[None, :], S,
                 mask=mkv)


class _Prepared:
    """What ``prepare_prefill`` hands a prefill launcher."""

    def __init__(self, empty: bool, out, final, state_pool, ksum_pool, args: tuple):
        self.empty, self.out, self.final = empty, out, final
        self.state_pool, self.ksum_pool, self.args = state_pool, ksum_pool, args


def prepare_prefill(q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None, b: Tensor | None,
                    initial_state: Tensor | None, *, segment_len: int,
                    cu_seqlens: Tensor | None, mode: str, initial_seg_len: Tensor | int,
                    initial_ksum: Tensor | None, output_final_state: bool,
                    block_ids: Tensor | None, state_pool: Tensor | None,
                    ksum_pool: Tensor | None, out: Tensor | None, chunk_size: int,
                    block_v: int | None) -> _Prepared:
    """The host side both prefill launchers share (this walking kernel and ``chunk.py``'s
    chunk-parallel one): argument checks and layout, output tensors, unit-stride inputs, tile
    sizes. ``.empty`` when there is nothing to compute; else ``.args`` = (layout, out, final,
    block_ids on q's device, state_pool, ksum_pool, q, k, v, initial_state, initial_ksum, BK,
    BV, BT)."""
    lay = check_prefill_args(q, k, v, log_a, b, initial_state, segment_len, cu_seqlens, mode,
                             initial_seg_len, initial_ksum, block_ids, state_pool, ksum_pool)
    out, final, block_ids, state_pool, ksum_pool = _prefill_outputs(
        q, v, lay, block_ids, state_pool, ksum_pool, output_final_state, out)
    H, K = q.shape[2], q.shape[3]
    V = v.shape[-1]
    N = lay["N"]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    for name, x in (("out", out), ("state_pool", state_pool), ("ksum_pool", ksum_pool)):
        if x.stride(-1) != 1 and x.numel() > 0:
            raise ValueError(f"{name} must be contiguous in its last dim")
    if initial_state is not None and initial_state.stride(-1) != 1:
        initial_state = initial_state.contiguous()
    if initial_ksum is not None and initial_ksum.stride(-1) != 1:
        initial_ksum = initial_ksum.contiguous()
    if final is not None and final.numel() and final.stride(-1) != 1:
        raise ValueError("final state must be contiguous in its last dim")
    if N == 0 or H == 0 or K == 0 or V == 0:  # nothing to compute (empty tensors)
        return _Prepared(True, out, final, state_pool, ksum_pool, ())
    BK = triton.next_power_of_2(max(K, 16))
    BV = block_v or min(triton.next_power_of_2(max(V, 16)), 64)
    # token tile: 64 (32 for K > 64, to keep q, k and S of one program in registers)
    BT = triton.next_power_of_2(max(16, min(chunk_size, 64 if BK <= 64 else 32)))
    return _Prepared(False, out, final, state_pool, ksum_pool,
                     (lay, out, final, block_ids.to(q.device), state_pool, ksum_pool, q, k, v,
                      initial_state, initial_ksum, BK, BV, BT))


def chunk_linear_prefill(
    q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None = None, b: Tensor | None = None,
    initial_state: Tensor | None = None, *, segment_len: int, cu_seqlens: Tensor | None = None,
    mode: str = "checkpoint", initial_seg_len: Tensor | int = 0,
    initial_ksum: Tensor | None = None, output_final_state: bool = True,
    block_ids: Tensor | None = None, state_pool: Tensor | None = None,
    ksum_pool: Tensor | None = None, out: Tensor | None = None, chunk_size: int = 64,
    block_v: int | None = None,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """Triton twin of ``twin.chunk_linear_prefill_torch`` (same signature and result).

    One launch, grid (N, H, ⌈V/BV⌉); ``chunk_size`` bounds the token tile BT (a power of two
    in [16, 64], at most 32 when K > 64), ``block_v`` sets the V tile.
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
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = lay["N"]
    dummy = q
    la = log_a if log_a is not None else dummy
    bw = b if b is not None else dummy
    h0 = initial_state if initial_state is not None else dummy
    ks0 = initial_ksum if initial_ksum is not None else dummy
    ht = final if final is not None else dummy
    st = lambda x, n: (x.stride(0), x.stride(1), x.stride(2))[:n]  # noqa: E731
    z3 = (0, 0, 0)
    grid = (N, H, triton.cdiv(V, BV))
    jitted(_chunk_prefill_kernel)[grid](
        q, k, v, la, bw, h0, ks0, out, ht, state_pool, ksum_pool,
        block_ids, lay["bos"], lay["lens"], lay["off"], lay["offsets"],
        K, V, segment_len,
        *st(q, 3), *st(k, 3), *st(v, 3),
        *(st(log_a, 3) if log_a is not None else z3), *(st(b, 3) if b is not None else z3),
        *st(out, 3),
        *(st(initial_state, 3) if initial_state is not None else z3),
        *(st(initial_ksum, 2) if initial_ksum is not None else z3[:2]),
        *(st(final, 3) if final is not None else z3),
        *st(state_pool, 3), *st(ksum_pool, 2),
        VARLEN=cu_seqlens is not None, HAS_A=log_a is not None, HAS_B=b is not None,
        HAS_H0=initial_state is not None, HAS_KS0=initial_ksum is not None,
        STORE_FINAL=final is not None, INDEP=mode == "independent",
        BT=BT, BK=BK, BV=BV, F64=q.dtype == torch.float64,
    )
    return out, final, state_pool, ksum_pool
