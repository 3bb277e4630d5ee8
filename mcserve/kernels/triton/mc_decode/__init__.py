"""Paged MC decode readout (linear family): one decode token per row, its cached blocks read in
place from the block pool through a block table (grm/soup/ssc/residual/post).

* ``single.py`` — Triton, one launch (``paged_mc_decode_linear``, ``impl="single"``);
* ``split.py`` — Triton, the blocks split across programs, then a log-sum-exp merge
  (``paged_mc_decode_linear_split``, ``impl="split"``; ``use_split`` picks it);
* ``twin.py`` — the torch twin, ``paged_mc_decode_linear_torch``;
* ``naive.py`` — the plain reference loop, ``paged_mc_decode_linear_reference``.

All four take the same arguments and give the same result. This package exports the torch
forms; the Triton forms need the ``triton`` package and are imported from their modules.
"""

from __future__ import annotations

from mcserve.kernels.triton.mc_decode.naive import paged_mc_decode_linear_reference
from mcserve.kernels.triton.mc_decode.twin import paged_mc_decode_linear_torch

__all__ = ["paged_mc_decode_linear_reference", "paged_mc_decode_linear_torch"]
