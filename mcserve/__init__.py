"""mcserve: an inference and serving engine for recurrent language models with Memory Caching.

Importing the package is light: only the configuration dataclasses are loaded eagerly; the torch
model class is imported on first access (``mcserve.MCForCausalLM``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mcserve.config import EngineConfig, MCConfig, ModelConfig

__version__ = "0.1.0"

__all__ = ["LLM", "EngineConfig", "MCConfig", "MCForCausalLM", "ModelConfig", "SamplingParams",
           "StructuredOutputsParams", "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from mcserve.engine.llm import LLM
    from mcserve.engine.sampling import SamplingParams
    from mcserve.engine.sampling_params import StructuredOutputsParams
    from mcserve.models.native import MCForCausalLM

_LAZY = {
    "MCForCausalLM": "mcserve.models.native",
    "LLM": "mcserve.engine.llm",
    "SamplingParams": "mcserve.engine.sampling",
    "StructuredOutputsParams": "mcserve.engine.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mcserve' has no attribute {name!r}")
