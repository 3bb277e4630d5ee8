"""Tiny random hybrid models, saved as transformers saves them: one module per family, each with
``MODEL_TYPE`` and ``save_tiny(path, seed=0)`` (returns the transformers model it saved, in eval
mode). ``FAMILIES`` lists them; the engine-level hybrid tests run over all of them;
``MC_FAMILIES`` those whose recurrent layers keep a memory for post-hoc MC (all but LFM2, whose
convolutions keep none)."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

FAMILIES: dict[str, object] = {}
for _info in pkgutil.iter_modules([str(Path(__file__).parent)]):
    _mod = importlib.import_module(f"{__name__}.{_info.name}")
    if hasattr(_mod, "save_tiny"):
        FAMILIES[_mod.MODEL_TYPE] = _mod

MC_FAMILIES = sorted(f for f in FAMILIES if f != "lfm2")
