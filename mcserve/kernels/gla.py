"""Gated linear attention over a span of tokens: S_t = a_t·S_{t-1} + b_t·k_t v_tᵀ, o_t = S_tᵀ q_t.

``chunk_gla`` is the chunk-parallel torch path (one masked product per chunk, no per-token loop;
on the CPU the span goes token by token in C++ instead, ``kernels.cpu.linear_scan``);
``naive_gla`` is its per-token twin with the same signature, used as the test oracle.
Both take ``initial_state`` and return ``(o, final_state)`` (flash-linear-attention convention).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mcserve.kernels import cpu as cpu_ops


def naive_gla(
    q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None, b: Tensor | None,
    initial_state: Tensor, chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Per-token recurrence. q, k ``(B, T, H, K)``, v ``(B, T, H, V)``, log_a/b ``(B, T, H)``."""
    del chunk_size
    S = initial_state
    outs = []
    for t in range(q.shape[1]):
        if log_a is not None:
            S = S * log_a[:, t].exp()[..., None, None]
        kt = k[:, t] if b is None else k[:, t] * b[:, t, :, None]
        S = S + kt[..., :, None] * v[:, t, :, None, :]  # (B, H, K, V)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, S


def chunk_local(q: Tensor, k: Tensor, v: Tensor, A: Tensor | None) -> tuple[Tensor, Tensor]:
    """Every chunk of a batch of chunks from a zero state, head-major: q, k ``(X, C, K)`` (the
    write gate already in k), v ``(X, C, V)``, A ``(X, C)`` the log decay from the chunk start
    to each token (cumulative, ≤ 0) or None. Returns the chunk's own outputs ``(X, C, V)`` and
    its contribution to the state at its end ``(X, K, V)``, as three batched GEMMs."""
    scores = torch.bmm(q, k.transpose(1, 2))  # (X, t, s)
    C = q.shape[1]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if A is None:
        scores.masked_fill_(~causal, 0.0)
        k_end = k
    else:
        # exp(A_t - A_s) for s <= t; the -inf before exp keeps s > t from overflowing
        decay = (A[:, :, None] - A[:, None, :]).masked_fill_(~causal, float("-inf")).exp_()
        scores.mul_(decay)
        k_end = k * (A[:, -1:] - A).exp()[..., None]  # decay from each token to the chunk end
    return torch.bmm(scores, v), torch.bmm(k_end.transpose(1, 2), v)


def chunk_gla(
    q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None, b: Tensor | None,
    initial_state: Tensor, chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Chunk-parallel form of ``naive_gla`` (same signature and result).

    q, k ``(B, T, H, K)``; v ``(B, T, H, V)``; log_a = log of the decay gate and b = write gate,
    ``(B, T, H)`` or None (no decay / unit write); initial_state ``(B, H, K, V)``.
    Returns o ``(B, T, H, V)`` and the state after the last token ``(B, H, K, V)``.

    All chunks at once, head-major (``chunk_local``): their own outputs and end-state
    contributions from zero, then a short scan over chunks for each chunk's start state, then
    one GEMM reads every start state out; a group of chunks at a time (``_GROUP_BYTES``).
    """
    T = q.shape[1]
    S = initial_state
    if T == 1:  # decode: one fused-looking step instead of the chunk machinery
        kt = k[:, 0] if b is None else k[:, 0] * b[:, 0, :, None]
        if log_a is not None:
            S = S * log_a[:, 0].exp()[..., None, None]
        S = torch.addcmul(S, kt[..., :, None], v[:, 0, :, None, :])  # (B, H, K, V)
        return torch.matmul(q[:, 0, :, None, :], S).transpose(1, 2), S
    if T == 0:
        return v.new_zeros(v.shape), S
    if cpu_ops.scans(S, q, k, v, log_a, b):
        # on the CPU: token by token in C++, each head's state kept in cache (faster than the
        # chunked products at every length measured, 2 to 2048 tokens, 4 and 24 heads)
        return cpu_ops.linear_scan(q, k, v, log_a, b, S)
    o, S, _ = _chunked(q, k, v, log_a, b, S, min(chunk_size, T), restart=False, ends=False)
    return o, S


def chunk_gla_ends(
    q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None, b: Tensor | None,
    initial_state: Tensor, chunk_size: int, restart: bool = False,
) -> tuple[Tensor, Tensor]:
    """``chunk_gla`` that also returns the state at the end of every chunk: o ``(B, T, H, V)``
    and ends ``(B, G, H, K, V)`` (G = ⌈T / chunk_size⌉; the last is the final state). With
    ``restart`` every chunk after the first starts from zero instead of the previous chunk's
    end (Memory Caching's independent segments). Segments of MC are its chunks. On the CPU
    token by token in C++ (``kernels.cpu.linear_scan_ends``), as ``chunk_gla``."""
    if q.shape[1] and cpu_ops.scans(initial_state, q, k, v, log_a, b):
        return cpu_ops.linear_scan_ends(q, k, v, log_a, b, initial_state, chunk_size, restart)
    o, _, ends = _chunked(q, k, v, log_a, b, initial_state, chunk_size, restart=restart,
                          ends=True)
    return o, ends


def _chunked(q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None, b: Tensor | None,
             S: Tensor, C: int, *, restart: bool, ends: bool
             ) -> tuple[Tensor, Tensor, Tensor | None]:
    B, T, H, K = q.shape
    V = v.shape[-1]
    G = -(-T // C)
    pad = G * C - T  # zero keys and values, no decay: the padding changes nothing

    def pad_(x: Tensor) -> Tensor:
        return torch.cat([x, x.new_zeros((B, pad) + x.shape[2:])], 1) if pad else x

    fold = (B, G, C)
    qf, kf, vf = (x.view(fold + x.shape[2:]) for x in (pad_(q), pad_(k), pad_(v)))
    bf = None if b is None else pad_(b).view(fold + (H,))
    Af = None if log_a is None else pad_(log_a).view(fold + (H,)).cumsum(2)  # (B, G, C, H)
    out = v.new_empty(B, G, C, H, V)
    all_ends = []
    # a group of chunks at a time keeps every temporary cache-sized (one batch of all chunks
    # at 8K tokens ran at half the GEMM rate); within it, everything is batched
    group = max(1, _GROUP_BYTES // (B * C * H * max(K, V) * q.element_size()))
    for g0 in range(0, G, group):
        g1 = min(G, g0 + group)
        n = g1 - g0

        def heads(x: Tensor, g0: int = g0, g1: int = g1) -> Tensor:
            """(B, G, C, H, ·) → the group's (B·n·H, C, ·), contiguous."""
            return x[:, g0:g1].transpose(2, 3).reshape((B * (g1 - g0) * H, C) + x.shape[4:])

        qh, kh, vh = heads(qf), heads(kf), heads(vf)
        if bf is not None:  # the write gate, on the group's own (cache-sized) copy of k
            kh = kh * heads(bf)[..., None]
        A = None if Af is None else heads(Af)
        o_loc, D = chunk_local(qh, kh, vh, A)  # (B·n·H, C, V), (B·n·H, K, V)
        D = D.view(B, n, H, K, V)
        if A is not None:
            qh = qh * A.exp()[..., None]  # a chunk's start state reaches t decayed by exp(A_t)
            decay_chunk = A[:, -1].exp().view(B, n, H, 1, 1)
        starts = []
        for g in range(n):  # the only loop: two small ops per chunk on (B, H, K, V)
            if restart and g0 + g:
                S = torch.zeros_like(S)
            starts.append(S)
            S = S + D[:, g] if A is None else torch.addcmul(D[:, g], S, decay_chunk[:, g])
            if ends:
                all_ends.append(S)
        S0 = (starts[0] if n == 1 else torch.stack(starts, 1)).reshape(B * n * H, K, V)
        o_loc.baddbmm_(qh, S0)
        out[:, g0:g1] = o_loc.view(B, n, H, C, V).transpose(2, 3)
    o = out.view(B, G * C, H, V)
    return (o[:, :T] if pad else o), S, torch.stack(all_ends, 1) if ends else None


# bytes of one operand (q, k or v) of a group of chunks that chunk_gla batches at once
_GROUP_BYTES = 512 * 2**10
