"""The ``rwkv7`` memory family: RWKV-7's generalised delta rule (docs/mc.md).

    S_t = diag(w_t)·S_{t-1} + b_t·(a_tᵀ S_{t-1}) + k_t v_tᵀ,    M(q) = Sᵀq

S ``(B, H, K, V)`` per head with keys on the rows, as the ``linear`` family: the rwkv package
keeps the transpose (values on the rows), so its state is ``S.transpose(-1, -2)``. Cached
checkpoints are S and the readout is linear in S, so every MC variant applies as for ``linear``
(``residual``/``post`` collapse to one summed state, ``soup`` equals ``grm``) and the cached
readouts reuse the linear family's (which read a pool block in place).

Gates are per channel, not per head: ``log_w`` (log decay, ≤ 0), ``a`` (removal key) and ``b``
(its write), each ``(B, T, H, K)``; all three are required.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mcserve.kernels import cpu as cpu_ops
from mcserve.kernels.rwkv7 import chunk_rwkv7
from mcserve.models.memory.base import State
from mcserve.models.memory.linear import _readout_mix_linear, _readout_mix_linear_paged


class RWKV7Memory:
    """Generalised delta rule with per-channel decay (RWKV-7's time-mixing state)."""

    name = "rwkv7"
    gate_names = ("log_w", "a", "b")
    readout_keys = ("S",)
    linear = True

    def init_state(self, batch: int, heads: int, k_dim: int, v_dim: int, *,
                   dtype: torch.dtype, device: torch.device | str,
                   init: dict[str, Tensor] | None = None) -> State:
        return {"S": torch.zeros(batch, heads, k_dim, v_dim, dtype=dtype, device=device)}

    def _check_gates(self, gates: dict[str, Tensor]) -> None:
        missing = [g for g in self.gate_names if g not in gates]
        if missing:
            raise ValueError(f"the rwkv7 memory needs the gates {list(self.gate_names)}; "
                             f"missing {missing}")

    def scan(self, state: State, q: Tensor, k: Tensor, v: Tensor, gates: dict[str, Tensor]
             ) -> tuple[Tensor, State]:
        self._check_gates(gates)
        o, S = chunk_rwkv7(q, k, v, gates["a"], gates["b"], gates["log_w"], state["S"])
        return o, {"S": S}

    def step_(self, state: State, q: Tensor, k: Tensor, v: Tensor, gates: dict[str, Tensor]
              ) -> Tensor:
        """``scan`` of one token (T = 1) that updates ``state["S"]`` in place; returns o
        ``(B, 1, H, V)``.

        The engine's decode passes views of its slot pool here: the state is stepped where it
        lives (C++ on CPU: aᵀS, then update + readout over the same block while it is in cache;
        else the torch twin ``kernels.cpu.twins.rwkv7_step_``) instead of being gathered,
        stepped out of place and scattered back.
        """
        self._check_gates(gates)
        o = cpu_ops.rwkv7_step_(state["S"], q[:, 0], k[:, 0], v[:, 0], gates["a"][:, 0],
                                gates["b"][:, 0], gates["log_w"][:, 0])
        return o[:, None]

    def readout_mix(self, mem: State, q: Tensor, w: Tensor) -> Tensor:
        return _readout_mix_linear(mem["S"], q, w)

    readout_mix_paged = staticmethod(_readout_mix_linear_paged)  # reads the pool in place
