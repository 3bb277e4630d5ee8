"""Reference of the chunked linear prefill: the twin's driver with the per-token recurrence
(``naive_gla``), the twin's oracle and ``MCSERVE_KERNELS=reference``."""

from __future__ import annotations

from torch import Tensor

from mcserve.kernels.gla import naive_gla
from mcserve.kernels.triton.linear_prefill.twin import _prefill_impl


def chunk_linear_prefill_reference(
    q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None = None, b: Tensor | None = None,
    initial_state: Tensor | None = None, *, segment_len: int, cu_seqlens: Tensor | None = None,
    mode: str = "checkpoint", initial_seg_len: Tensor | int = 0,
    initial_ksum: Tensor | None = None, output_final_state: bool = True,
    block_ids: Tensor | None = None, state_pool: Tensor | None = None,
    ksum_pool: Tensor | None = None, out: Tensor | None = None, chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """The twin, ``chunk_linear_prefill_torch``, with the per-token recurrence (``naive_gla``)."""
    return _prefill_impl(naive_gla, q, k, v, log_a, b, initial_state, segment_len=segment_len,
                         cu_seqlens=cu_seqlens, mode=mode, initial_seg_len=initial_seg_len,
                         initial_ksum=initial_ksum, output_final_state=output_final_state,
                         block_ids=block_ids, state_pool=state_pool, ksum_pool=ksum_pool,
                         out=out, chunk_size=chunk_size)
