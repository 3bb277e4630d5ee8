"""Torch twin of the chunked linear prefill with segment checkpoints (from ``chunk_gla``).

``_prefill_impl`` drives any gated-linear-attention function over the segments; the naive
reference (``naive.py``) runs it with the per-token recurrence.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mcserve.kernels.gla import chunk_gla
from mcserve.kernels.triton.common import _prefill_outputs, check_prefill_args


def _prefill_span(gla, q, k, v, log_a, b, S, ks0, off, C, independent, chunk_size):
    """One batch of rows with the same length and segment offset. Returns o, final S, and the
    (state, key sum) of every completed segment, oldest first."""
    T = q.shape[1]
    outs, bounds, pos, fill = [], [], 0, off
    ksum = ks0
    while pos < T:
        n = min(T - pos, C - fill)
        sl = slice(pos, pos + n)
        o, S = gla(q[:, sl], k[:, sl], v[:, sl], None if log_a is None else log_a[:, sl],
                   None if b is None else b[:, sl], S, chunk_size)
        outs.append(o)
        ksum = ksum + k[:, sl].sum(1)
        pos, fill = pos + n, fill + n
        if fill == C:
            bounds.append((S, ksum))
            ksum = torch.zeros_like(ksum)
            fill = 0
            if independent:
                S = torch.zeros_like(S)
    o = torch.cat(outs, 1) if outs else v.new_zeros(v.shape)
    return o, S, bounds


def _prefill_impl(gla, q, k, v, log_a, b, initial_state, *, segment_len, cu_seqlens, mode,
                  initial_seg_len, initial_ksum, output_final_state, block_ids, state_pool,
                  ksum_pool, out, chunk_size):
    lay = check_prefill_args(q, k, v, log_a, b, initial_state, segment_len, cu_seqlens, mode,
                             initial_seg_len, initial_ksum, block_ids, state_pool, ksum_pool)
    out, final, block_ids, state_pool, ksum_pool = _prefill_outputs(
        q, v, lay, block_ids, state_pool, ksum_pool, output_final_state, out)
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = q.dtype
    N = lay["N"]
    S0 = (q.new_zeros(N, H, K, V) if initial_state is None else initial_state.to(dt))
    ks0 = q.new_zeros(N, H, K) if initial_ksum is None else initial_ksum.to(dt)
    independent = mode == "independent"
    off = lay["off"].tolist()
    if cu_seqlens is None and len(set(off)) <= 1:  # all rows alike: one batched pass
        groups = [(list(range(N)), slice(0, T), off[0] if off else 0)]
        row_of = None
    else:  # ragged: one pass per sequence
        bos, lens = lay["bos"].tolist(), lay["lens"].tolist()
        if cu_seqlens is None:
            groups = [([i], slice(0, T), off[i]) for i in range(N)]
            row_of = list(range(N))
        else:
            groups = [([i], slice(bos[i], bos[i] + lens[i]), off[i]) for i in range(N)]
            row_of = [0] * N
    counts, offsets = lay["counts"].tolist(), lay["offsets"].tolist()
    for seqs, span, o_ in groups:
        rows = seqs if row_of is None else [row_of[i] for i in seqs]
        r = torch.tensor(rows, device=q.device)
        s = torch.tensor(seqs, device=q.device)
        pick = lambda x, r=r, span=span: None if x is None else x[r, span]  # noqa: E731
        o, S, bounds = _prefill_span(gla, pick(q), pick(k), pick(v), pick(log_a), pick(b), S0[s],
                                     ks0[s], o_, segment_len, independent, chunk_size)
        out[r, span] = o.to(out.dtype)
        if final is not None:
            final[s] = S
        for j, (Sj, kj) in enumerate(bounds):
            ids = block_ids[torch.tensor([offsets[i] + j for i in seqs], device=q.device)]
            assert all(counts[i] > j for i in seqs)
            state_pool[ids] = Sj.to(state_pool.dtype)
            ksum_pool[ids] = kj.to(ksum_pool.dtype)
    return out, final, state_pool, ksum_pool


def chunk_linear_prefill_torch(
    q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None = None, b: Tensor | None = None,
    initial_state: Tensor | None = None, *, segment_len: int, cu_seqlens: Tensor | None = None,
    mode: str = "checkpoint", initial_seg_len: Tensor | int = 0,
    initial_ksum: Tensor | None = None, output_final_state: bool = True,
    block_ids: Tensor | None = None, state_pool: Tensor | None = None,
    ksum_pool: Tensor | None = None, out: Tensor | None = None, chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """Gated linear attention S_t = a_t·S_{t-1} + b_t·k_t v_tᵀ, o_t = S_tᵀq_t (the online term of
    MC prefill), also emitting the state and key sum at every segment boundary.

    q, k ``(B, T, H, K)``; v ``(B, T, H, V)``; log_a (log of the decay a, ≤ 0) and b (write
    gate) ``(B, T, H)`` or None (no decay / unit write); initial_state ``(N, H, K, V)`` or None
    (zeros). Variable-length batches as in flash-linear-attention: B = 1 and ``cu_seqlens``
    ``(N + 1,)`` (else N = B). ``initial_seg_len`` (int or ``(N,)``) = tokens each sequence
    already has in its current segment, ``initial_ksum`` ``(N, H, K)`` their key sum (added to
    that segment's sum). ``mode="independent"`` restarts the state from zero after every
    completed segment (the final state is then zero when a sequence ends on a boundary).

    Returns ``(o, final_state, boundary_states, boundary_ksums)``: o ``(B, T, H, V)``;
    final_state ``(N, H, K, V)`` (None unless ``output_final_state``); the state after the last
    token of every completed segment and that segment's key sum (Σ k, unweighted by b). Without
    ``block_ids`` these are fresh ``(total, H, K, V)`` / ``(total, H, K)`` tensors laid out by
    ``common.boundary_layout``; with ``block_ids`` ``(total,)`` they are written in place into
    ``state_pool`` ``(num_blocks, H, K, V)`` / ``ksum_pool`` ``(num_blocks, H, K)`` at those
    rows, and the pools are returned.
    """
    return _prefill_impl(chunk_gla, q, k, v, log_a, b, initial_state, segment_len=segment_len,
                         cu_seqlens=cu_seqlens, mode=mode, initial_seg_len=initial_seg_len,
                         initial_ksum=initial_ksum, output_final_state=output_final_state,
                         block_ids=block_ids, state_pool=state_pool, ksum_pool=ksum_pool,
                         out=out, chunk_size=chunk_size)
