"""``mcserve eval``: perplexity versus context position and passkey retrieval, with and without
post-hoc Memory Caching (see docs/pretrained.md).

Importing the package (and ``mcserve.eval.cli``) does not import torch: the API is loaded on
first access (``mcserve.eval.evaluate_ppl``, ``evaluate_passkey``, ``parse_settings``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["evaluate_passkey", "evaluate_ppl", "parse_settings"]


def __getattr__(name: str) -> Any:
    if name == "evaluate_ppl":
        from mcserve.eval.ppl import evaluate_ppl

        return evaluate_ppl
    if name == "evaluate_passkey":
        from mcserve.eval.passkey import evaluate_passkey

        return evaluate_passkey
    if name == "parse_settings":
        from mcserve.eval.common import parse_settings

        return parse_settings
    raise AttributeError(f"module 'mcserve.eval' has no attribute {name!r}")
