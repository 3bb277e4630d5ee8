"""Fused per-layer decode of a gated-linear-memory mixer (the native model's, Mamba2's): one
decode token per row from its projections to the gated, normalised output.

* ``triton.py`` — Triton, ``fused_linear_decode``;
* ``twin.py`` — the torch twin, ``fused_linear_decode_torch``, written op by op after the
  mixers' own decode path.

Both take the same arguments and give the same result. There is no separate naive loop: the
reference is the mixers' own decode path (``Mamba2Mixer.forward_paged``, the native
``MCMixer.forward_paged``; ``tests/test_triton_fused.py``), and the ``reference`` backend takes
the twin. This package exports the torch form; the Triton form needs the ``triton`` package
and is imported from its module.
"""

from __future__ import annotations

from mcserve.kernels.triton.fused_decode.twin import fused_linear_decode_torch

__all__ = ["fused_linear_decode_torch"]
