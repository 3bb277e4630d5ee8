"""Liquid's LFM2 (model_type ``lfm2``): gated short convolutions and grouped-query attention.

Reads the directories transformers' ``Lfm2ForCausalLM.save_pretrained`` writes. Per layer
(``layer_types``: ``conv`` or ``full_attention``), as transformers' modeling file computes it:

    x → operator_norm → (short conv | attention) → + x → ffn_norm → SwiGLU (w1, w3, w2) → + x

then the final norm (``embedding_norm``) and the LM head (tied to the embedding by default).

* the short conv: ``B, C, x = in_proj(h).chunk(3)``; ``y = C · conv(B · x)`` (a causal
  depthwise conv of ``conv_L_cache`` taps, optional bias); ``out_proj(y)``. Its whole state is
  the last ``conv_L_cache - 1`` inputs ``B · x``: the engine keeps it like any recurrent
  layer's conv tail (``NoMemory``);
* attention: q/k/v projections, RMSNorm per head on q and k, rotary embeddings, causal GQA,
  ``out_proj``; its keys and values live in the engine's paged KV pool.

Memory Caching has no memory to cache in a conv layer: ``mc_variant`` must be ``none``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mcserve.config import MCConfig
from mcserve.models.attention import Attention, Rotary
from mcserve.models.checkpoint import CheckpointError
from mcserve.models.hybrid import HybridBlock, HybridLM
from mcserve.models.importing import (
    ConvInput,
    ImportedConfig,
    RebuildsUnderMC,
    causal_conv,
    check_positive_ints,
    first_token_id,
    load_checked,
    mc_settings,
    renamers,
    require_keys,
)
from mcserve.models.layers import GatedMLP, RMSNormF32
from mcserve.models.mc import MCMemory
from mcserve.models.mc_state import PagedLayer
from mcserve.models.memory.none import NoMemory
from mcserve.models.state import LayerState
from mcserve.models.varlen import spans

DEFAULT_SEGMENT_LEN = 2048


@dataclass(frozen=True)
class Lfm2Config(ImportedConfig):
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    layer_types: tuple[str, ...] = ("conv", "full_attention")
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 256  # after transformers' block_auto_adjust_ff_dim
    conv_size: int = 3  # conv_L_cache
    conv_bias: bool = False
    norm_eps: float = 1e-5
    rope: dict[str, Any] = field(default_factory=lambda: {"rope_theta": 1e6,
                                                          "rope_type": "default"})
    tie_embeddings: bool = True
    max_position_embeddings: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    mc_variant: str = "none"
    mc_mode: str = "checkpoint"
    segment_len: int = DEFAULT_SEGMENT_LEN
    mc_top_k: int = 2
    model_type: str = "lfm2"

    def __post_init__(self) -> None:
        check_positive_ints(self, ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                                   "head_dim", "intermediate_size", "conv_size"))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.n_layers} layers")
        bad = sorted(set(self.layer_types) - {"conv", "full_attention"})
        if bad:
            raise ValueError(f"layer_types {bad} are not supported (conv, full_attention)")
        if "conv" not in self.layer_types:
            raise ValueError("an LFM2 without conv layers is a Transformer, not served here")
        if self.mc_variant != "none":
            raise ValueError(f"mc_variant {self.mc_variant!r}: LFM2's short convolutions keep "
                             f"no memory for Memory Caching to cache; only 'none' applies")

    @property
    def mc(self) -> MCConfig:
        return MCConfig(variant="none", mode=self.mc_mode, segment_len=self.segment_len,
                        top_k=self.mc_top_k, share_uq=True)


class ShortConvMixer(nn.Module):
    """LFM2's gated short convolution (see the module docstring); parameter names as in
    transformers' ``Lfm2ShortConv``."""

    def __init__(self, cfg: Lfm2Config):
        super().__init__()
        D, W = cfg.d_model, cfg.conv_size
        self.W = W
        self.in_proj = nn.Linear(D, 3 * D, bias=cfg.conv_bias)
        self.conv = nn.Conv1d(D, D, W, groups=D, bias=cfg.conv_bias, padding=W - 1)
        self.out_proj = nn.Linear(D, D, bias=cfg.conv_bias)
        self.memory = MCMemory(NoMemory(), cfg.mc)

    def init_state(self, batch: int, dtype: torch.dtype, device) -> LayerState:
        mc = self.memory.init_state(batch, 1, 1, 1, dtype=dtype, device=device)
        conv = torch.zeros(batch, self.W - 1, self.conv.in_channels, dtype=dtype, device=device)
        return LayerState(mc, conv)

    def _gate_in(self, x: Tensor) -> tuple[Tensor, Tensor]:
        b, c, xx = self.in_proj(x).chunk(3, dim=-1)
        return b * xx, c

    def _conv(self, tail: Tensor, bx: Tensor) -> tuple[Tensor, Tensor]:
        inp = ConvInput(tail.to(bx.dtype), bx)
        y = causal_conv(inp, self.conv.weight[:, 0])
        if self.conv.bias is not None:
            y = y + self.conv.bias
        return y, inp.new_tail()

    def forward(self, x: Tensor, state: LayerState) -> tuple[Tensor, LayerState]:
        bx, c = self._gate_in(x)
        y, tail = self._conv(state.conv, bx)
        mc = replace(state.mc, pos=state.mc.pos + x.shape[1])
        return self.out_proj(c * y), LayerState(mc, tail)

    def forward_varlen(self, x: Tensor, states: list[LayerState], lens: list[int]
                       ) -> tuple[Tensor, list[LayerState]]:
        """Packed sequences ``(1, sum T, D)``: projections once, the conv per sequence."""
        bx, c = self._gate_in(x)
        ys, out = [], []
        for (s, e), st in zip(spans(lens), states, strict=True):
            y, tail = self._conv(st.conv, bx[:, s:e])
            ys.append(y)
            out.append(LayerState(replace(st.mc, pos=st.mc.pos + e - s), tail))
        y = ys[0] if len(ys) == 1 else torch.cat(ys, 1)
        return self.out_proj(c * y), out

    def forward_paged(self, x: Tensor, pl: PagedLayer) -> Tensor:
        """One token per row ``(B, 1, D)``; the conv tail ``pl.conv`` moves one row on."""
        with pl.gathered() as g:
            bx, c = self._gate_in(x)
            full = torch.cat([g.conv.to(bx.dtype), bx], 1)  # (B, W, D)
            y = (full * self.conv.weight[:, 0].t()).sum(1, keepdim=True)
            if self.conv.bias is not None:
                y = y + self.conv.bias
            if g.inplace:
                g.conv.copy_(full[:, 1:])
            else:
                g.conv = full[:, 1:].clone()
            return self.out_proj(c * y)


class Lfm2ForCausalLM(RebuildsUnderMC, HybridLM):
    """LFM2 (see the module docstring). State-dict names: ``embed.weight``,
    ``blocks.{i}.norm1``/``norm2`` (operator/ffn norms), ``blocks.{i}.mixer.*`` (conv layers),
    ``blocks.{i}.attn.*`` (attention layers), ``blocks.{i}.mlp.*``, ``norm_f``, ``lm_head``."""

    def __init__(self, config: Lfm2Config):
        super().__init__()
        self.config = config
        c = config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        rotary = Rotary(c.head_dim, c.head_dim, float(c.rope.get("rope_theta", 1e6)), c.rope)
        blocks, ai = [], 0
        for kind in c.layer_types:
            mixer = attn = None
            if kind == "conv":
                mixer = ShortConvMixer(c)
            else:
                attn = Attention(c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, ai,
                                 rotary=rotary, q_norm=RMSNormF32(c.head_dim, c.norm_eps),
                                 k_norm=RMSNormF32(c.head_dim, c.norm_eps))
                ai += 1
            blocks.append(HybridBlock(RMSNormF32(c.d_model, c.norm_eps), mixer, attn,
                                      RMSNormF32(c.d_model, c.norm_eps),
                                      GatedMLP(c.d_model, c.intermediate_size)))
        self.blocks = nn.ModuleList(blocks)
        self.norm_f = RMSNormF32(c.d_model, c.norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _head(self, x: Tensor) -> Tensor:
        return self.lm_head(self.norm_f(x))


# ---------------------------------------------------------------------------- loading
def lfm2_config_from_hf(cfg: dict, file: Path) -> Lfm2Config:
    """An ``Lfm2Config`` from transformers' ``Lfm2Config`` dict (its defaults)."""
    require_keys(cfg, file, ("hidden_size", "num_hidden_layers", "vocab_size",
                             "num_attention_heads", "intermediate_size"))
    D, n = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    types = cfg.get("layer_types")
    if types is None:
        idx = cfg.get("full_attn_idxs") or []
        types = ["full_attention" if i in idx else "conv" for i in range(n)]
    inter = cfg["intermediate_size"]
    if cfg.get("block_auto_adjust_ff_dim", True):  # as transformers' Lfm2MLP sizes it
        inter = int(2 * inter / 3)
        mult = cfg.get("block_ffn_dim_multiplier", 1.0)
        if mult is not None:
            inter = int(mult * inter)
            m = cfg.get("block_multiple_of", 256)
            inter = m * ((inter + m - 1) // m)
    rope = dict(cfg.get("rope_parameters") or {})
    if not rope:
        rope = {"rope_theta": cfg.get("rope_theta", 1e6), **(cfg.get("rope_scaling") or {})}
    train_len, mc = mc_settings(cfg, DEFAULT_SEGMENT_LEN)
    try:
        return Lfm2Config(
            vocab_size=cfg["vocab_size"], d_model=D, n_layers=n, layer_types=tuple(types),
            n_heads=heads, n_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or D // heads, intermediate_size=inter,
            conv_size=cfg.get("conv_L_cache", 3), conv_bias=bool(cfg.get("conv_bias", False)),
            norm_eps=float(cfg.get("norm_eps", 1e-5)), rope=rope,
            tie_embeddings=bool(cfg.get("tie_word_embeddings",
                                        cfg.get("tie_embedding", True))),
            max_position_embeddings=train_len, bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=first_token_id(cfg.get("eos_token_id")),
            pad_token_id=cfg.get("pad_token_id"), **mc)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: invalid LFM2 config: {e}") from None


_RENAME = (("model.embed_tokens.", "embed."), ("model.embedding_norm.", "norm_f."),
           ("model.layers.", "blocks."))
_PARTS = ((".operator_norm.", ".norm1."), (".ffn_norm.", ".norm2."), (".conv.", ".mixer."),
          (".self_attn.out_proj.", ".attn.o_proj."), (".self_attn.q_layernorm.", ".attn.q_norm."),
          (".self_attn.k_layernorm.", ".attn.k_norm."), (".self_attn.", ".attn."),
          (".feed_forward.w1.", ".mlp.gate_proj."), (".feed_forward.w3.", ".mlp.up_proj."),
          (".feed_forward.w2.", ".mlp.down_proj."))


_our_name, _hf_name = renamers(_RENAME, _PARTS)


def load_lfm2(path: Path, cfg: dict, stored: dict[str, Tensor], origin: dict[str, Path]
              ) -> Lfm2ForCausalLM:
    file = path / "config.json"
    lcfg = lfm2_config_from_hf(cfg, file)
    return load_checked(Lfm2ForCausalLM(lcfg), stored, origin, _our_name, _hf_name,
                        config_file=file, tied=lcfg.tie_embeddings, what="LFM2")
