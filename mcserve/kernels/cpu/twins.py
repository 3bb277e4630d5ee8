"""Plain torch twins of the C++ ops beside this file (same signatures, same results)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x ``(..., I)`` · weight ``(O, I)``ᵀ + bias → ``(..., O)``."""
    return F.linear(x, weight, bias)


def pack_pairs(w: Tensor) -> Tensor:
    """w ``(N, K)`` → ``(ceil(N/16), ceil(K/2), 16, 2)``: blocks of 16 output rows, k-pair by
    k-pair, zero-padded: the layout of the low-precision kernels (``lowp.cpp``), where one vector
    holds 16 outputs × 2 values of k."""
    N, K = w.shape
    Np, Kp = -(-N // 16) * 16, -(-K // 2) * 2
    p = w.new_zeros(Np, Kp)
    p[:N, :K] = w
    return p.view(Np // 16, 16, Kp // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_pairs(p: Tensor, N: int, K: int) -> Tensor:
    """The ``(N, K)`` weight of ``pack_pairs``' layout."""
    return p.permute(0, 2, 1, 3).reshape(p.shape[0] * 16, p.shape[1] * 2)[:N, :K]


def linear_q8(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None = None) -> Tensor:
    """x ``(..., K)`` · (qweight · scales ``(N,)``)ᵀ + bias → ``(..., N)``: the weight-only int8
    product (per-output-channel scales) in x's precision; qweight int8 in ``pack_pairs``'
    layout."""
    w = unpack_pairs(qweight, scales.numel(), x.shape[-1])
    return F.linear(x, w.to(x.dtype) * scales.to(x.dtype)[:, None], bias)


def linear_bf16(x: Tensor, weight: Tensor, scales: Tensor, bias: Tensor | None = None) -> Tensor:
    """x ``(..., K)`` · (weight · scales ``(N,)``)ᵀ + bias → ``(..., N)`` in x's precision;
    weight bfloat16 in ``pack_pairs``' layout (scales of 1 for plain bfloat16 weights)."""
    w = unpack_pairs(weight, scales.numel(), x.shape[-1])
    return F.linear(x, w.to(x.dtype) * scales.to(x.dtype)[:, None], bias)


def packed_rows(P: Tensor, scales: Tensor, idx: Tensor, K: int) -> Tensor:
    """Rows ``idx (T,)`` of a packed int8 / bfloat16 weight (``pack_pairs``' layout) as float32
    times their scales → ``(T, K)``, reading only those rows."""
    r = P[idx // 16, :, idx % 16, :].reshape(idx.numel(), -1)[:, :K]
    return r.float() * scales[idx][:, None]


#: ``gated_mlp``'s and ``moe_experts``' activations by code
MLP_ACTS = {0: F.silu, 1: lambda h: torch.square(F.relu(h)), 2: F.relu}


def gated_mlp(x: Tensor, gate: Tensor, s_gate: Tensor, up: Tensor, s_up: Tensor, down: Tensor,
              s_down: Tensor, act: int = 0) -> Tensor:
    """``down(act(gate x) · up x)`` for x ``(..., D)`` float32 and int8 or bfloat16 weights in
    ``pack_pairs``' layout with their scales: gate and up ``(⌈I/16⌉, ⌈D/2⌉, 16, 2)`` with ``(I,)``,
    down ``(⌈D/16⌉, ⌈I/2⌉, 16, 2)`` with ``(D,)``; ``act``: 0 silu, 1 relu², 2 relu."""
    lin = linear_q8 if gate.dtype == torch.int8 else linear_bf16
    return lin(MLP_ACTS[act](lin(x, gate, s_gate)) * lin(x, up, s_up), down, s_down)


def moe_experts(x: Tensor, idx: Tensor, w: Tensor, w_in: Tensor, s_in: Tensor | None,
                down: Tensor, s_down: Tensor | None, gated: bool, act: int) -> Tensor:
    """A MoE layer's routed experts on x ``(T, D)``: out ``(T, D)`` float32 = the sum over each
    token's experts ``idx (T, k)`` of ``w (T, k)`` · ``down_e(act(gate_e x) * up_e x)`` (gated;
    ``down_e(act(up_e x))`` otherwise); ``w_in (E, ⌈N1/16⌉, ⌈D/2⌉, 16, 2)`` and ``down (E,
    ⌈D/16⌉, ⌈I/2⌉, 16, 2)`` int8 or bfloat16 in ``pack_pairs``' layout with scales ``s_in (E,
    N1)``, ``s_down (E, D)``, ``N1 = 2I`` (gated) or ``I``, or float32 ``w_in (E, N1, D)`` and
    ``down (E, D, I)`` with no scales; ``act``: 0 silu, 1 relu², 2 relu. The pairs are added
    expert by expert, each expert's in pair order."""
    T, D = x.shape
    k = idx.shape[1]
    f32 = w_in.dtype == torch.float32
    N1 = w_in.shape[1] if f32 else s_in.shape[1]
    inter = N1 // 2 if gated else N1
    f = MLP_ACTS[act]
    out = torch.zeros(T, D)
    flat = idx.reshape(-1)
    for e in range(w_in.shape[0]):
        pairs = (flat == e).nonzero()[:, 0]
        if not pairs.numel():
            continue
        tok = pairs // k
        if f32:
            wi, wd = w_in[e], down[e]
        else:
            wi = unpack_pairs(w_in[e], N1, D).float() * s_in[e][:, None]
            wd = unpack_pairs(down[e], D, inter).float() * s_down[e][:, None]
        h = F.linear(x[tok], wi)
        h = f(h[:, :inter]) * h[:, inter:] if gated else f(h)
        out.index_add_(0, tok, F.linear(h, wd) * w.reshape(-1)[pairs, None])
    return out


def outer_bf16_(X: Tensor, w: Tensor, q: Tensor) -> Tensor:
    """X ``(A, T, n, K)`` bfloat16 = w ``(A, T, n)`` ⊗ q ``(A, T, K)``: each float32 product
    rounded to bfloat16 (to nearest even), in place."""
    return torch.mul(w[..., None], q[:, :, None, :], out=X)


def key_pairs_bf16_(dst: Tensor, src: Tensor, offset: int) -> Tensor:
    """dst ``(B, H, N, K/2, V, 2)`` bfloat16 [:, :, offset:offset + n] = src ``(B, n, H, K,
    V)`` with its keys in pairs (key 2i at [..., i, :, 0], 2i + 1 at [..., i, :, 1]), in
    place."""
    B, n, H, K, V = src.shape
    pairs = src.transpose(1, 2).reshape(B, H, n, K // 2, 2, V).transpose(-1, -2)
    dst[:, :, offset:offset + n].copy_(pairs.to(torch.bfloat16))
    return dst


def readout_picks_bf16(S: Tensor, q: Tensor, idx: Tensor, w: Tensor,
                       out: Tensor | None = None) -> Tensor:
    """y ``(B, L, H, V)`` = Σ_j bf16(w[..., j]·q)ᵀ S[idx[..., j]] with float32 sums: S
    ``(B, H, N, K/2, V, 2)`` bfloat16 in ``key_pairs_bf16_``' layout; added to ``out`` in place
    when given."""
    B, H, N, K2, V, _ = S.shape
    plain = S.transpose(-1, -2).reshape(B, H, N, 2 * K2, V).transpose(1, 2).float()
    X = (w[..., None] * q[..., None, :]).to(torch.bfloat16).float()  # (B, L, H, k, K)
    picked = plain[torch.arange(B)[:, None, None, None], idx, torch.arange(H)[None, None, :, None]]
    y = torch.einsum("blhjk,blhjkv->blhv", X, picked)  # picked (B, L, H, k, K, V)
    return y if out is None else out.add_(y)


def ckpt_pairs_bf16_(dst: Tensor, src: Tensor, offset: int) -> Tensor:
    """dst ``(B, H, K·V/16, P, 16, 2)`` bfloat16: checkpoints offset .. offset + n of it =
    src ``(B, n, H, K, V)``, each checkpoint's flattened (k, v) in groups of 16, checkpoints in
    pairs (j = 2p + e at [:, :, :, p, :, e]), in place."""
    B, n, H, K, V = src.shape
    j = torch.arange(offset, offset + n, device=src.device)
    groups = src.to(torch.bfloat16).reshape(B, n, H, K * V // 16, 16)
    dst[:, :, :, j // 2, :, j % 2] = groups.permute(1, 0, 2, 3, 4)
    return dst


def ckpt_pairs(S: Tensor) -> Tensor:
    """Checkpoints ``(A, N, K, V)`` in ``readout_bf16_``'s layout ``(A, K·V/16, P, 16, 2)``
    bfloat16, P the pairs rounded up to a multiple of 16, zero past N."""
    A, N, K, V = S.shape
    P = ((N + 1) // 2 + 15) // 16 * 16
    dst = torch.zeros(A, 1, K * V // 16, P, 16, 2, dtype=torch.bfloat16, device=S.device)
    return ckpt_pairs_bf16_(dst, S[:, :, None], 0)[:, 0]


def readout_bf16_(o: Tensor, w: Tensor, q: Tensor, S: Tensor) -> Tensor:
    """o ``(A, T, V)`` += Σ_j Σ_k q[:, :, k] · bf16(w[:, :, j]) · bf16(S_j)[k] in place, float32
    sums: the bfloat16 cached readout of a prefill tile. w ``(A, T, n)``, q ``(A, T, K)``
    float32, S the first n (or more) checkpoints in ``ckpt_pairs``' layout."""
    A, T, n = w.shape
    K, V = q.shape[-1], o.shape[-1]
    plain = S.permute(0, 2, 4, 1, 3).reshape(A, -1, K * V)[:, :n].float()  # (A, n, K·V)
    M = torch.bmm(w.to(torch.bfloat16).float(), plain).view(A, T, K, V)
    return o.add_((q[..., None] * M).sum(2))


def linear_step_(S: Tensor, q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None,
                 b: Tensor | None) -> Tensor:
    """S ``(B, H, K, V)`` ← a·S + (b·k) vᵀ in place; returns o = Sᵀq ``(B, H, V)``.

    q, k ``(B, H, K)``, v ``(B, H, V)``, log_a and b ``(B, H)`` or None.
    """
    kt = k if b is None else k * b[..., None]
    if log_a is not None:
        S.mul_(log_a.exp()[..., None, None])
    S.addcmul_(kt[..., :, None], v[..., None, :])
    return torch.matmul(q[..., None, :], S)[..., 0, :]


def linear_scan(q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None, b: Tensor | None,
                initial_state: Tensor) -> tuple[Tensor, Tensor]:
    """``linear_step_`` over the T tokens of a span from ``initial_state`` ``(B, H, K, V)``
    (not modified): q, k ``(B, T, H, K)``, v ``(B, T, H, V)``, log_a and b ``(B, T, H)`` or
    None. Returns o ``(B, T, H, V)`` and the final state."""
    S = initial_state.clone()
    outs = [linear_step_(S, q[:, t], k[:, t], v[:, t], None if log_a is None else log_a[:, t],
                         None if b is None else b[:, t]) for t in range(q.shape[1])]
    return (torch.stack(outs, 1) if outs else v.new_zeros(v.shape)), S


def linear_scan_ends(q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None, b: Tensor | None,
                     initial_state: Tensor, chunk: int, restart: bool) -> tuple[Tensor, Tensor]:
    """``linear_step_`` over the span, the state kept after every ``chunk`` tokens and after
    the last: ``(o (B, T, H, V), ends (B, ⌈T/chunk⌉, H, K, V))``; with ``restart`` each chunk
    after the first starts from zero."""
    S = initial_state.clone()
    T = q.shape[1]
    outs, ends = [], []
    for t in range(T):
        if restart and t and t % chunk == 0:
            S.zero_()
        outs.append(linear_step_(S, q[:, t], k[:, t], v[:, t],
                                 None if log_a is None else log_a[:, t],
                                 None if b is None else b[:, t]))
        if (t + 1) % chunk == 0 or t + 1 == T:
            ends.append(S.clone())
    B, H, K, V = S.shape
    return ((torch.stack(outs, 1) if outs else v.new_zeros(v.shape)),
            torch.stack(ends, 1) if ends else S.new_zeros(B, 0, H, K, V))


def _work(S: Tensor) -> Tensor:
    """S itself when its precision is computed in directly, else a float32 copy to compute in
    and copy back: long products of decays and rank-1 updates lose too much in 8 mantissa bits
    (the chunked kernels likewise run half precision in float32)."""
    return S if S.element_size() >= 4 else S.float()


def delta_step_(S: Tensor, q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None,
                beta: Tensor | None) -> Tensor:
    """S ``(B, H, K, V)`` ← α·(S − β k (kᵀS)) + β k vᵀ in place; returns o = Sᵀq ``(B, H, V)``.

    q, k ``(B, H, K)``, v ``(B, H, V)``, log_a (log α) and beta ``(B, H)`` or None (no decay /
    β = 1). The same operations as ``kernels.delta.chunk_delta_rule``'s one-token path.
    """
    W = _work(S)
    q, k, v = (x.to(W.dtype) for x in (q, k, v))
    if log_a is not None:
        W.mul_(log_a.to(W.dtype).exp()[..., None, None])
    err = v - torch.matmul(k[..., None, :], W)[..., 0, :]  # (B, H, V)
    if beta is not None:
        err = err * beta.to(W.dtype)[..., None]
    W.addcmul_(k[..., :, None], err[..., None, :])
    o = torch.matmul(q[..., None, :], W)[..., 0, :]
    if W is not S:
        S.copy_(W)
    return o.to(S.dtype)


def rwkv7_step_(S: Tensor, r: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor,
                log_w: Tensor) -> Tensor:
    """S ``(B, H, K, V)`` (keys on the rows) ← diag(exp(log_w))·S + b (aᵀS) + k vᵀ in place;
    returns o = Sᵀr ``(B, H, V)``. r, k, a, b, log_w ``(B, H, K)``, v ``(B, H, V)``."""
    W = _work(S)
    r, k, v, a, b, log_w = (x.to(W.dtype) for x in (r, k, v, a, b, log_w))
    sa = torch.matmul(a[..., None, :], W)  # (B, H, 1, V) aᵀS, before any row changes
    W.mul_(log_w.exp()[..., None]).addcmul_(b[..., :, None], sa)
    W.addcmul_(k[..., :, None], v[..., None, :])
    o = torch.matmul(r[..., None, :], W)[..., 0, :]
    if W is not S:
        S.copy_(W)
    return o.to(S.dtype)


def gla_vec_step_(S: Tensor, q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None,
                  b: Tensor | None) -> Tensor:
    """S ``(B, H, K, V)`` ← diag(exp(log_a))·S + (b·k) vᵀ in place; returns o = Sᵀq.

    q, k, log_a ``(B, H, K)`` (log_a None: no decay), v ``(B, H, V)``, b ``(B, H)`` or None.
    """
    if log_a is not None:
        S.mul_(log_a.exp()[..., None])
    kt = k if b is None else k * b[..., None]
    S.addcmul_(kt[..., :, None], v[..., None, :])
    return torch.matmul(q[..., None, :], S)[..., 0, :]


def readout_paged(pool: Tensor, ids: Tensor, q: Tensor, w: Tensor) -> Tensor:
    """Σ_n w[b, n, h]·pool[ids[b, n, h], h]ᵀ q[b, h]: pool ``(NB, H, K, V)``, ids ``(B, n, H)``,
    q ``(B, H, K)``, w ``(B, n, H)`` → ``(B, H, V)``."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= pool.shape[0]):
        raise IndexError("readout_paged: a block id is outside the pool")
    H = pool.shape[1]
    S = pool[ids, torch.arange(H, device=ids.device)]  # (B, n, H, K, V)
    return torch.einsum("bnh,bhk,bnhkv->bhv", w, q, S)


def readout_picks(S: Tensor, q: Tensor, idx: Tensor, w: Tensor) -> Tensor:
    """Σ_j w[b, t, h, j]·S[b, idx[b, t, h, j], h]ᵀ q[b, t, h]: S ``(B, N, H, K, V)``, q ``(B,
    L, H, K)``, idx ``(B, L, H, k)``, w ``(B, L, H, k)`` → ``(B, L, H, V)``. One embedding bag
    per (row, token, head) sums the rows of its picked states weighted by w·q, so no (L, k, K,
    V) gather is materialised."""
    B, N, H, K, V = S.shape
    L, k = q.shape[1], idx.shape[-1]
    b = torch.arange(B, device=q.device)[:, None, None, None]
    h = torch.arange(H, device=q.device)[None, None, :, None]
    base = ((b * N + idx) * H + h) * K  # (B, L, H, k) first row of each picked state
    rows = base[..., None] + torch.arange(K, device=q.device)  # (B, L, H, k, K)
    wts = w[..., None] * q[:, :, :, None, :]  # (B, L, H, k, K)
    y = F.embedding_bag(rows.reshape(B * L * H, k * K), S.reshape(-1, V), mode="sum",
                        per_sample_weights=wts.reshape(B * L * H, k * K))
    return y.view(B, L, H, V)


def topk_later(r: Tensor, k: int) -> Tensor:
    """Indices of the k largest entries of each row of r ``(R, N)``, largest first, the later
    index first among equal values (a stable sort of the reversed row) → ``(R, k)`` int64."""
    N = r.shape[-1]
    if not 1 <= k <= N:
        raise ValueError(f"topk_later: k must be in [1, N], got k={k}, N={N}")
    order = torch.sort(r.flip(-1), dim=-1, descending=True, stable=True).indices[..., :k]
    return N - 1 - order


def select_softmax(r: Tensor, visible: Tensor, r_on: Tensor, k: int
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """r ``(R, N)`` with entries n >= visible[row] taken as -inf: each row's ``topk_later``
    picks, and the softmax over [their scores, r_on] → idx ``(R, k)``, w ``(R, k)``, w_on
    ``(R,)``."""
    N = r.shape[-1]
    hidden = torch.arange(N, device=r.device)[None, :] >= visible[:, None]
    masked = r.masked_fill(hidden, float("-inf"))
    idx = topk_later(masked, k)
    gamma = torch.softmax(torch.cat([masked.gather(-1, idx), r_on[:, None]], -1), -1)
    return idx, gamma[:, :-1], gamma[:, -1]


def dense_softmax_(r: Tensor, visible: Tensor, r_on: Tensor) -> Tensor:
    """r ``(R, N)`` in place: the softmax over [its first visible[row] scores, r_on[row]] per
    row, zero past the visible ones; returns r_on's weights ``(R,)``."""
    N = r.shape[-1]
    hidden = torch.arange(N, device=r.device)[None, :] >= visible[:, None]
    gamma = torch.softmax(torch.cat([r.masked_fill(hidden, float("-inf")), r_on[:, None]], -1),
                          -1)
    r.copy_(gamma[:, :-1])
    return gamma[:, -1]


def conv_span(tail: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None,
              silu: bool = False) -> Tensor:
    """Depthwise causal conv of a span, then SiLU when ``silu``: tail ``(B, W-1, C)``, x ``(B, T,
    C)``, weight ``(C, W)`` → out[t] = bias + Σ_j w[:, j]·[tail; x][t + j] ``(B, T, C)``, as W
    shifted multiply-adds (tap j reads x shifted by s = W - 1 - j, and the tail for t < s)."""
    T, W = x.shape[1], weight.shape[1]
    # the taps as contiguous rows (a strided column of w broadcast over (B, T, C) takes torch's
    # slow elementwise path, 5-10x slower at C = 768), each added in one fused pass
    wt = weight.t().contiguous()  # (W, C)
    out = x * wt[W - 1]
    if bias is not None:
        out += bias
    for j in range(W - 1):
        s = W - 1 - j
        if s < T:
            out[:, s:].addcmul_(x[:, :T - s], wt[j])
        m = min(s, T)
        out[:, :m].addcmul_(tail[:, j:j + m], wt[j])
    return F.silu(out, inplace=True) if silu else out


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) · up, a new contiguous tensor."""
    return F.silu(gate) * up


def l2norm_(x: Tensor, group: int) -> Tensor:
    """x ``(R, D)`` in place: each group of ``group`` columns over its L2 norm (F.normalize)."""
    R, D = x.shape
    x.copy_(F.normalize(x.reshape(R, D // group, group), dim=-1).view(R, D))
    return x


def conv_step_(tail: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None,
               silu: bool) -> Tensor:
    """tail ``(B, W-1, C)``, x ``(B, C)``, weight ``(C, W)`` → act(conv) ``(B, C)``; the tail
    drops its oldest input and takes x, in place."""
    full = torch.cat([tail, x[:, None]], dim=1)  # (B, W, C)
    out = (full * weight.t()).sum(1)
    if bias is not None:
        out = out + bias
    tail.copy_(full[:, 1:])
    return F.silu(out) if silu else out


def rms_norm(x: Tensor, weight: Tensor | None, eps: float, group: int, z: Tensor | None,
             norm_before_gate: bool) -> Tensor:
    """RMSNorm of x ``(R, D)`` over groups of ``group`` channels, times weight (D or group
    entries); gated by silu(z) before the norm, or after it when ``norm_before_gate``."""
    R, D = x.shape
    h = x * F.silu(z) if z is not None and not norm_before_gate else x
    y = F.rms_norm(h.reshape(R, D // group, group), (group,), eps=eps).reshape(R, D)
    if weight is not None:
        y = y * (weight if weight.numel() == D else weight.repeat(D // group))
    if z is not None and norm_before_gate:
        y = y * F.silu(z)
    return y


def mc_scores_(seg_ksum: Tensor, k: Tensor, u: Tensor, seg_len: Tensor, ksum_pool: Tensor,
               table: Tensor, segment_len: int) -> Tensor:
    """MC routing scores ``(B, N + 1, H)`` of one token; ``seg_ksum (B, H, K) += k`` in place.

    r[:, n] = ⟨u, ksum_pool[table[:, n]]⟩ / (C·√K), −inf where ``table < 0``;
    r[:, N] = ⟨u, seg_ksum / (seg_len + 1)⟩ / √K (the online segment's mean key).
    """
    if table.numel() and int(table.max()) >= ksum_pool.shape[0]:
        raise IndexError("mc_scores_: a block id is outside the pool")
    K = k.shape[-1]
    seg_ksum.add_(k)
    r_on = (u * seg_ksum).sum(-1) / (seg_len.to(u.dtype)[:, None] + 1) / math.sqrt(K)  # (B, H)
    r_c = (ksum_pool[table.clamp_min(0)] * u[:, None]).sum(-1) / (segment_len * math.sqrt(K))
    r_c = r_c.masked_fill((table < 0)[..., None], float("-inf"))  # (B, N, H)
    return torch.cat([r_c, r_on[:, None]], dim=1)


def mc_step_readout_(S: Tensor, q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None,
                     b: Tensor | None, w_on: Tensor, pool: Tensor, ids: Tensor,
                     w_c: Tensor) -> Tensor:
    """``linear_step_`` then y = w_on·o + Σ_n w_c[b, n, h]·pool[ids[b, n, h], h]ᵀq ``(B, H, V)``."""
    o = linear_step_(S, q, k, v, log_a, b) * w_on[..., None]
    if ids.shape[1]:
        o = o + readout_paged(pool, ids, q, w_c)
    return o


def mask_logits_(logits: Tensor, rows: Tensor, bitmask: Tensor) -> Tensor:
    """Row ``rows[j]`` of ``logits`` (B, V) keeps token t's logit where bit ``t % 32`` of int32
    word ``bitmask[j, t // 32]`` is set, else -inf (tokens past ``32 * W`` too); in place."""
    v = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).reshape(bitmask.shape[0], -1).bool()
    if allowed.shape[1] < v:
        allowed = F.pad(allowed, (0, v - allowed.shape[1]), value=False)
    logits[rows] = logits[rows].masked_fill(~allowed[:, :v], -math.inf)
    return logits
