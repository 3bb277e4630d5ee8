"""Save and load native ``mcserve`` checkpoints (a transformers-style directory).

Layout of a checkpoint directory::

    config.json          ModelConfig.to_dict() (model_type "mcserve")
    model.safetensors    the state dict; tensors that alias each other are stored once
    tokenizer.json ...   optional tokenizer files, copied verbatim

Every way a directory can be wrong raises :class:`CheckpointError` (a ``ValueError``) with a
message that names the file and, for tensors, the tensor name and the shapes involved.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mcserve.config import ModelConfig
from mcserve.models.compact_weight import CompactWeight

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# Keys transformers writes into config.json that carry no architecture; dropped on load.
HARMLESS_CONFIG_KEYS = ("architectures", "torch_dtype", "transformers_version")
_RESERVED = (CONFIG_NAME, WEIGHTS_NAME)
_MAX_LISTED = 8


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete or does not match its config."""


def _storage_key(t: Tensor) -> tuple:
    """Identity of the exact view ``t`` takes of its storage (equal keys = the same tensor)."""
    return (
        t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
        tuple(t.stride()), t.dtype,
    )


def _alias_groups(state: Mapping[str, Tensor]) -> list[list[str]]:
    """Names in ``state`` that are the same tensor (tied weights), in state-dict order."""
    groups: dict[tuple, list[str]] = {}
    for name, t in state.items():
        if t.numel() == 0:  # empty tensors may all share a null data pointer
            continue
        groups.setdefault(_storage_key(t), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _keep_name(names: list[str]) -> str:
    """Which name of a tied group is written: not the LM head's (transformers does the same)."""
    for name in names:
        if not name.startswith("lm_head.") and ".lm_head." not in name:
            return name
    return names[0]


def _listed(names) -> str:
    names = sorted(names)
    more = f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return ", ".join(repr(n) for n in names[:_MAX_LISTED]) + more


def save_checkpoint(
    model: nn.Module, path: str | Path, tokenizer_files: Mapping[str, str | bytes] | None = None
) -> Path:
    """Write ``config.json``, ``model.safetensors`` and any tokenizer files into ``path``.

    ``model`` needs a ``.config`` with ``to_dict()``. Tied (aliased) tensors are stored once;
    :func:`load_checkpoint` restores the tie from the model's own structure. ``tokenizer_files``
    maps plain file names (e.g. ``"tokenizer.json"``) to their text or bytes. Returns the path.
    """
    from safetensors.torch import save_file

    path = Path(path)
    files = dict(tokenizer_files or {})
    for name in files:
        if not name or Path(name).name != name or name in (".", "..") or name in _RESERVED:
            raise ValueError(f"tokenizer file name {name!r} must be a plain file name, "
                             f"not a path or one of {_RESERVED}")
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError("save_checkpoint needs a model with a .config that has to_dict()")
    cfg = dict(config.to_dict())
    cfg["model_type"] = "mcserve"

    state = dict(model.state_dict())
    plain: dict[int, Tensor] = {}  # a low-precision weight in float32, once even if tied
    for name, t in state.items():
        if isinstance(t, CompactWeight):
            if id(t) not in plain:
                plain[id(t)] = t.materialized()
            state[name] = plain[id(t)]
    dropped: set[str] = set()
    for names in _alias_groups(state):
        keep = _keep_name(names)
        dropped.update(n for n in names if n != keep)
    tensors: dict[str, Tensor] = {}
    storages: set[int] = set()
    for name, t in state.items():
        if name in dropped:
            continue
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in storages:  # another view of a stored tensor's storage
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        tensors[name] = t

    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    save_file(tensors, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
    for name, content in files.items():
        target = path / name
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content, encoding="utf-8")
    return path


def read_config(path: str | Path) -> ModelConfig:
    """Parse and validate ``path/config.json`` into a :class:`ModelConfig`."""
    path = Path(path)
    cfg_path = path / CONFIG_NAME
    if not path.exists():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {path} is not a directory")
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path} is missing: {path} is not an mcserve checkpoint")
    try:
        data = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON: {e}") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {cfg_path}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(
            f"{cfg_path} must hold a JSON object, got {type(data).__name__}"
        )
    for key in HARMLESS_CONFIG_KEYS:
        data.pop(key, None)
    model_type = data.get("model_type", "mcserve")
    if model_type != "mcserve":
        raise CheckpointError(
            f"{cfg_path}: model_type {model_type!r} is not 'mcserve' "
            "(pretrained models of other types need an importer)"
        )
    try:
        return ModelConfig.from_dict(data)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg_path}: invalid config: {e}") from None


def _read_tensors(file: Path) -> dict[str, Tensor]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # safetensors raises its own error types, OSError, RuntimeError...
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{file} is not a readable safetensors file: {msg}") from None


def load_checkpoint(
    path: str | Path,
    cls: Callable[[ModelConfig], nn.Module],
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> Any:
    """Build ``cls(config)`` from ``path/config.json`` and load ``path/model.safetensors``.

    The file must hold exactly the model's tensors with the model's shapes, except that a tensor
    tied to another one in the model (the LM head when ``tie_embeddings`` is true) may be absent.
    ``dtype=None`` keeps the model's own parameter dtype (float32) and casts stored values to it.
    Returns the model in eval mode on ``device``.
    """
    path = Path(path)
    config = read_config(path)
    file = path / WEIGHTS_NAME
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: the checkpoint has no weights")
    try:
        model = cls(config)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path / CONFIG_NAME}: cannot build the model: {e}") from None
    stored = _read_tensors(file)

    expected = model.state_dict()
    missing = [n for n in expected if n not in stored]
    unexpected = [n for n in stored if n not in expected]
    if unexpected:
        raise CheckpointError(
            f"{file} has unexpected tensors not in this model: {_listed(unexpected)}"
        )
    # Fill tied tensors that were stored once; compare those that were stored twice.
    for names in _alias_groups(expected):
        present = [n for n in names if n in stored]
        if not present:
            continue
        for n in names:
            if n not in stored:
                stored[n] = stored[present[0]]
                missing.remove(n)
        first = stored[present[0]]
        for other in present[1:]:
            t = stored[other]
            if t.shape == first.shape and not torch.equal(t.to(first.dtype), first):
                raise CheckpointError(
                    f"{file}: tensors {present[0]!r} and {other!r} are tied in this model "
                    f"(tie_embeddings={config.tie_embeddings}) but hold different values"
                )
    if missing:
        raise CheckpointError(f"{file} is missing tensors: {_listed(missing)}")
    for name, want in expected.items():
        got = stored[name]
        if tuple(got.shape) != tuple(want.shape):
            raise CheckpointError(
                f"{file}: tensor {name!r} has shape {tuple(got.shape)}, "
                f"expected {tuple(want.shape)} for the model in {CONFIG_NAME}"
            )
        if got.dtype.is_floating_point != want.dtype.is_floating_point or (
            got.dtype == torch.bool) != (want.dtype == torch.bool):
            raise CheckpointError(
                f"{file}: tensor {name!r} has dtype {got.dtype}, expected {want.dtype}"
            )
    try:
        model.load_state_dict(stored, strict=True)
    except RuntimeError as e:  # should not happen after the checks above
        raise CheckpointError(f"{file}: cannot load the state dict: {e}") from None
    model.to(device=device)
    if dtype is not None:
        model.to(dtype=dtype)
    model.eval()
    return model
