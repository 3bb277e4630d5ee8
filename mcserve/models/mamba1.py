"""Mamba (v1) on mcserve's vector-gated ``gla`` memory family, so Memory Caching and the engine
apply to it.

Mamba's selective SSM keeps, for each of the ``d_inner`` channels, a state h ∈ R^N
(N = ``state_size``) with a decay per state dimension:

    h_t = exp(Δ_t·A_c) ⊙ h_{t-1} + Δ_t·B_t·x_t,    y_t = C_t·h_t + D_c·x_t

(A_c = −exp(A_log[c]) ∈ R^N, Δ_t = softplus(dt_proj(dt_t)) per channel). On
``VectorGatedMemory`` every channel is a head with K = N and V = 1: k = B_t (shared by all
channels), q = C_t, v = x_t of the channel, write gate b = Δ_t and log decay Δ_t·A_c per key
dimension. Around the SSM: in_proj → (x, z); a short causal depthwise conv (+ bias) and SiLU on
x; x_proj → (dt, B, C); the D skip; y·silu(z); out_proj. Blocks are pre-norm residual
(RMSNorm → mixer), then a final RMSNorm and the LM head.

Cost: d_inner heads of a (N, 1) state each. The memory's scan form (``kernels.gla_vector``)
does T·d_inner·N work per layer with about 2√T Python steps; MC's per-segment key sums and
cached blocks are d_inner·N numbers each, like the state.

Post-hoc MC (docs/mc.md) as for Mamba2: u_t = q_t = C_t (``share_uq``), no weights added;
``mc_variant="none"`` equals transformers' ``MambaForCausalLM`` to float rounding.

Loading (``load_mamba1``, called by ``mcserve.models.registry``): transformers' format
(``model_type: mamba``) or ``mamba_ssm``'s (``ssm_cfg`` without ``layer`` or with
``layer: Mamba1``; ``backbone.embedding.weight``, vocabulary padded to
``pad_vocab_size_multiple``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mcserve.config import validate_mc
from mcserve.models.base import ConvSSMMixer, MambaBlock, MambaLM
from mcserve.models.checkpoint import CheckpointError
from mcserve.models.importing import (
    ImportedConfig,
    check_mamba_ssm_blocks,
    check_positive_ints,
    config_getter,
    first_token_id,
    load_checked,
    mamba_ssm_name,
    mc_settings,
    padded_vocab,
    require_keys,
    up,
)
from mcserve.models.mc import MCMemory
from mcserve.models.memory.gla import VectorGatedMemory
from mcserve.models.state import LayerState

#: used for ``segment_len`` when the checkpoint records no training length
DEFAULT_SEGMENT_LEN = 2048


@dataclass(frozen=True)
class Mamba1Config(ImportedConfig):
    """Architecture of a Mamba (v1) LM plus the post-hoc MC settings applied to it.

    Engine-facing names as in ``ModelConfig``: ``n_heads`` = d_inner (one head per channel),
    ``head_dim`` = the value dim V = 1, ``state_size`` = the key dim K = N.
    """

    vocab_size: int = 256  # rows of the embedding / LM head (already padded)
    d_model: int = 64
    n_layers: int = 2
    d_inner: int = 128
    state_size: int = 16
    dt_rank: int = 4
    conv_size: int = 4
    use_bias: bool = False  # in_proj / out_proj
    use_conv_bias: bool = True
    norm_eps: float = 1e-5
    residual_in_fp32: bool = True
    tie_embeddings: bool = True
    unpadded_vocab_size: int | None = None  # the tokenizer's vocab when the rows were padded
    max_position_embeddings: int | None = None  # the training length, when the source records it
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # post-hoc Memory Caching (u = q, no learned weights)
    mc_variant: str = "none"
    mc_mode: str = "checkpoint"
    segment_len: int = DEFAULT_SEGMENT_LEN
    mc_top_k: int = 2
    memory: str = "gla"
    share_uq: bool = True
    model_type: str = "mamba"

    def __post_init__(self) -> None:
        check_positive_ints(self, ("vocab_size", "d_model", "n_layers", "d_inner", "state_size",
                                   "dt_rank", "conv_size"))
        if self.memory != "gla":
            raise ValueError(f"Mamba runs on the 'gla' memory family, got {self.memory!r}")
        if self.model_type != "mamba":
            raise ValueError(f"model_type must be 'mamba', got {self.model_type!r}")
        if not self.share_uq:
            raise ValueError("Mamba has no gate connectors: share_uq must be True (u = q)")
        validate_mc(self.mc_variant, self.mc_mode, self.segment_len, self.mc_top_k)

    @property
    def n_heads(self) -> int:
        return self.d_inner

    @property
    def head_dim(self) -> int:
        return 1



class Mamba1Mixer(ConvSSMMixer):
    """in_proj → (x, z); causal conv + SiLU on x; x_proj → (dt, B, C); the selective SSM as MC
    ``gla`` memory; D skip; y·silu(z); out_proj. Parameter names match transformers'
    ``MambaMixer``."""

    def __init__(self, cfg: Mamba1Config, layer_idx: int):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.H, self.N, self.R = cfg.d_inner, cfg.state_size, cfg.dt_rank
        self.in_proj = nn.Linear(cfg.d_model, 2 * cfg.d_inner, bias=cfg.use_bias)
        self.conv1d = nn.Conv1d(cfg.d_inner, cfg.d_inner, cfg.conv_size, groups=cfg.d_inner,
                                bias=cfg.use_conv_bias, padding=cfg.conv_size - 1)
        self.x_proj = nn.Linear(cfg.d_inner, self.R + 2 * self.N, bias=False)
        self.dt_proj = nn.Linear(self.R, cfg.d_inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(cfg.d_inner, self.N))
        self.D = nn.Parameter(torch.ones(cfg.d_inner))
        self.out_proj = nn.Linear(cfg.d_inner, cfg.d_model, bias=cfg.use_bias)
        self.family = VectorGatedMemory()
        self.memory = MCMemory(self.family, cfg.mc)

    # ------------------------------------------------------------------ engine interface
    def init_state(self, batch: int, dtype: torch.dtype, device) -> LayerState:
        mc = self.memory.init_state(batch, self.H, self.N, 1, dtype=dtype, device=device)
        conv = torch.zeros(batch, self.cfg.conv_size - 1, self.cfg.d_inner, dtype=dtype,
                           device=device)
        return LayerState(mc, conv)

    # ------------------------------------------------------------------ pieces
    def _pre_conv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Token-wise: x ``(B, T, D)`` → z and the conv's input x, each ``(B, T, d_inner)``."""
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        return z, xs

    def _post_conv(self, z: Tensor, xs: Tensor):
        """Token-wise: z and the conv's output xs ``(B, T, d_inner)`` → z, xs, q, k
        ``(B, T, H, N)``, gates."""
        B, T, _ = xs.shape
        H, N, R = self.H, self.N, self.R
        dt, Bm, Cm = self.x_proj(xs).split([R, N, N], dim=-1)
        delta = F.softplus(up(F.linear(dt, self.dt_proj.weight)) + up(self.dt_proj.bias))
        A = -torch.exp(up(self.A_log))  # (H, N)
        k = Bm[:, :, None, :].expand(B, T, H, N)  # one key for every channel: a view
        q = Cm[:, :, None, :].expand(B, T, H, N)
        gates = {"log_a": (delta[..., None] * A).to(xs.dtype), "b": delta.to(xs.dtype)}
        return z, xs, q, k, gates

    def _output(self, z: Tensor, xs: Tensor, y: Tensor) -> Tensor:
        y = y[..., 0] + xs * self.D.to(y.dtype)  # (B, T, d_inner)
        y = y * F.silu(z)
        return self.out_proj(y.to(self.out_proj.weight.dtype))

    def _values(self, xs: Tensor) -> Tensor:
        return xs[..., None]  # V = 1 per channel


class Mamba1Block(MambaBlock):
    mixer_class = Mamba1Mixer


class Mamba1MCForCausalLM(MambaLM):
    """Mamba (v1) language model with post-hoc Memory Caching (model_type ``mamba``); the
    state-dict names are those of :class:`~mcserve.models.base.MambaLM` (transformers')."""

    block_class = Mamba1Block


# ---------------------------------------------------------------------------- loading
def mamba1_config_from_hf(cfg: dict, file: Path) -> Mamba1Config:
    """A ``Mamba1Config`` from a transformers ``MambaConfig`` dict."""
    get = config_getter(cfg, file)
    d_model = get("hidden_size", required=True)
    expand = get("expand", 2)
    d_inner = get("intermediate_size", None)
    if d_inner is None and isinstance(d_model, int):
        d_inner = int(expand * d_model)
    rank = get("time_step_rank", "auto")
    if rank == "auto" and isinstance(d_model, int):
        rank = math.ceil(d_model / 16)
    act = get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise CheckpointError(f"{file}: hidden_act {act!r} is not supported (only 'silu')")
    train_len, mc = mc_settings(cfg, DEFAULT_SEGMENT_LEN)
    eos = first_token_id(get("eos_token_id"))
    try:
        return Mamba1Config(
            vocab_size=get("vocab_size", required=True), d_model=d_model,
            n_layers=get("num_hidden_layers", required=True), d_inner=d_inner,
            state_size=get("state_size", 16), dt_rank=rank, conv_size=get("conv_kernel", 4),
            use_bias=bool(get("use_bias", False)), use_conv_bias=bool(get("use_conv_bias", True)),
            norm_eps=float(get("layer_norm_epsilon", 1e-5)),
            residual_in_fp32=bool(get("residual_in_fp32", True)),
            tie_embeddings=bool(get("tie_word_embeddings", True)),
            max_position_embeddings=train_len, bos_token_id=get("bos_token_id"),
            eos_token_id=eos, pad_token_id=get("pad_token_id"), **mc,
        )
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: invalid Mamba config: {e}") from None


def mamba1_config_from_ssm(cfg: dict, file: Path) -> Mamba1Config:
    """A ``Mamba1Config`` from a ``mamba_ssm`` ``MambaConfig`` dict (``layer: Mamba1``)."""
    require_keys(cfg, file, ("d_model", "n_layer", "vocab_size"))
    ssm = dict(cfg.get("ssm_cfg") or {})
    d_model = cfg["d_model"]
    check_mamba_ssm_blocks(cfg, file)
    known = {"layer", "d_state", "d_conv", "expand", "dt_rank", "dt_min", "dt_max", "dt_init",
             "dt_scale", "dt_init_floor", "conv_bias", "bias", "use_fast_path"}
    unknown = sorted(set(ssm) - known)
    if unknown:
        raise CheckpointError(f"{file}: ssm_cfg keys {unknown} are not supported for Mamba1")
    rank = ssm.get("dt_rank", "auto")
    if rank == "auto" and isinstance(d_model, int):
        rank = math.ceil(d_model / 16)
    vocab, padded = padded_vocab(cfg)
    train_len, mc = mc_settings(cfg, DEFAULT_SEGMENT_LEN)
    try:
        return Mamba1Config(
            vocab_size=padded, d_model=d_model, n_layers=cfg["n_layer"],
            d_inner=int(ssm.get("expand", 2) * d_model), state_size=ssm.get("d_state", 16),
            dt_rank=rank, conv_size=ssm.get("d_conv", 4), use_bias=bool(ssm.get("bias", False)),
            use_conv_bias=bool(ssm.get("conv_bias", True)),
            norm_eps=float(cfg.get("norm_epsilon", 1e-5)),
            residual_in_fp32=bool(cfg.get("residual_in_fp32", True)),
            tie_embeddings=bool(cfg.get("tie_embeddings", True)),
            unpadded_vocab_size=vocab if padded != vocab else None,
            max_position_embeddings=train_len, **mc,
        )
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: invalid mamba_ssm Mamba config: {e}") from None


def load_mamba1(path: Path, cfg: dict, layout: str, stored: dict[str, Tensor],
                origin: dict[str, Path]) -> Mamba1MCForCausalLM:
    """The model of a transformers (``layout="transformers"``) or ``mamba_ssm`` Mamba1
    directory whose tensors ``stored`` came from the files ``origin``."""
    file = path / "config.json"
    mcfg = (mamba1_config_from_ssm(cfg, file) if layout == "mamba_ssm"
            else mamba1_config_from_hf(cfg, file))
    emb = "embedding" if layout == "mamba_ssm" else "embeddings"

    def source_name(ours: str) -> str:
        if ours == "embed.weight":
            return f"backbone.{emb}.weight"
        return ours if ours == "lm_head.weight" else "backbone." + ours

    return load_checked(Mamba1MCForCausalLM(mcfg), stored, origin, mamba_ssm_name, source_name,
                        config_file=file, tied=mcfg.tie_embeddings, what="Mamba")
