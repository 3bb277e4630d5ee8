"""The static decode step of ``ModelRunner`` (a mixin: ``runner.py`` holds the rest).

The step pads the decode batch to a bucket of ``batch_buckets`` (padded rows on the state
cache's scratch slot, and for a hybrid on the KV pool's scratch block) and its table to a bucket
of ``width_buckets`` (segment blocks; a hybrid's: its KV blocks), reading every input from one
static buffer: the step CUDA graphs capture and replay (``cuda_graphs.py``). On the CPU the same
step runs eagerly when ``static_decode`` is on. Checkpoint pushes and counters happen after the
step, on the host's knowledge of the rows (``ModelRunner._finish_decode``).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from mcserve.engine.cuda_graphs import DecodeGraphs, bucket
from mcserve.engine.sequence import Sequence
from mcserve.models.attention import PagedKV

log = logging.getLogger(__name__)

_HEAD = 7  # rows of the static buffer's head (see ``_fill_static``)


class StaticDecode:
    """The static step's buffers, filling, forward and capture, over ``ModelRunner``'s state
    (model, caches, buckets, ``_paged_layer``)."""

    def _static_buffers(self) -> None:
        """The static inputs, one buffer: ``_HEAD`` rows of the largest batch bucket (token,
        slot, fill, segments, top_k, KV length, KV write row; a step of B rows reads the first
        B of each), then the table; on a GPU filled by one copy from a pinned twin. The layout
        does not depend on B, so the padding ``reset_static_inputs`` writes is valid for
        every bucket that warm-up and capture run."""
        B, N = self.batch_buckets[-1], self.width_buckets[-1]
        dev = self.model.device
        self._static_in = torch.empty(_HEAD * B + B * N, dtype=torch.long, device=dev)
        self._static_host = (torch.empty(_HEAD * B + B * N, dtype=torch.long, pin_memory=True)
                             if dev.type == "cuda" else None)
        self._static_copied = torch.cuda.Event() if dev.type == "cuda" else None
        self.reset_static_inputs()

    @property
    def _static_kv(self) -> bool:
        """Whether the static step serves this model: any model but a hybrid that also reads
        segment blocks (two tables)."""
        return self.kv is None or not self.reads_table

    def _static_shape(self, seqs: list[Sequence]) -> tuple[int, int] | None:
        """The (batch, table width) buckets of a static step for ``seqs``; None when the batch
        or a table is larger than the largest bucket (the ragged step serves it)."""
        B = bucket(self.batch_buckets, len(seqs))
        if self.kv is not None:  # a hybrid's table is its KV table
            N = bucket(self.width_buckets, max(len(s.kv_table) for s in seqs))
            return None if B is None or N is None else (B, N)
        if not self.reads_table:
            return None if B is None else (B, 0)
        N = bucket(self.width_buckets, max(1, max(len(s.block_table) for s in seqs)))
        return None if B is None or N is None else (B, N)

    def _fill_static(self, seqs: list[Sequence], B: int, N: int) -> None:
        """Write the step's inputs into the static buffer as ``static_forward`` reads it:
        rows of (token, slot, segment fill, cached segments, top_k, KV length, KV write row),
        the first B columns of the (_HEAD, largest bucket) head, then the (B, N) block table (a
        hybrid's: its KV table). Rows past ``len(seqs)`` are padding: the scratch slot, no
        blocks (a hybrid's: one token in the KV pool's scratch block)."""
        pad = B - len(seqs)
        Bmax = self.batch_buckets[-1]
        k0 = self.mc.top_k
        kv = self.kv
        vals = ([s.last_id for s in seqs] + [0] * pad
                + [s.slot for s in seqs] + [self.cache.scratch_slot] * pad
                + [s.segment_fill for s in seqs] + [0] * pad
                + [len(s.block_table) for s in seqs] + [0] * pad
                + [s.mc_top_k or k0 for s in seqs] + [k0] * pad)
        if kv is None:
            vals += [1] * B + [0] * B
            tables, fill = [s.block_table for s in seqs], -1
        else:
            bs = kv.block_size
            vals += [s.num_computed_tokens + 1 for s in seqs] + [1] * pad
            vals += ([s.kv_table[p // bs] * bs + p % bs
                      for s in seqs for p in (s.num_computed_tokens,)]
                     + [kv.scratch * bs] * pad)
            tables, fill = [s.kv_table for s in seqs], kv.scratch
        table: list[int] = []
        if N:
            for t in tables:
                table += t
                table += [-1] * (N - len(t))
            table += [fill] * (N * pad)
        n = _HEAD * Bmax + B * N
        dst = self._static_in if self._static_host is None else self._static_host
        if self._static_host is not None:  # the pinned buffer is reused only once the
            self._static_copied.synchronize()  # previous step's copy out of it has finished
        dst[:_HEAD * Bmax].view(_HEAD, Bmax)[:, :B] = torch.tensor(vals).view(_HEAD, B)
        dst[_HEAD * Bmax:n] = torch.tensor(table, dtype=torch.long)
        if self._static_host is not None:  # one asynchronous host-to-device copy
            self._static_in[:n].copy_(self._static_host[:n], non_blocking=True)
            self._static_copied.record()

    def reset_static_inputs(self) -> None:
        """Padding in every row of the static buffer (what graph capture runs on)."""
        kv = self.kv
        self._static_in.fill_(-1 if kv is None else kv.scratch)  # tables: no block / scratch
        B = self.batch_buckets[-1]
        head = self._static_in[:_HEAD * B].view(_HEAD, B)  # B: the largest bucket
        head[0] = 0
        head[1] = self.cache.scratch_slot
        head[2:4] = 0
        head[4] = self.mc.top_k
        head[5] = 1
        head[6] = 0 if kv is None else kv.scratch * kv.block_size

    def _decode_static(self, seqs: list[Sequence], B: int, N: int, offloaded: bool) -> Tensor:
        """The static step for ``seqs`` padded to (B, N): a graph replay when one is captured
        for the shape and the step needs nothing the graph leaves out, else eagerly. Returns
        the real rows' logits in the callers' order."""
        self._fill_static(seqs, B, N)
        per_row = any(s.mc_top_k for s in seqs)
        if (self.graphs is not None and not offloaded and not per_row
                and self.graphs.has(B, N)):
            return self.graphs.replay(B, N)[:len(seqs)].clone()  # the next replay overwrites
        k_range = None
        if per_row:
            ks = [s.mc_top_k or self.mc.top_k for s in seqs]
            ks += [self.mc.top_k] * (B - len(seqs))
            k_range = (min(ks), max(ks))
        return self.static_forward(B, N, top_k_range=k_range, offloaded=offloaded)[:len(seqs)]

    @torch.no_grad()
    def static_forward(self, B: int, N: int, *, top_k_range: tuple[int, int] | None = None,
                       offloaded: bool = False) -> Tensor:
        """The region a CUDA graph captures: one decode token for B rows (padding included)
        whose inputs ``_fill_static`` wrote, with a block table N wide. Gathers every layer's
        slot rows, runs embedding → layers (``forward_paged``) → LM head, scatters the rows'
        new states back and re-initialises the scratch slot (so the padded rows always start
        from a fresh state and never overflow). Returns logits ``(B, V)``.

        No host syncs, no data-dependent Python branches and no host-to-device copies: shapes
        come from (B, N) alone. ``top_k_range`` (per-request top_k) and ``offloaded`` (host-tier
        blocks, fetched on demand) do sync, and are never captured."""
        Bmax = self.batch_buckets[-1]
        head = self._static_in[:_HEAD * Bmax].view(_HEAD, Bmax)[:, :B]
        table = self._static_in[_HEAD * Bmax:_HEAD * Bmax + B * N].view(B, N)
        tokens, idx, seg_len, n_seg = head[0][:, None], head[1], head[2], head[3]
        top_k = head[4] if top_k_range is not None else None
        kw = {}
        if self.kv is not None:  # the table is the KV table; no segment blocks are read
            kw["kv"] = PagedKV(self.kv.k, self.kv.v, table, None, None, head[6], head[5])
            table = table[:, :0]
        # a model whose fused decode reads the slot pools through a row index gets the pools
        # and the rows: no gather into the padded batch, no scatter back (a layer that cannot
        # take the fused call gathers its rows itself, PagedLayer.gathered)
        rows = self._reads_state_rows()
        layers = []
        for li, (mc, sl, bl) in enumerate(zip(self.mems, self.cache.slot, self.cache.block,
                                              strict=True)):
            got = sl if rows else {n: t.index_select(0, idx) for n, t in sl.items()}
            pl = self._paged_layer(li, mc, got, bl, seg_len, n_seg, table, top_k, top_k_range,
                                   offloaded)
            pl.rows = idx if rows else None
            layers.append(pl)
        logits = self.model.forward_paged(tokens, layers, **kw)[:, 0]  # (B, V)
        if not rows:
            for sl, pl in zip(self.cache.slot, layers, strict=True):
                for name, t in self._layer_outputs(pl).items():
                    sl[name].index_copy_(0, idx, t)  # padded rows all land on the scratch slot
        self.cache.clear_slot(self.cache.scratch_slot, self.init_mem)
        return logits

    def _reads_state_rows(self) -> bool:
        """Whether the static step hands the model its slot pools and a row index instead of
        gathered rows: the model says its decode reads them (``decode_state_rows``) and the
        kernel backend is active (the torch path would gather every layer anyway)."""
        from mcserve.kernels import dispatch

        if not getattr(self.model, "decode_state_rows", False):
            return False
        pool = next(iter(self.cache.slot[0].values()))
        return dispatch.get_backend(pool) == "triton"

    def capture_decode_graphs(self) -> bool:
        """Capture the static decode step as CUDA graphs (one per batch and table-width
        bucket) and turn the static step on; False, with the runner left eager, when the model
        is not on a CUDA device or its step cannot be captured (a family that syncs, such as
        the deep memories' inner-chunk fill, or loglinear's private states)."""
        if (self.private or not self._static_kv or self.model.device.type != "cuda"
                or not torch.cuda.is_available()):
            return False
        limit = self.model.max_graph_batch()
        batches = [b for b in self.batch_buckets if limit is None or b <= limit]
        if not batches:
            log.info("decode CUDA graphs off: the model's step syncs at every batch size")
            return False
        graphs = DecodeGraphs(self.static_forward, batches, self.width_buckets,
                              before_capture=self.reset_static_inputs)
        try:
            graphs.capture()
        except Exception as e:  # the eager step still serves; say why once
            log.warning("decode CUDA graphs disabled, the decode step runs eagerly: %s: %s",
                        type(e).__name__, e)
            self.cache.clear_slot(self.cache.scratch_slot, self.init_mem)
            return False
        self.graphs = graphs
        self.static_decode = True
        return True
