"""A float32 weight held only in its compact form: what a low-precision model keeps in memory.

``lowp_linear`` gives a CPU model's large linears and routed experts int8 or bfloat16 copies
that the C++ kernels multiply by. Keeping the float32 weights beside them would cost more
memory than float32 alone, so once those kernels run, each converted parameter becomes a
``CompactWeight``: a tensor that reports the float32 shape, dtype and device of the weight it
replaces but stores only the compact copies (``LowpWeight``: int8 values and per-row scales, or
bfloat16 values). The fast paths read the copies directly (``lowp_linear.lowp_of``, the MoE's
``Experts.compact``); any other reader (a twin, autograd, ``state_dict``, a model path with no
low-precision kernel) sees the exact float32 values the copies represent:

* every torch op on it runs on the dequantized weight (``__torch_dispatch__``), made for that
  op and dropped after it, so such readers are correct but slower than the fast paths;
* ``embedding`` (a tied input embedding) gathers and dequantizes only the rows it is asked for,
  and indexing one expert of a stacked ``(E, N, K)`` weight dequantizes that expert only;
* ``detach`` keeps it compact, so ``nn.Parameter`` wraps it and modules keep working;
* it is read-only: an op that writes into it raises, since the change could not be kept
  (load the float checkpoint to change weights);
* ``save_checkpoint`` and anything else that needs storage take ``materialized()``.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

aten = torch.ops.aten


class Compact(Protocol):
    """What a compact copy provides (``lowp_linear.LowpWeight``)."""

    data: Tensor
    in_features: int

    @property
    def out_features(self) -> int: ...

    def dequantized(self) -> Tensor: ...

    def rows(self, idx: Tensor) -> Tensor: ...


class CompactWeight(Tensor):
    """A float32 ``(N, K)`` weight held as one compact copy, or a stacked ``(E, N, K)`` weight
    (a MoE's experts) held as one copy per expert (``parts``); module docstring."""

    parts: tuple[Compact, ...]
    stacked: bool

    @staticmethod
    def __new__(cls, parts: tuple[Compact, ...], stacked: bool = False) -> CompactWeight:
        first = parts[0]
        if not stacked and len(parts) != 1:
            raise ValueError("an unstacked CompactWeight holds exactly one part")
        if any((p.out_features, p.in_features) != (first.out_features, first.in_features)
               for p in parts):
            raise ValueError("stacked parts must all have the same shape")
        shape = (first.out_features, first.in_features)
        if stacked:
            shape = (len(parts), *shape)
        return Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32,
                                             device=first.data.device, requires_grad=False)

    def __init__(self, parts: tuple[Compact, ...], stacked: bool = False):
        self.parts = tuple(parts)
        self.stacked = stacked

    def __repr__(self) -> str:
        kind = getattr(self.parts[0], "kind", "compact")
        return f"CompactWeight({kind}, shape={tuple(self.shape)})"

    def materialized(self) -> Tensor:
        """The plain float32 tensor of these values."""
        if self.stacked:
            return torch.stack([p.dequantized() for p in self.parts])
        return self.parts[0].dequantized()

    def data_ptr(self) -> int:  # identity of the values (parameter watches compare it)
        return self.parts[0].data.data_ptr()

    @property
    def nbytes_compact(self) -> int:
        return sum(getattr(p, "nbytes", 0) for p in self.parts)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            w = args[0]
            return CompactWeight(w.parts, w.stacked)
        if func is aten.embedding.default and isinstance(args[0], CompactWeight):
            w, idx = args[0], args[1]
            if not w.stacked:
                return w.parts[0].rows(idx.reshape(-1)).view(*idx.shape, w.shape[-1])
        if (func is aten.select.int and isinstance(args[0], CompactWeight) and args[0].stacked
                and args[1] == 0):
            w = args[0]
            return w.parts[args[2] % len(w.parts)].dequantized()
        _check_not_written(func, args, kwargs)
        unwrap = lambda t: t.materialized() if isinstance(t, CompactWeight) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


def _check_not_written(func, args, kwargs) -> None:
    schema = func._schema
    if not schema.is_mutable:
        return
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        if isinstance(v, CompactWeight):
            raise RuntimeError(
                f"{func}: this weight is held in {getattr(v.parts[0], 'kind', 'compact')} form "
                "only (a low-precision model's float32 weights are not kept) and cannot be "
                "changed in place; load the float checkpoint to change weights")


def materialized(t: Tensor) -> Tensor:
    """``t`` as a tensor with storage: a ``CompactWeight``'s float32 values, else ``t``."""
    return t.materialized() if isinstance(t, CompactWeight) else t


def compact_parameter(parts: tuple[Compact, ...], stacked: bool = False) -> torch.nn.Parameter:
    """A parameter (no gradient) holding a ``CompactWeight``."""
    return torch.nn.Parameter(CompactWeight(parts, stacked), requires_grad=False)
