"""IBM's Granite-4.0-H (model_type ``granitemoehybrid``): Mamba2 layers and attention layers,
each followed by a shared MLP and, in the MoE models (Tiny, Small), a sparse mixture of experts.

Reads the directories transformers' ``GraniteMoeHybridForCausalLM.save_pretrained`` writes (and
the older expert names the published checkpoints use). Built on ``mcserve.models.bamba`` (the
same Mamba2 layers, attention and float32 RMSNorms); what differs, as transformers' modeling
file computes it:

    x = embed(ids) · embedding_multiplier
    per layer (``layer_types``: ``mamba``/``linear_attention`` or ``attention``/
    ``full_attention``):
        x = x + residual_multiplier · (Mamba2 | attention)(input_layernorm(x))
        h = post_attention_layernorm(x)
        x = x + residual_multiplier · (moe(h) + shared_mlp(h))    (shared_mlp(h) alone when
                                                                   num_local_experts == 0)
    logits = lm_head(norm(x)) / logits_scaling

* attention: scale ``attention_multiplier`` (not head_dim^-0.5); with
  ``position_embedding_type: rope`` rotary embeddings (the default rope_type over the whole
  head, as transformers computes it whatever ``partial_rotary_factor`` says), with ``nope`` or
  null none at all (the published Granite-4.0-H models); ``attention_bias`` on q/k/v/o;
* shared MLP: ``output_linear(silu(g) · u)`` with ``g, u = input_linear(h).chunk(2)``
  (``SwiGLU``, ``shared_intermediate_size``);
* MoE (``SparseMoE``, routing ``topk_softmax``): the ``num_experts_per_tok`` experts of largest
  router logit, weighted by a softmax over those logits; experts of ``intermediate_size``.

Post-hoc Memory Caching wraps the Mamba2 layers' memory (``mc_variant`` etc.); the attention
layers, MLPs and experts are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from mcserve.models.attention import Rotary, rotary_from_config
from mcserve.models.bamba import (
    ATTENTION,
    MAMBA,
    BambaConfig,
    BambaForCausalLM,
    hf_mamba_fields,
    hf_rope,
)
from mcserve.models.checkpoint import CheckpointError
from mcserve.models.importing import load_checked, renamers
from mcserve.models.layers import SwiGLU
from mcserve.models.moe import SparseMoE

#: transformers' names of the layer kinds, old and new, as ours
LAYER_TYPES = {"mamba": MAMBA, MAMBA: MAMBA, "attention": ATTENTION, ATTENTION: ATTENTION}
POSITION_EMBEDDINGS = (None, "nope", "rope")


@dataclass(frozen=True)
class GraniteHybridConfig(BambaConfig):
    """``BambaConfig`` and Granite's multipliers, shared MLP and experts (``n_experts`` 0: a
    dense model, the shared MLP alone). ``intermediate_size``: each expert's."""

    shared_intermediate_size: int = 128
    n_experts: int = 0
    top_k: int = 2
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0
    rope: dict[str, Any] | None = None
    model_type: str = "granitemoehybrid"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                     "logits_scaling"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{name} must be a number, got {v!r}")
            object.__setattr__(self, name, float(v))
        if self.logits_scaling == 0:
            raise ValueError("logits_scaling must not be 0 (the logits are divided by it)")
        if self.n_experts:
            if self.top_k < 1 or self.top_k > self.n_experts:
                raise ValueError(f"num_experts_per_tok {self.top_k} must be in [1, "
                                 f"num_local_experts {self.n_experts}]")


    def rotary(self) -> Rotary | None:
        if self.rope is None:
            return None
        if self.rope.get("rope_type", "default") == "default":  # the whole head, whatever else
            return Rotary(self.head_dim, self.head_dim,
                          float(self.rope.get("rope_theta", 10000.0)))
        return rotary_from_config({"rope_parameters": self.rope}, self.head_dim)


class GraniteFFN(nn.Module):
    """``moe(h) + shared(h)``, or ``shared(h)`` without experts."""

    def __init__(self, c: GraniteHybridConfig):
        super().__init__()
        self.shared = SwiGLU(c.d_model, c.shared_intermediate_size)
        self.moe = (SparseMoE(c.d_model, c.n_experts, c.top_k, c.intermediate_size,
                              routing="topk_softmax") if c.n_experts else None)

    def forward(self, h: Tensor) -> Tensor:
        y = self.shared(h)
        return y if self.moe is None else self.moe(h) + y


class GraniteHybridForCausalLM(BambaForCausalLM):
    """Granite-4.0-H (see the module docstring). State-dict names as ``BambaForCausalLM``'s,
    the MLP as ``blocks.{i}.mlp.shared.{up,down}`` and ``blocks.{i}.mlp.moe.*``."""

    config: GraniteHybridConfig

    def _attn_scale(self) -> float:
        return self.config.attention_multiplier

    def _residual_scale(self) -> float:
        return self.config.residual_multiplier

    def _mlp(self) -> nn.Module:
        return GraniteFFN(self.config)

    def _embed(self, input_ids: Tensor) -> Tensor:
        x = self.embed(input_ids)
        m = self.config.embedding_multiplier
        return x if m == 1.0 else x * m

    def _head(self, x: Tensor) -> Tensor:
        logits = self.lm_head(self.norm_f(x))
        s = self.config.logits_scaling
        return logits if s == 1.0 else logits / s


# ---------------------------------------------------------------------------- loading
def granite_hybrid_config_from_hf(cfg: dict, file: Path) -> GraniteHybridConfig:
    """A ``GraniteHybridConfig`` from transformers' ``GraniteMoeHybridConfig`` dict (its
    defaults)."""
    fields = hf_mamba_fields(cfg, file)
    n = fields["n_layers"]
    types = cfg.get("layer_types", cfg.get("layers_block_type"))
    if types is None:
        types = ["mamba"] * n if isinstance(n, int) else []
    bad = sorted({str(t) for t in types} - set(LAYER_TYPES))
    if bad:
        raise CheckpointError(f"{file}: layer_types {bad} are not supported (mamba, attention)")
    pos = cfg.get("position_embedding_type")
    if pos not in POSITION_EMBEDDINGS:
        raise CheckpointError(f"{file}: position_embedding_type {pos!r} is not supported "
                              f"(one of {list(POSITION_EMBEDDINGS)})")
    rope = None
    if pos == "rope":
        rope = hf_rope(cfg, partial=cfg.get("partial_rotary_factor"))
    experts = cfg.get("num_local_experts", 8) or 0
    try:
        return GraniteHybridConfig(
            layer_types=tuple(LAYER_TYPES[t] for t in types),
            intermediate_size=cfg.get("intermediate_size", 11008),
            shared_intermediate_size=cfg.get("shared_intermediate_size", 1024),
            n_experts=experts, top_k=cfg.get("num_experts_per_tok", 2),
            embedding_multiplier=cfg.get("embedding_multiplier", 1.0),
            residual_multiplier=cfg.get("residual_multiplier", 1.0),
            attention_multiplier=cfg.get("attention_multiplier", 1.0),
            logits_scaling=cfg.get("logits_scaling", 1.0), rope=rope,
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), **fields)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: invalid Granite-4.0-H config: {e}") from None


_OURS, _HF = renamers(
    (("model.embed_tokens.", "embed."), ("model.norm.", "norm_f."), ("model.layers.", "blocks.")),
    ((".input_layernorm.", ".norm1."), (".post_attention_layernorm.", ".norm2."),
     (".mamba.", ".mixer."), (".self_attn.", ".attn."),
     (".shared_mlp.input_linear.", ".mlp.shared.up."),
     (".shared_mlp.output_linear.", ".mlp.shared.down."),
     (".block_sparse_moe.", ".mlp.moe.")))

#: the expert names the published checkpoints use and transformers 5 still writes → the names
#: of its modules
_LEGACY = ((".block_sparse_moe.input_linear.weight", ".block_sparse_moe.experts.gate_up_proj"),
           (".block_sparse_moe.output_linear.weight", ".block_sparse_moe.experts.down_proj"),
           (".block_sparse_moe.router.layer.weight", ".block_sparse_moe.router.weight"))


def _our_name(src: str) -> str:
    for a, b in _LEGACY:
        if src.endswith(a):
            src = src[:-len(a)] + b
            break
    return _OURS(src)


def _hf_name(ours: str) -> str:
    """Our name → the transformers name as ``save_pretrained`` writes it (the older expert
    names)."""
    src = _HF(ours)
    for a, b in _LEGACY:
        if src.endswith(b):
            return src[:-len(b)] + a
    return src


def load_granite_hybrid(path: Path, cfg: dict, stored: dict[str, Tensor],
                        origin: dict[str, Path]) -> GraniteHybridForCausalLM:
    file = path / "config.json"
    gcfg = granite_hybrid_config_from_hf(cfg, file)
    return load_checked(GraniteHybridForCausalLM(gcfg), stored, origin, _our_name, _hf_name,
                        config_file=file, tied=gcfg.tie_embeddings, what="Granite-4.0-H")
