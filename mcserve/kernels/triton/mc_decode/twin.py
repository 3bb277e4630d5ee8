"""Torch twin of the paged MC decode readout (linear family)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mcserve.config import MCConfig
from mcserve.kernels.triton.common import check_decode_args
from mcserve.kernels.triton.ssc_router.twin import _cached_scores, _select, _within_row_k


def paged_mc_decode_linear_torch(
    q: Tensor, u: Tensor, o_online: Tensor, p_online: Tensor, table: Tensor, pool_S: Tensor,
    ksum_pool: Tensor, *, variant: str, segment_len: int, top_k: int = 2,
    n_seg: Tensor | None = None, state_table: Tensor | None = None, out: Tensor | None = None,
    row_top_k: Tensor | None = None,
) -> Tensor:
    """MC readout of one decode token per row over cached blocks read through a block table.

    y = γ_on·o_online + Σ_i γ_i·S_iᵀq with S_i = ``pool_S[state_table[b, i]]`` (one per valid
    table entry) and gates by ``variant``: ``grm``/``soup`` softmax over the cached scores
    r_i = ⟨u, ksum_i/segment_len⟩/√K and the online score ⟨u, p_online⟩/√K; ``ssc`` the same
    over the ``top_k`` best cached blocks (ties → more recent) plus the online memory (per
    row ``min(row_top_k[b], top_k)`` when ``row_top_k`` ``(B,)`` is given: ``top_k`` is then
    the largest count, a compile-time constant of the Triton kernel);
    ``post`` 1/(n+1) each, n = ``n_seg[b]`` or else the row's valid entries; ``residual`` ones.

    Shapes: q, u, p_online ``(B, H, K)``; o_online ``(B, H, V)`` (the online memory's readout
    after this token's update); table/state_table ``(B, N)`` or ``(B, H, N)``; pool_S
    ``(num_blocks, H, K, V)``; ksum_pool ``(num_blocks, H, K)``; n_seg ``(B,)``.
    Returns y ``(B, H, V)`` in q's dtype (written into ``out`` when given).
    """
    tab, stab = check_decode_args(q, u, o_online, p_online, table, pool_S, ksum_pool, variant,
                                  segment_len, top_k, n_seg, state_table, row_top_k)
    B, H, K = q.shape
    N = tab.shape[-1]
    dt = q.dtype
    valid = tab >= 0
    mc = MCConfig(variant=variant)  # its capabilities pick the weights
    if mc.fixed_weights:
        if mc.averages:
            n = (valid.sum(-1) if n_seg is None else n_seg[:, None].expand(B, H)).to(dt)
            w_on = 1.0 / (n + 1.0)
        else:
            w_on = q.new_ones(B, H)
        w_c = valid.to(dt) * w_on[..., None]
        ids = stab
    else:
        r_on = (u * p_online.to(dt)).sum(-1) / math.sqrt(K)  # (B, H)
        r_c = _cached_scores(u, ksum_pool, tab, segment_len)  # (B, H, N)
        ids = stab
        if mc.selects and (N > top_k or row_top_k is not None):  # only the selected
            idx = _select(r_c, min(top_k, N))
            r_c, ids, valid = r_c.gather(-1, idx), stab.gather(-1, idx), valid.gather(-1, idx)
            if row_top_k is not None:  # rows asking for fewer picks drop the extra ones
                valid = valid & _within_row_k(row_top_k, idx.shape[-1])
                r_c = r_c.masked_fill(~valid, float("-inf"))
        gamma = torch.softmax(torch.cat([r_c, r_on[..., None]], -1), -1)
        w_c, w_on = gamma[..., :-1], gamma[..., -1]
    h = torch.arange(H, device=q.device)[None, :, None]
    S = pool_S[ids.clamp_min(0), h].to(dt)  # (B, H, n, K, V): the blocks this step reads
    S = torch.where(valid[..., None, None], S, torch.zeros((), dtype=dt, device=q.device))
    y = o_online.to(dt) * w_on[..., None] + torch.einsum("bhn,bhk,bhnkv->bhv", w_c, q, S)
    if out is None:
        return y
    out.copy_(y)
    return out
