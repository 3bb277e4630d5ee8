"""Token-budget scheduler (vLLM v1 style): no prefill/decode phases, only "tokens to compute".

Each step: running sequences first (oldest first), each gets its next token or its next prefill
chunk; then waiting sequences are admitted in arrival order while the budget, the slots and the
block pool allow. Prefill chunks end on segment boundaries (so every completed segment becomes a
block the moment it completes, and prefix hashes are well defined). When the pool runs out, the
newest running sequence is preempted and recomputed later (its hashed blocks usually survive in
the prefix cache, which makes the recompute cheap). The waiting queue never skips its head, so
nothing starves.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from mcserve.config import MCConfig
from mcserve.engine.kv_cache import KVCache
from mcserve.engine.prefix_keys import chain_hashes
from mcserve.engine.resume import ResumePoint, ResumeStore
from mcserve.engine.sequence import Sequence, Status
from mcserve.engine.state_cache import StateCache

log = logging.getLogger(__name__)


def grid_step(interval: int, p: int) -> int:
    """The spacing of the resume-point grid after prompt position ``p``: ``interval`` up to
    ``4 · interval``, then the largest power-of-two multiple of ``interval`` no more than a
    quarter of ``p``. A shared prefix of any length finds a point at least three quarters of the
    way in, and a long prompt keeps O(log L) points, not L / interval: each ends a prefill
    chunk, so a 32K prompt computes in 24 chunks instead of 128 at ``interval`` 256 (on a GPU,
    where a chunk's fixed cost is most of it, that is the prefill time)."""
    step = interval
    while step * 8 <= p:
        step *= 2
    return step


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens to compute this step
    new_blocks: list[int]  # blocks for the segments this step completes, in order
    resume_block: int | None = None  # set when the slot must be (re)initialised: -1 = fresh
    #                                  sequence, otherwise the prefix block to resume from
    resume_point: ResumePoint | None = None  # the slot starts from this (pinned) point
    snapshot: bool = False  # keep a resume point where this chunk ends


@dataclass
class SchedulerOutput:
    prefills: list[ScheduledSeq] = field(default_factory=list)
    decodes: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, cache: StateCache, mc: MCConfig, *, max_num_seqs: int,
                 max_num_batched_tokens: int):
        self.cache = cache
        self.mc = mc
        # pool blocks to plan for: constant segments only (none has no checkpoints, loglinear's
        # change every token and stay private to the runner)
        self.caches_blocks = mc.caches_blocks
        # a selecting variant with a host tier: blocks of running sequences move to the host
        # when the device pool is full (the router reads key sums; its picks are fetched per
        # token)
        self.offload = mc.selects and cache.num_host_blocks > 0
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_swaps = 0
        # resume points (set by the engine): the store, and the grid of prompt positions to
        # keep them at (0: none)
        self.resume: ResumeStore | None = None
        self.interval = 0
        self.prompt_tokens_admitted = 0  # prompt tokens of admitted sequences (first time)
        self.prompt_tokens_cached = 0  # ... of which came from the state cache
        self.on_release = lambda seq: None  # the runner forgets per-sequence private state
        self.on_keep = lambda seq: None  # the runner keeps a resume point of seq's state now
        # hybrid models: the attention layers' paged KV (set by the engine). A preempted hybrid
        # is not swapped: it leaves a resume point (``on_keep``) and resumes from it
        self.kv: KVCache | None = None

    # ------------------------------------------------------------------ queue
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence wherever it is and return its slot and blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED

    def _release(self, seq: Sequence) -> None:
        self.on_release(seq)
        if seq.block_table:
            self.cache.free(seq.block_table)
        seq.block_table = []
        if seq.kv_table:
            self.kv.free(seq.kv_table)
            seq.kv_table = []
        seq.saved_slot = None
        if seq.slot is not None:
            self.cache.free_slot(seq.slot)
            seq.slot = None

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Swap to the host tier when it has room, else free everything and recompute later
        (a hybrid: from the resume point it leaves, while that lasts)."""
        self.running.remove(seq)
        swapped = (self.cache.swap_out(seq.block_table, seq.slot)
                   if seq.slot is not None and self.kv is None else None)
        if swapped is not None:
            seq.block_table, seq.saved_slot = swapped
            seq.slot = None
            self.num_swaps += 1
        else:
            if self.kv is not None and seq.slot is not None:
                # a hybrid keeps its state as a resume point (its KV blocks held by the point,
                # given up or moved to a lower tier when they are wanted): readmitted, it
                # resumes there unless the point had to go
                self.on_keep(seq)
            self._release(seq)
            seq.num_computed_tokens = 0
            seq.segment_fill = 0
            seq.block_hashes = []
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    # ------------------------------------------------------------------ planning
    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        if not self.caches_blocks:
            return 0
        C, p = self.mc.segment_len, seq.num_computed_tokens
        return (p + n) // C - p // C

    def _kv_needed(self, seq: Sequence, n: int) -> int:
        """KV blocks ``seq`` needs beyond its table to compute ``n`` more tokens."""
        if self.kv is None:
            return 0
        return max(0, self.kv.blocks_for(seq.num_computed_tokens + n) - len(seq.kv_table))

    def _fits(self, need: int, kv_need: int) -> bool:
        """Whether ``need`` state blocks and ``kv_need`` KV blocks can be had now; KV blocks
        that only resume points hold are given up (least recently used first) for them."""
        if not self.cache.can_allocate(need):
            return False
        if kv_need and not self.kv.can_allocate(kv_need) and self.resume is not None:
            self.resume.drop_kv(lambda: self.kv.can_allocate(kv_need))
        return not kv_need or self.kv.can_allocate(kv_need)

    def _grow_kv(self, seq: Sequence, kv_need: int) -> None:
        if kv_need:
            seq.kv_table = seq.kv_table + self.kv.allocate(kv_need)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens to compute now: all that is left, or the longest budget-fitting piece that
        ends on a segment boundary (and completes at most half the device pool's blocks)."""
        n = self._fit_chunk(seq, budget)
        p = seq.num_computed_tokens
        q = self._next_mark(seq, p)
        return q - p if n > 0 and q is not None and q < p + n else n

    def _fit_chunk(self, seq: Sequence, budget: int) -> int:
        left = seq.num_uncomputed
        C = self.mc.segment_len
        if self.caches_blocks:
            budget = min(budget, max(1, self.cache.num_blocks // 2) * C)
        if left <= budget:
            return left
        if not self.caches_blocks:
            return budget
        p = seq.num_computed_tokens
        return max(0, (p + budget) // C * C - p)

    def _next_mark(self, seq: Sequence, p: int) -> int | None:
        """The first prompt position after ``p`` to keep a resume point at: the grid
        (``grid_step``) or a position the request asked for. Chunks end there."""
        if self.resume is None:
            return None
        best = None
        if self.interval:
            step = grid_step(self.interval, p)
            q = (p // step + 1) * step
            if q <= len(seq.prompt_ids):
                best = q
        for q in seq.resume_at:
            if q > p:
                best = q if best is None else min(best, q)
                break
        return best

    def _item(self, seq: Sequence, n: int, blocks: list[int], **kw) -> ScheduledSeq:
        p = seq.num_computed_tokens
        return ScheduledSeq(seq, n, blocks, snapshot=self._next_mark(seq, p) == p + n, **kw)

    def _offload_for(self, seq: Sequence) -> bool:
        """Free a device block by moving one of ``seq``'s own (else the oldest running
        sequence's) unshared blocks to the host tier."""
        for s in [seq] + sorted(self.running, key=lambda x: x.arrival):
            if self.cache.offload_one(s.block_table) is not None:
                return True
        return False

    def prefix_hashes(self, seq: Sequence) -> list[bytes]:
        """Hashes of the complete segments that may be reused: at least one token must remain to
        be computed (its logits are needed), and prompt logprobs need every position computed."""
        if not self.caches_blocks or not self.cache.enable_prefix_caching:
            return []
        if seq.params.prompt_logprobs is not None:
            return []
        ids, C = seq.all_ids, self.mc.segment_len
        return chain_hashes(ids, C, seq.salt, (len(ids) - 1) // C)

    def _resume_lookup(self, seq: Sequence, hashes: list[bytes]) -> ResumePoint | None:
        """The deepest resume point of ``seq``'s tokens past its cached blocks (pinned), or
        None; ``seq.block_table`` holds the blocks it found for ``hashes``. With segment
        blocks, a point needs the blocks before it in the pool (what MC reads): those cached
        already, or those a point read back from disk brings along (imported here). At least
        one token is left to compute (its logits are needed); prompt logprobs need every
        position computed."""
        if self.resume is None or seq.params.prompt_logprobs is not None:
            return None
        lo, hi = seq.num_computed_tokens + 1, seq.num_tokens - 1
        if hi < lo:
            return None
        n_hits, C = len(seq.block_table), self.mc.segment_len

        def accept(rp: ResumePoint) -> bool:
            if self.kv is not None and rp.kv_blocks is None and rp.kv is None:
                return False  # a hybrid needs its KV too
            return (not self.caches_blocks or rp.pos // C <= n_hits
                    or (rp.blocks is not None and rp.blocks.num_blocks >= rp.pos // C))

        rp, why = self.resume.lookup(seq.all_ids, seq.salt, lo, hi, accept)
        if rp is None:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("request %s: no resume point past token %d (%s)", seq.request_id,
                          lo - 1, why)
            return None
        need = rp.pos // C if self.caches_blocks else 0
        if need > n_hits:  # a point from disk: its blocks join the pool first
            try:
                self.cache.import_blocks(rp.blocks)
            except ValueError as e:
                log.warning("state cache: the blocks of a resume point do not fit: %s", e)
            more = self.cache.lookup(hashes[n_hits:need])
            if len(more) < need - n_hits:
                self.cache.free(more)
                self.resume.unpin(rp)
                return None
            seq.block_table = seq.block_table + more
            seq.block_hashes = hashes[:need]
        rp.blocks = None  # in the pool now (or never needed)
        return rp

    def _hybrid_resume(self, seq: Sequence, rp: ResumePoint | None) -> None:
        """A hybrid resumes from a resume point only (its KV and its recurrent state at the
        same token) or from nothing: segment blocks past the point are given back, and the
        point's KV blocks before it are shared (the partial last one is copied by the runner
        into a block of the sequence's own)."""
        C = self.mc.segment_len
        keep = rp.pos // C if rp is not None and self.caches_blocks else 0
        if len(seq.block_table) > keep:
            self.cache.free(seq.block_table[keep:])
            seq.block_table = seq.block_table[:keep]
            seq.block_hashes = seq.block_hashes[:keep]
        if rp is None:
            seq.num_computed_tokens = seq.segment_fill = 0
            return
        if rp.kv_blocks is None:  # KV as tensors: the runner writes it into new blocks
            seq.kv_table = []
            return
        full = rp.pos // self.kv.block_size
        seq.kv_table = list(rp.kv_blocks[:full])
        self.kv.share(seq.kv_table)

    def _being_computed(self, seq: Sequence, hashes: list[bytes]) -> bool:
        """Whether the first segment of ``hashes`` that is not cached is being computed by a
        running prefill of another request (same tokens up to that segment's end, same salt):
        then ``seq`` waits for the block instead of computing the same segments alongside
        (requests sharing a new long prefix that arrive together compute it once)."""
        n = self.cache.cached_prefix(hashes)
        if n >= len(hashes):
            return False
        end = (n + 1) * self.mc.segment_len
        ids = None
        for s in self.running:
            if (s.request_id != seq.request_id and s.salt == seq.salt and s.is_prefill
                    and s.num_computed_tokens < end <= s.num_tokens):
                if ids is None:
                    ids = seq.all_ids[:end]
                if s.all_ids[:end] == ids:
                    return True
        return False

    def _awaits_resume(self, seq: Sequence) -> bool:
        """Whether a running prefill of another request (same salt) will keep a resume point
        inside ``seq``'s tokens at its next chunk's end, with the same tokens before it: then
        ``seq`` waits for it (16 users that send one new system prompt at once compute it
        once)."""
        if self.resume is None:
            return False
        ids = None
        for s in self.running:
            if s.request_id == seq.request_id or s.salt != seq.salt or not s.is_prefill:
                continue
            q = self._next_mark(s, s.num_computed_tokens)
            if q is None or q >= seq.num_tokens or self.resume.has(s.resume_key(q)):
                continue
            if ids is None:
                ids = seq.all_ids
            if ids[:q] == s.all_ids[:q]:
                return True
        return False

    def _swap_in(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Admit a swapped-out sequence; returns the tokens scheduled (0: it must wait)."""
        n = self._chunk(seq, budget)
        need = self._blocks_needed(seq, n)
        n_host = 0 if self.offload else sum(
            b >= self.cache.host_base for b in seq.block_table)
        if n <= 0 or not self.cache.can_allocate(need + n_host):
            return 0
        slot = self.cache.allocate_slot()
        if slot is None:
            return 0
        seq.block_table = self.cache.swap_in(seq.block_table, seq.saved_slot, slot,
                                             keep_on_host=self.offload)
        seq.slot, seq.saved_slot = slot, None
        blocks = self.cache.allocate(need)
        self.waiting.popleft()
        seq.status = Status.RUNNING
        self.running.append(seq)
        item = self._item(seq, n, blocks)
        (out.prefills if seq.is_prefill else out.decodes).append(item)
        return n

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.budget
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.status is not Status.RUNNING or budget <= 0:
                continue
            n = self._chunk(seq, budget)
            if n <= 0:
                continue
            need, kv_need = self._blocks_needed(seq, n), self._kv_needed(seq, n)
            while not self._fits(need, kv_need):
                if (self.offload and not self.cache.can_allocate(need)
                        and self._offload_for(seq)):
                    continue
                victim = max(self.running, key=lambda s: s.arrival)
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            blocks = self.cache.allocate(need)
            self._grow_kv(seq, kv_need)
            budget -= n
            item = self._item(seq, n, blocks)
            (out.prefills if seq.is_prefill else out.decodes).append(item)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.saved_slot is not None:  # swapped out earlier: bring it back as it was
                n = self._swap_in(seq, budget, out)
                if not n:
                    break
                budget -= n
                continue
            hashes = self.prefix_hashes(seq)
            if (self.kv is None and self._being_computed(seq, hashes)) \
                    or self._awaits_resume(seq):
                break  # a running prefill is computing its prefix: reuse it next step
            slot = self.cache.allocate_slot()
            if slot is None:
                break
            hits = self.cache.lookup(hashes)
            seq.slot, seq.block_table = slot, hits
            seq.block_hashes = hashes[:len(hits)]
            seq.num_computed_tokens = len(hits) * self.mc.segment_len
            seq.segment_fill = 0
            rp = self._resume_lookup(seq, hashes)
            if rp is not None:
                seq.num_computed_tokens, seq.segment_fill = rp.pos, rp.segment_fill
            if self.kv is not None:
                self._hybrid_resume(seq, rp)
            seq.num_cached_tokens = min(seq.num_computed_tokens, len(seq.prompt_ids))
            n = self._chunk(seq, budget)
            need, kv_need = self._blocks_needed(seq, n), self._kv_needed(seq, n)
            blocks = self.cache.allocate(need) if n > 0 and self._fits(need, kv_need) else None
            if blocks is not None:
                self._grow_kv(seq, kv_need)
            if blocks is None:  # undo; the head waits (FCFS: nobody overtakes it)
                if rp is not None:
                    self.resume.unpin(rp)
                self._release(seq)
                seq.num_computed_tokens = 0
                seq.segment_fill = 0
                seq.block_hashes = []
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            if not seq.admitted:
                seq.admitted = True
                self.prompt_tokens_admitted += len(seq.prompt_ids)
                self.prompt_tokens_cached += seq.num_cached_tokens
            budget -= n
            resume = seq.block_table[-1] if seq.block_table else -1
            out.prefills.append(self._item(seq, n, blocks, resume_block=resume,
                                           resume_point=rp))
        return out
