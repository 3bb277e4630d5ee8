"""mcserve: an inference and serving engine for recurrent language models with Memory Caching.

Importing the package is light: only the configuration dataclasses are loaded eagerly; the torch
model class is imported on first access (``mcserve.MCForCausalLM``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mcserve.config import MCConfig, ModelConfig

__version__ = "0.1.0"

__all__ = ["MCConfig", "MCForCausalLM", "ModelConfig", "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from mcserve.models.native import MCForCausalLM


def __getattr__(name: str) -> Any:
    if name == "MCForCausalLM":
        from mcserve.models.native import MCForCausalLM

        return MCForCausalLM
    raise AttributeError(f"module 'mcserve' has no attribute {name!r}")
