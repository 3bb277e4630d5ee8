"""Causal attention over a cached KV plus new tokens: the attention layers of hybrid models.

Two forms with the same signatures, and a test comparing them (tests/test_attention.py):

* ``attend`` (fast: ``scaled_dot_product_attention`` with grouped-query heads) and
  ``naive_attend`` (an explicit float32 softmax, its twin): queries ``(B, T, H, D)`` of the
  tokens at positions ``pos0 .. pos0 + T - 1`` against keys and values ``(B, S, Hkv, D)`` of
  positions ``0 .. S - 1`` (S = pos0 + T), causal;
* ``attend_decode`` and ``naive_attend_decode``: one query per row ``(B, 1, H, D)`` against
  that row's first ``lengths[b]`` keys of a padded ``(B, S, Hkv, D)``;
* ``paged_decode`` and ``naive_paged_decode``: the same against the paged pool through each
  row's block table, read in place with an online softmax: a Triton kernel on CUDA
  (``kernels/triton/paged_attention.py``), one C++ pass on the CPU (float32, ``kernels/cpu``);
  elsewhere the blocks gathered and ``attend_decode``.

The paged KV pool (``write_pages``, ``gather_pages``): keys and values of one layer are
``(num_blocks, block_size, Hkv, D)``; a sequence's tokens live in the blocks its table lists,
token p in block ``table[p // block_size]`` at row ``p % block_size``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mcserve.kernels import cpu as cpu_ops


def _causal_mask(T: int, S: int, device: torch.device) -> Tensor:
    """(T, S) bool: query t (position S - T + t) sees keys 0 .. S - T + t."""
    q = torch.arange(S - T, S, device=device)
    return torch.arange(S, device=device)[None, :] <= q[:, None]


def attend(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """q ``(B, T, H, D)``, k, v ``(B, S, Hkv, D)`` with S ≥ T: the T queries are the last T
    positions; causal. → ``(B, T, H, D)``."""
    T, S = q.shape[1], k.shape[1]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = q.shape[2] != k.shape[2]
    if T == S:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                           enable_gqa=gqa)
    elif T == 1:
        o = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=gqa)
    else:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=_causal_mask(T, S, q.device),
                                           scale=scale, enable_gqa=gqa)
    return o.transpose(1, 2)


def naive_attend(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """``attend``'s twin: the scores, mask and softmax written out, in float32."""
    T, S, H, Hkv = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    rep = H // Hkv
    kf = k.float().repeat_interleave(rep, dim=2)
    vf = v.float().repeat_interleave(rep, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q.float(), kf) * scale
    s = s.masked_fill(~_causal_mask(T, S, q.device), float("-inf"))
    o = torch.einsum("bhts,bshd->bthd", s.softmax(-1), vf)
    return o.to(q.dtype)


def attend_decode(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, scale: float, *,
                  owned: bool = False) -> Tensor:
    """q ``(B, 1, H, D)``; k, v ``(B, S, Hkv, D)`` padded; row b sees keys ``0 ..
    lengths[b] - 1`` (its own token included). → ``(B, 1, H, D)``. What lies past a row's
    length (stale rows of a reused block, another block's padding) is never read, even if it is
    not finite. ``owned``: k and v are the caller's scratch copies (gathered for this call),
    cleared past each row's length in place instead of copied."""
    S = k.shape[1]
    valid = torch.arange(S, device=q.device)[None, :] < lengths[:, None]  # (B, S)
    pad = ~valid[:, :, None, None]
    k = k.masked_fill_(pad, 0) if owned else k.masked_fill(pad, 0)
    v = v.masked_fill_(pad, 0) if owned else v.masked_fill(pad, 0)
    mask = valid[:, None, None, :]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask, scale=scale,
                                       enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2)


def naive_attend_decode(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, scale: float, *,
                        owned: bool = False) -> Tensor:
    """``attend_decode``'s twin: each row alone through ``naive_attend``."""
    rows = [naive_attend(q[b:b + 1], k[b:b + 1, :int(n)], v[b:b + 1, :int(n)], scale)
            for b, n in enumerate(lengths.tolist())]
    return torch.cat(rows)


def write_pages(pool: Tensor, slots: Tensor, x: Tensor) -> None:
    """Write token rows ``x`` ``(n, Hkv, D)`` into ``pool`` ``(num_blocks, block_size, Hkv,
    D)`` at flat rows ``slots`` ``(n,)`` (block · block_size + offset)."""
    pool.view(-1, *pool.shape[2:]).index_copy_(0, slots, x.to(pool.dtype))


def gather_pages(pool: Tensor, table: Tensor, n: int) -> Tensor:
    """A sequence's first ``n`` token rows ``(n, Hkv, D)`` from the blocks ``table`` lists."""
    bs = pool.shape[1]
    nb = -(-n // bs)
    return pool.index_select(0, table[:nb]).reshape(-1, *pool.shape[2:])[:n]


def gather_pages_batch(pool: Tensor, tables: Tensor) -> Tensor:
    """Every row's blocks ``(B, N · block_size, Hkv, D)`` from padded tables ``(B, N)`` (-1:
    no block; read as block 0 and masked by the caller)."""
    B, N = tables.shape
    got = pool.index_select(0, tables.clamp_min(0).reshape(-1))  # (B·N, bs, Hkv, D)
    return got.view(B, N * pool.shape[1], *pool.shape[2:])


def paged_decode(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, lengths: Tensor,
                 scale: float) -> Tensor:
    """q ``(B, 1, H, D)``; one layer's pools ``(num_blocks, block_size, Hkv, D)``; row b's
    first ``lengths[b]`` tokens in the blocks ``tables[b]`` lists (-1 pads). → ``(B, 1, H,
    D)``. Nothing past a row's length is read."""
    from mcserve.kernels import dispatch

    if dispatch.get_backend(q) == "triton":
        from mcserve.kernels.triton.paged_attention import paged_decode as triton_paged_decode

        return triton_paged_decode(q, k_pool, v_pool, tables, lengths, scale)
    y = cpu_ops.paged_attention_decode(q[:, 0], k_pool, v_pool, tables, lengths, scale)
    if y is not None:
        return y[:, None]
    return attend_decode(q, gather_pages_batch(k_pool, tables), gather_pages_batch(v_pool, tables),
                         lengths, scale, owned=True)


def naive_paged_decode(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor,
                       lengths: Tensor, scale: float) -> Tensor:
    """``paged_decode``'s twin: each row's tokens gathered, then ``naive_attend``."""
    rows = []
    for b, n in enumerate(lengths.tolist()):
        k = gather_pages(k_pool, tables[b], int(n))[None]
        v = gather_pages(v_pool, tables[b], int(n))[None]
        rows.append(naive_attend(q[b:b + 1], k, v, scale))
    return torch.cat(rows)
