"""Frozen, validated configuration dataclasses passed everywhere (one place for settings), and
the validators they share (``validate_mc``, ``normalize_delta_scale``).

This module imports nothing from mcserve: every layer may import it."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

MEMORIES = ("linear", "swla", "dla", "titans")
VARIANTS = ("none", "residual", "grm", "soup", "ssc", "loglinear", "post")
MODES = ("checkpoint", "independent")


def default_mode(variant: str) -> str | None:
    """The ``mc_mode`` a post-hoc switch to ``variant`` implies when none is given: ``post`` is
    the paper's post-training variant (independent segments), ``loglinear`` only exists with
    checkpoints; None keeps the current mode."""
    return {"post": "independent", "loglinear": "checkpoint"}.get(variant)


def validate_mc(
    variant: str, mode: str, segment_len: int, top_k: int, *, memory: str = "linear",
    inner_chunk: int = 1,
) -> None:
    """Raise ValueError naming the bad argument for an invalid MC setting."""
    if memory not in MEMORIES:
        raise ValueError(f"memory={memory!r} is not one of {MEMORIES}")
    if variant not in VARIANTS:
        raise ValueError(f"mc_variant={variant!r} is not one of {VARIANTS}")
    if mode not in MODES:
        raise ValueError(f"mc_mode={mode!r} is not one of {MODES}")
    if variant == "loglinear" and mode != "checkpoint":
        raise ValueError("mc_mode must be 'checkpoint' for mc_variant='loglinear'")
    if not isinstance(segment_len, int) or segment_len < 1:
        raise ValueError(f"segment_len must be a positive integer, got {segment_len!r}")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"mc_top_k must be a positive integer, got {top_k!r}")
    if not isinstance(inner_chunk, int) or inner_chunk < 1:
        raise ValueError(f"inner_chunk must be a positive integer, got {inner_chunk!r}")
    if memory in ("dla", "titans") and segment_len % inner_chunk != 0:
        raise ValueError(
            f"segment_len ({segment_len}) must be a multiple of inner_chunk ({inner_chunk})"
        )



def _is_scale(v: Any) -> bool:
    """One valid ``delta_scale`` value: a finite number > 0 (not a bool)."""
    return (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
            and v > 0)


def normalize_delta_scale(value: Any, n_layers: int) -> tuple[float, ...] | None:
    """Mamba2's ``delta_scale`` (layer l runs with Δ' = s_l·Δ) as one positive float per layer,
    or None for the model as trained.

    Accepts None, a number (every layer), or a sequence of 1 or ``n_layers`` numbers; anything
    else is a ValueError naming ``delta_scale``."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        vals = [value]
    elif isinstance(value, (list, tuple)):
        vals = list(value)
    else:
        raise ValueError(f"delta_scale must be a number or a list of numbers, got {value!r}")
    if len(vals) == 1:
        vals = vals * n_layers
    if len(vals) != n_layers:
        raise ValueError(f"delta_scale needs 1 or n_layers ({n_layers}) values, got {len(vals)}")
    out = []
    for v in vals:
        if not _is_scale(v):
            raise ValueError(f"delta_scale values must be finite numbers > 0, got {v!r}")
        out.append(float(v))
    return tuple(out)

@dataclass(frozen=True)
class MCConfig:
    """How one layer caches and aggregates its memory (docs/mc.md).

    The one home of each MC setting: code outside this module (and the plain reference oracle,
    ``mcserve.kernels.reference``) asks the capability properties below instead of comparing
    variant names.
    """

    variant: str = "grm"
    mode: str = "checkpoint"
    segment_len: int = 64
    top_k: int = 2  # ssc: cached segments each token reads besides the online one
    share_uq: bool = False  # u_t = q_t instead of a learned x·W_u (the post-hoc parameterisation)

    def __post_init__(self) -> None:
        validate_mc(self.variant, self.mode, self.segment_len, self.top_k)

    # ------------------------------------------------------------------ capabilities
    @property
    def segmented(self) -> bool:
        """The memory is cut into segments whose checkpoints are cached (every variant but
        ``none``; ``loglinear`` segments logarithmically, the others every ``segment_len``)."""
        return self.variant != "none"

    @property
    def log_segmented(self) -> bool:
        """Logarithmic segmentation (``loglinear``): the checkpoints change every token (a stack
        of at most log2(n) + 1 that merges as the position grows), so they are never shared."""
        return self.variant == "loglinear"

    @property
    def caches_blocks(self) -> bool:
        """Constant segmentation: every completed segment of ``segment_len`` tokens is a fixed
        checkpoint, which the engine keeps as a block of its pool (and may share by prefix)."""
        return self.segmented and not self.log_segmented

    @property
    def routes(self) -> bool:
        """Each token weighs the segments by a score ⟨u_t, mean key of the segment⟩ (a softmax
        gate over the cached and the online memories): needs u (a learned ``u_proj`` or
        ``share_uq``)."""
        return self.variant in ("grm", "soup", "ssc", "loglinear")

    @property
    def selects(self) -> bool:
        """Routing reads only the ``top_k`` best-scored cached segments (``ssc``); ``top_k`` may
        be overridden per request."""
        return self.variant == "ssc"

    @property
    def mixes_parameters(self) -> bool:
        """The gate mixes the memories' parameters before one readout (``soup``); on a linear
        memory the readout is linear in them, which makes it the same as mixing outputs."""
        return self.variant == "soup"

    @property
    def fixed_weights(self) -> bool:
        """Every memory gets the same fixed weight, no routing (``residual``: 1 each, ``post``:
        1/(n+1) each): on linear memories the cached states collapse into one running sum."""
        return self.variant in ("residual", "post")

    @property
    def averages(self) -> bool:
        """The fixed weight is 1/(n+1) over n cached segments (``post``), not 1."""
        return self.variant == "post"

    @property
    def independent(self) -> bool:
        """Every segment's memory starts afresh from the initial memory."""
        return self.mode == "independent"

    def collapses(self, linear_memory: bool) -> bool:
        """Whether the cache collapses into one summed state on this memory family (a linear
        memory: the readout of a sum is the sum of the readouts)."""
        return linear_memory and self.fixed_weights


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of the native ``MCForCausalLM`` (model_type ``mcserve``).

    The MC fields are flat (``mc_variant``...) so that ``config.json`` reads like a transformers
    config; ``.mc`` gives them as an ``MCConfig``.
    """

    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 2
    head_dim: int = 32  # K = V = head_dim
    memory: str = "linear"
    mc_variant: str = "grm"
    mc_mode: str = "checkpoint"
    segment_len: int = 64
    mc_top_k: int = 2
    share_uq: bool = False
    inner_chunk: int = 16  # deep memories: tokens per mini-batch gradient step
    memory_expansion: int = 4  # deep memories: E = memory_expansion * K
    conv_size: int = 4  # short causal depthwise conv on q, k, v; 0 disables it
    use_decay_gate: bool = True  # per-head, data-dependent a_t (linear/swla/titans)
    use_write_gate: bool = True  # per-head, data-dependent b_t (and c_t for swla)
    mlp_ratio: float = 8 / 3  # SwiGLU hidden = round_up(mlp_ratio * d_model, 16)
    tie_embeddings: bool = True
    norm_eps: float = 1e-6
    max_position_embeddings: int = 1024  # the training length; informs post-hoc defaults only
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    model_type: str = field(default="mcserve", repr=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "head_dim"):
            val = getattr(self, name)
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive integer, got {val!r}")
        if self.model_type != "mcserve":
            raise ValueError(f"model_type must be 'mcserve', got {self.model_type!r}")
        validate_mc(
            self.mc_variant, self.mc_mode, self.segment_len, self.mc_top_k,
            memory=self.memory, inner_chunk=self.inner_chunk,
        )
        if self.conv_size < 0:
            raise ValueError(f"conv_size must be >= 0, got {self.conv_size}")
        if self.memory_expansion < 1:
            raise ValueError(f"memory_expansion must be >= 1, got {self.memory_expansion}")

    @property
    def mc(self) -> MCConfig:
        return MCConfig(
            variant=self.mc_variant, mode=self.mc_mode, segment_len=self.segment_len,
            top_k=self.mc_top_k, share_uq=self.share_uq,
        )

    @property
    def mlp_hidden(self) -> int:
        return int(-(-self.mlp_ratio * self.d_model // 16) * 16)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a config.json dict; unknown keys are an error naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; known keys are {sorted(names)}")
        return cls(**data)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


_DTYPES = ("float32", "float64", "bfloat16")
#: weight quantizations of the CPU engine (models/lowp_linear.py); None is off
QUANTIZATIONS = ("int8",)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the model weights; validated once here.

    MC fields left as None keep the model's own settings (checkpoint config.json).
    """

    model: str | None = None  # checkpoint directory; None = the embedded default model
    tokenizer: str | None = None  # directory with tokenizer.json; None = the model directory
    max_num_seqs: int = 32  # sequences decoded together in one step
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_model_len: int = 32768  # prompt + generated tokens of one sequence
    # device pool of cached segment checkpoints (all layers each); None = sized automatically:
    # enough for every slot at max_model_len, capped by state_cache_mib, and none at all for
    # variants that cache nothing (none, loglinear)
    num_state_blocks: int | None = None
    state_cache_mib: int = 1024  # budget (MiB) of the automatic block pool and the resume points
    # hybrid models: the attention layers' paged KV pool, in MiB, and its block size in tokens
    # (independent of the recurrent state's size)
    kv_cache_mib: int = 1024
    kv_block_size: int = 16
    num_kv_blocks: int | None = None  # a fixed number of KV blocks instead of kv_cache_mib's
    # CPU: run nn.Linear layers through oneDNN-packed weight copies (models/packed_linear.py);
    # 2-3x faster GEMMs at decode batch sizes, at the cost of a second copy of the weights
    cpu_packed_weights: bool = True
    # CUDA: no CUDA graphs of the decode step (captured per batch-size bucket at start-up
    # otherwise); the CPU never uses them
    enforce_eager: bool = False
    host_state_blocks: int = 0  # host tier for preempted sequences' blocks (0 = recompute)
    enable_prefix_caching: bool = True  # prefix blocks and resume points (docs/engine.md)
    # resume points (the whole recurrent state at a token position, docs/engine.md): one every
    # checkpoint_interval prompt tokens (None: picked from the state's size and the budget;
    # 0: no grid, only request ends, chat message ends and explicit positions)
    checkpoint_interval: int | None = None
    # a host-memory tier (MiB) that resume points spill to from a GPU before the disk or being
    # dropped; unused on the CPU, whose device tier is host memory already
    host_state_cache_mib: int = 4096
    state_cache_dir: str | None = None  # disk tier of resume points (survives a restart)
    state_cache_disk_gib: float = 8.0  # bound of the disk tier
    # weights and activations; on the CPU "bfloat16" gives the large linears bfloat16 weights
    # and keeps everything else (activations, state, small parameters) float32
    # (models/lowp_linear.py)
    dtype: str = "float32"
    # CPU: "int8" gives the large linears weight-only int8 weights (one scale per output
    # channel), quantized at load time; None: off (models/lowp_linear.py)
    quantization: str | None = None
    device: str = "cpu"
    seed: int = 0  # global sampling seed for requests without their own
    mc_variant: str | None = None
    mc_mode: str | None = None
    segment_len: int | None = None
    mc_top_k: int | None = None
    # Mamba2 only: per-layer scale of the discretisation step, Δ' = s_l·Δ (a number for every
    # layer, or one per layer); None keeps the model as trained
    delta_scale: float | tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "num_state_blocks", "state_cache_mib", "kv_cache_mib", "kv_block_size",
                     "num_kv_blocks"):
            val = getattr(self, name)
            if name in ("num_state_blocks", "num_kv_blocks") and val is None:
                continue
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name} must be a positive integer, got {val!r}")
        for name in ("host_state_blocks", "host_state_cache_mib"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {val!r}")
        ci = self.checkpoint_interval
        if ci is not None and (not isinstance(ci, int) or isinstance(ci, bool) or ci < 0):
            raise ValueError(f"checkpoint_interval must be an integer >= 0 (0: no grid), got "
                             f"{ci!r}")
        gib = self.state_cache_disk_gib
        if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not gib > 0:
            raise ValueError(f"state_cache_disk_gib must be a number > 0, got {gib!r}")
        if self.state_cache_dir is not None and not isinstance(self.state_cache_dir, str):
            raise ValueError(f"state_cache_dir must be a path string, got "
                             f"{self.state_cache_dir!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.quantization is not None:
            if self.quantization not in QUANTIZATIONS:
                raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got "
                                 f"{self.quantization!r}")
            if self.dtype != "float32":
                raise ValueError(f"quantization={self.quantization!r} needs dtype='float32' (the "
                                 f"int8 kernels take float32 activations), got "
                                 f"dtype={self.dtype!r}")
            if not str(self.device).startswith("cpu"):
                raise ValueError(f"quantization={self.quantization!r} is a CPU path, got "
                                 f"device={self.device!r}")
        if self.mc_variant is not None and self.mc_variant not in VARIANTS:
            raise ValueError(f"mc_variant={self.mc_variant!r} is not one of {VARIANTS}")
        if self.mc_mode is not None and self.mc_mode not in MODES:
            raise ValueError(f"mc_mode={self.mc_mode!r} is not one of {MODES}")
        for name in ("segment_len", "mc_top_k"):
            val = getattr(self, name)
            if val is not None and (not isinstance(val, int) or val < 1):
                raise ValueError(f"{name} must be a positive integer, got {val!r}")
        if self.delta_scale is not None:
            ds = self.delta_scale
            vals = list(ds) if isinstance(ds, (list, tuple)) else [ds]
            if not vals or not all(_is_scale(v) for v in vals):
                raise ValueError(f"delta_scale must be a number > 0 or a non-empty list of "
                                 f"numbers > 0, got {ds!r}")
            if isinstance(ds, list):
                object.__setattr__(self, "delta_scale", tuple(float(v) for v in ds))

    def mc_overrides(self) -> dict[str, Any]:
        """The overrides ``load_model`` applies (MC settings and, when set, ``delta_scale``)."""
        names = ("mc_variant", "mc_mode", "segment_len", "mc_top_k", "delta_scale")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)
