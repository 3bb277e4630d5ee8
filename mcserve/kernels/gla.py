"""Gated linear attention over a span of tokens: S_t = a_t·S_{t-1} + b_t·k_t v_tᵀ, o_t = S_tᵀ q_t.

``chunk_gla`` is the chunk-parallel torch path (one masked product per chunk, no per-token loop);
``naive_gla`` is its per-token twin with the same signature, used as the test oracle.
Both take ``initial_state`` and return ``(o, final_state)`` (flash-linear-attention convention).
"""

from __future__ import annotations

import torch
from torch import Tensor


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


def chunk_gla(
    q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None, b: Tensor | None,
    initial_state: Tensor, chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Chunk-parallel form of ``naive_gla`` (same signature and result).

    q, k ``(B, T, H, K)``; v ``(B, T, H, V)``; log_a = log of the decay gate and b = write gate,
    ``(B, T, H)`` or None (no decay / unit write); initial_state ``(B, H, K, V)``.
    Returns o ``(B, T, H, V)`` and the state after the last token ``(B, H, K, V)``.
    """
    T = q.shape[1]
    S = initial_state
    if T == 1:  # decode: one fused-looking step instead of the chunk machinery
        kt = k[:, 0] if b is None else k[:, 0] * b[:, 0, :, None]
        if log_a is not None:
            S = S * log_a[:, 0].exp()[..., None, None]
        S = torch.addcmul(S, kt[..., :, None], v[:, 0, :, None, :])  # (B, H, K, V)
        return torch.matmul(q[:, 0, :, None, :], S).transpose(1, 2), S
    outs = []
    for s in range(0, T, chunk_size):
        qc, kc, vc = q[:, s:s + chunk_size], k[:, s:s + chunk_size], v[:, s:s + chunk_size]
        L = qc.shape[1]
        if b is not None:
            kc = kc * b[:, s:s + L, :, None]
        if log_a is None:
            inter = torch.einsum("blhk,bhkv->blhv", qc, S)
            scores = torch.einsum("bthk,bshk->bhts", qc, kc).tril()
            S = S + torch.einsum("bshk,bshv->bhkv", kc, vc)
        else:
            A = log_a[:, s:s + L].cumsum(1)  # (B, L, H) log of the decay from chunk start to t
            inter = torch.einsum("blhk,bhkv->blhv", qc * A.exp()[..., None], S)
            diff = A.transpose(1, 2)[..., :, None] - A.transpose(1, 2)[..., None, :]  # (B,H,t,s)
            mask = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
            decay = torch.where(mask, diff, torch.full_like(diff, float("-inf"))).exp()
            scores = torch.einsum("bthk,bshk->bhts", qc, kc) * decay
            k_end = kc * (A[:, -1:] - A).exp()[..., None]  # decay from s to the chunk end
            S = S * A[:, -1].exp()[..., None, None] + torch.einsum("bshk,bshv->bhkv", k_end, vc)
        outs.append(inter + torch.einsum("bhts,bshv->bthv", scores, vc))
    o = torch.cat(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, S
