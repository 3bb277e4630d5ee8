"""flash-linear-attention's DeltaNet and Gated DeltaNet on mcserve's delta-rule memories.

Reads the directories fla's ``AutoModelForCausalLM.save_pretrained`` writes (``config.json``
with ``model_type`` ``delta_net`` or ``gated_deltanet``, ``model.safetensors``) and runs them
on the ``delta`` / ``gated_delta`` memory families under ``MCMemory``, so the engine and
Memory Caching apply.

Per layer (pre-norm residual blocks, then a final RMSNorm and the LM head):

    x → attn_norm → mixer → + x → mlp_norm → SwiGLU MLP (gate_proj, up_proj, down_proj) → + x

The mixer, as fla's layers compute it:

* q, k, v = q_proj(x), k_proj(x), v_proj(x) (no bias), each through a short causal depthwise
  conv (``conv_size`` taps, optional bias) and SiLU. DeltaNet applies SiLU to q, k only when
  ``qk_activation`` is ``silu`` (else relu, elu+1 or identity after the conv); v always gets it.
* q, k normalised per head: L2 with fla's ε (x / √(Σx² + 1e-6)), or DeltaNet's ``qk_norm:
  sum`` (x / Σx); then q is scaled by K^-0.5 (fla's kernels' default scale).
* β = sigmoid(b_proj(x)) per head (DeltaNet without ``use_beta``: 1), doubled with
  ``allow_neg_eigval``. Gated DeltaNet's decay is log α = −exp(A_log)·softplus(a_proj(x) +
  dt_bias), in float32.
* the delta rule per head (``docs/mc.md``), read out as Sᵀq.
* per-head RMSNorm of the output (``o_norm``), gated by silu(g_proj(x)) with ``use_gate``
  (fla's FusedRMSNormGated, swish), then o_proj.

Gated DeltaNet with ``num_v_heads`` > ``num_heads`` (grouped value heads) gives value head j the
q/k of head j // (num_v_heads / num_heads); the memory runs on the value heads.

Post-hoc MC (docs/mc.md, docs/pretrained.md): the memory of every layer is wrapped in
``MCMemory`` with the settings in :class:`FlaDeltaConfig`; the gated variants score segments with
u = q (the scaled, normalised query the memory reads), so no weights are added.
``mc_variant="none"`` is the model as trained.

Not supported (a clear error): hybrid attention layers (``attn``), ``hidden_act`` other than
swish, ``attn_mode`` values fla itself rejects.
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
)
from mcserve.models.importing import up as _up
from mcserve.models.layers import GatedMLP
from mcserve.models.mc import MCMemory
from mcserve.models.mc_state import PagedLayer
from mcserve.models.memory.delta import DeltaMemory, GatedDeltaMemory
from mcserve.models.state import LayerState
from mcserve.models.varlen import fill_conv_tails

#: used for ``segment_len`` when the checkpoint records no training length
DEFAULT_SEGMENT_LEN = 2048
MODEL_TYPES = ("delta_net", "gated_deltanet")
_MEMORY = {"delta_net": "delta", "gated_deltanet": "gated_delta"}
_QK_ACTIVATIONS = ("silu", "relu", "elu", "identity")
_QK_NORMS = ("l2", "sum")
_L2_EPS = 1e-6  # fla's l2norm: x / sqrt(sum(x^2) + eps)


@dataclass(frozen=True)
class FlaDeltaConfig(ImportedConfig):
    """Architecture of a fla DeltaNet / Gated DeltaNet LM plus post-hoc MC settings.

    ``n_heads`` and ``head_dim`` are the memory's heads and value dim (what the engine reads);
    ``qk_heads`` and ``key_dim`` are the q/k heads and the key dim K.
    """

    model_type: str = "gated_deltanet"
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 2  # value heads (= memory heads)
    qk_heads: int = 2  # q/k heads; n_heads is a multiple of it
    key_dim: int = 32  # K per head
    head_dim: int = 32  # V per head
    intermediate_size: int = 256
    use_gate: bool = True  # g_proj + gated RMSNorm on the output
    use_beta: bool = True  # b_proj (DeltaNet may turn it off: β = 1)
    use_short_conv: bool = True
    conv_size: int = 4
    conv_bias: bool = False
    allow_neg_eigval: bool = False  # β ∈ (0, 2)
    qk_activation: str = "silu"  # DeltaNet only; Gated DeltaNet is always silu
    qk_norm: str = "l2"  # DeltaNet only; Gated DeltaNet is always l2
    norm_eps: float = 1e-6  # block norms, final norm and o_norm
    tie_embeddings: bool = False
    max_position_embeddings: int | None = None  # the training length, when recorded
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # post-hoc Memory Caching (u = q, no learned weights)
    mc_variant: str = "none"
    mc_mode: str = "checkpoint"
    segment_len: int = DEFAULT_SEGMENT_LEN
    mc_top_k: int = 2
    share_uq: bool = True

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {self.model_type!r}")
        check_positive_ints(self, ("vocab_size", "d_model", "n_layers", "n_heads", "qk_heads",
                                   "key_dim", "head_dim", "intermediate_size", "conv_size"))
        if self.n_heads % self.qk_heads:
            raise ValueError(f"the value heads ({self.n_heads}) must be a multiple of the q/k "
                             f"heads ({self.qk_heads})")
        if self.qk_activation not in _QK_ACTIVATIONS:
            raise ValueError(f"qk_activation must be one of {_QK_ACTIVATIONS}, got "
                             f"{self.qk_activation!r}")
        if self.qk_norm not in _QK_NORMS:
            raise ValueError(f"qk_norm must be one of {_QK_NORMS}, got {self.qk_norm!r}")
        if self.model_type == "gated_deltanet" and (self.qk_activation, self.qk_norm) != (
                "silu", "l2"):
            raise ValueError("Gated DeltaNet always uses qk_activation 'silu' and qk_norm 'l2'")
        if not self.share_uq:
            raise ValueError("fla models have no gate connectors: share_uq must be True (u = q)")
        validate_mc(self.mc_variant, self.mc_mode, self.segment_len, self.mc_top_k)

    @property
    def memory(self) -> str:
        return _MEMORY[self.model_type]

    @property
    def gated(self) -> bool:
        return self.model_type == "gated_deltanet"

    @property
    def qk_dim(self) -> int:
        return self.qk_heads * self.key_dim

    @property
    def value_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.qk_dim + self.value_dim


class RMSNorm(nn.Module):
    """x / rms(x) · w over the last dim, in float32 at least (fla's RMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor | None = None) -> Tensor:
        """With ``gate``: times silu(gate) after the norm (fla's FusedRMSNormGated, swish)."""
        h = F.rms_norm(_up(x), (x.shape[-1],), eps=self.eps) * _up(self.weight)
        if gate is not None:
            h = h * F.silu(_up(gate))
        return h.to(x.dtype)


def _l2norm(x: Tensor) -> Tensor:
    h = _up(x)
    return (h * torch.rsqrt((h * h).sum(-1, keepdim=True) + _L2_EPS)).to(x.dtype)


class DeltaMixer(nn.Module):
    """fla's ``DeltaNet`` / ``GatedDeltaNet`` layer on an MC delta-rule memory. Parameter names
    match fla's (``q_proj``, ``q_conv1d``, ``b_proj``, ``a_proj``, ``A_log``, ``dt_bias``,
    ``g_proj``, ``o_norm``, ``o_proj``)."""

    def __init__(self, cfg: FlaDeltaConfig, layer_idx: int):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        D, H = cfg.d_model, cfg.n_heads
        self.q_proj = nn.Linear(D, cfg.qk_dim, bias=False)
        self.k_proj = nn.Linear(D, cfg.qk_dim, bias=False)
        self.v_proj = nn.Linear(D, cfg.value_dim, bias=False)
        if cfg.gated:
            self.a_proj = nn.Linear(D, H, bias=False)
            self.A_log = nn.Parameter(torch.zeros(H))
            self.dt_bias = nn.Parameter(torch.zeros(H))
        self.b_proj = nn.Linear(D, H, bias=False) if cfg.use_beta else None
        if cfg.use_short_conv:
            for name, dim in (("q", cfg.qk_dim), ("k", cfg.qk_dim), ("v", cfg.value_dim)):
                setattr(self, f"{name}_conv1d", nn.Conv1d(dim, dim, cfg.conv_size, groups=dim,
                                                          bias=cfg.conv_bias))
        self.g_proj = nn.Linear(D, cfg.value_dim, bias=False) if cfg.use_gate else None
        self.o_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.o_proj = nn.Linear(cfg.value_dim, D, bias=False)
        self.family = GatedDeltaMemory() if cfg.gated else DeltaMemory()
        self.memory = MCMemory(self.family, cfg.mc)

    # ------------------------------------------------------------------ engine interface
    def init_memory(self) -> None:
        return None  # the delta-rule families start from zero

    def init_state(self, batch: int, dtype: torch.dtype, device) -> LayerState:
        cfg = self.cfg
        mc = self.memory.init_state(batch, cfg.n_heads, cfg.key_dim, cfg.head_dim, dtype=dtype,
                                    device=device)
        conv = (torch.zeros(batch, cfg.conv_size - 1, cfg.conv_dim, dtype=dtype, device=device)
                if cfg.use_short_conv else None)
        return LayerState(mc, conv)

    # ------------------------------------------------------------------ pieces
    def _conv(self, qkv: Tensor, tail: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The three short convs as one depthwise causal conv over (q, k, v) channels.

        qkv ``(B, T, C)``, tail ``(B, w - 1, C)`` → conv output (before activations), the new
        tail, and the conv input with the old tail in front ``(B, w - 1 + T, C)``."""
        w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0]
        full = ConvInput(tail.to(qkv.dtype), qkv)  # [tail; qkv] (B, w-1+T, C)
        out = causal_conv(full, w)
        if self.cfg.conv_bias:
            out += torch.cat([self.q_conv1d.bias, self.k_conv1d.bias, self.v_conv1d.bias])
        return out, full.new_tail(), full

    def _project(self, x: Tensor, conv_tail: Tensor | None):
        """x ``(B, T, D)`` → q, k ``(B, T, H, K)``, v ``(B, T, H, V)``, gates, the new conv tail
        and the conv input (for ``fill_conv_tails``; None without convs)."""
        cfg = self.cfg
        B, T, _ = x.shape
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # (B, T, C)
        full = None
        if cfg.use_short_conv:
            qkv, conv_tail, full = self._conv(qkv, conv_tail)
        q, k, v = qkv.split([cfg.qk_dim, cfg.qk_dim, cfg.value_dim], dim=-1)
        v = F.silu(v)
        act = cfg.qk_activation
        if act == "silu":
            q, k = F.silu(q), F.silu(k)
        elif act == "relu":
            q, k = q.relu(), k.relu()
        elif act == "elu":
            q, k = F.elu(q) + 1.0, F.elu(k) + 1.0
        Hk, K = cfg.qk_heads, cfg.key_dim
        q = q.reshape(B, T, Hk, K)
        k = k.reshape(B, T, Hk, K)
        if cfg.qk_norm == "l2":
            q, k = _l2norm(q), _l2norm(k)
        else:
            q, k = q / q.sum(-1, keepdim=True), k / k.sum(-1, keepdim=True)
        q = q * K ** -0.5
        rep = cfg.n_heads // Hk
        if rep > 1:  # grouped value heads: value head j reads q/k head j // rep
            q = q.repeat_interleave(rep, dim=2)
            k = k.repeat_interleave(rep, dim=2)
        v = v.reshape(B, T, cfg.n_heads, cfg.head_dim)
        gates = {}
        if self.b_proj is not None:
            beta = torch.sigmoid(_up(self.b_proj(x)))
            gates["beta"] = (beta * 2 if cfg.allow_neg_eigval else beta).to(x.dtype)
        elif cfg.allow_neg_eigval:
            gates["beta"] = x.new_full((B, T, cfg.n_heads), 2.0)
        if cfg.gated:
            a = _up(self.a_proj(x)) + _up(self.dt_bias)
            gates["log_a"] = (-torch.exp(_up(self.A_log)) * F.softplus(a)).to(x.dtype)
        return q, k, v, gates, conv_tail, full

    def _output(self, x: Tensor, o: Tensor) -> Tensor:
        B, T, H, V = o.shape
        g = None if self.g_proj is None else self.g_proj(x).view(B, T, H, V)
        return self.o_proj(self.o_norm(o, g).reshape(B, T, H * V))

    def forward(self, x: Tensor, state: LayerState) -> tuple[Tensor, LayerState]:
        record = state.mc.record
        q, k, v, gates, conv, full = self._project(x, state.conv)
        y, mc = self.memory.forward(state.mc, q, k, v, q, gates)
        if record is not None:
            fill_conv_tails(record, full, state.mc.pos, self.cfg.conv_size)
        return self._output(x, y), LayerState(mc, conv)

    def forward_paged(self, x: Tensor, pl: PagedLayer) -> Tensor:
        """One token per row of a ragged batch (see ``PagedLayer``); updates ``pl``."""
        q, k, v, gates, pl.conv, _ = self._project(x, pl.conv)
        return self._output(x, self.memory.decode_paged(pl, q, k, v, q, gates))


class DeltaBlock(nn.Module):
    def __init__(self, cfg: FlaDeltaConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = DeltaMixer(cfg, layer_idx)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = GatedMLP(cfg.d_model, cfg.intermediate_size)

    def forward(self, x: Tensor, state: LayerState) -> tuple[Tensor, LayerState]:
        h, state = self.mixer(self.attn_norm(x), state)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), state

    def forward_paged(self, x: Tensor, pl: PagedLayer) -> Tensor:
        x = x + self.mixer.forward_paged(self.attn_norm(x), pl)
        return x + self.mlp(self.mlp_norm(x))


class FlaDeltaForCausalLM(RebuildsUnderMC, RecurrentLM):
    """DeltaNet / Gated DeltaNet LM with post-hoc Memory Caching (model_type ``delta_net`` /
    ``gated_deltanet``).

    State-dict names are fla's without the ``model.`` prefix, with ``embed`` for
    ``embeddings`` and ``mixer`` for ``attn``: ``embed.weight``,
    ``layers.{i}.attn_norm.weight``, ``layers.{i}.mixer.*``, ``layers.{i}.mlp_norm.weight``,
    ``layers.{i}.mlp.*``, ``norm.weight``, ``lm_head.weight``. Use
    ``mcserve.models.registry.load_model`` to read an fla directory.
    """

    def __init__(self, config: FlaDeltaConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(DeltaBlock(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _head(self, x: Tensor) -> Tensor:
        return self.lm_head(self.norm(x))


# ---------------------------------------------------------------------------- loading
def config_from_fla(cfg: dict, file: Path) -> FlaDeltaConfig:
    """A ``FlaDeltaConfig`` from an fla ``DeltaNetConfig`` / ``GatedDeltaNetConfig`` dict
    (fla's defaults for absent keys)."""
    mt = cfg.get("model_type")
    if mt not in MODEL_TYPES:
        raise CheckpointError(f"{file}: model_type {mt!r} is not one of {MODEL_TYPES}")
    gated = mt == "gated_deltanet"

    def get(key, default=None, required=False):
        if key not in cfg or cfg[key] is None:
            if required:
                raise CheckpointError(f"{file}: required key {key!r} is missing")
            return default
        return cfg[key]

    attn = get("attn")
    if attn and (not isinstance(attn, dict) or attn.get("layers")):
        raise CheckpointError(f"{file}: 'attn' = {attn!r} (hybrid attention layers) is not "
                              f"supported")
    act = get("hidden_act", "swish")
    if act not in ("swish", "silu"):
        raise CheckpointError(f"{file}: hidden_act {act!r} is not supported (only 'swish')")
    mode = get("attn_mode", "chunk")
    if mode not in ("chunk", "fused_recurrent", "fused_chunk"):
        raise CheckpointError(f"{file}: attn_mode {mode!r} is not a DeltaNet kernel mode")
    d_model = get("hidden_size", required=True)
    if not isinstance(d_model, int) or d_model < 1:
        raise CheckpointError(f"{file}: hidden_size must be a positive integer, got {d_model!r}")

    def whole(name: str, val: float) -> int:
        if abs(val - round(val)) > 1e-5:
            raise CheckpointError(f"{file}: {name} = {val} is not a whole number")
        return int(round(val))

    if gated:
        qk_heads = get("num_heads", 6)
        n_heads = get("num_v_heads", qk_heads)
        key_dim = get("head_dim", 256)
        value_dim = whole("head_dim * expand_v", key_dim * get("expand_v", 2.0))
        if n_heads < qk_heads or n_heads % qk_heads:
            raise CheckpointError(f"{file}: num_v_heads={n_heads} must be a multiple of "
                                  f"num_heads={qk_heads}")
        extra = dict(use_gate=bool(get("use_gate", True)), use_beta=True)
    else:
        n_heads = qk_heads = get("num_heads", 16)
        kd = whole("hidden_size * expand_k", d_model * get("expand_k", 1.0))
        vd = whole("hidden_size * expand_v", d_model * get("expand_v", 1.0))
        if kd % n_heads or vd % n_heads:
            raise CheckpointError(f"{file}: key dim {kd} and value dim {vd} must be multiples "
                                  f"of num_heads={n_heads}")
        key_dim, value_dim = kd // n_heads, vd // n_heads
        extra = dict(use_gate=bool(get("use_gate", False)), use_beta=bool(get("use_beta", True)),
                     qk_activation=get("qk_activation", "silu"), qk_norm=get("qk_norm", "l2"))
    inter = get("intermediate_size")
    if inter is None:  # fla's GatedMLP: 2/3 · hidden_ratio · hidden_size, rounded up to 256
        inter = int(d_model * get("hidden_ratio", 4) * 2 / 3)
        inter = 256 * ((inter + 255) // 256)
    train_len, mc = mc_settings(cfg, DEFAULT_SEGMENT_LEN)
    eos = first_token_id(get("eos_token_id"))
    try:
        return FlaDeltaConfig(
            model_type=mt, vocab_size=get("vocab_size", required=True), d_model=d_model,
            n_layers=get("num_hidden_layers", required=True), n_heads=n_heads,
            qk_heads=qk_heads, key_dim=key_dim, head_dim=value_dim, intermediate_size=inter,
            use_short_conv=bool(get("use_short_conv", True)), conv_size=get("conv_size", 4),
            conv_bias=bool(get("conv_bias", False)),
            allow_neg_eigval=bool(get("allow_neg_eigval", False)),
            norm_eps=float(get("norm_eps", 1e-6)),
            tie_embeddings=bool(get("tie_word_embeddings", False)),
            max_position_embeddings=train_len, bos_token_id=get("bos_token_id"),
            eos_token_id=eos, pad_token_id=get("pad_token_id"), **mc, **extra,
        )
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: invalid {mt} config: {e}") from None


def _our_name(src: str) -> str:
    """fla tensor name → ``FlaDeltaForCausalLM`` name."""
    name = src[len("model."):] if src.startswith("model.") else src
    if name == "embeddings.weight":
        return "embed.weight"
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "layers" and parts[2] == "attn":
        parts[2] = "mixer"
    return ".".join(parts)


def _fla_name(ours: str) -> str:
    """``FlaDeltaForCausalLM`` name → the fla tensor name (for error messages)."""
    if ours == "lm_head.weight":
        return ours
    if ours == "embed.weight":
        return "model.embeddings.weight"
    parts = ours.split(".")
    if len(parts) > 3 and parts[0] == "layers" and parts[2] == "mixer":
        parts[2] = "attn"
    return "model." + ".".join(parts)


def load_fla_delta(path: Path, cfg: dict, layout: str, stored: dict[str, Tensor],
                   origin: dict[str, Path]) -> FlaDeltaForCausalLM:
    """An fla ``delta_net`` / ``gated_deltanet`` model (float32, cpu, eval mode) from its
    directory's config dict and tensors (``stored``; ``origin`` names the file of each, as
    ``registry.read_weights`` returns them).

    Every mismatch between the weights and the config is a ``CheckpointError`` naming the file
    and the tensor: a missing tensor, one this model does not use, a wrong shape or dtype.
    """
    file = path / "config.json"
    mcfg = config_from_fla(cfg, file)
    return load_checked(FlaDeltaForCausalLM(mcfg), stored, origin, _our_name, _fla_name,
                        config_file=file, tied=mcfg.tie_embeddings, what=mcfg.model_type)
