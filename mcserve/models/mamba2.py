"""Mamba2 on mcserve's ``linear`` memory family, so Memory Caching and the engine apply to it.

Mamba2's SSM is gated linear attention with a scalar decay per head (SSD):

    S_t = exp(Δ_t·A)·S_{t-1} + Δ_t·B_t x_tᵀ,    y_t = S_tᵀ C_t + D·x_t

with S ∈ R^{N×P} per head (N = ``state_size``, P = ``head_dim``). On ``LinearMemory`` that is
log_a = Δ_t·A (A = −exp(A_log) < 0), b = Δ_t, k = B_t, v = x_t, q = C_t, so K = N and V = P.
Δ_t = softplus(dt_t + dt_bias), clamped to ``time_step_limit``. B and C come in ``n_groups``
groups shared by consecutive heads. Around the SSM: one input projection to (z, x, B, C, dt), a
short causal depthwise conv (with bias) + SiLU over (x, B, C), the D skip, a gated RMSNorm
(``norm(y·silu(z))`` per group, or ``norm(y)·silu(z)`` with ``norm_before_gate``) and the output
projection. Blocks are pre-norm residual (RMSNorm → mixer), then a final RMSNorm and the LM head.

Post-hoc MC (docs/mc.md): the memory of every layer is wrapped in ``MCMemory`` with the
checkpoint's MC settings (``mc_variant`` etc. in :class:`Mamba2Config`); the gated variants use
u_t = q_t = C_t (``share_uq``), so no weights are added. ``mc_variant="none"`` is the model as
trained, and equals transformers' ``Mamba2ForCausalLM`` to float rounding.

Δ scaling (``delta_scale``, training-free context extension in the manner of MambaExtend): layer l
runs with Δ' = s_l·Δ in both the decay exp(Δ'·A) and the input weight Δ', i.e. a longer or
shorter discretisation step. ``None`` (or all ones) is the model as trained.

The model class exposes the interface of ``MCForCausalLM`` that the engine uses: ``.config``,
``init_state``, ``forward(ids, state)``, ``forward_paged(ids, layers)``, ``layers[i].mixer``
(``.memory``, ``.init_memory()``, ``.init_state(batch, dtype, device)``), ``.dtype``,
``.device`` and ``generate``. Its mixer, block and LM build on the Mamba family's bases in
``base.py`` (``ConvSSMMixer``, ``MambaBlock``, ``MambaLM``).

Loading (``load_mamba2``, called by ``mcserve.models.registry``): transformers' format
(``model_type: mamba2``) or ``mamba_ssm``'s (``ssm_cfg`` with ``layer: Mamba2``;
``backbone.embedding.weight``, vocabulary padded to ``pad_vocab_size_multiple``).
``save_pretrained`` writes transformers' format.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mcserve.config import normalize_delta_scale, validate_mc
from mcserve.kernels import cpu as cpu_ops
from mcserve.models.base import ConvSSMMixer, MambaBlock, MambaLM
from mcserve.models.checkpoint import CheckpointError
from mcserve.models.importing import (
    ConvInput,
    ImportedConfig,
    causal_conv,
    check_mamba_ssm_blocks,
    check_positive_ints,
    config_getter,
    first_token_id,
    load_checked,
    mamba_ssm_name,
    mc_settings,
    padded_vocab,
    require_keys,
)
from mcserve.models.importing import up as _up
from mcserve.models.layers import GatedRMSNorm
from mcserve.models.lowp_linear import lowp_of
from mcserve.models.mc import MCMemory
from mcserve.models.mc_state import PagedLayer
from mcserve.models.memory.linear import LinearMemory
from mcserve.models.packed_linear import is_packed
from mcserve.models.state import LayerState
from mcserve.models.varlen import ParamsWatch, params_key

#: used for ``segment_len`` when the checkpoint records no training length
DEFAULT_SEGMENT_LEN = 2048


@dataclass(frozen=True)
class Mamba2Config(ImportedConfig):
    """Architecture of a Mamba2 LM plus the post-hoc MC settings applied to it.

    Field names follow mcserve's ``ModelConfig`` where the engine reads them (``vocab_size``,
    ``d_model``, ``n_layers``, ``n_heads``, ``head_dim`` = the value dim V = P, ``memory``,
    ``mc_*``, ``segment_len``); ``state_size`` is the key dim K = N.
    """

    vocab_size: int = 256  # rows of the embedding / LM head (already padded)
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    head_dim: int = 32  # P: value dim of the memory
    state_size: int = 16  # N: key dim of the memory
    n_groups: int = 1
    conv_size: int = 4
    use_bias: bool = False  # in_proj / out_proj
    use_conv_bias: bool = True
    norm_eps: float = 1e-5  # block and final RMSNorms
    gated_norm_eps: float = 1e-5  # the gated RMSNorm inside the mixer
    rmsnorm: bool = True  # gated RMSNorm; False: y·silu(z)
    norm_before_gate: bool = False
    d_has_hdim: bool = False  # D per channel (H·P) instead of per head
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    residual_in_fp32: bool = True
    tie_embeddings: bool = False
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
    memory: str = "linear"
    share_uq: bool = True
    # per-layer Δ scale s_l (Δ' = s_l·Δ); a number or a 1-element list applies to every layer
    delta_scale: tuple[float, ...] | None = None
    model_type: str = "mamba2"

    def __post_init__(self) -> None:
        check_positive_ints(self, ("vocab_size", "d_model", "n_layers", "n_heads", "head_dim",
                                   "state_size", "n_groups", "conv_size"))
        if self.n_heads % self.n_groups:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_groups "
                             f"({self.n_groups})")
        if self.memory != "linear":
            raise ValueError(f"Mamba2 runs on the 'linear' memory family, got {self.memory!r}")
        if self.model_type != "mamba2":
            raise ValueError(f"model_type must be 'mamba2', got {self.model_type!r}")
        if not self.share_uq:
            raise ValueError("Mamba2 has no gate connectors: share_uq must be True (u = q)")
        lo, hi = self.time_step_limit
        if not 0 <= lo < hi:
            raise ValueError(f"time_step_limit must be (lo, hi) with 0 <= lo < hi, got "
                             f"{self.time_step_limit!r}")
        object.__setattr__(self, "time_step_limit", (float(lo), float(hi)))
        object.__setattr__(self, "delta_scale", normalize_delta_scale(self.delta_scale,
                                                                      self.n_layers))
        validate_mc(self.mc_variant, self.mc_mode, self.segment_len, self.mc_top_k)

    @property
    def d_inner(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.state_size

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["time_step_limit"] = list(self.time_step_limit)
        if self.delta_scale is not None:
            d["delta_scale"] = list(self.delta_scale)
        return d

    @classmethod
    def _from_dict_values(cls, data: dict[str, Any]) -> dict[str, Any]:
        if "time_step_limit" in data:
            data["time_step_limit"] = tuple(float(x) for x in data["time_step_limit"])
        return data


class Mamba2Mixer(ConvSSMMixer):
    """in_proj → (z, xBC, dt); causal conv + SiLU on xBC; SSD as MC linear memory; D skip;
    gated RMSNorm; out_proj. Parameter names match transformers' ``Mamba2Mixer``."""

    def __init__(self, cfg: Mamba2Config, layer_idx: int):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.H, self.P, self.N, self.G = cfg.n_heads, cfg.head_dim, cfg.state_size, cfg.n_groups
        self.delta_scale = cfg.delta_scale[layer_idx] if cfg.delta_scale else 1.0
        d_inner, conv_dim = cfg.d_inner, cfg.conv_dim
        self.in_proj = nn.Linear(cfg.d_model, d_inner + conv_dim + self.H, bias=cfg.use_bias)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, cfg.conv_size, groups=conv_dim,
                                bias=cfg.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(self.H))
        self.A_log = nn.Parameter(torch.zeros(self.H))
        self.D = nn.Parameter(torch.ones(d_inner if cfg.d_has_hdim else self.H))
        self.norm = (GatedRMSNorm(d_inner, d_inner // self.G, cfg.gated_norm_eps,
                                  cfg.norm_before_gate) if cfg.rmsnorm else None)
        self.out_proj = nn.Linear(d_inner, cfg.d_model, bias=cfg.use_bias)
        self.family = LinearMemory()
        self.memory = MCMemory(self.family, cfg.mc)

    # ------------------------------------------------------------------ engine interface
    def init_state(self, batch: int, dtype: torch.dtype, device) -> LayerState:
        mc = self.memory.init_state(batch, self.H, self.N, self.P, dtype=dtype, device=device)
        conv = torch.zeros(batch, self.cfg.conv_size - 1, self.cfg.conv_dim, dtype=dtype,
                           device=device)
        return LayerState(mc, conv)

    def forward_paged(self, x: Tensor, pl: PagedLayer) -> Tensor:
        y = self._fused_paged(x, pl)
        if y is not None:
            return y
        with pl.gathered() as g:
            return super().forward_paged(x, g)

    def _fused_paged(self, x: Tensor, pl: PagedLayer) -> Tensor | None:
        """The decode step as in_proj, one fused kernel call (conv step, gates, state update,
        readout, MC, D skip, gated norm: ``dispatch.fused_linear_decode``, Triton) and out_proj,
        when a kernel backend is active (CUDA tensors, or ``MCSERVE_KERNELS=triton``) and the
        step fits it: one token per row, states writable in place, every block on the device,
        constant segments, no autograd. ``None`` otherwise: the unfused path, its twin."""
        from mcserve.kernels import dispatch

        mc_kw = None if pl.conv is None else self.memory.fused_decode_kwargs(x, pl, self.P)
        if mc_kw is None:
            return None
        cfg, H, N, G = self.cfg, self.H, self.N, self.G
        DI = cfg.d_inner
        z, xbc, dt = self.in_proj(x[:, 0]).split([DI, cfg.conv_dim, H], dim=-1)
        lo, hi = cfg.time_step_limit
        y = dispatch.fused_linear_decode(
            xbc, z, pl.mem["S"], v_offset=0, k_offset=DI, q_offset=DI + G * N, qk_heads=H // G,
            conv_tail=pl.conv, conv_weight=self.conv1d.weight[:, 0], conv_bias=self.conv1d.bias,
            gate_mode="softplus", dt=dt, dt_bias=self.dt_bias, A_log=self.A_log, dt_min=lo,
            dt_max=hi, dt_scale=self.delta_scale, D=self.D,
            norm_weight=self.norm.weight if self.norm is not None else None,
            norm_group=DI // G, norm_eps=self.norm.eps if self.norm is not None else 1e-6,
            norm_before_gate=cfg.norm_before_gate, **mc_kw)
        return self.out_proj(y.to(self.out_proj.weight.dtype))[:, None]

    # ------------------------------------------------------------------ pieces
    def _pre_conv(self, x: Tensor) -> tuple[tuple[Tensor, Tensor], Tensor]:
        """Token-wise: x ``(B, T, D)`` → (z ``(B, T, H·P)``, dt ``(B, T, H)``) and the conv's
        input xBC ``(B, T, C)``."""
        cfg = self.cfg
        z, xbc, dt = self.in_proj(x).split([cfg.d_inner, cfg.conv_dim, self.H], dim=-1)
        return (z, dt), xbc

    @staticmethod
    def _taps(full: ConvInput, w: Tensor) -> Tensor:
        if full.x.shape[1] == 1:  # one product and one sum over the window
            return (torch.cat(list(full), 1) * w.t()).sum(1, keepdim=True)
        return causal_conv(full, w)

    def _post_conv(self, rest: tuple[Tensor, Tensor], xbc: Tensor):
        """Token-wise: (z, dt) and the conv's output ``(B, T, C)`` → z, x_h ``(B, T, H, P)``,
        q, k ``(B, T, H, N)``, gates."""
        z, dt = rest
        B, T, _ = xbc.shape
        cfg = self.cfg
        H, P, N, G = self.H, self.P, self.N, self.G
        xs, Bm, Cm = xbc.split([cfg.d_inner, G * N, G * N], dim=-1)
        xs = xs.reshape(B, T, H, P)
        rep = H // G
        if G == 1:  # one group (most checkpoints): a broadcast view, no copy
            k = Bm.reshape(B, T, 1, N).expand(B, T, H, N)  # (B, T, H, N)
            q = Cm.reshape(B, T, 1, N).expand(B, T, H, N)
        else:
            k = Bm.reshape(B, T, G, N).repeat_interleave(rep, dim=2)  # (B, T, H, N)
            q = Cm.reshape(B, T, G, N).repeat_interleave(rep, dim=2)
        delta = F.softplus(_up(dt) + _up(self.dt_bias))  # (B, T, H)
        lo, hi = cfg.time_step_limit
        if lo > 0 or hi != math.inf:
            delta = delta.clamp(lo, hi)
        if self.delta_scale != 1.0:  # the discretisation step, in decay and input weight alike
            delta = delta * self.delta_scale
        A = -torch.exp(_up(self.A_log))  # (H,)
        gates = {"log_a": (delta * A).to(xs.dtype), "b": delta.to(xs.dtype)}
        return z, xs, q, k, gates

    def _output(self, z: Tensor, xs: Tensor, y: Tensor) -> Tensor:
        B, T, H, P = xs.shape
        D = self.D.to(y.dtype)
        y = y + xs * (D.view(H, P) if self.cfg.d_has_hdim else D[:, None])
        y = y.reshape(B, T, H * P)
        y = self.norm(y, z) if self.norm is not None else y * F.silu(z)
        return self.out_proj(y.to(self.out_proj.weight.dtype))


def _fuses_rows(pl: PagedLayer) -> bool:
    """What the fused block needs of a step's state views: the SSM state and conv tail of
    contiguous float32 rows, written in place."""
    S = pl.mem.get("S")
    return (pl.inplace and pl.rows is None and S is not None and S.dtype == torch.float32
            and S.stride(-1) == 1 and S.stride(-2) == S.shape[-1] and pl.conv is not None
            and pl.conv.stride(-1) == 1)


# the parameters ``mamba2_block_decode_`` reads (the gated norm's weight besides, when present)
_FUSED_PATHS = (("norm", "weight"), ("mixer", "in_proj", "weight"), ("mixer", "in_proj", "bias"),
                ("mixer", "conv1d", "weight"), ("mixer", "conv1d", "bias"), ("mixer", "dt_bias"),
                ("mixer", "A_log"), ("mixer", "D"), ("mixer", "out_proj", "weight"),
                ("mixer", "out_proj", "bias"))


class Mamba2Block(MambaBlock):
    mixer_class = Mamba2Mixer

    def forward_paged(self, x: Tensor, pl: PagedLayer) -> Tensor:
        fused = self._fused_decode(x, pl)
        if fused is not None:
            return fused
        return super().forward_paged(x, pl)

    def _fused_decode(self, x: Tensor, pl: PagedLayer) -> Tensor | None:
        """The whole block for one token per row as one C++ call (``mamba2_block_decode_``)
        when it applies: CPU float32 inference without MC (the plain SSM state), states writable
        in place. ``None`` otherwise: the Python path, its twin."""
        if (torch.is_grad_enabled() or not x.is_cpu or x.dtype != torch.float32
                or x.shape[1] != 1 or not self._fuses_layer() or not _fuses_rows(pl)
                or cpu_ops.ops() is None):
            return None
        if x.shape[0] > cpu_ops.GEMV_MAX_ROWS and self._packed():
            return None
        B = x.shape[0]
        y = cpu_ops.ops().mamba2_block_decode_(x.view(B, -1), *self._fused_args(),
                                               pl.mem["S"], pl.conv)
        return y.view(x.shape)

    def _fuses_layer(self) -> bool:
        """What the fused block needs of the layer itself: no MC (the plain SSM state), Δ as
        trained, float32 norm weights."""
        m = self.mixer
        return (not m.memory.cfg.segmented and m.delta_scale == 1.0
                and self.norm.weight.dtype == torch.float32)

    def _packed(self) -> bool:
        # a batch: oneDNN's packed GEMM (Python path) beats the block's plain one (int8 and
        # bfloat16 weights are never packed: their kernels take any batch in the block)
        return is_packed(self.mixer.in_proj) or is_packed(self.mixer.out_proj)

    def _fused_args(self) -> tuple:
        """The weights and shape arguments of ``mamba2_block_decode_``, cached while the
        parameters stay the same (``params_key``): gathering them through two dozen module
        attribute lookups took longer per layer and step than the rest of the Python path.
        A projection with int8 or bfloat16 weights (``lowp_linear``) passes its compact copy
        (and scales), which the C++ block multiplies by at any row count."""
        m = self.mixer
        # the forward wrappers (they hold the compact weights), kept alive by the cache below so
        # that their ids stay theirs
        fw = (m.in_proj.__dict__.get("forward"), m.out_proj.__dict__.get("forward"))
        key = (params_key(self, _FUSED_PATHS if self.mixer.norm is None
                          else _FUSED_PATHS + (("mixer", "norm", "weight"),)),
               id(fw[0]), id(fw[1]))
        cached = self.__dict__.get("_fused_cache")
        if cached is None or cached[0] != key:
            lp_in, lp_out = lowp_of(m.in_proj), lowp_of(m.out_proj)
            lo, hi = m.cfg.time_step_limit
            d = lambda t: None if t is None else t.detach()  # noqa: E731
            w_in, s_in = ((d(m.in_proj.weight), None) if lp_in is None
                          else (lp_in.data, lp_in.scales))
            w_out, s_out = ((d(m.out_proj.weight), None) if lp_out is None
                            else (lp_out.data, lp_out.scales))
            args = (d(self.norm.weight), self.norm.eps, w_in, s_in,
                    d(m.in_proj.bias),
                    d(m.conv1d.weight)[:, 0], d(m.conv1d.bias), d(m.dt_bias), d(m.A_log), lo, hi,
                    d(m.D), None if m.norm is None else d(m.norm.weight),
                    m.norm.eps if m.norm is not None else 0.0,
                    m.norm.norm_before_gate if m.norm is not None else False,
                    w_out, s_out, d(m.out_proj.bias), m.H, m.P, m.N, m.G)
            cached = self.__dict__["_fused_cache"] = (key, args, fw)
        return cached[1]


class Mamba2MCForCausalLM(MambaLM):
    """Mamba2 language model with post-hoc Memory Caching (model_type ``mamba2``); see
    :class:`MambaLM` for the state-dict names."""

    block_class = Mamba2Block
    # the decode step reads the engine's slot pools through a row index (PagedLayer.rows)
    decode_state_rows = True

    def forward_paged(self, input_ids: Tensor, layers: list[PagedLayer]) -> Tensor:
        """``MambaLM.forward_paged``, with every layer in one C++ call where each layer's
        block would be fused (``Mamba2Block._fused_decode``): the same blocks, one after
        another, without the Python between them."""
        x = self.embed(input_ids)
        stack = self._decode_stack(x, layers)
        if stack is None:
            for blk, pl in zip(self.layers, layers, strict=True):
                x = blk.forward_paged(x, pl)
            return self._head(x)
        B = x.shape[0]
        y = stack.decode_(x.view(B, -1), [pl.mem["S"] for pl in layers],
                          [pl.conv for pl in layers])
        return self._head(y.view(x.shape))

    def _decode_stack(self, x: Tensor, layers: list[PagedLayer]) -> Any:
        """The ``Mamba2Stack`` of every layer's fused block for this step, or None where a
        layer's block would not be fused. Rebuilt when a layer's arguments change
        (``_fused_args``: parameters changed or replaced, weights wrapped)."""
        ops = cpu_ops.ops()
        if (ops is None or torch.is_grad_enabled() or not x.is_cpu or x.dtype != torch.float32
                or x.shape[1] != 1 or not all(_fuses_rows(pl) for pl in layers)):
            return None
        cached = self.__dict__.get("_stack_cache")
        if cached is not None and cached[1] is None:
            return None  # a layer that never fuses (MC, Δ scaled): its own path decides
        if cached is None or not cached[3].current():  # one cheap test, not a walk per layer
            args = [blk._fused_args() for blk in self.layers]
            if cached is None or any(a is not b for a, b in zip(args, cached[0], strict=True)):
                fuses = all(blk._fuses_layer() for blk in self.layers)
                cached = (args, ops.Mamba2Stack(args) if fuses else None,
                          any(blk._packed() for blk in self.layers))
            cached = self.__dict__["_stack_cache"] = cached[:3] + (self._stack_watch(),)
        if cached[1] is None or (x.shape[0] > cpu_ops.GEMV_MAX_ROWS and cached[2]):
            return None
        return cached[1]

    def _stack_watch(self) -> ParamsWatch:
        """What ``_fused_args`` of every layer reads, watched as one: the parameters, the
        modules on their paths and the projections' ``forward`` wrappers."""
        paths, attrs = [], []
        for i, blk in enumerate(self.layers):
            at = ("layers", str(i))
            own = _FUSED_PATHS + ((("mixer", "norm", "weight"),) if blk.mixer.norm is not None
                                  else ())
            paths += [at + p for p in own]
            attrs += [(at + ("mixer", proj), "forward") for proj in ("in_proj", "out_proj")]
        return ParamsWatch(self, tuple(paths), tuple(attrs))

    def with_delta_scale(self, delta_scale: Any) -> Mamba2MCForCausalLM:
        """The same weights with Δ' = s_l·Δ (``delta_scale``: see
        ``mcserve.config.normalize_delta_scale``)."""
        return self.with_mc(delta_scale=delta_scale)

    # ------------------------------------------------------------------ export
    def hf_state_dict(self) -> dict[str, Tensor]:
        """The weights under transformers' ``Mamba2ForCausalLM`` names."""
        out = {}
        for name, t in self.state_dict().items():
            if name == "embed.weight":
                out["backbone.embeddings.weight"] = t
            elif name == "lm_head.weight":
                out[name] = t
            else:
                out["backbone." + name] = t
        return out

    def save_pretrained(self, path: str | Path) -> Path:
        """Write a transformers-format directory (config.json + model.safetensors)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        c = self.config
        cfg = {
            "model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"],
            "vocab_size": c.vocab_size, "hidden_size": c.d_model,
            "num_hidden_layers": c.n_layers, "num_heads": c.n_heads, "head_dim": c.head_dim,
            "state_size": c.state_size, "n_groups": c.n_groups, "conv_kernel": c.conv_size,
            "expand": (c.d_inner // c.d_model if c.d_inner % c.d_model == 0
                       else c.d_inner / c.d_model),
            "use_bias": c.use_bias, "use_conv_bias": c.use_conv_bias,
            "layer_norm_epsilon": c.norm_eps, "residual_in_fp32": c.residual_in_fp32,
            "time_step_limit": [c.time_step_limit[0],
                                c.time_step_limit[1] if math.isfinite(c.time_step_limit[1])
                                else {"__float__": "Infinity"}],
            "tie_word_embeddings": c.tie_embeddings, "bos_token_id": c.bos_token_id,
            "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id,
        }
        if c.max_position_embeddings is not None:
            cfg["max_position_embeddings"] = c.max_position_embeddings
        (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        tensors = {k: v.detach().to("cpu").contiguous().clone()
                   for k, v in self.hf_state_dict().items()}
        if c.tie_embeddings:
            tensors.pop("lm_head.weight", None)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path


# ---------------------------------------------------------------------------- loading
def mamba2_config_from_hf(cfg: dict, file: Path) -> Mamba2Config:
    """A ``Mamba2Config`` from a transformers ``Mamba2Config`` dict."""
    get = config_getter(cfg, file)
    d_model = get("hidden_size", required=True)
    n_heads = get("num_heads", 128)
    head_dim = get("head_dim", 64)
    expand = get("expand", 2)
    if isinstance(d_model, int) and abs(expand * d_model - n_heads * head_dim) > 1e-6:
        raise CheckpointError(f"{file}: hidden_size * expand ({d_model} * {expand}) must equal "
                              f"num_heads * head_dim ({n_heads} * {head_dim})")
    act = get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise CheckpointError(f"{file}: hidden_act {act!r} is not supported (only 'silu')")
    train_len, mc = mc_settings(cfg, DEFAULT_SEGMENT_LEN)
    limit = get("time_step_limit", (0.0, math.inf)) or (0.0, math.inf)
    eos = first_token_id(get("eos_token_id"))
    try:
        return Mamba2Config(
            vocab_size=get("vocab_size", required=True), d_model=d_model,
            n_layers=get("num_hidden_layers", required=True), n_heads=n_heads,
            head_dim=head_dim, state_size=get("state_size", 128), n_groups=get("n_groups", 1),
            conv_size=get("conv_kernel", 4), use_bias=bool(get("use_bias", False)),
            use_conv_bias=bool(get("use_conv_bias", True)),
            norm_eps=float(get("layer_norm_epsilon", 1e-5)),
            gated_norm_eps=float(get("layer_norm_epsilon", 1e-5)),
            time_step_limit=tuple(limit), residual_in_fp32=bool(get("residual_in_fp32", True)),
            tie_embeddings=bool(get("tie_word_embeddings", False)),
            max_position_embeddings=train_len, bos_token_id=get("bos_token_id"),
            eos_token_id=eos, pad_token_id=get("pad_token_id"), **mc,
        )
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: invalid Mamba2 config: {e}") from None


def mamba2_config_from_ssm(cfg: dict, file: Path) -> Mamba2Config:
    """A ``Mamba2Config`` from a ``mamba_ssm`` ``MambaConfig`` dict (``layer: Mamba2``)."""
    require_keys(cfg, file, ("d_model", "n_layer", "vocab_size"))
    ssm = dict(cfg.get("ssm_cfg") or {})
    d_model = cfg["d_model"]
    check_mamba_ssm_blocks(cfg, file)
    expand = ssm.get("expand", 2)
    d_inner = int(expand * d_model)
    d_ssm = ssm.get("d_ssm") or d_inner
    if d_ssm != d_inner:
        raise CheckpointError(f"{file}: ssm_cfg.d_ssm={d_ssm} != expand * d_model={d_inner} "
                              f"(a gated MLP inside the mixer) is not supported")
    headdim = ssm.get("headdim", 64)
    if d_ssm % headdim:
        raise CheckpointError(f"{file}: d_ssm={d_ssm} is not a multiple of headdim={headdim}")
    vocab, padded = padded_vocab(cfg)
    limit = ssm.get("dt_limit", (0.0, math.inf))
    train_len, mc = mc_settings(cfg, DEFAULT_SEGMENT_LEN)
    try:
        return Mamba2Config(
            vocab_size=padded, d_model=d_model, n_layers=cfg["n_layer"],
            n_heads=d_ssm // headdim, head_dim=headdim, state_size=ssm.get("d_state", 128),
            n_groups=ssm.get("ngroups", 1), conv_size=ssm.get("d_conv", 4),
            use_bias=bool(ssm.get("bias", False)), use_conv_bias=bool(ssm.get("conv_bias", True)),
            norm_eps=float(cfg.get("norm_epsilon", 1e-5)), gated_norm_eps=1e-5,
            rmsnorm=bool(ssm.get("rmsnorm", True)),
            norm_before_gate=bool(ssm.get("norm_before_gate", False)),
            d_has_hdim=bool(ssm.get("D_has_hdim", False)), time_step_limit=tuple(limit),
            residual_in_fp32=bool(cfg.get("residual_in_fp32", True)),
            tie_embeddings=bool(cfg.get("tie_embeddings", True)),
            unpadded_vocab_size=vocab if padded != vocab else None,
            max_position_embeddings=train_len, **mc,
        )
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: invalid mamba_ssm Mamba2 config: {e}") from None


def load_mamba2(path: Path, cfg: dict, layout: str,
                read_weights: Callable[[Path], tuple[dict[str, Tensor], dict[str, Path]]]
                ) -> Mamba2MCForCausalLM:
    """The model of a transformers (``layout="transformers"``) or ``mamba_ssm`` Mamba2
    directory. ``read_weights(path)`` gives its tensors and the file each came from; it is
    called once the config has converted, so a bad config.json is reported before any weights
    are read."""
    file = path / "config.json"
    mcfg = (mamba2_config_from_ssm(cfg, file) if layout == "mamba_ssm"
            else mamba2_config_from_hf(cfg, file))
    stored, origin = read_weights(path)
    emb = "embedding" if layout == "mamba_ssm" else "embeddings"

    def source_name(ours: str) -> str:
        if ours == "embed.weight":
            return f"backbone.{emb}.weight"
        return ours if ours == "lm_head.weight" else "backbone." + ours

    return load_checked(Mamba2MCForCausalLM(mcfg), stored, origin, mamba_ssm_name, source_name,
                        config_file=file, tied=mcfg.tie_embeddings, what="Mamba2")
