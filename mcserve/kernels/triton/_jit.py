"""Lazy ``triton.jit``: kernels are decorated on first use, once per interpreter setting.

``triton.jit`` decides at decoration time whether a kernel runs compiled or under the
interpreter (``TRITON_INTERPRET=1``). Decorating lazily, and again when the setting changes,
means the kernels follow the environment at *call* time: a test can set ``TRITON_INTERPRET=1``
even when triton (or this package) was imported earlier in the same process without it.
Kernels must therefore be self-contained (no calls to other ``@triton.jit`` helpers).
"""

from __future__ import annotations

import os
from collections.abc import Callable

_CACHE: dict[tuple[Callable, bool], object] = {}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def jitted(fn: Callable):
    """``triton.jit(fn)`` for the current interpreter setting (cached)."""
    key = (fn, interpreting())
    k = _CACHE.get(key)
    if k is None:
        import triton

        k = _CACHE[key] = triton.jit(fn)
    return k
