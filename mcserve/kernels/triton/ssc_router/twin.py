"""Torch twin of the ssc router: the cached blocks' scores and the top-k selection.

The scores and the selection here are also what the decode readout's ``ssc`` variant uses
(``mc_decode.twin``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mcserve.kernels.triton.common import _check_router


def _select(r: Tensor, top_k: int) -> Tensor:
    """Columns of the ``top_k`` largest scores along the last dim, ties to the larger column
    (the more recent block), best first. Same rule as ``MCMemory._select``."""
    N = r.shape[-1]
    order = torch.sort(r.flip(-1), dim=-1, descending=True, stable=True).indices
    return N - 1 - order[..., :top_k]


def _cached_scores(u: Tensor, ksum_pool: Tensor, tab: Tensor, segment_len: int) -> Tensor:
    """r ``(B, H, N)`` = ⟨u, ksum/segment_len⟩/√K, ``-inf`` where the table holds -1."""
    B, H, N = tab.shape
    K = u.shape[-1]
    valid = tab >= 0
    h = torch.arange(H, device=u.device)[None, :, None]
    ks = ksum_pool[tab.clamp_min(0), h].to(u.dtype)  # (B, H, N, K)
    ks = torch.where(valid[..., None], ks, torch.zeros((), dtype=u.dtype, device=u.device))
    r = torch.einsum("bhk,bhnk->bhn", u, ks) / (segment_len * math.sqrt(K))
    return r.masked_fill(~valid, float("-inf"))


def _within_row_k(row_top_k: Tensor, k: int) -> Tensor:
    """``(B, 1, k)`` bool: pick j of row b is kept iff j < row_top_k[b]."""
    return (torch.arange(k, device=row_top_k.device) < row_top_k[:, None])[:, None, :]


def ssc_router_torch(u: Tensor, ksum_pool: Tensor, table: Tensor, *, segment_len: int,
                     top_k: int, row_top_k: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Top-k cached blocks per row and head by r_i = ⟨u, ksum_i/segment_len⟩/√K.

    u ``(B, H, K)``, ksum_pool ``(num_blocks, H, K)``, table ``(B, N)`` or ``(B, H, N)`` (-1
    padded). Returns ``(indices, scores)``, both ``(B, H, top_k)``: *columns* of the table
    (int64; gather the block ids with ``table.gather``), best first, ties → the more recent
    (larger column); rows with fewer than ``top_k`` valid blocks are padded with index -1 and
    score -inf. Scores are in u's dtype. ``row_top_k`` ``(B,)``: row b keeps only its first
    ``row_top_k[b]`` picks (the rest padded the same way).
    """
    tab = _check_router(u, ksum_pool, table, segment_len, top_k, row_top_k)
    B, H, N = tab.shape
    r = _cached_scores(u, ksum_pool, tab, segment_len)
    kk = min(top_k, N)
    idx = _select(r, kk)
    sc = r.gather(-1, idx)
    drop = tab.gather(-1, idx) < 0
    if row_top_k is not None:
        drop = drop | ~_within_row_k(row_top_k, kk)
    idx = idx.masked_fill(drop, -1)
    sc = sc.masked_fill(drop, float("-inf"))
    if kk < top_k:
        idx = torch.cat([idx, idx.new_full((B, H, top_k - kk), -1)], -1)
        sc = torch.cat([sc, sc.new_full((B, H, top_k - kk), float("-inf"))], -1)
    return idx, sc
