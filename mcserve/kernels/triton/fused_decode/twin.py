"""Torch twin of the fused per-layer decode of the gated linear memory (native mixer, Mamba2
mixer), written op by op after the mixers' own decode path."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mcserve.kernels.triton.common import check_fused_args, rows_views
from mcserve.kernels.triton.mc_decode.twin import paged_mc_decode_linear_torch


def fused_linear_decode_torch(
    x: Tensor, z: Tensor | None, S: Tensor, *, q_offset: int, k_offset: int, v_offset: int,
    qk_heads: int = 1, conv_tail: Tensor | None = None, conv_weight: Tensor | None = None,
    conv_bias: Tensor | None = None, normalize_qk: bool = False, u: Tensor | None = None,
    gate_mode: str = "given", log_a: Tensor | None = None, b: Tensor | None = None,
    decay_scale: float = 1.0, dt: Tensor | None = None, dt_bias: Tensor | None = None,
    A_log: Tensor | None = None, dt_min: float = 0.0, dt_max: float = math.inf,
    dt_scale: float = 1.0, D: Tensor | None = None, norm_weight: Tensor | None = None,
    norm_eps: float = 1e-6, norm_group: int | None = None, norm_before_gate: bool = False,
    variant: str = "none", segment_len: int = 1, top_k: int = 2,
    seg_ksum: Tensor | None = None, seg_len: Tensor | None = None, n_seg: Tensor | None = None,
    table: Tensor | None = None, state_table: Tensor | None = None,
    pool_S: Tensor | None = None, ksum_pool: Tensor | None = None, csum: Tensor | None = None,
    row_top_k: Tensor | None = None, out: Tensor | None = None,
    state_rows: Tensor | None = None,
) -> Tensor:
    """One decode token per row through a gated-linear-memory mixer, from its projections to
    the gated, normalised output (what ``o_proj`` / ``out_proj`` reads).

    ``state_rows`` ``(B,)``: S, conv_tail, seg_ksum and csum are pools whose row
    ``state_rows[b]`` is row b's (read and updated there: the engine's slot pool, no gather
    into a batch); rows may repeat only where their results are discarded (padding).

    x ``(B, CC)``: the token's conv-input channels (pre-conv): v of head h at channels
    ``v_offset + h·V``, q and k of q/k group g (``qk_heads`` heads share one: Mamba2's B/C) at
    ``q_offset + g·K`` / ``k_offset + g·K``; the three ranges tile ``[0, CC)``. Steps:

    1. conv (when ``conv_tail (B, W-1, CC)``, ``conv_weight (CC, W)``, ``conv_bias`` are
       given): depthwise causal conv over the tail and x, + bias, SiLU; the tail drops its
       oldest input and takes x, in place. Without a conv x is used as is;
    2. q, k L2-normalised per head (``normalize_qk``: x / max(‖x‖, 1e-12)); u = ``u (B, H, K)``
       or q;
    3. gates ``(B, H)``: ``given`` (log_a, b as passed, None = 1), ``sigmoid`` (log_a =
       ``decay_scale``·logsigmoid(log_a), b = sigmoid(b): the native model), ``softplus``
       (Δ = clamp(softplus(dt + dt_bias), dt_min, dt_max)·dt_scale, log_a = −Δ·exp(A_log),
       b = Δ: Mamba2);
    4. S ``(B, H, K, V)`` ← a·S + b·k vᵀ in place, o = Sᵀq; MC by ``variant``: ``none`` y = o;
       ``residual``/``post`` (collapsed): y = w·(o + csumᵀq), w = 1 or 1/(n_seg + 1), csum
       ``(B, H, K, V)`` the sum of the cached states (None: none cached); ``grm``/``soup``/
       ``ssc``: y = ``paged_mc_decode_linear_torch(q, u, o, p_on, table, …)`` with p_on =
       (seg_ksum + k)/(seg_len + 1). Every variant but ``none`` advances ``seg_ksum += k`` in
       place (seg_len and pushes stay with the caller);
    5. y += D·v (``D`` ``(H,)`` or ``(H·V,)``);
    6. output gate and norm over groups of ``norm_group`` channels (default V: per head):
       without ``norm_weight`` y·silu(z); with it, RMSNorm(y)·w·silu(z) when
       ``norm_before_gate`` (the native model), else RMSNorm(y·silu(z))·w (Mamba2);
       ``norm_weight`` ``(norm_group,)`` (repeated over groups) or ``(H·V,)``; z None: no gate.

    Returns y ``(B, H·V)`` in x's dtype (written into ``out`` when given); computed in float32
    at least.
    """
    if state_rows is not None:  # gather the rows, step them, write them back
        rows_views(x.shape[0], state_rows, S=S, conv_tail=conv_tail, seg_ksum=seg_ksum,
                   csum=csum)
        pools = {"S": S, "conv_tail": conv_tail, "seg_ksum": seg_ksum}
        got = {n: None if t is None else t[state_rows] for n, t in pools.items()}
        y = fused_linear_decode_torch(
            x, z, got["S"], q_offset=q_offset, k_offset=k_offset, v_offset=v_offset,
            qk_heads=qk_heads, conv_tail=got["conv_tail"], conv_weight=conv_weight,
            conv_bias=conv_bias, normalize_qk=normalize_qk, u=u, gate_mode=gate_mode,
            log_a=log_a, b=b, decay_scale=decay_scale, dt=dt, dt_bias=dt_bias, A_log=A_log,
            dt_min=dt_min, dt_max=dt_max, dt_scale=dt_scale, D=D, norm_weight=norm_weight,
            norm_eps=norm_eps, norm_group=norm_group, norm_before_gate=norm_before_gate,
            variant=variant, segment_len=segment_len, top_k=top_k, seg_ksum=got["seg_ksum"],
            seg_len=seg_len, n_seg=n_seg, table=table, state_table=state_table, pool_S=pool_S,
            ksum_pool=ksum_pool, csum=None if csum is None else csum[state_rows],
            row_top_k=row_top_k, out=out)
        for n, t in pools.items():
            if t is not None:
                t.index_copy_(0, state_rows, got[n])
        return y
    dims = check_fused_args(
        x, z, S, q_offset=q_offset, k_offset=k_offset, v_offset=v_offset, qk_heads=qk_heads,
        conv_tail=conv_tail, conv_weight=conv_weight, conv_bias=conv_bias, u=u,
        gate_mode=gate_mode, log_a=log_a, b=b, dt=dt, dt_bias=dt_bias, A_log=A_log, D=D,
        norm_weight=norm_weight, norm_group=norm_group, variant=variant,
        segment_len=segment_len, top_k=top_k, seg_ksum=seg_ksum, seg_len=seg_len, n_seg=n_seg,
        table=table, state_table=state_table, pool_S=pool_S, ksum_pool=ksum_pool, csum=csum,
        row_top_k=row_top_k)
    B, H, K, V, G, GS = (dims[n] for n in ("B", "H", "K", "V", "G", "GS"))
    dt_ = torch.promote_types(x.dtype, torch.float32)
    up = lambda t: None if t is None else t.to(dt_)  # noqa: E731
    xa = up(x)
    if conv_tail is not None:
        full = torch.cat([up(conv_tail), xa[:, None]], dim=1)  # (B, W, CC)
        xa = (full * up(conv_weight).t()).sum(1)
        if conv_bias is not None:
            xa = xa + up(conv_bias)
        xa = torch.nn.functional.silu(xa)
        conv_tail.copy_(full[:, 1:].to(conv_tail.dtype))
    rep = H // G
    q = xa[:, q_offset:q_offset + G * K].reshape(B, G, K).repeat_interleave(rep, 1)  # (B,H,K)
    k = xa[:, k_offset:k_offset + G * K].reshape(B, G, K).repeat_interleave(rep, 1)
    v = xa[:, v_offset:v_offset + H * V].reshape(B, H, V)
    if normalize_qk:
        q = torch.nn.functional.normalize(q, dim=-1)
        k = torch.nn.functional.normalize(k, dim=-1)
    uu = q if u is None else up(u)
    la_, b_ = up(log_a), up(b)
    if gate_mode == "sigmoid":
        la_ = None if la_ is None else torch.nn.functional.logsigmoid(la_) * decay_scale
        b_ = None if b_ is None else torch.sigmoid(b_)
    elif gate_mode == "softplus":
        delta = torch.nn.functional.softplus(up(dt) + up(dt_bias)).clamp(dt_min, dt_max)
        delta = delta * dt_scale
        la_, b_ = -delta * torch.exp(up(A_log)), delta
    # the online step, in place
    Sw = up(S)
    if la_ is not None:
        Sw = Sw * la_.exp()[..., None, None]
    kb = k if b_ is None else k * b_[..., None]
    Sw = Sw + kb[..., :, None] * v[..., None, :]  # (B, H, K, V)
    S.copy_(Sw.to(S.dtype))
    o = torch.einsum("bhk,bhkv->bhv", q, Sw)
    if variant == "none":
        y = o
    else:
        cum = up(seg_ksum) + k
        seg_ksum.copy_(cum.to(seg_ksum.dtype))
        if variant in ("residual", "post"):
            y = o if csum is None else o + torch.einsum("bhk,bhkv->bhv", q, up(csum))
            if variant == "post":
                y = y / (n_seg.to(dt_) + 1.0)[:, None, None]
        else:
            p_on = cum / (seg_len.to(dt_) + 1.0)[:, None, None]
            y = paged_mc_decode_linear_torch(q, uu, o, p_on, table, pool_S, ksum_pool,
                                             variant=variant, segment_len=segment_len,
                                             top_k=top_k, state_table=state_table,
                                             row_top_k=row_top_k)
    if D is not None:
        y = y + v * (up(D).view(H, V) if D.numel() == H * V else up(D)[:, None])
    y = y.reshape(B, H * V)
    zz = None if z is None else torch.nn.functional.silu(up(z))
    if norm_weight is None:
        if zz is not None:
            y = y * zz
    else:
        if zz is not None and not norm_before_gate:
            y = y * zz
        y = torch.nn.functional.rms_norm(y.view(B, -1, GS), (GS,), eps=norm_eps).view(B, -1)
        w = up(norm_weight)
        y = y * (w if w.numel() == H * V else w.repeat(H * V // GS))
        if zz is not None and norm_before_gate:
            y = y * zz
    y = y.to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out
