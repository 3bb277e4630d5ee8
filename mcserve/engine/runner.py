"""ModelRunner: turns the scheduler's decision into tensors and runs the model.

* A prefill chunk (any number of segments) is ONE model call: the model records the checkpoint of
  every segment boundary the chunk crosses (``MCLayerState.record``), and the runner scatters
  them into their pool blocks in one write per pool tensor. The chunks of several sequences, of
  any lengths and phases, are one variable-length call (``prefill_varlen``, the model's
  ``forward_varlen``).
* Decodes run as one ragged batch (``MCForCausalLM.forward_paged``): rows at different
  positions, with different numbers of cached segments, read their blocks from the pool through
  a padded block table. No Python loop over sequences.
* The static decode step (``static_decode.py``, a mixin) pads that batch to bucket sizes and
  reads its inputs from one static buffer: the step CUDA graphs replay (``cuda_graphs.py``).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from mcserve.config import MCConfig
from mcserve.engine.cuda_graphs import DecodeGraphs, decode_buckets, table_buckets
from mcserve.engine.kv_cache import KVCache
from mcserve.engine.prefix_keys import block_hash
from mcserve.engine.resume import ResumePoint, ResumeStore
from mcserve.engine.scheduler import ScheduledSeq
from mcserve.engine.sequence import Sequence
from mcserve.engine.state_cache import StateCache
from mcserve.engine.static_decode import StaticDecode
from mcserve.models.mc import MCMemory
from mcserve.models.mc_state import MCLayerState, PagedLayer
from mcserve.models.native import MCForCausalLM
from mcserve.models.state import LayerState, ModelState

log = logging.getLogger(__name__)



class ModelRunner(StaticDecode):
    def __init__(self, model: MCForCausalLM, cache: StateCache, mc: MCConfig, *,
                 max_model_len: int | None = None):
        self.model = model
        self.cache = cache
        self.mc = mc
        # completed segments become pool blocks (constant segmentation); False: no segments
        # at all, or loglinear's private states (below)
        self.caches_blocks = mc.caches_blocks
        self.mems = [blk.mixer.memory for blk in model.layers]
        # the initial online memory of each layer, without the batch dim
        self.init_mem = [
            {k: t[0] for k, t in blk.mixer.init_state(1, model.dtype, model.device).mc.mem.items()}
            for blk in model.layers
        ]
        # checkpoints that change every token (loglinear: a stack of at most log2(n) + 1 per
        # layer): the sequences keep their model state privately instead of in the pools
        self.private = mc.log_segmented
        self.states: dict[int, ModelState] = {}
        self.resume: ResumeStore | None = None  # resume points (set by the engine)
        # hybrid models: the attention layers' paged KV pool (set by the engine)
        self.kv: KVCache | None = None
        # each layer's value dim (independent mode restarts a segment's memory with it)
        self.v_dims = [blk.mixer.init_state(1, model.dtype, model.device).mc.v_dim
                       for blk in model.layers]
        # static decode (``static_forward``): the batch padded to a bucket of
        # ``batch_buckets``, the block table to one of ``width_buckets`` (the most cached
        # segments a sequence can have: max_model_len's, and no more than the pools hold); the
        # step CUDA graphs capture. Off by default on the CPU, where the ragged step is faster
        self.reads_table = mc.caches_blocks and not all(m.collapsed for m in self.mems)
        cap = cache.num_blocks + cache.num_host_blocks
        if max_model_len is not None:
            cap = min(cap, max_model_len // mc.segment_len)
        self.max_model_len = max_model_len
        self.batch_buckets = decode_buckets(cache.num_slots)
        self.width_buckets = table_buckets(cap if self.reads_table else 0)
        self.static_decode = False
        self.graphs: DecodeGraphs | None = None
        # the last contiguous decode's slot range and its per-layer views of the slot pools
        self._views: tuple[tuple[int, int] | None, list[dict[str, Tensor]]] = (None, [])
        self._static_buffers()
        cache.clear_slot(cache.scratch_slot, self.init_mem)

    def attach_kv(self, kv: KVCache | None) -> None:
        """A hybrid model's KV pool. Without segment blocks to read, the static step's table
        is the KV block table (its width buckets from ``max_model_len``'s blocks)."""
        self.kv = kv
        if kv is not None and not self.reads_table:
            cap = kv.num_blocks if self.max_model_len is None else min(
                kv.num_blocks, kv.blocks_for(self.max_model_len))
            self.width_buckets = table_buckets(cap)
            self._static_buffers()

    # ------------------------------------------------------------------ state <-> pool
    def release(self, seq: Sequence) -> None:
        """Forget a sequence's private state (loglinear) when it finishes or is preempted."""
        self.states.pop(seq.seq_id, None)

    def init_slot(self, seq: Sequence, resume_block: int,
                  point: ResumePoint | None = None) -> None:
        """(Re)initialise ``seq``'s slot: from resume point ``point`` (unpinned once copied),
        else fresh (``resume_block`` -1) or from the checkpoint of block ``resume_block``."""
        if point is not None:
            for sl, rows in zip(self.cache.slot, point.rows, strict=True):
                for name, t in sl.items():
                    t[seq.slot].copy_(rows[name], non_blocking=True)
            if point.kv_blocks is not None:  # the point's partial KV block: a copy of its own
                full, part = divmod(point.pos, self.kv.block_size)
                if part:
                    self.kv.copy_rows(point.kv_blocks[full], seq.kv_table[full], part)
            elif point.kv is not None:  # KV from the host, a disk or another engine
                self.kv.write(seq.kv_table, point.kv)
            self.resume.unpin(point)
        elif resume_block < 0:
            self.cache.clear_slot(seq.slot, self.init_mem)
        else:
            init = self.init_mem if self.mc.independent else [None] * len(self.init_mem)
            self.cache.copy_block_to_slot(resume_block, seq.slot, init)

    def keep(self, seq: Sequence) -> None:
        """Keep ``seq``'s state as it is now (``num_computed_tokens`` tokens in) as a resume
        point: a copy of its slot row, or of its private state. Already kept: made recent."""
        pos = seq.num_computed_tokens
        if self.resume is None or pos == 0:
            return
        key = seq.resume_key(pos)
        if self.resume.has(key):
            self.resume.touch(key)
        elif self.private:
            if seq.seq_id in self.states:
                self.resume.put_private(key, pos, seq.segment_fill, self.states[seq.seq_id])
        elif seq.slot is not None:
            rows = [{name: t[seq.slot].clone() for name, t in sl.items()}
                    for sl in self.cache.slot]
            kv_blocks = None
            if self.kv is not None:  # the KV before pos, held by the point
                kv_blocks = seq.kv_table[:self.kv.blocks_for(pos)]
                self.kv.share(kv_blocks)
            self.resume.put_rows(key, pos, seq.segment_fill, rows,
                                 seq.block_hashes if self.caches_blocks else None, kv_blocks)

    def load_state(self, seq: Sequence) -> ModelState:
        """A batch-of-one model state for ``seq`` from its slot and block table."""
        s, table = seq.slot, seq.block_table
        N, C = len(table), self.mc.segment_len
        idx = torch.tensor(table, dtype=torch.long, device=self.model.device)
        layers = []
        for li, (mc, sl, bl) in enumerate(zip(self.mems, self.cache.slot, self.cache.block,
                                              strict=True)):
            keys = mc.family.readout_keys
            mem = {name[4:]: t[s:s + 1].clone() for name, t in sl.items()
                   if name.startswith("mem.")}
            if mc.collapsed:
                n = min(N, 1)
                cached = {k: sl[f"csum.{k}"][s:s + 1, None][:, :n].clone() for k in keys}
                ksum = bl["ksum"].new_zeros((1, n) + bl["ksum"].shape[1:])
            else:
                cached = {k: self.cache.read_block(li, f"mem.{k}", table)[None] for k in keys}
                ksum = bl["ksum"][idx][None]
            st = MCLayerState(
                mem=mem, seg_ksum=sl["seg_ksum"][s:s + 1].clone(), seg_len=seq.segment_fill,
                cached=cached, cached_ksum=ksum, cached_len=[C] * ksum.shape[1],
                cached_pos=[(i + 1) * C for i in range(ksum.shape[1])], n_segments=N,
                pos=seq.num_computed_tokens, v_dim=self.v_dims[li],
                top_k=seq.mc_top_k,
            )
            conv = sl["conv"][s:s + 1].clone() if "conv" in sl else None
            layers.append(LayerState(st, conv))
        return ModelState(layers)

    def store_state(self, seqs: list[Sequence], state: ModelState | list[ModelState]) -> None:
        """Row r of ``state`` back into the slot of ``seqs[r]``; ``state`` is one batched state,
        or a list of batch-of-one states (one per sequence, at any phase). One write per slot
        tensor and layer."""
        states = [state] if isinstance(state, ModelState) else state
        s = torch.tensor([q.slot for q in seqs], dtype=torch.long, device=self.model.device)

        def rows(ts: list[Tensor]) -> Tensor:
            return ts[0] if len(ts) == 1 else torch.cat(ts)

        for li, (mc, sl) in enumerate(zip(self.mems, self.cache.slot, strict=True)):
            lss = [st.layers[li] for st in states]
            for k in lss[0].mc.mem:
                sl[f"mem.{k}"][s] = rows([ls.mc.mem[k] for ls in lss])
            sl["seg_ksum"][s] = rows([ls.mc.seg_ksum for ls in lss])
            if lss[0].conv is not None:
                sl["conv"][s] = rows([ls.conv for ls in lss])
            if mc.collapsed:  # rows with a cached segment: its running sum
                have = [r for r, ls in enumerate(lss) if ls.mc.num_cached]
                if have:
                    idx = s if len(have) == len(lss) else s[have]
                    for k in mc.family.readout_keys:
                        sl[f"csum.{k}"][idx] = rows([lss[r].mc.cached[k][:, 0] for r in have])

    def _register(self, seq: Sequence, bid: int) -> None:
        """Block ``bid`` holds the checkpoint of ``seq``'s segment that just completed."""
        C, s = self.mc.segment_len, len(seq.block_table)
        assert len(seq.block_hashes) == s, "a key for every block of the table"
        # chain_hashes' next link: the segment's own tokens after the previous key
        h = block_hash(seq.block_hashes[-1] if seq.block_hashes else None,
                       seq.ids(s * C, (s + 1) * C), seq.salt)
        seq.block_table.append(bid)
        seq.block_hashes.append(h)
        self.cache.register(bid, h)

    # ------------------------------------------------------------------ prefill
    @property
    def varlen(self) -> bool:
        """Whether ``prefill_varlen`` serves this model (not loglinear's private states)."""
        return not self.private

    @staticmethod
    def _phase(item: ScheduledSeq) -> tuple:
        """Items with equal phases continue from the same position, fill of the online segment
        and number of cached segments, with the same per-request MC overrides and chunk length:
        the model mixes them as one batch when they are adjacent (``phase_runs``)."""
        seq = item.seq
        return (item.num_tokens, seq.num_computed_tokens, seq.segment_fill,
                len(seq.block_table), seq.mc_top_k or 0)

    @torch.no_grad()
    def prefill_varlen(self, items: list[ScheduledSeq]) -> Tensor:
        """The chunks of several sequences, of any lengths and phases, through the model in ONE
        variable-length call (``forward_varlen``: tokens packed back to back, the token-wise
        work once, the sequence mixing per sequence, or per batch of sequences at one phase with
        equal chunks: the items are packed in phase order). Each records the checkpoints of the
        segment boundaries its chunk crosses (any number), written into its pool blocks with
        one scatter per layer and pool tensor for all items. Returns the last position's
        logits of each item ``(n, V)``, in the order of ``items``; the same as ``prefill`` of
        each alone."""
        assert self.varlen, "prefill_varlen: private (loglinear) states prefill one by one"
        order = sorted(range(len(items)), key=lambda r: self._phase(items[r]))
        items = [items[r] for r in order]
        seqs = [it.seq for it in items]
        for it in items:
            if it.resume_block is not None:
                self.init_slot(it.seq, it.resume_block, it.resume_point)
        states = [self.load_state(q) for q in seqs]
        lens = [it.num_tokens for it in items]
        ids = [t for q, n in zip(seqs, lens, strict=True)
               for t in q.ids(q.num_computed_tokens, q.num_computed_tokens + n)]
        x = torch.tensor([ids], dtype=torch.long, device=self.model.device)
        if self.caches_blocks:
            for st in states:
                for ls in st.layers:
                    ls.mc.record = []  # MCMemory.forward appends each checkpoint it completes
        kw = {} if self.kv is None else {"kv": self.kv.view(seqs, lens)}
        logits, states = self.model.forward_varlen(x, states, lens, **kw)  # (n, V)
        for q, n in zip(seqs, lens, strict=True):
            q.num_computed_tokens += n
        if self.caches_blocks:
            self._write_checkpoints(items, states)
        self.store_state(seqs, states)
        for it in items:
            if it.snapshot:
                self.keep(it.seq)
        if order == sorted(order):
            return logits
        back = [0] * len(order)
        for r, o in enumerate(order):
            back[o] = r
        return logits[torch.tensor(back, device=logits.device)]  # in the callers' order

    @torch.no_grad()
    def prefill(self, item: ScheduledSeq, want_all_logits: bool) -> Tensor:
        """Compute ``item.num_tokens`` tokens of one sequence in one model call, however many
        segment boundaries it crosses; returns logits ``(n, V)`` (all positions) or ``(1, V)``
        (the last one)."""
        seq = item.seq
        if self.private:
            x = torch.tensor([seq.ids(seq.num_computed_tokens,
                                      seq.num_computed_tokens + item.num_tokens)],
                             device=self.model.device)
            rp = item.resume_point
            if rp is not None:
                state = copy.deepcopy(rp.private)
                self.resume.unpin(rp)
            else:
                state = None if item.resume_block is not None else self.states[seq.seq_id]
            logits, self.states[seq.seq_id] = self.model(x, state, last_only=not want_all_logits)
            seq.num_computed_tokens += item.num_tokens
            if item.snapshot:
                self.keep(seq)
            return logits[0] if want_all_logits else logits[0, -1:]
        if item.resume_block is not None:
            self.init_slot(seq, item.resume_block, item.resume_point)
        state = self.load_state(seq)
        n = item.num_tokens
        x = torch.tensor([seq.ids(seq.num_computed_tokens, seq.num_computed_tokens + n)],
                         dtype=torch.long, device=self.model.device)
        if self.caches_blocks:
            for ls in state.layers:
                ls.mc.record = []  # MCMemory.forward appends each checkpoint it completes
        if self.kv is not None:  # a hybrid: its attention KV is in the paged pool
            logits, (state,) = self.model.forward_varlen(
                x, [state], [n], kv=self.kv.view([seq], [n]), all_logits=want_all_logits)
            logits = logits[None] if want_all_logits else logits[:, None]
        else:
            logits, state = self.model(x, state, last_only=not want_all_logits)
        seq.num_computed_tokens += n
        if self.caches_blocks:
            self._write_checkpoints([item], [state])
        self.store_state([seq], state)
        if item.snapshot:
            self.keep(seq)
        return logits[0]

    def _write_checkpoints(self, items: list[ScheduledSeq], states: list[ModelState]) -> None:
        """Scatter the checkpoints the model recorded in this step (``states[i]``: item i's
        batch-of-one state; each item crossed its own number of boundaries) into the blocks the
        scheduler allocated for them (``item.new_blocks``, oldest first), one write per layer
        and pool tensor for all items, and register them."""
        C = self.mc.segment_len
        for it, st in zip(items, states, strict=True):
            assert len(it.new_blocks) == len(st.layers[0].mc.record), \
                "the scheduler's new blocks and the checkpoints of the chunk disagree"
            it.seq.segment_fill = (it.seq.segment_fill + it.num_tokens) % C
        ids = [bid for it in items for bid in it.new_blocks]  # the rows below, in order
        idx = (torch.tensor(ids, dtype=torch.long, device=self.model.device) if ids else None)
        for li, (mc, bl) in enumerate(zip(self.mems, self.cache.block, strict=True)):
            rec = []  # every item's checkpoints, items in order, each oldest first
            for st in states:
                ls = st.layers[li].mc
                rec += ls.record
                ls.record = None
            if not rec:
                continue

            def rows(get: Callable[[dict], Tensor], rec: list[dict] = rec) -> Tensor:
                ts = [get(r) for r in rec]  # each (1, ...)
                return ts[0] if len(ts) == 1 else torch.cat(ts)

            for k in rec[0]["mem"]:
                bl[f"mem.{k}"][idx] = rows(lambda r, k=k: r["mem"][k])
            bl["ksum"][idx] = rows(lambda r: r["ksum"])
            if "conv" in bl:
                bl["conv"][idx] = rows(lambda r: r["conv"])
            if mc.collapsed:
                for k in mc.family.readout_keys:
                    bl[f"csum.{k}"][idx] = rows(lambda r, k=k: r["csum"][k])
        for it in items:
            for bid in it.new_blocks:
                self._register(it.seq, bid)

    # ------------------------------------------------------------------ decode
    @torch.no_grad()
    def decode(self, items: list[ScheduledSeq]) -> Tensor:
        """One token for each sequence, as one ragged batch; returns logits ``(B, V)``."""
        seqs = [it.seq for it in items]
        dev = self.model.device
        if self.private:  # per sequence: each has its own logarithmic segmentation
            rows = []
            for s in seqs:
                x = torch.tensor([[s.last_id]], device=dev)
                logits, self.states[s.seq_id] = self.model(x, self.states[s.seq_id])
                s.num_computed_tokens += 1
                rows.append(logits[0, -1])
            return torch.stack(rows)
        # host-tier blocks and per-request top_k are known on the host: no read-back of the
        # table or the top_k tensor (a sync per step on a GPU)
        hb = self.cache.host_base
        offloaded = self.cache.num_host_blocks > 0 and any(
            b >= hb for s in seqs for b in s.block_table)
        if self.static_decode and self._static_kv:
            shape = self._static_shape(seqs)
            if shape is not None:
                logits = self._decode_static(seqs, *shape, offloaded)
                self._finish_decode(items)
                return logits
        return self._decode_ragged(items, offloaded)

    def _decode_ragged(self, items: list[ScheduledSeq], offloaded: bool) -> Tensor:
        """``decode`` at the batch's own shape: rows in slot order, the table as wide as the
        longest one; the slot pool's rows are views when the slots are contiguous."""
        dev = self.model.device
        seqs = [it.seq for it in items]
        # rows in slot order: when the slots are one contiguous range (the usual case with
        # continuous batching), every layer's online state is a view of the slot pool and is
        # updated in place, with no gather before the step and no scatter after it
        order = sorted(range(len(items)), key=lambda r: seqs[r].slot)
        items = [items[r] for r in order]
        seqs = [it.seq for it in items]
        s0 = seqs[0].slot
        contiguous = all(s.slot == s0 + r for r, s in enumerate(seqs))
        idx = (slice(s0, s0 + len(seqs)) if contiguous else
               torch.tensor([s.slot for s in seqs], dtype=torch.long, device=dev))
        n_max = max(len(s.block_table) for s in seqs)
        if len(seqs) == 1 and n_max:  # read-only below: the sequence's own tensor will do
            table = seqs[0].table_tensor(dev)[None]
        else:
            table = torch.full((len(seqs), n_max), -1, dtype=torch.long, device=dev)
            for r, s in enumerate(seqs):
                if s.block_table:
                    table[r, :len(s.block_table)] = s.table_tensor(dev)
        seg_len = torch.tensor([s.segment_fill for s in seqs], dtype=torch.long, device=dev)
        n_seg = torch.tensor([len(s.block_table) for s in seqs], dtype=torch.long, device=dev)
        ks = [s.mc_top_k or self.mc.top_k for s in seqs]
        per_row = any(s.mc_top_k for s in seqs)
        top_k = torch.tensor(ks, device=dev) if per_row else None
        # per layer: the slot tensors' rows as handed to the model, views when contiguous (the
        # same range as the last step's reuses them: the pools are never replaced), else copies
        if not contiguous:
            rows_in = [{n: t[idx] for n, t in sl.items()} for sl in self.cache.slot]
        elif self._views[0] == (s0, len(seqs)):
            rows_in = self._views[1]
        else:
            rows_in = [{n: t[idx] for n, t in sl.items()} for sl in self.cache.slot]
            self._views = ((s0, len(seqs)), rows_in)
        layers = []
        for li, (mc, got, bl) in enumerate(zip(self.mems, rows_in, self.cache.block,
                                               strict=True)):
            layers.append(self._paged_layer(li, mc, got, bl, seg_len, n_seg, table, top_k,
                                             (min(ks), max(ks)) if per_row else None,
                                             offloaded))
        tokens = torch.tensor([[s.last_id] for s in seqs], dtype=torch.long, device=dev)
        kw = {} if self.kv is None else {"kv": self.kv.view(seqs, [1] * len(seqs))}
        logits = self.model.forward_paged(tokens, layers, **kw)[:, 0]
        for sl, pl, got in zip(self.cache.slot, layers, rows_in, strict=True):
            for name, t in self._layer_outputs(pl).items():
                if not (contiguous and t is got[name]):  # not updated in place in the pool
                    sl[name][idx] = t
        self._finish_decode(items)
        if order == sorted(order):
            return logits
        back = torch.empty(len(order), dtype=torch.long, device=logits.device)
        back[torch.tensor(order, device=logits.device)] = torch.arange(len(order),
                                                                       device=logits.device)
        return logits[back]  # in the callers' row order

    def _paged_layer(self, li: int, mc: MCMemory, got: dict[str, Tensor],
                     bl: dict[str, Tensor], seg_len: Tensor, n_seg: Tensor, table: Tensor,
                     top_k: Tensor | None, top_k_range: tuple[int, int] | None,
                     offloaded: bool) -> PagedLayer:
        """Layer ``li``'s ``PagedLayer`` over the slot rows ``got`` (writable views or
        copies) and the block pool ``bl``."""
        keys = mc.family.readout_keys
        return PagedLayer(
            mem={n[4:]: t for n, t in got.items() if n.startswith("mem.")},
            conv=got.get("conv"),
            seg_ksum=got["seg_ksum"], seg_len=seg_len, n_seg=n_seg,
            csum={k: got[f"csum.{k}"] for k in keys} if mc.collapsed else None,
            table=table, pool={k: bl[f"mem.{k}"] for k in keys}, ksum_pool=bl["ksum"],
            fetch=partial(self.cache.fetch, li) if offloaded else None, top_k=top_k,
            top_k_range=top_k_range,
            inplace=True,  # views of the pool, or gathered copies: writable either way
            host_pool=({k: self.cache.host[li][f"mem.{k}"] for k in keys}
                       if offloaded else None),
            host_base=self.cache.host_base,
        )

    @staticmethod
    def _layer_outputs(pl: PagedLayer) -> dict[str, Tensor]:
        """A layer's online state after the step, by slot-pool name (the model may have
        replaced tensors of ``pl`` instead of updating them in place)."""
        news = {f"mem.{k}": t for k, t in pl.mem.items()}
        news["seg_ksum"] = pl.seg_ksum
        if pl.conv is not None:
            news["conv"] = pl.conv
        if pl.csum is not None:
            news.update({f"csum.{k}": t for k, t in pl.csum.items()})
        return news

    def _finish_decode(self, items: list[ScheduledSeq]) -> None:
        """After a decode step (the slot pool holds every row's new state): rows whose
        segment this token completed push a checkpoint into their new block; counters move."""
        C = self.mc.segment_len
        done = [it for it in items if self.caches_blocks and it.seq.segment_fill + 1 == C]
        if done:
            self._push_completed([it.seq.slot for it in done],
                                 [it.new_blocks[0] for it in done])
        for it in items:
            s = it.seq
            s.num_computed_tokens += 1
            s.segment_fill += 1
        for it in done:
            it.seq.segment_fill = 0
            self._register(it.seq, it.new_blocks[0])

    def _push_completed(self, slots: list[int], bids: list[int]) -> None:
        """The online segment of each slot in ``slots`` is complete: its checkpoint goes into
        block ``bids[i]``, the segment restarts (key sum zero; independent mode: the initial
        memory) and collapsed variants add it to their running sum."""
        dev = self.model.device
        rows = torch.tensor(slots, dtype=torch.long, device=dev)
        ids = torch.tensor(bids, dtype=torch.long, device=dev)
        for mc, sl, bl, init in zip(self.mems, self.cache.slot, self.cache.block, self.init_mem,
                                    strict=True):
            mem_names = [n for n in sl if n.startswith("mem.")]
            for name in mem_names:
                bl[name][ids] = sl[name][rows]
            bl["ksum"][ids] = sl["seg_ksum"][rows]
            sl["seg_ksum"][rows] = 0
            if "conv" in sl:
                bl["conv"][ids] = sl["conv"][rows]
            if mc.collapsed:
                for k in mc.family.readout_keys:
                    sl[f"csum.{k}"][rows] += sl[f"mem.{k}"][rows]
                    bl[f"csum.{k}"][ids] = sl[f"csum.{k}"][rows]
            if self.mc.independent:
                for name in mem_names:
                    sl[name][rows] = init[name[4:]]
