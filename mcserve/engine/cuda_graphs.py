"""CUDA graphs of the static decode step, as vLLM captures its decode.

A decode step launches hundreds of small kernels (a few per layer and family op); at the batch
sizes of serving, launching them from Python costs more than running them, and the GPU waits.
``ModelRunner`` therefore has a *static* decode step (``ModelRunner.static_forward``) whose
shapes depend only on two bucketed sizes: the batch is padded to a size of ``decode_buckets``
(padded rows point at the state cache's scratch slot and at no block) and the block table to a
width of ``table_buckets`` (``-1`` entries are masked). Every input lives in one static device
buffer the runner fills before the step; the step has no host syncs and no data-dependent
Python branches, so it can be recorded once per (batch, table width) bucket and replayed.

``DecodeGraphs`` captures at start-up in descending size order (largest first, so later graphs
fit in the memory the first one reserved) with one shared memory pool, after warm-up runs on a
side stream (they compile the Triton kernels, run lazy initialisation, and check, with
``torch.cuda.set_sync_debug_mode("error")``, that the step never syncs). Replay is a copy of the
step's inputs into the static buffer (by the runner) and ``graph.replay()``; the output logits
are a static tensor that the next replay overwrites, so the runner copies its rows out.

Everything here needs CUDA; on the CPU the same static step runs eagerly (tests, and the runner's
``static_decode`` switch).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import Tensor

log = logging.getLogger(__name__)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes a static decode step pads to: 1, 2, 4, 8 and every multiple of 8 up to
    ``max_num_seqs`` (vLLM's ``cudagraph_capture_sizes``), and ``max_num_seqs`` itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {b for b in (1, 2, 4) if b < max_num_seqs}
    sizes.update(range(8, max_num_seqs, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def table_buckets(max_blocks: int) -> list[int]:
    """Block-table widths a static decode step pads to: powers of two below ``max_blocks``
    and ``max_blocks`` itself (the most cached segments a sequence can have); ``[0]`` when
    ``max_blocks`` is 0 (the model reads no table)."""
    if max_blocks <= 0:
        return [0]
    out, n = [], 1
    while n < max_blocks:
        out.append(n)
        n *= 2
    return out + [max_blocks]


def bucket(sizes: list[int], n: int) -> int | None:
    """The smallest of ``sizes`` (ascending) that holds ``n``; None when none does."""
    for s in sizes:
        if s >= n:
            return s
    return None


@contextmanager
def _sync_debug_errors():
    """Raise on any synchronising CUDA call inside the block (warm-up of a step to capture)."""
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


class DecodeGraphs:
    """One captured CUDA graph of ``step(batch, width)`` per (batch bucket, width bucket).

    ``step`` must read its inputs from static buffers, never sync, and return the logits
    ``(batch, V)``; the graph keeps that output tensor, which ``replay`` returns.
    """

    def __init__(self, step: Callable[[int, int], Tensor], batch_sizes: list[int],
                 table_widths: list[int], *, warmup: int = 2,
                 before_capture: Callable[[], None] | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device")
        self.step = step
        self.batch_sizes = sorted(batch_sizes)
        self.table_widths = sorted(table_widths)
        self.warmup = warmup
        self.before_capture = before_capture or (lambda: None)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.num_replays = 0
        self.pool = None

    def capture(self) -> None:
        """Warm up and capture every bucket, largest first, into one memory pool. Raises when
        the step cannot be captured (it synchronises, or a kernel is not capturable); the
        caller then keeps the eager step."""
        self.before_capture()  # padding everywhere: warm-up and capture touch only scratch
        self.pool = torch.cuda.graph_pool_handle()
        # warm-up on a side stream, as torch.cuda.graph requires of lazily initialised kernels
        # (cuBLAS workspaces, Triton compilation); one bucket per width is enough for the
        # sync check, every bucket compiles its own Triton specialisation
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for width in reversed(self.table_widths):
                for batch in reversed(self.batch_sizes):
                    for _ in range(self.warmup):
                        with _sync_debug_errors():
                            self.step(batch, width)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        # no garbage collection while capturing: collecting an unreachable engine would destroy
        # its graphs and free its memory pool, CUDA calls that invalidate a capture in progress
        # (a capture then fails at random); collect first, then pause the collector
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.no_grad():
                for width in reversed(self.table_widths):
                    for batch in reversed(self.batch_sizes):
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g, pool=self.pool):
                            out = self.step(batch, width)
                        self.graphs[(batch, width)] = (g, out)
        finally:
            if was_enabled:
                gc.enable()
        torch.cuda.synchronize()
        log.info("captured %d CUDA graphs of the decode step (batch %s x table width %s)",
                 len(self.graphs), self.batch_sizes, self.table_widths)

    def has(self, batch: int, width: int) -> bool:
        return (batch, width) in self.graphs

    def replay(self, batch: int, width: int) -> Tensor:
        """Run the graph of ``(batch, width)`` on what the static buffers hold now; returns its
        static output ``(batch, V)`` (overwritten by the next replay)."""
        g, out = self.graphs[(batch, width)]
        g.replay()
        self.num_replays += 1
        return out
