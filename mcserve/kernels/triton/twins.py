"""Torch twins (and plain reference loops) of the Triton kernels in this package.

Every Triton kernel here has a torch *twin* with the same signature and result: the vectorised
path used on CPU, and the thing the kernel is tested against (docs/kernels.md). A third, plainly
written *reference* version (Python loops over rows, heads and tokens) backs
``MCSERVE_KERNELS=reference`` and is the oracle of the twins themselves. Nothing in this module
imports triton.

Shared conventions (see ``docs/kernels.md``):

* a **block table** is ``(B, N)`` (one list of block ids per row) or ``(B, H, N)`` (one list per
  row and head, e.g. the ssc router's picks), int, padded with ``-1``; entries are in segment
  order (column ``n`` is the ``n``-th oldest cached segment of the row), so "more recent" means
  "larger column";
* ``pool_S`` ``(num_blocks, H, K, V)`` and ``ksum_pool`` ``(num_blocks, H, K)`` are one layer's
  slice of the engine's block pool, read in place through the table;
* ``state_table`` (same shape as ``table``, optional) names the pool rows the *states* are read
  from when they differ from the ids the key sums are read from (host-tier blocks staged into
  device rows by ``StateCache.fetch``: key sums always stay on the device under their own ids).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mcserve.config import VARIANTS, MCConfig
from mcserve.kernels.gla import chunk_gla, naive_gla

# the variants whose checkpoints are constant blocks: what a block-table readout can serve
DECODE_VARIANTS = tuple(v for v in VARIANTS if MCConfig(variant=v).caches_blocks)
PREFILL_MODES = ("checkpoint", "independent")

__all__ = [
    "DECODE_VARIANTS", "PREFILL_MODES", "boundary_layout",
    "paged_mc_decode_linear_torch", "paged_mc_decode_linear_reference",
    "ssc_router_torch", "ssc_router_reference",
    "chunk_linear_prefill_torch", "chunk_linear_prefill_reference",
    "FUSED_VARIANTS", "fused_linear_decode_torch",
]


# ---------------------------------------------------------------------------------------------
# argument checks shared by the twins and the Triton wrappers
# ---------------------------------------------------------------------------------------------


def _head_table(table: Tensor, B: int, H: int, name: str = "table") -> Tensor:
    """``(B, N)`` or ``(B, H, N)`` int table → a ``(B, H, N)`` view (no copy)."""
    if table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an int32/int64 tensor, got {table.dtype}")
    if table.dim() == 2 and table.shape[0] == B:
        return table[:, None, :].expand(B, H, table.shape[1])
    if table.dim() == 3 and table.shape[:2] == (B, H):
        return table
    raise ValueError(f"{name} must be (B, N) or (B, H, N) with B={B}, H={H}, "
                     f"got {tuple(table.shape)}")


def check_decode_args(q: Tensor, u: Tensor, o_online: Tensor, p_online: Tensor, table: Tensor,
                      pool_S: Tensor, ksum_pool: Tensor, variant: str, segment_len: int,
                      top_k: int, n_seg: Tensor | None, state_table: Tensor | None,
                      row_top_k: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Validate the decode arguments; return ``(table, state_table)`` as ``(B, H, N)`` views."""
    if variant not in DECODE_VARIANTS:
        raise ValueError(f"variant must be one of {DECODE_VARIANTS}, got {variant!r}")
    if not isinstance(segment_len, int) or segment_len < 1:
        raise ValueError(f"segment_len must be a positive integer, got {segment_len!r}")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    if q.dim() != 3:
        raise ValueError(f"q must be (B, H, K), got {tuple(q.shape)}")
    B, H, K = q.shape
    if u.shape != q.shape or p_online.shape != q.shape:
        raise ValueError(f"u and p_online must have q's shape {tuple(q.shape)}, got "
                         f"{tuple(u.shape)} and {tuple(p_online.shape)}")
    if o_online.dim() != 3 or o_online.shape[:2] != (B, H):
        raise ValueError(f"o_online must be (B, H, V), got {tuple(o_online.shape)}")
    V = o_online.shape[2]
    if pool_S.dim() != 4 or pool_S.shape[1:] != (H, K, V):
        raise ValueError(f"pool_S must be (num_blocks, {H}, {K}, {V}), got {tuple(pool_S.shape)}")
    if ksum_pool.dim() != 3 or ksum_pool.shape[1:] != (H, K):
        raise ValueError(f"ksum_pool must be (num_blocks, {H}, {K}), got "
                         f"{tuple(ksum_pool.shape)}")
    tab = _head_table(table, B, H)
    stab = tab if state_table is None else _head_table(state_table, B, H, "state_table")
    if stab.shape != tab.shape:
        raise ValueError(f"state_table must have table's shape {tuple(table.shape)}, got "
                         f"{tuple(state_table.shape)}")
    if n_seg is not None and n_seg.shape != (B,):
        raise ValueError(f"n_seg must be (B,) = ({B},), got {tuple(n_seg.shape)}")
    _check_row_top_k(row_top_k, B)
    return tab, stab


def _check_row_top_k(row_top_k: Tensor | None, B: int) -> None:
    if row_top_k is not None and (row_top_k.shape != (B,) or row_top_k.dtype.is_floating_point):
        raise ValueError(f"row_top_k must be an int tensor of shape ({B},), got "
                         f"{row_top_k.dtype} {tuple(row_top_k.shape)}")


def boundary_layout(lengths: Tensor, segment_len: int, initial_seg_len: Tensor | int = 0
                    ) -> tuple[Tensor, Tensor]:
    """Where each sequence's segment boundaries go in ``chunk_linear_prefill``'s outputs.

    ``lengths`` ``(N,)`` tokens per sequence in this call, ``initial_seg_len`` (int or ``(N,)``)
    tokens each sequence already has in its current segment. Returns ``(counts, offsets)``,
    both ``(N,)`` int64: sequence ``i`` completes ``counts[i] = (initial_seg_len[i] +
    lengths[i]) // segment_len`` segments, whose states are rows ``offsets[i] ..
    offsets[i] + counts[i] - 1`` of ``boundary_states`` (sequence-major, oldest first).
    """
    lengths = lengths.to(torch.int64)
    off = torch.as_tensor(initial_seg_len, dtype=torch.int64, device=lengths.device)
    counts = (off.expand_as(lengths) + lengths) // segment_len
    offsets = torch.cumsum(counts, 0) - counts
    return counts, offsets


def check_prefill_args(q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None, b: Tensor | None,
                       initial_state: Tensor | None, segment_len: int,
                       cu_seqlens: Tensor | None, mode: str, initial_seg_len,
                       initial_ksum: Tensor | None, block_ids: Tensor | None,
                       state_pool: Tensor | None, ksum_pool: Tensor | None) -> dict:
    """Validate the prefill arguments; return the per-sequence layout (all int64, on q's device).

    Keys: ``N`` sequences, ``bos``/``lens``/``off`` ``(N,)`` (start row in dim 1, tokens,
    tokens already in the current segment), ``counts``/``offsets`` (see
    :func:`boundary_layout`), ``total`` boundaries.
    """
    if mode not in PREFILL_MODES:
        raise ValueError(f"mode must be one of {PREFILL_MODES}, got {mode!r}")
    if not isinstance(segment_len, int) or segment_len < 1:
        raise ValueError(f"segment_len must be a positive integer, got {segment_len!r}")
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must be (B, T, H, K) alike, got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be (B, T, H, V), got {tuple(v.shape)}")
    V = v.shape[3]
    for name, g in (("log_a", log_a), ("b", b)):
        if g is not None and g.shape != (B, T, H):
            raise ValueError(f"{name} must be (B, T, H) = {(B, T, H)}, got {tuple(g.shape)}")
    dev = q.device
    if cu_seqlens is None:
        N = B
        bos = torch.zeros(N, dtype=torch.int64, device=dev)
        lens = torch.full((N,), T, dtype=torch.int64, device=dev)
    else:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch dim must be 1, got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be 1-D with N + 1 >= 2 entries")
        cu = cu_seqlens.to(device=dev, dtype=torch.int64)
        N = cu.numel() - 1
        bos, lens = cu[:-1], cu[1:] - cu[:-1]
        if int(cu[0]) != 0 or int(cu[-1]) != T or bool((lens < 0).any()):
            raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {cu_seqlens.tolist()}")
    off = torch.as_tensor(initial_seg_len, dtype=torch.int64, device=dev).expand(N).contiguous()
    if bool(((off < 0) | (off >= segment_len)).any()):
        raise ValueError(f"initial_seg_len must lie in [0, segment_len={segment_len})")
    if initial_state is not None and initial_state.shape != (N, H, K, V):
        raise ValueError(f"initial_state must be (N, H, K, V) = {(N, H, K, V)}, got "
                         f"{tuple(initial_state.shape)}")
    if initial_ksum is not None and initial_ksum.shape != (N, H, K):
        raise ValueError(f"initial_ksum must be (N, H, K) = {(N, H, K)}, got "
                         f"{tuple(initial_ksum.shape)}")
    counts, offsets = boundary_layout(lens, segment_len, off)
    total = int(counts.sum())
    given = [x is not None for x in (block_ids, state_pool, ksum_pool)]
    if any(given) and not all(given):
        raise ValueError("block_ids, state_pool and ksum_pool go together")
    if block_ids is not None:
        if block_ids.shape != (total,):
            raise ValueError(f"block_ids must be ({total},): one id per completed segment, got "
                             f"{tuple(block_ids.shape)}")
        if state_pool.dim() != 4 or state_pool.shape[1:] != (H, K, V):
            raise ValueError(f"state_pool must be (num_blocks, {H}, {K}, {V}), got "
                             f"{tuple(state_pool.shape)}")
        if ksum_pool.dim() != 3 or ksum_pool.shape[1:] != (H, K):
            raise ValueError(f"ksum_pool must be (num_blocks, {H}, {K}), got "
                             f"{tuple(ksum_pool.shape)}")
    return dict(N=N, bos=bos, lens=lens, off=off, counts=counts, offsets=offsets, total=total)


def _prefill_outputs(q: Tensor, v: Tensor, lay: dict, block_ids, state_pool, ksum_pool,
                     output_final_state: bool, out: Tensor | None):
    B, T, H, K = q.shape
    V = v.shape[-1]
    if out is None:
        out = v.new_empty(B, T, H, V)
    elif out.shape != (B, T, H, V):
        raise ValueError(f"out must be {(B, T, H, V)}, got {tuple(out.shape)}")
    if block_ids is None:
        total = lay["total"]
        state_pool = q.new_empty(total, H, K, V)
        ksum_pool = q.new_empty(total, H, K)
        block_ids = torch.arange(total, device=q.device)
    final = q.new_empty(lay["N"], H, K, V) if output_final_state else None
    return out, final, block_ids, state_pool, ksum_pool


# ---------------------------------------------------------------------------------------------
# 1. paged MC decode readout (linear family)
# ---------------------------------------------------------------------------------------------


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


def paged_mc_decode_linear_reference(
    q: Tensor, u: Tensor, o_online: Tensor, p_online: Tensor, table: Tensor, pool_S: Tensor,
    ksum_pool: Tensor, *, variant: str, segment_len: int, top_k: int = 2,
    n_seg: Tensor | None = None, state_table: Tensor | None = None, out: Tensor | None = None,
    row_top_k: Tensor | None = None,
) -> Tensor:
    """Plain per-row, per-head loop with the signature of :func:`paged_mc_decode_linear_torch`."""
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


# ---------------------------------------------------------------------------------------------
# 2. ssc router
# ---------------------------------------------------------------------------------------------


def _within_row_k(row_top_k: Tensor, k: int) -> Tensor:
    """``(B, 1, k)`` bool: pick j of row b is kept iff j < row_top_k[b]."""
    return (torch.arange(k, device=row_top_k.device) < row_top_k[:, None])[:, None, :]


def _check_router(u: Tensor, ksum_pool: Tensor, table: Tensor, segment_len: int, top_k: int,
                  row_top_k: Tensor | None = None) -> Tensor:
    if not isinstance(segment_len, int) or segment_len < 1:
        raise ValueError(f"segment_len must be a positive integer, got {segment_len!r}")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    if u.dim() != 3:
        raise ValueError(f"u must be (B, H, K), got {tuple(u.shape)}")
    B, H, K = u.shape
    if ksum_pool.dim() != 3 or ksum_pool.shape[1:] != (H, K):
        raise ValueError(f"ksum_pool must be (num_blocks, {H}, {K}), got "
                         f"{tuple(ksum_pool.shape)}")
    _check_row_top_k(row_top_k, B)
    return _head_table(table, B, H)


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


def ssc_router_reference(u: Tensor, ksum_pool: Tensor, table: Tensor, *, segment_len: int,
                         top_k: int, row_top_k: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Plain loop with the signature and result of :func:`ssc_router_torch`."""
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


# ---------------------------------------------------------------------------------------------
# 3. chunked linear prefill with segment checkpoints
# ---------------------------------------------------------------------------------------------


def _prefill_span(gla, q, k, v, log_a, b, S, ks0, off, C, independent, chunk_size):
    """One batch of rows with the same length and segment offset. Returns o, final S, and the
    (state, key sum) of every completed segment, oldest first."""
    T = q.shape[1]
    outs, bounds, pos, fill = [], [], 0, off
    ksum = ks0
    while pos < T:
        n = min(T - pos, C - fill)
        sl = slice(pos, pos + n)
        o, S = gla(q[:, sl], k[:, sl], v[:, sl], None if log_a is None else log_a[:, sl],
                   None if b is None else b[:, sl], S, chunk_size)
        outs.append(o)
        ksum = ksum + k[:, sl].sum(1)
        pos, fill = pos + n, fill + n
        if fill == C:
            bounds.append((S, ksum))
            ksum = torch.zeros_like(ksum)
            fill = 0
            if independent:
                S = torch.zeros_like(S)
    o = torch.cat(outs, 1) if outs else v.new_zeros(v.shape)
    return o, S, bounds


def _prefill_impl(gla, q, k, v, log_a, b, initial_state, *, segment_len, cu_seqlens, mode,
                  initial_seg_len, initial_ksum, output_final_state, block_ids, state_pool,
                  ksum_pool, out, chunk_size):
    lay = check_prefill_args(q, k, v, log_a, b, initial_state, segment_len, cu_seqlens, mode,
                             initial_seg_len, initial_ksum, block_ids, state_pool, ksum_pool)
    out, final, block_ids, state_pool, ksum_pool = _prefill_outputs(
        q, v, lay, block_ids, state_pool, ksum_pool, output_final_state, out)
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = q.dtype
    N = lay["N"]
    S0 = (q.new_zeros(N, H, K, V) if initial_state is None else initial_state.to(dt))
    ks0 = q.new_zeros(N, H, K) if initial_ksum is None else initial_ksum.to(dt)
    independent = mode == "independent"
    off = lay["off"].tolist()
    if cu_seqlens is None and len(set(off)) <= 1:  # all rows alike: one batched pass
        groups = [(list(range(N)), slice(0, T), off[0] if off else 0)]
        row_of = None
    else:  # ragged: one pass per sequence
        bos, lens = lay["bos"].tolist(), lay["lens"].tolist()
        if cu_seqlens is None:
            groups = [([i], slice(0, T), off[i]) for i in range(N)]
            row_of = list(range(N))
        else:
            groups = [([i], slice(bos[i], bos[i] + lens[i]), off[i]) for i in range(N)]
            row_of = [0] * N
    counts, offsets = lay["counts"].tolist(), lay["offsets"].tolist()
    for seqs, span, o_ in groups:
        rows = seqs if row_of is None else [row_of[i] for i in seqs]
        r = torch.tensor(rows, device=q.device)
        s = torch.tensor(seqs, device=q.device)
        pick = lambda x, r=r, span=span: None if x is None else x[r, span]  # noqa: E731
        o, S, bounds = _prefill_span(gla, pick(q), pick(k), pick(v), pick(log_a), pick(b), S0[s],
                                     ks0[s], o_, segment_len, independent, chunk_size)
        out[r, span] = o.to(out.dtype)
        if final is not None:
            final[s] = S
        for j, (Sj, kj) in enumerate(bounds):
            ids = block_ids[torch.tensor([offsets[i] + j for i in seqs], device=q.device)]
            assert all(counts[i] > j for i in seqs)
            state_pool[ids] = Sj.to(state_pool.dtype)
            ksum_pool[ids] = kj.to(ksum_pool.dtype)
    return out, final, state_pool, ksum_pool


def chunk_linear_prefill_torch(
    q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None = None, b: Tensor | None = None,
    initial_state: Tensor | None = None, *, segment_len: int, cu_seqlens: Tensor | None = None,
    mode: str = "checkpoint", initial_seg_len: Tensor | int = 0,
    initial_ksum: Tensor | None = None, output_final_state: bool = True,
    block_ids: Tensor | None = None, state_pool: Tensor | None = None,
    ksum_pool: Tensor | None = None, out: Tensor | None = None, chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """Gated linear attention S_t = a_t·S_{t-1} + b_t·k_t v_tᵀ, o_t = S_tᵀq_t (the online term of
    MC prefill), also emitting the state and key sum at every segment boundary.

    q, k ``(B, T, H, K)``; v ``(B, T, H, V)``; log_a (log of the decay a, ≤ 0) and b (write
    gate) ``(B, T, H)`` or None (no decay / unit write); initial_state ``(N, H, K, V)`` or None
    (zeros). Variable-length batches as in flash-linear-attention: B = 1 and ``cu_seqlens``
    ``(N + 1,)`` (else N = B). ``initial_seg_len`` (int or ``(N,)``) = tokens each sequence
    already has in its current segment, ``initial_ksum`` ``(N, H, K)`` their key sum (added to
    that segment's sum). ``mode="independent"`` restarts the state from zero after every
    completed segment (the final state is then zero when a sequence ends on a boundary).

    Returns ``(o, final_state, boundary_states, boundary_ksums)``: o ``(B, T, H, V)``;
    final_state ``(N, H, K, V)`` (None unless ``output_final_state``); the state after the last
    token of every completed segment and that segment's key sum (Σ k, unweighted by b). Without
    ``block_ids`` these are fresh ``(total, H, K, V)`` / ``(total, H, K)`` tensors laid out by
    :func:`boundary_layout`; with ``block_ids`` ``(total,)`` they are written in place into
    ``state_pool`` ``(num_blocks, H, K, V)`` / ``ksum_pool`` ``(num_blocks, H, K)`` at those
    rows, and the pools are returned.
    """
    return _prefill_impl(chunk_gla, q, k, v, log_a, b, initial_state, segment_len=segment_len,
                         cu_seqlens=cu_seqlens, mode=mode, initial_seg_len=initial_seg_len,
                         initial_ksum=initial_ksum, output_final_state=output_final_state,
                         block_ids=block_ids, state_pool=state_pool, ksum_pool=ksum_pool,
                         out=out, chunk_size=chunk_size)


def chunk_linear_prefill_reference(
    q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None = None, b: Tensor | None = None,
    initial_state: Tensor | None = None, *, segment_len: int, cu_seqlens: Tensor | None = None,
    mode: str = "checkpoint", initial_seg_len: Tensor | int = 0,
    initial_ksum: Tensor | None = None, output_final_state: bool = True,
    block_ids: Tensor | None = None, state_pool: Tensor | None = None,
    ksum_pool: Tensor | None = None, out: Tensor | None = None, chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """:func:`chunk_linear_prefill_torch` with the per-token recurrence (``naive_gla``)."""
    return _prefill_impl(naive_gla, q, k, v, log_a, b, initial_state, segment_len=segment_len,
                         cu_seqlens=cu_seqlens, mode=mode, initial_seg_len=initial_seg_len,
                         initial_ksum=initial_ksum, output_final_state=output_final_state,
                         block_ids=block_ids, state_pool=state_pool, ksum_pool=ksum_pool,
                         out=out, chunk_size=chunk_size)


# ---------------------------------------------------------------------------------------------
# 4. fused per-layer decode of the gated linear memory (native mixer, Mamba2 mixer)
# ---------------------------------------------------------------------------------------------

FUSED_VARIANTS = ("none", "residual", "post", "grm", "soup", "ssc")
GATE_MODES = ("given", "sigmoid", "softplus")


def rows_views(B: int, state_rows: Tensor | None, **pools: Tensor | None
               ) -> dict[str, Tensor | None]:
    """With ``state_rows`` ``(B,)`` (row b's state lives at ``state_rows[b]`` of each pool):
    ``(B, ...)`` stand-ins of the pools for the shape checks (no data is read), after checking
    ``state_rows``. Without: the tensors as given."""
    if state_rows is None:
        return pools
    if state_rows.dim() != 1 or state_rows.shape[0] != B or state_rows.dtype not in (
            torch.int32, torch.int64):
        raise ValueError(f"state_rows must be an int32/int64 tensor of shape ({B},), got "
                         f"{state_rows.dtype} {tuple(state_rows.shape)}")
    out: dict[str, Tensor | None] = {}
    for name, t in pools.items():
        if t is not None and t.shape[0] == 0:
            raise ValueError(f"{name}: an empty pool cannot hold state_rows")
        out[name] = None if t is None else t[:1].expand((B,) + t.shape[1:])
    return out


def check_fused_args(x: Tensor, z: Tensor | None, S: Tensor, *, q_offset: int, k_offset: int,
                     v_offset: int, qk_heads: int, conv_tail, conv_weight, conv_bias, u,
                     gate_mode: str, log_a, b, dt, dt_bias, A_log, D, norm_weight,
                     norm_group: int | None, variant: str, segment_len: int, top_k: int,
                     seg_ksum, seg_len, n_seg, table, state_table, pool_S, ksum_pool, csum,
                     row_top_k) -> dict:
    """Validate ``fused_linear_decode``'s arguments; return the sizes it uses."""
    if S.dim() != 4:
        raise ValueError(f"S must be (B, H, K, V), got {tuple(S.shape)}")
    B, H, K, V = S.shape
    if x.dim() != 2 or x.shape[0] != B:
        raise ValueError(f"x must be (B, channels) with B={B}, got {tuple(x.shape)}")
    CC = x.shape[1]
    if qk_heads < 1 or H % qk_heads:
        raise ValueError(f"qk_heads ({qk_heads}) must divide the number of heads ({H})")
    G = H // qk_heads  # q/k groups
    spans = sorted([(v_offset, H * V), (q_offset, G * K), (k_offset, G * K)])
    pos = 0
    for start, n in spans:  # the q, k and v channels tile [0, CC) exactly
        if start != pos:
            raise ValueError(f"q ({q_offset}), k ({k_offset}) and v ({v_offset}) channel ranges "
                             f"must tile the {CC} channels of x without gaps or overlaps")
        pos += n
    if pos != CC:
        raise ValueError(f"x has {CC} channels, q/k/v cover {pos}")
    if (conv_tail is None) != (conv_weight is None):
        raise ValueError("conv_tail and conv_weight go together")
    if conv_tail is not None:
        W = conv_weight.shape[-1]
        if conv_weight.shape != (CC, W) or conv_tail.shape != (B, W - 1, CC) or W < 2:
            raise ValueError(f"conv_weight must be ({CC}, W) and conv_tail (B, W - 1, {CC}) with "
                             f"W ≥ 2, got {tuple(conv_weight.shape)}, {tuple(conv_tail.shape)}")
        if conv_bias is not None and conv_bias.shape != (CC,):
            raise ValueError(f"conv_bias must be ({CC},)")
    if u is not None and u.shape != (B, H, K):
        raise ValueError(f"u must be (B, H, K) = {(B, H, K)}, got {tuple(u.shape)}")
    if gate_mode not in GATE_MODES:
        raise ValueError(f"gate_mode must be one of {GATE_MODES}, got {gate_mode!r}")
    if gate_mode == "softplus":
        if dt is None or dt_bias is None or A_log is None or log_a is not None or b is not None:
            raise ValueError("gate_mode='softplus' takes dt, dt_bias and A_log (no log_a / b)")
        gates = (("dt", dt),)
        if dt_bias.shape != (H,) or A_log.shape != (H,):
            raise ValueError(f"dt_bias and A_log must be ({H},)")
    else:
        if dt is not None:
            raise ValueError("dt is for gate_mode='softplus'")
        gates = (("log_a", log_a), ("b", b))
    for name, g in gates:
        if g is not None and g.shape != (B, H):
            raise ValueError(f"{name} must be (B, H) = {(B, H)}, got {tuple(g.shape)}")
    if D is not None and D.shape not in ((H,), (H * V,)):
        raise ValueError(f"D must be ({H},) or ({H * V},), got {tuple(D.shape)}")
    if z is not None and z.shape != (B, H * V):
        raise ValueError(f"z must be (B, H·V) = {(B, H * V)}, got {tuple(z.shape)}")
    GS = norm_group or V
    if norm_weight is not None:
        if GS % V or (H * V) % GS:
            raise ValueError(f"norm_group ({GS}) must be a multiple of V ({V}) dividing H·V")
        if norm_weight.shape not in ((GS,), (H * V,)):
            raise ValueError(f"norm_weight must be ({GS},) or ({H * V},)")
    if variant not in FUSED_VARIANTS:
        raise ValueError(f"variant must be one of {FUSED_VARIANTS}, got {variant!r}")
    if variant != "none":
        if seg_ksum is None or seg_ksum.shape != (B, H, K):
            raise ValueError(f"variant {variant!r} needs seg_ksum (B, H, K) = {(B, H, K)}")
    if variant == "post" and (n_seg is None or n_seg.shape != (B,)):
        raise ValueError("variant 'post' needs n_seg (B,)")
    if variant in ("residual", "post") and csum is not None and csum.shape != S.shape:
        raise ValueError(f"csum must have S's shape {tuple(S.shape)}")
    if variant in ("grm", "soup", "ssc"):
        if seg_len is None or seg_len.shape != (B,):
            raise ValueError(f"variant {variant!r} needs seg_len (B,)")
        if table is None or pool_S is None or ksum_pool is None:
            raise ValueError(f"variant {variant!r} needs table, pool_S and ksum_pool")
        q0 = S.new_empty(B, H, K)
        check_decode_args(q0, q0, S.new_empty(B, H, V), q0, table, pool_S, ksum_pool, variant,
                          segment_len, top_k, None, state_table, row_top_k)
    return dict(B=B, H=H, K=K, V=V, CC=CC, G=G, GS=GS)


def fused_linear_decode_torch(
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
    """One decode token per row through a gated-linear-memory mixer, from its projections to
    the gated, normalised output (what ``o_proj`` / ``out_proj`` reads).

    ``state_rows`` ``(B,)``: S, conv_tail, seg_ksum and csum are pools whose row
    ``state_rows[b]`` is row b's (read and updated there: the engine's slot pool, no gather
    into a batch); rows may repeat only where their results are discarded (padding).

    x ``(B, CC)``: the token's conv-input channels (pre-conv): v of head h at channels
    ``v_offset + h·V``, q and k of q/k group g (``qk_heads`` heads share one: Mamba2's B/C) at
    ``q_offset + g·K`` / ``k_offset + g·K``; the three ranges tile ``[0, CC)``. Steps:

    1. conv (when ``conv_tail (B, W-1, CC)``, ``conv_weight (CC, W)``, ``conv_bias`` are
       given): depthwise causal conv over the tail and x, + bias, SiLU; the tail drops its
       oldest input and takes x, in place. Without a conv x is used as is;
    2. q, k L2-normalised per head (``normalize_qk``: x / max(‖x‖, 1e-12)); u = ``u (B, H, K)``
       or q;
    3. gates ``(B, H)``: ``given`` (log_a, b as passed, None = 1), ``sigmoid`` (log_a =
       ``decay_scale``·logsigmoid(log_a), b = sigmoid(b): the native model), ``softplus``
       (Δ = clamp(softplus(dt + dt_bias), dt_min, dt_max)·dt_scale, log_a = −Δ·exp(A_log),
       b = Δ: Mamba2);
    4. S ``(B, H, K, V)`` ← a·S + b·k vᵀ in place, o = Sᵀq; MC by ``variant``: ``none`` y = o;
       ``residual``/``post`` (collapsed): y = w·(o + csumᵀq), w = 1 or 1/(n_seg + 1), csum
       ``(B, H, K, V)`` the sum of the cached states (None: none cached); ``grm``/``soup``/
       ``ssc``: y = ``paged_mc_decode_linear_torch(q, u, o, p_on, table, …)`` with p_on =
       (seg_ksum + k)/(seg_len + 1). Every variant but ``none`` advances ``seg_ksum += k`` in
       place (seg_len and pushes stay with the caller);
    5. y += D·v (``D`` ``(H,)`` or ``(H·V,)``);
    6. output gate and norm over groups of ``norm_group`` channels (default V: per head):
       without ``norm_weight`` y·silu(z); with it, RMSNorm(y)·w·silu(z) when
       ``norm_before_gate`` (the native model), else RMSNorm(y·silu(z))·w (Mamba2);
       ``norm_weight`` ``(norm_group,)`` (repeated over groups) or ``(H·V,)``; z None: no gate.

    Returns y ``(B, H·V)`` in x's dtype (written into ``out`` when given); computed in float32
    at least.
    """
    if state_rows is not None:  # gather the rows, step them, write them back
        rows_views(x.shape[0], state_rows, S=S, conv_tail=conv_tail, seg_ksum=seg_ksum,
                   csum=csum)
        pools = {"S": S, "conv_tail": conv_tail, "seg_ksum": seg_ksum}
        got = {n: None if t is None else t[state_rows] for n, t in pools.items()}
        y = fused_linear_decode_torch(
            x, z, got["S"], q_offset=q_offset, k_offset=k_offset, v_offset=v_offset,
            qk_heads=qk_heads, conv_tail=got["conv_tail"], conv_weight=conv_weight,
            conv_bias=conv_bias, normalize_qk=normalize_qk, u=u, gate_mode=gate_mode,
            log_a=log_a, b=b, decay_scale=decay_scale, dt=dt, dt_bias=dt_bias, A_log=A_log,
            dt_min=dt_min, dt_max=dt_max, dt_scale=dt_scale, D=D, norm_weight=norm_weight,
            norm_eps=norm_eps, norm_group=norm_group, norm_before_gate=norm_before_gate,
            variant=variant, segment_len=segment_len, top_k=top_k, seg_ksum=got["seg_ksum"],
            seg_len=seg_len, n_seg=n_seg, table=table, state_table=state_table, pool_S=pool_S,
            ksum_pool=ksum_pool, csum=None if csum is None else csum[state_rows],
            row_top_k=row_top_k, out=out)
        for n, t in pools.items():
            if t is not None:
                t.index_copy_(0, state_rows, got[n])
        return y
    dims = check_fused_args(
        x, z, S, q_offset=q_offset, k_offset=k_offset, v_offset=v_offset, qk_heads=qk_heads,
        conv_tail=conv_tail, conv_weight=conv_weight, conv_bias=conv_bias, u=u,
        gate_mode=gate_mode, log_a=log_a, b=b, dt=dt, dt_bias=dt_bias, A_log=A_log, D=D,
        norm_weight=norm_weight, norm_group=norm_group, variant=variant,
        segment_len=segment_len, top_k=top_k, seg_ksum=seg_ksum, seg_len=seg_len, n_seg=n_seg,
        table=table, state_table=state_table, pool_S=pool_S, ksum_pool=ksum_pool, csum=csum,
        row_top_k=row_top_k)
    B, H, K, V, G, GS = (dims[n] for n in ("B", "H", "K", "V", "G", "GS"))
    dt_ = torch.promote_types(x.dtype, torch.float32)
    up = lambda t: None if t is None else t.to(dt_)  # noqa: E731
    xa = up(x)
    if conv_tail is not None:
        full = torch.cat([up(conv_tail), xa[:, None]], dim=1)  # (B, W, CC)
        xa = (full * up(conv_weight).t()).sum(1)
        if conv_bias is not None:
            xa = xa + up(conv_bias)
        xa = torch.nn.functional.silu(xa)
        conv_tail.copy_(full[:, 1:].to(conv_tail.dtype))
    rep = H // G
    q = xa[:, q_offset:q_offset + G * K].reshape(B, G, K).repeat_interleave(rep, 1)  # (B,H,K)
    k = xa[:, k_offset:k_offset + G * K].reshape(B, G, K).repeat_interleave(rep, 1)
    v = xa[:, v_offset:v_offset + H * V].reshape(B, H, V)
    if normalize_qk:
        q = torch.nn.functional.normalize(q, dim=-1)
        k = torch.nn.functional.normalize(k, dim=-1)
    uu = q if u is None else up(u)
    la_, b_ = up(log_a), up(b)
    if gate_mode == "sigmoid":
        la_ = None if la_ is None else torch.nn.functional.logsigmoid(la_) * decay_scale
        b_ = None if b_ is None else torch.sigmoid(b_)
    elif gate_mode == "softplus":
        delta = torch.nn.functional.softplus(up(dt) + up(dt_bias)).clamp(dt_min, dt_max)
        delta = delta * dt_scale
        la_, b_ = -delta * torch.exp(up(A_log)), delta
    # the online step, in place
    Sw = up(S)
    if la_ is not None:
        Sw = Sw * la_.exp()[..., None, None]
    kb = k if b_ is None else k * b_[..., None]
    Sw = Sw + kb[..., :, None] * v[..., None, :]  # (B, H, K, V)
    S.copy_(Sw.to(S.dtype))
    o = torch.einsum("bhk,bhkv->bhv", q, Sw)
    if variant == "none":
        y = o
    else:
        cum = up(seg_ksum) + k
        seg_ksum.copy_(cum.to(seg_ksum.dtype))
        if variant in ("residual", "post"):
            y = o if csum is None else o + torch.einsum("bhk,bhkv->bhv", q, up(csum))
            if variant == "post":
                y = y / (n_seg.to(dt_) + 1.0)[:, None, None]
        else:
            p_on = cum / (seg_len.to(dt_) + 1.0)[:, None, None]
            y = paged_mc_decode_linear_torch(q, uu, o, p_on, table, pool_S, ksum_pool,
                                             variant=variant, segment_len=segment_len,
                                             top_k=top_k, state_table=state_table,
                                             row_top_k=row_top_k)
    if D is not None:
        y = y + v * (up(D).view(H, V) if D.numel() == H * V else up(D)[:, None])
    y = y.reshape(B, H * V)
    zz = None if z is None else torch.nn.functional.silu(up(z))
    if norm_weight is None:
        if zz is not None:
            y = y * zz
    else:
        if zz is not None and not norm_before_gate:
            y = y * zz
        y = torch.nn.functional.rms_norm(y.view(B, -1, GS), (GS,), eps=norm_eps).view(B, -1)
        w = up(norm_weight)
        y = y * (w if w.numel() == H * V else w.repeat(H * V // GS))
        if zz is not None and norm_before_gate:
            y = y * zz
    y = y.to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out
