"""Plain reference loop of the paged MC decode readout (the twin's oracle,
``MCSERVE_KERNELS=reference``)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mcserve.config import MCConfig
from mcserve.kernels.triton.common import check_decode_args


def paged_mc_decode_linear_reference(
    q: Tensor, u: Tensor, o_online: Tensor, p_online: Tensor, table: Tensor, pool_S: Tensor,
    ksum_pool: Tensor, *, variant: str, segment_len: int, top_k: int = 2,
    n_seg: Tensor | None = None, state_table: Tensor | None = None, out: Tensor | None = None,
    row_top_k: Tensor | None = None,
) -> Tensor:
    """Plain per-row, per-head loop with the signature of the twin,
    ``paged_mc_decode_linear_torch``."""
    tab, stab = check_decode_args(q, u, o_online, p_online, table, pool_S, ksum_pool, variant,
                                  segment_len, top_k, n_seg, state_table, row_top_k)
    B, H, K = q.shape
    dt = q.dtype
    mc = MCConfig(variant=variant)
    y = o_online.new_zeros(o_online.shape, dtype=dt)
    for bi in range(B):
        for h in range(H):
            cols = [n for n in range(tab.shape[-1]) if int(tab[bi, h, n]) >= 0]
            reads = [pool_S[int(stab[bi, h, n]), h].to(dt).T @ q[bi, h] for n in cols]
            if mc.fixed_weights and not mc.averages:
                w = [1.0] * (len(cols) + 1)
            elif mc.fixed_weights:
                cnt = len(cols) if n_seg is None else int(n_seg[bi])
                w = [1.0 / (cnt + 1)] * (len(cols) + 1)
            else:
                scores = [float(u[bi, h].double() @ ksum_pool[int(tab[bi, h, n]), h].double())
                          / segment_len / math.sqrt(K) for n in cols]
                r_on = float(u[bi, h].double() @ p_online[bi, h].double()) / math.sqrt(K)
                keep = list(range(len(cols)))
                if mc.selects:
                    kk = top_k if row_top_k is None else min(top_k, int(row_top_k[bi]))
                    keep = sorted(keep, key=lambda j: (scores[j], j), reverse=True)[:kk]
                r = torch.tensor([scores[j] for j in keep] + [r_on], dtype=torch.float64)
                g = torch.softmax(r, 0).tolist()
                w = [0.0] * (len(cols) + 1)
                for j, gj in zip(keep + [len(cols)], g):
                    w[j] = gj
            acc = w[-1] * o_online[bi, h].to(dt)
            for j, rd in enumerate(reads):
                if w[j]:
                    acc = acc + w[j] * rd
            y[bi, h] = acc
    if out is None:
        return y
    out.copy_(y)
    return out
