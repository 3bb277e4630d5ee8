"""Plain reference loop of the ssc router (the twin's oracle, ``MCSERVE_KERNELS=reference``)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mcserve.kernels.triton.common import _check_router


def ssc_router_reference(u: Tensor, ksum_pool: Tensor, table: Tensor, *, segment_len: int,
                         top_k: int, row_top_k: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Plain loop with the signature and result of the twin, ``ssc_router_torch``."""
    tab = _check_router(u, ksum_pool, table, segment_len, top_k, row_top_k)
    B, H, N = tab.shape
    K = u.shape[-1]
    idx = torch.full((B, H, top_k), -1, dtype=torch.int64, device=u.device)
    sc = torch.full((B, H, top_k), float("-inf"), dtype=u.dtype, device=u.device)
    for bi in range(B):
        for h in range(H):
            cand = [(float(u[bi, h].double() @ ksum_pool[int(tab[bi, h, n]), h].double())
                     / segment_len / math.sqrt(K), n)
                    for n in range(N) if int(tab[bi, h, n]) >= 0]
            cand.sort(reverse=True)  # score, then the larger column first
            kk = top_k if row_top_k is None else min(top_k, int(row_top_k[bi]))
            for j, (s, n) in enumerate(cand[:kk]):
                idx[bi, h, j] = n
                sc[bi, h, j] = s
    return idx, sc
