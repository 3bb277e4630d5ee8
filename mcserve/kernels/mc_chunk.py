"""Memory Caching over a whole prefill chunk of the gated linear memory, in one pass.

``mc_linear_chunk`` takes a span of T tokens that may cross any number of segment boundaries
(constant segmentation, docs/mc.md) and computes, without a loop over tokens and with a
constant number of large tensor ops:

* the online term of every token: one chunked scan of all segments at once (the span is padded
  at the front to a segment boundary and folded to ``(B·n_seg, C, H, ·)``, each segment scanned
  from zero), plus each segment's start state read out with its decay;
* the state at every segment boundary (the checkpoints): a short scan over segments,
  S_end(g) = A_g·S_start(g) + D_g, where D_g is the segment's own contribution;
* the cached-memory term: scores of every token against every earlier checkpoint (the carried
  ones and those completed inside the span, causally masked), one softmax (or top-k for ``ssc``),
  and one weighted readout as batched matmuls, blockwise over checkpoints so memory stays bounded.

``mc_linear_chunk_naive`` is its per-token twin with the same signature (the test oracle beside
``mcserve.kernels.reference.mc_linear``). Both take the layer's ``MCConfig`` (its constant
segmentation, mode and variant capabilities) and follow the flash-linear-attention convention:
the running state goes in as ``initial_state`` and comes back as ``final_state``.

The gates are ``log_a`` (log of the decay a ∈ (0, 1], ≤ 0) and ``b`` (write gate); None means
all ones. Every constant-segmentation variant applies (``grm`` and ``soup`` are equal on this
family). For the fixed-weight variants (``residual``, ``post``) the cached memories enter as
their running sum (one state), since on a linear memory Σ_i M⁽ⁱ⁾(q) = (Σ_i S_i)ᵀq.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mcserve.config import MCConfig
from mcserve.kernels import cpu as cpu_ops
from mcserve.kernels import dispatch
from mcserve.kernels.gla import chunk_gla_ends, naive_gla

_TOKEN_TILE = 256  # tokens per GEMM in the cached readout
# checkpoints per GEMM: the CPU's weighted operand X (tile, block·K) stays cache-sized at
# K = 64 (2K-8K prefill 35-40% faster than the read-then-weight form on a Zen 4 core)
_X_BLOCK = 16
# the X-buffer form's sizes for bfloat16 operands on a CPU with AMX tiles, where oneDNN's AMX
# GEMM gains from larger products (the readout's own AMX pass takes K and V it cannot)
_AMX_TOKEN_TILE, _AMX_X_BLOCK = 512, 32
_READ_BLOCK = 32  # checkpoints per GEMM of the read-then-weight form
_SCORE_TILE = 2048  # tokens per scores product of the CPU's ssc picks
# on a GPU the small CPU tiles make thousands of launches per chunk that each run for
# microseconds: tiles there are as large as a temporary of this many bytes allows
_GPU_TILE_BYTES = 256 * 2**20
_GPU_TOKEN_TILE = 2048


def _x_tiles(low: bool) -> tuple[int, int]:
    """Tokens and checkpoints per GEMM of the CPU's X = [w_n·q_t] readout: larger with
    bfloat16 operands where AMX multiplies them."""
    if low and bool(cpu_ops.lowp_info().get("amx_bf16", False)):
        return _AMX_TOKEN_TILE, _AMX_X_BLOCK
    return _TOKEN_TILE, _X_BLOCK


def _big_tiles(x: Tensor) -> bool:
    """The GPU tiling for ``x``'s device (a function, so a test can take it on the CPU)."""
    return not x.is_cpu
# ssc reads only its picks (on the CPU the C++ pool readout, elsewhere an embedding bag) instead
# of the dense readout once there are this many times more checkpoints than picks: the dense
# form reads every checkpoint for every token, the picks top_k of them (on the CPU a 2K ssc8
# chunk is 17% faster at 2 than at 4; not measured on a GPU)
SPARSE_FACTOR = 2


def _check(q: Tensor, k: Tensor, v: Tensor, u: Tensor, initial_state: Tensor,
           initial_ksum: Tensor, initial_fill: int, cached: Tensor, cached_ksum: Tensor,
           mc: MCConfig, top_k: int | None) -> None:
    if not isinstance(mc, MCConfig) or not mc.caches_blocks:
        raise ValueError(f"mc must be an MCConfig with constant segmentation, got {mc!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    segment_len = mc.segment_len
    if not 0 <= initial_fill < segment_len:
        raise ValueError(f"initial_fill must lie in [0, segment_len={segment_len}), "
                         f"got {initial_fill}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or u.shape != q.shape or v.shape[:3] != (B, T, H):
        raise ValueError("q, k, u must be (B, T, H, K) and v (B, T, H, V)")
    if initial_state.shape != (B, H, K, V):
        raise ValueError(f"initial_state must be {(B, H, K, V)}, got {tuple(initial_state.shape)}")
    if initial_ksum.shape != (B, H, K):
        raise ValueError(f"initial_ksum must be {(B, H, K)}, got {tuple(initial_ksum.shape)}")
    if cached.dim() != 5 or cached.shape[0] != B or cached.shape[2:] != (H, K, V):
        raise ValueError(f"cached must be (B, N, H, K, V), got {tuple(cached.shape)}")
    if cached_ksum.shape != cached.shape[:2] + (H, K):
        raise ValueError(f"cached_ksum must be (B, N, H, K), got {tuple(cached_ksum.shape)}")
    if mc.fixed_weights and cached.shape[1] > 1:
        raise ValueError("residual/post take the cached memories as one summed state (N <= 1)")


def _select(r: Tensor, top_k: int) -> Tensor:
    """Indices of the top_k scores along the last dim of ``r`` (B, L, H, N), ties to the later
    one; ``(B, L, H, top_k)``.

    On the CPU one C++ pass per row (``cpu_ops.topk_later``). Elsewhere a partial selection
    (``topk``), several times cheaper than sorting every row; its choice among equal scores is
    unspecified, so where a finite score ties at a row's threshold the stable sort decides
    (``topk_later``'s twin). Ties among -inf scores (checkpoints a token cannot see) need no
    rule: whichever is picked gets weight zero."""
    N = r.shape[-1]
    if r.is_cpu:
        return cpu_ops.topk_later(r.reshape(-1, N), top_k).view(r.shape[:-1] + (top_k,))
    return _select_partial(r, top_k)


def _select_partial(r: Tensor, top_k: int) -> Tensor:
    """``_select`` off the CPU (``topk``, the stable sort only on finite ties)."""
    vals, idx = torch.topk(r, top_k, dim=-1, sorted=False)
    thresh = vals.amin(-1, keepdim=True)
    tied = ((r >= thresh).sum(-1, keepdim=True) > top_k) & (thresh > float("-inf"))
    if bool(tied.any()):
        return cpu_ops.twins.topk_later(r, top_k)
    return idx


def _readout_blocks(S: Tensor, q: Tensor, w: Tensor, n_carried: int, segment_len: int,
                    dtype: torch.dtype | None = None) -> Tensor:
    """Σ_n w[:, t, :, n] S_nᵀ q_t. S ``(B, N, H, K, V)``, q ``(B, L, H, K)``, w ``(B, L, H, N)``
    where token t (of the padded, segment-aligned span) sees checkpoints n < n_carried +
    t // segment_len (w is zero beyond). ``dtype`` bfloat16 (on the CPU): the GEMMs read the
    weighted queries and the checkpoints rounded to bfloat16 and each block's product is added
    into the float32 result (``mc_linear_chunk``'s ``readout_dtype``); None: float32 throughout.

    Tiled over tokens and checkpoints; checkpoints a whole tile cannot see are skipped. On the
    CPU the weights go into the GEMM's left operand: per tile and block of checkpoints,
    X = [w_n·q_t]_n ``(L_tile, n·K)`` and one ``X @ [S_n]_n`` ``(n·K, V)`` accumulates straight
    into the output, with X in one reused cache-sized buffer. Reading every checkpoint first
    (``(L_tile, n, V)``) and weighting after costs a second pass over a large temporary and ran
    at half the GEMM's rate (``_readout_reads``, the form GPUs take).
    """
    if _big_tiles(q) or (torch.is_grad_enabled()
                         and (S.requires_grad or q.requires_grad or w.requires_grad)):
        # GPUs; training (the in-place accumulation into a reused buffer has no backward)
        return _readout_reads(S, q, w, n_carried, segment_len)
    B, L, H, K = q.shape
    N, V = S.shape[1], S.shape[-1]
    low = dtype is not None and dtype != q.dtype
    # (BH, N·K, V) checkpoint-major (one copy, rounded to ``dtype`` on the way)
    Sx = torch.empty((B, H, N, K, V), dtype=dtype if low else q.dtype, device=q.device)
    Sx.copy_(S.permute(0, 2, 1, 3, 4))
    Sx = Sx.view(B * H, N * K, V)
    qh = q.permute(0, 2, 1, 3).reshape(B * H, L, K)  # (BH, L, K)
    wh = w.permute(0, 2, 1, 3).reshape(B * H, L, N)  # (BH, L, N)
    out = q.new_zeros(B * H, L, V)
    tile, block = _x_tiles(low)
    buf = torch.empty(B * H * min(L, tile) * min(N, block) * K, dtype=Sx.dtype, device=q.device)
    for t0 in range(0, L, tile):
        t1 = min(L, t0 + tile)
        n_vis = min(N, n_carried + (t1 - 1) // segment_len)
        o = out[:, t0:t1]
        for n0 in range(0, n_vis, block):
            n1 = min(n_vis, n0 + block)
            # (BH, tile, n, K) = w_n · q_t, contiguous (a prefix of the buffer): the product
            # writes it in one pass and the GEMM reads it as (BH, tile, n·K) without a copy
            X = buf[:B * H * (t1 - t0) * (n1 - n0) * K].view(B * H, t1 - t0, n1 - n0, K)
            if low:  # X and the block's product in ``dtype`` (float32 sums inside the GEMM)
                cpu_ops.outer_bf16_(X, wh[:, t0:t1, n0:n1], qh[:, t0:t1])
                o.add_(torch.bmm(X.view(B * H, t1 - t0, -1), Sx[:, n0 * K:n1 * K]))
            else:
                torch.mul(wh[:, t0:t1, n0:n1, None], qh[:, t0:t1, None, :], out=X)
                o.baddbmm_(X.view(B * H, t1 - t0, -1), Sx[:, n0 * K:n1 * K])
    return out.view(B, H, L, V).transpose(1, 2)


def _readout_reads(S: Tensor, q: Tensor, w: Tensor, n_carried: int, segment_len: int
                   ) -> Tensor:
    """``_readout_blocks`` by reading every checkpoint of a tile for every token,
    ``(L_tile, K) @ (K, n·V)`` with the states laid out key-major once per call, then one
    batched weighted sum over the tile's checkpoints. On a GPU the tiles are as large as
    ``_GPU_TILE_BYTES`` allows (few launches)."""
    B, L, H, K = q.shape
    N, V = S.shape[1], S.shape[-1]
    Sk = S.permute(0, 2, 3, 1, 4).contiguous()  # (B, H, K, N, V)
    qh = q.transpose(1, 2)  # (B, H, L, K)
    wh = w.transpose(1, 2)  # (B, H, L, N)
    out = q.new_zeros(B, H, L, V)
    tile, block = _TOKEN_TILE, _READ_BLOCK
    if _big_tiles(q):  # (B, H, tile, block, V) reads per GEMM within the byte budget
        tile = min(L, _GPU_TOKEN_TILE)
        block = max(1, _GPU_TILE_BYTES // (B * H * tile * V * q.element_size()))
    for t0 in range(0, L, tile):
        t1 = min(L, t0 + tile)
        n_vis = min(N, n_carried + (t1 - 1) // segment_len)
        acc = None
        for n0 in range(0, n_vis, block):
            n1 = min(n_vis, n0 + block)
            reads = torch.matmul(qh[:, :, t0:t1], Sk[:, :, :, n0:n1].reshape(B, H, K, -1))
            reads = reads.view(B, H, t1 - t0, n1 - n0, V)  # S_nᵀ q_t for the tile
            part = torch.matmul(wh[:, :, t0:t1, None, n0:n1], reads)[:, :, :, 0]
            acc = part if acc is None else acc.add_(part)
        if acc is not None:
            out[:, :, t0:t1] = acc
    return out.transpose(1, 2)


def _readout_picks(S: Tensor, q: Tensor, idx: Tensor, w: Tensor) -> Tensor:
    """Σ_j w[:, t, :, j] S_{idx[:, t, :, j]}ᵀ q_t per head, reading only the picked checkpoints:
    S ``(B, N, H, K, V)`` contiguous, q ``(B, L, H, K)``, idx ``(B, L, H, k)`` checkpoint
    indices, w ``(B, L, H, k)`` their weights. On the CPU in C++, each picked state read once
    per tile of tokens (``kernels.cpu.readout_picks``); elsewhere its twin, one embedding bag
    per (row, token, head), so no (L, k, K, V) gather is materialised."""
    return cpu_ops.readout_picks(S, q, idx, w)


def _scores(u: Tensor, ksum: Tensor, n_carried: int, segment_len: int) -> Tensor:
    """r[b, t, h, n] = u_t·ksum_n / (C·√K) for the checkpoints token t sees (n < n_carried +
    t // C), -inf for the rest: u ``(B, L, H, K)`` over the padded, segment-aligned span, ksum
    ``(B, N, H, K)``. Checkpoints last: the selection and softmax dim."""
    L, K, N = u.shape[1], u.shape[-1], ksum.shape[1]
    r = torch.einsum("blhk,bnhk->blhn", u * (1.0 / (segment_len * math.sqrt(K))), ksum)
    seg = torch.arange(L, device=u.device) // segment_len
    hidden = torch.arange(N, device=u.device)[None, :] >= (n_carried + seg)[:, None]  # (L, N)
    return r.masked_fill_(hidden[None, :, None, :], float("-inf"))


def _weighted_readout(S: Tensor, q: Tensor, w: Tensor, n_carried: int, segment_len: int,
                      dtype: torch.dtype | None) -> Tensor:
    """Σ_n w[:, t, :, n] S_nᵀ q_t (``_readout_blocks``' contract) on the device's form: the fused
    Triton readout where it runs and nothing needs a backward, ``_readout_blocks`` elsewhere."""
    if dispatch.get_backend(q) == "triton" and not (torch.is_grad_enabled() and (
            q.requires_grad or S.requires_grad or w.requires_grad)):  # fused, no backward
        # one pass, no (tokens, checkpoints, V) temporaries
        from mcserve.kernels.triton.readout import mc_chunk_readout

        return mc_chunk_readout(S, q, w, n_carried, segment_len)
    return _readout_blocks(S, q, w, n_carried, segment_len, dtype)


def _readout_dense_unfused(S: tuple[Tensor, ...], q: Tensor, u: Tensor, ksum: Tensor,
                           r_on: Tensor, o: Tensor, n_carried: int, segment_len: int,
                           dtype: torch.dtype | None = None) -> Tensor:
    """Every token's MC output over all the checkpoints it sees: y_t = γ_on·o_t + Σ_n γ_n S_nᵀ
    q_t, γ = softmax over [r_t,n (``_scores``), r_on_t]. S the checkpoint states ``(B, N_i, H, K,
    V)`` in parts, concatenated along dim 1 in order; ksum their key sums ``(B, N, H, K)``; q, u
    ``(B, L, H, K)``, r_on ``(B, L, H)`` and o (the online term) ``(B, L, H, V)`` over the padded,
    segment-aligned span; ``dtype`` as in ``_readout_blocks``. The scores and weights of the
    whole span as tensors, then one weighted readout (GPUs, training; the twin of
    ``_readout_dense``)."""
    r_c = _scores(u, ksum, n_carried, segment_len)
    gamma = torch.softmax(torch.cat([r_c, r_on[..., None]], -1), -1)
    y = o * gamma[..., -1:]
    return y + _weighted_readout(torch.cat(S, 1), q, gamma[..., :-1], n_carried, segment_len,
                                 dtype)


def _readout_dense(S: tuple[Tensor, ...], q: Tensor, u: Tensor, ksum: Tensor, r_on: Tensor,
                   o: Tensor, n_carried: int, segment_len: int,
                   dtype: torch.dtype | None = None) -> Tensor:
    """``_readout_dense_unfused`` tile by tile on the CPU: for each tile of tokens the scores
    against the checkpoints the tile sees, their softmax with the online score and the weighted
    readout (``_readout_blocks``' X = [w_n·q_t]_n GEMMs), so no ``(L, H, N)`` score or weight
    tensor is ever whole (at 8K tokens and 128 checkpoints each is 16 MiB per head, and the
    unfused form passes over five of them). The checkpoints are laid out head-major once,
    straight from their parts (rounded to ``dtype`` on the way). bfloat16 on a CPU with AMX
    tiles: each tile's weighted readout is one C++ pass (``kernels.cpu.readout_bf16_``: the
    weights times the checkpoints 32 at a time, then the queries, in float32), with no X buffer
    and float32 sums throughout."""
    B, L, H, K = q.shape
    V = S[0].shape[-1]
    N = sum(s.shape[1] for s in S)
    low = dtype is not None and dtype != q.dtype
    # bfloat16 on AMX tiles: one C++ pass per tile
    fused = low and dtype == torch.bfloat16 and cpu_ops.readout_bf16_fused(K, V)
    BH = B * H
    if fused:  # checkpoint pairs in groups of 16 columns, converted in one pass per part
        P = ((N + 1) // 2 + 15) // 16 * 16  # pairs, a whole number of the kernel's steps
        Sx = torch.empty((B, H, K * V // 16, P, 16, 2), dtype=dtype, device=q.device)
        n = 0
        for part in S + ((q.new_zeros(B, 2 * P - N, H, K, V),) if 2 * P > N else ()):
            cpu_ops.ckpt_pairs_bf16_(Sx, part, n)
            n += part.shape[1]
    else:
        Sx = torch.empty((B, H, N, K, V), dtype=dtype if low else q.dtype, device=q.device)
        n = 0
        for part in S:
            Sx[:, :, n:n + part.shape[1]].copy_(part.permute(0, 2, 1, 3, 4))
            n += part.shape[1]
    Sx = Sx.view(BH, K * V // 16, -1, 16, 2) if fused else Sx.view(BH, N * K, V)
    heads = lambda x: x.permute(0, 2, 1, 3).reshape(BH, x.shape[1], x.shape[3])  # noqa: E731
    qh, oh = heads(q), heads(o)  # (BH, L, K), (BH, L, V)
    uh = heads(u)
    kh = heads(ksum).mul_(1.0 / (segment_len * math.sqrt(K)))  # (BH, N, K), the scale folded in
    ron = r_on.permute(0, 2, 1).reshape(BH, L)
    out = torch.empty(BH, L, V, dtype=q.dtype, device=q.device)
    tile, block = _x_tiles(low)
    buf = torch.empty(0 if fused else BH * min(L, tile) * min(N, block) * K, dtype=Sx.dtype,
                      device=q.device)
    pos = torch.arange(L, device=q.device) // segment_len + n_carried  # checkpoints t sees
    for t0 in range(0, L, tile):
        t1 = min(L, t0 + tile)
        T = t1 - t0
        n_vis = min(N, n_carried + (t1 - 1) // segment_len)
        o_t = out[:, t0:t1]
        if n_vis == 0:  # the tile sees no checkpoint: the online term alone
            o_t.copy_(oh[:, t0:t1])
            continue
        w = torch.bmm(uh[:, t0:t1], kh[:, :n_vis].transpose(1, 2))  # (BH, T, n_vis) scores
        # each token's softmax over the checkpoints it sees and its online score, in place
        w_on = cpu_ops.dense_softmax_(w.view(-1, n_vis), pos[t0:t1].expand(BH, T).reshape(-1),
                                      ron[:, t0:t1].reshape(-1))
        torch.mul(oh[:, t0:t1], w_on.view(BH, T, 1), out=o_t)
        if fused:
            cpu_ops.readout_bf16_(o_t, w, qh[:, t0:t1], Sx)
            continue
        for n0 in range(0, n_vis, block):
            n1 = min(n_vis, n0 + block)
            X = buf[:BH * T * (n1 - n0) * K].view(BH, T, n1 - n0, K)
            if low:
                cpu_ops.outer_bf16_(X, w[:, :, n0:n1], qh[:, t0:t1])
                o_t.add_(torch.bmm(X.view(BH, T, -1), Sx[:, n0 * K:n1 * K]))
            else:
                torch.mul(w[:, :, n0:n1, None], qh[:, t0:t1, None, :], out=X)
                o_t.baddbmm_(X.view(BH, T, -1), Sx[:, n0 * K:n1 * K])
    return out.view(B, H, L, V).transpose(1, 2)


def _selected_readout(S: tuple[Tensor, ...], q: Tensor, u: Tensor, ksum: Tensor, r_on: Tensor,
                      o: Tensor, n_carried: int, segment_len: int, top_k: int,
                      dtype: torch.dtype | None = None) -> Tensor:
    """``_readout_dense_unfused`` over each token's ``top_k`` best-scoring checkpoints only
    (``ssc``; ties to the later one): the picks read in place once there are ``SPARSE_FACTOR``
    times more checkpoints than picks, else a dense readout with zero weights elsewhere. On
    the CPU the sparse form picks and weighs in one C++ pass per row
    (``kernels.cpu.select_softmax``); with ``dtype`` bfloat16 on AMX tiles its readout takes
    bfloat16 operands with float32 sums (``kernels.cpu.readout_picks_bf16``)."""
    sparse = sum(s.shape[1] for s in S) >= SPARSE_FACTOR * top_k and not (
        torch.is_grad_enabled() and q.requires_grad)
    if sparse and q.is_cpu:
        # per tile of tokens the scores unmasked, head-major (B, H, T, N), then one C++ pass per
        # row: the visible picks and their softmax with the online score; no masked or gathered
        # copies. Tiles keep the scores a few MiB (at 8K tokens and 256 checkpoints the whole
        # span's are 32 MiB, which glibc maps and faults in afresh on every call)
        B, L, H, K = q.shape
        N = ksum.shape[1]
        kT = ksum.permute(0, 2, 3, 1)  # (B, H, K, N)
        seen = (torch.arange(L, device=q.device) // segment_len + n_carried).clamp_(max=N)
        uh = u * (1.0 / (segment_len * math.sqrt(K)))
        picks = []
        for t0 in range(0, L, _SCORE_TILE):
            t1 = min(L, t0 + _SCORE_TILE)
            # the checkpoints the tile's last token sees (at least top_k columns: N >= 2·top_k)
            n_vis = min(N, max(top_k, n_carried + (t1 - 1) // segment_len))
            r = torch.matmul(uh[:, t0:t1].transpose(1, 2), kT[..., :n_vis])  # (B, H, T, n_vis)
            got = cpu_ops.select_softmax(
                r.view(-1, n_vis), seen[t0:t1].expand(B, H, t1 - t0).reshape(-1),
                r_on[:, t0:t1].transpose(1, 2).reshape(-1), top_k)
            picks.append([x.view(B, H, t1 - t0, -1) for x in got])
        idx, w, w_on = (torch.cat(parts, 2) if len(parts) > 1 else parts[0]
                        for parts in zip(*picks))  # (B, H, L, top_k | 1)
        y = o * w_on.transpose(1, 2).contiguous()  # (a strided broadcast runs at half speed)
        idx = idx.transpose(1, 2)
        w = w.transpose(1, 2)
        V = o.shape[-1]
        if (dtype == torch.bfloat16 and dtype != q.dtype and K % 32 == 0
                and cpu_ops.readout_bf16_fused(K, V)):
            # bfloat16 operands on AMX tiles: the checkpoints in key pairs, one pass per part
            Sx = torch.empty((B, H, N, K // 2, V, 2), dtype=dtype, device=q.device)
            n = 0
            for part in S:
                cpu_ops.key_pairs_bf16_(Sx, part, n)
                n += part.shape[1]
            return cpu_ops.readout_picks_bf16(Sx, q, idx, w, out=y)
        return y + _readout_picks(torch.cat(S, 1).contiguous(), q, idx, w)
    r_c = _scores(u, ksum, n_carried, segment_len)
    idx = _select(r_c, top_k)  # (B, L, H, top_k)
    gamma = torch.softmax(torch.cat([r_c.gather(-1, idx), r_on[..., None]], -1), -1)
    y = o * gamma[..., -1:]
    Sc = torch.cat(S, 1)
    if sparse:
        return y + _readout_picks(Sc.contiguous(), q, idx, gamma[..., :-1])
    w_c = torch.zeros_like(r_c).scatter(-1, idx, gamma[..., :-1])
    return y + _weighted_readout(Sc, q, w_c, n_carried, segment_len, dtype)


def _online_torch(qf: Tensor, kf: Tensor, vf: Tensor, laf: Tensor | None, bf: Tensor | None,
                  initial_state: Tensor, mc: MCConfig) -> tuple[Tensor, Tensor]:
    """Online readout of every token and the state at the end of every segment, for the
    segment-folded span ``(B, G, C, H, ·)``: the chunked scan with the segments as its chunks
    (``chunk_gla_ends``; in independent mode each segment after the first starts from zero).
    Returns o ``(B, G, C, H, V)`` and S_end ``(B, G, H, K, V)``."""
    B, G, C, H, K = qf.shape
    V = vf.shape[-1]
    flat = lambda x: None if x is None else x.reshape((B, G * C) + x.shape[3:])  # noqa: E731
    o, S_end = chunk_gla_ends(flat(qf), flat(kf), flat(vf), flat(laf), flat(bf), initial_state,
                              C, restart=mc.independent)
    return o.view(B, G, C, H, V), S_end


def mc_linear_chunk(
    q: Tensor, k: Tensor, v: Tensor, u: Tensor, log_a: Tensor | None = None,
    b: Tensor | None = None, *, initial_state: Tensor, initial_ksum: Tensor, initial_fill: int,
    cached: Tensor, cached_ksum: Tensor, n_segments: int, mc: MCConfig, top_k: int | None = None,
    readout_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """MC over the gated linear memory for a span of tokens that may cross many segments.

    q, k, u ``(B, T, H, K)``; v ``(B, T, H, V)``; log_a, b ``(B, T, H)`` or None. The rows sit
    at the same phase: ``initial_fill`` tokens (< segment_len) already in the online segment,
    whose state is ``initial_state`` ``(B, H, K, V)`` and key sum ``initial_ksum`` ``(B, H, K)``;
    ``cached`` ``(B, N, H, K, V)`` / ``cached_ksum`` ``(B, N, H, K)`` the cached checkpoints (all
    full segments), or for the fixed-weight variants their sum (N ≤ 1); ``n_segments`` the
    number of cached segments so far; ``top_k`` a per-request override of ``mc.top_k``;
    ``readout_dtype`` (bfloat16, the CPU's dense cached readout only) the precision of that
    readout's GEMM operands (float32 accumulation; the scores, the selection, the online term and
    every state stay in q's dtype), None for q's dtype.

    Returns ``(y, final_state, boundary_states, boundary_ksums)``: y ``(B, T, H, V)``; the
    state after the last token ``(B, H, K, V)`` (in independent mode not yet restarted when the
    span ends on a boundary); the state and key sum at the end of every segment the span
    completes, oldest first, ``(B, n_b, H, K, V)`` / ``(B, n_b, H, K)``.
    """
    _check(q, k, v, u, initial_state, initial_ksum, initial_fill, cached, cached_ksum, mc, top_k)
    segment_len, top_k = mc.segment_len, top_k or mc.top_k
    B, T, H, K = q.shape
    V = v.shape[-1]
    C, f0 = segment_len, initial_fill
    G = -(-(f0 + T) // C)  # segments the padded span covers (the first holds f0 old tokens)
    n_b = (f0 + T) // C  # of which complete at the span's end
    pad = G * C - f0 - T

    def fold(x: Tensor | None, fill: float = 0.0) -> Tensor | None:
        """(B, T, ...) → (B, G, C, ...): f0 zero rows in front (tokens already consumed: no
        write, no decay), the tail padded to a whole segment."""
        if x is None:
            return None
        if f0 or pad:
            shape = (B, f0) + x.shape[2:]
            tail = (B, pad) + x.shape[2:]
            x = torch.cat([x.new_full(shape, fill), x, x.new_full(tail, fill)], 1)
        return x.reshape((B, G, C) + x.shape[2:])  # a view of an aligned span

    qf, kf, uf = fold(q), fold(k), fold(u)  # (B, G, C, H, K)
    backend = dispatch.get_backend(q)
    if backend == "torch":
        o, S_end = _online_torch(qf, kf, fold(v), fold(log_a), fold(b), initial_state, mc)
    else:  # the prefill kernel (Triton on CUDA): online readout and every boundary state
        o, final, bs, _ = dispatch.chunk_linear_prefill(
            q, k, v, log_a, b, initial_state, segment_len=C, mode=mc.mode,
            initial_seg_len=f0, backend=backend)
        S_end = bs.view(B, n_b, H, K, V)
        if n_b < G:  # the partial last segment ends at the final state
            S_end = torch.cat([S_end, final[:, None]], 1)
        o = torch.cat([o.new_zeros(B, f0, H, V), o, o.new_zeros(B, pad, H, V)], 1)
        o = o.view(B, G, C, H, V)
    # ---- online scores: the mean key of the online segment so far, token t included
    # the running key sums of every segment as one product with a lower-triangular ones matrix
    # (on the CPU a cumsum along the segment's dim, not the last one, is the slower pass)
    tri = torch.ones(C, C, dtype=kf.dtype, device=kf.device).tril_()
    kc = torch.matmul(tri, kf.reshape(B * G, C, H * K)).view(B, G, C, H, K)
    kc[:, 0] += initial_ksum[:, None]
    seg_ksum = kc[:, :, -1]  # (B, G, H, K) key sum of each (padded) segment
    if mc.fixed_weights:
        # collapsed: the cached memories are one running sum; segment g adds g new checkpoints
        csum0 = cached.sum(1) if cached.shape[1] else torch.zeros_like(initial_state)
        prev = torch.cat([torch.zeros_like(S_end[:, :1]), S_end[:, :-1]], 1).cumsum(1)
        csum = csum0[:, None] + prev  # (B, G, H, K, V) cached sum seen by segment g
        y = o + torch.einsum("bgchk,bghkv->bgchv", qf, csum)
        if mc.averages:
            counts = n_segments + 1 + torch.arange(G, device=q.device, dtype=q.dtype)
            y = y / counts[None, :, None, None, None]
    else:
        count = torch.arange(1, C + 1, device=q.device, dtype=q.dtype)  # (C,)
        r_on = (uf * kc).sum(-1) / (count[:, None] * math.sqrt(K))  # (B, G, C, H)
        N0 = cached.shape[1]
        N = N0 + G - 1
        # checkpoints a token can read: the carried N0, then the span's completed segments
        ck = torch.cat([cached_ksum, seg_ksum[:, :G - 1]], 1)  # (B, N, H, K)
        pieces = (cached, S_end[:, :G - 1])  # their states (B, N, H, K, V), in two parts
        L = G * C
        qr, ur = qf.reshape(B, L, H, K), uf.reshape(B, L, H, K)
        r_on = r_on.reshape(B, L, H)
        o = o.reshape(B, L, H, V)
        if mc.selects and N > top_k:
            y = _selected_readout(pieces, qr, ur, ck, r_on, o, N0, C, top_k, readout_dtype)
        elif N:
            grad = torch.is_grad_enabled() and any(
                x is not None and x.requires_grad
                for x in (q, k, v, u, log_a, b, initial_state, initial_ksum, cached, cached_ksum))
            fused = backend != "triton" and not _big_tiles(q) and not grad
            dense = _readout_dense if fused else _readout_dense_unfused
            y = dense(pieces, qr, ur, ck, r_on, o, N0, C, readout_dtype)
        else:  # nothing cached yet: the online term alone (its softmax weight is 1)
            y = o
    y = y.reshape(B, G * C, H, V)[:, f0:f0 + T]
    # a partial last segment's padding wrote nothing and did not decay: S_end[:, -1] is exact
    return y, S_end[:, -1], S_end[:, :n_b], seg_ksum[:, :n_b]


def mc_linear_chunk_naive(
    q: Tensor, k: Tensor, v: Tensor, u: Tensor, log_a: Tensor | None = None,
    b: Tensor | None = None, *, initial_state: Tensor, initial_ksum: Tensor, initial_fill: int,
    cached: Tensor, cached_ksum: Tensor, n_segments: int, mc: MCConfig, top_k: int | None = None,
    readout_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``mc_linear_chunk`` token by token (same signature and results): the oracle twin; it
    computes in q's dtype whatever ``readout_dtype`` says."""
    _check(q, k, v, u, initial_state, initial_ksum, initial_fill, cached, cached_ksum, mc, top_k)
    segment_len, top_k = mc.segment_len, top_k or mc.top_k
    B, T, H, K = q.shape
    C = segment_len
    S, ksum, fill = initial_state, initial_ksum, initial_fill
    mems = [cached[:, i] for i in range(cached.shape[1])]
    ksums = [cached_ksum[:, i] for i in range(cached.shape[1])]
    n_seg = n_segments
    ys, b_states, b_ksums = [], [], []
    for t in range(T):
        if fill == C:  # the previous token completed a segment: it becomes a cached memory
            if mc.fixed_weights:
                mems = [S + mems[0]] if mems else [S]
            else:
                mems.append(S)
                ksums.append(ksum)
            n_seg += 1
            ksum, fill = torch.zeros_like(ksum), 0
            if mc.independent:
                S = torch.zeros_like(S)
        la = None if log_a is None else log_a[:, t:t + 1]
        bb = None if b is None else b[:, t:t + 1]
        o, S = naive_gla(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], la, bb, S)
        o = o[:, 0]  # (B, H, V)
        ksum, fill = ksum + k[:, t], fill + 1
        qt = q[:, t]
        reads = [torch.einsum("bhk,bhkv->bhv", qt, m) for m in mems]
        if mc.fixed_weights:
            y = (o + sum(reads)) / (n_seg + 1 if mc.averages else 1)
        else:
            r = [(u[:, t] * ks).sum(-1) / (C * math.sqrt(K)) for ks in ksums]  # (B, H) each
            r_on = (u[:, t] * ksum).sum(-1) / (fill * math.sqrt(K))
            y = torch.zeros_like(o)
            for bi in range(B):
                for h in range(H):
                    sc = [float(x[bi, h].detach()) for x in r]  # the selection only
                    pick = list(range(len(sc)))
                    if mc.selects:
                        pick.sort(key=lambda i, sc=sc: (sc[i], i), reverse=True)
                        pick = sorted(pick[:top_k])
                    logits = torch.stack([r[i][bi, h] for i in pick] + [r_on[bi, h]])
                    gam = torch.softmax(logits, 0)
                    acc = gam[-1] * o[bi, h]
                    for j, i in enumerate(pick):
                        acc = acc + gam[j] * reads[i][bi, h]
                    y[bi, h] = acc
        ys.append(y)
        if fill == C:
            b_states.append(S)
            b_ksums.append(ksum)
    y = torch.stack(ys, 1) if ys else v.new_zeros(v.shape)
    V = v.shape[-1]
    bs = torch.stack(b_states, 1) if b_states else q.new_zeros(B, 0, H, K, V)
    bk = torch.stack(b_ksums, 1) if b_ksums else q.new_zeros(B, 0, H, K)
    return y, S, bs, bk
