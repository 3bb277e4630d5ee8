"""The contract every memory family (the update rule f of docs/mc.md) implements.

A family is a stateless object: parameters it needs (W^init for the deep memories) are passed in
by the mixer that owns them. States are plain ``dict[str, Tensor]`` whose tensors all lead with
the batch dimension B, so the MC layer (``mcserve.models.mc``) can stack, gather, reset and copy
them without knowing what is inside.

Shapes: q, k ``(B, T, H, K)``, v ``(B, T, H, V)``, every gate ``(B, T, H)``.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

State = dict[str, Tensor]


class MemoryFamily(Protocol):
    name: str
    #: gate names the family reads from ``gates`` (each ``(B, T, H)``); missing ones mean "all ones"
    #: for a, b, c, m-free defaults documented per family.
    gate_names: tuple[str, ...]
    #: state entries a *cached* block needs for readout (S for linear; W1, W2 for deep memories).
    readout_keys: tuple[str, ...]
    #: True when the memory is linear in its parameters AND its readout is linear in them, so that
    #: residual/post collapse to one summed state and soup equals grm.
    linear: bool

    def init_state(
        self, batch: int, heads: int, k_dim: int, v_dim: int, *, dtype: torch.dtype,
        device: torch.device | str, init: dict[str, Tensor] | None = None,
    ) -> State:
        """Online state at the start of a sequence (or of a segment in independent mode).

        ``init`` holds learned initial parameters (``w1`` ``(H, V, E)``, ``w2`` ``(H, E, K)`` for
        the deep families); linear families ignore it and start at zero.
        """
        ...

    def scan(self, state: State, q: Tensor, k: Tensor, v: Tensor, gates: dict[str, Tensor]
             ) -> tuple[Tensor, State]:
        """Run the recurrence over T tokens from ``state``.

        Returns ``o (B, T, H, V)`` with ``o[:, t] = M_t(q_t)`` read *after* token t's update, and
        the state after the last token. Must be associative: scanning a[:i] then a[i:] equals
        scanning a. ``state`` is not modified in place.
        """
        ...

    def readout_mix(self, mem: State, q: Tensor, w: Tensor) -> Tensor:
        """Weighted readout of fixed (cached) memories.

        ``mem[key]`` is ``(B, N, H, ...)`` for each key in ``readout_keys``; q ``(B, T, H, K)``;
        w ``(B, T, N, H)``. Returns ``(B, T, H, V)`` = Σ_n w[:, :, n] · M_n(q).
        """
        ...
