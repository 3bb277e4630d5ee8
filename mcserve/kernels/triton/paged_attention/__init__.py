"""The decode attention of a hybrid model's attention layer over the paged KV pool.

* ``triton.py`` — Triton, ``paged_decode``.

Its twin is ``kernels.attention.naive_paged_decode``, with the caller
(``kernels.attention.paged_decode``) that picks the implementation. Importing this package
imports triton.
"""

from __future__ import annotations

from mcserve.kernels.triton.paged_attention.triton import paged_decode

__all__ = ["paged_decode"]
