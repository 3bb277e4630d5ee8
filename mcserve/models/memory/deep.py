"""The deep memory families ``dla`` and ``titans`` (docs/deep-memory.md) as :class:`MemoryFamily`.

Memory per head: ``M_W(x) = x + W1 gelu(W2 x)``, ``W1 (V, E)``, ``W2 (E, K)``, ``K == V``, exact
GELU, starting from the learned ``W^init`` the mixer passes to :meth:`init_state`. Updates take
mini-batch steps of ``inner_chunk`` tokens (gradients at the inner chunk's starting weights); the
math lives in :mod:`mcserve.kernels.deep`, these classes only bind it to the protocol.

State (every tensor leads with B): ``W1`` ``(B, H, V, E)``, ``W2`` ``(B, H, E, K)``, the inner
chunk's starting weights ``W1_0``/``W2_0``, titans' momentum ``Z1``/``Z2``, and ``fill`` (long
``(B,)``, tokens already in the current inner chunk; equal across the batch).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mcserve.kernels.deep import deep_init_state, deep_readout_mix, deep_scan, deep_scan_soup
from mcserve.models.memory.base import State

__all__ = ["DLAMemory", "TitansMemory"]


class _DeepMemory:
    name: str = ""
    gate_names: tuple[str, ...] = ()
    readout_keys: tuple[str, ...] = ("W1", "W2")
    linear: bool = False

    def __init__(self, inner_chunk: int = 16) -> None:
        if isinstance(inner_chunk, bool) or not isinstance(inner_chunk, int) or inner_chunk < 1:
            raise ValueError(f"inner_chunk must be an int >= 1, got {inner_chunk!r}")
        self.inner_chunk = inner_chunk

    def __repr__(self) -> str:
        return f"{type(self).__name__}(inner_chunk={self.inner_chunk})"

    def _gates(self, gates: dict[str, Tensor]) -> tuple[Tensor, Tensor | None, Tensor | None]:
        if "eta" not in gates:
            raise ValueError(f"{self.name} memory needs the gate 'eta'")
        if self.name == "titans":
            return gates["eta"], gates.get("a"), gates.get("m")
        return gates["eta"], None, None

    def init_state(
        self, batch: int, heads: int, k_dim: int, v_dim: int, *, dtype: torch.dtype,
        device: torch.device | str, init: dict[str, Tensor] | None = None,
    ) -> State:
        """Online state at a sequence (or independent segment) start: ``W = W0 = W^init``.

        ``init`` must hold ``w1`` ``(H, V, E)`` and ``w2`` ``(H, E, K)`` (shared by the batch).
        """
        if init is None or "w1" not in init or "w2" not in init:
            raise ValueError(f"{self.name} memory needs init={{'w1': ..., 'w2': ...}} (W^init)")
        if k_dim != v_dim:
            raise ValueError(f"deep memories need k_dim == v_dim, got {k_dim} and {v_dim}")
        w1, w2 = init["w1"], init["w2"]
        E = w1.shape[-1]
        if tuple(w1.shape) != (heads, v_dim, E) or tuple(w2.shape) != (heads, E, k_dim):
            raise ValueError(
                f"init w1 {list(w1.shape)} / w2 {list(w2.shape)} do not match "
                f"H={heads}, K=V={k_dim}"
            )
        return deep_init_state(self.name, batch, w1, w2, dtype=dtype, device=device)

    def scan(self, state: State, q: Tensor, k: Tensor, v: Tensor, gates: dict[str, Tensor]
             ) -> tuple[Tensor, State]:
        """``o (B, T, H, V)`` with ``o_t = M_{W_t}(q_t)`` after t's update, and the new state.

        q, k ``(B, T, H, K)``, v ``(B, T, H, V)``, gates ``(B, T, H)``.
        """
        eta, a, m = self._gates(gates)
        return deep_scan(
            state, q, k, v, eta, a, m, memory=self.name, inner_chunk=self.inner_chunk
        )

    def readout_mix(self, mem: State, q: Tensor, w: Tensor) -> Tensor:
        """``sum_n w_n M_n(q)``: mem W1 ``(B, N, H, V, E)``, W2 ``(B, N, H, E, K)``, q
        ``(B, T, H, K)``, w ``(B, T, N, H)`` -> ``(B, T, H, V)`` (identity term ``sum_n w_n q``).
        """
        return deep_readout_mix(mem["W1"], mem["W2"], q, w)

    def scan_soup(
        self, state: State, q: Tensor, k: Tensor, v: Tensor, gates: dict[str, Tensor],
        w_on: Tensor, mem: State, w_cached: Tensor,
    ) -> tuple[Tensor, State]:
        """Memory soup: ``y_t = M_{theta*}(q_t)``, ``theta* = w_on theta_t + sum_n w_n theta_n``.

        w_on ``(B, T, H)`` weighs the online weights after t's update; mem as in
        :meth:`readout_mix`; w_cached ``(B, T, N, H)``. The identity term has coefficient 1
        whatever the weights sum to. Returns ``y (B, T, H, V)`` and the online state.
        """
        eta, a, m = self._gates(gates)
        return deep_scan_soup(
            state, q, k, v, eta, a, m, w_on, mem["W1"], mem["W2"], w_cached,
            memory=self.name, inner_chunk=self.inner_chunk,
        )


class DLAMemory(_DeepMemory):
    """Deep linear attention: ``W_t = W_{t-1} + eta_t grad_W <M_W(k_t), v_t>``. Gate: ``eta``."""

    name = "dla"
    gate_names = ("eta",)


class TitansMemory(_DeepMemory):
    """Titans: ``Z_t = m_t Z_{t-1} - eta_t grad_W ||M_W(k_t) - v_t||^2``, ``W_t = a_t W + Z_t``.

    Gates ``eta``, ``a`` (missing: ones) and ``m`` (missing: zeros).
    """

    name = "titans"
    gate_names = ("eta", "a", "m")
