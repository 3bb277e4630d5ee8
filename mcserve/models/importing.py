"""What the importers of pretrained formats share: the registry (``registry.py``) and the model
modules it loads (``mamba1``, ``mamba2``, ``fla_delta``, ``fla_gla``, ``rwkv7``) import these
from here. This module imports none of them, so no import cycle runs through it.

* config.json reading: the MC keys a config may carry, the training length it records, small
  checks shared by the converters (required keys, positive integer fields, ``mamba_ssm``
  blocks, vocabulary padding);
* :class:`ImportedConfig` and :class:`RebuildsUnderMC`: the config and model methods every
  imported family has (``mc``, ``to_dict``, ``replace``, ``from_dict``; ``with_mc``);
* :func:`load_checked`: a renamed state dict loaded with every mismatch a ``CheckpointError``,
  the checkpoint's tensors becoming the parameters (no copy); :func:`no_init`, under which the
  registry builds a model that is about to receive a checkpoint;
* small pieces several families use as they are (``up``, ``causal_conv``); shared layers
  live in ``layers.py``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch
from torch import Tensor, nn

from mcserve.config import MCConfig
from mcserve.kernels import cpu as cpu_ops
from mcserve.models.checkpoint import CheckpointError

#: the MC settings a config.json may carry
MC_KEYS = ("mc_variant", "mc_mode", "segment_len", "mc_top_k")
#: config.json keys that record the training context length, in order of preference
TRAINING_LENGTH_KEYS = ("max_position_embeddings", "max_seq_len", "seq_len", "n_ctx",
                        "training_seq_len")

_C = TypeVar("_C", bound="ImportedConfig")
_M = TypeVar("_M", bound="RebuildsUnderMC")


# ---------------------------------------------------------------------------- config.json
def training_length(cfg: dict) -> int | None:
    """The training context length a config records, if any."""
    for key in TRAINING_LENGTH_KEYS:
        val = cfg.get(key)
        if isinstance(val, int) and not isinstance(val, bool) and val > 0:
            return val
    return None


def mc_settings(cfg: dict, default_segment_len: int) -> tuple[int | None, dict[str, Any]]:
    """``(training length, MC fields)`` of a config: the MC keys it carries, with
    ``segment_len`` defaulting to the training length, else ``default_segment_len``."""
    train_len = training_length(cfg)
    mc = {k: cfg[k] for k in MC_KEYS if k in cfg}
    mc.setdefault("segment_len", train_len or default_segment_len)
    return train_len, mc


def first_token_id(value: Any) -> Any:
    """A token id a config may store as a list (``eos_token_id: [0, 2]``): its first entry."""
    if isinstance(value, list):
        return value[0] if value else None
    return value


def require_keys(cfg: dict, file: Path, keys: Iterable[str]) -> None:
    for key in keys:
        if key not in cfg:
            raise CheckpointError(f"{file}: required key {key!r} is missing")


def config_getter(cfg: dict, file: Path) -> Callable[..., Any]:
    """``get(key, default=None, required=False)`` over ``cfg``: a missing required key is a
    ``CheckpointError`` naming ``file``."""
    def get(key, default=None, required=False):
        if key not in cfg:
            if required:
                raise CheckpointError(f"{file}: required key {key!r} is missing")
            return default
        return cfg[key]

    return get


def mamba_ssm_name(src: str) -> str:
    """A transformers / mamba_ssm Mamba or Mamba2 tensor name → the name in mcserve's model
    (``backbone.`` dropped, the embedding as ``embed.weight``)."""
    name = src[len("backbone."):] if src.startswith("backbone.") else src
    if name in ("embeddings.weight", "embedding.weight"):
        return "embed.weight"
    return name


def check_mamba_ssm_blocks(cfg: dict, file: Path) -> None:
    """A ``mamba_ssm`` ``MambaConfig`` dict must describe plain RMSNorm → mixer blocks."""
    if cfg.get("d_intermediate", 0):
        raise CheckpointError(f"{file}: d_intermediate={cfg['d_intermediate']} (MLP blocks after "
                              f"the mixer) is not supported")
    if cfg.get("attn_layer_idx"):
        raise CheckpointError(f"{file}: attn_layer_idx={cfg['attn_layer_idx']} (hybrid attention "
                              f"layers) is not supported")
    if not cfg.get("rms_norm", True):
        raise CheckpointError(f"{file}: rms_norm=false (LayerNorm blocks) is not supported")


def padded_vocab(cfg: dict) -> tuple[int, int]:
    """``(vocab_size, rows)`` of a ``mamba_ssm`` config: the vocabulary padded to
    ``pad_vocab_size_multiple``."""
    vocab = cfg["vocab_size"]
    mult = cfg.get("pad_vocab_size_multiple", 8) or 1
    return vocab, vocab + (-vocab) % mult


def check_positive_ints(obj: Any, names: Iterable[str]) -> None:
    for name in names:
        val = getattr(obj, name)
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name} must be a positive integer, got {val!r}")


# ---------------------------------------------------------------------------- config / model API
class ImportedConfig:
    """Methods of an imported family's (frozen dataclass) config with the post-hoc MC fields
    ``mc_variant``, ``mc_mode``, ``segment_len``, ``mc_top_k`` (u = q: ``share_uq``)."""

    @property
    def mc(self) -> MCConfig:
        return MCConfig(variant=self.mc_variant, mode=self.mc_mode, segment_len=self.segment_len,
                        top_k=self.mc_top_k, share_uq=True)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[_C], data: dict[str, Any]) -> _C:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; known keys are {sorted(names)}")
        return cls(**cls._from_dict_values(dict(data)))

    @classmethod
    def _from_dict_values(cls, data: dict[str, Any]) -> dict[str, Any]:
        """``from_dict``'s keyword arguments from the (known) keys of ``data``."""
        return data

    def replace(self: _C, **changes: Any) -> _C:
        return dataclasses.replace(self, **changes)


class RebuildsUnderMC:
    """``with_mc`` for a model built from ``self.config`` (an :class:`ImportedConfig`)."""

    def with_mc(self: _M, **mc: Any) -> _M:
        """The same weights under other MC settings (``mc_variant``, ``mc_mode``, ...)."""
        new = type(self)(self.config.replace(**mc))
        new.load_state_dict(self.state_dict())
        return new.to(device=self.device, dtype=self.dtype).eval()


# ---------------------------------------------------------------------------- weights
def listed(names, n: int = 8) -> str:
    """The first ``n`` of ``names`` (sorted, quoted) and how many more."""
    names = sorted(names)
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(repr(x) for x in names[:n]) + more


#: ``torch.nn.init``'s initializers, which ``no_init`` makes leave their tensor as it is
_INITIALIZERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_",
                 "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                 "kaiming_normal_", "orthogonal_", "sparse_")


_no_init = threading.local()  # the threads inside ``no_init``
_no_init_lock = threading.Lock()
_no_init_saved: dict[str, Callable[..., Tensor]] = {}
_no_init_depth = 0


def _skipping(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    def init_unless_loading(tensor: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if getattr(_no_init, "on", False):
            return tensor
        return fn(tensor, *args, **kwargs)

    return init_unless_loading


@contextlib.contextmanager
def no_init() -> Iterator[None]:
    """Within the block, in this thread, ``torch.nn.init``'s initializers do nothing: a model
    built to receive a checkpoint's weights is not filled with random values first, so its
    parameters' memory is never touched (``load_checked`` then takes the checkpoint's tensors as
    the parameters) and a large model's load neither spends seconds on random numbers nor peaks
    at twice its weights. Values set otherwise (``fill_``, ``copy_``, buffers computed in
    ``__init__``) are unaffected, and so is every other thread (the initializers are wrapped
    while any thread is inside, and check which thread calls)."""
    global _no_init_depth
    init = torch.nn.init
    with _no_init_lock:
        if _no_init_depth == 0:
            for name in _INITIALIZERS:
                if hasattr(init, name):
                    _no_init_saved[name] = getattr(init, name)
                    setattr(init, name, _skipping(_no_init_saved[name]))
        _no_init_depth += 1
    before = getattr(_no_init, "on", False)
    _no_init.on = True
    try:
        yield
    finally:
        _no_init.on = before
        with _no_init_lock:
            _no_init_depth -= 1
            if _no_init_depth == 0:
                for name, fn in _no_init_saved.items():
                    setattr(init, name, fn)
                _no_init_saved.clear()


#: set by ``registry.load_model`` for a low-precision CPU load: ``(model, name, tensor)`` → the
#: parameter to hold instead of a float copy of ``tensor`` (``lowp_linear.compact_on_load``),
#: or None to keep it as it is
ON_LOAD: contextvars.ContextVar[Callable[[nn.Module, str, Tensor], nn.Parameter | None] | None]
ON_LOAD = contextvars.ContextVar("mcserve_on_load", default=None)


def _tied_names(model: nn.Module) -> list[list[str]]:
    """The parameter names of ``model`` that are one tensor (a tied embedding and head)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _set_param(model: nn.Module, name: str, p: nn.Parameter) -> None:
    mod_name, _, leaf = name.rpartition(".")
    model.get_submodule(mod_name)._parameters[leaf] = p


def load_checked(model: nn.Module, stored: dict[str, Tensor], origin: dict[str, Path],
                 rename: Callable[[str], str], source_name: Callable[[str], str], *,
                 config_file: Path, tied: bool, what: str,
                 embed_name: str = "embed.weight") -> nn.Module:
    """Load ``stored`` (source names) into ``model`` after renaming, or raise a
    ``CheckpointError`` naming the file and the source tensor: two tensors with one name, a
    missing tensor, an unknown one, a wrong shape or a non-float dtype; a tied head stored with
    values other than the embedding's (``embed_name``). ``source_name`` maps our names back
    for messages."""
    renamed: dict[str, Tensor] = {}
    src_of: dict[str, str] = {}
    for name, t in stored.items():
        ours = rename(name)
        if ours in renamed:
            raise CheckpointError(f"{origin[name]}: tensors {src_of[ours]!r} and {name!r} both "
                                  f"map to {ours!r}")
        renamed[ours] = t
        src_of[ours] = name
    expected = model.state_dict()
    weights_file = next(iter(origin.values())) if origin else config_file.parent
    if tied and "lm_head.weight" in renamed and embed_name in renamed:
        if not torch.equal(renamed["lm_head.weight"], renamed[embed_name]):
            raise CheckpointError(f"{origin[src_of['lm_head.weight']]}: "
                                  f"{src_of['lm_head.weight']!r} and the embedding are tied in "
                                  f"{config_file} but hold different values")
        renamed.pop("lm_head.weight")
        src_of.pop("lm_head.weight")
    skip = {"lm_head.weight"} if tied else set()
    missing = [n for n in expected if n not in renamed and n not in skip]
    if missing:
        srcs = [source_name(n) for n in missing]
        more = f" (and {listed(srcs[1:])})" if len(srcs) > 1 else ""
        raise CheckpointError(f"{weights_file} is missing tensor {srcs[0]!r}{more} required by "
                              f"{config_file}")
    unexpected = [n for n in renamed if n not in expected]
    if unexpected:
        names = [src_of[n] for n in unexpected]
        raise CheckpointError(f"{origin[names[0]]} has tensors this {what} model does not use: "
                              f"{listed(names)}")
    for name, want in expected.items():
        if name in skip:
            continue
        got, src = renamed[name], src_of[name]
        if tuple(got.shape) != tuple(want.shape):
            raise CheckpointError(f"{origin[src]}: tensor {src!r} has shape {tuple(got.shape)}, "
                                  f"expected {tuple(want.shape)} from {config_file}")
        if not got.dtype.is_floating_point:
            raise CheckpointError(f"{origin[src]}: tensor {src!r} has dtype {got.dtype}, "
                                  f"expected a floating point tensor")
    tied_names = _tied_names(model)
    convert = ON_LOAD.get()
    plain: dict[str, Tensor] = {}
    for name, t in renamed.items():
        p = convert(model, name, t) if convert is not None else None
        if p is not None:  # a compact (int8 / bfloat16) weight made from the tensor as read
            _set_param(model, name, p)
        else:  # a copy of its own, so nothing refers to the checkpoint's mapped file after
            plain[name] = t.to(expected[name].dtype, copy=True)
    # the tensors become the parameters (``assign``): the model's own, left uninitialised
    # under ``no_init``, are never touched, and no second copy of the weights exists
    model.load_state_dict(plain, strict=False, assign=True)  # the checks above are stricter
    for names in tied_names:  # assigning replaced one name's parameter: tie the others again
        loaded = [n for n in names if n in renamed]  # one, by the checks above
        p = model.get_parameter(loaded[0])
        for n in names:
            _set_param(model, n, p)
    return model.eval()


def renamers(rename: tuple[tuple[str, str], ...], parts: tuple[tuple[str, str], ...]
             ) -> tuple[Callable[[str], str], Callable[[str], str]]:
    """(transformers name → ours, ours → transformers name) from a table of prefixes and one
    of inner parts (the first matching entry of each applies; the reverse map takes the first
    entry with the ours side, so list the current transformers name before legacy ones)."""
    def apply(name: str, back: bool) -> str:
        for pair in rename:
            a, b = pair[::-1] if back else pair
            if name.startswith(a):
                name = b + name[len(a):]
                break
        for pair in parts:
            a, b = pair[::-1] if back else pair
            if a in name:
                return name.replace(a, b, 1)
        return name

    return (lambda src: apply(src, False)), (lambda name: apply(name, True))


# ---------------------------------------------------------------------------- shared layers
def up(x: Tensor) -> Tensor:
    """Half precision → float32 (as the reference implementations compute norms, Δ and
    gates); float64 stays."""
    return x.float() if x.element_size() < 4 else x


class ConvInput(NamedTuple):
    """A short conv's input over a span, the previous tail ``(B, W - 1, C)`` in front of the
    span's ``x`` ``(B, T, C)``, kept as the two parts: concatenating them copied the whole span
    once per layer (4% of a long prefill) only to read it back shifted."""

    tail: Tensor
    x: Tensor

    def rows(self, start: int, n: int) -> Tensor:
        """Rows ``[start, start + n)`` of ``[tail; x]`` ``(B, n, C)`` (a view unless the range
        straddles the two parts)."""
        w1 = self.tail.shape[1]
        if start >= w1:
            return self.x[:, start - w1:start - w1 + n]
        if start + n <= w1:
            return self.tail[:, start:start + n]
        return torch.cat([self.tail[:, start:], self.x[:, :start + n - w1]], 1)

    def new_tail(self) -> Tensor:
        """The last ``W - 1`` rows: the tail the next span continues from."""
        return self.rows(self.x.shape[1], self.tail.shape[1])


def causal_conv(inp: ConvInput, w: Tensor, silu: bool = False) -> Tensor:
    """Depthwise causal conv of the span: ``w`` ``(C, W)`` → ``(B, T, C)``, without bias:
    out[t] = Σ_j w[:, j]·[tail; x][t + j], then SiLU when ``silu``; in one C++ pass on the CPU
    (``kernels.cpu.conv_span``), else W shifted multiply-adds (its twin)."""
    return cpu_ops.conv_span(inp.tail, inp.x, w, None, silu)
