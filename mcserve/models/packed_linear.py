"""oneDNN-packed weights for ``nn.Linear`` at inference on CPU.

torch's default CPU GEMM is slow for the shapes decoding produces: a few rows times a large
weight (the LM head of a 50K vocabulary is 154 MB in float32). On a 2-core AVX-512 machine a
(8, 768) × (768, 50288) product took 23 ms through ``F.linear`` and 7–9 ms through oneDNN with
the weight reordered once into its blocked layout (``bench/roofline.py`` reports the effect on a
whole decode step). This module keeps that reordered copy next to each ``nn.Linear`` weight and
routes the layer's forward through it when it is safe:

* inference only: autograd off (``torch.no_grad``/``inference_mode``), input on the CPU, input and
  weight float32 or bfloat16;
* the weight unchanged since packing (its version counter is checked on every call; an in-place
  update or a reassigned parameter falls back to ``F.linear``).

Inputs of one or two rows (batch-1 and batch-2 decode) take the C++ matrix-vector product of
``mcserve.kernels.cpu`` instead, for every linear of any size: oneDNN and torch's GEMM stream
the weights at a third to a half of this machine's bandwidth for a single row (a 130M Mamba2's
linears at one row: 38.5 ms through ``F.linear``, 34.9 ms packed, 22.9 ms C++, one thread,
``python bench/cpu_kernels.py --threads 1``).

Linears with int8 or bfloat16 weights (``lowp_linear.apply_weight_precision``) are not packed:
their forward takes the C++ low-precision kernels at every row count (``_PackedForward.lowp``).

Anything else takes ``F.linear``, the plain twin with the same signature
(``tests/test_packed_linear.py`` compares the two). The packed copy doubles the weights' memory
(only weights of at least ``MIN_NUMEL`` elements are packed).

bfloat16 weights are packed only where oneDNN can reorder them: that needs AVX-512 (BW, VL and
DQ) or AVX-NE-CONVERT, which many CPUs (AVX2-only AMD EPYC, older Intel) lack; there bfloat16
linears stay plain ``nn.Linear``. :func:`bf16_packing_supported` probes this once per process.
Setting ``MCSERVE_NO_BF16_PACKING=1`` (or the module flag ``force_bf16_fallback``) forces the
plain path everywhere.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mcserve.kernels import cpu as cpu_ops

_DTYPES = (torch.float32, torch.bfloat16)

#: environment variable that, set to anything but "" or "0", keeps bfloat16 linears unpacked
NO_BF16_PACKING_ENV = "MCSERVE_NO_BF16_PACKING"
#: True: bfloat16 linears are never packed (as if the CPU could not), whatever the probe says
force_bf16_fallback = False


def available() -> bool:
    """True when this torch build has the oneDNN linear ops (x86 CPU builds do)."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


@functools.cache
def _bf16_probe() -> str | None:
    """None when oneDNN packs and multiplies a bfloat16 weight on this CPU, else why not."""
    if not available():
        return "this torch build has no oneDNN (x86 CPU) linear ops"
    try:
        w = torch.ones(16, 16, dtype=torch.bfloat16)
        y = packed_linear(torch.ones(3, 16, dtype=torch.bfloat16), pack_weight(w), None)
        if not bool((y == 16).all()):
            return "oneDNN's bfloat16 linear gave a wrong result on this CPU"
    except RuntimeError as e:
        text = str(e).strip().splitlines()
        return (f"this CPU cannot run oneDNN's bfloat16 linear (it needs avx512bw, avx512vl and "
                f"avx512dq, or avx_ne_convert; torch reports CPU capability "
                f"{torch.backends.cpu.get_cpu_capability()}): {text[0] if text else 'error'}")
    return None


def bf16_fallback_forced() -> bool:
    """True when ``force_bf16_fallback`` or ``$MCSERVE_NO_BF16_PACKING`` asks for plain bf16."""
    return force_bf16_fallback or os.environ.get(NO_BF16_PACKING_ENV, "") not in ("", "0")


def bf16_unsupported_reason() -> str | None:
    """Why bfloat16 weights are not packed here (the missing CPU feature, or the override), or
    None when they are."""
    if bf16_fallback_forced():
        return f"bfloat16 packing is switched off ({NO_BF16_PACKING_ENV} / force_bf16_fallback)"
    return _bf16_probe()


def bf16_packing_supported() -> bool:
    """True when bfloat16 ``nn.Linear`` weights can be packed on this CPU (probed once)."""
    return bf16_unsupported_reason() is None


def pack_weight(weight: Tensor, batch_hint: int = 8) -> Tensor:
    """``weight (out, in)`` in oneDNN's blocked layout, tuned for about ``batch_hint`` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)`` from ``pack_weight(weight)``; x ``(..., in)``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _version(t: Tensor) -> int | None:
    """In-place update counter; inference tensors (made under ``inference_mode``) have none."""
    return None if t.is_inference() else t._version


class _PackedForward:
    """Replaces ``nn.Linear.forward`` on one module instance (its parameters are untouched, so
    ``state_dict``, tying and ``.to()`` keep working; ``.to()`` leaves the CPU path anyway).
    ``lowp``: the layer's int8 or bfloat16 weight copy (``lowp_linear.apply_weight_precision``),
    which the C++ low-precision kernels multiply by at any row count."""

    def __init__(self, module: nn.Linear, batch_hint: int, pack: bool, lowp=None):
        self.module = module
        self.weight = module.weight
        self.version = _version(module.weight)
        self.packed = pack_weight(module.weight, batch_hint) if pack else None
        self.lowp = lowp

    def usable(self, x: Tensor) -> bool:
        w = self.module.weight
        return (not torch.is_grad_enabled() and w is self.weight
                and _version(w) == self.version and x.device.type == "cpu" and w.is_cpu
                and x.dtype == w.dtype and x.dim() >= 2)

    def __call__(self, x: Tensor) -> Tensor:
        m = self.module
        if self.usable(x):
            bias = m.bias.detach() if m.bias is not None else None
            if self.lowp is not None and cpu_ops.enabled():
                return self.lowp.linear(x, bias)
            if x.numel() <= cpu_ops.GEMV_MAX_ROWS * x.shape[-1] and cpu_ops.enabled():
                return cpu_ops.linear(x, m.weight.detach(), bias)
            if self.packed is not None:
                return packed_linear(x, self.packed, bias)
        return F.linear(x, m.weight, m.bias)


#: smaller weights stay on ``F.linear``: below about a megabyte oneDNN's per-call overhead
#: (~10 µs) outweighs its faster inner loop (a 256×256 weight: 6.5 µs plain, 17 µs packed)
MIN_NUMEL = 2**20


def is_packed(module: nn.Module) -> bool:
    """True when ``module`` is an ``nn.Linear`` routed through a oneDNN-packed weight, which
    beats a plain GEMM from 3 rows on (the fused C++ decode blocks use a plain one)."""
    fwd = module.__dict__.get("forward")
    return isinstance(fwd, _PackedForward) and fwd.packed is not None


def pack_linears(model: nn.Module, batch_hint: int = 8, min_numel: int = MIN_NUMEL) -> int:
    """Route every CPU float32/bfloat16 ``nn.Linear`` of ``model`` through the fast paths of the
    module docstring: a packed copy of weights with at least ``min_numel`` elements (when oneDNN
    is there; bfloat16 only where :func:`bf16_packing_supported`) and the C++ matrix-vector
    product for one or two rows (float32, when built); returns how many linears were wrapped.
    Idempotent."""
    onednn, gemv = available(), cpu_ops.enabled()
    if not (onednn or gemv):
        return 0
    n = 0
    for m in model.modules():
        if (isinstance(m, nn.Linear) and m.weight.is_cpu and m.weight.dtype in _DTYPES
                and not isinstance(m.__dict__.get("forward"), _PackedForward)):
            pack = onednn and m.weight.numel() >= min_numel and (
                m.weight.dtype != torch.bfloat16 or bf16_packing_supported())
            if pack or (gemv and m.weight.dtype == torch.float32):
                m.forward = _PackedForward(m, batch_hint, pack)
                n += 1
    return n


def unpack_linears(model: nn.Module) -> int:
    """Undo ``pack_linears`` (frees the packed copies); returns how many were restored."""
    n = 0
    for m in model.modules():
        if isinstance(m.__dict__.get("forward"), _PackedForward):
            del m.forward
            n += 1
    return n
