"""Qwen3-Next (model_type ``qwen3_next``) and Qwen3.5's language models (``qwen3_5_text``,
``qwen3_5_moe_text``, and the text part of the ``qwen3_5`` / ``qwen3_5_moe`` image-text
checkpoints): Gated DeltaNet layers and gated attention.

Reads the directories transformers' ``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM``,
``Qwen3_5MoeForCausalLM`` and ``Qwen3_5(Moe)ForConditionalGeneration`` ``save_pretrained``
write (the image-text ones: ``text_config`` and the ``model.language_model.*`` tensors; the
vision tower is not loaded). Per layer (``layer_types``:
``linear_attention`` or ``full_attention``), as transformers' modeling files compute it:

    x → input_layernorm → (Gated DeltaNet | gated attention) → + x
      → post_attention_layernorm → (SwiGLU MLP | sparse MoE) → + x

then the final norm and the LM head (tied to the embedding with ``tie_word_embeddings``).

* every block norm, the final norm and attention's q/k norms are zero-centred RMSNorms:
  ``rms(x) · (1 + w)`` in float32 (:class:`RMSNormZeroCentred`);
* Gated DeltaNet (:class:`Qwen3NextDeltaMixer`): Qwen3-Next projects q, k, v, z with one
  ``in_proj_qkvz`` and b, a with ``in_proj_ba``, both grouped per key head (key head g holds
  its q, k, then the v and z of its ``num_v / num_k`` value heads; then its b's and a's);
  Qwen3.5 has four plain projections (``in_proj_qkv`` in q | k | v order, ``in_proj_z``,
  ``in_proj_b``, ``in_proj_a``). Then a causal depthwise conv (no bias) + SiLU over q, k, v;
  q and k l2-normalised (x / √(Σx² + 1e-6)), q scaled by K^-0.5; value head j reads key head
  j // (num_v / num_k); β = sigmoid(b), log α = −exp(A_log)·softplus(a + dt_bias); the gated
  delta rule (``memory/delta.py``, read out as Sᵀq); a per-head RMSNorm (plain weight) gated by
  silu(z); ``out_proj``;
* gated attention: ``q_proj`` emits each head's query and its output gate side by side
  (``(H, 2·D)``), q/k norms per head, rotary embeddings on the first
  ``partial_rotary_factor · head_dim`` channels, causal GQA at scale D^-0.5, the output times
  sigmoid(gate), ``o_proj`` (``mcserve.models.attention.Attention(output_gate=True)``).
  Qwen3.5's multimodal rotary (``mrope_section``) is plain rotary for text: its three position
  axes are equal;
* MLPs: Qwen3-Next's layer i is a sparse MoE (softmax router, top-k renormalised with
  ``norm_topk_prob``, a shared expert gated by sigmoid(``shared_expert_gate``)) when
  ``num_experts > 0``, i is not in ``mlp_only_layers`` and (i + 1) % ``decoder_sparse_step`` is
  0, else a SwiGLU MLP; Qwen3.5's text model is dense, Qwen3.5-MoE's is sparse in every layer
  (always renormalised).

Post-hoc MC applies to the Gated DeltaNet layers (their memories run under ``MCMemory``; u = q,
no weights added); the attention layers keep their whole KV. ``mc_variant="none"`` is the
model as trained. Not supported (a ``CheckpointError`` naming the key): ``hidden_act`` other
than silu, rope types other than default / linear / llama3, unknown layer types.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mcserve.config import validate_mc
from mcserve.models.attention import Attention, Rotary
from mcserve.models.base import ConvSSMMixer
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
from mcserve.models.importing import up as _up
from mcserve.models.layers import GatedMLP, GatedRMSNorm
from mcserve.models.mc import MCMemory
from mcserve.models.mc_state import PagedLayer
from mcserve.models.memory.delta import GatedDeltaMemory
from mcserve.models.state import LayerState

DEFAULT_SEGMENT_LEN = 2048
MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
#: image-text checkpoints whose language model (``text_config``) is served
WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
LAYER_TYPES = ("linear_attention", "full_attention")
_L2_EPS = 1e-6  # transformers' / fla's l2norm: x / sqrt(sum(x^2) + eps)
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Qwen3NextConfig(ImportedConfig):
    """A Qwen3-Next / Qwen3.5 text model (``model_type``) plus post-hoc MC settings.

    Gated DeltaNet: ``lin_k_heads`` key heads of ``lin_key_dim``, ``lin_v_heads`` value heads
    (the memory's heads) of ``lin_value_dim``. ``split_proj``: Qwen3.5's four input projections
    instead of Qwen3-Next's grouped ``in_proj_qkvz`` / ``in_proj_ba``. ``num_experts`` 0: every
    MLP is dense."""

    model_type: str = "qwen3_next"
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 4
    layer_types: tuple[str, ...] = ("linear_attention", "linear_attention", "linear_attention",
                                    "full_attention")
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    attention_bias: bool = False
    rope: dict[str, Any] = field(default_factory=lambda: {
        "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "rope_type": "default"})
    lin_k_heads: int = 2
    lin_v_heads: int = 4
    lin_key_dim: int = 16
    lin_value_dim: int = 16
    conv_size: int = 4
    split_proj: bool = False
    intermediate_size: int = 128
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 32
    shared_expert_intermediate_size: int = 32
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
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

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {self.model_type!r}")
        check_positive_ints(self, ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                                   "head_dim", "lin_k_heads", "lin_v_heads", "lin_key_dim",
                                   "lin_value_dim", "conv_size", "intermediate_size",
                                   "decoder_sparse_step"))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.n_layers} layers")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"layer_types {bad} are not supported ({', '.join(LAYER_TYPES)})")
        if "linear_attention" not in self.layer_types:
            raise ValueError("a model without linear_attention layers is a Transformer, not "
                             "served here")
        if self.lin_v_heads % self.lin_k_heads:
            raise ValueError(f"linear_num_value_heads ({self.lin_v_heads}) must be a multiple "
                             f"of linear_num_key_heads ({self.lin_k_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"num_attention_heads ({self.n_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.n_kv_heads})")
        if self.num_experts:
            check_positive_ints(self, ("num_experts", "num_experts_per_tok",
                                       "moe_intermediate_size",
                                       "shared_expert_intermediate_size"))
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                                 f"num_experts ({self.num_experts})")
        self.rotary()  # the rope settings are checked here
        validate_mc(self.mc_variant, self.mc_mode, self.segment_len, self.mc_top_k)

    def rotary(self) -> Rotary:
        """The attention layers' rotary embedding (partial: ``partial_rotary_factor``)."""
        kind = self.rope.get("rope_type", self.rope.get("type", "default"))
        if kind not in _ROPE_TYPES:
            raise ValueError(f"rope_type {kind!r} is not supported (supported: "
                             f"{', '.join(_ROPE_TYPES)})")
        factor = float(self.rope.get("partial_rotary_factor", 1.0))
        return Rotary(self.head_dim, int(self.head_dim * factor),
                      float(self.rope.get("rope_theta", 10000.0)), self.rope)

    def sparse(self, i: int) -> bool:
        """Whether layer i's MLP is the sparse MoE (transformers' rule)."""
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def _from_dict_values(cls, data: dict[str, Any]) -> dict[str, Any]:
        for key in ("layer_types", "mlp_only_layers"):
            if key in data:
                data[key] = tuple(data[key])
        return data


class RMSNormZeroCentred(nn.Module):
    """rms(x) · (1 + w) in float32, cast back to x's dtype (transformers' Qwen3NextRMSNorm;
    the weight starts at zero)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = F.rms_norm(_up(x), (x.shape[-1],), eps=self.eps)
        return (h * (1.0 + _up(self.weight))).to(x.dtype)


def _l2norm(x: Tensor) -> Tensor:
    h = _up(x)
    return (h * torch.rsqrt((h * h).sum(-1, keepdim=True) + _L2_EPS)).to(x.dtype)


class Qwen3NextDeltaMixer(ConvSSMMixer):
    """Qwen3-Next's / Qwen3.5's Gated DeltaNet on an MC gated delta-rule memory (see the module
    docstring). Parameter names as in transformers' ``Qwen3NextGatedDeltaNet`` /
    ``Qwen3_5GatedDeltaNet``; the engine-facing ``forward``/``forward_varlen``/
    ``forward_paged`` are ``ConvSSMMixer``'s."""

    def __init__(self, cfg: Qwen3NextConfig, layer_idx: int):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        D = cfg.d_model
        self.Hk, self.Hv = cfg.lin_k_heads, cfg.lin_v_heads
        self.K, self.V = cfg.lin_key_dim, cfg.lin_value_dim
        self.r = self.Hv // self.Hk
        key_dim, value_dim = self.Hk * self.K, self.Hv * self.V
        self.conv_dim = 2 * key_dim + value_dim
        if cfg.split_proj:
            self.in_proj_qkv = nn.Linear(D, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(D, value_dim, bias=False)
            self.in_proj_b = nn.Linear(D, self.Hv, bias=False)
            self.in_proj_a = nn.Linear(D, self.Hv, bias=False)
        else:
            self.in_proj_qkvz = nn.Linear(D, 2 * key_dim + 2 * value_dim, bias=False)
            self.in_proj_ba = nn.Linear(D, 2 * self.Hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.conv_size,
                                groups=self.conv_dim, bias=False, padding=cfg.conv_size - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.Hv))
        self.A_log = nn.Parameter(torch.zeros(self.Hv))
        self.norm = GatedRMSNorm(self.V, self.V, cfg.norm_eps, norm_before_gate=True)
        self.out_proj = nn.Linear(value_dim, D, bias=False)
        self.family = GatedDeltaMemory()
        self.memory = MCMemory(self.family, cfg.mc)

    def init_state(self, batch: int, dtype: torch.dtype, device) -> LayerState:
        mc = self.memory.init_state(batch, self.Hv, self.K, self.V, dtype=dtype, device=device)
        conv = torch.zeros(batch, self.cfg.conv_size - 1, self.conv_dim, dtype=dtype,
                           device=device)
        return LayerState(mc, conv)

    def _pre_conv(self, x: Tensor) -> tuple[tuple[Tensor, Tensor, Tensor], Tensor]:
        """x ``(B, T, D)`` → (z ``(B, T, Hv·V)``, b, a ``(B, T, Hv)``) and the conv's input
        ``(B, T, C)`` in q | k | v order."""
        B, T, _ = x.shape
        if self.cfg.split_proj:
            return (self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)), self.in_proj_qkv(x)
        K, rV, r, Hk = self.K, self.r * self.V, self.r, self.Hk
        q, k, v, z = self.in_proj_qkvz(x).view(B, T, Hk, 2 * K + 2 * rV).split(
            [K, K, rV, rV], dim=-1)
        b, a = self.in_proj_ba(x).view(B, T, Hk, 2 * r).split([r, r], dim=-1)
        xc = torch.cat([q.reshape(B, T, Hk * K), k.reshape(B, T, Hk * K),
                        v.reshape(B, T, Hk * rV)], dim=-1)
        return (z.reshape(B, T, Hk * rV), b.reshape(B, T, self.Hv),
                a.reshape(B, T, self.Hv)), xc

    def _post_conv(self, rest: tuple[Tensor, Tensor, Tensor], xc: Tensor):
        """The conv's output (after SiLU) → z, v, q, k, gates of the memory."""
        z, b, a = rest
        B, T, _ = xc.shape
        kd = self.Hk * self.K
        q, k, v = xc.split([kd, kd, self.Hv * self.V], dim=-1)
        q = _l2norm(q.reshape(B, T, self.Hk, self.K)) * self.K ** -0.5
        k = _l2norm(k.reshape(B, T, self.Hk, self.K))
        if self.r > 1:  # value head j reads key head j // r
            q = q.repeat_interleave(self.r, dim=2)
            k = k.repeat_interleave(self.r, dim=2)
        v = v.reshape(B, T, self.Hv, self.V)
        log_a = -torch.exp(_up(self.A_log)) * F.softplus(_up(a) + _up(self.dt_bias))
        gates = {"beta": torch.sigmoid(_up(b)).to(xc.dtype), "log_a": log_a.to(xc.dtype)}
        return z, v, q, k, gates

    def _output(self, z: Tensor, xs: Tensor, y: Tensor) -> Tensor:
        B, T, H, V = y.shape
        o = self.norm(y, z.reshape(B, T, H, V))
        return self.out_proj(o.reshape(B, T, H * V))

    def forward_paged(self, x: Tensor, pl: PagedLayer) -> Tensor:
        with pl.gathered() as g:
            return super().forward_paged(x, g)


def _moe(cfg: Qwen3NextConfig) -> nn.Module:
    from mcserve.models.moe import SparseMoE

    return SparseMoE(cfg.d_model, cfg.num_experts, cfg.num_experts_per_tok,
                     cfg.moe_intermediate_size, routing="softmax_topk",
                     norm_topk_prob=cfg.norm_topk_prob,
                     shared_intermediate=cfg.shared_expert_intermediate_size, shared_gate=True)


class Qwen3NextForCausalLM(RebuildsUnderMC, HybridLM):
    """Qwen3-Next / Qwen3.5 text (see the module docstring). State-dict names: ``embed``,
    ``blocks.{i}.norm1``/``norm2`` (input / post-attention norms), ``blocks.{i}.mixer.*``
    (Gated DeltaNet), ``blocks.{i}.attn.*``, ``blocks.{i}.mlp.*``, ``norm_f``, ``lm_head``."""

    def __init__(self, config: Qwen3NextConfig):
        super().__init__()
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        rotary = c.rotary()
        blocks, ai = [], 0
        for i, kind in enumerate(c.layer_types):
            mixer = attn = None
            if kind == "linear_attention":
                mixer = Qwen3NextDeltaMixer(c, i)
            else:
                attn = Attention(c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, ai,
                                 rotary=rotary, bias=c.attention_bias,
                                 q_norm=RMSNormZeroCentred(c.head_dim, c.norm_eps),
                                 k_norm=RMSNormZeroCentred(c.head_dim, c.norm_eps),
                                 output_gate=True)
                ai += 1
            mlp = _moe(c) if c.sparse(i) else GatedMLP(c.d_model, c.intermediate_size)
            blocks.append(HybridBlock(RMSNormZeroCentred(c.d_model, c.norm_eps), mixer, attn,
                                      RMSNormZeroCentred(c.d_model, c.norm_eps), mlp))
        self.blocks = nn.ModuleList(blocks)
        self.norm_f = RMSNormZeroCentred(c.d_model, c.norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _head(self, x: Tensor) -> Tensor:
        return self.lm_head(self.norm_f(x))


# ---------------------------------------------------------------------------- loading
def _get(cfg: dict, key: str, default: Any) -> Any:
    val = cfg.get(key)
    return default if val is None else val


def qwen3_next_config_from_hf(cfg: dict, file: Path) -> Qwen3NextConfig:
    """A ``Qwen3NextConfig`` from transformers' ``Qwen3NextConfig`` / ``Qwen3_5TextConfig`` dict
    (``model_type`` ``qwen3_next`` / ``qwen3_5_text``; transformers' defaults for absent keys),
    or from a ``qwen3_5`` image-text config's ``text_config``."""
    mt = cfg.get("model_type")
    if mt in WRAPPERS:
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(f"{file}: a {mt} config needs a 'text_config' object")
        tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        mt = WRAPPERS[mt]
        cfg = {**text, "model_type": mt, "tie_word_embeddings": tie}
    if mt not in MODEL_TYPES:
        raise CheckpointError(f"{file}: model_type {mt!r} is not one of "
                              f"{MODEL_TYPES + tuple(WRAPPERS)}")
    qwen35 = mt != "qwen3_next"
    require_keys(cfg, file, ("hidden_size", "num_hidden_layers", "vocab_size",
                             "num_attention_heads"))
    act = _get(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise CheckpointError(f"{file}: hidden_act {act!r} is not supported (only 'silu')")
    D, n, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    types = cfg.get("layer_types")
    if types is None:  # transformers' default: every full_attention_interval-th layer
        every = _get(cfg, "full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    rope = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    rope = {**scaling, **rope}
    rope.setdefault("rope_theta", _get(cfg, "rope_theta", 10000.0))
    rope.setdefault("partial_rotary_factor", _get(cfg, "partial_rotary_factor", 0.25))
    rope.setdefault("rope_type", rope.get("type", "default"))
    if mt == "qwen3_5_text":  # dense
        moe: dict[str, Any] = {"num_experts": 0}
        inter = _get(cfg, "intermediate_size", 12288)
    else:
        moe = dict(num_experts=_get(cfg, "num_experts", 256 if qwen35 else 512),
                   num_experts_per_tok=_get(cfg, "num_experts_per_tok", 8 if qwen35 else 10),
                   moe_intermediate_size=_get(cfg, "moe_intermediate_size", 512),
                   shared_expert_intermediate_size=_get(cfg, "shared_expert_intermediate_size",
                                                        512))
        if qwen35:  # Qwen3.5-MoE: every layer sparse, the top-k always renormalised
            inter = moe["moe_intermediate_size"]  # no dense MLP
        else:
            inter = _get(cfg, "intermediate_size", 5632)
            moe.update(norm_topk_prob=bool(_get(cfg, "norm_topk_prob", True)),
                       decoder_sparse_step=_get(cfg, "decoder_sparse_step", 1),
                       mlp_only_layers=tuple(_get(cfg, "mlp_only_layers", ())))
    train_len, mc = mc_settings(cfg, DEFAULT_SEGMENT_LEN)
    try:
        return Qwen3NextConfig(
            model_type=mt, vocab_size=cfg["vocab_size"], d_model=D, n_layers=n,
            layer_types=tuple(types), n_heads=heads,
            n_kv_heads=_get(cfg, "num_key_value_heads", 4 if mt == "qwen3_5_text" else 2),
            head_dim=_get(cfg, "head_dim", 256),
            attention_bias=bool(_get(cfg, "attention_bias", False)), rope=rope,
            lin_k_heads=_get(cfg, "linear_num_key_heads", 16),
            lin_v_heads=_get(cfg, "linear_num_value_heads", 32),
            lin_key_dim=_get(cfg, "linear_key_head_dim", 128),
            lin_value_dim=_get(cfg, "linear_value_head_dim", 128),
            conv_size=_get(cfg, "linear_conv_kernel_dim", 4), split_proj=qwen35,
            intermediate_size=inter,
            norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
            tie_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=train_len, bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=first_token_id(cfg.get("eos_token_id")),
            pad_token_id=cfg.get("pad_token_id"), **moe, **mc)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: invalid {mt} config: {e}") from None


_RENAME = (("model.embed_tokens.", "embed."), ("model.norm.", "norm_f."),
           ("model.layers.", "blocks."))
_PARTS = ((".input_layernorm.", ".norm1."), (".post_attention_layernorm.", ".norm2."),
          (".linear_attn.", ".mixer."), (".self_attn.", ".attn."), (".mlp.gate.", ".mlp.router."))
#: tensors transformers itself does not load into the causal LM (multi-token prediction heads,
#: the vision tower of an image-text checkpoint)
_IGNORED = ("mtp.", "model.visual.")


_our_name, _hf_name = renamers(_RENAME, _PARTS)


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _stack_experts(stored: dict[str, Tensor], origin: dict[str, Path]
                   ) -> tuple[dict[str, Tensor], dict[str, Path]]:
    """Per-expert tensors (``...mlp.experts.{e}.{gate,up,down}_proj.weight``, as transformers
    writes them and the published checkpoints hold them) stacked into transformers 5's
    ``experts.gate_up_proj`` ``(E, 2I, D)`` (gate rows first) and ``experts.down_proj``
    ``(E, D, I)``; a layer whose experts are not numbered 0..E-1 in all three is a
    ``CheckpointError`` naming the missing tensor."""
    groups: dict[str, dict[str, dict[int, str]]] = {}
    for name in stored:
        m = _EXPERT.match(name)
        if m:
            groups.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = name
    if not groups:
        return stored, origin
    stored, origin = dict(stored), dict(origin)
    for prefix, parts in groups.items():
        n = 1 + max(max(p) for p in parts.values())
        for part in ("gate_proj", "up_proj", "down_proj"):
            for e in range(n):
                if e not in parts.get(part, {}):
                    some = next(iter(next(iter(parts.values())).values()))
                    raise CheckpointError(f"{origin[some]} is missing tensor "
                                          f"'{prefix}.{e}.{part}.weight' (expert {e} of {n})")
        for target in ("gate_up_proj", "down_proj"):
            if f"{prefix}.{target}" in stored:
                raise CheckpointError(f"{origin[f'{prefix}.{target}']}: {prefix!r} holds its "
                                      f"experts both stacked and one by one")

        def stack(part: str, _parts=parts, _n=n) -> Tensor:
            return torch.stack([stored.pop(_parts[part][e]) for e in range(_n)])

        gate_up = torch.cat([stack("gate_proj"), stack("up_proj")], 1)
        stored[f"{prefix}.gate_up_proj"] = gate_up
        stored[f"{prefix}.down_proj"] = stack("down_proj")
        where = origin[parts["gate_proj"][0]]
        for names in parts.values():
            for name in names.values():
                origin.pop(name)
        origin[f"{prefix}.gate_up_proj"] = origin[f"{prefix}.down_proj"] = where
    return stored, origin


def load_qwen3_next(path: Path, cfg: dict, stored: dict[str, Tensor], origin: dict[str, Path]
                    ) -> Qwen3NextForCausalLM:
    """A Qwen3-Next / Qwen3.5 text model (float32, cpu, eval mode) from its directory's config
    dict and tensors; every mismatch is a ``CheckpointError`` naming the file and tensor."""
    file = path / "config.json"
    qcfg = qwen3_next_config_from_hf(cfg, file)
    if cfg.get("model_type") in WRAPPERS:  # the language model inside the image-text model
        lm = "model.language_model."
        stored = {("model." + k[len(lm):] if k.startswith(lm) else k): t
                  for k, t in stored.items()}
        origin = {("model." + k[len(lm):] if k.startswith(lm) else k): f
                  for k, f in origin.items()}
    stored = {k: t for k, t in stored.items() if not k.startswith(_IGNORED)}
    stored, origin = _stack_experts(stored, origin)
    return load_checked(Qwen3NextForCausalLM(qcfg), stored, origin, _our_name, _hf_name,
                        config_file=file, tied=qcfg.tie_embeddings, what=qcfg.model_type)
