"""The vectorised torch path of Memory Caching, with the same signatures as ``reference``.

These wrap the layer code the model runs (``mcserve.models.mc.MCMemory`` over a memory family)
for one unbatched sequence, so testing them against ``reference.mc_linear``/``mc_deep`` tests the
serving path itself, not a copy of it.
"""

from __future__ import annotations

from torch import Tensor

from mcserve.config import MCConfig, validate_mc


def mc_linear(
    q: Tensor, k: Tensor, v: Tensor, u: Tensor, a: Tensor | None = None, b: Tensor | None = None,
    *, variant: str, segment_len: int, top_k: int = 2, mode: str = "checkpoint",
) -> Tensor:
    """Fast twin of ``reference.mc_linear``: q, k, u ``(T, H, K)``, v ``(T, H, V)``, a/b ``(T, H)``.
    """
    from mcserve.models.mc import MCMemory
    from mcserve.models.memory.linear import LinearMemory

    validate_mc(variant, mode, segment_len, top_k)
    mc = MCMemory(LinearMemory(), MCConfig(variant=variant, mode=mode, segment_len=segment_len,
                                           top_k=top_k))
    T, H, K = q.shape
    state = mc.init_state(1, H, K, v.shape[-1], dtype=q.dtype, device=q.device)
    gates = {}
    if a is not None:
        gates["log_a"] = a.log()[None]
    if b is not None:
        gates["b"] = b[None]
    y, _ = mc.forward(state, q[None], k[None], v[None], u[None], gates)
    return y[0]


def mc_deep(
    q: Tensor, k: Tensor, v: Tensor, u: Tensor, eta: Tensor, w1_init: Tensor, w2_init: Tensor,
    a: Tensor | None = None, m: Tensor | None = None, *, memory: str, variant: str,
    segment_len: int, top_k: int = 2, mode: str = "checkpoint", inner_chunk: int = 1,
) -> Tensor:
    """Fast twin of ``reference.mc_deep`` for ``memory`` in {"dla", "titans"}."""
    from mcserve.models.mc import MCMemory
    from mcserve.models.memory.deep import DLAMemory, TitansMemory

    validate_mc(variant, mode, segment_len, top_k, memory=memory, inner_chunk=inner_chunk)
    if memory not in ("dla", "titans"):
        raise ValueError(f"memory must be 'dla' or 'titans', got {memory!r}")
    family = DLAMemory(inner_chunk) if memory == "dla" else TitansMemory(inner_chunk)
    mc = MCMemory(family, MCConfig(variant=variant, mode=mode, segment_len=segment_len,
                                   top_k=top_k))
    T, H, K = q.shape
    init = {"w1": w1_init, "w2": w2_init}
    state = mc.init_state(1, H, K, v.shape[-1], dtype=q.dtype, device=q.device, init=init)
    gates = {"eta": eta[None]}
    if memory == "titans":
        if a is not None:
            gates["a"] = a[None]
        if m is not None:
            gates["m"] = m[None]
    y, _ = mc.forward(state, q[None], k[None], v[None], u[None], gates, init=init)
    return y[0]
