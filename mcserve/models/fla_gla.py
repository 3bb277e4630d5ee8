"""flash-linear-attention's GLA (Gated Linear Attention) on mcserve's vector-gated ``gla`` memory.

Reads the directories fla's ``AutoModelForCausalLM.save_pretrained`` writes for
``GLAForCausalLM`` (``config.json`` with ``model_type: gla``, ``model.safetensors``) and runs
them under ``MCMemory``, so the engine and Memory Caching apply.

Per layer (pre-norm residual blocks, then a final RMSNorm and the LM head):

    x → attn_norm → mixer → + x → mlp_norm → SwiGLU MLP (gate_proj, up_proj, down_proj) → + x

The mixer, as fla's ``GatedLinearAttention`` computes it:

* q = q_proj(x) (``key_dim`` = hidden·expand_k), k = k_proj(x), v = v_proj(x) (per kv head), no
  bias; with ``use_short_conv`` each through its own causal depthwise conv (no bias) and SiLU;
* the per-key-dim decay gk = logsigmoid(gk_proj(x)) / 16 (a rank-16 projection
  ``gk_proj.0`` → ``gk_proj.1`` with bias), clamped below at ``clamp_min`` when set;
* with ``num_kv_heads`` < ``num_heads``, k, gk and v of kv head h serve heads h·g .. h·g + g − 1;
* the optional ``feature_map`` on q and k, then the recurrence S_t = diag(exp gk_t)·S_{t-1} +
  k_t v_tᵀ read as Sᵀ(q_t·K^-0.5) (fla's default scale), i.e. the ``gla`` family with b = 1;
* the output RMSNorm per head, gated by swish(g_proj(x)) (``FusedRMSNormGated``, or RMSNorm then
  the ``hidden_act`` gate when ``fuse_norm`` is off; no gate without ``use_output_gate``), o_proj.

Post-hoc MC (docs/mc.md): u = the scaled query the memory reads (``share_uq``), no weights
added; ``mc_variant="none"`` is the model as trained.

Not supported (a clear error): hybrid attention layers (``attn``), an MLP ``hidden_act`` other
than swish, feature maps other than relu / swish / silu / sigmoid / sqrelu / identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mcserve.config import validate_mc
from mcserve.models.base import RecurrentLM
from mcserve.models.checkpoint import CheckpointError
from mcserve.models.importing import (
    ConvInput,
    ImportedConfig,
    RebuildsUnderMC,
    causal_conv,
    check_positive_ints,
    first_token_id,
    load_checked,
    mc_settings,
    require_keys,
    up,
)
from mcserve.models.layers import GatedMLP
from mcserve.models.mc import MCMemory
from mcserve.models.mc_state import PagedLayer
from mcserve.models.memory.gla import VectorGatedMemory
from mcserve.models.state import LayerState
from mcserve.models.varlen import fill_conv_tails

DEFAULT_SEGMENT_LEN = 2048
#: fla's GatedLinearAttention fixes these (its model config does not pass them)
GATE_LOW_RANK_DIM = 16
GATE_LOGIT_NORMALIZER = 16
_ACT = {
    "relu": F.relu, "swish": F.silu, "silu": F.silu, "sigmoid": torch.sigmoid,
    "sqrelu": lambda x: F.relu(x) ** 2,
}


@dataclass(frozen=True)
class FlaGLAConfig(ImportedConfig):
    """Architecture of an fla GLA LM plus the post-hoc MC settings.

    Engine-facing names as in ``ModelConfig``: ``n_heads``, ``head_dim`` = the value dim V of a
    head (``head_v_dim``); ``head_k_dim`` is the key dim K.
    """

    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 4
    key_dim: int = 32  # q width (all heads)
    value_dim: int = 64  # output width (all heads)
    intermediate_size: int = 256
    feature_map: str | None = None
    use_short_conv: bool = False
    conv_size: int = 4
    use_output_gate: bool = True
    gate_act: str = "swish"  # the output gate's activation (fla's hidden_act)
    fuse_norm: bool = True
    elementwise_affine: bool = True
    norm_eps: float = 1e-6
    clamp_min: float | None = None
    tie_embeddings: bool = False
    max_position_embeddings: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    mc_variant: str = "none"
    mc_mode: str = "checkpoint"
    segment_len: int = DEFAULT_SEGMENT_LEN
    mc_top_k: int = 2
    memory: str = "gla"
    share_uq: bool = True
    model_type: str = "gla"

    def __post_init__(self) -> None:
        check_positive_ints(self, ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                                   "key_dim", "value_dim", "intermediate_size", "conv_size"))
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"num_heads ({self.n_heads}) must be a multiple of num_kv_heads "
                             f"({self.n_kv_heads})")
        if self.key_dim % self.n_heads or self.value_dim % self.n_heads:
            raise ValueError(f"key dim {self.key_dim} and value dim {self.value_dim} must be "
                             f"multiples of num_heads ({self.n_heads})")
        if self.feature_map is not None and self.feature_map not in _ACT:
            raise ValueError(f"feature_map {self.feature_map!r} is not supported; supported: "
                             f"None, {sorted(_ACT)}")
        if self.gate_act not in _ACT:
            raise ValueError(f"hidden_act {self.gate_act!r} is not supported as the output gate; "
                             f"supported: {sorted(_ACT)}")
        if self.memory != "gla" or self.model_type != "gla" or not self.share_uq:
            raise ValueError("fla GLA runs on the 'gla' memory with u = q (share_uq)")
        validate_mc(self.mc_variant, self.mc_mode, self.segment_len, self.mc_top_k)

    @property
    def head_k_dim(self) -> int:
        return self.key_dim // self.n_heads

    @property
    def head_dim(self) -> int:
        return self.value_dim // self.n_heads

    @property
    def groups(self) -> int:
        return self.n_heads // self.n_kv_heads


class RMSNorm(nn.Module):
    """x / rms(x) · w (w optional), in float32 at least, as fla's RMSNorm."""

    def __init__(self, dim: int, eps: float, affine: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None

    def forward(self, x: Tensor) -> Tensor:
        h = F.rms_norm(up(x), (x.shape[-1],), eps=self.eps)
        if self.weight is not None:
            h = h * self.weight.to(h.dtype)
        return h.to(x.dtype)


class ShortConv(nn.Module):
    """Causal depthwise conv + SiLU (fla's ``ShortConvolution`` without bias); ``weight``
    ``(D, 1, W)``."""

    def __init__(self, dim: int, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, 1, size))


class GLAMixer(nn.Module):
    """fla's ``GatedLinearAttention`` (parameter names match) with the recurrence as MC ``gla``
    memory."""

    def __init__(self, cfg: FlaGLAConfig, layer_idx: int):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.H, self.K, self.V, self.G = cfg.n_heads, cfg.head_k_dim, cfg.head_dim, cfg.groups
        kd_g, vd_g = cfg.key_dim // self.G, cfg.value_dim // self.G
        self.widths = [cfg.key_dim, kd_g, vd_g]  # q, k, v before the repeat over groups
        D = cfg.d_model
        self.q_proj = nn.Linear(D, cfg.key_dim, bias=False)
        self.k_proj = nn.Linear(D, kd_g, bias=False)
        self.v_proj = nn.Linear(D, vd_g, bias=False)
        if cfg.use_output_gate:
            self.g_proj = nn.Linear(D, cfg.value_dim, bias=False)
        if cfg.use_short_conv:
            self.q_conv1d = ShortConv(cfg.key_dim, cfg.conv_size)
            self.k_conv1d = ShortConv(kd_g, cfg.conv_size)
            self.v_conv1d = ShortConv(vd_g, cfg.conv_size)
        self.gk_proj = nn.Sequential(nn.Linear(D, GATE_LOW_RANK_DIM, bias=False),
                                     nn.Linear(GATE_LOW_RANK_DIM, kd_g, bias=True))
        self.o_proj = nn.Linear(cfg.value_dim, D, bias=False)
        self.fused_gate = cfg.gate_act in ("swish", "silu") and cfg.fuse_norm and \
            cfg.use_output_gate
        norm = RMSNorm(self.V, cfg.norm_eps, cfg.elementwise_affine)
        if self.fused_gate:
            self.g_norm_swish_gate = norm
        else:
            self.g_norm = norm
        self.family = VectorGatedMemory()
        self.memory = MCMemory(self.family, cfg.mc)

    # ------------------------------------------------------------------ engine interface
    def init_memory(self) -> None:
        return None

    def init_state(self, batch: int, dtype: torch.dtype, device) -> LayerState:
        mc = self.memory.init_state(batch, self.H, self.K, self.V, dtype=dtype, device=device)
        conv = None
        if self.cfg.use_short_conv:
            conv = torch.zeros(batch, self.cfg.conv_size - 1, sum(self.widths), dtype=dtype,
                               device=device)
        return LayerState(mc, conv)

    # ------------------------------------------------------------------ pieces
    def _project(self, x: Tensor, conv_tail: Tensor | None):
        """x ``(B, T, D)`` → q (scaled), k, v ``(B, T, H, ·)``, gates, the new conv tail and the
        conv input ``(B, w - 1 + T, C)`` (None without a conv)."""
        B, T, _ = x.shape
        H, K, V, G = self.H, self.K, self.V, self.G
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        full = None
        if conv_tail is not None:
            w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])
            w = w[:, 0]  # (C, W)
            full = ConvInput(conv_tail.to(qkv.dtype), qkv)  # [tail; qkv] (B, W-1+T, C)
            conv_tail = full.new_tail()
            qkv = causal_conv(full, w, silu=True)
        q, k, v = qkv.split(self.widths, dim=-1)
        gk = self.gk_proj(x)
        q = q.reshape(B, T, H, K)
        k, gk = k.reshape(B, T, H // G, K), gk.reshape(B, T, H // G, K)
        v = v.reshape(B, T, H // G, V)
        if G > 1:  # kv head h serves heads h·G .. h·G + G − 1
            k, gk, v = (t.repeat_interleave(G, dim=2) for t in (k, gk, v))
        gk = F.logsigmoid(up(gk)) / GATE_LOGIT_NORMALIZER
        if self.cfg.clamp_min is not None:
            gk = gk.clamp_min(self.cfg.clamp_min)
        if self.cfg.feature_map is not None:
            act = _ACT[self.cfg.feature_map]
            q, k = act(q), act(k)
        q = q * K ** -0.5  # fla's kernels' default scale
        return q, k, v, {"log_a": gk.to(q.dtype)}, conv_tail, full

    def _output(self, x: Tensor, o: Tensor) -> Tensor:
        B, T = o.shape[:2]
        if self.fused_gate:
            g = self.g_proj(x).reshape(B, T, self.H, self.V)
            o = self.g_norm_swish_gate(o) * F.silu(g)
            o = o.reshape(B, T, -1)
        else:
            o = self.g_norm(o).reshape(B, T, -1)
            if self.cfg.use_output_gate:
                o = o * _ACT[self.cfg.gate_act](self.g_proj(x))
        return self.o_proj(o)

    def forward(self, x: Tensor, state: LayerState) -> tuple[Tensor, LayerState]:
        record = state.mc.record
        q, k, v, gates, conv, full = self._project(x, state.conv)
        y, mc = self.memory.forward(state.mc, q, k, v, q, gates)
        if record is not None:
            fill_conv_tails(record, full, state.mc.pos, self.cfg.conv_size)
        return self._output(x, y), LayerState(mc, conv)

    def forward_paged(self, x: Tensor, pl: PagedLayer) -> Tensor:
        """One token per row of a ragged batch (see ``PagedLayer``); updates ``pl``."""
        q, k, v, gates, conv, _ = self._project(x, pl.conv)
        if conv is not None:
            if pl.inplace:
                pl.conv.copy_(conv)
            else:
                pl.conv = conv.clone()
        return self._output(x, self.memory.decode_paged(pl, q, k, v, q, gates))


class GLABlock(nn.Module):
    def __init__(self, cfg: FlaGLAConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = GLAMixer(cfg, layer_idx)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = GatedMLP(cfg.d_model, cfg.intermediate_size)

    @property
    def mixer(self) -> GLAMixer:  # the name the engine reads
        return self.attn

    def forward(self, x: Tensor, state: LayerState) -> tuple[Tensor, LayerState]:
        h, state = self.attn(self.attn_norm(x), state)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), state

    def forward_paged(self, x: Tensor, pl: PagedLayer) -> Tensor:
        x = x + self.attn.forward_paged(self.attn_norm(x), pl)
        return x + self.mlp(self.mlp_norm(x))


class FlaGLAForCausalLM(RebuildsUnderMC, RecurrentLM):
    """fla's ``GLAForCausalLM`` with post-hoc Memory Caching (model_type ``gla``).

    State-dict names are fla's without the ``model.`` prefix (``embeddings.weight``,
    ``layers.{i}.attn.*``, ``norm.weight``) plus ``lm_head.weight``; ``embed`` is an alias of
    ``embeddings`` for the engine.
    """

    def __init__(self, config: FlaGLAConfig):
        super().__init__()
        self.config = config
        self.embeddings = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(GLABlock(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embeddings.weight

    @property
    def embed(self) -> nn.Embedding:
        return self.embeddings

    def _head(self, x: Tensor) -> Tensor:
        return self.lm_head(self.norm(x))


# ---------------------------------------------------------------------------- loading
def gla_config_from_fla(cfg: dict, file: Path) -> FlaGLAConfig:
    """A ``FlaGLAConfig`` from fla's ``GLAConfig`` dict (defaults as fla's)."""
    def get(key, default=None):
        val = cfg.get(key, default)
        return default if val is None and default is not None else val

    require_keys(cfg, file, ("hidden_size", "num_hidden_layers", "vocab_size"))
    if cfg.get("attn"):
        raise CheckpointError(f"{file}: attn={cfg['attn']} (hybrid attention layers) is not "
                              f"supported")
    if get("hidden_act", "swish") not in ("swish", "silu"):
        raise CheckpointError(f"{file}: hidden_act {cfg['hidden_act']!r} is not supported "
                              f"(the MLP is SwiGLU)")
    if not get("use_gk", True) or get("use_gv", False):
        raise CheckpointError(f"{file}: use_gk=false or use_gv=true is not supported")
    D = cfg["hidden_size"]
    heads = get("num_heads", 4)
    inter = cfg.get("intermediate_size")
    if inter is None and isinstance(D, int):
        inter = int(D * get("hidden_ratio", 4) * 2 / 3)
        inter = 256 * ((inter + 255) // 256)
    train_len, mc = mc_settings(cfg, DEFAULT_SEGMENT_LEN)
    eos = first_token_id(cfg.get("eos_token_id"))
    try:
        return FlaGLAConfig(
            vocab_size=cfg["vocab_size"], d_model=D, n_layers=cfg["num_hidden_layers"],
            n_heads=heads, n_kv_heads=get("num_kv_heads", heads),
            key_dim=int(D * get("expand_k", 0.5)), value_dim=int(D * get("expand_v", 1)),
            intermediate_size=inter, feature_map=cfg.get("feature_map"),
            use_short_conv=bool(get("use_short_conv", False)), conv_size=get("conv_size", 4),
            use_output_gate=bool(get("use_output_gate", True)),
            gate_act=get("hidden_act", "swish"), fuse_norm=bool(get("fuse_norm", True)),
            elementwise_affine=bool(get("elementwise_affine", True)),
            norm_eps=float(get("norm_eps", 1e-6)), clamp_min=cfg.get("clamp_min"),
            tie_embeddings=bool(get("tie_word_embeddings", False)),
            max_position_embeddings=train_len, bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos, pad_token_id=cfg.get("pad_token_id"), **mc,
        )
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: invalid GLA config: {e}") from None


def _our_name(src: str) -> str:
    return src[len("model."):] if src.startswith("model.") else src


def _fla_name(ours: str) -> str:
    return ours if ours == "lm_head.weight" else "model." + ours


def load_fla_gla(path: Path, cfg: dict, stored: dict[str, Tensor], origin: dict[str, Path]
                 ) -> FlaGLAForCausalLM:
    """The model of an fla GLA directory whose tensors ``stored`` came from the files
    ``origin``."""
    file = path / "config.json"
    gcfg = gla_config_from_fla(cfg, file)
    return load_checked(FlaGLAForCausalLM(gcfg), stored, origin, _our_name, _fla_name,
                        config_file=file, tied=gcfg.tie_embeddings, what="GLA",
                        embed_name="embeddings.weight")
