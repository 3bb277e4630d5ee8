"""RWKV-7's generalised delta rule over a span of tokens (state S ∈ R^{K×V} per head).

    S_t = diag(w_t)·S_{t-1} + b_t·(a_tᵀ S_{t-1}) + k_t v_tᵀ,    o_t = S_tᵀ r_t

with w_t = exp(log_w_t) a per-channel decay, a_t the removal key (RWKV-7 passes −κ̂) and b_t
the scaled write of what was removed (κ̂·a_rate). S is stored with keys on the rows, as every
matrix memory of mcserve (and flash-linear-attention's ``[B, H, K, V]`` states); the rwkv
package keeps the transpose, S_pkg = Sᵀ, and writes the same rule as
S_pkg ← S_pkg·(diag(w) + aᵀb) + vᵀk, o = S_pkg·r.

``chunk_rwkv7`` is the chunk-parallel torch path; ``naive_rwkv7`` is its per-token twin with the
same signature, the test oracle. Both take ``initial_state`` and return ``(o, final_state)``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _step(S: Tensor, r: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, log_w: Tensor
          ) -> tuple[Tensor, Tensor]:
    """One token for every (batch, head) at once: S ``(B, H, K, V)``, the rest ``(B, H, K)``
    (v ``(B, H, V)``). Returns (o ``(B, H, V)``, S)."""
    sa = torch.matmul(a[..., None, :], S)  # (B, H, 1, V) aᵀS
    S = S * log_w.exp()[..., None] + b[..., None] * sa + k[..., None] * v[..., None, :]
    return torch.matmul(r[..., None, :], S)[..., 0, :], S


def naive_rwkv7(
    r: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, log_w: Tensor,
    initial_state: Tensor, chunk_size: int = 32,
) -> tuple[Tensor, Tensor]:
    """Per-token recurrence. r, k, a, b, log_w ``(B, T, H, K)``, v ``(B, T, H, V)``,
    initial_state ``(B, H, K, V)`` → o ``(B, T, H, V)``, final state ``(B, H, K, V)``."""
    del chunk_size
    S = initial_state
    outs = []
    for t in range(r.shape[1]):
        o, S = _step(S, r[:, t], k[:, t], v[:, t], a[:, t], b[:, t], log_w[:, t])
        outs.append(o)
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, S


def chunk_rwkv7(
    r: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, log_w: Tensor,
    initial_state: Tensor, chunk_size: int = 32,
) -> tuple[Tensor, Tensor]:
    """Chunk-parallel form of ``naive_rwkv7`` (same signature and result).

    Inside a chunk of L tokens, with c_t = Σ_{s≤t} log w_s per channel (c_0 = 0) and the removed
    values u_t = a_tᵀ S_{t-1} (rows ``(L, V)``), unrolling the rule gives

        S_t = e^{c_t} ⊙ S_0 + Σ_{s≤t} e^{c_t − c_s} ⊙ (b_s u_s + k_s v_sᵀ)
        u_t = (a_t e^{c_{t-1}})ᵀ S_0 + Σ_{s<t} [A_ab]_{ts} u_s + [A_ak]_{ts} v_s

    with [A_xy]_{ts} = Σ_i x_{t,i} y_{s,i} e^{c_{t-1,i} − c_{s,i}}: a unit lower-triangular
    system (I − A_ab) u = ..., solved exactly by forward substitution. The outputs and the state
    at the chunk end follow from u with the same pairwise decays, computed as matrix products
    of factors referred to the chunk's middle token. Those factors grow as e^{|Σ log w|} over
    half a chunk: fine in float32 for RWKV-7's bounded decays (log w ≥ −e^{−0.5}) up to chunks
    of a few hundred tokens; ``chunk_size`` trades the L² work against the per-chunk loop.
    """
    if r.element_size() < 4:  # half precision: the L×L products and the solve in float32
        f = [x.float() for x in (r, k, v, a, b, log_w, initial_state)]
        o, S = chunk_rwkv7(*f, chunk_size=chunk_size)
        return o.to(v.dtype), S.to(initial_state.dtype)
    B, T, H, K = r.shape
    S = initial_state
    if T == 1:  # decode: one step, no chunk machinery
        o, S = _step(S, r[:, 0], k[:, 0], v[:, 0], a[:, 0], b[:, 0], log_w[:, 0])
        return o[:, None], S
    # heads first: (B, H, T, ·)
    r, k, v, a, b, log_w = (x.transpose(1, 2) for x in (r, k, v, a, b, log_w))
    outs = []
    for s0 in range(0, T, chunk_size):
        sl = slice(s0, s0 + chunk_size)
        rc, kc, vc, ac, bc, lw = r[:, :, sl], k[:, :, sl], v[:, :, sl], a[:, :, sl], \
            b[:, :, sl], log_w[:, :, sl]
        L = rc.shape[2]
        c = lw.cumsum(2)  # (B, H, L, K) log decay from the chunk start through token t
        c_prev = c - lw  # through token t - 1
        incl = torch.ones(L, L, dtype=torch.bool, device=r.device).tril()  # s ≤ t
        # e^{c_t − c_s} factored around the chunk's middle m: (x_t e^{c_t − m})·(y_s e^{m − c_s})
        # turns the pairwise decays into matrix products; each factor is at most
        # e^{|Σ log w| over half a chunk} (RWKV-7: log w ≥ −e^{−0.5}, so ≤ e^{9.7} for L = 32)
        m = c[:, :, (L - 1) // 2:(L - 1) // 2 + 1]  # (B, H, 1, K)
        fwd, fwd_prev, back = (c - m).exp(), (c_prev - m).exp(), (m - c).exp()
        bs, ks = bc * back, kc * back  # (B, H, L, K) written at s, referred to m
        aq, rq = ac * fwd_prev, rc * fwd  # read at t (after token t - 1 / after token t)
        A_ab = torch.matmul(aq, bs.transpose(-1, -2)).tril(-1)  # (B, H, L, L), s < t
        A_ak = torch.matmul(aq, ks.transpose(-1, -2)).tril(-1)
        A_rb = torch.matmul(rq, bs.transpose(-1, -2)).masked_fill(~incl, 0.0)  # s ≤ t
        A_rk = torch.matmul(rq, ks.transpose(-1, -2)).masked_fill(~incl, 0.0)
        rhs = torch.matmul(ac * c_prev.exp(), S) + torch.matmul(A_ak, vc)  # (B, H, L, V)
        eye = torch.eye(L, dtype=r.dtype, device=r.device)
        u = torch.linalg.solve_triangular(eye - A_ab, rhs, upper=False, unitriangular=True)
        outs.append(torch.matmul(rc * c.exp(), S) + torch.matmul(A_rb, u)
                    + torch.matmul(A_rk, vc))
        to_end = (c[:, :, -1:] - c).exp()  # (B, H, L, K) decay from each token to the chunk end
        S = (S * c[:, :, -1].exp()[..., None]
             + torch.matmul((bc * to_end).transpose(-1, -2), u)
             + torch.matmul((kc * to_end).transpose(-1, -2), vc))
    o = torch.cat(outs, dim=2).transpose(1, 2) if outs else v.new_zeros(v.shape).transpose(1, 2)
    return o, S
