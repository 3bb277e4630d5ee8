"""Deep memory families ``dla`` and ``titans`` (docs/deep-memory.md).

Memory per head: ``M_W(x) = x + W1 gelu(W2 x)`` with ``W1 (V, E)``, ``W2 (E, K)``, ``K == V`` and
the exact (erf) GELU. Updates for token t, every gradient taken at the weights ``W0`` the current
inner chunk started with:

* ``dla``:    ``W_t = W_{t-1} + eta_t grad_W <M_W(k_t), v_t>`` (gradient *ascent*);
* ``titans``: ``Z_t = m_t Z_{t-1} - eta_t grad_W ||M_W(k_t) - v_t||^2`` (no 1/2),
  ``W_t = a_t W_{t-1} + Z_t`` (``a`` missing means ones, ``m`` missing means zeros).

With ``z = W2 k``, ``h = gelu(z)`` and ``g = dL/dM`` (``v`` for dla, ``2 (M(k) - v)`` for titans)
the gradient is rank one per matrix: ``dL/dW1 = g h^T`` and ``dL/dW2 = delta k^T`` with
``delta = (W1^T g) * gelu'(z)``. Inside an inner chunk the weights are therefore the chunk's
starting weights plus a gate-weighted sum of rank-one terms, so applying ``W2_t`` / ``W1_t`` to a
per-token vector is a masked, attention-like product (the "dual form" of TTT/Titans). The
functions here loop over inner chunks in Python but never over tokens, and never materialise
anything of size ``T x parameters``. Each public function has a plain per-token twin with the same
signature (suffix ``_naive``) used as the test oracle.

State (all tensors lead with the batch dim B; a plain ``dict[str, Tensor]``):

* ``W1`` ``(B, H, V, E)``, ``W2`` ``(B, H, E, K)``: the current weights (after the last token);
* ``W1_0``, ``W2_0``: the weights the current inner chunk started with (gradient point);
* ``Z1``, ``Z2`` (titans only): the momentum, shapes of ``W1``/``W2``;
* ``fill`` long ``(B,)``: tokens already in the current inner chunk (``0 <= fill < inner_chunk``;
  the same for every row). ``fill == 0`` implies ``W_0 == W``.

Shapes: q, k ``(B, T, H, K)``, v ``(B, T, H, V)``, gates ``(B, T, H)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "DEEP_MEMORIES",
    "DeepState",
    "MidFn",
    "gelu",
    "gelu_grad",
    "deep_init_state",
    "deep_online_apply",
    "deep_online_apply_naive",
    "deep_scan",
    "deep_scan_naive",
    "deep_readout_mix",
    "deep_scan_soup",
    "deep_scan_soup_naive",
]

DEEP_MEMORIES: tuple[str, ...] = ("dla", "titans")

DeepState = dict[str, Tensor]
#: ``mid(h, t0, t1)``: called with ``h = W2_t x_t`` ``(B, L, H, E)`` for the tokens ``t0:t1`` of
#: the current call and returns the per-token vectors ``(B, L, H, E)`` that ``W1_t`` is applied to.
MidFn = Callable[[Tensor, int, int], Tensor]


# --------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------


def gelu(z: Tensor) -> Tensor:
    """Exact (erf) GELU ``z * Phi(z)``."""
    return F.gelu(z)


def gelu_grad(z: Tensor) -> Tensor:
    """Derivative of the exact GELU: ``Phi(z) + z * phi(z)``."""
    cdf = 0.5 * (1.0 + torch.erf(z * (1.0 / math.sqrt(2.0))))
    pdf = torch.exp(-0.5 * z * z) * (1.0 / math.sqrt(2.0 * math.pi))
    return cdf + z * pdf


def _gelu_mid(h: Tensor, t0: int, t1: int) -> Tensor:
    return gelu(h)


def _check_memory(memory: str) -> None:
    if memory not in DEEP_MEMORIES:
        raise ValueError(f"memory must be one of {DEEP_MEMORIES}, got {memory!r}")


def _check_inner_chunk(inner_chunk: int) -> None:
    if isinstance(inner_chunk, bool) or not isinstance(inner_chunk, int) or inner_chunk < 1:
        raise ValueError(f"inner_chunk must be an int >= 1, got {inner_chunk!r}")


def _read_fill(state: DeepState, inner_chunk: int) -> int:
    """The common fill count of the batch (host int); checks it is in ``[0, inner_chunk)``."""
    fill = state["fill"]
    if fill.numel() == 0:
        return 0
    first = int(fill[0])
    assert bool((fill == first).all()), "all batch rows must have the same inner-chunk fill"
    if not 0 <= first < inner_chunk:
        raise ValueError(f"state fill {first} is outside [0, inner_chunk={inner_chunk})")
    return first


def _check_inputs(state: DeepState, k: Tensor, v: Tensor, x: Tensor) -> None:
    B, T, H, K = k.shape
    V = v.shape[-1]
    if V != K:
        raise ValueError(f"deep memories need V == K, got K={K}, V={V}")
    if v.shape[:3] != (B, T, H) or x.shape != (B, T, H, K):
        raise ValueError(
            f"shape mismatch: k {list(k.shape)}, v {list(v.shape)}, q/x {list(x.shape)}"
        )
    w1, w2 = state["W1"], state["W2"]
    if w1.shape[:3] != (B, H, V) or w2.shape[0:2] != (B, H) or w2.shape[3] != K:
        raise ValueError(
            f"state W1 {list(w1.shape)} / W2 {list(w2.shape)} do not match B={B}, H={H}, K={K}"
        )


def _gate(g: Tensor | None, like: Tensor, fill_value: float) -> Tensor:
    """``g`` ``(B, T, H)`` or a constant gate shaped like ``like[..., 0]``."""
    if g is None:
        return torch.full(like.shape[:3], fill_value, dtype=like.dtype, device=like.device)
    return g


def deep_init_state(
    memory: str, batch: int, w1: Tensor, w2: Tensor, *, dtype: torch.dtype,
    device: torch.device | str,
) -> DeepState:
    """Initial state from the learned ``W^init``: w1 ``(H, V, E)``, w2 ``(H, E, K)``.

    The weights are copied for each of the ``batch`` rows; momentum (titans) starts at zero and
    the first inner chunk starts now (``fill = 0``).
    """
    _check_memory(memory)
    w1 = w1.to(dtype=dtype, device=device)
    w2 = w2.to(dtype=dtype, device=device)
    W1 = w1.unsqueeze(0).expand(batch, *w1.shape).contiguous()  # (B, H, V, E)
    W2 = w2.unsqueeze(0).expand(batch, *w2.shape).contiguous()  # (B, H, E, K)
    state: DeepState = {"W1": W1, "W2": W2, "W1_0": W1.clone(), "W2_0": W2.clone()}
    if memory == "titans":
        state["Z1"] = torch.zeros_like(W1)
        state["Z2"] = torch.zeros_like(W2)
    state["fill"] = torch.zeros(batch, dtype=torch.long, device=device)
    return state


# --------------------------------------------------------------------------------------
# Dual form
# --------------------------------------------------------------------------------------


def _pair_products(x: Tensor) -> Tensor:
    """``P[..., t, j] = prod_{j < i <= t} x[..., i]`` for ``j <= t``, else 0.

    x ``(B, H, L)`` -> ``(B, H, L, L)``. Computed with a cumulative product (no logs, no
    division), so zero gates are fine.
    """
    L = x.shape[-1]
    strict = torch.ones(L, L, dtype=torch.bool, device=x.device).tril(-1)  # i > j
    ones = torch.ones((), dtype=x.dtype, device=x.device)
    X = torch.where(strict, x.unsqueeze(-1), ones)  # (B, H, L, L), X[i, j] = x_i if i > j else 1
    return torch.cumprod(X, dim=-2).tril()


def _bth(c: Tensor) -> Tensor:
    """``(B, H, L)`` coefficient -> ``(B, L, H, 1)`` for broadcasting against per-token rows."""
    return c.permute(0, 2, 1).unsqueeze(-1)


class _Piece:
    """The online weights over a run of L tokens that lie inside one inner chunk.

    With ``W_s``, ``Z_s`` the state before the run and ``u_j = c_j (g_j h_j^T, delta_j k_j^T)``
    the update of token j (``c = +eta`` for dla, ``-eta`` for titans; gradients at ``W0``):

        W_t = cW[t] W_s + cZ[t] Z_s + sum_{j <= t} C[t, j] u_j
        Z_t = pm[t] Z_s + sum_{j <= t} Pm[t, j] u_j

    with ``Pa[t, j] = prod_{j<i<=t} a_i`` (likewise ``Pm``), ``cW = cumprod(a)``,
    ``pm = cumprod(m)``, ``C = Pa @ Pm`` and ``cZ = Pa @ pm``. For dla ``a = 1``, ``m = 0``:
    ``C`` is the lower-triangular ones matrix and there is no momentum.
    """

    def __init__(
        self, memory: str, state: DeepState, k: Tensor, v: Tensor, eta: Tensor,
        a: Tensor | None, m: Tensor | None,
    ) -> None:
        self.memory = memory
        self.state = state
        self.k = k  # (B, L, H, K)
        w1_0, w2_0 = state["W1_0"], state["W2_0"]  # (B, H, V, E), (B, H, E, K)
        z = torch.einsum("bhek,blhk->blhe", w2_0, k)  # (B, L, H, E)
        self.h = gelu(z)  # (B, L, H, E)
        if memory == "dla":
            self.g = v  # (B, L, H, V)
            c = eta
        else:
            mk = k + torch.einsum("bhve,blhe->blhv", w1_0, self.h)  # M_{W0}(k), (B, L, H, V)
            self.g = 2.0 * (mk - v)  # (B, L, H, V)
            c = -eta
        self.delta = torch.einsum("bhve,blhv->blhe", w1_0, self.g) * gelu_grad(z)  # (B, L, H, E)
        self.c = c.permute(0, 2, 1)  # (B, H, L)
        B, L, H = eta.shape
        if memory == "dla":
            tril = torch.ones(L, L, dtype=k.dtype, device=k.device).tril()
            self.C = tril.expand(B, H, L, L)  # (B, H, L, L)
            self.cW: Tensor | None = None  # all ones
            self.cZ: Tensor | None = None
        else:
            a_ = _gate(a, k, 1.0).permute(0, 2, 1)  # (B, H, L)
            m_ = _gate(m, k, 0.0).permute(0, 2, 1)  # (B, H, L)
            Pa, Pm = _pair_products(a_), _pair_products(m_)  # (B, H, L, L)
            pm = torch.cumprod(m_, dim=-1)  # (B, H, L)
            self.C = Pa @ Pm  # (B, H, L, L)
            self.cW = torch.cumprod(a_, dim=-1)  # (B, H, L)
            self.cZ = (Pa @ pm.unsqueeze(-1)).squeeze(-1)  # (B, H, L)
            self.Pm_last = Pm[..., -1, :]  # (B, H, L)
            self.pm_last = pm[..., -1]  # (B, H)
        self.Cc = self.C * self.c.unsqueeze(-2)  # (B, H, L, L): C[t, j] c_j

    def _base(self, key: str, mom: str, eq: str, x: Tensor) -> Tensor:
        out = torch.einsum(eq, self.state[key], x)  # (B, L, H, *)
        if self.cW is not None:
            out = _bth(self.cW) * out + _bth(self.cZ) * torch.einsum(eq, self.state[mom], x)
        return out

    def apply_w2(self, x: Tensor) -> Tensor:
        """``W2_t x_t`` for x ``(B, L, H, K)`` -> ``(B, L, H, E)``."""
        out = self._base("W2", "Z2", "bhek,blhk->blhe", x)
        att = torch.einsum("bthk,bjhk->bhtj", x, self.k) * self.Cc  # (B, H, L, L)
        return out + torch.einsum("bhtj,bjhe->bthe", att, self.delta)

    def apply_w1(self, y: Tensor) -> Tensor:
        """``W1_t y_t`` for y ``(B, L, H, E)`` -> ``(B, L, H, V)``."""
        out = self._base("W1", "Z1", "bhve,blhe->blhv", y)
        att = torch.einsum("bthe,bjhe->bhtj", y, self.h) * self.Cc  # (B, H, L, L)
        return out + torch.einsum("bhtj,bjhv->bthv", att, self.g)

    def end_state(self, chunk_full: bool, fill: int) -> DeepState:
        """State after the last token of the run; ``fill`` is the new fill count."""
        st = self.state
        last = self.Cc[..., -1, :]  # (B, H, L)
        W1 = torch.einsum("bhj,bjhv,bjhe->bhve", last, self.g, self.h)  # (B, H, V, E)
        W2 = torch.einsum("bhj,bjhe,bjhk->bhek", last, self.delta, self.k)  # (B, H, E, K)
        if self.cW is None:
            W1 = W1 + st["W1"]
            W2 = W2 + st["W2"]
        else:
            cw, cz = self.cW[..., -1, None, None], self.cZ[..., -1, None, None]  # (B, H, 1, 1)
            W1 = W1 + cw * st["W1"] + cz * st["Z1"]
            W2 = W2 + cw * st["W2"] + cz * st["Z2"]
        new: DeepState = {"W1": W1, "W2": W2}
        if chunk_full:
            new["W1_0"], new["W2_0"] = W1.clone(), W2.clone()
        else:
            new["W1_0"], new["W2_0"] = st["W1_0"].clone(), st["W2_0"].clone()
        if self.cW is not None:
            zl = self.Pm_last * self.c  # (B, H, L)
            pz = self.pm_last[..., None, None]  # (B, H, 1, 1)
            new["Z1"] = pz * st["Z1"] + torch.einsum("bhj,bjhv,bjhe->bhve", zl, self.g, self.h)
            new["Z2"] = pz * st["Z2"] + torch.einsum(
                "bhj,bjhe,bjhk->bhek", zl, self.delta, self.k
            )
        new["fill"] = torch.full_like(st["fill"], fill)
        return new


def deep_online_apply(
    state: DeepState, k: Tensor, v: Tensor, x: Tensor, mid: MidFn, eta: Tensor,
    a: Tensor | None = None, m: Tensor | None = None, *, memory: str, inner_chunk: int,
) -> tuple[Tensor, Tensor, DeepState]:
    """Apply the per-token online weights to per-token vectors (chunkwise dual form).

    For every token t (after t's own update): ``h_t = W2_t x_t``, ``y_t = mid(h)_t``,
    ``out_t = W1_t y_t``. ``mid`` is called once per run of tokens inside one inner chunk (tokens
    ``t0:t1`` of this call) and must act token-wise; it lets a caller mix ``W2_t x_t`` with other
    memories before the nonlinearity (memory soup).

    Args:
        state: the deep state (module docstring); not modified.
        k: ``(B, T, H, K)`` keys; v: ``(B, T, H, V)`` values (``V == K``).
        x: ``(B, T, H, K)`` vectors for ``W2_t``.
        mid: ``(h (B, L, H, E), t0, t1) -> (B, L, H, E)``.
        eta: ``(B, T, H)``; a, m: ``(B, T, H)`` or None (titans only; ones / zeros).
        memory: ``"dla"`` or ``"titans"``; inner_chunk: tokens per inner mini-batch.

    Returns:
        ``out (B, T, H, V)``, ``y (B, T, H, E)`` (the ``mid`` outputs) and the new state.
    """
    _check_memory(memory)
    _check_inner_chunk(inner_chunk)
    _check_inputs(state, k, v, x)
    fill = _read_fill(state, inner_chunk)
    B, T, H, _ = k.shape
    outs: list[Tensor] = []
    ys: list[Tensor] = []
    st = state
    t0 = 0
    while t0 < T:
        t1 = min(t0 + inner_chunk - fill, T)
        sl = slice(t0, t1)
        piece = _Piece(
            memory, st, k[:, sl], v[:, sl], eta[:, sl],
            None if a is None else a[:, sl], None if m is None else m[:, sl],
        )
        y = mid(piece.apply_w2(x[:, sl]), t0, t1)  # (B, L, H, E)
        outs.append(piece.apply_w1(y))
        ys.append(y)
        fill += t1 - t0
        full = fill == inner_chunk
        fill %= inner_chunk
        st = piece.end_state(full, fill)
        t0 = t1
    if T == 0:
        st = {key: val.clone() for key, val in state.items()}
        E = state["W1"].shape[-1]
        empty_o = x.new_zeros(B, 0, H, v.shape[-1])
        return empty_o, x.new_zeros(B, 0, H, E), st
    return torch.cat(outs, dim=1), torch.cat(ys, dim=1), st


def deep_scan(
    state: DeepState, q: Tensor, k: Tensor, v: Tensor, eta: Tensor,
    a: Tensor | None = None, m: Tensor | None = None, *, memory: str, inner_chunk: int,
) -> tuple[Tensor, DeepState]:
    """Run the recurrence over T tokens; ``o_t = M_{W_t}(q_t)`` after t's update (dual form).

    q, k ``(B, T, H, K)``, v ``(B, T, H, V)``, gates ``(B, T, H)``. Returns ``o (B, T, H, V)``
    and the state after the last token. Associative over any split of the tokens.
    """
    out, _, st = deep_online_apply(
        state, k, v, q, _gelu_mid, eta, a, m, memory=memory, inner_chunk=inner_chunk
    )
    return q + out, st


# --------------------------------------------------------------------------------------
# Per-token twins (the test oracle)
# --------------------------------------------------------------------------------------


def deep_online_apply_naive(
    state: DeepState, k: Tensor, v: Tensor, x: Tensor, mid: MidFn, eta: Tensor,
    a: Tensor | None = None, m: Tensor | None = None, *, memory: str, inner_chunk: int,
) -> tuple[Tensor, Tensor, DeepState]:
    """Per-token twin of :func:`deep_online_apply`: materialises ``W_t`` for every token."""
    _check_memory(memory)
    _check_inner_chunk(inner_chunk)
    _check_inputs(state, k, v, x)
    fill = _read_fill(state, inner_chunk)
    B, T, H, _ = k.shape
    a = _gate(a, k, 1.0)
    m = _gate(m, k, 0.0)
    W1, W2 = state["W1"], state["W2"]  # (B, H, V, E), (B, H, E, K)
    W1_0, W2_0 = state["W1_0"], state["W2_0"]
    titans = memory == "titans"
    Z1 = state["Z1"] if titans else None
    Z2 = state["Z2"] if titans else None
    outs: list[Tensor] = []
    ys: list[Tensor] = []
    for t in range(T):
        kt, vt = k[:, t], v[:, t]  # (B, H, K), (B, H, V)
        z = torch.einsum("bhek,bhk->bhe", W2_0, kt)  # (B, H, E)
        hh = gelu(z)
        if titans:
            g = 2.0 * (kt + torch.einsum("bhve,bhe->bhv", W1_0, hh) - vt)  # (B, H, V)
        else:
            g = vt
        G1 = g[..., :, None] * hh[..., None, :]  # (B, H, V, E)
        dz = torch.einsum("bhve,bhv->bhe", W1_0, g) * gelu_grad(z)  # (B, H, E)
        G2 = dz[..., :, None] * kt[..., None, :]  # (B, H, E, K)
        lr = eta[:, t, :, None, None]  # (B, H, 1, 1)
        if titans:
            assert Z1 is not None and Z2 is not None
            mt, at = m[:, t, :, None, None], a[:, t, :, None, None]
            Z1 = mt * Z1 - lr * G1
            Z2 = mt * Z2 - lr * G2
            W1 = at * W1 + Z1
            W2 = at * W2 + Z2
        else:
            W1 = W1 + lr * G1
            W2 = W2 + lr * G2
        fill += 1
        if fill == inner_chunk:
            W1_0, W2_0, fill = W1, W2, 0
        hx = torch.einsum("bhek,bhk->bhe", W2, x[:, t])  # (B, H, E)
        y = mid(hx[:, None], t, t + 1)[:, 0]  # (B, H, E)
        outs.append(torch.einsum("bhve,bhe->bhv", W1, y))
        ys.append(y)
    new: DeepState = {"W1": W1.clone(), "W2": W2.clone(), "W1_0": W1_0.clone(),
                      "W2_0": W2_0.clone()}
    if titans:
        assert Z1 is not None and Z2 is not None
        new["Z1"], new["Z2"] = Z1.clone(), Z2.clone()
    new["fill"] = torch.full_like(state["fill"], fill)
    E = W1.shape[-1]
    if T == 0:
        return x.new_zeros(B, 0, H, v.shape[-1]), x.new_zeros(B, 0, H, E), new
    return torch.stack(outs, dim=1), torch.stack(ys, dim=1), new


def deep_scan_naive(
    state: DeepState, q: Tensor, k: Tensor, v: Tensor, eta: Tensor,
    a: Tensor | None = None, m: Tensor | None = None, *, memory: str, inner_chunk: int,
) -> tuple[Tensor, DeepState]:
    """Per-token twin of :func:`deep_scan`."""
    out, _, st = deep_online_apply_naive(
        state, k, v, q, _gelu_mid, eta, a, m, memory=memory, inner_chunk=inner_chunk
    )
    return q + out, st


# --------------------------------------------------------------------------------------
# Cached memories: weighted readout (grm/residual/...) and memory soup
# --------------------------------------------------------------------------------------


def deep_readout_mix(w1: Tensor, w2: Tensor, q: Tensor, w: Tensor) -> Tensor:
    """``sum_n w[:, t, n] M_n(q_t)`` for N fixed memories.

    w1 ``(B, N, H, V, E)``, w2 ``(B, N, H, E, K)``, q ``(B, T, H, K)``, w ``(B, T, N, H)`` ->
    ``(B, T, H, V)``. Note the identity term ``(sum_n w_n) q``. ``N = 0`` gives zeros.
    """
    z = torch.einsum("bnhek,bthk->btnhe", w2, q)  # (B, T, N, H, E)
    gw = gelu(z) * w.unsqueeze(-1)  # (B, T, N, H, E)
    out = torch.einsum("bnhve,btnhe->bthv", w1, gw)  # (B, T, H, V)
    return out + w.sum(dim=2).unsqueeze(-1) * q


def _soup_parts(
    w1: Tensor, w2: Tensor, q: Tensor, w_on: Tensor, w_cached: Tensor
) -> tuple[MidFn, Callable[[Tensor, Tensor], Tensor]]:
    hc = torch.einsum("bnhek,bthk,btnh->bthe", w2, q, w_cached)  # (B, T, H, E)

    def mid(h_on: Tensor, t0: int, t1: int) -> Tensor:
        return gelu(w_on[:, t0:t1, :, None] * h_on + hc[:, t0:t1])  # (B, L, H, E)

    def finish(out_on: Tensor, g: Tensor) -> Tensor:
        cached = torch.einsum("bnhve,bthe,btnh->bthv", w1, g, w_cached)  # (B, T, H, V)
        return q + w_on.unsqueeze(-1) * out_on + cached

    return mid, finish


def deep_scan_soup(
    state: DeepState, q: Tensor, k: Tensor, v: Tensor, eta: Tensor, a: Tensor | None,
    m: Tensor | None, w_on: Tensor, w1: Tensor, w2: Tensor, w_cached: Tensor, *, memory: str,
    inner_chunk: int,
) -> tuple[Tensor, DeepState]:
    """Memory soup over the online memory and N cached ones (dual form).

    ``y_t = M_{theta*}(q_t)`` with ``theta* = w_on[t] theta_t + sum_n w_cached[t, n] theta_n``,
    ``theta_t`` the online weights after t's update, i.e. ``h* = w_on W2_t q + sum_n w_n W2_n q``,
    ``y = q + w_on W1_t gelu(h*) + sum_n w_n W1_n gelu(h*)`` (identity coefficient 1).

    w_on ``(B, T, H)``, w1 ``(B, N, H, V, E)``, w2 ``(B, N, H, E, K)``, w_cached
    ``(B, T, N, H)``; the rest as in :func:`deep_scan`. Returns ``y (B, T, H, V)`` and the
    online state after the last token.
    """
    mid, finish = _soup_parts(w1, w2, q, w_on, w_cached)
    out, g, st = deep_online_apply(
        state, k, v, q, mid, eta, a, m, memory=memory, inner_chunk=inner_chunk
    )
    return finish(out, g), st


def deep_scan_soup_naive(
    state: DeepState, q: Tensor, k: Tensor, v: Tensor, eta: Tensor, a: Tensor | None,
    m: Tensor | None, w_on: Tensor, w1: Tensor, w2: Tensor, w_cached: Tensor, *, memory: str,
    inner_chunk: int,
) -> tuple[Tensor, DeepState]:
    """Per-token twin of :func:`deep_scan_soup`."""
    mid, finish = _soup_parts(w1, w2, q, w_on, w_cached)
    out, g, st = deep_online_apply_naive(
        state, k, v, q, mid, eta, a, m, memory=memory, inner_chunk=inner_chunk
    )
    return finish(out, g), st
