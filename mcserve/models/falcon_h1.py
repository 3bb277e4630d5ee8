"""TII's Falcon-H1 (model_type ``falcon_h1``): Mamba2 and attention side by side in every layer.

Reads the directories transformers' ``FalconH1ForCausalLM.save_pretrained`` writes. Every layer,
as transformers' modeling file computes it (``m_*``: the config's µP multipliers):

    h = input_layernorm(x)
    x = x + m_ssm_out · mamba(m_ssm_in · h) + m_attn_out · attention(m_attn_in · h)
    x = x + m_down · down(silu(m_gate · gate(h')) · up(h')),   h' = pre_ff_layernorm(x)

then ``final_layernorm`` and ``m_lm_head · lm_head`` (tied to the embedding with
``tie_word_embeddings``); the embedding is scaled by ``embedding_multiplier``.

* Mamba2: mcserve's ``Mamba2Mixer`` (``mamba_n_heads`` heads of ``mamba_d_head``, inner size
  ``mamba_d_ssm`` or ``mamba_expand · hidden_size``, ``mamba_n_groups`` B/C groups, D per head,
  Δ clamped to ``time_step_limit`` as transformers' prefill does); its in_proj output is scaled
  per part by ``ssm_multipliers`` (the µP vector: z, x, B, C, Δ); the output gate is
  ``y·silu(z)`` or, with ``mamba_rms_norm``, a gated RMSNorm per group (``mamba_norm_before_gate``);
* attention: GQA with rotary embeddings (``rope_parameters``), biases with ``attention_bias``,
  keys scaled by ``key_multiplier``, scale ``head_dim ** -0.5``;
* MLP: gated SiLU (``mlp_multipliers``: gate, down), biases with ``mlp_bias``.

Every multiplier of a projection is folded into that projection's weights when loading (exact up
to float rounding): ``ssm_in_multiplier`` and the µP vector into ``in_proj`` (its bias takes the
µP vector only), ``ssm_out_multiplier`` into ``out_proj``, ``attention_in_multiplier`` into the
q/k/v weights (not their biases), ``key_multiplier`` into ``k_proj``,
``attention_out_multiplier`` into ``o_proj``, the MLP multipliers into ``gate_proj`` and
``down_proj``. The embedding and LM-head multipliers stay explicit (the two may share one
matrix). Mamba2's in_proj and out_proj take one bias setting here: when only one of
``mamba_proj_bias`` (in_proj) and ``projectors_bias`` (out_proj) is set, the other gets a zero
bias.

Post-hoc Memory Caching applies to the Mamba2 half of every layer (``mc_variant`` etc., as for
Mamba2: u = q = C); the attention half and the MLP are unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mcserve.config import validate_mc
from mcserve.models.attention import Attention, Rotary
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
from mcserve.models.layers import RMSNormF32
from mcserve.models.mamba2 import Mamba2Config, Mamba2Mixer

DEFAULT_SEGMENT_LEN = 2048


@dataclass(frozen=True)
class FalconH1Config(ImportedConfig):
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    attention_bias: bool = False
    mlp_bias: bool = False
    rope: dict[str, Any] = field(default_factory=lambda: {"rope_theta": 1e4,
                                                          "rope_type": "default"})
    mamba_n_heads: int = 4
    mamba_head_dim: int = 16
    state_size: int = 16
    n_groups: int = 1
    conv_size: int = 4
    mamba_bias: bool = False  # in_proj and out_proj (see the module docstring)
    use_conv_bias: bool = True
    mamba_rms_norm: bool = False
    norm_before_gate: bool = True
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    norm_eps: float = 1e-5
    embedding_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0
    tie_embeddings: bool = False
    max_position_embeddings: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    mc_variant: str = "none"
    mc_mode: str = "checkpoint"
    segment_len: int = DEFAULT_SEGMENT_LEN
    mc_top_k: int = 2
    model_type: str = "falcon_h1"

    def __post_init__(self) -> None:
        check_positive_ints(self, ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                                   "head_dim", "intermediate_size", "mamba_n_heads",
                                   "mamba_head_dim", "state_size", "n_groups", "conv_size"))
        lo, hi = self.time_step_limit
        object.__setattr__(self, "time_step_limit", (float(lo), float(hi)))
        for name in ("embedding_multiplier", "lm_head_multiplier"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)!r}")
        validate_mc(self.mc_variant, self.mc_mode, self.segment_len, self.mc_top_k)
        _ = self.mamba2  # Mamba2Config's own checks (groups, time_step_limit)
        self.rotary()  # a rope type Rotary does not know

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["time_step_limit"] = list(self.time_step_limit)
        return d

    @classmethod
    def _from_dict_values(cls, data: dict[str, Any]) -> dict[str, Any]:
        if "time_step_limit" in data:
            data["time_step_limit"] = tuple(float(x) for x in data["time_step_limit"])
        return data

    def rotary(self) -> Rotary:
        return Rotary(self.head_dim, self.head_dim, float(self.rope.get("rope_theta", 1e4)),
                      self.rope)

    @property
    def mamba2(self) -> Mamba2Config:
        """The Mamba2 mixers' config (their MC settings included)."""
        return Mamba2Config(
            vocab_size=self.vocab_size, d_model=self.d_model, n_layers=self.n_layers,
            n_heads=self.mamba_n_heads, head_dim=self.mamba_head_dim, state_size=self.state_size,
            n_groups=self.n_groups, conv_size=self.conv_size, use_bias=self.mamba_bias,
            use_conv_bias=self.use_conv_bias, norm_eps=self.norm_eps,
            gated_norm_eps=self.norm_eps, rmsnorm=self.mamba_rms_norm,
            norm_before_gate=self.norm_before_gate, time_step_limit=self.time_step_limit,
            mc_variant=self.mc_variant, mc_mode=self.mc_mode, segment_len=self.segment_len,
            mc_top_k=self.mc_top_k)


class FalconH1MLP(nn.Module):
    """``down(silu(gate(x)) · up(x))`` with optional biases (the multipliers folded in)."""

    def __init__(self, d_model: int, hidden: int, bias: bool):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=bias)
        self.up_proj = nn.Linear(d_model, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled():
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.silu(self.gate_proj(x), inplace=True).mul_(self.up_proj(x)))


class FalconH1ForCausalLM(RebuildsUnderMC, HybridLM):
    """Falcon-H1 (see the module docstring). State-dict names: ``embed.weight``,
    ``blocks.{i}.norm1`` (input_layernorm), ``blocks.{i}.mixer.*`` (Mamba2),
    ``blocks.{i}.attn.*``, ``blocks.{i}.norm2`` (pre_ff_layernorm), ``blocks.{i}.mlp.*``,
    ``norm_f``, ``lm_head``; the projections hold the multipliers folded in."""

    def __init__(self, config: FalconH1Config):
        super().__init__()
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        rotary = c.rotary()
        mcfg = c.mamba2
        self.blocks = nn.ModuleList(
            HybridBlock(RMSNormF32(c.d_model, c.norm_eps), mixer=Mamba2Mixer(mcfg, i),
                        attn=Attention(c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, i,
                                       rotary=rotary, bias=c.attention_bias),
                        norm2=RMSNormF32(c.d_model, c.norm_eps),
                        mlp=FalconH1MLP(c.d_model, c.intermediate_size, c.mlp_bias))
            for i in range(c.n_layers))
        self.norm_f = RMSNormF32(c.d_model, c.norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _embed(self, input_ids: Tensor) -> Tensor:
        x = self.embed(input_ids)
        m = self.config.embedding_multiplier
        return x if m == 1.0 else x * m

    def _head(self, x: Tensor) -> Tensor:
        logits = self.lm_head(self.norm_f(x))
        m = self.config.lm_head_multiplier
        return logits if m == 1.0 else logits * m


# ---------------------------------------------------------------------------- loading
@dataclass(frozen=True)
class Multipliers:
    """The µP multipliers transformers applies around the projections (folded when loading)."""

    ssm_in: float = 1.0
    ssm_out: float = 1.0
    ssm: tuple[float, ...] = (1.0,) * 5  # z, x, B, C, Δ parts of in_proj's output
    attn_in: float = 1.0
    attn_out: float = 1.0
    key: float = 1.0
    mlp: tuple[float, float] = (1.0, 1.0)  # gate, down


def _floats(cfg: dict, file: Path, key: str, n: int) -> tuple[float, ...]:
    val = cfg.get(key)
    if val is None:
        return (1.0,) * n
    if not isinstance(val, list) or len(val) != n or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in val):
        raise CheckpointError(f"{file}: {key} must be a list of {n} numbers, got {val!r}")
    return tuple(float(v) for v in val)


def falcon_h1_config_from_hf(cfg: dict, file: Path) -> tuple[FalconH1Config, Multipliers]:
    """A ``FalconH1Config`` and the multipliers to fold from transformers' ``FalconH1Config``
    dict (its defaults)."""
    require_keys(cfg, file, ("hidden_size", "num_hidden_layers", "vocab_size",
                             "num_attention_heads"))
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise CheckpointError(f"{file}: hidden_act {act!r} is not supported (silu)")
    D, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    d_ssm = cfg.get("mamba_d_ssm", 1024)
    if d_ssm is None:
        d_ssm = int(cfg.get("mamba_expand", 2) * D)
    m_heads = cfg.get("mamba_n_heads", 128)
    m_head_dim = cfg.get("mamba_d_head", "auto")
    if m_head_dim in ("auto", None):
        if not isinstance(m_heads, int) or m_heads < 1 or d_ssm % m_heads:
            raise CheckpointError(f"{file}: mamba_n_heads {m_heads!r} must divide the Mamba "
                                  f"inner size {d_ssm}")
        m_head_dim = d_ssm // m_heads
    if m_head_dim * m_heads != d_ssm:
        raise CheckpointError(f"{file}: mamba_d_head {m_head_dim} × mamba_n_heads {m_heads} is "
                              f"not the Mamba inner size {d_ssm}")
    rope = dict(cfg.get("rope_parameters") or {})
    if not rope:
        rope = {"rope_theta": cfg.get("rope_theta", 1e4), **(cfg.get("rope_scaling") or {})}
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise CheckpointError(f"{file}: partial_rotary_factor {partial} is not supported "
                              f"(transformers' Falcon-H1 rotates whole heads)")
    limit = cfg.get("time_step_limit") or (0.0, math.inf)
    if not isinstance(limit, (list, tuple)) or len(limit) != 2:
        raise CheckpointError(f"{file}: time_step_limit must be [low, high], got {limit!r}")
    mult = Multipliers(
        ssm_in=float(cfg.get("ssm_in_multiplier", 1.0)),
        ssm_out=float(cfg.get("ssm_out_multiplier", 1.0)),
        ssm=_floats(cfg, file, "ssm_multipliers", 5),
        attn_in=float(cfg.get("attention_in_multiplier", 1.0)),
        attn_out=float(cfg.get("attention_out_multiplier", 1.0)),
        key=float(cfg.get("key_multiplier", 1.0)), mlp=_floats(cfg, file, "mlp_multipliers", 2))
    train_len, mc = mc_settings(cfg, DEFAULT_SEGMENT_LEN)
    try:
        fcfg = FalconH1Config(
            vocab_size=cfg["vocab_size"], d_model=D, n_layers=cfg["num_hidden_layers"],
            n_heads=heads, n_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or D // heads,
            intermediate_size=cfg.get("intermediate_size", 14336),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)), rope=rope,
            mamba_n_heads=m_heads, mamba_head_dim=m_head_dim,
            state_size=cfg.get("mamba_d_state", 256), n_groups=cfg.get("mamba_n_groups", 1),
            conv_size=cfg.get("mamba_d_conv", 4),
            mamba_bias=bool(cfg.get("mamba_proj_bias", False)
                            or cfg.get("projectors_bias", False)),
            use_conv_bias=bool(cfg.get("mamba_conv_bias", True)),
            mamba_rms_norm=bool(cfg.get("mamba_rms_norm", False)),
            norm_before_gate=bool(cfg.get("mamba_norm_before_gate", True)),
            time_step_limit=tuple(limit), norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
            lm_head_multiplier=float(cfg.get("lm_head_multiplier", 1.0)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=train_len, bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=first_token_id(cfg.get("eos_token_id")),
            pad_token_id=cfg.get("pad_token_id"), **mc)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: invalid Falcon-H1 config: {e}") from None
    return fcfg, mult


def fold_multipliers(stored: dict[str, Tensor], c: FalconH1Config, m: Multipliers,
                     cfg: dict) -> dict[str, Tensor]:
    """``stored`` (transformers' names) with the multipliers folded into the projections and
    zero biases where Mamba2's in_proj or out_proj lacks the bias the other has (see the module
    docstring). Tensors are scaled in float32 at least, then stored in their own dtype."""
    out = dict(stored)
    DI, GN, H = c.mamba_n_heads * c.mamba_head_dim, c.n_groups * c.state_size, c.mamba_n_heads
    mup = torch.cat([torch.full((n,), v) for n, v in
                     zip((DI, DI, GN, GN, H), m.ssm, strict=True)])

    def scale(name: str, s) -> None:
        t = out.get(name)
        if t is None:
            return
        if isinstance(s, Tensor):
            if t.dim() == 0 or t.shape[0] != s.numel():
                return  # misshaped: load_checked names it
            s = s.view(-1, *([1] * (t.dim() - 1)))
        elif s == 1.0:
            return
        dt = torch.promote_types(t.dtype, torch.float32)
        out[name] = (t.to(dt) * s).to(t.dtype)

    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        if c.mamba_bias:
            for proj, n, key in (("in_proj", 2 * DI + 2 * GN + H, "mamba_proj_bias"),
                                 ("out_proj", c.d_model, "projectors_bias")):
                name = f"{p}mamba.{proj}.bias"
                if not cfg.get(key, False) and name not in out:
                    w = out.get(f"{p}mamba.{proj}.weight")
                    out[name] = torch.zeros(n, dtype=w.dtype if w is not None else torch.float32)
        scale(f"{p}mamba.in_proj.weight", mup * m.ssm_in)
        scale(f"{p}mamba.in_proj.bias", mup)
        for part in ("weight", "bias"):
            scale(f"{p}mamba.out_proj.{part}", m.ssm_out)
            scale(f"{p}self_attn.k_proj.{part}", m.key)
            scale(f"{p}self_attn.o_proj.{part}", m.attn_out)
            scale(f"{p}feed_forward.gate_proj.{part}", m.mlp[0])
            scale(f"{p}feed_forward.down_proj.{part}", m.mlp[1])
        for proj in ("q_proj", "k_proj", "v_proj"):
            scale(f"{p}self_attn.{proj}.weight", m.attn_in)
    return out


_RENAME = (("model.embed_tokens.", "embed."), ("model.final_layernorm.", "norm_f."),
           ("model.layers.", "blocks."))
_PARTS = ((".input_layernorm.", ".norm1."), (".pre_ff_layernorm.", ".norm2."),
          (".mamba.", ".mixer."), (".self_attn.", ".attn."), (".feed_forward.", ".mlp."))



_our_name, _hf_name = renamers(_RENAME, _PARTS)


def load_falcon_h1(path: Path, cfg: dict, stored: dict[str, Tensor], origin: dict[str, Path]
                   ) -> FalconH1ForCausalLM:
    file = path / "config.json"
    fcfg, mult = falcon_h1_config_from_hf(cfg, file)
    # the µP vector is a non-persistent buffer transformers computes from the config
    stored = {k: v for k, v in stored.items() if not k.endswith(".mamba.mup_vector")}
    origin = {k: v for k, v in origin.items() if k in stored}
    folded = fold_multipliers(stored, fcfg, mult, cfg)
    for name in folded.keys() - stored.keys():  # zero biases added: where their weight is
        origin[name] = origin.get(name.replace(".bias", ".weight"), file)
    return load_checked(FalconH1ForCausalLM(fcfg), folded, origin, _our_name, _hf_name,
                        config_file=file, tied=fcfg.tie_embeddings, what="Falcon-H1")
