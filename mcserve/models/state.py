"""The engine-facing state of a recurrent LM: ``LayerState`` per layer, ``ModelState`` for the
model (never modified in place; see docs/engine.md)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from mcserve.models.mc_state import MCLayerState


@dataclass
class LayerState:
    mc: MCLayerState
    conv: Tensor | None  # (B, conv_size - 1, C) last pre-conv inputs; None without a conv


@dataclass
class ModelState:
    layers: list[LayerState]

    @property
    def pos(self) -> int:
        return self.layers[0].mc.pos

    def map_tensors(self, fn) -> ModelState:
        return ModelState([
            LayerState(ls.mc.map_tensors(fn), None if ls.conv is None else fn(ls.conv))
            for ls in self.layers
        ])
