"""AI21's Jamba (model_type ``jamba``): Mamba (v1) layers, attention layers and MoE MLPs.

Reads the directories transformers' ``JambaForCausalLM.save_pretrained`` writes (and the
per-expert layout of the Hub's original Jamba checkpoints). Layer i is an attention layer when
``i % attn_layer_period == attn_layer_offset``, else a Mamba layer; its MLP is a sparse MoE of
``num_experts`` experts when ``num_experts > 1`` and ``i % expert_layer_period ==
expert_layer_offset``, else a dense gated MLP. Per layer, as transformers' modeling file computes
it (every norm an RMSNorm computed in float32, weight · x̂, eps ``rms_norm_eps``):

    x → input_layernorm → (Mamba | attention) → + x → pre_ff_layernorm → (MLP | MoE) → + x

then ``final_layernorm`` and the LM head (untied by default).

* Mamba: transformers' ``JambaMambaMixer`` is Mamba (v1) with three more RMSNorms, on the
  x_proj outputs before they are used: ``dt_layernorm`` on the rank-``mamba_dt_rank`` Δ input,
  ``b_layernorm`` on B and ``c_layernorm`` on C. :class:`JambaMambaMixer` is
  ``mamba1.Mamba1Mixer`` (the selective SSM on the ``gla`` memory family, the engine contract
  as it is) with those norms applied where it computes Δ, B and C;
* attention: q/k/v/o projections without bias, causal grouped-query attention scaled by
  ``head_dim ** -0.5`` and no positional embedding at all (Jamba relies on the Mamba layers
  for position); its keys and values live in the engine's paged KV pool;
* MoE: softmax over the router logits, the top ``num_experts_per_tok`` weights kept as they are
  (not renormalised), experts gate_up_proj ``(E, 2I, D)`` / down_proj ``(E, D, I)``
  (``moe.SparseMoE``); older checkpoints' ``experts.{e}.gate_proj/up_proj/down_proj.weight``
  are stacked into that layout when loading.

Post-hoc Memory Caching (docs/mc.md) applies to the Mamba layers as to Mamba (v1): u = q = C_t,
no weights added; the attention layers keep their whole KV and are unchanged.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
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
    renamers,
    require_keys,
    up,
)
from mcserve.models.layers import GatedMLP, RMSNormF32
from mcserve.models.mamba1 import Mamba1Config, Mamba1Mixer
from mcserve.models.moe import SparseMoE

DEFAULT_SEGMENT_LEN = 2048


@dataclass(frozen=True)
class JambaConfig(ImportedConfig):
    """Architecture of a Jamba LM plus the post-hoc MC settings of its Mamba layers.

    ``head_dim`` is, as for ``Mamba1Config``, the recurrent memory's value dim (1, what the
    engine rebuilds memories with); the attention heads' dim is ``attn_head_dim``."""

    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4  # attention heads
    n_kv_heads: int = 2
    attn_head_dim: int = 16
    intermediate_size: int = 128
    attn_layer_period: int = 2
    attn_layer_offset: int = 1
    expert_layer_period: int = 2
    expert_layer_offset: int = 1
    num_experts: int = 1
    num_experts_per_tok: int = 2
    state_size: int = 16  # mamba_d_state
    conv_size: int = 4  # mamba_d_conv
    d_inner: int = 128  # mamba_expand * d_model
    dt_rank: int = 4
    use_conv_bias: bool = True  # mamba_conv_bias
    use_bias: bool = False  # mamba_proj_bias (in_proj / out_proj)
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    max_position_embeddings: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    mc_variant: str = "none"
    mc_mode: str = "checkpoint"
    segment_len: int = DEFAULT_SEGMENT_LEN
    mc_top_k: int = 2
    model_type: str = "jamba"

    def __post_init__(self) -> None:
        check_positive_ints(self, (
            "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "attn_head_dim",
            "intermediate_size", "attn_layer_period", "expert_layer_period", "num_experts",
            "num_experts_per_tok", "state_size", "conv_size", "d_inner", "dt_rank"))
        if self.model_type != "jamba":
            raise ValueError(f"model_type must be 'jamba', got {self.model_type!r}")
        for name in ("attn_layer", "expert_layer"):
            off, per = getattr(self, f"{name}_offset"), getattr(self, f"{name}_period")
            if not isinstance(off, int) or not 0 <= off < per:
                raise ValueError(f"{name}_offset {off!r} must be an integer in "
                                 f"[0, {name}_period={per})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"num_attention_heads {self.n_heads} is not a multiple of "
                             f"num_key_value_heads {self.n_kv_heads}")
        if self.num_experts > 1 and self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} exceeds "
                             f"num_experts {self.num_experts}")
        if "mamba" not in self.layer_kinds:
            raise ValueError("a Jamba without Mamba layers is a Transformer, not served here")
        validate_mc(self.mc_variant, self.mc_mode, self.segment_len, self.mc_top_k)

    @property
    def head_dim(self) -> int:
        return 1

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """``attention`` or ``mamba`` per layer (transformers' ``layers_block_type``)."""
        return tuple("attention" if i % self.attn_layer_period == self.attn_layer_offset
                     else "mamba" for i in range(self.n_layers))

    def is_moe(self, i: int) -> bool:
        """Whether layer i's MLP is the MoE (transformers' ``layers_num_experts[i] > 1``)."""
        return self.num_experts > 1 and i % self.expert_layer_period == self.expert_layer_offset

    @property
    def mamba(self) -> Mamba1Config:
        """The ``Mamba1Config`` the Mamba mixers are built from."""
        return Mamba1Config(
            vocab_size=self.vocab_size, d_model=self.d_model, n_layers=self.n_layers,
            d_inner=self.d_inner, state_size=self.state_size, dt_rank=self.dt_rank,
            conv_size=self.conv_size, use_bias=self.use_bias, use_conv_bias=self.use_conv_bias,
            norm_eps=self.norm_eps, mc_variant=self.mc_variant, mc_mode=self.mc_mode,
            segment_len=self.segment_len, mc_top_k=self.mc_top_k)


class JambaMambaMixer(Mamba1Mixer):
    """``Mamba1Mixer`` with Jamba's RMSNorms on Δ's input, B and C (``dt_layernorm``,
    ``b_layernorm``, ``c_layernorm``); parameter names as transformers' ``JambaMambaMixer``."""

    def __init__(self, cfg: JambaConfig, layer_idx: int):
        super().__init__(cfg.mamba, layer_idx)
        self.dt_layernorm = RMSNormF32(cfg.dt_rank, cfg.norm_eps)
        self.b_layernorm = RMSNormF32(cfg.state_size, cfg.norm_eps)
        self.c_layernorm = RMSNormF32(cfg.state_size, cfg.norm_eps)

    def _post_conv(self, z: Tensor, xs: Tensor):
        B, T, _ = xs.shape
        H, N, R = self.H, self.N, self.R
        dt, Bm, Cm = self.x_proj(xs).split([R, N, N], dim=-1)
        dt, Bm, Cm = self.dt_layernorm(dt), self.b_layernorm(Bm), self.c_layernorm(Cm)
        delta = F.softplus(up(F.linear(dt, self.dt_proj.weight)) + up(self.dt_proj.bias))
        A = -torch.exp(up(self.A_log))  # (H, N)
        k = Bm[:, :, None, :].expand(B, T, H, N)  # one key for every channel: a view
        q = Cm[:, :, None, :].expand(B, T, H, N)
        gates = {"log_a": (delta[..., None] * A).to(xs.dtype), "b": delta.to(xs.dtype)}
        return z, xs, q, k, gates


def _moe(cfg: JambaConfig) -> SparseMoE:
    return SparseMoE(cfg.d_model, cfg.num_experts, cfg.num_experts_per_tok,
                     cfg.intermediate_size, routing="softmax_topk", norm_topk_prob=False)


class JambaForCausalLM(RebuildsUnderMC, HybridLM):
    """Jamba (see the module docstring). State-dict names: ``embed.weight``,
    ``blocks.{i}.norm1``/``norm2`` (input / pre-FF norms), ``blocks.{i}.mixer.*`` (Mamba layers),
    ``blocks.{i}.attn.*`` (attention layers), ``blocks.{i}.mlp.*``, ``norm_f``, ``lm_head``."""

    def __init__(self, config: JambaConfig):
        super().__init__()
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        blocks, ai = [], 0
        for i, kind in enumerate(c.layer_kinds):
            mixer = attn = None
            if kind == "mamba":
                mixer = JambaMambaMixer(c, i)
            else:
                attn = Attention(c.d_model, c.n_heads, c.n_kv_heads, c.attn_head_dim, ai,
                                 rotary=None)
                ai += 1
            mlp = _moe(c) if c.is_moe(i) else GatedMLP(c.d_model, c.intermediate_size)
            blocks.append(HybridBlock(RMSNormF32(c.d_model, c.norm_eps), mixer, attn,
                                      RMSNormF32(c.d_model, c.norm_eps), mlp))
        self.blocks = nn.ModuleList(blocks)
        self.norm_f = RMSNormF32(c.d_model, c.norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _head(self, x: Tensor) -> Tensor:
        return self.lm_head(self.norm_f(x))


# ---------------------------------------------------------------------------- loading
#: config.json keys of options this importer does not implement, with the values it does
_ONLY = {"hidden_act": ("silu", "swish")}


def jamba_config_from_hf(cfg: dict, file: Path) -> JambaConfig:
    """A ``JambaConfig`` from transformers' ``JambaConfig`` dict (its defaults)."""
    require_keys(cfg, file, ("hidden_size", "num_hidden_layers", "vocab_size",
                             "num_attention_heads"))
    for key, ok in _ONLY.items():
        if key in cfg and cfg[key] not in ok:
            raise CheckpointError(f"{file}: {key} {cfg[key]!r} is not supported "
                                  f"(supported: {list(ok)})")
    D, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    rank = cfg.get("mamba_dt_rank", "auto")
    if rank == "auto" and isinstance(D, int):
        rank = math.ceil(D / 16)
    expand = cfg.get("mamba_expand", 2)
    head_dim = cfg.get("head_dim")
    if head_dim is None and isinstance(D, int) and isinstance(heads, int) and heads > 0:
        head_dim = D // heads
    kv = cfg.get("num_key_value_heads")
    train_len, mc = mc_settings(cfg, DEFAULT_SEGMENT_LEN)
    try:
        return JambaConfig(
            vocab_size=cfg["vocab_size"], d_model=D, n_layers=cfg["num_hidden_layers"],
            n_heads=heads, n_kv_heads=heads if kv is None else kv, attn_head_dim=head_dim,
            intermediate_size=cfg.get("intermediate_size", 14336),
            attn_layer_period=cfg.get("attn_layer_period", 8),
            attn_layer_offset=cfg.get("attn_layer_offset", 4),
            expert_layer_period=cfg.get("expert_layer_period", 2),
            expert_layer_offset=cfg.get("expert_layer_offset", 1),
            num_experts=cfg.get("num_experts", cfg.get("num_local_experts", 16)),
            num_experts_per_tok=cfg.get("num_experts_per_tok", 2),
            state_size=cfg.get("mamba_d_state", 16), conv_size=cfg.get("mamba_d_conv", 4),
            d_inner=int(expand * D), dt_rank=rank,
            use_conv_bias=bool(cfg.get("mamba_conv_bias", True)),
            use_bias=bool(cfg.get("mamba_proj_bias", False)),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=train_len, bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=first_token_id(cfg.get("eos_token_id")),
            pad_token_id=cfg.get("pad_token_id"), **mc)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: invalid Jamba config: {e}") from None


_RENAME = (("model.embed_tokens.", "embed."), ("model.final_layernorm.", "norm_f."),
           ("model.layers.", "blocks."))
_PARTS = ((".input_layernorm.", ".norm1."), (".pre_ff_layernorm.", ".norm2."),
          (".mamba.", ".mixer."), (".self_attn.", ".attn."), (".feed_forward.", ".mlp."))


_our_name, _hf_name = renamers(_RENAME, _PARTS)


_PER_EXPERT = re.compile(r"^(.*\.feed_forward\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)"
                         r"\.weight$")


def _stack_experts(stored: dict[str, Tensor], origin: dict[str, Path]
                   ) -> tuple[dict[str, Tensor], dict[str, Path]]:
    """The original checkpoints' one Linear per expert (``experts.{e}.gate_proj.weight``...)
    stacked into transformers 5's ``experts.gate_up_proj`` ``(E, 2I, D)`` (gate rows first)
    and ``experts.down_proj`` ``(E, D, I)``; other tensors as they are."""
    groups: dict[str, dict[str, dict[int, str]]] = {}
    out, where = {}, {}
    for name, t in stored.items():
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name], where[name] = t, origin[name]
            continue
        groups.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = name
    for prefix, parts in groups.items():
        any_name = next(iter(next(iter(parts.values())).values()))
        experts = range(1 + max(max(p) for p in parts.values()))
        for part in ("gate_proj", "up_proj", "down_proj"):
            lost = [e for e in experts if e not in parts.get(part, {})]
            if lost:
                raise CheckpointError(f"{origin[any_name]}: expert tensor {prefix}.{lost[0]}."
                                      f"{part}.weight is missing ({len(experts)} experts of "
                                      f"{prefix} are stored)")
        gate, up_, down = ([stored[parts[part][e]] for e in experts]
                           for part in ("gate_proj", "up_proj", "down_proj"))
        try:
            out[f"{prefix}.gate_up_proj"] = torch.cat([torch.stack(gate), torch.stack(up_)], 1)
            out[f"{prefix}.down_proj"] = torch.stack(down)
        except RuntimeError as e:
            raise CheckpointError(f"{origin[parts['gate_proj'][0]]}: the experts of {prefix} "
                                  f"have different shapes: {e}") from None
        where[f"{prefix}.gate_up_proj"] = origin[parts["gate_proj"][0]]
        where[f"{prefix}.down_proj"] = origin[parts["down_proj"][0]]
    return out, where


def load_jamba(path: Path, cfg: dict, stored: dict[str, Tensor], origin: dict[str, Path]
               ) -> JambaForCausalLM:
    file = path / "config.json"
    jcfg = jamba_config_from_hf(cfg, file)
    stored, origin = _stack_experts(stored, origin)
    try:
        model = JambaForCausalLM(jcfg)
    except ValueError as e:
        raise CheckpointError(f"{file}: {e}") from None
    return load_checked(model, stored, origin, _our_name, _hf_name, config_file=file,
                        tied=jcfg.tie_embeddings, what="Jamba")
