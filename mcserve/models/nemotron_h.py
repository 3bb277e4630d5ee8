"""NVIDIA's Nemotron-H (model_type ``nemotron_h``): Mamba2, attention, MLP and MoE layers.

Reads the directories transformers' ``NemotronHForCausalLM.save_pretrained`` writes. The layers
come from ``layers_block_type`` (or the older ``hybrid_override_pattern`` string: ``M`` Mamba2,
``*`` attention, ``-`` MLP, ``E`` MoE). Every layer is ONE pre-norm residual step, as
transformers' modeling file computes it:

    x → RMSNorm → (Mamba2 | attention | MLP | MoE) → + x

then the final norm (``norm_f``) and the LM head (never tied to the embedding: transformers'
``NemotronHForCausalLM`` ties nothing, whatever ``tie_word_embeddings`` says; a checkpoint
with ``tie_word_embeddings`` and no ``lm_head.weight`` gets the embedding).

* Mamba2: ``Mamba2Mixer`` (``mcserve.models.mamba2``) with ``mamba_num_heads`` heads of
  ``mamba_head_dim``, ``n_groups`` B/C groups, the gated RMSNorm per group (gate before the
  norm), D per head, Δ clamped below at ``time_step_min`` (transformers' prefill clamp; its
  ``time_step_limit`` field is not read by the modeling code, nor here);
* attention: causal GQA without rotary embeddings or biases, scale ``head_dim ** -0.5``;
* MLP: ``down_proj(act(up_proj(x)))`` without a gate, ``mlp_hidden_act`` (``relu2`` = relu²);
* MoE: ``SparseMoE`` (``mcserve.models.moe``): sigmoid router with a score-correction bias and
  group-limited top-k, non-gated experts, a shared expert, optional latent projections.

Post-hoc Memory Caching applies to the Mamba2 layers (``mc_variant`` etc., as for Mamba2:
u = q = C); attention, MLP and MoE layers are unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from mcserve.config import validate_mc
from mcserve.models.attention import Attention
from mcserve.models.checkpoint import CheckpointError
from mcserve.models.hybrid import HybridBlock, HybridLM
from mcserve.models.importing import (
    ImportedConfig,
    RebuildsUnderMC,
    check_positive_ints,
    first_token_id,
    load_checked,
    mc_settings,
    require_keys,
)
from mcserve.models.layers import RMSNormF32
from mcserve.models.mamba2 import Mamba2Config, Mamba2Mixer
from mcserve.models.moe import ACTIVATIONS, SparseMoE

DEFAULT_SEGMENT_LEN = 2048

#: layer kinds, as one character each (``hybrid_override_pattern``)
_KINDS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*",
          "mlp": "-", "moe": "E"}
_PATTERN = {"M", "*", "-", "E"}


@dataclass(frozen=True)
class NemotronHConfig(ImportedConfig):
    vocab_size: int = 256
    d_model: int = 64
    pattern: str = "M*-"  # one character per layer: M Mamba2, * attention, - MLP, E MoE
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    mlp_act: str = "relu2"
    mlp_bias: bool = False
    mamba_n_heads: int = 4
    mamba_head_dim: int = 16
    state_size: int = 16
    n_groups: int = 1
    conv_size: int = 4
    use_bias: bool = False  # Mamba2's in_proj / out_proj
    use_conv_bias: bool = True
    time_step_min: float = 0.001
    norm_eps: float = 1e-5
    # MoE ("E" layers)
    n_experts: int = 8
    n_shared_experts: int = 1
    moe_intermediate_size: int = 128
    moe_shared_intermediate_size: int = 128
    moe_latent_size: int | None = None
    top_k: int = 2
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    tie_embeddings: bool = False
    max_position_embeddings: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    mc_variant: str = "none"
    mc_mode: str = "checkpoint"
    segment_len: int = DEFAULT_SEGMENT_LEN
    mc_top_k: int = 2
    model_type: str = "nemotron_h"

    def __post_init__(self) -> None:
        check_positive_ints(self, ("vocab_size", "d_model", "n_heads", "n_kv_heads", "head_dim",
                                   "intermediate_size", "mamba_n_heads", "mamba_head_dim",
                                   "state_size", "n_groups", "conv_size"))
        bad = sorted(set(self.pattern) - _PATTERN)
        if not self.pattern or bad:
            raise ValueError(f"layer pattern {self.pattern!r}: layer kinds {bad} are not "
                             f"supported (M Mamba2, * attention, - MLP, E MoE)")
        if "M" not in self.pattern:
            raise ValueError("a Nemotron-H without Mamba2 layers is a Transformer, not served "
                             "here")
        if self.mlp_act not in ACTIVATIONS:
            raise ValueError(f"mlp_hidden_act {self.mlp_act!r} is not supported "
                             f"({sorted(ACTIVATIONS)})")
        if self.mamba_n_heads % self.n_groups:
            raise ValueError(f"mamba_num_heads ({self.mamba_n_heads}) must be a multiple of "
                             f"n_groups ({self.n_groups})")
        if "E" in self.pattern:
            check_positive_ints(self, ("n_experts", "moe_intermediate_size",
                                       "moe_shared_intermediate_size", "top_k"))
            with torch.device("meta"):  # SparseMoE's own checks (top_k, groups), no memory
                _moe(self)
        validate_mc(self.mc_variant, self.mc_mode, self.segment_len, self.mc_top_k)

    @property
    def n_layers(self) -> int:
        return len(self.pattern)

    @property
    def mamba2(self) -> Mamba2Config:
        """The Mamba2 layers' config (their MC settings included)."""
        return Mamba2Config(
            vocab_size=self.vocab_size, d_model=self.d_model, n_layers=self.pattern.count("M"),
            n_heads=self.mamba_n_heads, head_dim=self.mamba_head_dim, state_size=self.state_size,
            n_groups=self.n_groups, conv_size=self.conv_size, use_bias=self.use_bias,
            use_conv_bias=self.use_conv_bias, norm_eps=self.norm_eps,
            gated_norm_eps=self.norm_eps, rmsnorm=True, norm_before_gate=False,
            time_step_limit=(self.time_step_min, math.inf), mc_variant=self.mc_variant,
            mc_mode=self.mc_mode, segment_len=self.segment_len, mc_top_k=self.mc_top_k)


class NemotronHMLP(nn.Module):
    """``down_proj(act(up_proj(x)))``: Nemotron-H's MLP, no gate."""

    def __init__(self, d_model: int, hidden: int, act: str, bias: bool):
        super().__init__()
        self.up_proj = nn.Linear(d_model, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, d_model, bias=bias)
        self.act = ACTIVATIONS[act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


def _moe(c: NemotronHConfig) -> SparseMoE:
    """An "E" layer: transformers' ``NemotronHMoE`` (its shared expert always present)."""
    return SparseMoE(c.d_model, c.n_experts, c.top_k, c.moe_intermediate_size,
                     routing="sigmoid", gated=False, act=c.mlp_act,
                     norm_topk_prob=c.norm_topk_prob,
                     routed_scaling_factor=c.routed_scaling_factor, n_group=c.n_group,
                     topk_group=c.topk_group, shared_intermediate=c.moe_shared_intermediate_size,
                     shared_gated=False, shared_bias=c.mlp_bias, latent_size=c.moe_latent_size,
                     latent_bias=c.mlp_bias)


class NemotronHForCausalLM(RebuildsUnderMC, HybridLM):
    """Nemotron-H (see the module docstring). State-dict names: ``embed.weight``,
    ``blocks.{i}.norm1`` (Mamba2 and attention layers) or ``norm2`` (MLP and MoE layers),
    ``blocks.{i}.mixer.*`` (Mamba2), ``blocks.{i}.attn.*``, ``blocks.{i}.mlp.*``, ``norm_f``,
    ``lm_head``."""

    def __init__(self, config: NemotronHConfig):
        super().__init__()
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        mcfg = c.mamba2
        blocks, ai, mi = [], 0, 0
        for kind in c.pattern:
            norm = RMSNormF32(c.d_model, c.norm_eps)
            if kind == "M":
                blk = HybridBlock(norm, mixer=Mamba2Mixer(mcfg, mi))
                mi += 1
            elif kind == "*":
                blk = HybridBlock(norm, attn=Attention(c.d_model, c.n_heads, c.n_kv_heads,
                                                       c.head_dim, ai, rotary=None))
                ai += 1
            elif kind == "-":
                blk = HybridBlock(None, norm2=norm, mlp=NemotronHMLP(
                    c.d_model, c.intermediate_size, c.mlp_act, c.mlp_bias))
            else:
                blk = HybridBlock(None, norm2=norm, mlp=_moe(c))
            blocks.append(blk)
        self.blocks = nn.ModuleList(blocks)
        self.norm_f = RMSNormF32(c.d_model, c.norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _head(self, x: Tensor) -> Tensor:
        return self.lm_head(self.norm_f(x))


# ---------------------------------------------------------------------------- loading
def layer_pattern(cfg: dict, file: Path) -> str:
    """The layer kinds of a transformers config as one character per layer."""
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("hybrid_override_pattern")
        if not isinstance(pattern, str):
            raise CheckpointError(f"{file}: required key 'layers_block_type' (or "
                                  f"'hybrid_override_pattern') is missing")
        bad = sorted(set(pattern) - _PATTERN)
        if bad:
            raise CheckpointError(f"{file}: hybrid_override_pattern has layer kinds {bad}; "
                                  f"supported: M, *, -, E")
        return pattern
    if not isinstance(types, list):
        raise CheckpointError(f"{file}: layers_block_type must be a list, got {types!r}")
    bad = sorted({str(t) for t in types} - set(_KINDS))
    if bad:
        raise CheckpointError(f"{file}: layers_block_type has layer types {bad}; supported: "
                              f"{sorted(_KINDS)}")
    return "".join(_KINDS[t] for t in types)


def nemotron_h_config_from_hf(cfg: dict, file: Path) -> NemotronHConfig:
    """A ``NemotronHConfig`` from transformers' ``NemotronHConfig`` dict (its defaults; the
    older ``mamba_*`` key names too, as transformers reads them)."""
    require_keys(cfg, file, ("hidden_size", "vocab_size"))

    def get(key, old, default):
        return cfg[key] if key in cfg else cfg.get(old, default)

    pattern = layer_pattern(cfg, file)
    act = cfg.get("mamba_hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{file}: mamba_hidden_act {act!r} is not supported (silu)")
    heads = cfg.get("num_attention_heads", 32)
    kv = cfg.get("num_key_value_heads") or heads
    train_len, mc = mc_settings(cfg, DEFAULT_SEGMENT_LEN)
    try:
        return NemotronHConfig(
            vocab_size=cfg["vocab_size"], d_model=cfg["hidden_size"], pattern=pattern,
            n_heads=heads, n_kv_heads=kv,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg.get("intermediate_size", 21504),
            mlp_act=cfg.get("mlp_hidden_act", "relu2"), mlp_bias=bool(cfg.get("mlp_bias", False)),
            mamba_n_heads=cfg.get("mamba_num_heads", 128),
            mamba_head_dim=cfg.get("mamba_head_dim", 64),
            state_size=cfg.get("ssm_state_size", 128),
            n_groups=get("n_groups", "mamba_n_groups", 8),
            conv_size=get("conv_kernel", "mamba_d_conv", 4),
            use_bias=bool(cfg.get("use_bias", False)),
            use_conv_bias=bool(get("use_conv_bias", "mamba_conv_bias", True)),
            time_step_min=float(get("time_step_min", "mamba_dt_min", 0.001)),
            norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
            n_experts=cfg.get("n_routed_experts", cfg.get("num_local_experts", 8)),
            n_shared_experts=cfg.get("n_shared_experts", 1),
            moe_intermediate_size=cfg.get("moe_intermediate_size", 7688),
            moe_shared_intermediate_size=cfg.get("moe_shared_expert_intermediate_size", 7688),
            moe_latent_size=cfg.get("moe_latent_size"),
            top_k=cfg.get("num_experts_per_tok", 2),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            n_group=cfg.get("n_group", 1), topk_group=cfg.get("topk_group", 1),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            max_position_embeddings=train_len, bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=first_token_id(cfg.get("eos_token_id")),
            pad_token_id=cfg.get("pad_token_id"), **mc)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: invalid Nemotron-H config: {e}") from None


#: an "E" layer's names: transformers' (under ``mixer.``) and ours (under ``mlp.``)
_MOE = (("gate.weight", "router.weight"),
        ("gate.e_score_correction_bias", "e_score_correction_bias"),
        ("shared_experts.", "shared_expert."))


def _swap(tail: str, pairs) -> str:
    for a, b in pairs:
        if tail.startswith(a):
            return b + tail[len(a):]
    return tail


def _stack_experts(stored: dict[str, Tensor], origin: dict[str, Path]
                   ) -> tuple[dict[str, Tensor], dict[str, Path]]:
    """Saved checkpoints keep one tensor per expert (``...mixer.experts.{j}.up_proj.weight``,
    as transformers writes them): stacked into ``...mixer.experts.up_proj`` ``(E, ...)`` as
    transformers' module holds them. A missing expert is a ``CheckpointError``."""
    groups: dict[str, dict[int, str]] = {}
    for name in stored:
        head, sep, rest = name.partition(".experts.")
        if not sep:
            continue
        j, _, proj = rest.partition(".")
        if j.isdigit() and proj in ("up_proj.weight", "down_proj.weight"):
            groups.setdefault(f"{head}.experts.{proj[:-len('.weight')]}", {})[int(j)] = name
    if not groups:
        return stored, origin
    stored, origin = dict(stored), dict(origin)
    for target, parts in groups.items():
        n = max(parts) + 1
        if sorted(parts) != list(range(n)):
            gap = min(set(range(n)) - set(parts))
            raise CheckpointError(f"{origin[parts[max(parts)]]}: expert {gap} of {target!r} is "
                                  f"missing (experts 0..{n - 1} expected)")
        if target in stored:
            raise CheckpointError(f"{origin[target]}: {target!r} is stored both stacked and "
                                  f"per expert")
        stored[target] = torch.stack([stored.pop(parts[j]) for j in range(n)])
        origin[target] = origin[parts[0]]
        for j in range(n):
            origin.pop(parts[j])
    return stored, origin


def _namer(pattern: str):
    """(ours from the stored names, stored names from ours) for a model of ``pattern``: saved
    checkpoints name the base model ``backbone.`` (transformers' module is ``model.``; both
    are read)."""
    mixer = {"M": "mixer", "*": "attn", "-": "mlp", "E": "mlp"}
    norm = {"M": "norm1", "*": "norm1", "-": "norm2", "E": "norm2"}

    def ours(src: str) -> str:
        for pre in ("backbone.", "model."):
            if src.startswith(pre):
                rest = src[len(pre):]
                break
        else:
            return src
        for a, b in (("embeddings.", "embed."), ("norm_f.", "norm_f.")):
            if rest.startswith(a):
                return b + rest[len(a):]
        if rest.startswith("layers."):
            i, part, tail = (rest[len("layers."):].split(".", 2) + ["", ""])[:3]
            if i.isdigit() and int(i) < len(pattern) and part in ("norm", "mixer"):
                kind = pattern[int(i)]
                if kind == "E" and part == "mixer":
                    tail = _swap(tail, _MOE)
                return f"blocks.{i}.{norm[kind] if part == 'norm' else mixer[kind]}.{tail}"
        return src

    def hf(name: str) -> str:
        if name.startswith("embed."):
            return "backbone.embeddings." + name[len("embed."):]
        if name.startswith("norm_f."):
            return "backbone." + name
        if name.startswith("blocks."):
            i, part, tail = name[len("blocks."):].split(".", 2)
            if pattern[int(i)] == "E" and part == "mlp":
                tail = _swap(tail, [(b, a) for a, b in _MOE])
            part = "norm" if part.startswith("norm") else "mixer"
            return f"backbone.layers.{i}.{part}.{tail}"
        return name

    return ours, hf


def load_nemotron_h(path: Path, cfg: dict, stored: dict[str, Tensor], origin: dict[str, Path]
                    ) -> NemotronHForCausalLM:
    file = path / "config.json"
    ncfg = nemotron_h_config_from_hf(cfg, file)
    # transformers ignores the multi-token-prediction layers (``mtp.*``) when loading
    stored = {k: v for k, v in stored.items() if not k.startswith("mtp.")}
    stored, origin = _stack_experts(stored, origin)
    # transformers never ties the head; a checkpoint saved tied (no ``lm_head.weight``) gets the
    # embedding
    ncfg = ncfg.replace(tie_embeddings=bool(cfg.get("tie_word_embeddings", False))
                        and "lm_head.weight" not in stored)
    ours, hf = _namer(ncfg.pattern)
    return load_checked(NemotronHForCausalLM(ncfg), stored, origin, ours, hf, config_file=file,
                        tied=ncfg.tie_embeddings, what="Nemotron-H")
