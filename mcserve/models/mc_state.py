"""The per-layer state of Memory Caching (the MC layer is ``mcserve.models.mc``).

``MCLayerState``: one layer's state for a batch of sequences at the same position (online memory,
online segment's key sum and length, the cached memories stacked on dim 1), as
``MCMemory.forward`` consumes and returns it; its cached stack lives in ``_Stack``, shared
append-only between states. ``PagedLayer``: one layer's view of a ragged decode batch whose cached
blocks live in the engine's shared block pool, as ``MCMemory.decode_paged`` reads and updates it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from mcserve.models.memory.base import State


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
    # when a list: ``MCMemory.forward`` appends a record of every segment it completes (its
    # checkpoint, for the engine to write into a pool block) and pushes a segment completed by
    # the span's last token at once, instead of at the start of the next span
    record: list[dict] | None = field(default=None, repr=False, compare=False)

    def append(self, block: State, ksum: Tensor, length: int, pos: int) -> None:
        """Cache one more segment: block tensors ``(B, ...)``, its key sum ``(B, H, K)``."""
        self.extend({k: t[:, None] for k, t in block.items()}, ksum[:, None], [length], [pos])

    def extend(self, blocks: State, ksums: Tensor, lengths: list[int], pos: list[int]) -> None:
        """Cache n more segments at once: block tensors ``(B, n, ...)``, their key sums ``(B, n,
        H, K)``, tokens and end positions (n each); one write into the stack for all n."""
        n, m = self.num_cached, len(lengths)
        if torch.is_grad_enabled() and any(t.requires_grad for t in blocks.values()):
            # training: autograd saved views of the stack, so never write into it in place
            self.cached = {k: torch.cat([self.cached[k], t], 1) for k, t in blocks.items()}
            self.cached_ksum = torch.cat([self.cached_ksum, ksums], 1)
            self._stack = None
            self.cached_len += lengths
            self.cached_pos += pos
            return
        st = self._stack
        if st is None or st.filled != n or n + m > st.capacity or (
                n and st.ksum.data_ptr() != self.cached_ksum.data_ptr()):
            st = _Stack(self.cached, self.cached_ksum, max(8, 2 * (n + m)))
        for k, t in blocks.items():
            st.t[k][:, n:n + m] = t
        st.ksum[:, n:n + m] = ksums
        st.filled = n + m
        self._stack = st
        self.cached = {k: t[:, :n + m] for k, t in st.t.items()}
        self.cached_ksum = st.ksum[:, :n + m]
        self.cached_len += lengths
        self.cached_pos += pos

    def truncate(self, n: int) -> None:
        """Keep the first n cached segments (loglinear merges)."""
        self.cached = {k: t[:, :n] for k, t in self.cached.items()}
        self.cached_ksum = self.cached_ksum[:, :n]
        del self.cached_len[n:], self.cached_pos[n:]

    @property
    def num_cached(self) -> int:
        return self.cached_ksum.shape[1]

    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> MCLayerState:
        """Apply ``fn`` to every tensor (e.g. select batch rows, move device)."""
        return replace(
            self, mem={k: fn(t) for k, t in self.mem.items()}, seg_ksum=fn(self.seg_ksum),
            cached={k: fn(t) for k, t in self.cached.items()}, cached_ksum=fn(self.cached_ksum),
            cached_len=list(self.cached_len), cached_pos=list(self.cached_pos), _stack=None,
            record=None,
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
    # fetch(ids, head_dim): maps block ids that name host-tier blocks to device rows (fetching
    # head h of a block for the entries of head h along head_dim); None when every block in
    # ``table`` is on the device
    fetch: Callable[[Tensor, int], Tensor] | None = None
    top_k: Tensor | None = None  # (B,) per-row ssc top_k overrides; None = MCConfig.top_k
    # (smallest, largest) of ``top_k`` as host ints, from whoever built it: the pick count is a
    # shape, and reading it back from the tensor would stall a GPU step; None: read it back
    top_k_range: tuple[int, int] | None = None
    # ``mem`` may be updated in place (it is a view of the engine's slot pool, or scratch)
    inplace: bool = False
    # the host tier's rows of ``pool`` (ids from ``host_base`` on), for kernels that read host
    # blocks in place instead of through ``fetch`` (the fused CPU block: both tiers are RAM)
    host_pool: State | None = None
    host_base: int = 0
    # set: ``mem``, ``conv``, ``seg_ksum`` and ``csum`` are the whole slot pools and row b's
    # entries are at ``rows[b]`` (the static decode step, no gather into a batch); the fused
    # decode kernel reads and updates them there, every other path works on ``gathered()``
    rows: Tensor | None = None

    @contextmanager
    def gathered(self) -> Iterator[PagedLayer]:
        """A batch-shaped copy of a row-indexed layer (``rows`` set): its states gathered from
        the pools, and written back into them when the block exits. The layer itself when
        ``rows`` is None."""
        if self.rows is None:
            yield self
            return
        rows = self.rows
        g = replace(self, mem={k: t[rows] for k, t in self.mem.items()},
                    conv=None if self.conv is None else self.conv[rows],
                    seg_ksum=self.seg_ksum[rows],
                    csum=None if self.csum is None else {k: t[rows] for k, t in self.csum.items()},
                    rows=None)
        yield g
        for k, t in g.mem.items():
            self.mem[k].index_copy_(0, rows, t)
        if self.conv is not None:
            self.conv.index_copy_(0, rows, g.conv)
        self.seg_ksum.index_copy_(0, rows, g.seg_ksum)
        if self.csum is not None:
            for k, t in g.csum.items():
                self.csum[k].index_copy_(0, rows, t)
