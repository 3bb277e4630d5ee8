"""Triton kernels for the CUDA path of mcserve, with their torch twins and reference loops.

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

One sub-package per op, each with its forms side by side (as flash-linear-attention lays out
``fla/ops/<op>/``): the Triton kernel(s), which need the ``triton`` package; the torch twin
(``twin.py``, ``*_torch``, same signature and result), which needs only torch; and the plain
reference loop (``naive.py``, ``*_reference``, the twin's oracle):

* ``mc_decode/`` — ``single.py``, ``split.py``, ``twin.py``, ``naive.py``;
* ``ssc_router/`` — ``triton.py``, ``twin.py``, ``naive.py``;
* ``linear_prefill/`` — ``chunk.py``, ``scan.py``, ``twin.py``, ``naive.py``;
* ``fused_decode/`` — ``triton.py``, ``twin.py`` (the reference is the mixers' decode path);
* ``readout/`` (the cached readout of a prefill chunk) and ``paged_attention/`` (hybrid
  models' decode attention) — ``triton.py``; their twins live with their callers
  (``kernels.mc_chunk``, ``kernels.attention``).

``common.py`` holds the argument checks and output layouts the forms share, ``_launch.py`` the
Triton wrappers' launch helpers, ``_jit.py`` the lazy ``triton.jit``. Each op package exports
its torch forms; the Triton forms are imported from their modules. Pick one per call with
``mcserve.kernels.dispatch``.
"""

from __future__ import annotations

from mcserve.kernels.triton.common import boundary_layout
from mcserve.kernels.triton.fused_decode import fused_linear_decode_torch
from mcserve.kernels.triton.linear_prefill import (
    chunk_linear_prefill_reference,
    chunk_linear_prefill_torch,
)
from mcserve.kernels.triton.mc_decode import (
    paged_mc_decode_linear_reference,
    paged_mc_decode_linear_torch,
)
from mcserve.kernels.triton.ssc_router import ssc_router_reference, ssc_router_torch

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
