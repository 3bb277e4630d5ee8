"""Tiny random hybrid models, saved as transformers saves them: one module per family, each with
``MODEL_TYPE`` and ``save_tiny(path, seed=0)`` (returns the transformers model it saved, in eval
mode). ``FAMILIES`` lists them; the engine-level hybrid tests run over all of them;
``MC_FAMILIES`` those whose recurrent layers keep a memory for post-hoc MC (all but LFM2, whose
convolutions keep none); ``rewrite`` copies a saved checkpoint with its config or tensors
changed (the error tests)."""

from __future__ import annotations

import importlib
import json
import pkgutil
from pathlib import Path

FAMILIES: dict[str, object] = {}
for _info in pkgutil.iter_modules([str(Path(__file__).parent)]):
    _mod = importlib.import_module(f"{__name__}.{_info.name}")
    if hasattr(_mod, "save_tiny"):
        FAMILIES[_mod.MODEL_TYPE] = _mod

MC_FAMILIES = sorted(f for f in FAMILIES if f != "lfm2")


def rewrite(src: Path, dst: Path, *, config=None, tensors=None) -> Path:
    """A copy of the checkpoint ``src`` in ``dst`` with ``config(cfg)`` applied to its
    config.json dict and ``tensors(state_dict)`` to its (single-file) weights."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    sd = load_file(str(src / "model.safetensors"))
    if config:
        config(cfg)
    if tensors:
        sd = tensors(sd)
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(dst / "model.safetensors"))
    return dst
