"""Host-side helpers every Triton wrapper of this package shares: block sizes, last-dim strides,
the MC variant as a kernel constant. Imports triton."""

from __future__ import annotations

import functools

import triton
from torch import Tensor

from mcserve.config import MCConfig


@functools.cache  # per decode step and layer: look the capabilities up once
def _variant_code(variant: str) -> int:
    """The kernel's VARIANT constant: 0 weights 1, 1 weights 1/(n+1), 2 softmax gate over every
    block, 3 softmax gate over the top_k picks."""
    mc = MCConfig(variant=variant)
    if mc.fixed_weights:
        return 1 if mc.averages else 0
    return 3 if mc.selects else 2


def _pow2(x: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(max(1, x)))


def _last_contig(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()
