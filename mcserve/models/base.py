"""``RecurrentLM``: the model base every recurrent LM the engine drives subclasses (the
``forward``/``forward_varlen``/``forward_paged`` contract of docs/engine.md)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor, nn

from mcserve.models.mc_state import PagedLayer
from mcserve.models.state import ModelState
from mcserve.models.varlen import check_varlen, spans


class RecurrentLM(nn.Module):
    """What every recurrent LM the engine drives shares: ``embed``, ``layers`` of blocks with
    ``forward(x, LayerState)``/``forward_paged(x, PagedLayer)`` and ``mixer.init_state``, and a
    ``_head``. The native model and the imported ones (``mamba2.py``) subclass it."""

    def _head(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def max_graph_batch(self) -> int | None:
        """The largest decode batch whose step runs without a host sync on the model's device
        (what CUDA graphs can hold); None: no bound. A sparse MoE layer without its grouped
        path bounds it (``SparseMoE.max_sync_free_tokens``)."""
        from mcserve.models.moe import SparseMoE

        limits = [m.max_sync_free_tokens(self.dtype, self.device) for m in self.modules()
                  if isinstance(m, SparseMoE)]
        limits = [n for n in limits if n is not None]
        return min(limits) if limits else None

    def init_state(self, batch: int = 1) -> ModelState:
        return ModelState([blk.mixer.init_state(batch, self.dtype, self.device)
                           for blk in self.layers])

    def forward(self, input_ids: Tensor, state: ModelState | None = None, *,
                last_only: bool = False) -> tuple[Tensor, ModelState]:
        """input_ids ``(B, T)`` → logits ``(B, T, vocab)`` and the state after the last token.

        ``last_only``: logits of the last position only, ``(B, 1, vocab)``; the LM head of a
        large vocabulary over every prompt token otherwise dominates a long prefill.
        """
        if input_ids.dim() != 2:
            shape = tuple(input_ids.shape)
            raise ValueError(f"input_ids must be (batch, tokens), got shape {shape}")
        if state is None:
            state = self.init_state(input_ids.shape[0])
        x = self.embed(input_ids)
        new_layers = []
        for blk, ls in zip(self.layers, state.layers, strict=True):
            x, ls = blk(x, ls)
            new_layers.append(ls)
        if last_only:
            x = x[:, -1:]
        return self._head(x), replace(state, layers=new_layers)

    @property
    def packs_varlen(self) -> bool:
        """Whether ``forward_varlen`` runs the sequences packed: every block has a
        ``forward_varlen(x, layer_states, lens)``."""
        return all(callable(getattr(blk, "forward_varlen", None)) for blk in self.layers)

    def forward_varlen(self, input_ids: Tensor, states: list[ModelState], lens: list[int]
                       ) -> tuple[Tensor, list[ModelState]]:
        """Several sequences in one call, their tokens packed back to back: input_ids
        ``(1, sum T)``, sequence i has ``lens[i]`` tokens and continues from ``states[i]`` (a
        batch-of-one state, at any position). Returns the last position's logits of each
        sequence ``(n, vocab)`` and each sequence's new state; the same as ``forward`` on each
        sequence alone (``last_only``).

        With ``packs_varlen`` the token-wise work (embedding, norms, projections, MLPs, the LM
        head on the n last positions) and the short conv (each sequence from its own tail) run
        once over the packed tokens and only the MC memory per sequence on its slice,
        consecutive sequences at one phase with equal lengths as one batch (``phase_runs``: put
        such sequences next to each other; the gated linear memory without segments on the
        kernel backend: all of them in one call); otherwise the call runs ``forward`` on each
        sequence in turn. A checkpoint list
        in a layer's ``MCLayerState.record`` gets that sequence's checkpoints. The tensors of
        ``states`` are not modified.
        """
        check_varlen(input_ids, states, lens)
        if not self.packs_varlen:
            rows, new_states = [], []
            for (s, e), st in zip(spans(lens), states, strict=True):
                logits, st = self(input_ids[:, s:e], st, last_only=True)
                rows.append(logits[0, -1])
                new_states.append(st)
            return torch.stack(rows), new_states
        x = self.embed(input_ids)  # (1, L, D)
        per_layer = []  # [layer][sequence]
        for li, blk in enumerate(self.layers):
            x, lss = blk.forward_varlen(x, [st.layers[li] for st in states], lens)
            per_layer.append(lss)
        last = torch.tensor([e - 1 for _, e in spans(lens)], device=x.device)
        logits = self._head(x[:, last])[0]  # (n, V)
        return logits, [replace(st, layers=[lss[i] for lss in per_layer])
                        for i, st in enumerate(states)]

    def forward_paged(self, input_ids: Tensor, layers: list[PagedLayer]) -> Tensor:
        """Decode one token for each row of a ragged batch: input_ids ``(B, 1)`` → ``(B, 1, V)``.

        The rows may be at different positions with different numbers of cached segments; the
        ``PagedLayer`` views are updated in place (online memory, conv tail, key sums).
        """
        x = self.embed(input_ids)
        for blk, pl in zip(self.layers, layers, strict=True):
            x = blk.forward_paged(x, pl)
        return self._head(x)
