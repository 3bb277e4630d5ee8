"""Triton kernel: the decode attention of a hybrid model's attention layer over the paged KV pool.

One program per (row, query head): it walks the row's blocks through its block table, loads a
``(block_size, D)`` tile of keys of its KV head (grouped-query: head h reads KV head h / rep),
scores it against the query, keeps an online softmax (running max and sum) and a ``(D,)``
accumulator of the weighted values, all in float32; tokens past the row's length are masked on
load, so nothing past it is read. Grid (B, H). Signature and result:
``kernels.attention.paged_decode`` (``naive_paged_decode`` is the twin).
"""

from __future__ import annotations

import torch
import triton.language as tl
from torch import Tensor

from mcserve.kernels.triton._jit import jitted
from mcserve.kernels.triton._launch import _pow2


def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, t_ptr, l_ptr, o_ptr,
    REP, D, BS, scale,
    sq_b, sq_h, sk_n, sk_s, sk_h, st_b, so_b, so_h,
    BD: tl.constexpr, BSP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    g = h // REP
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    offs_s = tl.arange(0, BSP)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + offs_d, mask=md, other=0.0).to(tl.float32)
    L = tl.load(l_ptr + b).to(tl.int64)
    m_i = tl.max(tl.full([BSP], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BSP], tl.float32), 0)
    acc = tl.zeros([BD], tl.float32)
    n_blocks = (L + BS - 1) // BS
    for j in range(0, n_blocks):
        blk = tl.load(t_ptr + b * st_b + j).to(tl.int64)
        ms = (offs_s < BS) & (j * BS + offs_s < L)
        off = blk * sk_n + offs_s[:, None] * sk_s + g * sk_h + offs_d[None, :]
        mask = ms[:, None] & md[None, :]
        kt = tl.load(k_ptr + off, mask=mask, other=0.0).to(tl.float32)  # (BSP, BD)
        s = tl.sum(kt * q[None, :], axis=1) * scale
        s = tl.where(ms, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        vt = tl.load(v_ptr + off, mask=mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * vt, axis=0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    out = acc / l_i
    tl.store(o_ptr + b * so_b + h * so_h + offs_d, out.to(o_ptr.dtype.element_ty), mask=md)


def paged_decode(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, lengths: Tensor,
                 scale: float) -> Tensor:
    """q ``(B, 1, H, D)``; one layer's pools ``(num_blocks, block_size, Hkv, D)`` (contiguous
    in their last two dims); ``tables`` ``(B, N)``; ``lengths`` ``(B,)``. → ``(B, 1, H, D)``."""
    B, _, H, D = q.shape
    NB, BS, Hkv, _ = k_pool.shape
    q2 = q[:, 0]
    tables = tables.contiguous()
    lengths = lengths.contiguous()
    o = torch.empty((B, H, D), dtype=q.dtype, device=q.device)
    if B == 0:
        return o[:, None]
    assert k_pool.stride() == v_pool.stride() and k_pool.stride(-1) == 1 \
        and k_pool.stride(-2) == D, "paged_decode: pools with (Hkv, D) rows contiguous expected"
    jitted(_paged_decode_kernel)[(B, H)](
        q2, k_pool, v_pool, tables, lengths, o,
        H // Hkv, D, BS, float(scale),
        q2.stride(0), q2.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        tables.stride(0), o.stride(0), o.stride(1),
        BD=_pow2(D), BSP=_pow2(BS),
    )
    return o[:, None]
