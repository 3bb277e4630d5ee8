"""Triton kernels for the CUDA path of mcserve, and their torch twins.

* ``paged_mc_decode_linear`` — MC readout of one decode token per row over blocks read in
  place from the pool through a block table (grm/soup/ssc/residual/post, linear family);
* ``ssc_router`` — per row and head top-k over the cached blocks' key-sum scores;
* ``paged_mc_decode_linear_split`` — the same readout split over the cached blocks (partial
  readouts with their local max and sum of exponentials, then a log-sum-exp merge), for small
  batches over many blocks;
* ``chunk_linear_prefill`` — chunked gated linear attention that also writes the state and key
  sum at every segment boundary (straight into the block pool when block ids are given),
  variable-length batches via ``cu_seqlens``; ``chunk_linear_prefill_chunked`` is its
  chunk-parallel form (chunk states, a scan over chunk boundaries, chunk outputs);
* ``fused_linear_decode`` — one decode token per row through a gated-linear-memory mixer (the
  native model's, Mamba2's) from its projections to the gated, normalised output: conv step,
  gates, in-place state update, MC readout, D skip, output gate and RMSNorm.

The Triton versions live in ``decode.py`` / ``split.py`` / ``prefill.py`` / ``chunk.py`` /
``fused.py`` and need the ``triton`` package;
the torch twins (``*_torch``, same signatures) and plain reference loops (``*_reference``) live
in ``twins.py`` and need only torch. Pick one per call with ``mcserve.kernels.dispatch``.
"""

from __future__ import annotations

from mcserve.kernels.triton.twins import (
    boundary_layout,
    chunk_linear_prefill_reference,
    chunk_linear_prefill_torch,
    fused_linear_decode_torch,
    paged_mc_decode_linear_reference,
    paged_mc_decode_linear_torch,
    ssc_router_reference,
    ssc_router_torch,
)

__all__ = [
    "available", "boundary_layout",
    "chunk_linear_prefill_reference", "chunk_linear_prefill_torch", "fused_linear_decode_torch",
    "paged_mc_decode_linear_reference", "paged_mc_decode_linear_torch",
    "ssc_router_reference", "ssc_router_torch",
]


def available() -> str | None:
    """None when ``import triton`` works, else the reason it does not."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"triton is not importable: {type(e).__name__}: {e}"
    return None
