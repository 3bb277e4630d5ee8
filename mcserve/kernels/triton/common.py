"""Argument checks and output layouts shared by the forms of the ops in this package.

Each op's Triton form, torch twin and naive reference (one sub-package per op) validate their
arguments with the same function from here, so all three accept and reject the same calls; the
decode checks also serve the fused decode. Nothing in this module imports triton.

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

import torch
from torch import Tensor

from mcserve.config import VARIANTS, MCConfig

# the variants whose checkpoints are constant blocks: what a block-table readout can serve
DECODE_VARIANTS = tuple(v for v in VARIANTS if MCConfig(variant=v).caches_blocks)
PREFILL_MODES = ("checkpoint", "independent")
FUSED_VARIANTS = ("none", "residual", "post", "grm", "soup", "ssc")
GATE_MODES = ("given", "sigmoid", "softplus")

__all__ = [
    "DECODE_VARIANTS", "PREFILL_MODES", "FUSED_VARIANTS", "GATE_MODES", "boundary_layout",
    "check_decode_args", "check_prefill_args", "check_fused_args", "rows_views",
]


# ---------------------------------------------------------------------------------------------
# paged MC decode readout and ssc router (also the fused decode's cached readout)
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


# ---------------------------------------------------------------------------------------------
# chunked linear prefill with segment checkpoints
# ---------------------------------------------------------------------------------------------


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
# fused per-layer decode of the gated linear memory
# ---------------------------------------------------------------------------------------------


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
