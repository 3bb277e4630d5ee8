"""Memory Caching over any memory family: segmentation, cached checkpoints, gates, aggregation.

This is the fast (vectorised torch) path of docs/mc.md; ``mcserve.kernels.reference`` is
its oracle. ``MCMemory.forward`` consumes a span of tokens for a batch of sequences that sit at
the same position and returns ``(y, state)``; any split of the tokens gives the same result, so
prefill is one call and decode is one call per token.

The span is cut into *pieces* inside which the set of cached memories does not change (the rest
of a constant segment; a single token for ``loglinear``, whose segmentation changes every token).
Per piece: one family scan for the online readouts, one contraction for the cached readouts
(or a gather of the selected blocks for ``ssc`` when that is cheaper), one softmax for the gates.

``loglinear`` over the ``linear`` family has its own span path with no per-token loop
(``MCMemory.forward_loglinear_linear``): every checkpoint is a decayed sum of writes, so a chunk
of tokens is one masked quadratic form plus a readout of the memories carried into the chunk.
``loglinear`` on the other families, and short ``loglinear`` spans (decode), run one piece per
token.

This module holds ``MCMemory``: the span forward (per piece, or in one pass of
``kernels.mc_chunk`` for the gated linear memory under constant segments), segment pushes, and
the ragged decode over a block pool (``decode_paged``: torch, the CPU ops of ``kernels.cpu``, or
the kernels of ``kernels.dispatch``). The states it works on are in ``mcserve.models.mc_state``;
the ``loglinear`` re-segmentation and span path are in ``mcserve.models.mc_loglinear``
(``LogLinearMixin``, which ``MCMemory`` inherits).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from mcserve.config import MCConfig
from mcserve.kernels import cpu as cpu_ops
from mcserve.kernels.mc_chunk import mc_linear_chunk
from mcserve.models.mc_loglinear import LogLinearMixin
from mcserve.models.mc_state import MCLayerState, PagedLayer
from mcserve.models.memory.base import MemoryFamily, State
from mcserve.models.memory.linear import LinearMemory

# shorter loglinear spans (decode) take the per-token loop: ~20 ops a token beat the span path's
# ~100 ops a chunk below about 3 tokens (CPU, B=1..8, H=8, K=V=64)
_LOG_FAST_MIN = 4
# the decode kernel's readout that gates every block its table lists (a softmax over them and
# the online memory): what a selecting variant's picks are read with once routed
_ROUTE_ALL = "grm"


class MCMemory(LogLinearMixin):
    """One memory family wrapped with one MC configuration."""

    def __init__(self, family: MemoryFamily, cfg: MCConfig):
        self.family = family
        self.cfg = cfg
        # residual/post on a linear memory keep one summed state: decode cost flat in N.
        self.collapsed = cfg.collapses(family.linear)
        # soup equals grm on linear memories (the readout is linear in the parameters).
        self.soup = cfg.mixes_parameters and not family.linear
        # loglinear on gated linear attention: a chunked masked quadratic form per span instead
        # of one _log_advance + _piece per token. False selects the per-token loop (its twin).
        self.loglinear_fast = cfg.log_segmented and isinstance(family, LinearMemory)
        # constant segments on the gated linear memory: a span crossing any number of segment
        # boundaries is one pass (kernels.mc_chunk). False selects the per-piece loop (its twin).
        self.chunked = cfg.caches_blocks and type(family) is LinearMemory
        # the precision of the chunk's dense cached readout GEMMs (None: the state's dtype);
        # bfloat16 where the engine runs bfloat16 on a CPU with BF16 dot products
        # (models/lowp_linear.py, prepare_cpu_weights)
        self.readout_dtype: torch.dtype | None = None

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
        if not self.cfg.segmented:
            y, st.mem = self.family.scan(st.mem, q, k, v, gates)
            st.pos += T
            return y, st
        if self.loglinear_fast and T >= _LOG_FAST_MIN:
            return self.forward_loglinear_linear(state, q, k, v, u, gates)
        if self.chunked and T > 1:
            return self._forward_chunk(st, q, k, v, u, gates, init)
        ys, t0 = [], 0
        while t0 < T:
            if self.cfg.log_segmented:
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
        if st.record is not None and st.seg_len == self.cfg.segment_len:
            self.push(st, init)
        y = torch.cat(ys, dim=1) if ys else v.new_zeros(v.shape)
        return y, st

    def _forward_chunk(self, st: MCLayerState, q: Tensor, k: Tensor, v: Tensor, u: Tensor,
                       gates: dict[str, Tensor], init: dict[str, Tensor] | None
                       ) -> tuple[Tensor, MCLayerState]:
        """``forward`` of the gated linear memory under constant segmentation: the whole span
        in one pass (``kernels.mc_chunk``), however many segments it crosses; then the state is
        advanced through the span's boundaries exactly as the per-piece loop leaves it."""
        C, T = self.cfg.segment_len, q.shape[1]
        if st.seg_len == C:
            self.push(st, init)
        f0, pos0, ksum0 = st.seg_len, st.pos, st.seg_ksum
        y, S, bs, bk = mc_linear_chunk(
            q, k, v, u, gates.get("log_a"), gates.get("b"), initial_state=st.mem["S"],
            initial_ksum=ksum0, initial_fill=f0, cached=st.cached["S"],
            cached_ksum=st.cached_ksum, n_segments=st.n_segments, mc=self.cfg, top_k=st.top_k,
            readout_dtype=self.readout_dtype)
        n_b, fill = bs.shape[1], (f0 + T) % C
        # a segment completed by the last token stays online (pushed by the next span), unless
        # the caller records checkpoints
        n_push = n_b - 1 if n_b and not fill and st.record is None else n_b
        if n_push and not self.collapsed:  # every completed segment cached in one write
            self._push_many(st, bs[:, :n_push], bk[:, :n_push],
                            [pos0 + (i + 1) * C - f0 for i in range(n_push)], init)
        for i in range(n_push if self.collapsed else 0):
            st.mem, st.seg_ksum, st.seg_len = {"S": bs[:, i]}, bk[:, i], C
            st.pos = pos0 + (i + 1) * C - f0
            self.push(st, init)
        st.pos = pos0 + T
        if n_push < n_b:
            st.mem, st.seg_ksum, st.seg_len = {"S": bs[:, -1]}, bk[:, -1], C
        elif fill:
            st.mem, st.seg_len = {"S": S}, fill
            st.seg_ksum = k[:, T - fill:].sum(1) if n_b else ksum0 + k.sum(1)
        return y, st

    # ------------------------------------------------------------------ ragged decode
    def decode_paged(self, pl: PagedLayer, q: Tensor, k: Tensor, v: Tensor, u: Tensor,
                     gates: dict[str, Tensor]) -> Tensor:
        """One token per row, rows at different positions, blocks read from the pool.

        q, k, u ``(B, 1, H, K)``; updates ``pl.mem``, ``pl.seg_ksum`` (not seg_len / pushes,
        which the runner owns) and returns y ``(B, 1, H, V)``. Constant segmentation only.
        """
        cfg = self.cfg
        if cfg.log_segmented:
            raise NotImplementedError("loglinear decode over a block pool is not supported")
        if not cfg.segmented:
            y, pl.mem = self._scan_rows(pl.mem, q, k, v, gates, inplace=pl.inplace)
            return y
        if self.family.linear and cfg.routes:
            from mcserve.kernels import dispatch

            if dispatch.get_backend(q) != "torch":  # Triton on CUDA, or MCSERVE_KERNELS=...
                return self.decode_paged_kernels(pl, q, k, v, u, gates)
        B, _, H, K = q.shape
        # CPU inference on the gated linear memory: routing scores and the step + readout as two
        # one-pass C++ ops (kernels.cpu; this torch code is their twin), updating pl in place
        fast = (cfg.routes and isinstance(self.family, LinearMemory) and q.is_cpu
                and not torch.is_grad_enabled() and cpu_ops.enabled())
        if fast:
            if not pl.inplace:
                pl.mem = {key: t.clone() for key, t in pl.mem.items()}
                pl.seg_ksum = pl.seg_ksum.clone()
        else:
            cum = pl.seg_ksum + k[:, 0]  # (B, H, K)
            pl.seg_ksum = cum
        if self.collapsed:
            scale = (1.0 / (pl.n_seg + 1).to(q.dtype) if cfg.averages
                     else q.new_ones(B))[:, None, None]  # (B, 1, 1)
            o, pl.mem = self._scan_rows(pl.mem, q, k, v, gates, inplace=pl.inplace)
            w = scale[..., None].expand(B, 1, 1, H)
            csum = {key: t[:, None] for key, t in pl.csum.items()}
            return o * scale[..., None] + self.family.readout_mix(csum, q, w)
        table = pl.table
        valid = table >= 0  # (B, N)
        tb = table.clamp_min(0)
        N = table.shape[1]
        if cfg.fixed_weights:  # deep memories: explicit sum over the blocks
            scale = 1.0 / (pl.n_seg + 1).to(q.dtype) if cfg.averages else q.new_ones(B)
            w_on = scale[:, None, None].expand(B, 1, H)
            w_c = (valid.to(q.dtype) * scale[:, None])[:, None, :, None].expand(B, 1, N, H)
            ids = tb[:, :, None].expand(B, N, H)
        else:
            if fast:  # seg_ksum += k in place; scores of the N blocks and the online segment
                r = cpu_ops.mc_scores_(pl.seg_ksum, k[:, 0], u[:, 0], pl.seg_len, pl.ksum_pool,
                                       table, cfg.segment_len)  # (B, N + 1, H)
                r_c, r_on = r[:, None, :N], r[:, None, N]
            else:
                p_on = cum / (pl.seg_len + 1).to(q.dtype)[:, None, None]
                r_on = (u[:, 0] * p_on).sum(-1)[:, None] / math.sqrt(K)  # (B, 1, H)
                # every cached block is a full segment: fold 1/(C·√K) into u, and score with a
                # multiply-sum (an einsum would first copy the gathered sums into a GEMM layout)
                u_s = u[:, 0] / (cfg.segment_len * math.sqrt(K))  # (B, H, K)
                r_c = (pl.ksum_pool[tb] * u_s[:, None]).sum(-1)[:, None]  # (B, 1, N, H)
                r_c = r_c.masked_fill(~valid[:, None, :, None], float("-inf"))
            k_row = pl.top_k
            k_min = k_max = cfg.top_k
            if k_row is not None:
                k_min, k_max = (pl.top_k_range if pl.top_k_range is not None
                                else (int(k_row.min()), int(k_row.max())))
            if cfg.selects and (N > k_max or (k_row is not None and k_min < N)):
                idx = self._select(r_c, min(k_max, N))  # (B, 1, k, H)
                r_c = r_c.gather(2, idx)
                if k_row is not None:  # rows asking for fewer picks drop the extra ones
                    extra = torch.arange(idx.shape[2], device=q.device) >= k_row[:, None]
                    r_c = r_c.masked_fill(extra[:, None, :, None], float("-inf"))
                ids = tb.gather(1, idx[:, 0].flatten(1)).view(B, -1, H)  # (B, k, H) block ids
            else:
                ids = tb[:, :, None].expand(B, N, H)
            if pl.fetch is not None:  # bring host-tier blocks (ssc's selection) to the device
                ids = pl.fetch(ids, 2)  # (B, k, H): heads on dim 2
            gamma = torch.softmax(torch.cat([r_c, r_on[:, :, None]], 2), dim=2)
            w_on, w_c = gamma[:, :, -1], gamma[:, :, :-1]
        if self.soup:
            cached = self._gather_blocks_by_id(pl.pool, ids)
            y, pl.mem = self._scan_rows(pl.mem, q, k, v, gates, (w_on, cached, w_c))
            return y
        if fast:
            log_a, b = gates.get("log_a"), gates.get("b")
            y = cpu_ops.mc_step_readout_(
                pl.mem["S"], q[:, 0], k[:, 0], v[:, 0], None if log_a is None else log_a[:, 0],
                None if b is None else b[:, 0], w_on[:, 0], pl.pool["S"], ids, w_c[:, 0])
            return y[:, None]  # (B, 1, H, V)
        o, pl.mem = self._scan_rows(pl.mem, q, k, v, gates, inplace=pl.inplace)
        y = o * w_on[..., None]
        if w_c.shape[2]:
            paged = getattr(self.family, "readout_mix_paged", None)
            if paged is not None:  # reads the pool in place
                y = y + paged(pl.pool, ids, q, w_c)
            else:
                y = y + self.family.readout_mix(self._gather_blocks_by_id(pl.pool, ids), q, w_c)
        return y

    def fused_decode_kwargs(self, x: Tensor, pl: PagedLayer, v_dim: int) -> dict | None:
        """The MC arguments of ``dispatch.fused_linear_decode`` for a decode step of ``x``
        ``(B, 1, ·)`` over ``pl`` (heads of ``v_dim`` values), or None where the step does not
        fit the fused kernel: no kernel backend (CPU tensors without ``MCSERVE_KERNELS=triton``),
        not one token per row, states not writable in place, host-tier blocks, logarithmic
        segments, autograd, or few programs reading many blocks (``dispatch.fused_decode_pays``).
        A mixer then takes its unfused path, which is the fused call's twin."""
        from mcserve.kernels import dispatch

        cfg = self.cfg
        if (x.shape[1] != 1 or not pl.inplace or pl.fetch is not None or cfg.log_segmented
                or torch.is_grad_enabled() or dispatch.get_backend(x) != "triton"
                or (cfg.caches_blocks and not dispatch.fused_decode_pays(
                    x.shape[0], pl.seg_ksum.shape[1], v_dim, pl.table.shape[-1],
                    cfg.variant))):
            return None
        top_k = cfg.top_k
        if cfg.selects and pl.top_k is not None:  # the largest pick is the compile-time count
            top_k = pl.top_k_range[1] if pl.top_k_range is not None else int(pl.top_k.max())
        routed = cfg.caches_blocks and not self.collapsed
        seg = cfg.segmented
        return dict(
            variant=cfg.variant, segment_len=cfg.segment_len, top_k=top_k,
            seg_ksum=pl.seg_ksum if seg else None, seg_len=pl.seg_len if seg else None,
            n_seg=pl.n_seg if seg else None, table=pl.table if routed else None,
            pool_S=pl.pool["S"] if routed else None, ksum_pool=pl.ksum_pool if routed else None,
            csum=pl.csum["S"] if self.collapsed and pl.csum else None,
            row_top_k=pl.top_k if cfg.selects else None, state_rows=pl.rows)

    def decode_paged_kernels(self, pl: PagedLayer, q: Tensor, k: Tensor, v: Tensor, u: Tensor,
                             gates: dict[str, Tensor], backend: str | None = None) -> Tensor:
        """``decode_paged`` for a matrix memory (``linear``/``swla``) with a routing variant,
        its cached readout done by the kernel ``dispatch.paged_mc_decode_linear`` (Triton on
        CUDA; ``backend`` forces one, see ``mcserve.kernels.dispatch``).

        Same arguments, result and updates of ``pl`` as ``decode_paged``. Host-tier blocks
        (``pl.fetch``): a selecting variant routes first and only the picked blocks are fetched
        (then a softmax over them and the online memory, i.e. an unselected readout over a
        per-head table); otherwise every block of the table is fetched. Per-request top_k
        overrides (``pl.top_k`` ``(B,)``) are honoured.
        """
        from mcserve.kernels import dispatch

        cfg = self.cfg
        if not self.family.linear or self.collapsed or not cfg.caches_blocks or not cfg.routes:
            raise ValueError("decode_paged_kernels handles linear/swla memories with a routing "
                             "variant over constant segments")
        C, top_k = cfg.segment_len, cfg.top_k
        selects = cfg.selects
        row_top_k = pl.top_k if selects else None
        if row_top_k is not None:  # the largest is the kernel's compile-time pick count
            top_k = pl.top_k_range[1] if pl.top_k_range is not None else int(row_top_k.max())
        cum = pl.seg_ksum + k[:, 0]
        pl.seg_ksum = cum
        p_on = cum / (pl.seg_len + 1).to(q.dtype)[:, None, None]
        o, pl.mem = self.family.scan(pl.mem, q, k, v, gates)
        table, state_table = pl.table, None
        if pl.fetch is not None:
            if selects and (table.shape[1] > top_k or row_top_k is not None):
                idx, _ = dispatch.ssc_router(u[:, 0], pl.ksum_pool, table, segment_len=C,
                                             top_k=top_k, row_top_k=row_top_k, backend=backend)
                B, H = idx.shape[:2]
                ids = table[:, None, :].expand(B, H, table.shape[1]).gather(2, idx.clamp_min(0))
                table = torch.where(idx >= 0, ids, -1)  # (B, H, top_k) block ids
                selects, row_top_k = False, None  # picked already: read every listed block
            if table.dim() == 2:  # staging is per head: one list per (row, head)
                table = table[:, None, :].expand(table.shape[0], q.shape[2], table.shape[1])
            state_table = torch.where(table >= 0, pl.fetch(table.clamp_min(0), 1), -1)
        y = dispatch.paged_mc_decode_linear(
            q[:, 0], u[:, 0], o[:, 0], p_on, table, pl.pool["S"], pl.ksum_pool,
            variant=cfg.variant if selects else _ROUTE_ALL, segment_len=C, top_k=top_k,
            state_table=state_table, row_top_k=row_top_k, backend=backend)
        return y[:, None]

    @staticmethod
    def _gather_blocks_by_id(pool: State, ids: Tensor) -> State:
        """Pool rows per (row, block, head): ids ``(B, n, H)`` → tensors ``(B, n, H, ...)``."""
        h = torch.arange(ids.shape[2], device=ids.device)[None, None, :]
        return {key: t[ids, h] for key, t in pool.items()}

    def _scan_rows(self, mem: State, q: Tensor, k: Tensor, v: Tensor, gates: dict[str, Tensor],
                   soup: tuple | None = None, *, inplace: bool = False
                   ) -> tuple[Tensor, State]:
        """family.scan (or scan_soup) for rows that may sit at different inner-chunk phases.

        Deep memories keep the fill of the current inner chunk per row; their scan needs one
        fill per call, so rows are grouped by fill (at most ``inner_chunk`` groups, never a
        loop over sequences).
        """
        def run(m, qq, kk, vv, gg, sp):
            if sp is None and inplace and qq.shape[1] == 1:
                return self.family.step_(m, qq, kk, vv, gg), m
            if sp is None:
                return self.family.scan(m, qq, kk, vv, gg)
            w_on, cached, w_c = sp
            return self.family.scan_soup(m, qq, kk, vv, gg, w_on, cached, w_c)

        inplace = inplace and hasattr(self.family, "step_")
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
        """The online segment is complete: cache its memory, start a new segment.

        With ``st.record`` a list, appends the checkpoint as the engine's pool block needs it:
        ``mem`` (the whole online memory, to resume from), ``ksum``, ``pos`` (where the segment
        ends) and, for collapsed variants, ``csum`` (the running sum including this one)."""
        block = {key: st.mem[key] for key in self.family.readout_keys}
        if self.collapsed and st.num_cached:
            st.cached = {key: st.cached[key] + block[key][:, None] for key in block}
        else:
            st.append(block, st.seg_ksum, st.seg_len, st.pos)
        if st.record is not None:
            st.record.append({
                "mem": dict(st.mem), "ksum": st.seg_ksum, "pos": st.pos,
                "csum": ({key: st.cached[key][:, 0] for key in block} if self.collapsed
                         else None)})
        self._new_segment(st, 1, init)

    def _new_segment(self, st: MCLayerState, pushed: int,
                     init: dict[str, Tensor] | None) -> None:
        """After ``pushed`` segments were cached: an empty online segment (in independent mode
        from the initial memory)."""
        st.n_segments += pushed
        st.seg_ksum = torch.zeros_like(st.seg_ksum)
        st.seg_len = 0
        if self.cfg.independent:
            B, H, K = st.seg_ksum.shape
            st.mem = self.family.init_state(B, H, K, st.v_dim, dtype=st.seg_ksum.dtype,
                                            device=st.seg_ksum.device, init=init)

    def _push_many(self, st: MCLayerState, S: Tensor, ksum: Tensor, pos: list[int],
                   init: dict[str, Tensor] | None) -> None:
        """``push`` of n completed segments of the gated linear memory at once (not collapsed):
        their states ``S`` ``(B, n, H, K, V)``, key sums ``(B, n, H, K)`` and end positions;
        leaves ``st`` as n ``push`` calls would (a new, empty online segment)."""
        C = self.cfg.segment_len
        st.extend({"S": S}, ksum, [C] * len(pos), pos)
        if st.record is not None:
            st.record += [{"mem": {"S": S[:, i]}, "ksum": ksum[:, i], "pos": p, "csum": None}
                          for i, p in enumerate(pos)]
        st.mem, st.pos = {"S": S[:, -1]}, pos[-1]
        self._new_segment(st, len(pos), init)

    # ------------------------------------------------------------------ one piece
    def _piece(self, st: MCLayerState, q: Tensor, k: Tensor, v: Tensor, u: Tensor,
               gates: dict[str, Tensor]) -> Tensor:
        """Tokens that all see the same cached set; updates ``st`` and returns y (B, L, H, V)."""
        B, L, H, K = q.shape
        N = st.num_cached
        cum = st.seg_ksum[:, None] + k.cumsum(1)  # (B, L, H, K) online key sums incl. token t
        cfg = self.cfg
        cached = st.cached
        if cfg.fixed_weights:
            scale = 1.0 / (st.n_segments + 1) if cfg.averages else 1.0
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
            top_k = st.top_k or cfg.top_k
            if cfg.selects and N > top_k:
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
