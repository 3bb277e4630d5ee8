"""Vector-gated linear attention (GLA form): a decay per token, head and key dimension.

    S_t = diag(a_t)·S_{t-1} + b_t·k_t v_tᵀ,    o_t = S_tᵀ q_t

with S ∈ R^{K×V} per head, a_t ∈ (0, 1]^K passed as ``log_a`` (≤ 0) and b_t a scalar write gate.

``chunk_gla_vec`` is the fast torch path, ``naive_gla_vec`` its per-token twin with the same
signature (the test oracle). Both take ``initial_state`` and return ``(o, final_state)``
(flash-linear-attention convention; no q scaling here, the caller scales q if its model does).

Two chunked forms, picked by the value width:

* ``_chunk_matmul`` (large V, e.g. GLA heads): per chunk, the state carried in is read with
  q·exp(A) (A = cumulative log decay from the chunk start), and the tokens of the chunk interact
  through masked products. A per-dim decay does not factor out of the q·k product, so the chunk
  is cut into sub-chunks: between sub-chunks, q and k are referred to the start of the query's
  sub-chunk (q·exp(A_t − A_ref), k·exp(A_ref − A_s), both exponents ≤ 0); inside a sub-chunk the
  (t, s, K) decay tensor is formed explicitly, masked before the exponential. No exponential of a
  positive number is ever taken, so long strong decays underflow to 0 instead of overflowing.
* ``_chunk_scan`` (small V, e.g. Mamba1 with V = 1): the sub-chunk decay tensor would cost
  (sub-chunk)× the state, more than the states themselves, so every chunk runs the per-token
  recurrence from zero, all chunks at once, and the states carried between chunks are added
  afterwards with exp(A) (≤ 1). Python steps: chunk length + number of chunks, not T.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

#: value widths up to this run the scan form (its work is T·K·V; the matmul form's sub-chunk
#: decay tensor alone is T·16·K)
SCAN_MAX_V = 8


def naive_gla_vec(
    q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None, b: Tensor | None,
    initial_state: Tensor, chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Per-token recurrence. q, k ``(B, T, H, K)``, v ``(B, T, H, V)``, log_a ``(B, T, H, K)``,
    b ``(B, T, H)`` (None: no decay / unit write), initial_state ``(B, H, K, V)``."""
    del chunk_size
    S = initial_state
    outs = []
    for t in range(q.shape[1]):
        if log_a is not None:
            S = S * log_a[:, t].exp()[..., None]
        kt = k[:, t] if b is None else k[:, t] * b[:, t, :, None]
        S = S + kt[..., :, None] * v[:, t, :, None, :]  # (B, H, K, V)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, S


def step_gla_vec_(S: Tensor, q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None,
                  b: Tensor | None) -> Tensor:
    """One token, ``S`` ``(B, H, K, V)`` updated in place; q, k, log_a ``(B, H, K)``, v
    ``(B, H, V)``, b ``(B, H)``. Returns o ``(B, H, V)``."""
    if log_a is not None:
        S.mul_(log_a.exp()[..., None])
    kt = k if b is None else k * b[..., None]
    S.addcmul_(kt[..., :, None], v[..., None, :])
    return torch.matmul(q[..., None, :], S)[..., 0, :]


def chunk_gla_vec(
    q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None, b: Tensor | None,
    initial_state: Tensor, chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Chunked form of ``naive_gla_vec`` (same signature and result).

    q, k ``(B, T, H, K)``; v ``(B, T, H, V)``; log_a ``(B, T, H, K)`` or None; b ``(B, T, H)`` or
    None; initial_state ``(B, H, K, V)``. Returns o ``(B, T, H, V)`` and the final state.
    """
    B, T, H, K = q.shape
    if T == 0:
        return v.new_zeros(v.shape), initial_state
    if T == 1:  # decode: one step, out of place
        S = initial_state.clone()
        o = step_gla_vec_(S, q[:, 0], k[:, 0], v[:, 0], None if log_a is None else log_a[:, 0],
                          None if b is None else b[:, 0])
        return o[:, None], S
    kb = k if b is None else k * b[..., None]
    la = torch.zeros_like(q) if log_a is None else log_a.to(q.dtype)
    if v.shape[-1] <= SCAN_MAX_V:
        # about √T tokens a chunk balances the two python loops of the scan form
        L = max(8, min(256, 8 * math.ceil(math.sqrt(T) / 8)))
        return _chunk_scan(q, kb, v, la, initial_state, L)
    return _chunk_matmul(q, kb, v, la, initial_state, chunk_size)


def _pad_chunks(x: Tensor, L: int) -> Tensor:
    """(B, T, H, D) → (B, NC, L, H, D), zero-padded at the end. Padding tokens write nothing
    (k = v = 0) and do not decay (log_a = 0), so the final state is unchanged."""
    B, T = x.shape[:2]
    pad = (-T) % L
    if pad:
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
    return x.view(B, (T + pad) // L, L, *x.shape[2:])


def _carry(S0: Tensor, decay: Tensor, local_end: Tensor) -> tuple[Tensor, Tensor]:
    """States at every chunk start and the final state.

    decay ``(B, NC, H, K)`` = exp of the chunk's total log decay; local_end ``(B, NC, H, K, V)``
    = the chunk's end state when started from zero."""
    starts = []
    S = S0
    for c in range(decay.shape[1]):
        starts.append(S)
        S = S * decay[:, c, ..., None] + local_end[:, c]
    return torch.stack(starts, 1), S  # (B, NC, H, K, V)


def _chunk_scan(q: Tensor, kb: Tensor, v: Tensor, la: Tensor, S0: Tensor, L: int
                ) -> tuple[Tensor, Tensor]:
    T = q.shape[1]
    qc, kc, vc, lc = (_pad_chunks(x, L) for x in (q, kb, v, la))  # (B, NC, L, H, ·)
    B, NC, _, H, K = qc.shape
    V = vc.shape[-1]
    S = S0.new_zeros(B, NC, H, K, V)
    a = lc.exp()
    outs = []
    for j in range(L):  # every chunk from zero at once
        S = S * a[:, :, j, ..., None] + kc[:, :, j, ..., None] * vc[:, :, j, :, None, :]
        outs.append((qc[:, :, j, ..., None] * S).sum(-2))  # (B, NC, H, V)
    o = torch.stack(outs, 2)  # (B, NC, L, H, V)
    A = lc.cumsum(2)  # (B, NC, L, H, K) log decay from the chunk start, ≤ 0
    starts, S_end = _carry(S0, A[:, :, -1].exp(), S)
    o = o + torch.einsum("bclhk,bchkv->bclhv", qc * A.exp(), starts)
    return o.reshape(B, NC * L, H, V)[:, :T], S_end


def _chunk_matmul(q: Tensor, kb: Tensor, v: Tensor, la: Tensor, S0: Tensor, L: int,
                  sub: int = 16) -> tuple[Tensor, Tensor]:
    T = q.shape[1]
    L = min(L, sub * math.ceil(T / sub))  # short spans: one chunk of whole sub-chunks
    L = sub * math.ceil(L / sub)
    qc, kc, vc, lc = (_pad_chunks(x, L) for x in (q, kb, v, la))  # (B, NC, L, H, ·)
    B, NC, _, H, K = qc.shape
    V = vc.shape[-1]
    A = lc.cumsum(2)  # (B, NC, L, H, K) log decay from the chunk start, ≤ 0
    A_end = A[:, :, -1:]  # (B, NC, 1, H, K)
    # the chunk's writes decayed to its end: its end state when started from zero
    local_end = torch.einsum("bclhk,bclhv->bchkv", kc * (A_end - A).exp(), vc)
    starts, S_end = _carry(S0, A_end[:, :, 0].exp(), local_end)
    o = torch.einsum("bclhk,bchkv->bclhv", qc * A.exp(), starts)  # carried-in state
    mask = torch.ones(sub, sub, dtype=torch.bool, device=q.device).tril()  # s ≤ t
    mask = mask[:, :, None, None]  # (t, s, 1, 1)
    parts = []
    for i in range(L // sub):
        sl = slice(i * sub, (i + 1) * sub)
        Ai, qi, ki, vi = A[:, :, sl], qc[:, :, sl], kc[:, :, sl], vc[:, :, sl]
        # inside the sub-chunk: the explicit (t, s, K) decay, masked before the exponential
        diff = Ai[:, :, :, None] - Ai[:, :, None, :]  # (B, NC, t, s, H, K)
        dec = diff.masked_fill(~mask, float("-inf")).exp()
        scores = (qi[:, :, :, None] * ki[:, :, None] * dec).sum(-1)  # (B, NC, t, s, H)
        oi = torch.einsum("bctsh,bcshv->bcthv", scores, vi)
        if i:  # earlier sub-chunks, referred to the end of the previous one
            ref = A[:, :, i * sub - 1:i * sub]  # (B, NC, 1, H, K)
            qr = qi * (Ai - ref).exp()
            kr = kc[:, :, :i * sub] * (ref - A[:, :, :i * sub]).exp()
            att = torch.einsum("bcthk,bcshk->bchts", qr, kr)
            oi = oi + torch.einsum("bchts,bcshv->bcthv", att, vc[:, :, :i * sub])
        parts.append(oi)
    o = o + torch.cat(parts, 2)
    return o.reshape(B, NC * L, H, V)[:, :T], S_end
