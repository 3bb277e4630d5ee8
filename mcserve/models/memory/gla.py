"""``gla``: the vector-gated linear memory, a decay per key dimension (GLA, Mamba1).

    S_t = diag(a_t)·S_{t-1} + b_t·k_t v_tᵀ,    readout Sᵀq

a_t ∈ (0, 1]^K per token, head and key dimension, passed as the gate ``log_a`` of shape
``(B, T, H, K)`` (the other families' gates are ``(B, T, H)``); b_t ``(B, T, H)``. The state and
readout are those of ``linear``, so a cached checkpoint is S at the boundary, residual/post
collapse to one summed state and soup equals grm: every MC variant applies unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mcserve.kernels import cpu as cpu_ops
from mcserve.kernels.gla_vector import chunk_gla_vec
from mcserve.models.memory.base import State
from mcserve.models.memory.linear import _readout_mix_linear, _readout_mix_linear_paged


class VectorGatedMemory:
    """S_t = diag(a_t)·S_{t-1} + b_t·k_t v_tᵀ; readout Sᵀq (``log_a`` ``(B, T, H, K)``)."""

    name = "gla"
    gate_names = ("log_a", "b")
    readout_keys = ("S",)
    linear = True

    def init_state(self, batch: int, heads: int, k_dim: int, v_dim: int, *,
                   dtype: torch.dtype, device: torch.device | str,
                   init: dict[str, Tensor] | None = None) -> State:
        return {"S": torch.zeros(batch, heads, k_dim, v_dim, dtype=dtype, device=device)}

    def scan(self, state: State, q: Tensor, k: Tensor, v: Tensor, gates: dict[str, Tensor]
             ) -> tuple[Tensor, State]:
        o, S = chunk_gla_vec(q, k, v, gates.get("log_a"), gates.get("b"), state["S"])
        return o, {"S": S}

    def step_(self, state: State, q: Tensor, k: Tensor, v: Tensor, gates: dict[str, Tensor]
              ) -> Tensor:
        """``scan`` of one token (T = 1) updating ``state["S"]`` in place (the engine's decode
        passes views of its slot pool); returns o ``(B, 1, H, V)``. One pass over S in C++ on
        CPU (decay, write and readout together), else the torch twin
        ``kernels.cpu.twins.gla_vec_step_``."""
        log_a, b = gates.get("log_a"), gates.get("b")
        o = cpu_ops.gla_vec_step_(state["S"], q[:, 0], k[:, 0], v[:, 0],
                                  None if log_a is None else log_a[:, 0],
                                  None if b is None else b[:, 0])
        return o[:, None]

    def readout_mix(self, mem: State, q: Tensor, w: Tensor) -> Tensor:
        return _readout_mix_linear(mem["S"], q, w)

    readout_mix_paged = staticmethod(_readout_mix_linear_paged)  # reads the pool in place
