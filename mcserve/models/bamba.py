"""IBM's Bamba (model_type ``bamba``): Mamba2 layers and grouped-query attention layers.

Reads the directories transformers' ``BambaForCausalLM.save_pretrained`` writes. Per layer
(``attn_layer_indices`` name the attention layers, every other layer is Mamba2), as
transformers' modeling file computes it:

    x → input_layernorm → (Mamba2 | attention) → + x → pre_ff_layernorm → SwiGLU MLP → + x

then the final norm (``final_layernorm``) and the LM head (untied by default). Every RMSNorm
computes in float32 (``RMSNormF32``).

* Mamba2 layers are mcserve's ``Mamba2Mixer`` as it is (transformers' ``BambaMixer`` is the same
  math: in_proj → (z, xBC, dt), causal conv + bias + SiLU on xBC, ``n_groups`` groups of B and
  C, Δ = softplus(dt + dt_bias) clamped to ``time_step_limit``, A = -exp(A_log), D per head,
  the gated RMSNorm ``norm(y·silu(z))`` per group (``norm_before_gate`` false) with the model's
  ``rms_norm_eps``, out_proj). One difference, in transformers only: its one-token decode step
  does not clamp Δ to ``time_step_limit`` (its prefill does); mcserve clamps both, so the two
  agree for the default limit (0, inf) and every prefill;
* attention: q/k/v/o projections (``attention_bias`` on all four), rotary embeddings on the
  first half of each head (transformers hard-codes ``partial_rotary_factor`` 0.5 unless
  ``rope_parameters`` names another), causal GQA with scale head_dim^-0.5; its keys and values
  live in the engine's paged KV pool;
* MLP: ``down_proj(silu(gate_proj(x)) · up_proj(x))`` (``mlp_bias`` on all three).

Post-hoc Memory Caching wraps the Mamba2 layers' memory (``mc_variant`` etc., as in
``Mamba2Config``); the attention layers are unchanged. ``mcserve.models.granite_hybrid``
(Granite-4.0-H) builds on this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from mcserve.config import validate_mc
from mcserve.models.attention import Attention, Rotary, rotary_from_config
from mcserve.models.checkpoint import CheckpointError
from mcserve.models.hybrid import HybridBlock, HybridLM
from mcserve.models.importing import (
    ImportedConfig,
    RebuildsUnderMC,
    check_positive_ints,
    first_token_id,
    load_checked,
    mc_settings,
    renamers,
    require_keys,
)
from mcserve.models.layers import GatedMLP, RMSNormF32
from mcserve.models.mamba2 import Mamba2Config, Mamba2Mixer

DEFAULT_SEGMENT_LEN = 2048
MAMBA, ATTENTION = "linear_attention", "full_attention"


@dataclass(frozen=True)
class BambaConfig(ImportedConfig):
    """A Bamba model (and, through ``GraniteHybridConfig``, Granite-4.0-H). ``rope`` None: the
    attention layers have no rotary embedding."""

    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    layer_types: tuple[str, ...] = (MAMBA, ATTENTION)
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    attention_bias: bool = False
    mlp_bias: bool = False
    rope: dict[str, Any] | None = field(default_factory=lambda: {
        "rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5})
    mamba_n_heads: int = 8
    mamba_head_dim: int = 16
    mamba_n_groups: int = 1
    mamba_d_state: int = 16
    mamba_d_conv: int = 4
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_position_embeddings: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    mc_variant: str = "none"
    mc_mode: str = "checkpoint"
    segment_len: int = DEFAULT_SEGMENT_LEN
    mc_top_k: int = 2
    model_type: str = "bamba"

    def __post_init__(self) -> None:
        check_positive_ints(self, ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                                   "head_dim", "mamba_n_heads", "mamba_head_dim",
                                   "mamba_n_groups", "mamba_d_state", "mamba_d_conv"))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "time_step_limit", tuple(float(x)
                                                          for x in self.time_step_limit))
        if len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.n_layers} layers")
        bad = sorted(set(self.layer_types) - {MAMBA, ATTENTION})
        if bad:
            raise ValueError(f"layer_types {bad} are not supported ({MAMBA}, {ATTENTION})")
        if MAMBA not in self.layer_types:
            raise ValueError("a model without Mamba2 layers is a Transformer, not served here")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"num_attention_heads ({self.n_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.n_kv_heads})")
        validate_mc(self.mc_variant, self.mc_mode, self.segment_len, self.mc_top_k)
        self.rotary()  # an unsupported rope_type is an error here, not later
        _ = self.mamba2  # the Mamba2 layers' config: checks their shapes

    def rotary(self) -> Rotary | None:
        """The attention layers' rotary embedding (None: ``rope`` None)."""
        if self.rope is None:
            return None
        return rotary_from_config({"rope_parameters": self.rope}, self.head_dim)

    @property
    def mamba2(self) -> Mamba2Config:
        """The ``Mamba2Config`` of the Mamba2 layers (layer index = order among them)."""
        return Mamba2Config(
            vocab_size=self.vocab_size, d_model=self.d_model,
            n_layers=self.layer_types.count(MAMBA), n_heads=self.mamba_n_heads,
            head_dim=self.mamba_head_dim, state_size=self.mamba_d_state,
            n_groups=self.mamba_n_groups, conv_size=self.mamba_d_conv,
            use_bias=self.mamba_proj_bias, use_conv_bias=self.mamba_conv_bias,
            norm_eps=self.norm_eps, gated_norm_eps=self.norm_eps, rmsnorm=True,
            norm_before_gate=False, d_has_hdim=False, time_step_limit=self.time_step_limit,
            residual_in_fp32=False, tie_embeddings=self.tie_embeddings,
            mc_variant=self.mc_variant, mc_mode=self.mc_mode, segment_len=self.segment_len,
            mc_top_k=self.mc_top_k)

    @classmethod
    def _from_dict_values(cls, data: dict[str, Any]) -> dict[str, Any]:
        for key in ("layer_types", "time_step_limit"):
            if key in data:
                data[key] = tuple(data[key])
        return data


def gated_mlp(d_model: int, hidden: int, bias: bool) -> GatedMLP:
    """``GatedMLP`` (gate_proj, up_proj, down_proj), with biases when ``bias``."""
    mlp = GatedMLP(d_model, hidden)
    if bias:
        mlp.gate_proj = nn.Linear(d_model, hidden)
        mlp.up_proj = nn.Linear(d_model, hidden)
        mlp.down_proj = nn.Linear(hidden, d_model)
    return mlp


class BambaForCausalLM(RebuildsUnderMC, HybridLM):
    """Bamba (see the module docstring). State-dict names: ``embed.weight``,
    ``blocks.{i}.norm1``/``norm2``, ``blocks.{i}.mixer.*`` (Mamba2 layers, transformers'
    names), ``blocks.{i}.attn.*`` (attention layers), ``blocks.{i}.mlp.*``, ``norm_f``,
    ``lm_head``. Subclasses change ``_attn_scale``, ``_mlp``, ``_residual_scale``,
    ``_embed`` and ``_head``."""

    def __init__(self, config: BambaConfig):
        super().__init__()
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        rotary = c.rotary()
        mcfg = c.mamba2
        blocks, mi, ai = [], 0, 0
        for kind in c.layer_types:
            mixer = attn = None
            if kind == MAMBA:
                mixer = Mamba2Mixer(mcfg, mi)
                mi += 1
            else:
                attn = Attention(c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, ai,
                                 rotary=rotary, bias=c.attention_bias, scale=self._attn_scale())
                ai += 1
            blocks.append(HybridBlock(RMSNormF32(c.d_model, c.norm_eps), mixer, attn,
                                      RMSNormF32(c.d_model, c.norm_eps), self._mlp(),
                                      residual_scale=self._residual_scale()))
        self.blocks = nn.ModuleList(blocks)
        self.norm_f = RMSNormF32(c.d_model, c.norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _attn_scale(self) -> float | None:
        return None  # head_dim ** -0.5

    def _residual_scale(self) -> float:
        return 1.0

    def _mlp(self) -> nn.Module:
        c = self.config
        return gated_mlp(c.d_model, c.intermediate_size, c.mlp_bias)

    def _head(self, x: Tensor) -> Tensor:
        return self.lm_head(self.norm_f(x))


# ---------------------------------------------------------------------------- loading
def hf_mamba_fields(cfg: dict, file: Path, kv_heads: int | None = None) -> dict[str, Any]:
    """The Mamba2-layer, attention-shape and token fields Bamba's and Granite-4.0-H's
    transformers configs share (their defaults), as ``BambaConfig`` keyword arguments.
    ``kv_heads``: the family's default ``num_key_value_heads`` (None: as many as the heads)."""
    require_keys(cfg, file, ("hidden_size", "num_hidden_layers", "vocab_size",
                             "num_attention_heads"))
    D, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise CheckpointError(f"{file}: hidden_act {act!r} is not supported (only 'silu')")
    kv = cfg.get("num_key_value_heads", kv_heads) or heads
    expand = cfg.get("mamba_expand", 2)
    m_heads = cfg.get("mamba_n_heads", 128)
    m_dim = cfg.get("mamba_d_head", "auto")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
               for v in (D, heads, expand, m_heads)):
        raise CheckpointError(f"{file}: hidden_size, num_attention_heads, mamba_expand and "
                              f"mamba_n_heads must be positive integers")
    if m_dim in (None, "auto"):
        m_dim = expand * D // m_heads
    if m_dim * m_heads != expand * D:
        raise CheckpointError(f"{file}: mamba_n_heads * mamba_d_head ({m_heads} * {m_dim}) must "
                              f"equal mamba_expand * hidden_size ({expand} * {D})")
    limit = cfg.get("time_step_limit") or (0.0, math.inf)
    train_len, mc = mc_settings(cfg, DEFAULT_SEGMENT_LEN)
    return dict(
        vocab_size=cfg["vocab_size"], d_model=D, n_layers=cfg["num_hidden_layers"],
        n_heads=heads, n_kv_heads=kv, head_dim=cfg.get("head_dim") or D // heads,
        attention_bias=bool(cfg.get("attention_bias", False)), mamba_n_heads=m_heads,
        mamba_head_dim=m_dim, mamba_n_groups=cfg.get("mamba_n_groups", 1),
        mamba_d_state=cfg.get("mamba_d_state", 256), mamba_d_conv=cfg.get("mamba_d_conv", 4),
        mamba_conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        mamba_proj_bias=bool(cfg.get("mamba_proj_bias", False)), time_step_limit=tuple(limit),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=train_len, bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=first_token_id(cfg.get("eos_token_id")),
        pad_token_id=cfg.get("pad_token_id"), **mc)


def hf_rope(cfg: dict, *, partial: float | None) -> dict[str, Any]:
    """The rotary parameters of a transformers config (``rope_parameters``, or the older
    ``rope_theta`` + ``rope_scaling``), with ``partial_rotary_factor`` defaulting to
    ``partial``."""
    rope = dict(cfg.get("rope_parameters") or {})
    if not rope:
        rope = {"rope_theta": cfg.get("rope_theta", 10000.0), **(cfg.get("rope_scaling") or {})}
    rope.setdefault("rope_type", rope.get("type", "default"))
    if partial is not None:
        rope.setdefault("partial_rotary_factor", partial)
    return rope


def bamba_config_from_hf(cfg: dict, file: Path) -> BambaConfig:
    """A ``BambaConfig`` from transformers' ``BambaConfig`` dict (its defaults)."""
    n = cfg.get("num_hidden_layers")
    fields = hf_mamba_fields(cfg, file, kv_heads=8)  # transformers' BambaConfig default
    idx = cfg.get("attn_layer_indices") or []
    if isinstance(n, int) and any(not isinstance(i, int) or not 0 <= i < n for i in idx):
        raise CheckpointError(f"{file}: attn_layer_indices {idx} must be layer indices in "
                              f"[0, {n})")
    types = tuple(ATTENTION if i in idx else MAMBA for i in range(n)) if isinstance(n, int) \
        else ()
    try:
        return BambaConfig(
            layer_types=types, intermediate_size=cfg.get("intermediate_size", 14336),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope=hf_rope(cfg, partial=0.5),  # transformers' BambaConfig: 0.5 unless given
            norm_eps=float(cfg.get("rms_norm_eps", 1e-5)), **fields)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: invalid Bamba config: {e}") from None


_OURS, _HF = renamers(
    (("model.embed_tokens.", "embed."), ("model.final_layernorm.", "norm_f."),
     ("model.layers.", "blocks.")),
    ((".input_layernorm.", ".norm1."), (".pre_ff_layernorm.", ".norm2."), (".mamba.", ".mixer."),
     (".self_attn.", ".attn."), (".feed_forward.", ".mlp.")))


def load_bamba(path: Path, cfg: dict, stored: dict[str, Tensor], origin: dict[str, Path]
               ) -> BambaForCausalLM:
    file = path / "config.json"
    bcfg = bamba_config_from_hf(cfg, file)
    return load_checked(BambaForCausalLM(bcfg), stored, origin, _OURS, _HF, config_file=file,
                        tied=bcfg.tie_embeddings, what="Bamba")


__all__ = ["BambaConfig", "BambaForCausalLM", "bamba_config_from_hf", "load_bamba"]
