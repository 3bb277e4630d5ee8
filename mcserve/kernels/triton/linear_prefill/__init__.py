"""Chunked gated linear prefill that also writes the state and key sum at every segment
boundary (straight into the block pool when block ids are given); variable-length batches via
``cu_seqlens``.

* ``chunk.py`` — Triton, chunk-parallel: chunk states, a scan over chunk boundaries, chunk
  outputs (``chunk_linear_prefill_chunked``, ``impl="chunk"``);
* ``scan.py`` — Triton, one program walking each sequence chunk by chunk
  (``chunk_linear_prefill``, ``impl="scan"``);
* ``twin.py`` — the torch twin, ``chunk_linear_prefill_torch`` (from ``chunk_gla``);
* ``naive.py`` — the reference, ``chunk_linear_prefill_reference`` (from ``naive_gla``).

All four take the same arguments and give the same result; ``common.boundary_layout`` says
where each sequence's boundaries go. This package exports the torch forms; the Triton forms
need the ``triton`` package and are imported from their modules.
"""

from __future__ import annotations

from mcserve.kernels.triton.linear_prefill.naive import chunk_linear_prefill_reference
from mcserve.kernels.triton.linear_prefill.twin import chunk_linear_prefill_torch

__all__ = ["chunk_linear_prefill_reference", "chunk_linear_prefill_torch"]
