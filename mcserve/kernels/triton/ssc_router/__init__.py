"""The ssc router: per row and head, the top-k cached blocks by their key-sum scores.

* ``triton.py`` — Triton, ``ssc_router`` (the paged decode kernel of ``mc_decode/single.py``
  stopped after the selection);
* ``twin.py`` — the torch twin, ``ssc_router_torch`` (its scores and selection also serve the
  decode readout's ``ssc`` variant);
* ``naive.py`` — the plain reference loop, ``ssc_router_reference``.

All three take the same arguments and give the same result. This package exports the torch
forms; the Triton form needs the ``triton`` package and is imported from its module.
"""

from __future__ import annotations

from mcserve.kernels.triton.ssc_router.naive import ssc_router_reference
from mcserve.kernels.triton.ssc_router.twin import ssc_router_torch

__all__ = ["ssc_router_reference", "ssc_router_torch"]
