"""Importer registry: one loader per ``model_type``, so more pretrained families can follow.

``load_model(path, dtype=..., device=..., mc_overrides={...})`` reads a checkpoint directory of
any supported format and returns a model with the interface the engine drives (that of
``MCForCausalLM``), with the requested Memory Caching settings applied post hoc.

Supported layouts (``detect_format``):

* ``mcserve``: mcserve's own checkpoint (``config.json`` with ``model_type: mcserve`` +
  ``model.safetensors``);
* ``transformers`` Mamba2: ``config.json`` with ``model_type: mamba2`` and ``model.safetensors``,
  sharded safetensors (``model.safetensors.index.json``), or ``pytorch_model.bin`` (read with
  ``weights_only=True``; sharded ``pytorch_model.bin.index.json`` too);
* ``mamba_ssm`` Mamba2 (the original state-spaces format): ``config.json`` with ``d_model``,
  ``n_layer``, ``ssm_cfg`` (``layer: Mamba2``), ``vocab_size``, ``pad_vocab_size_multiple``...,
  and ``pytorch_model.bin``.

Post-hoc MC defaults: an imported model starts as trained (``mc_variant="none"``); ``segment_len``
defaults to the training length when the config records one (``max_position_embeddings``,
``max_seq_len``, ``seq_len``, ``n_ctx`` or ``training_seq_len``), else 2048. Setting
``mc_variant`` without ``mc_mode`` picks ``independent`` for ``post`` (the paper's post-training
recipe) and ``checkpoint`` for ``loglinear``; other variants keep the model's mode.

Every way a directory can be wrong raises :class:`CheckpointError` (a ``ValueError``) naming the
file and, for tensors, the tensor and the shapes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mcserve.config import MODES, VARIANTS, MCConfig, default_mode
from mcserve.models.checkpoint import CheckpointError
from mcserve.models.importing import MC_KEYS, ON_LOAD, no_init

__all__ = [
    "CheckpointError", "Importer", "apply_mc", "detect_format", "load_model", "read_config",
    "register", "supported_model_types",
]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
           "float16": torch.float16}


@dataclass(frozen=True)
class Importer:
    model_type: str
    #: ``(path, config dict, layout) -> model`` (weights loaded, eval mode, float32, cpu)
    load: Callable[[Path, dict, str], nn.Module]
    description: str


_REGISTRY: dict[str, Importer] = {}


def register(model_type: str, load: Callable[[Path, dict, str], nn.Module],
             description: str = "") -> None:
    """Add (or replace) the importer for ``model_type``."""
    _REGISTRY[model_type] = Importer(model_type, load, description)


def supported_model_types() -> list[str]:
    return sorted(_REGISTRY)


# ---------------------------------------------------------------------------- config / format
def read_config(path: str | Path) -> dict:
    path = Path(path)
    if is_checkpoint_file(path):  # BlinkDL's RWKV-7 .pth: the architecture is in the shapes
        return {}
    if not path.exists():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {path} is not a directory")
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: {path} is not a model directory")
    try:
        data = json.loads(file.read_text(encoding="utf-8"), object_hook=_float_hook)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {file}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def _float_hook(obj: dict) -> Any:
    # transformers writes non-finite floats as {"__float__": "Infinity"}
    if set(obj) == {"__float__"}:
        return float(obj["__float__"])
    return obj


def is_checkpoint_file(path: str | Path) -> bool:
    """True for a checkpoint that is one file rather than a directory (BlinkDL's RWKV-7
    ``.pth``, loaded as model_type ``rwkv7``, layout ``blinkdl``)."""
    path = Path(path)
    return path.suffix == ".pth" and path.is_file()


def detect_format(path: str | Path) -> tuple[str, str]:
    """``(model_type, layout)`` of a checkpoint directory, e.g. ``("mamba2", "mamba_ssm")``.

    layout is ``"mcserve"``, ``"transformers"`` or ``"mamba_ssm"``. An unknown ``model_type`` is a
    ``CheckpointError`` listing the supported ones.
    """
    path = Path(path)
    if is_checkpoint_file(path):
        return "rwkv7", "blinkdl"
    cfg = read_config(path)
    file = path / "config.json"
    mt = cfg.get("model_type")
    if mt is None:
        if {"d_model", "n_layer"} <= set(cfg) and "ssm_cfg" in cfg:
            layer = (cfg.get("ssm_cfg") or {}).get("layer", "Mamba1")
            if layer == "Mamba1" and "mamba" in _REGISTRY:
                return "mamba", "mamba_ssm"
            if layer != "Mamba2":
                raise CheckpointError(
                    f"{file}: mamba_ssm checkpoint with ssm_cfg.layer={layer!r}; only 'Mamba1' "
                    f"and 'Mamba2' are supported (supported model types: "
                    f"{supported_model_types()})")
            return "mamba2", "mamba_ssm"
        if {"d_model", "n_layers", "vocab_size"} <= set(cfg):
            return "mcserve", "mcserve"  # native configs written before model_type was recorded
        raise CheckpointError(
            f"{file} has no model_type and is not a mamba_ssm config (d_model, n_layer, "
            f"ssm_cfg); supported model types: {supported_model_types()}")
    if mt not in _REGISTRY:
        raise CheckpointError(f"{file}: model_type {mt!r} is not supported; supported model "
                              f"types: {supported_model_types()}")
    return mt, ("mcserve" if mt == "mcserve" else "transformers")


# ---------------------------------------------------------------------------- MC overrides
def resolve_mc(current: dict[str, Any], overrides: dict[str, Any] | None,
               default_segment_len: int | None = None) -> dict[str, Any]:
    """The MC fields after ``overrides`` (see the module docstring for the defaults)."""
    ov = {k: v for k, v in (overrides or {}).items() if v is not None}
    bad = sorted(set(ov) - set(MC_KEYS))
    if bad:
        raise ValueError(f"unknown MC override(s) {bad}; known: {list(MC_KEYS)}")
    if "mc_variant" in ov and ov["mc_variant"] not in VARIANTS:
        raise ValueError(f"mc_variant={ov['mc_variant']!r} is not one of {VARIANTS}")
    if "mc_mode" in ov and ov["mc_mode"] not in MODES:
        raise ValueError(f"mc_mode={ov['mc_mode']!r} is not one of {MODES}")
    out = {k: current[k] for k in MC_KEYS}
    out.update(ov)
    if "mc_variant" in ov and "mc_mode" not in ov:
        out["mc_mode"] = default_mode(ov["mc_variant"]) or out["mc_mode"]
    trained_plain = not MCConfig(variant=current["mc_variant"]).segmented
    if "segment_len" not in ov and default_segment_len and trained_plain:
        out["segment_len"] = default_segment_len
    return out


def apply_mc(model: nn.Module, overrides: dict[str, Any] | None) -> nn.Module:
    """``model`` with other MC settings (a new module sharing nothing; same dtype/device).

    Native models trained without gate connectors get u = q (``share_uq``) for the gated
    variants. Returns ``model`` itself when nothing changes.
    """
    cfg = model.config
    current = {k: getattr(cfg, k) for k in MC_KEYS}
    default_len = getattr(cfg, "max_position_embeddings", None)
    new = resolve_mc(current, overrides, default_len)
    if new == current:
        return model
    from mcserve.models.mamba2 import Mamba2MCForCausalLM

    if isinstance(model, Mamba2MCForCausalLM) or hasattr(model, "with_mc"):
        return model.with_mc(**new)  # imported models rebuild themselves under new MC settings
    from mcserve.models.native import MCForCausalLM

    ncfg = cfg.replace(**new)
    has_u = any("u_proj" in n for n, _ in model.named_parameters())
    if ncfg.mc.routes and not has_u:
        ncfg = ncfg.replace(share_uq=True)
    out = MCForCausalLM(ncfg).to(dtype=model.dtype, device=model.device)
    missing, unexpected = out.load_state_dict(model.state_dict(), strict=False)
    if missing or [k for k in unexpected if "u_proj" not in k]:
        raise ValueError(f"cannot apply MC overrides {overrides}: parameters "
                         f"{missing or unexpected} do not match")
    return out.eval()


# ---------------------------------------------------------------------------- loading
def load_model(path: str | Path, *, dtype: torch.dtype | str | None = None,
               device: str | torch.device = "cpu", mc_overrides: dict[str, Any] | None = None,
               compact: str | None = None) -> nn.Module:
    """Load any supported checkpoint directory and apply MC overrides; eval mode.

    ``dtype`` is a torch dtype or one of ``"float32"``, ``"float64"``, ``"bfloat16"``;
    None keeps float32. ``mc_overrides`` holds any of ``mc_variant``, ``mc_mode``,
    ``segment_len``, ``mc_top_k`` (None values are ignored), and ``delta_scale`` (Mamba2 only).
    ``compact`` (``"int8"`` or ``"bf16"``, CPU float32 loads of the pretrained formats): the
    large linears and routed experts become compact weights as each tensor is read
    (``lowp_linear.compact_on_load``), so the float32 weights are never all in memory; the
    engine's precision step (``lowp_linear.prepare_cpu_weights``) then routes them.
    """
    path = Path(path)
    model_type, layout = detect_format(path)
    cfg = read_config(path)
    hook = None
    if compact is not None:
        from mcserve.models.lowp_linear import compact_on_load

        hook = compact_on_load(compact)
    token = ON_LOAD.set(hook)
    try:
        with no_init():  # the checkpoint fills every parameter (importing.no_init)
            model = _REGISTRY[model_type].load(path, cfg, layout)
    finally:
        ON_LOAD.reset(token)
    # ``delta_scale`` (Mamba2's Δ scaling) rides with the overrides (EngineConfig.mc_overrides)
    # but is not an MC setting: applied after them, on models that have it
    mc_overrides = dict(mc_overrides or {})
    delta_scale = mc_overrides.pop("delta_scale", None)
    model = apply_mc(model, mc_overrides)
    if delta_scale is not None:
        if not hasattr(model, "with_delta_scale"):
            raise ValueError(f"delta_scale applies to Mamba2 checkpoints, not model_type "
                             f"{model_type!r}")
        model = model.with_delta_scale(delta_scale)
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        dtype = _DTYPES[dtype]
    model = model.to(device=device)
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model.eval()


def _load_native(path: Path, cfg: dict, layout: str) -> nn.Module:
    from mcserve.models.native import MCForCausalLM

    return MCForCausalLM.from_pretrained(path)


# ---------------------------------------------------------------------------- weights
def read_weights(path: Path) -> tuple[dict[str, Tensor], dict[str, Path]]:
    """All tensors of a transformers-style directory and the file each came from.

    Looks for ``model.safetensors``, ``model.safetensors.index.json``, ``pytorch_model.bin``,
    ``pytorch_model.bin.index.json`` in that order.
    """
    candidates = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                  "pytorch_model.bin.index.json")
    for name in candidates:
        file = path / name
        if not file.is_file():
            continue
        if name.endswith(".index.json"):
            return _read_sharded(file)
        tensors = _read_file(file)
        return tensors, {k: file for k in tensors}
    raise CheckpointError(f"{path} has no weights: expected one of {list(candidates)}")


def _read_file(file: Path) -> dict[str, Tensor]:
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                return {name: f.get_tensor(name) for name in f.keys()}
        except Exception as e:  # safetensors raises its own types
            raise CheckpointError(f"{file} is not a readable safetensors file: "
                                  f"{_first_line(e)}") from None
    try:
        sd = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as e:  # pickle errors, zip errors, unsafe globals...
        raise CheckpointError(f"{file} is not a readable torch checkpoint (loaded with "
                              f"weights_only=True): {_first_line(e)}") from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(v, Tensor) for v in sd.values()):
        raise CheckpointError(f"{file} does not hold a state dict of tensors")
    return dict(sd)


def _read_sharded(index: Path) -> tuple[dict[str, Tensor], dict[str, Path]]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index} is not a valid shard index (needs a 'weight_map' "
                              f"object): {_first_line(e)}") from None
    tensors: dict[str, Tensor] = {}
    origin: dict[str, Path] = {}
    for shard in sorted(set(weight_map.values())):
        file = index.parent / shard
        if not file.is_file():
            names = sorted(k for k, v in weight_map.items() if v == shard)
            raise CheckpointError(f"{index} lists shard {shard!r} (for tensor {names[0]!r}"
                                  f"{' and more' if len(names) > 1 else ''}) but {file} is "
                                  f"missing")
        got = _read_file(file)
        for name, t in got.items():
            tensors[name] = t
            origin[name] = file
    for name, shard in weight_map.items():
        if name not in tensors:
            raise CheckpointError(f"{index}: tensor {name!r} is mapped to "
                                  f"{shard!r} but {index.parent / shard} does not hold it")
    return tensors, origin


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _load_mamba2(path: Path, cfg: dict, layout: str) -> nn.Module:
    from mcserve.models.mamba2 import load_mamba2

    return load_mamba2(path, cfg, layout, read_weights)


register("mcserve", _load_native, "mcserve's native MC models (config.json + model.safetensors)")
register("mamba2", _load_mamba2,
         "Mamba2: transformers format (model_type mamba2) or the original mamba_ssm format")


def _load_fla_delta(path: Path, cfg: dict, layout: str) -> nn.Module:
    from mcserve.models.fla_delta import load_fla_delta

    return load_fla_delta(path, cfg, layout, *read_weights(path))


register("delta_net", _load_fla_delta, "DeltaNet: flash-linear-attention format (fla-hub)")
register("gated_deltanet", _load_fla_delta,
         "Gated DeltaNet: flash-linear-attention format (fla-hub)")


def _load_mamba1(path: Path, cfg: dict, layout: str) -> nn.Module:
    from mcserve.models.mamba1 import load_mamba1

    return load_mamba1(path, cfg, layout, *read_weights(path))


register("mamba", _load_mamba1,
         "Mamba (v1): transformers format (model_type mamba) or the original mamba_ssm format")


def _load_fla_gla(path: Path, cfg: dict, layout: str) -> nn.Module:
    from mcserve.models.fla_gla import load_fla_gla

    return load_fla_gla(path, cfg, *read_weights(path))


register("gla", _load_fla_gla, "GLA: flash-linear-attention format (fla-hub, model_type gla)")


def _load_lfm2(path: Path, cfg: dict, layout: str) -> nn.Module:
    from mcserve.models.lfm2 import load_lfm2

    return load_lfm2(path, cfg, *read_weights(path))


register("lfm2", _load_lfm2, "LFM2: transformers format (model_type lfm2), a hybrid of gated "
         "short convolutions and attention")


def _load_qwen3_next(path: Path, cfg: dict, layout: str) -> nn.Module:
    from mcserve.models.qwen3_next import load_qwen3_next

    return load_qwen3_next(path, cfg, *read_weights(path))


register("qwen3_next", _load_qwen3_next, "Qwen3-Next: transformers format (model_type "
         "qwen3_next), Gated DeltaNet and gated attention layers, MoE MLPs")
register("qwen3_5_text", _load_qwen3_next, "Qwen3.5 language model: transformers format "
         "(Qwen3_5ForCausalLM), Gated DeltaNet and gated attention layers, dense MLPs")
register("qwen3_5_moe_text", _load_qwen3_next, "Qwen3.5-MoE language model: transformers format "
         "(Qwen3_5MoeForCausalLM), Gated DeltaNet and gated attention layers, MoE MLPs")
register("qwen3_5", _load_qwen3_next, "Qwen3.5 image-text checkpoint: its language model only "
         "(text_config; the vision tower is not loaded)")
register("qwen3_5_moe", _load_qwen3_next, "Qwen3.5-MoE image-text checkpoint: its language "
         "model only (text_config; the vision tower is not loaded)")


def _load_bamba(path: Path, cfg: dict, layout: str) -> nn.Module:
    from mcserve.models.bamba import load_bamba

    return load_bamba(path, cfg, *read_weights(path))


register("bamba", _load_bamba, "Bamba: transformers format (model_type bamba), a hybrid of "
         "Mamba2 and attention layers")


def _load_granite_hybrid(path: Path, cfg: dict, layout: str) -> nn.Module:
    from mcserve.models.granite_hybrid import load_granite_hybrid

    return load_granite_hybrid(path, cfg, *read_weights(path))


register("granitemoehybrid", _load_granite_hybrid, "Granite-4.0-H: transformers format "
         "(model_type granitemoehybrid), Mamba2 and attention layers with a shared MLP and "
         "optional experts")


def _load_jamba(path: Path, cfg: dict, layout: str) -> nn.Module:
    from mcserve.models.jamba import load_jamba

    return load_jamba(path, cfg, *read_weights(path))


register("jamba", _load_jamba, "Jamba: transformers format (model_type jamba), a hybrid of Mamba "
         "(v1) layers, attention layers and MoE MLPs")


def _load_nemotron_h(path: Path, cfg: dict, layout: str) -> nn.Module:
    from mcserve.models.nemotron_h import load_nemotron_h

    return load_nemotron_h(path, cfg, *read_weights(path))


register("nemotron_h", _load_nemotron_h, "Nemotron-H: transformers format (model_type "
         "nemotron_h), a hybrid of Mamba2, attention and MLP/MoE layers")


def _load_falcon_h1(path: Path, cfg: dict, layout: str) -> nn.Module:
    from mcserve.models.falcon_h1 import load_falcon_h1

    return load_falcon_h1(path, cfg, *read_weights(path))


register("falcon_h1", _load_falcon_h1, "Falcon-H1: transformers format (model_type falcon_h1), "
         "Mamba2 and attention side by side in every layer")


def _load_rwkv7(path: Path, cfg: dict, layout: str) -> nn.Module:
    from mcserve.models.rwkv7 import from_blinkdl, from_fla

    try:
        if layout == "blinkdl":
            return from_blinkdl(_read_file(path), str(path))
        tensors, origin = read_weights(path)
        return from_fla(tensors, cfg, str(next(iter(origin.values()), path)))
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(str(e)) from None


register("rwkv7", _load_rwkv7,
         "RWKV-7: BlinkDL's .pth file, or flash-linear-attention format (fla-hub, model_type "
         "rwkv7)")
