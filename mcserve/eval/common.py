"""Shared pieces of ``mcserve eval``: MC settings, model loading, chunked forward with resets.

A *setting* is how the model is run:

* ``as-is``: the checkpoint's own configuration (for an imported Mamba2: no MC);
* ``reset:C``: the "segment reset" baseline: no MC, and the recurrent memory
  restarts from its initial state every C tokens (the short-conv tail runs on), i.e. what
  independent mode computes without reading any cached memory;
* ``VARIANT[:C[:MODE[:TOP_K]]]``: post-hoc MC (``post``, ``grm``, ``ssc``, ``loglinear``,
  ``residual``, ``soup`` or ``none``) with segment length C (default: the model's), mode
  (default: ``independent`` for post, ``checkpoint`` otherwise) and top-k for ``ssc``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mcserve.config import MODES, VARIANTS


@dataclass(frozen=True)
class Setting:
    kind: str  # "as-is", "reset" or "mc"
    variant: str | None = None
    segment_len: int | None = None
    mode: str | None = None
    top_k: int | None = None

    @property
    def name(self) -> str:
        if self.kind == "as-is":
            return "as-is"
        if self.kind == "reset":
            return f"reset:{self.segment_len}"
        if self.variant == "none":  # no segments: length and mode do not apply
            return "none"
        parts = [self.variant, str(self.segment_len), self.mode]
        if self.variant == "ssc":
            parts.append(str(self.top_k))
        return ":".join(parts)

    def overrides(self) -> dict[str, Any]:
        if self.kind == "as-is":
            return {}
        if self.kind == "reset":
            return {"mc_variant": "none"}
        if self.variant == "none":
            return {"mc_variant": "none"}
        out = {"mc_variant": self.variant, "segment_len": self.segment_len,
               "mc_mode": self.mode}
        if self.top_k is not None:
            out["mc_top_k"] = self.top_k
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "variant": self.variant,
                "segment_len": self.segment_len, "mode": self.mode, "top_k": self.top_k}


def _int(text: str, what: str) -> int:
    try:
        val = int(text)
    except ValueError:
        raise ValueError(f"{what} must be a positive integer, got {text!r}") from None
    if val < 1:
        raise ValueError(f"{what} must be a positive integer, got {val}")
    return val


def parse_setting(text: str, default_segment_len: int) -> Setting:
    parts = [p.strip() for p in text.strip().split(":")]
    head = parts[0]
    if head in ("as-is", "asis"):
        if len(parts) > 1:
            raise ValueError(f"setting {text!r}: 'as-is' takes no arguments")
        return Setting("as-is")
    if head == "reset":
        if len(parts) > 2:
            raise ValueError(f"setting {text!r}: expected reset[:SEGMENT_LEN]")
        C = _int(parts[1], f"setting {text!r}: segment length") if len(parts) > 1 and parts[1] \
            else default_segment_len
        return Setting("reset", segment_len=C)
    if head not in VARIANTS:
        raise ValueError(f"setting {text!r}: {head!r} is not one of as-is, reset, "
                         f"{', '.join(VARIANTS)}")
    if len(parts) > 4:
        raise ValueError(f"setting {text!r}: expected VARIANT[:SEGMENT_LEN[:MODE[:TOP_K]]]")
    C = _int(parts[1], f"setting {text!r}: segment length") if len(parts) > 1 and parts[1] \
        else default_segment_len
    mode = parts[2] if len(parts) > 2 and parts[2] else (
        "independent" if head == "post" else "checkpoint")
    if mode not in MODES:
        raise ValueError(f"setting {text!r}: mode {mode!r} is not one of {MODES}")
    if head == "loglinear" and mode != "checkpoint":
        raise ValueError(f"setting {text!r}: loglinear needs mode checkpoint")
    top_k = _int(parts[3], f"setting {text!r}: top_k") if len(parts) > 3 and parts[3] else None
    if head == "ssc" and top_k is None:
        top_k = 2
    return Setting("mc", variant=head, segment_len=C, mode=mode, top_k=top_k)


def parse_settings(text: str | None, default_segment_len: int, *, with_reset: bool
                   ) -> list[Setting]:
    """``as-is`` first, then the comma-separated settings, then (``with_reset``) one
    ``reset:C`` per distinct segment length of the MC settings; duplicates dropped."""
    out = [Setting("as-is")]
    for item in (text or "").split(","):
        if item.strip():
            out.append(parse_setting(item, default_segment_len))
    if with_reset:
        for C in [s.segment_len for s in out if s.kind == "mc" and s.variant != "none"]:
            out.append(Setting("reset", segment_len=C))
    seen, unique = set(), []
    for s in out:
        if s.name not in seen:
            seen.add(s.name)
            unique.append(s)
    return unique


def parse_int_list(text: str, what: str) -> list[int]:
    vals = [_int(x.strip(), what) for x in text.split(",") if x.strip()]
    if not vals:
        raise ValueError(f"{what}: expected a comma-separated list of positive integers")
    return vals


def parse_float_list(text: str, what: str, lo: float = 0.0, hi: float = 1.0) -> list[float]:
    vals = []
    for x in text.split(","):
        if not x.strip():
            continue
        try:
            v = float(x)
        except ValueError:
            raise ValueError(f"{what}: {x!r} is not a number") from None
        if not lo <= v <= hi:
            raise ValueError(f"{what}: {v} is not in [{lo}, {hi}]")
        vals.append(v)
    if not vals:
        raise ValueError(f"{what}: expected a comma-separated list of numbers")
    return vals


# ---------------------------------------------------------------------------- models
def load(path: str | Path, *, dtype: str = "float32", device: str = "cpu",
         tokenizer: str | Path | None = None, delta_scale: Any = None,
         quantization: str | None = None) -> tuple[nn.Module, Any]:
    """(model, tokenizer) from a checkpoint directory of any supported format; the tokenizer is
    ``mcserve.engine.tokenizer.load_tokenizer(path, tokenizer)``. ``delta_scale``: Mamba2's
    Δ scaling (``Mamba2Config.delta_scale``), None for the model as trained. ``dtype`` and
    ``quantization`` as the engine applies them (``EngineConfig``; on the CPU, bfloat16 and
    int8 weights for the large linears: ``models/lowp_linear.py``)."""
    from mcserve.config import EngineConfig
    from mcserve.engine.tokenizer import load_tokenizer
    from mcserve.models.lowp_linear import load_compact, load_dtype, prepare_cpu_weights
    from mcserve.models.registry import load_model

    EngineConfig(dtype=dtype, device=device, quantization=quantization)  # validates the pair
    overrides = {"delta_scale": delta_scale} if delta_scale is not None else None
    model = load_model(path, dtype=load_dtype(dtype, device), device=device,
                       mc_overrides=overrides,
                       compact=load_compact(dtype, quantization, device))
    if model.device.type == "cpu":
        prepare_cpu_weights(model, dtype, quantization)
    return model, load_tokenizer(path, tokenizer)


def default_segment_len(model: nn.Module) -> int:
    """Segment length of a post-hoc setting that names none: the model's own when it uses MC,
    else its training length, else its configured segment_len."""
    cfg = model.config
    if cfg.mc_variant != "none":
        return cfg.segment_len
    return getattr(cfg, "max_position_embeddings", None) or cfg.segment_len


def model_for(base: nn.Module, setting: Setting) -> nn.Module:
    from mcserve.models.registry import apply_mc

    return apply_mc(base, setting.overrides()).eval()


class EvalModel:
    """A model as the evaluations run it (not the serving engine's ``ModelRunner``): tokens fed
    in chunks, the memory restarted every ``reset_every`` tokens (the segment-reset baseline).
    Any chunking gives the same result."""

    def __init__(self, model: nn.Module, reset_every: int | None = None, chunk: int = 1024):
        self.model = model
        self.reset_every = reset_every
        self.chunk = chunk

    def _reset(self, state):
        from dataclasses import replace

        from mcserve.models.state import LayerState

        B = state.layers[0].mc.seg_ksum.shape[0]
        m = self.model
        # the recurrent layers' memory restarts; conv tails (and a hybrid's attention KV) stay
        return replace(state, layers=[
            LayerState(blk.mixer.init_state(B, m.dtype, m.device).mc, ls.conv)
            for blk, ls in zip(m.layers, state.layers, strict=True)
        ])

    @torch.no_grad()
    def feed(self, ids: Tensor, state, pos: int, on_logits=None):
        """Feed ``ids (B, T)`` from position ``pos``; calls ``on_logits(t0, logits)`` per chunk
        (t0 = offset in ids) and returns ``(last logits (B, V), state)``."""
        T = ids.shape[1]
        t = 0
        last = None
        while t < T:
            n = min(self.chunk, T - t)
            p = pos + t
            if self.reset_every:
                if p > 0 and p % self.reset_every == 0 and state is not None:
                    state = self._reset(state)
                n = min(n, self.reset_every - p % self.reset_every)
            logits, state = self.model(ids[:, t:t + n], state)
            if on_logits is not None:
                on_logits(t, logits)
            last = logits[:, -1]
            t += n
        return last, state


def write_json(path: str | Path, data: dict) -> None:
    import json

    text = json.dumps(data, indent=2, allow_nan=True) + "\n"
    if str(path) == "-":
        import sys

        sys.stdout.write(text)
    else:
        Path(path).write_text(text, encoding="utf-8")


def progress(total: int, desc: str, enabled: bool):
    """A tqdm bar on stderr, or a silent stand-in when tqdm is missing or disabled."""
    if enabled:
        try:
            from tqdm.auto import tqdm

            return tqdm(total=total, desc=desc, unit="tok", unit_scale=True, leave=False)
        except ImportError:
            pass

    class _Null:
        def update(self, n=1):
            pass

        def set_postfix_str(self, s):
            pass

        def close(self):
            pass

    return _Null()
