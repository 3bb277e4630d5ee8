"""Delta-rule matrix memories: ``delta`` (DeltaNet) and ``gated_delta`` (Gated DeltaNet).

    delta:        S_t = (I − β_t k_t k_tᵀ)·S_{t-1} + β_t k_t v_tᵀ
    gated_delta:  S_t = α_t·(I − β_t k_t k_tᵀ)·S_{t-1} + β_t k_t v_tᵀ,   readout Sᵀq

The update is not linear in the writes (it reads S back through k_tᵀS), but a cached checkpoint
is just S and the readout Sᵀq is linear in S: a sum of readouts is the readout of the summed
states and a γ-mix of states reads out as the γ-mix of readouts. So ``linear = True``: residual
and post collapse to one summed state and soup equals grm, exactly as on the ``linear`` family.

Gates: ``beta`` (β, the write strength, absent = 1) and, for ``gated_delta``, ``log_a``
(log α ≤ 0, absent = no decay), each ``(B, T, H)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mcserve.kernels import cpu as cpu_ops
from mcserve.kernels.delta import chunk_delta_rule
from mcserve.models.memory.base import State
from mcserve.models.memory.linear import _readout_mix_linear, _readout_mix_linear_paged


class DeltaMemory:
    """S_t = (I − β_t k_t k_tᵀ)·S_{t-1} + β_t k_t v_tᵀ; readout Sᵀq."""

    name = "delta"
    gate_names: tuple[str, ...] = ("beta",)
    readout_keys = ("S",)
    linear = True

    def init_state(self, batch: int, heads: int, k_dim: int, v_dim: int, *,
                   dtype: torch.dtype, device: torch.device | str,
                   init: dict[str, Tensor] | None = None) -> State:
        return {"S": torch.zeros(batch, heads, k_dim, v_dim, dtype=dtype, device=device)}

    def _log_alpha(self, gates: dict[str, Tensor]) -> Tensor | None:
        return None

    def scan(self, state: State, q: Tensor, k: Tensor, v: Tensor, gates: dict[str, Tensor]
             ) -> tuple[Tensor, State]:
        o, S = chunk_delta_rule(q, k, v, gates.get("beta"), self._log_alpha(gates),
                                state["S"])
        return o, {"S": S}

    def step_(self, state: State, q: Tensor, k: Tensor, v: Tensor, gates: dict[str, Tensor]
              ) -> Tensor:
        """``scan`` of one token (T = 1) that updates ``state["S"]`` in place; returns o
        ``(B, 1, H, V)``.

        The engine's decode passes views of its slot pool here: the state is stepped where it
        lives (C++ on CPU: Sᵀk, then update + readout over the same block while it is in cache;
        else the torch twin ``kernels.cpu.twins.delta_step_``) instead of being gathered,
        stepped out of place and scattered back.
        """
        beta, log_a = gates.get("beta"), self._log_alpha(gates)
        o = cpu_ops.delta_step_(state["S"], q[:, 0], k[:, 0], v[:, 0],
                                None if log_a is None else log_a[:, 0],
                                None if beta is None else beta[:, 0])
        return o[:, None]

    def readout_mix(self, mem: State, q: Tensor, w: Tensor) -> Tensor:
        return _readout_mix_linear(mem["S"], q, w)

    readout_mix_paged = staticmethod(_readout_mix_linear_paged)  # reads the pool in place


class GatedDeltaMemory(DeltaMemory):
    """S_t = α_t·(I − β_t k_t k_tᵀ)·S_{t-1} + β_t k_t v_tᵀ; readout Sᵀq (α = exp(log_a))."""

    name = "gated_delta"
    gate_names = ("beta", "log_a")

    def _log_alpha(self, gates: dict[str, Tensor]) -> Tensor | None:
        return gates.get("log_a")
