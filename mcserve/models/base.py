"""The model bases.

* ``RecurrentLM``: the base every recurrent LM the engine drives subclasses (the
  ``forward``/``forward_varlen``/``forward_paged`` contract of docs/engine.md);
* the Mamba family's: ``ConvSSMMixer`` (a short causal conv before the memory; Mamba2's,
  Mamba (v1)'s and Qwen3-Next's Gated DeltaNet mixers), ``MambaBlock`` (pre-norm residual) and
  ``MambaLM`` (embedding, blocks, final norm, LM head) of ``mamba2.py`` and ``mamba1.py``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mcserve.kernels import cpu as cpu_ops
from mcserve.models.importing import ConvInput, RebuildsUnderMC, causal_conv
from mcserve.models.layers import RMSNormF32
from mcserve.models.mc_state import PagedLayer
from mcserve.models.state import LayerState, ModelState
from mcserve.models.varlen import (
    check_varlen,
    conv_varlen,
    mix_sequence,
    mix_varlen,
    phase_runs,
    spans,
)


class RecurrentLM(nn.Module):
    """What every recurrent LM the engine drives shares: ``embed``, ``layers`` of blocks with
    ``forward(x, LayerState)``/``forward_paged(x, PagedLayer)`` and ``mixer.init_state``, and a
    ``_head``. The native model and the imported ones (``MambaLM`` below, ``HybridLM``...)
    subclass it."""

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


class ConvSSMMixer(nn.Module):
    """What Mamba2's and Mamba (v1)'s mixers share: the engine-facing ``forward`` (a sequence),
    ``forward_varlen`` (packed sequences) and ``forward_paged`` (one token per row) around a
    subclass's token-wise ``_pre_conv`` (in_proj: the conv's input and what the SSM takes
    beside it), ``_conv`` (the short conv of one span from its tail, on ``conv1d``'s weights),
    token-wise ``_post_conv`` (the SSM's inputs: z, xs, q, k, gates) and ``_output`` (D skip,
    gate, out_proj). ``_values`` turns xs into the memory's values."""

    def init_memory(self) -> None:
        return None  # the memory families start from zero

    def _values(self, xs: Tensor) -> Tensor:
        return xs

    def _project(self, x: Tensor, conv_tail: Tensor, inplace: bool = False,
                 keep_conv_input: bool = False):
        """x ``(B, T, D)`` → z, xs, q, k, gates (``_post_conv``) and the new conv tail.

        ``inplace`` (decode): ``conv_tail`` is shifted in place (``kernels.cpu.conv_step_``).
        ``keep_conv_input``: also return the conv's input ``(B, w - 1 + T, C)`` (for
        ``fill_conv_tails``)."""
        rest, xc = self._pre_conv(x)
        xc, conv_tail, full = self._conv(xc, conv_tail, inplace)
        out = self._post_conv(rest, xc)
        return (*out, conv_tail, full) if keep_conv_input else (*out, conv_tail)

    def _conv(self, xc: Tensor, conv_tail: Tensor, inplace: bool = False
              ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Conv (``conv1d``) + bias + SiLU of one span of the conv's input ``(B, T, C)`` after
        the tail ``(B, w - 1, C)`` → the output, the new tail and the conv's input
        ``(B, w - 1 + T, C)`` (None when ``inplace`` and T = 1: the tail is shifted in place)."""
        T = xc.shape[1]
        w = self.conv1d.weight[:, 0]  # (C, w)
        if T == 1 and inplace:  # decode: conv + bias + silu in one pass, the tail shifted in place
            out = cpu_ops.conv_step_(conv_tail, xc[:, 0], w, self.conv1d.bias, True)[:, None]
            return out, conv_tail, None
        full = ConvInput(conv_tail.to(xc.dtype), xc)  # [tail; xc] (B, w-1+T, C)
        out = self._taps(full, w)
        if self.conv1d.bias is not None:
            out += self.conv1d.bias
        return F.silu(out, inplace=True), full.new_tail(), full

    @staticmethod
    def _taps(full: ConvInput, w: Tensor) -> Tensor:
        """The depthwise causal conv of the span with ``w`` ``(C, w)``, as w shifted
        multiply-adds (faster than grouped conv1d on CPU)."""
        return causal_conv(full, w)

    def forward(self, x: Tensor, state: LayerState) -> tuple[Tensor, LayerState]:
        z, xs, q, k, gates, conv, full = self._project(x, state.conv, keep_conv_input=True)
        y, state = mix_sequence(self.memory, state, q, k, self._values(xs), q, gates, None, conv,
                                full, self.cfg.conv_size)
        return self._output(z, xs, y), state

    def forward_varlen(self, x: Tensor, states: list[LayerState], lens: list[int]
                       ) -> tuple[Tensor, list[LayerState]]:
        """Sequences packed back to back, x ``(1, sum T, D)`` with lengths ``lens``, each from
        its own batch-of-one state: in_proj, the short conv (``conv_varlen``), the SSM's inputs
        and the output run once on the packed tokens, the memory per sequence on its slice
        (``mix_varlen``: consecutive sequences at one phase with equal lengths as one batch,
        ``phase_runs``; the plain linear memory on the kernel backend as one call). Returns
        ``(1, sum T, D)`` and each sequence's new state; equals ``forward`` per sequence."""
        runs = phase_runs(states, lens)
        rest, xc = self._pre_conv(x)
        xc, convs, fulls = conv_varlen(xc, states, lens, runs, self.conv1d.weight[:, 0],
                                        self.conv1d.bias)
        z, xs, q, k, gates = self._post_conv(rest, xc)
        y, states = mix_varlen(self.memory, states, lens, runs, q, k, self._values(xs), q, gates,
                               None, convs, fulls, self.cfg.conv_size)
        return self._output(z, xs, y), states

    def forward_paged(self, x: Tensor, pl: PagedLayer) -> Tensor:
        """One token per row of a ragged batch (see ``PagedLayer``); updates ``pl``."""
        if not pl.inplace:
            pl.conv = pl.conv.clone()
        z, xs, q, k, gates, pl.conv = self._project(x, pl.conv, inplace=True)
        return self._output(z, xs, self.memory.decode_paged(pl, q, k, self._values(xs), q,
                                                            gates))


class MambaBlock(nn.Module):
    """Pre-norm residual block of Mamba2 and Mamba (v1): x + mixer(RMSNorm(x)), summed in
    float32 at least with ``residual_in_fp32``. The mixer is ``mixer_class(cfg, layer_idx)``."""

    mixer_class: type[ConvSSMMixer]

    def __init__(self, cfg: Any, layer_idx: int):
        super().__init__()
        self.residual_in_fp32 = cfg.residual_in_fp32
        self.norm = RMSNormF32(cfg.d_model, cfg.norm_eps)
        self.mixer = self.mixer_class(cfg, layer_idx)

    def _residual(self, x: Tensor, h: Tensor) -> Tensor:
        if self.residual_in_fp32:
            dt = torch.promote_types(x.dtype, torch.float32)
            return x.to(dt) + h.to(dt)
        return x + h.to(x.dtype)

    def forward(self, x: Tensor, state: LayerState) -> tuple[Tensor, LayerState]:
        h, state = self.mixer(self.norm(x.to(self.norm.weight.dtype)), state)
        return self._residual(x, h), state

    def forward_varlen(self, x: Tensor, states: list[LayerState], lens: list[int]
                       ) -> tuple[Tensor, list[LayerState]]:
        """Packed sequences ``(1, sum T, D)`` (see ``ConvSSMMixer.forward_varlen``)."""
        h, states = self.mixer.forward_varlen(self.norm(x.to(self.norm.weight.dtype)), states,
                                              lens)
        return self._residual(x, h), states

    def forward_paged(self, x: Tensor, pl: PagedLayer) -> Tensor:
        return self._residual(x, self.mixer.forward_paged(
            self.norm(x.to(self.norm.weight.dtype)), pl))


class MambaLM(RebuildsUnderMC, RecurrentLM):
    """The LM around ``block_class`` blocks shared by Mamba2 and Mamba (v1): embedding, the
    blocks, a final RMSNorm and the LM head (tied to the embedding with ``tie_embeddings``).

    State-dict names: ``embed.weight``, ``layers.{i}.norm.weight``, ``layers.{i}.mixer.*``
    (as in transformers), ``norm_f.weight``, ``lm_head.weight``. Use
    ``mcserve.models.registry.load_model`` to read a transformers or ``mamba_ssm`` directory.
    """

    block_class: type[MambaBlock]

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(self.block_class(config, i)
                                    for i in range(config.n_layers))
        self.norm_f = RMSNormF32(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _head(self, x: Tensor) -> Tensor:
        return self.lm_head(self.norm_f(x.to(self.dtype)))
