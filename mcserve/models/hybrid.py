"""Hybrid language models: recurrent layers and attention layers in one stack (LFM2,
Granite-4.0-H, Bamba, Nemotron-H, Falcon-H1, Qwen3-Next, Jamba; docs/models.md).

``HybridLM`` is a ``RecurrentLM`` whose ``blocks`` are ``HybridBlock``s of three shapes: a
recurrent mixer (Mamba2, Mamba, Gated DeltaNet, a gated short conv), an attention layer, or
both side by side (Falcon-H1), each optionally followed by an MLP or MoE; a block may also be
an MLP alone (Nemotron-H). What the engine sees:

* ``layers``: the blocks with a recurrent mixer, in order: the state cache keeps their state
  exactly as for a pure recurrent model (slots, segment blocks, resume points);
* ``attn_layers``: the attention modules, in order (``Attention.index``): their keys and values
  live in the engine's paged KV pool (``kv_spec``), passed to ``forward_varlen`` and
  ``forward_paged`` as a ``PagedKV``.

The model's own ``forward(input_ids, state)`` keeps the KV in the state (``HybridState.attn``,
contiguous), so prefill + decode, any split of the tokens, equals one call, as for every model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from mcserve.models.attention import Attention, AttnBatch, KVState, PagedKV
from mcserve.models.base import RecurrentLM
from mcserve.models.mc_state import PagedLayer
from mcserve.models.state import LayerState, ModelState
from mcserve.models.varlen import check_varlen, spans


@dataclass
class HybridState(ModelState):
    """A ``ModelState`` (the recurrent layers) and the attention layers' contiguous KV."""

    attn: list[KVState] = field(default_factory=list)

    def map_tensors(self, fn) -> HybridState:
        base = super().map_tensors(fn)
        return HybridState(base.layers, [kv.map_tensors(fn) for kv in self.attn])


class HybridBlock(nn.Module):
    """``x + s·(mixer(norm1(x)) + attn(norm1(x)))``, then ``x + s·mlp(norm2(x))``: any of
    ``mixer``, ``attn``, ``mlp`` may be absent (``s``: ``residual_scale``). Families with other
    arrangements override ``_mix`` (both mixers' outputs into one) and ``_ffn``."""

    def __init__(self, norm1: nn.Module | None, mixer: nn.Module | None = None,
                 attn: Attention | None = None, norm2: nn.Module | None = None,
                 mlp: nn.Module | None = None, residual_scale: float = 1.0):
        super().__init__()
        self.norm1 = norm1
        self.mixer = mixer
        self.attn = attn
        self.norm2 = norm2
        self.mlp = mlp
        self.residual_scale = residual_scale

    def _mix(self, y: Tensor | None, a: Tensor | None) -> Tensor:
        """The mixers' outputs (either may be None) as one update of the stream."""
        return y if a is None else a if y is None else y + a

    def _add(self, x: Tensor, h: Tensor) -> Tensor:
        return x + h if self.residual_scale == 1.0 else x + h * self.residual_scale

    def _ffn(self, x: Tensor) -> Tensor:
        if self.mlp is None:
            return x
        return self._add(x, self.mlp(self.norm2(x) if self.norm2 is not None else x))

    def _in(self, x: Tensor) -> Tensor:
        return self.norm1(x) if self.norm1 is not None else x

    def forward(self, x: Tensor, ls: LayerState | None, kv: KVState | None, pos0: int
                ) -> tuple[Tensor, LayerState | None, KVState | None]:
        if self.mixer is not None or self.attn is not None:
            h = self._in(x)
            y = a = None
            if self.mixer is not None:
                y, ls = self.mixer(h, ls)
            if self.attn is not None:
                a, kv = self.attn(h, kv, pos0)
            x = self._add(x, self._mix(y, a))
        return self._ffn(x), ls, kv

    def forward_varlen(self, x: Tensor, lss: list[LayerState] | None, lens: list[int],
                       batch: AttnBatch) -> tuple[Tensor, list[LayerState] | None]:
        if self.mixer is not None or self.attn is not None:
            h = self._in(x)
            y = a = None
            if self.mixer is not None:
                y, lss = self.mixer.forward_varlen(h, lss, lens)
            if self.attn is not None:
                a = self.attn.forward_varlen(h, batch)
            x = self._add(x, self._mix(y, a))
        return self._ffn(x), lss

    def forward_paged(self, x: Tensor, pl: PagedLayer | None, batch: AttnBatch) -> Tensor:
        if self.mixer is not None or self.attn is not None:
            h = self._in(x)
            y = a = None
            if self.mixer is not None:
                y = self.mixer.forward_paged(h, pl)
            if self.attn is not None:
                a = self.attn.forward_paged(h, batch)
            x = self._add(x, self._mix(y, a))
        return self._ffn(x)


class HybridLM(RecurrentLM):
    """The model base of every hybrid family (see the module docstring). Subclasses set
    ``embed``, ``blocks`` (a ``ModuleList`` of ``HybridBlock``) and ``_head``; ``_embed``
    scales the embedding where a family does."""

    blocks: nn.ModuleList

    @property
    def layers(self) -> list[HybridBlock]:  # what the engine's state cache keeps
        return [b for b in self.blocks if b.mixer is not None]

    @property
    def attn_layers(self) -> list[Attention]:
        return [b.attn for b in self.blocks if b.attn is not None]

    def kv_spec(self) -> tuple[int, int, int]:
        """(attention layers, key/value heads, head dim) of the engine's KV pools."""
        attn = self.attn_layers
        shapes = {(a.Hkv, a.D) for a in attn}
        if len(shapes) != 1:
            raise ValueError(f"attention layers with different KV shapes {sorted(shapes)}")
        (hkv, d), = shapes
        return len(attn), hkv, d

    def _embed(self, input_ids: Tensor) -> Tensor:
        return self.embed(input_ids)

    def init_state(self, batch: int = 1) -> HybridState:
        return HybridState(
            [blk.mixer.init_state(batch, self.dtype, self.device) for blk in self.layers],
            [KVState.empty(batch, a.Hkv, a.D, self.dtype, self.device)
             for a in self.attn_layers])

    def forward(self, input_ids: Tensor, state: HybridState | None = None, *,
                last_only: bool = False) -> tuple[Tensor, HybridState]:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, tokens), got shape "
                             f"{tuple(input_ids.shape)}")
        if state is None:
            state = self.init_state(input_ids.shape[0])
        pos0 = state.pos
        x = self._embed(input_ids)
        layers, attn = list(state.layers), list(state.attn)
        ri = 0
        for blk in self.blocks:
            ls = layers[ri] if blk.mixer is not None else None
            kv = attn[blk.attn.index] if blk.attn is not None else None
            x, ls, kv = blk(x, ls, kv, pos0)
            if blk.mixer is not None:
                layers[ri] = ls
                ri += 1
            if blk.attn is not None:
                attn[blk.attn.index] = kv
        if last_only:
            x = x[:, -1:]
        return self._head(x), HybridState(layers, attn)

    @property
    def packs_varlen(self) -> bool:
        return True

    def forward_varlen(self, input_ids: Tensor, states: list[ModelState], lens: list[int],
                       kv: PagedKV | None = None, all_logits: bool = False
                       ) -> tuple[Tensor, list[ModelState]]:
        """``RecurrentLM.forward_varlen`` with the attention layers' KV either in each state
        (``HybridState.attn``, contiguous; the new states carry the longer KV) or, when ``kv``
        is given, in the engine's paged pool (the states' own ``attn`` is not read).
        ``all_logits``: every position's logits ``(sum T, V)`` instead of the last ones."""
        check_varlen(input_ids, states, lens)
        dev = input_ids.device
        ctx = [st.pos for st in states]
        positions = torch.cat([torch.arange(c, c + n, device=dev)
                               for c, n in zip(ctx, lens, strict=True)])[None]
        batch = AttnBatch(positions, ctx, lens, paged=kv,
                          prev=None if kv is not None else [st.attn for st in states])
        x = self._embed(input_ids)
        per_layer = []
        ri = 0
        for blk in self.blocks:
            lss = [st.layers[ri] for st in states] if blk.mixer is not None else None
            x, lss = blk.forward_varlen(x, lss, lens, batch)
            if blk.mixer is not None:
                per_layer.append(lss)
                ri += 1
        if all_logits:
            logits = self._head(x)[0]
        else:
            last = torch.tensor([e - 1 for _, e in spans(lens)], device=dev)
            logits = self._head(x[:, last])[0]
        out = []
        for i, st in enumerate(states):
            attn = batch.new[i] if kv is None else getattr(st, "attn", [])
            out.append(HybridState([lss[i] for lss in per_layer], list(attn)))
        return logits, out

    def forward_paged(self, input_ids: Tensor, layers: list[PagedLayer],
                      kv: PagedKV | None = None) -> Tensor:
        """One token per row ``(B, 1)`` → ``(B, 1, V)``; the recurrent layers' ``PagedLayer``
        views are updated in place, the attention layers read and write the pool ``kv``."""
        if kv is None:
            raise ValueError("a hybrid model decodes against a paged KV pool: pass kv")
        B = input_ids.shape[0]
        batch = AttnBatch((kv.lengths - 1)[:, None], kv.ctx, [1] * B, paged=kv)
        x = self._embed(input_ids)
        ri = 0
        for blk in self.blocks:
            pl = layers[ri] if blk.mixer is not None else None
            x = blk.forward_paged(x, pl, batch)
            if blk.mixer is not None:
                ri += 1
        return self._head(x)
