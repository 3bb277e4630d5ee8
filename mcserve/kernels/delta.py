"""The (gated) delta rule over a span of tokens, chunk-parallel.

    S_t = α_t·(I − β_t k_t k_tᵀ)·S_{t-1} + β_t k_t v_tᵀ,    o_t = S_tᵀ q_t

(S is K×V per head, keys on the rows; α ≡ 1 is DeltaNet, per-token α is Gated DeltaNet).
``chunk_delta_rule`` is the WY/UT form: inside a chunk the update is
S_t = α_t S_{t-1} + k_t u_tᵀ with u_t = β_t (v_t − α_t S_{t-1}ᵀ k_t). Writing Γ_t for the decay
from the chunk start to t, the pseudo-values satisfy one unit lower-triangular system

    (I + A) U = diag(β) V − diag(β Γ) K S_0,    A_tj = β_t (Γ_t/Γ_j) k_tᵀ k_j  (j < t),

so with T = (I + A)⁻¹ (a triangular solve, never an explicit inverse), U = T diag(β) V −
(T diag(βΓ) K) S_0, and the chunk's outputs and final state follow from U as for gated linear
attention. ``naive_delta_rule`` is its per-token twin with the same signature (the oracle is
``mcserve.kernels.reference.delta_rule_recurrent``). Both take ``initial_state`` and return
``(o, final_state)`` (flash-linear-attention convention); q is used as given (no scaling).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mcserve.kernels.reference import delta_rule_recurrent


def naive_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor | None, log_alpha: Tensor | None = None,
    initial_state: Tensor | None = None, chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Per-token recurrence. q, k ``(B, T, H, K)``, v ``(B, T, H, V)``, beta/log_alpha
    ``(B, T, H)`` or None, initial_state ``(B, H, K, V)`` or None (zeros)."""
    del chunk_size
    return delta_rule_recurrent(q, k, v, beta, log_alpha, initial_state)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # half precision runs in float32: the triangular solve has no half kernels on CPU, and the
    # long products of α and (I − βkkᵀ) lose too much in 8 mantissa bits
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def chunk_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor | None, log_alpha: Tensor | None = None,
    initial_state: Tensor | None = None, chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Chunk-parallel form of ``naive_delta_rule`` (same signature and result).

    q, k ``(B, T, H, K)``; v ``(B, T, H, V)``; beta = write strength and log_alpha = log of the
    decay, ``(B, T, H)`` or None (ones / no decay); initial_state ``(B, H, K, V)`` or None.
    Returns o ``(B, T, H, V)`` and the state after the last token ``(B, H, K, V)``, in the
    dtype of q.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype = q.dtype
    dt = _compute_dtype(out_dtype)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    beta = None if beta is None else beta.to(dt)
    log_alpha = None if log_alpha is None else log_alpha.to(dt)
    S = (torch.zeros(B, H, K, V, dtype=dt, device=q.device) if initial_state is None
         else initial_state.to(dt))
    if T == 0:
        return v.new_zeros(v.shape).to(out_dtype), S.to(out_dtype)
    if T == 1:  # decode: one step, no chunk machinery
        kt = k[:, 0]  # (B, H, K)
        if log_alpha is not None:
            S = S * log_alpha[:, 0].exp()[..., None, None]
        err = v[:, 0] - torch.matmul(kt[..., None, :], S)[..., 0, :]  # (B, H, V)
        if beta is not None:
            err = err * beta[:, 0, :, None]
        S = torch.addcmul(S, kt[..., :, None], err[..., None, :])
        o = torch.matmul(q[:, 0, :, None, :], S).transpose(1, 2)  # (B, 1, H, V)
        return o.to(out_dtype), S.to(out_dtype)
    outs = []
    for s in range(0, T, chunk_size):
        qc = q[:, s:s + chunk_size].transpose(1, 2)  # (B, H, L, K)
        kc = k[:, s:s + chunk_size].transpose(1, 2)
        vc = v[:, s:s + chunk_size].transpose(1, 2)  # (B, H, L, V)
        L = qc.shape[2]
        bc = (torch.ones(B, H, L, dtype=dt, device=q.device) if beta is None
              else beta[:, s:s + L].transpose(1, 2))  # (B, H, L)
        incl = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()  # j ≤ t
        if log_alpha is None:
            decay = incl.to(dt)  # (L, L) Γ_t/Γ_j on j ≤ t
            gam = None
        else:
            g = log_alpha[:, s:s + L].transpose(1, 2).cumsum(-1)  # (B, H, L) log Γ_t
            diff = g[..., :, None] - g[..., None, :]  # (B, H, t, j)
            decay = diff.masked_fill(~incl, float("-inf")).exp()  # masked before exp: no inf
            gam = g.exp()  # (B, H, L) Γ_t
        kk = kc @ kc.transpose(-1, -2)  # (B, H, L, L)
        A = (bc[..., None] * kk * decay).tril(-1)
        I_A = A + torch.eye(L, dtype=dt, device=q.device)
        bk = bc[..., None] * (kc if gam is None else kc * gam[..., None])  # diag(βΓ) K
        rhs = torch.cat([bc[..., None] * vc, bk], dim=-1)  # (B, H, L, V + K)
        sol = torch.linalg.solve_triangular(I_A, rhs, upper=False, unitriangular=True)
        u_free, w = sol.split([V, K], dim=-1)  # T diag(β) V, T diag(βΓ) K
        u = u_free - w @ S  # (B, H, L, V) pseudo-values given the carried state
        q_in = qc if gam is None else qc * gam[..., None]
        o = q_in @ S + ((qc @ kc.transpose(-1, -2)) * decay) @ u  # (B, H, L, V)
        outs.append(o)
        if gam is None:
            S = S + kc.transpose(-1, -2) @ u
        else:
            k_end = kc * (g[..., -1:] - g).exp()[..., None]  # decay from j to the chunk end
            S = S * gam[..., -1, None, None] + k_end.transpose(-1, -2) @ u
    o = torch.cat(outs, dim=2).transpose(1, 2)  # (B, T, H, V)
    return o.to(out_dtype), S.to(out_dtype)
