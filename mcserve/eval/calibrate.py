"""Per-layer Δ scales for a longer context, without gradient steps (MambaExtend's recipe).

A Mamba2 layer runs with Δ' = s_l·Δ (``Mamba2Config.delta_scale``). Past its training length a
checkpoint's states leave the range they were trained in; a different step size moves the decay
exp(Δ'·A) and the input weight Δ' back towards it. The scales are picked on a small held-out set
at the target length by zeroth-order search over a grid:

1. one shared scale: every grid value for all layers at once, keep the best;
2. unless ``shared_only``: coordinate search from there, layer by layer (``passes`` sweeps), each
   layer trying every grid value with the others fixed, keeping a change only when it lowers the
   loss.

The objective is the mean next-token NLL over ``windows`` windows of ``length`` tokens, each from
an empty state, of the model under one evaluation setting (as-is, or a post-hoc MC setting, so
the scales can be calibrated for MC and Δ scaling combined). ``calibrate_delta`` is the API;
``mcserve eval calibrate-delta`` (``mcserve.eval.cli``) wraps it.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch import nn

from mcserve.eval.common import EvalModel, Setting, model_for, progress
from mcserve.eval.ppl import window_nll

DEFAULT_GRID = (0.25, 0.35, 0.5, 0.7, 1.0, 1.4, 2.0, 2.8, 4.0)


def _windows(ids: list[int], length: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    have = len(ids) // (length + 1)
    if have < 1:
        raise ValueError(f"the calibration data has {len(ids)} tokens, fewer than one window of "
                         f"{length} (+1) needs")
    n = min(n, have)
    data = torch.tensor(ids[:n * (length + 1)], dtype=torch.long).view(n, length + 1)
    return data[:, :-1], data[:, 1:]


def calibrate_delta(
    base: nn.Module, ids: list[int], length: int, *, setting: Setting | None = None,
    grid: tuple[float, ...] = DEFAULT_GRID, windows: int = 2, passes: int = 1,
    shared_only: bool = False, chunk: int = 1024, batch_size: int = 1,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Search per-layer Δ scales minimising perplexity at ``length`` (see the module doc)."""
    if not hasattr(base, "with_delta_scale"):
        raise ValueError("Δ scaling applies to Mamba2 checkpoints (model_type mamba2) only")
    if not grid or any(not math.isfinite(g) or g <= 0 for g in grid):
        raise ValueError(f"the grid must hold numbers > 0, got {grid!r}")
    grid = tuple(sorted(set(float(g) for g in grid)))
    setting = setting or Setting("as-is")
    n_layers = base.config.n_layers
    x, y = _windows(ids, length, windows)
    n_evals = len(grid) + (0 if shared_only else passes * n_layers * len(grid))
    bar = progress(n_evals * x.numel(), "calibrate Δ", show_progress)
    cache: dict[tuple[float, ...], float] = {}
    history: list[dict[str, Any]] = []
    reset = setting.segment_len if setting.kind == "reset" else None

    def nll(scales: tuple[float, ...]) -> float:
        if scales in cache:
            return cache[scales]
        model = model_for(base.with_delta_scale(list(scales)), setting)
        em = EvalModel(model, reset_every=reset, chunk=chunk)
        total = 0.0
        for b0 in range(0, x.shape[0], batch_size):
            total += float(window_nll(model, x[b0:b0 + batch_size], y[b0:b0 + batch_size],
                                      em).sum())
            bar.update(x[b0:b0 + batch_size].numel())
        cache[scales] = val = total / x.numel()
        history.append({"delta_scale": list(scales), "ppl": math.exp(val)})
        bar.set_postfix_str(f"ppl {math.exp(val):.3f}")
        return val

    t0 = time.perf_counter()
    try:
        ones = (1.0,) * n_layers
        base_nll = nll(ones)
        best, best_nll = ones, base_nll
        for g in grid:  # one shared scale
            cand = (g,) * n_layers
            v = nll(cand)
            if v < best_nll:
                best, best_nll = cand, v
        shared, shared_nll = best, best_nll
        if not shared_only:
            for _ in range(passes):
                changed = False
                for layer in range(n_layers):
                    for g in grid:
                        cand = best[:layer] + (g,) + best[layer + 1:]
                        v = nll(cand)
                        if v < best_nll - 1e-9:
                            best, best_nll, changed = cand, v, True
                if not changed:
                    break
    finally:
        bar.close()
    return {
        "delta_scale": list(best), "ppl": math.exp(best_nll),
        "ppl_unscaled": math.exp(base_nll), "shared_scale": shared[0],
        "ppl_shared": math.exp(shared_nll), "length": length, "windows": int(x.shape[0]),
        "setting": setting.name, "grid": list(grid), "passes": passes,
        "shared_only": shared_only, "evaluations": len(history),
        "seconds": round(time.perf_counter() - t0, 1), "history": history,
    }


def format_result(res: dict[str, Any]) -> str:
    scales = ",".join(f"{s:g}" for s in res["delta_scale"])
    return "\n".join([
        f"setting {res['setting']}, length {res['length']}, {res['windows']} window(s), "
        f"{res['evaluations']} evaluations in {res['seconds']} s",
        f"ppl unscaled          {res['ppl_unscaled']:.3f}",
        f"ppl shared scale {res['shared_scale']:<5g}{res['ppl_shared']:.3f}",
        f"ppl per-layer         {res['ppl']:.3f}   --delta-scale {scales}",
    ])
