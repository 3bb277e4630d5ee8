"""Which implementation of a kernel runs: Triton on CUDA, the torch twin elsewhere.

``get_backend(x)`` returns ``"triton"`` when ``x`` lives on a CUDA device and triton imports,
``"torch"`` otherwise (so on a CPU-only host nothing changes). The environment variable
``MCSERVE_KERNELS=reference|torch|triton`` forces one for every call (``reference`` = the plain
loop versions, slow, for debugging; ``triton`` on CPU tensors needs ``TRITON_INTERPRET=1``).
The functions below take the kernels' signatures plus an optional ``backend=`` and pick the
implementation per call; every backend gives the same result (see ``tests/test_triton_kernels``).

``mc_linear`` composes the kernels into the whole MC layer of the linear family for one
sequence, with ``reference.mc_linear``'s signature (used to test the kernels end to end against
the oracle): ``chunk_linear_prefill`` gives the online readouts and the segment checkpoints,
and ``paged_mc_decode_linear`` runs every token as one row of a ragged batch whose block table
lists the checkpoints before it.
"""

from __future__ import annotations

import math
import os
from functools import lru_cache

import torch
from torch import Tensor

from mcserve.kernels.triton.common import DECODE_VARIANTS
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

BACKENDS = ("reference", "torch", "triton")

__all__ = ["BACKENDS", "get_backend", "triton_available", "paged_mc_decode_linear",
           "ssc_router", "chunk_linear_prefill", "fused_linear_decode", "fused_decode_pays",
           "mc_linear"]


@lru_cache(maxsize=1)
def _triton_status() -> str | None:
    from mcserve.kernels.triton import available

    return available()


def triton_available() -> bool:
    return _triton_status() is None


def get_backend(x: Tensor | None = None) -> str:
    """The backend for a call on tensor ``x`` (see the module docstring)."""
    forced = os.environ.get("MCSERVE_KERNELS", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"MCSERVE_KERNELS={forced!r} is not one of {BACKENDS}")
        if forced == "triton" and not triton_available():
            raise RuntimeError(f"MCSERVE_KERNELS=triton but {_triton_status()}")
        return forced
    if x is not None and x.is_cuda and triton_available():
        return "triton"
    return "torch"


def _resolve(backend: str | None, x: Tensor) -> str:
    b = backend or get_backend(x)
    if b not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {b!r}")
    if b == "triton":
        if not triton_available():
            raise RuntimeError(f"backend 'triton' requested but {_triton_status()}")
        from mcserve.kernels.triton._jit import interpreting

        if not x.is_cuda and not interpreting():
            raise RuntimeError("the triton backend on CPU tensors needs TRITON_INTERPRET=1")
    return b


def paged_mc_decode_linear(q: Tensor, u: Tensor, o_online: Tensor, p_online: Tensor,
                           table: Tensor, pool_S: Tensor, ksum_pool: Tensor, *, variant: str,
                           segment_len: int, top_k: int = 2, n_seg: Tensor | None = None,
                           state_table: Tensor | None = None, out: Tensor | None = None,
                           row_top_k: Tensor | None = None, backend: str | None = None,
                           impl: str | None = None) -> Tensor:
    """See ``triton.mc_decode.twin.paged_mc_decode_linear_torch``.

    ``impl`` picks the Triton kernel: ``"single"`` (one launch, one program per row, head and
    V tile walking the row's blocks: ``triton/mc_decode/single.py``), ``"split"`` (the blocks
    split across programs, then a log-sum-exp merge: ``triton/mc_decode/split.py``), None =
    ``split.use_split`` on the shapes (small batch × many blocks, softmax or fixed-weight
    variants). Ignored by the other backends.
    """
    kw = dict(variant=variant, segment_len=segment_len, top_k=top_k, n_seg=n_seg,
              state_table=state_table, out=out, row_top_k=row_top_k)
    if impl not in (None, "single", "split"):
        raise ValueError(f"impl must be 'single', 'split' or None, got {impl!r}")
    b = _resolve(backend, q)
    if b == "triton":
        from mcserve.kernels.triton.mc_decode import split

        if impl is None:
            impl = ("split" if split.use_split(q.shape[0], q.shape[1], o_online.shape[-1],
                                               table.shape[-1], variant) else "single")
        if impl == "split":
            fn = split.paged_mc_decode_linear_split
        else:
            from mcserve.kernels.triton.mc_decode.single import paged_mc_decode_linear as fn
    elif b == "torch":
        fn = paged_mc_decode_linear_torch
    else:
        fn = paged_mc_decode_linear_reference
    return fn(q, u, o_online, p_online, table, pool_S, ksum_pool, **kw)


def ssc_router(u: Tensor, ksum_pool: Tensor, table: Tensor, *, segment_len: int, top_k: int,
               row_top_k: Tensor | None = None, backend: str | None = None
               ) -> tuple[Tensor, Tensor]:
    """See ``triton.ssc_router.twin.ssc_router_torch``."""
    b = _resolve(backend, u)
    if b == "triton":
        from mcserve.kernels.triton.ssc_router.triton import ssc_router as fn
    elif b == "torch":
        fn = ssc_router_torch
    else:
        fn = ssc_router_reference
    return fn(u, ksum_pool, table, segment_len=segment_len, top_k=top_k, row_top_k=row_top_k)


def chunk_linear_prefill(q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None = None,
                         b: Tensor | None = None, initial_state: Tensor | None = None, *,
                         segment_len: int, cu_seqlens: Tensor | None = None,
                         mode: str = "checkpoint", initial_seg_len: Tensor | int = 0,
                         initial_ksum: Tensor | None = None, output_final_state: bool = True,
                         block_ids: Tensor | None = None, state_pool: Tensor | None = None,
                         ksum_pool: Tensor | None = None, out: Tensor | None = None,
                         chunk_size: int = 64, backend: str | None = None,
                         impl: str = "chunk") -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """See ``triton.linear_prefill.twin.chunk_linear_prefill_torch``.

    ``impl`` picks the Triton kernel: ``"chunk"`` (chunk-parallel: chunk states, a short scan
    over chunk boundaries, chunk outputs; ``triton/linear_prefill/chunk.py``) or ``"scan"``
    (one program per sequence, head and V tile walking its chunks in order;
    ``triton/linear_prefill/scan.py``). Ignored by the other backends.
    """
    kw = dict(segment_len=segment_len, cu_seqlens=cu_seqlens, mode=mode,
              initial_seg_len=initial_seg_len, initial_ksum=initial_ksum,
              output_final_state=output_final_state, block_ids=block_ids,
              state_pool=state_pool, ksum_pool=ksum_pool, out=out, chunk_size=chunk_size)
    if impl not in ("chunk", "scan"):
        raise ValueError(f"impl must be 'chunk' or 'scan', got {impl!r}")
    bk = _resolve(backend, q)
    if bk == "triton" and impl == "chunk":
        from mcserve.kernels.triton.linear_prefill.chunk import chunk_linear_prefill_chunked as fn
    elif bk == "triton":
        from mcserve.kernels.triton.linear_prefill.scan import chunk_linear_prefill as fn
    elif bk == "torch":
        fn = chunk_linear_prefill_torch
    else:
        fn = chunk_linear_prefill_reference
    return fn(q, k, v, log_a, b, initial_state, **kw)


def fused_decode_pays(B: int, H: int, V: int, N: int, variant: str) -> bool:
    """Whether the fused decode kernel suits a step (shapes only, no data read): its cached
    readout walks a row's N blocks in one program per (row, head), so with few programs and
    many blocks to read (the case ``paged_mc_decode_linear`` splits over N) the unfused step
    with the split readout is faster."""
    if variant not in ("grm", "soup"):  # none / fixed weights read one state, ssc top_k blocks
        return True
    from mcserve.kernels.triton.mc_decode import split

    return not split.use_split(B, H, V, N, variant)


def fused_linear_decode(x: Tensor, z: Tensor | None, S: Tensor, *, backend: str | None = None,
                        **kw) -> Tensor:
    """See ``triton.fused_decode.twin.fused_linear_decode_torch`` (keyword arguments as there).
    The Triton kernel is ``triton/fused_decode/triton.py``; the ``reference`` backend takes the
    torch twin too (it is written op by op after the mixers' own decode path)."""
    bk = _resolve(backend, x)
    if bk == "triton":
        from mcserve.kernels.triton.fused_decode.triton import fused_linear_decode as fn
    else:
        fn = fused_linear_decode_torch
    return fn(x, z, S, **kw)


def mc_linear(q: Tensor, k: Tensor, v: Tensor, u: Tensor, a: Tensor | None = None,
              b: Tensor | None = None, *, variant: str, segment_len: int, top_k: int = 2,
              mode: str = "checkpoint", backend: str | None = None,
              block_ids: Tensor | None = None, num_blocks: int | None = None) -> Tensor:
    """``reference.mc_linear`` (constant segmentation variants) built from the kernels.

    q, k, u ``(T, H, K)``, v ``(T, H, V)``, a/b ``(T, H)`` or None. ``block_ids`` (one per
    completed segment) and ``num_blocks`` place the checkpoints in a pool of that size (the
    rest of it is filled with NaN, so a read through a wrong id shows); default: in order.
    """
    if variant not in DECODE_VARIANTS:
        raise ValueError(f"variant must be one of {DECODE_VARIANTS}, got {variant!r}")
    T, H, K = q.shape
    V = v.shape[-1]
    C = segment_len
    nb = T // C
    if block_ids is None:
        block_ids = torch.arange(nb, device=q.device)
    num_blocks = max(num_blocks or 0, int(block_ids.max()) + 1 if nb else 0)
    pool = q.new_full((num_blocks, H, K, V), float("nan"))
    kpool = q.new_full((num_blocks, H, K), float("nan"))
    log_a = None if a is None else a.log()[None]
    o, _, pool, kpool = chunk_linear_prefill(
        q[None], k[None], v[None], log_a, None if b is None else b[None], None,
        segment_len=C, mode=mode, block_ids=block_ids, state_pool=pool, ksum_pool=kpool,
        backend=backend)
    o = o[0]
    # row t = the token at position t+1: its segment index and how many segments precede it
    t = torch.arange(T, device=q.device)
    seg, fill = t // C, t % C + 1
    ksum_seg = torch.zeros_like(k)
    for s in range(0, T, C):  # running key sum inside each segment
        ksum_seg[s:s + C] = k[s:s + C].cumsum(0)
    p_on = ksum_seg / fill.to(q.dtype)[:, None, None]
    ncol = max(1, math.ceil(T / C) - 1)
    cols = torch.arange(ncol, device=q.device)
    table = torch.where(cols[None, :] < seg[:, None], block_ids[cols.clamp_max(max(nb - 1, 0))]
                        if nb else cols.new_full((ncol,), -1), -1)
    return paged_mc_decode_linear(q, u, o, p_on, table, pool, kpool, variant=variant,
                                  segment_len=C, top_k=top_k, backend=backend)
