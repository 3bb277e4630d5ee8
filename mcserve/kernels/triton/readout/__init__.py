"""The cached-memory readout of a prefill chunk, fused (flash-style).

* ``triton.py`` — Triton, ``mc_chunk_readout``.

Its torch twin is ``kernels.mc_chunk._readout_blocks`` (the CPU form) and its reference
``mc_chunk.mc_linear_chunk_naive`` (end to end): they live with ``mc_chunk``, which calls this
kernel on a GPU. Importing this package imports triton.
"""

from __future__ import annotations

from mcserve.kernels.triton.readout.triton import mc_chunk_readout

__all__ = ["mc_chunk_readout"]
