"""The family of a layer whose whole state is a short-conv tail (LFM2's gated convolutions):
no memory to read or cache. It gives such a layer the same engine-facing state as every other
recurrent layer (an ``MCLayerState`` with an empty memory beside the conv tail), so the state
cache, resume points and preemption treat it like any other layer; Memory Caching has nothing
to cache in it (MC variants other than ``none`` are refused by the models that use it)."""

from __future__ import annotations

import torch
from torch import Tensor

from mcserve.models.memory.base import State


class NoMemory:
    name = "none"
    gate_names: tuple[str, ...] = ()
    readout_keys: tuple[str, ...] = ()
    linear = True

    def init_state(self, batch: int, heads: int, k_dim: int, v_dim: int, *, dtype: torch.dtype,
                   device: torch.device | str, init: dict[str, Tensor] | None = None) -> State:
        return {}

    def scan(self, state: State, q: Tensor, k: Tensor, v: Tensor, gates: dict[str, Tensor]
             ) -> tuple[Tensor, State]:
        raise NotImplementedError("a layer without memory has nothing to scan")

    def readout_mix(self, mem: State, q: Tensor, w: Tensor) -> Tensor:
        raise NotImplementedError("a layer without memory has nothing to read")
