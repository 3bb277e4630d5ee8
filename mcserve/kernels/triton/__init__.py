"""Triton kernels for the CUDA path of mcserve, and their torch twins.

* ``paged_mc_decode_linear`` — MC readout of one decode token per row over blocks read in
  place from the pool through a block table (grm/soup/ssc/residual/post, linear family);
* ``ssc_router`` — per row and head top-k over the cached blocks' key-sum scores;
* ``chunk_linear_prefill`` — chunked gated linear attention that also writes the state and key
  sum at every segment boundary (straight into the block pool when block ids are given),
  variable-length batches via ``cu_seqlens``.

The Triton versions live in ``decode.py`` / ``prefill.py`` and need the ``triton`` package;
the torch twins (``*_torch``, same signatures) and plain reference loops (``*_reference``) live
in ``twins.py`` and need only torch. Pick one per call with ``mcserve.kernels.dispatch``.
"""

from __future__ import annotations

from mcserve.kernels.triton.twins import (
    boundary_layout,
    chunk_linear_prefill_reference,
    chunk_linear_prefill_torch,
    paged_mc_decode_linear_reference,
    paged_mc_decode_linear_torch,
    ssc_router_reference,
    ssc_router_torch,
)

__all__ = [
    "available", "boundary_layout",
    "chunk_linear_prefill_reference", "chunk_linear_prefill_torch",
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
