"""ModelRunner: turns the scheduler's decision into tensors and runs the model.

* A prefill chunk (any number of segments) is ONE model call: the model records the checkpoint of
  every segment boundary the chunk crosses (``MCLayerState.record``), and the runner scatters
  them into their pool blocks in one write per pool tensor. Sequences at the same phase with
  chunks of the same length run as one batch.
* Decodes run as one ragged batch (``MCForCausalLM.forward_paged``): rows at different
  positions, with different numbers of cached segments, read their blocks from the pool through
  a padded block table. No Python loop over sequences.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
from torch import Tensor

from mcserve.config import MCConfig
from mcserve.engine.scheduler import ScheduledSeq
from mcserve.engine.sequence import Sequence
from mcserve.engine.state_cache import StateCache, chain_hashes
from mcserve.models.mc import MCLayerState, PagedLayer
from mcserve.models.native import LayerState, MCForCausalLM, ModelState


class ModelRunner:
    def __init__(self, model: MCForCausalLM, cache: StateCache, mc: MCConfig):
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

    # ------------------------------------------------------------------ state <-> pool
    def release(self, seq: Sequence) -> None:
        """Forget a sequence's private state (loglinear) when it finishes or is preempted."""
        self.states.pop(seq.seq_id, None)

    def init_slot(self, seq: Sequence, resume_block: int) -> None:
        if resume_block < 0:
            self.cache.clear_slot(seq.slot, self.init_mem)
        else:
            init = self.init_mem if self.mc.independent else [None] * len(self.init_mem)
            self.cache.copy_block_to_slot(resume_block, seq.slot, init)

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
                pos=seq.num_computed_tokens, v_dim=self.model.config.head_dim,
                top_k=seq.mc_top_k,
            )
            conv = sl["conv"][s:s + 1].clone() if "conv" in sl else None
            layers.append(LayerState(st, conv))
        return ModelState(layers)

    def store_state(self, seqs: list[Sequence], state: ModelState) -> None:
        """Row r of ``state`` back into the slot of ``seqs[r]``."""
        s = torch.tensor([q.slot for q in seqs], dtype=torch.long, device=self.model.device)
        for mc, sl, ls in zip(self.mems, self.cache.slot, state.layers, strict=True):
            for k, t in ls.mc.mem.items():
                sl[f"mem.{k}"][s] = t
            sl["seg_ksum"][s] = ls.mc.seg_ksum
            if ls.conv is not None:
                sl["conv"][s] = ls.conv
            if mc.collapsed and ls.mc.num_cached:
                for k in mc.family.readout_keys:
                    sl[f"csum.{k}"][s] = ls.mc.cached[k][:, 0]

    @staticmethod
    def _stack_states(states: list[ModelState]) -> ModelState:
        """Batch-of-one states of sequences at the same phase (same segment fill, same number of
        cached segments) → one batched state."""
        if len(states) == 1:
            return states[0]
        layers = []
        for lss in zip(*(st.layers for st in states), strict=True):
            m = [ls.mc for ls in lss]
            mc = replace(m[0], mem={k: torch.cat([x.mem[k] for x in m]) for k in m[0].mem},
                         seg_ksum=torch.cat([x.seg_ksum for x in m]),
                         cached={k: torch.cat([x.cached[k] for x in m]) for k in m[0].cached},
                         cached_ksum=torch.cat([x.cached_ksum for x in m]),
                         cached_len=list(m[0].cached_len), cached_pos=list(m[0].cached_pos),
                         _stack=None)
            conv = None if lss[0].conv is None else torch.cat([ls.conv for ls in lss])
            layers.append(LayerState(mc, conv))
        return ModelState(layers)

    def _register(self, seq: Sequence, bid: int) -> None:
        """Block ``bid`` holds the checkpoint of ``seq``'s segment that just completed."""
        h, = chain_hashes(seq.all_ids, self.mc.segment_len, seq.salt,
                          len(seq.block_table) + 1, seq.block_hashes)
        seq.block_table.append(bid)
        seq.block_hashes.append(h)
        self.cache.register(bid, h)

    # ------------------------------------------------------------------ prefill
    def batch_key(self, item: ScheduledSeq) -> tuple | None:
        """Prefill items with equal keys can run as one batch (``prefill_batch``); None: alone.
        Equal keys mean the same number of tokens from the same phase: the same fill of the
        online segment and the same number of cached segments (so segment boundaries and the
        cached stack line up across rows) and the same per-request MC overrides."""
        seq = item.seq
        if self.private:
            return None
        return (item.num_tokens, seq.segment_fill, len(seq.block_table), seq.mc_top_k)

    @torch.no_grad()
    def prefill_batch(self, items: list[ScheduledSeq]) -> Tensor:
        """``prefill`` of several sequences with one ``batch_key`` as one batch; returns the
        last position's logits of each ``(B, V)``. Short prompts arriving together cost one
        pass over the weights instead of one per sequence."""
        if len(items) == 1:
            return self.prefill(items[0], False)
        assert len({self.batch_key(it) for it in items}) == 1, "prefill_batch: mixed phases"
        return self._prefill_rows(items, False)[:, -1]

    @torch.no_grad()
    def prefill(self, item: ScheduledSeq, want_all_logits: bool) -> Tensor:
        """Compute ``item.num_tokens`` tokens of one sequence; returns logits ``(n, V)`` (all
        positions) or ``(1, V)`` (the last one)."""
        seq = item.seq
        if self.private:
            x = torch.tensor([seq.all_ids[seq.num_computed_tokens:][:item.num_tokens]],
                             device=self.model.device)
            state = None if item.resume_block is not None else self.states[seq.seq_id]
            logits, self.states[seq.seq_id] = self.model(x, state, last_only=not want_all_logits)
            seq.num_computed_tokens += item.num_tokens
            return logits[0] if want_all_logits else logits[0, -1:]
        return self._prefill_rows([item], want_all_logits)[0]

    def _prefill_rows(self, items: list[ScheduledSeq], want_all_logits: bool) -> Tensor:
        """The chunk of every item (same phase, same length) through the model in ONE call,
        however many segment boundaries it crosses; the checkpoint of every boundary crossed
        is written into the item's pool blocks in one scatter per layer and pool tensor.
        Returns logits ``(B, n, V)`` (all positions) or ``(B, 1, V)``."""
        seqs = [it.seq for it in items]
        for it in items:
            if it.resume_block is not None:
                self.init_slot(it.seq, it.resume_block)
        state = self._stack_states([self.load_state(q) for q in seqs])
        n = items[0].num_tokens
        x = torch.tensor([q.all_ids[q.num_computed_tokens:q.num_computed_tokens + n]
                          for q in seqs], dtype=torch.long, device=self.model.device)
        if self.caches_blocks:
            for ls in state.layers:
                ls.mc.record = []  # MCMemory.forward appends each checkpoint it completes
        logits, state = self.model(x, state, last_only=not want_all_logits)
        for q in seqs:
            q.num_computed_tokens += n
        if self.caches_blocks:
            self._write_checkpoints(items, state)
        self.store_state(seqs, state)
        return logits

    def _write_checkpoints(self, items: list[ScheduledSeq], state: ModelState) -> None:
        """Scatter the checkpoints the model recorded in this chunk into the blocks the
        scheduler allocated for them (``item.new_blocks``, oldest first), and register them."""
        seqs = [it.seq for it in items]
        n_new = len(state.layers[0].mc.record)
        assert all(len(it.new_blocks) == n_new for it in items), \
            "the scheduler's new blocks and the checkpoints of the chunk disagree"
        C = self.mc.segment_len
        for q in seqs:
            q.segment_fill = (q.segment_fill + items[0].num_tokens) % C
        if not n_new:
            for ls in state.layers:
                ls.mc.record = None
            return
        # (row, checkpoint) row-major, as torch.stack(..., 1).flatten(0, 1) lays them out
        idx = torch.tensor([bid for it in items for bid in it.new_blocks[:n_new]],
                           dtype=torch.long, device=self.model.device)

        def stacked(ts: list[Tensor]) -> Tensor:
            return torch.stack(ts, 1).flatten(0, 1)

        for mc, bl, ls in zip(self.mems, self.cache.block, state.layers, strict=True):
            rec, ls.mc.record = ls.mc.record, None
            for k in rec[0]["mem"]:
                bl[f"mem.{k}"][idx] = stacked([r["mem"][k] for r in rec])
            bl["ksum"][idx] = stacked([r["ksum"] for r in rec])
            if "conv" in bl:
                bl["conv"][idx] = stacked([r["conv"] for r in rec])
            if mc.collapsed:
                for k in mc.family.readout_keys:
                    bl[f"csum.{k}"][idx] = stacked([r["csum"][k] for r in rec])
        for it in items:
            for bid in it.new_blocks[:n_new]:
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
        layers = []
        offloaded = bool((table >= self.cache.host_base).any())
        top_k = (torch.tensor([s.mc_top_k or self.mc.top_k for s in seqs], device=dev)
                 if any(s.mc_top_k for s in seqs) else None)
        rows_in = []  # per layer: the slot tensors' rows as handed to the model
        for li, (mc, sl, bl) in enumerate(zip(self.mems, self.cache.slot, self.cache.block,
                                              strict=True)):
            keys = mc.family.readout_keys
            got = {n: t[idx] for n, t in sl.items()}  # views when contiguous, else copies
            rows_in.append(got)
            layers.append(PagedLayer(
                mem={n[4:]: t for n, t in got.items() if n.startswith("mem.")},
                conv=got.get("conv"),
                seg_ksum=got["seg_ksum"], seg_len=seg_len, n_seg=n_seg,
                csum={k: got[f"csum.{k}"] for k in keys} if mc.collapsed else None,
                table=table, pool={k: bl[f"mem.{k}"] for k in keys}, ksum_pool=bl["ksum"],
                fetch=partial(self.cache.fetch, li) if offloaded else None, top_k=top_k,
                inplace=True,  # views of the pool, or gathered copies: writable either way
                host_pool=({k: self.cache.host[li][f"mem.{k}"] for k in keys}
                           if offloaded else None),
                host_base=self.cache.host_base,
            ))
        tokens = torch.tensor([[s.last_id] for s in seqs], dtype=torch.long, device=dev)
        logits = self.model.forward_paged(tokens, layers)[:, 0]
        # rows whose segment completes with this token push a checkpoint
        C = self.mc.segment_len
        done = [r for r, s in enumerate(seqs)
                if self.caches_blocks and s.segment_fill + 1 == C]
        if done:
            rows = torch.tensor(done, dtype=torch.long, device=dev)
            bids = torch.tensor([items[r].new_blocks[0] for r in done], dtype=torch.long,
                                device=dev)
            for mc, bl, pl, init in zip(self.mems, self.cache.block, layers, self.init_mem,
                                        strict=True):
                for k, t in pl.mem.items():
                    bl[f"mem.{k}"][bids] = t[rows]
                bl["ksum"][bids] = pl.seg_ksum[rows]
                pl.seg_ksum[rows] = 0
                if pl.conv is not None:
                    bl["conv"][bids] = pl.conv[rows]
                if mc.collapsed:
                    for k in mc.family.readout_keys:
                        pl.csum[k][rows] += pl.mem[k][rows]
                        bl[f"csum.{k}"][bids] = pl.csum[k][rows]
                if self.mc.independent:
                    for k, t in pl.mem.items():
                        t[rows] = init[k]
        for sl, pl, got in zip(self.cache.slot, layers, rows_in, strict=True):
            news = {f"mem.{k}": t for k, t in pl.mem.items()}
            news["seg_ksum"] = pl.seg_ksum
            if pl.conv is not None:
                news["conv"] = pl.conv
            if pl.csum is not None:
                news.update({f"csum.{k}": t for k, t in pl.csum.items()})
            for name, t in news.items():
                if not (contiguous and t is got[name]):  # not updated in place in the pool
                    sl[name][idx] = t
        for r, s in enumerate(seqs):
            s.num_computed_tokens += 1
            s.segment_fill += 1
            if r in done:
                s.segment_fill = 0
                self._register(s, items[r].new_blocks[0])
        if order == sorted(order):
            return logits
        back = torch.empty(len(order), dtype=torch.long, device=logits.device)
        back[torch.tensor(order, device=logits.device)] = torch.arange(len(order),
                                                                       device=logits.device)
        return logits[back]  # in the callers' row order
