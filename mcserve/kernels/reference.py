"""Plain, readable reference implementation of Memory Caching (the oracle).

This module implements docs/mc.md (memory families, segmentation, MC aggregation) as
directly as possible, with explicit Python loops over tokens and segments. It is the
oracle that every faster path (chunked torch, Triton, decode kernels) is tested against;
it favours clarity over speed and is meant for short sequences only.

Public API:

* :func:`segments` -- the segment boundaries seen by the token at position ``n``.
* :func:`mc_linear` -- Memory Caching on the ``linear`` memory family
  (``S_t = a_t S_{t-1} + b_t k_t v_t^T``, readout ``S^T q``).
* :func:`mc_deep` -- Memory Caching on the deep families ``dla`` and ``titans``
  (``M(x) = x + W1 gelu(W2 x)``).

Conventions (docs/mc.md): positions are 1-indexed, ``n = t + 1`` for the tensor row
``t``. Segments are half-open ``(start, end]`` in positions, which is exactly the Python
slice ``[start:end]`` of 0-indexed rows. The readout of token ``t`` uses the memory state
*after* token ``t``'s own update. The token completing a segment still reads that segment
as its online memory.

Variants (``variant=``): ``none``, ``residual``, ``grm``, ``soup``, ``ssc``,
``loglinear``, ``post``. Modes (``mode=``): ``checkpoint`` (one memory runs through
the whole sequence and the cached memory of a segment is the state after its last
token) and ``independent`` (every segment restarts from the initial state).
``loglinear`` is defined in checkpoint mode only; ``none`` ignores segmentation and
mode entirely.

All arithmetic happens in the dtype of the inputs (float64 works and is what the
tests use).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["MODES", "VARIANTS", "DEEP_MEMORIES", "segments", "mc_linear", "mc_deep"]

VARIANTS: tuple[str, ...] = ("none", "residual", "grm", "soup", "ssc", "loglinear", "post")
MODES: tuple[str, ...] = ("checkpoint", "independent")
DEEP_MEMORIES: tuple[str, ...] = ("dla", "titans")


# --------------------------------------------------------------------------------------
# Segmentation
# --------------------------------------------------------------------------------------


def segments(n: int, segment_len: int, variant: str) -> list[tuple[int, int]]:
    """Return the segments that the token at 1-indexed position ``n`` reads.

    Each segment is a pair ``(start, end)`` meaning positions ``start+1 .. end``
    (equivalently the 0-indexed rows ``[start:end]``). The list covers ``1..n`` in
    order without gaps; the **last** entry is the online segment (its ``end`` is
    ``n``), all earlier entries are cached segments. ``n == 0`` gives ``[]``.

    * constant segmentation (every variant except ``none`` and ``loglinear``): segment
      ``s`` holds ``((s-1)*C, s*C]``; the online segment is ``s = ceil(n / C)`` and ends
      at ``n`` (it may be partial). A token completing a segment reads it as online.
    * ``loglinear``: the binary expansion of ``n``, largest power of two first, e.g.
      ``segments(37, C, "loglinear") == [(0, 32), (32, 36), (36, 37)]``;
      ``segment_len`` is ignored.
    * ``none``: a single segment ``[(0, n)]`` (no segmentation).

    Pure Python; raises ``ValueError`` for a negative ``n``, ``segment_len < 1`` or an
    unknown ``variant``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    _check_segment_len(segment_len)
    _check_variant(variant)
    if n == 0:
        return []
    if variant == "none":
        return [(0, n)]
    if variant == "loglinear":
        out: list[tuple[int, int]] = []
        start = 0
        for bit in range(n.bit_length() - 1, -1, -1):
            if n & (1 << bit):
                out.append((start, start + (1 << bit)))
                start += 1 << bit
        return out
    num_segments = -(-n // segment_len)  # ceil(n / C)
    return [((i - 1) * segment_len, min(i * segment_len, n)) for i in range(1, num_segments + 1)]


# --------------------------------------------------------------------------------------
# Argument validation
# --------------------------------------------------------------------------------------


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def _check_segment_len(segment_len: int) -> None:
    if isinstance(segment_len, bool) or not isinstance(segment_len, int) or segment_len < 1:
        raise ValueError(f"segment_len must be an int >= 1, got {segment_len!r}")


def _check_common(variant: str, mode: str, segment_len: int, top_k: int) -> None:
    _check_variant(variant)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if variant == "loglinear" and mode != "checkpoint":
        raise ValueError(
            f"mode={mode!r} is not defined for variant='loglinear' (checkpoint mode only)"
        )
    _check_segment_len(segment_len)
    if variant == "ssc" and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1 for variant='ssc', got {top_k!r}")


def _check_tensor(
    name: str, x: object, shape: tuple[int | None, ...], dtype: torch.dtype
) -> Tensor:
    """Check that ``x`` is a floating tensor of ``dtype`` whose shape matches ``shape``.

    ``None`` entries in ``shape`` are free. Returns ``x``.
    """
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if len(shape) != x.dim() or any(
        want is not None and want != got for want, got in zip(shape, x.shape)
    ):
        want_str = "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"
        raise ValueError(f"{name} must have shape {want_str}, got {list(x.shape)}")
    if x.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype} (the dtype of q), got {x.dtype}")
    return x


def _check_qkvu(q: object, k: object, v: object, u: object) -> tuple[int, int, int, int]:
    """Validate q, k, u ``[T, H, K]`` and v ``[T, H, V]``; return ``(T, H, K, V)``."""
    if not isinstance(q, Tensor):
        raise ValueError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must have shape [T, H, K], got {list(q.shape)}")
    if not q.dtype.is_floating_point:
        raise ValueError(f"q must have a floating dtype, got {q.dtype}")
    T, H, K = q.shape
    _check_tensor("k", k, (T, H, K), q.dtype)
    _check_tensor("u", u, (T, H, K), q.dtype)
    _check_tensor("v", v, (T, H, None), q.dtype)
    return T, H, K, v.shape[2]  # type: ignore[union-attr]


def _gate_or_ones(name: str, g: Tensor | None, T: int, H: int, like: Tensor) -> Tensor:
    """Return the per-token, per-head gate ``g`` ``[T, H]``, or ones when it is None."""
    if g is None:
        return torch.ones(T, H, dtype=like.dtype, device=like.device)
    return _check_tensor(name, g, (T, H), like.dtype)


# --------------------------------------------------------------------------------------
# Aggregation, shared by both families
# --------------------------------------------------------------------------------------


def _weights(variant: str, r: Tensor, top_k: int) -> Tensor:
    """Mixing weights ``[H, s]`` over the ``s`` memories of one token.

    ``r`` ``[H, s]`` are the scores ``<u_t, p_i> / sqrt(K)``; column ``s-1`` is the
    online memory, the earlier columns are the cached memories in segment order.
    """
    H, s = r.shape
    if variant == "residual":
        return torch.ones_like(r)
    if variant == "post":
        return torch.full_like(r, 1.0 / s)
    if variant in ("grm", "soup", "loglinear"):
        return torch.softmax(r, dim=-1)
    if variant == "ssc":
        w = torch.zeros_like(r)
        for h in range(H):
            cached = list(range(s - 1))
            scores = r[h].tolist()
            # Highest score first; among equal scores the more recent (larger index).
            cached.sort(key=lambda i: (scores[i], i), reverse=True)
            chosen = sorted(cached[:top_k]) + [s - 1]
            w[h, chosen] = torch.softmax(r[h, chosen], dim=-1)
        return w
    raise AssertionError(f"unreachable variant {variant!r}")  # pragma: no cover


def _scores(u_t: Tensor, k: Tensor, segs: list[tuple[int, int]]) -> Tensor:
    """``r[h, i] = <u_t[h], mean(k[start_i:end_i, h])> / sqrt(K)``, shape ``[H, s]``."""
    K = k.shape[-1]
    pooled = torch.stack([k[start:end].mean(dim=0) for start, end in segs], dim=1)  # [H,s,K]
    return torch.einsum("hk,hsk->hs", u_t, pooled) / math.sqrt(K)


# --------------------------------------------------------------------------------------
# Linear memory
# --------------------------------------------------------------------------------------


def _linear_states(
    k: Tensor, v: Tensor, a: Tensor, b: Tensor, reset_every: int | None
) -> list[Tensor]:
    """Run ``S_t = a_t S_{t-1} + b_t k_t v_t^T`` and return all states.

    ``states[n]`` ``[H, K, V]`` is the state after position ``n`` (``states[0]`` = 0).
    With ``reset_every = C`` the state restarts from zero at every segment start
    (independent mode), so ``states[end]`` is the memory of the segment ending at
    ``end``; with ``None`` one memory runs through the whole sequence.
    """
    T, H, K = k.shape
    V = v.shape[-1]
    state = torch.zeros(H, K, V, dtype=k.dtype, device=k.device)
    states = [state]
    for t in range(T):
        if reset_every is not None and t % reset_every == 0:
            state = torch.zeros_like(state)
        outer = k[t][:, :, None] * v[t][:, None, :]  # [H, K, V]
        state = a[t][:, None, None] * state + b[t][:, None, None] * outer
        states.append(state)
    return states


def mc_linear(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    u: Tensor,
    a: Tensor | None = None,
    b: Tensor | None = None,
    *,
    variant: str,
    segment_len: int,
    top_k: int = 2,
    mode: str = "checkpoint",
) -> Tensor:
    """Memory Caching over the ``linear`` memory family, one unbatched sequence.

    Memory: ``S_t = a_t S_{t-1} + b_t k_t v_t^T`` (``S`` is ``[K, V]`` per head,
    starting at zero), readout ``M(q) = S^T q``. For token ``t`` in segment ``s`` the
    memories ``M^(1..s-1)`` are the cached segment memories and ``M^(s)`` the online one
    (state after ``t``); the output is aggregated according to ``variant``
    (docs/mc.md):

    * ``none``: ``S_t^T q_t`` (no segmentation, ``mode`` ignored);
    * ``residual``: ``sum_i M^(i)(q_t)``; ``post``: ``(1/s) sum_i M^(i)(q_t)``;
    * ``grm``: ``sum_i gamma_i M^(i)(q_t)``, ``gamma = softmax_i(<u_t, p_i> / sqrt(K))``
      where ``p_i`` is the mean key of segment ``i`` (online: its tokens so far);
    * ``soup``: read out the gamma-weighted mix of the states (equals ``grm`` here);
    * ``ssc``: the ``top_k`` cached segments with the highest score (ties: the more
      recent) plus the online one, softmax over that set;
    * ``loglinear``: ``grm`` over the logarithmic segments (checkpoint mode only).

    Args:
        q, k, u: ``[T, H, K]`` queries, keys and gate connectors.
        v: ``[T, H, V]`` values.
        a, b: ``[T, H]`` decay and write gates, or None for all ones.
        variant: one of :data:`VARIANTS`.
        segment_len: constant segment length ``C >= 1`` (unused by ``none``/``loglinear``).
        top_k: number of cached segments ``ssc`` selects (``>= 1``).
        mode: ``"checkpoint"`` or ``"independent"``.

    Returns:
        ``y`` ``[T, H, V]`` in the dtype of ``q``.

    Raises:
        ValueError: for an unknown variant/mode, ``loglinear`` with independent mode,
            ``segment_len < 1``, ``top_k < 1`` with ``ssc``, or mismatched shapes/dtypes.
    """
    _check_common(variant, mode, segment_len, top_k)
    T, H, K, V = _check_qkvu(q, k, v, u)
    a = _gate_or_ones("a", a, T, H, q)
    b = _gate_or_ones("b", b, T, H, q)

    # `none` is the plain recurrence; everything else reads one state per segment.
    independent = mode == "independent" and variant != "none"
    states = _linear_states(k, v, a, b, segment_len if independent else None)

    y = torch.zeros(T, H, V, dtype=q.dtype, device=q.device)
    for t in range(T):
        n = t + 1
        segs = segments(n, segment_len, variant)
        # Checkpoint mode: the continuous state at each boundary (the online one is the
        # state after n). Independent mode: states restart at segment starts, so the
        # state at a segment's end is that segment's own memory.
        mems = torch.stack([states[end] for _, end in segs], dim=1)  # [H, s, K, V]
        if variant == "none":
            y[t] = torch.einsum("hkv,hk->hv", mems[:, 0], q[t])
            continue
        w = _weights(variant, _scores(u[t], k, segs), top_k)  # [H, s]
        if variant == "soup":
            mixed = torch.einsum("hs,hskv->hkv", w, mems)  # mix the parameters, then read
            y[t] = torch.einsum("hkv,hk->hv", mixed, q[t])
        else:
            reads = torch.einsum("hskv,hk->hsv", mems, q[t])  # M^(i)(q_t) for every i
            y[t] = torch.einsum("hs,hsv->hv", w, reads)
    return y


# --------------------------------------------------------------------------------------
# Deep memories (dla, titans)
# --------------------------------------------------------------------------------------


def _gelu_and_grad(z: Tensor) -> tuple[Tensor, Tensor]:
    """Exact (erf) GELU ``z * Phi(z)`` and its derivative ``Phi(z) + z * phi(z)``."""
    cdf = 0.5 * (1.0 + torch.erf(z / math.sqrt(2.0)))
    pdf = torch.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    return z * cdf, cdf + z * pdf


def _deep_readout(w1: Tensor, w2: Tensor, x: Tensor) -> Tensor:
    """``M_W(x) = x + W1 gelu(W2 x)`` per head: w1 ``[H,V,E]``, w2 ``[H,E,K]``, x ``[H,K]``."""
    z = torch.einsum("hek,hk->he", w2, x)
    h, _ = _gelu_and_grad(z)
    return x + torch.einsum("hve,he->hv", w1, h)


def _deep_grad(memory: str, w1: Tensor, w2: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Closed-form gradient w.r.t. ``(W1, W2)`` of the inner objective at one token.

    ``dla``: ``L = <M_W(k), v>``. ``titans``: ``L = ||M_W(k) - v||^2`` (no 1/2).
    With ``z = W2 k``, ``h = gelu(z)``, ``g = dL/dM`` (``v`` or ``2 (M_W(k) - v)``):
    ``dL/dW1 = g h^T`` and ``dL/dW2 = ((W1^T g) * gelu'(z)) k^T``.
    """
    z = torch.einsum("hek,hk->he", w2, k)
    h, dh = _gelu_and_grad(z)
    if memory == "dla":
        g = v
    else:
        g = 2.0 * (k + torch.einsum("hve,he->hv", w1, h) - v)
    grad_w1 = torch.einsum("hv,he->hve", g, h)
    back = torch.einsum("hve,hv->he", w1, g) * dh
    grad_w2 = torch.einsum("he,hk->hek", back, k)
    return grad_w1, grad_w2


def _deep_states(
    memory: str,
    k: Tensor,
    v: Tensor,
    eta: Tensor,
    a: Tensor,
    m: Tensor,
    w1_init: Tensor,
    w2_init: Tensor,
    inner_chunk: int,
    reset_every: int | None,
) -> list[tuple[Tensor, Tensor]]:
    """Run the deep-memory recurrence; ``states[n] = (W1, W2)`` after position ``n``.

    Inner chunks of ``inner_chunk`` tokens start at the sequence start and, with
    ``reset_every = C`` (independent mode), at every segment start, where the weights
    restart from ``W^init`` and the titans momentum from zero. Inside an inner chunk
    every gradient is taken at the weights ``W0`` the chunk started with, while the
    updates accumulate token by token.
    """
    T = k.shape[0]
    w1, w2 = w1_init, w2_init
    mom1, mom2 = torch.zeros_like(w1), torch.zeros_like(w2)
    w1_0, w2_0 = w1, w2
    states = [(w1, w2)]
    since_reset = 0  # tokens since the last restart (sequence start or segment start)
    for t in range(T):
        if reset_every is not None and t % reset_every == 0:
            w1, w2 = w1_init, w2_init
            mom1, mom2 = torch.zeros_like(w1), torch.zeros_like(w2)
            since_reset = 0
        if since_reset % inner_chunk == 0:
            w1_0, w2_0 = w1, w2  # a new inner chunk: freeze the gradient point
        g1, g2 = _deep_grad(memory, w1_0, w2_0, k[t], v[t])
        lr = eta[t][:, None, None]
        if memory == "dla":
            # gradient ascent on <M_W(k), v>
            w1 = w1 + lr * g1
            w2 = w2 + lr * g2
        else:
            mom1 = m[t][:, None, None] * mom1 - lr * g1
            mom2 = m[t][:, None, None] * mom2 - lr * g2
            w1 = a[t][:, None, None] * w1 + mom1
            w2 = a[t][:, None, None] * w2 + mom2
        since_reset += 1
        states.append((w1, w2))
    return states


def mc_deep(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    u: Tensor,
    eta: Tensor,
    w1_init: Tensor,
    w2_init: Tensor,
    a: Tensor | None = None,
    m: Tensor | None = None,
    *,
    memory: str,
    variant: str,
    segment_len: int,
    top_k: int = 2,
    mode: str = "checkpoint",
    inner_chunk: int = 1,
) -> Tensor:
    """Memory Caching over the deep memory families ``dla`` and ``titans``.

    Memory per head: ``M_W(x) = x + W1 gelu(W2 x)`` with ``W1 [V, E]``, ``W2 [E, K]``,
    ``K == V``, exact (erf) GELU, starting from ``(w1_init, w2_init)``. Updates for token
    ``t``, with every gradient taken at the weights ``W0`` its inner
    chunk started with (``inner_chunk = 1`` is the exact per-token recurrence):

    * ``dla``: ``W_t = W_{t-1} + eta_t grad_W <M_W(k_t), v_t>`` (``a``, ``m`` ignored);
    * ``titans``: ``Sigma_t = m_t Sigma_{t-1} - eta_t grad_W ||M_W(k_t) - v_t||^2``,
      ``W_t = a_t W_{t-1} + Sigma_t`` (momentum ``Sigma`` starts at zero).

    Inner chunks start at the sequence start (checkpoint mode) and at every segment
    start (independent mode, where every segment also restarts from ``W^init`` with zero
    momentum). Aggregation over segments is as in :func:`mc_linear`, with ``M^(i)(q_t)``
    the MLP readout; ``soup`` reads out ``M`` with ``W1, W2`` mixed by the gates (which
    differs from ``grm`` for these non-linear memories).

    Args:
        q, k, u: ``[T, H, K]``; v: ``[T, H, V]`` with ``V == K``.
        eta: ``[T, H]`` inner learning rates.
        w1_init: ``[H, V, E]``; w2_init: ``[H, E, K]`` initial weights per head.
        a, m: ``[T, H]`` titans decay and momentum, or None (``a = 1``, ``m = 0``).
        memory: ``"dla"`` or ``"titans"``.
        variant, segment_len, top_k, mode: as in :func:`mc_linear`.
        inner_chunk: tokens per inner mini-batch (``>= 1``); ``segment_len`` must be a
            multiple of it (checked for every variant).

    Returns:
        ``y`` ``[T, H, V]`` in the dtype of ``q``.

    Raises:
        ValueError: for an unknown memory/variant/mode, bad ``segment_len``, ``top_k``
            or ``inner_chunk``, ``segment_len % inner_chunk != 0``, or mismatched
            shapes/dtypes.
    """
    if memory not in DEEP_MEMORIES:
        raise ValueError(f"memory must be one of {DEEP_MEMORIES}, got {memory!r}")
    _check_common(variant, mode, segment_len, top_k)
    if isinstance(inner_chunk, bool) or not isinstance(inner_chunk, int) or inner_chunk < 1:
        raise ValueError(f"inner_chunk must be an int >= 1, got {inner_chunk!r}")
    if segment_len % inner_chunk != 0:
        raise ValueError(
            f"segment_len ({segment_len}) must be a multiple of inner_chunk ({inner_chunk})"
        )
    T, H, K, V = _check_qkvu(q, k, v, u)
    if V != K:
        raise ValueError(f"v must have the key dim K={K} as its last dim (V == K), got {V}")
    eta = _check_tensor("eta", eta, (T, H), q.dtype)
    _check_tensor("w1_init", w1_init, (H, V, None), q.dtype)
    E = w1_init.shape[2]
    _check_tensor("w2_init", w2_init, (H, E, K), q.dtype)
    a = _gate_or_ones("a", a, T, H, q)
    m = _gate_or_ones("m", m, T, H, q) if m is not None else torch.zeros_like(a)

    independent = mode == "independent" and variant != "none"
    states = _deep_states(
        memory,
        k,
        v,
        eta,
        a,
        m,
        w1_init,
        w2_init,
        inner_chunk,
        segment_len if independent else None,
    )

    y = torch.zeros(T, H, V, dtype=q.dtype, device=q.device)
    for t in range(T):
        n = t + 1
        segs = segments(n, segment_len, variant)
        w1s = torch.stack([states[end][0] for _, end in segs], dim=1)  # [H, s, V, E]
        w2s = torch.stack([states[end][1] for _, end in segs], dim=1)  # [H, s, E, K]
        if variant == "none":
            y[t] = _deep_readout(w1s[:, 0], w2s[:, 0], q[t])
            continue
        w = _weights(variant, _scores(u[t], k, segs), top_k)  # [H, s]
        if variant == "soup":
            w1_mix = torch.einsum("hs,hsve->hve", w, w1s)
            w2_mix = torch.einsum("hs,hsek->hek", w, w2s)
            y[t] = _deep_readout(w1_mix, w2_mix, q[t])
        else:
            reads = torch.stack(
                [_deep_readout(w1s[:, i], w2s[:, i], q[t]) for i in range(len(segs))], dim=1
            )  # [H, s, V]
            y[t] = torch.einsum("hs,hsv->hv", w, reads)
    return y


# --------------------------------------------------------------------------------------
# Delta-rule memories (delta, gated_delta)
# --------------------------------------------------------------------------------------


def delta_rule_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor | None,
    log_alpha: Tensor | None = None,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The (gated) delta rule, one token at a time.

    ``S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T`` with ``S`` ``[K, V]``
    per head (keys on the rows), readout ``o_t = S_t^T q_t`` after token ``t``'s update.
    ``log_alpha`` None is the plain delta rule (``alpha = 1``); ``beta`` None means ones.
    No scaling or normalisation of q and k happens here.

    Args:
        q, k: ``(B, T, H, K)``; v: ``(B, T, H, V)``.
        beta, log_alpha: ``(B, T, H)`` or None.
        initial_state: ``(B, H, K, V)`` or None (zeros).

    Returns:
        ``o`` ``(B, T, H, V)`` and the state after the last token ``(B, H, K, V)``.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = (torch.zeros(B, H, K, V, dtype=q.dtype, device=q.device) if initial_state is None
         else initial_state)
    outs = []
    for t in range(T):
        kt, vt = k[:, t], v[:, t]  # (B, H, K), (B, H, V)
        if log_alpha is not None:
            S = S * log_alpha[:, t].exp()[..., None, None]
        bt = torch.ones_like(kt[..., 0]) if beta is None else beta[:, t]  # (B, H)
        # (I - b k k^T) S + b k v^T = S + k (b (v - S^T k))^T
        err = vt - torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + kt[..., :, None] * (bt[..., None] * err)[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, S


def _delta_states(
    k: Tensor, v: Tensor, beta: Tensor, log_alpha: Tensor | None, reset_every: int | None
) -> list[Tensor]:
    """All states of the (gated) delta rule for one unbatched sequence.

    ``states[n]`` ``[H, K, V]`` is the state after position ``n`` (``states[0]`` = 0); with
    ``reset_every = C`` every segment restarts from zero (independent mode).
    """
    T, H, K = k.shape
    state = torch.zeros(H, K, v.shape[-1], dtype=k.dtype, device=k.device)
    states = [state]
    for t in range(T):
        if reset_every is not None and t % reset_every == 0:
            state = torch.zeros_like(state)
        la = None if log_alpha is None else log_alpha[None, t:t + 1]
        _, state = delta_rule_recurrent(k[None, t:t + 1], k[None, t:t + 1], v[None, t:t + 1],
                                        beta[None, t:t + 1], la, state[None])
        state = state[0]
        states.append(state)
    return states


def mc_delta(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    u: Tensor,
    beta: Tensor | None = None,
    log_alpha: Tensor | None = None,
    *,
    variant: str,
    segment_len: int,
    top_k: int = 2,
    mode: str = "checkpoint",
) -> Tensor:
    """Memory Caching over the ``delta`` / ``gated_delta`` families, one unbatched sequence.

    As :func:`mc_linear` with the memory ``S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} +
    beta_t k_t v_t^T`` (``log_alpha`` None: ``alpha = 1``; ``beta`` None: ones). The readout
    ``S^T q`` is linear in ``S``, so ``soup`` equals ``grm`` exactly as on ``linear``.

    Args:
        q, k, u: ``[T, H, K]``; v: ``[T, H, V]``; beta, log_alpha: ``[T, H]`` or None.

    Returns:
        ``y`` ``[T, H, V]``.
    """
    _check_common(variant, mode, segment_len, top_k)
    T, H, K, V = _check_qkvu(q, k, v, u)
    beta = _gate_or_ones("beta", beta, T, H, q)
    if log_alpha is not None:
        _check_tensor("log_alpha", log_alpha, (T, H), q.dtype)
    independent = mode == "independent" and variant != "none"
    states = _delta_states(k, v, beta, log_alpha, segment_len if independent else None)
    y = torch.zeros(T, H, V, dtype=q.dtype, device=q.device)
    for t in range(T):
        segs = segments(t + 1, segment_len, variant)
        mems = torch.stack([states[end] for _, end in segs], dim=1)  # [H, s, K, V]
        if variant == "none":
            y[t] = torch.einsum("hkv,hk->hv", mems[:, 0], q[t])
            continue
        w = _weights(variant, _scores(u[t], k, segs), top_k)  # [H, s]
        if variant == "soup":
            mixed = torch.einsum("hs,hskv->hkv", w, mems)
            y[t] = torch.einsum("hkv,hk->hv", mixed, q[t])
        else:
            reads = torch.einsum("hskv,hk->hsv", mems, q[t])
            y[t] = torch.einsum("hs,hsv->hv", w, reads)
    return y


__all__ += ["delta_rule_recurrent", "mc_delta"]


# --------------------------------------------------------------------------------------
# RWKV-7 (generalised delta rule), in the rwkv package's own layout
# --------------------------------------------------------------------------------------


def rwkv7_recurrent(
    r: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor,
    state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """RWKV-7's time-mixing recurrence on one unbatched sequence, token by token, head by head.

    The state of a head is ``S`` ``[V, K]`` (values on the rows, as the rwkv package keeps it)::

        S_t = S_{t-1} (diag(w_t) + a_t^T b_t) + v_t^T k_t,      y_t = S_t r_t

    with row vectors ``a_t, b_t, k_t`` ``[1, K]``: ``w_t`` is the per-channel decay (in (0, 1)),
    ``a_t`` the removal key (RWKV-7 passes ``-kk``) and ``b_t`` the write of what was removed
    (``kk * a_rate``). mcserve's matrix memories store the transpose ``[K, V]``
    (``mcserve.kernels.rwkv7``).

    Args:
        r, w, k, a, b: ``[T, H, K]`` receptance (the query), decay, key, removal key and rate.
        v: ``[T, H, V]`` values.
        state: ``[H, V, K]`` initial state, or None for zeros.

    Returns:
        ``y`` ``[T, H, V]`` and the final state ``[H, V, K]``.
    """
    T, H, K = r.shape
    V = v.shape[-1]
    S = torch.zeros(H, V, K, dtype=r.dtype, device=r.device) if state is None else state.clone()
    y = torch.zeros(T, H, V, dtype=r.dtype, device=r.device)
    for t in range(T):
        for h in range(H):
            transition = torch.diag(w[t, h]) + torch.outer(a[t, h], b[t, h])  # [K, K]
            S[h] = S[h] @ transition + torch.outer(v[t, h], k[t, h])
            y[t, h] = S[h] @ r[t, h]
    return y, S


__all__ += ["rwkv7_recurrent"]
