"""Memory Caching over any memory family: segmentation, cached checkpoints, gates, aggregation.

This is the fast (vectorised torch) path of DESIGN.md §1.2-1.3; ``mcserve.kernels.reference`` is
its oracle. ``MCMemory.forward`` consumes a span of tokens for a batch of sequences that sit at
the same position and returns ``(y, state)``; any split of the tokens gives the same result, so
prefill is one call and decode is one call per token.

The span is cut into *pieces* inside which the set of cached memories does not change (the rest
of a constant segment; a single token for ``loglinear``, whose segmentation changes every token).
Per piece: one family scan for the online readouts, one contraction for the cached readouts
(or a gather of the selected blocks for ``ssc`` when that is cheaper), one softmax for the gates.
No per-token Python loop except for ``loglinear``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from mcserve.config import MCConfig
from mcserve.models.memory.base import MemoryFamily, State


def log_boundaries(n: int) -> list[int]:
    """Cached checkpoint positions for the token at position n under logarithmic segmentation.

    Prefix sums of n's binary expansion, largest power first, without n itself
    (n = 37 = 100101₂ → [32, 36]).
    """
    out, acc = [], 0
    for j in range(n.bit_length() - 1, -1, -1):
        if n >> j & 1:
            acc += 1 << j
            out.append(acc)
    return out[:-1]


class _Stack:
    """Preallocated storage behind ``MCLayerState.cached``: appends are amortised O(1).

    States share it append-only: a state that sees N blocks may write block N in place only if
    nobody has written past N yet (``filled == N``); otherwise it copies (the other writer was a
    different continuation of the same prefix, e.g. a reused state).
    """

    def __init__(self, cached: State, ksum: Tensor, capacity: int):
        n = ksum.shape[1]
        self.t = {k: _grow(t, capacity) for k, t in cached.items()}
        self.ksum = _grow(ksum, capacity)
        self.filled = n

    @property
    def capacity(self) -> int:
        return self.ksum.shape[1]


def _grow(t: Tensor, capacity: int) -> Tensor:
    out = t.new_empty((t.shape[0], capacity) + t.shape[2:])
    out[:, :t.shape[1]] = t
    return out


@dataclass
class MCLayerState:
    """Everything one layer needs to continue a batch of sequences (all at position ``pos``)."""

    mem: State  # online memory, family-specific, tensors lead with B
    seg_ksum: Tensor  # (B, H, K) key sum of the online segment so far
    seg_len: int  # tokens in the online segment; == segment_len means complete, not yet pushed
    cached: State  # readout tensors of cached memories stacked on dim 1: (B, N, ...)
    cached_ksum: Tensor  # (B, N, H, K) key sum of each cached segment
    cached_len: list[int] = field(default_factory=list)  # tokens of each cached segment
    cached_pos: list[int] = field(default_factory=list)  # position each cached segment ends at
    n_segments: int = 0  # cached segments so far (== N unless collapsed into one summed block)
    pos: int = 0  # tokens consumed
    v_dim: int = 0  # value dim, to rebuild the initial memory in independent mode
    top_k: int | None = None  # per-request ssc override of MCConfig.top_k
    _stack: _Stack | None = field(default=None, repr=False, compare=False)

    def append(self, block: State, ksum: Tensor, length: int, pos: int) -> None:
        """Cache one more segment: block tensors ``(B, ...)``, its key sum ``(B, H, K)``."""
        n = self.num_cached
        if torch.is_grad_enabled() and any(t.requires_grad for t in block.values()):
            # training: autograd saved views of the stack, so never write into it in place
            self.cached = {k: torch.cat([self.cached[k], t[:, None]], 1) for k, t in block.items()}
            self.cached_ksum = torch.cat([self.cached_ksum, ksum[:, None]], 1)
            self._stack = None
            self.cached_len.append(length)
            self.cached_pos.append(pos)
            return
        st = self._stack
        if st is None or st.filled != n or n == st.capacity or (
                n and st.ksum.data_ptr() != self.cached_ksum.data_ptr()):
            st = _Stack(self.cached, self.cached_ksum, max(8, 2 * (n + 1)))
        for k, t in block.items():
            st.t[k][:, n] = t
        st.ksum[:, n] = ksum
        st.filled = n + 1
        self._stack = st
        self.cached = {k: t[:, :n + 1] for k, t in st.t.items()}
        self.cached_ksum = st.ksum[:, :n + 1]
        self.cached_len.append(length)
        self.cached_pos.append(pos)

    def truncate(self, n: int) -> None:
        """Keep the first n cached segments (loglinear merges)."""
        self.cached = {k: t[:, :n] for k, t in self.cached.items()}
        self.cached_ksum = self.cached_ksum[:, :n]
        del self.cached_len[n:], self.cached_pos[n:]

    @property
    def num_cached(self) -> int:
        return self.cached_ksum.shape[1]

    def map_tensors(self, fn) -> MCLayerState:
        """Apply ``fn`` to every tensor (e.g. select batch rows, move device)."""
        return replace(
            self, mem={k: fn(t) for k, t in self.mem.items()}, seg_ksum=fn(self.seg_ksum),
            cached={k: fn(t) for k, t in self.cached.items()}, cached_ksum=fn(self.cached_ksum),
            cached_len=list(self.cached_len), cached_pos=list(self.cached_pos), _stack=None,
        )


@dataclass
class PagedLayer:
    """One layer's view of a ragged decode batch whose cached blocks live in a shared pool.

    Every row is a different sequence at its own position; row b owns the blocks
    ``table[b, :n]`` (padded with -1). Invariant between steps: ``seg_len < segment_len``
    (the runner pushes a completed segment into a pool block right after the token that ends it).
    """

    mem: State  # online memory, (B, ...)
    conv: Tensor | None  # (B, conv_size - 1, C) short-conv tail
    seg_ksum: Tensor  # (B, H, K)
    seg_len: Tensor  # (B,) long
    n_seg: Tensor  # (B,) long, cached segments so far
    csum: State | None  # collapsed variants: Σ of cached readout states, (B, ...)
    table: Tensor  # (B, N) long block ids, -1 = no block
    pool: State  # readout key -> (num_blocks, H, ...) this layer's slice of the block pool
    ksum_pool: Tensor  # (num_blocks, H, K) key sums of the blocks
    # maps block ids that name host-tier blocks to device rows (fetching them); None when
    # every block in ``table`` is on the device
    fetch: Callable[[Tensor], Tensor] | None = None
    top_k: Tensor | None = None  # (B,) per-row ssc top_k overrides; None = MCConfig.top_k


class MCMemory:
    """One memory family wrapped with one MC configuration."""

    def __init__(self, family: MemoryFamily, cfg: MCConfig):
        self.family = family
        self.cfg = cfg
        # residual/post on a linear memory keep one summed state: decode cost flat in N.
        self.collapsed = family.linear and cfg.variant in ("residual", "post")
        # soup equals grm on linear memories (the readout is linear in the parameters).
        self.soup = cfg.variant == "soup" and not family.linear

    def init_state(self, batch: int, heads: int, k_dim: int, v_dim: int, *, dtype: torch.dtype,
                   device: torch.device | str, init: dict[str, Tensor] | None = None
                   ) -> MCLayerState:
        mem = self.family.init_state(batch, heads, k_dim, v_dim, dtype=dtype, device=device,
                                     init=init)
        return MCLayerState(
            mem=mem,
            seg_ksum=torch.zeros(batch, heads, k_dim, dtype=dtype, device=device),
            seg_len=0,
            cached={key: mem[key].new_zeros((batch, 0) + mem[key].shape[1:])
                    for key in self.family.readout_keys},
            cached_ksum=torch.zeros(batch, 0, heads, k_dim, dtype=dtype, device=device),
            v_dim=v_dim,
        )

    # ------------------------------------------------------------------ forward
    def forward(self, state: MCLayerState, q: Tensor, k: Tensor, v: Tensor, u: Tensor,
                gates: dict[str, Tensor], init: dict[str, Tensor] | None = None
                ) -> tuple[Tensor, MCLayerState]:
        """q, k, u ``(B, T, H, K)``, v ``(B, T, H, V)``, gates ``(B, T, H)`` → y ``(B, T, H, V)``.

        ``init`` is the learned initial memory (deep families), needed to restart segments in
        independent mode. ``state`` is not modified.
        """
        T = q.shape[1]
        st = replace(state, cached_len=list(state.cached_len), cached_pos=list(state.cached_pos))
        if self.cfg.variant == "none":
            y, st.mem = self.family.scan(st.mem, q, k, v, gates)
            st.pos += T
            return y, st
        ys, t0 = [], 0
        while t0 < T:
            if self.cfg.variant == "loglinear":
                self._log_advance(st)
                n = 1
            else:
                if st.seg_len == self.cfg.segment_len:
                    self.push(st, init)
                n = min(T - t0, self.cfg.segment_len - st.seg_len)
            sl = slice(t0, t0 + n)
            ys.append(self._piece(st, q[:, sl], k[:, sl], v[:, sl], u[:, sl],
                                  {g: x[:, sl] for g, x in gates.items()}))
            t0 += n
        y = torch.cat(ys, dim=1) if ys else v.new_zeros(v.shape)
        return y, st

    # ------------------------------------------------------------------ ragged decode
    def decode_paged(self, pl: PagedLayer, q: Tensor, k: Tensor, v: Tensor, u: Tensor,
                     gates: dict[str, Tensor]) -> Tensor:
        """One token per row, rows at different positions, blocks read from the pool.

        q, k, u ``(B, 1, H, K)``; updates ``pl.mem``, ``pl.seg_ksum`` (not seg_len / pushes,
        which the runner owns) and returns y ``(B, 1, H, V)``. Constant segmentation only.
        """
        variant = self.cfg.variant
        if variant == "loglinear":
            raise NotImplementedError("loglinear decode over a block pool is not supported")
        if variant == "none":
            y, pl.mem = self._scan_rows(pl.mem, q, k, v, gates)
            return y
        if self.family.linear and variant in ("grm", "soup", "ssc"):
            from mcserve.kernels import dispatch

            if dispatch.get_backend(q) != "torch":  # Triton on CUDA, or MCSERVE_KERNELS=...
                return dispatch.decode_paged_linear(self, pl, q, k, v, u, gates)
        B, _, H, K = q.shape
        cum = pl.seg_ksum + k[:, 0]  # (B, H, K)
        pl.seg_ksum = cum
        if self.collapsed:
            scale = (q.new_ones(B) if variant == "residual"
                     else 1.0 / (pl.n_seg + 1).to(q.dtype))[:, None, None]  # (B, 1, 1)
            o, pl.mem = self._scan_rows(pl.mem, q, k, v, gates)
            w = scale[..., None].expand(B, 1, 1, H)
            csum = {key: t[:, None] for key, t in pl.csum.items()}
            return o * scale[..., None] + self.family.readout_mix(csum, q, w)
        table = pl.table
        valid = table >= 0  # (B, N)
        tb = table.clamp_min(0)
        N = table.shape[1]
        if variant in ("residual", "post"):  # deep memories: explicit sum over the blocks
            scale = (q.new_ones(B) if variant == "residual"
                     else 1.0 / (pl.n_seg + 1).to(q.dtype))
            w_on = scale[:, None, None].expand(B, 1, H)
            w_c = (valid.to(q.dtype) * scale[:, None])[:, None, :, None].expand(B, 1, N, H)
            ids = tb[:, :, None].expand(B, N, H)
        else:
            p_on = cum / (pl.seg_len + 1).to(q.dtype)[:, None, None]
            r_on = (u[:, 0] * p_on).sum(-1)[:, None] / math.sqrt(K)  # (B, 1, H)
            # every cached block is a full segment: fold 1/(C·√K) into u, and score with a
            # multiply-sum (an einsum here would first copy the gathered sums into a GEMM layout)
            u_s = u[:, 0] / (self.cfg.segment_len * math.sqrt(K))  # (B, H, K)
            r_c = (pl.ksum_pool[tb] * u_s[:, None]).sum(-1)[:, None]  # (B, 1, N, H)
            r_c = r_c.masked_fill(~valid[:, None, :, None], float("-inf"))
            k_row = pl.top_k
            k_max = self.cfg.top_k if k_row is None else int(k_row.max())
            if variant == "ssc" and (N > k_max or (k_row is not None and bool((k_row < N).any()))):
                idx = self._select(r_c, min(k_max, N))  # (B, 1, k, H)
                r_c = r_c.gather(2, idx)
                if k_row is not None:  # rows asking for fewer picks drop the extra ones
                    extra = torch.arange(idx.shape[2], device=q.device) >= k_row[:, None]
                    r_c = r_c.masked_fill(extra[:, None, :, None], float("-inf"))
                ids = tb.gather(1, idx[:, 0].flatten(1)).view(B, -1, H)  # (B, k, H) block ids
            else:
                ids = tb[:, :, None].expand(B, N, H)
            if pl.fetch is not None:  # bring host-tier blocks (ssc's selection) to the device
                ids = pl.fetch(ids)
            gamma = torch.softmax(torch.cat([r_c, r_on[:, :, None]], 2), dim=2)
            w_on, w_c = gamma[:, :, -1], gamma[:, :, :-1]
        if self.soup:
            cached = self._gather_blocks_by_id(pl.pool, ids)
            y, pl.mem = self._scan_rows(pl.mem, q, k, v, gates, (w_on, cached, w_c))
            return y
        o, pl.mem = self._scan_rows(pl.mem, q, k, v, gates)
        y = o * w_on[..., None]
        if w_c.shape[2]:
            paged = getattr(self.family, "readout_mix_paged", None)
            if paged is not None:  # reads the pool in place
                y = y + paged(pl.pool, ids, q, w_c)
            else:
                y = y + self.family.readout_mix(self._gather_blocks_by_id(pl.pool, ids), q, w_c)
        return y

    @staticmethod
    def _gather_blocks_by_id(pool: State, ids: Tensor) -> State:
        """Pool rows per (row, block, head): ids ``(B, n, H)`` → tensors ``(B, n, H, ...)``."""
        h = torch.arange(ids.shape[2], device=ids.device)[None, None, :]
        return {key: t[ids, h] for key, t in pool.items()}

    def _scan_rows(self, mem: State, q: Tensor, k: Tensor, v: Tensor, gates: dict[str, Tensor],
                   soup: tuple | None = None) -> tuple[Tensor, State]:
        """family.scan (or scan_soup) for rows that may sit at different inner-chunk phases.

        Deep memories keep the fill of the current inner chunk per row; their scan needs one
        fill per call, so rows are grouped by fill (at most ``inner_chunk`` groups, never a
        loop over sequences).
        """
        def run(m, qq, kk, vv, gg, sp):
            if sp is None:
                return self.family.scan(m, qq, kk, vv, gg)
            w_on, cached, w_c = sp
            return self.family.scan_soup(m, qq, kk, vv, gg, w_on, cached, w_c)

        fill = mem.get("fill")
        if fill is None or bool((fill == fill[0]).all()):
            return run(mem, q, k, v, gates, soup)
        y = v.new_empty(v.shape)
        out = {key: t.clone() for key, t in mem.items()}
        for f in fill.unique().tolist():
            rows = (fill == f).nonzero().flatten()
            sub = {key: t[rows] for key, t in mem.items()}
            sp = None if soup is None else (
                soup[0][rows], {key: t[rows] for key, t in soup[1].items()}, soup[2][rows])
            yr, new = run(sub, q[rows], k[rows], v[rows], {g: x[rows] for g, x in gates.items()},
                          sp)
            y[rows] = yr
            for key, t in new.items():
                out[key][rows] = t
        return y, out

    # ------------------------------------------------------------------ segments
    def push(self, st: MCLayerState, init: dict[str, Tensor] | None) -> None:
        """The online segment is complete: cache its memory, start a new segment."""
        block = {key: st.mem[key] for key in self.family.readout_keys}
        if self.collapsed and st.num_cached:
            st.cached = {key: st.cached[key] + block[key][:, None] for key in block}
        else:
            st.append(block, st.seg_ksum, st.seg_len, st.pos)
        st.n_segments += 1
        st.seg_ksum = torch.zeros_like(st.seg_ksum)
        st.seg_len = 0
        if self.cfg.mode == "independent":
            B, H, K = st.seg_ksum.shape
            st.mem = self.family.init_state(B, H, K, st.v_dim, dtype=st.seg_ksum.dtype,
                                            device=st.seg_ksum.device, init=init)

    def _log_advance(self, st: MCLayerState) -> None:
        """Re-segment for the next token (position pos + 1) under logarithmic segmentation.

        The boundaries of n + 1 are a subset of those of n plus n itself, so the cached blocks
        form a stack: push the state at n, pop the tail that is no longer a boundary and merge
        those segments' key sums into the new online segment.
        """
        n = st.pos
        if n == 0:
            return
        keep = set(log_boundaries(n + 1))
        if n in keep:  # n even: the state at n becomes a checkpoint, nothing merges
            st.append({key: st.mem[key] for key in self.family.readout_keys}, st.seg_ksum,
                      st.seg_len, n)
            st.seg_ksum = torch.zeros_like(st.seg_ksum)
            st.seg_len = 0
            return
        n_keep = sum(1 for p in st.cached_pos if p in keep)  # kept ones are a prefix of the stack
        st.seg_ksum = st.seg_ksum + st.cached_ksum[:, n_keep:].sum(1)
        st.seg_len += sum(st.cached_len[n_keep:])
        st.truncate(n_keep)

    # ------------------------------------------------------------------ one piece
    def _piece(self, st: MCLayerState, q: Tensor, k: Tensor, v: Tensor, u: Tensor,
               gates: dict[str, Tensor]) -> Tensor:
        """Tokens that all see the same cached set; updates ``st`` and returns y (B, L, H, V)."""
        B, L, H, K = q.shape
        N = st.num_cached
        cum = st.seg_ksum[:, None] + k.cumsum(1)  # (B, L, H, K) online key sums incl. token t
        variant = self.cfg.variant
        cached = st.cached
        if variant in ("residual", "post"):
            scale = 1.0 if variant == "residual" else 1.0 / (st.n_segments + 1)
            w_on = q.new_full((B, L, H), scale)
            w_c = q.new_full((B, L, N, H), scale)
        else:
            counts = torch.arange(st.seg_len + 1, st.seg_len + L + 1, device=q.device)
            p_on = cum / counts.to(q.dtype)[None, :, None, None]
            r_on = (u * p_on).sum(-1) / math.sqrt(K)  # (B, L, H)
            if N:
                lens = torch.tensor(st.cached_len, dtype=q.dtype, device=q.device)
                p_c = st.cached_ksum / lens[None, :, None, None]  # (B, N, H, K)
                if L == 1:  # decode: multiply-sum reads p_c once, no GEMM relayout
                    r_c = (p_c * u).sum(-1)[:, None] / math.sqrt(K)
                else:
                    r_c = torch.einsum("blhk,bnhk->blnh", u, p_c) / math.sqrt(K)
            else:
                r_c = q.new_zeros(B, L, 0, H)
            top_k = st.top_k or self.cfg.top_k
            if variant == "ssc" and N > top_k:
                idx = self._select(r_c, top_k)  # (B, L, top_k, H)
                gamma = torch.softmax(torch.cat([r_c.gather(2, idx), r_on[:, :, None]], 2), 2)
                w_on = gamma[:, :, -1]
                if L == 1:  # decode: read only the selected blocks
                    cached = self._gather_blocks(cached, idx[:, 0])
                    w_c = gamma[:, :, :-1]
                else:  # prefill: every block is read anyway; scatter the weights back
                    w_c = q.new_zeros(B, L, N, H).scatter(2, idx, gamma[:, :, :-1])
            else:
                gamma = torch.softmax(torch.cat([r_c, r_on[:, :, None]], 2), dim=2)
                w_on, w_c = gamma[:, :, -1], gamma[:, :, :-1]
        if self.soup:
            y, st.mem = self.family.scan_soup(st.mem, q, k, v, gates, w_on, cached, w_c)
        else:
            o, st.mem = self.family.scan(st.mem, q, k, v, gates)
            y = o * w_on[..., None]
            if w_c.shape[2]:
                y = y + self.family.readout_mix(cached, q, w_c)
        st.seg_ksum = cum[:, -1]
        st.seg_len += L
        st.pos += L
        return y

    def _select(self, r_c: Tensor, top_k: int) -> Tensor:
        """Indices of the top_k cached scores along dim 2, ties going to the more recent block."""
        N = r_c.shape[2]
        # sort along a contiguous last dim (much faster than along dim 2 of (B, L, N, H))
        r = r_c.flip(2).transpose(2, 3).contiguous()  # (B, L, H, N), most recent first
        order = torch.sort(r, dim=-1, descending=True, stable=True).indices[..., :top_k]
        return N - 1 - order.transpose(2, 3)

    @staticmethod
    def _gather_blocks(cached: State, idx: Tensor) -> State:
        """Blocks chosen per (sequence, head): idx ``(B, k, H)`` → tensors ``(B, k, H, ...)``."""
        B, kk, H = idx.shape
        b = torch.arange(B, device=idx.device)[:, None, None]
        h = torch.arange(H, device=idx.device)[None, None, :]
        return {key: t[b, idx, h] for key, t in cached.items()}
