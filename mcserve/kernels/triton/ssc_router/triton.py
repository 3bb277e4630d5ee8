"""Triton form of the ssc router: the paged MC decode kernel (``mc_decode/single.py``) run with
``ROUTE_ONLY``, stopped after the top-k selection. Signature and result are those of the torch
twin, ``twin.ssc_router_torch``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mcserve.kernels.triton._jit import jitted
from mcserve.kernels.triton._launch import _last_contig, _pow2
from mcserve.kernels.triton.common import _check_router
from mcserve.kernels.triton.mc_decode.single import _paged_decode_kernel


def ssc_router(u: Tensor, ksum_pool: Tensor, table: Tensor, *, segment_len: int, top_k: int,
               row_top_k: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Triton twin of ``twin.ssc_router_torch`` (same signature and result); grid (B, H)."""
    tab = _check_router(u, ksum_pool, table, segment_len, top_k, row_top_k)
    B, H, K = u.shape
    N = tab.shape[-1]
    u, ksum_pool = _last_contig(u), _last_contig(ksum_pool)
    idx = torch.empty(B, H, top_k, dtype=torch.int64, device=u.device)
    sc = torch.empty(B, H, top_k, dtype=u.dtype, device=u.device)
    if B == 0 or H == 0:
        return idx, sc
    jitted(_paged_decode_kernel)[(B, H, 1)](
        u, u, u, u, tab, tab, ksum_pool, ksum_pool, tab,
        row_top_k if row_top_k is not None else tab, sc, idx, sc,
        N, K, 1, segment_len,
        0, 0, u.stride(0), u.stride(1), 0, 0, 0, 0,
        tab.stride(0), tab.stride(1), tab.stride(2), 0, 0, 0,
        0, 0, 0, ksum_pool.stride(0), ksum_pool.stride(1), 0, 0, idx.stride(0), idx.stride(1),
        VARIANT=3, TOP_K=top_k, HAS_NSEG=False, HAS_KROW=row_top_k is not None,
        ROUTE_ONLY=True,
        BN=_pow2(N), BK=_pow2(K, 16), BV=16, F64=u.dtype == torch.float64,
    )
    return idx, sc
