"""Perplexity versus context position, with and without post-hoc Memory Caching.

The data (a plain text file; a JSONL file of ``{"text": ...}`` records joined by the EOS token
or a blank line; or a ``.bin`` file of uint16 token ids) is tokenized once and cut into
non-overlapping windows of each requested length L: window w feeds tokens
[w·(L+1), w·(L+1)+L) and scores the next token at each of its L positions. Negative
log-likelihoods are averaged per position bucket (default edges 0, L₀/2, L₀, 2L₀, 4L₀, ... with
L₀ the shortest length), so a row shows how the model fares deeper into the context, and per
window (the usual perplexity at length L).

``evaluate_ppl`` is the API; ``mcserve eval ppl`` (``mcserve.eval.cli``) wraps it.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mcserve.eval.common import EvalModel, Setting, model_for, progress


# ---------------------------------------------------------------------------- data
def read_texts(path: str | Path) -> list[str]:
    """Documents of a text file (one document) or a JSONL file (one per line: a string, or an
    object whose ``text`` field, else first string field, is the document)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data file {path} does not exist")
    raw = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix.lower() not in (".jsonl", ".ndjson"):
        return [raw]
    texts = []
    for i, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not valid JSON: {e}") from None
        if isinstance(obj, str):
            texts.append(obj)
        elif isinstance(obj, dict):
            text = obj.get("text")
            if not isinstance(text, str):
                text = next((v for v in obj.values() if isinstance(v, str)), None)
            if text is None:
                raise ValueError(f"{path}:{i}: the record has no string field")
            texts.append(text)
        else:
            raise ValueError(f"{path}:{i}: expected a string or an object, got "
                             f"{type(obj).__name__}")
    if not texts:
        raise ValueError(f"{path} holds no texts")
    return texts


def read_token_file(path: str | Path) -> list[int]:
    """Pre-tokenized data: a ``.bin`` file of little-endian uint16 token ids (the format
    ``bench/prepare_data.py`` writes)."""
    import numpy as np

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data file {path} does not exist")
    if path.stat().st_size % 2:
        raise ValueError(f"{path}: a .bin file must hold uint16 token ids (even size)")
    return np.fromfile(str(path), dtype="<u2").astype(np.int64).tolist()


def tokenize_texts(texts: list[str], tokenizer, vocab_size: int) -> list[int]:
    eos = tokenizer.eos_token_id
    sep = [] if eos is not None else tokenizer.encode("\n\n", add_special_tokens=False)
    ids: list[int] = []
    for i, text in enumerate(texts):
        if i:
            ids.extend([eos] if eos is not None else sep)
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
    if ids and max(ids) >= vocab_size:
        raise ValueError(f"the tokenizer produced id {max(ids)} but the model's vocab_size is "
                         f"{vocab_size}: use the model's own tokenizer (--tokenizer)")
    return ids


def default_buckets(lengths: list[int]) -> list[int]:
    L0, Lmax = min(lengths), max(lengths)
    edges = [0]
    if L0 >= 2:
        edges.append(L0 // 2)
    e = L0
    while e < Lmax:
        edges.append(e)
        e *= 2
    edges.append(Lmax)
    return sorted(set(edges))


# ---------------------------------------------------------------------------- evaluation
@torch.no_grad()
def window_nll(model: nn.Module, windows: torch.Tensor, targets: torch.Tensor, em: EvalModel
               ) -> torch.Tensor:
    """Per-position NLL ``(B, L)`` (float64) of ``targets`` given ``windows``."""
    B, L = windows.shape
    out = torch.empty(B, L, dtype=torch.float64)

    def on_logits(t0, logits):
        n = logits.shape[1]
        tgt = targets[:, t0:t0 + n].to(logits.device)
        lp = F.cross_entropy(logits.float().reshape(B * n, -1), tgt.reshape(-1),
                             reduction="none")
        out[:, t0:t0 + n] = lp.view(B, n).double().cpu()

    em.feed(windows.to(model.device), None, 0, on_logits)
    return out


def evaluate_ppl(
    base: nn.Module, ids: list[int], lengths: list[int], settings: list[Setting], *,
    max_windows: int = 8, batch_size: int = 1, chunk: int = 1024,
    buckets: list[int] | None = None, show_progress: bool = True,
) -> dict[str, Any]:
    """Perplexity per setting × length, overall and per position bucket (see module doc)."""
    lengths = sorted(set(lengths))
    need = max(lengths) + 1
    if len(ids) < need:
        raise ValueError(f"the data has {len(ids)} tokens, fewer than the {need} one window of "
                         f"the longest length ({max(lengths)}) needs")
    edges = sorted(set(buckets)) if buckets else default_buckets(lengths)
    if edges[0] != 0:
        edges = [0] + edges
    if edges[-1] < max(lengths):
        edges.append(max(lengths))
    data = torch.tensor(ids, dtype=torch.long)
    plan = {L: min(max_windows, len(ids) // (L + 1)) for L in lengths}
    total = sum(L * n for L, n in plan.items()) * len(settings)
    bar = progress(total, "eval ppl", show_progress)
    results = []
    try:
        for setting in settings:
            model = model_for(base, setting)
            reset = setting.segment_len if setting.kind == "reset" else None
            em = EvalModel(model, reset_every=reset, chunk=chunk)
            for L in lengths:
                n_win = plan[L]
                nll_sum = torch.zeros(L, dtype=torch.float64)
                t_start = time.perf_counter()
                for w0 in range(0, n_win, batch_size):
                    ws = range(w0, min(n_win, w0 + batch_size))
                    win = torch.stack([data[w * (L + 1): w * (L + 1) + L] for w in ws])
                    tgt = torch.stack([data[w * (L + 1) + 1: w * (L + 1) + L + 1] for w in ws])
                    bar.set_postfix_str(f"{setting.name} L={L}")
                    nll_sum += window_nll(model, win, tgt, em).sum(0)
                    bar.update(L * len(ws))
                elapsed = time.perf_counter() - t_start
                mean = nll_sum / n_win
                bucket_ppl, bucket_tokens = [], []
                for lo, hi in zip(edges[:-1], edges[1:]):
                    if lo >= L:
                        bucket_ppl.append(None)
                        bucket_tokens.append(0)
                        continue
                    seg = mean[lo:min(hi, L)]
                    bucket_ppl.append(math.exp(float(seg.mean())))
                    bucket_tokens.append(int(seg.numel()) * n_win)
                results.append({
                    "setting": setting.name, **{f"mc_{k}": v for k, v in setting.to_dict().items()
                                                 if k != "name"},
                    "length": L, "windows": n_win, "ppl": math.exp(float(mean.mean())),
                    "bucket_ppl": bucket_ppl, "bucket_tokens": bucket_tokens,
                    "seconds": round(elapsed, 3),
                })
    finally:
        bar.close()
    return {
        "tokens": len(ids), "lengths": lengths, "buckets": [[a, b] for a, b in
                                                            zip(edges[:-1], edges[1:])],
        "settings": [s.to_dict() for s in settings], "results": results,
    }


# ---------------------------------------------------------------------------- output
def format_table(report: dict[str, Any]) -> str:
    """One row per setting × length: window perplexity, then perplexity per position bucket."""
    buckets = report["buckets"]
    heads = ["setting", "length", "ppl"] + [f"[{a},{b})" for a, b in buckets]
    rows = []
    for r in report["results"]:
        rows.append([r["setting"], str(r["length"]), f"{r['ppl']:.3f}"]
                    + ["-" if p is None else f"{p:.3f}" for p in r["bucket_ppl"]])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
              for i, h in enumerate(heads)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w)
                       for i, (h, w) in enumerate(zip(heads, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def plot(report: dict[str, Any], out: str | Path, title: str = "") -> None:
    """Left: perplexity by position bucket at the longest length, one curve per setting;
    right: window perplexity versus window length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    Lmax = max(report["lengths"])
    centers = [max(1.0, (a + b) / 2) for a, b in report["buckets"]]
    cmap = plt.get_cmap("tab20")
    for i, s in enumerate(report["settings"]):
        # as-is: thick black; segment-reset baselines: dashed; MC settings: solid
        style = ({"color": "black", "linewidth": 2.5} if s["kind"] == "as-is" else
                 {"color": cmap(i % 20), "linestyle": "--" if s["kind"] == "reset" else "-"})
        rows = [r for r in report["results"] if r["setting"] == s["name"]]
        longest = [r for r in rows if r["length"] == Lmax]
        if longest:
            pts = [(c, p) for c, p in zip(centers, longest[0]["bucket_ppl"]) if p is not None]
            ax1.plot([c for c, _ in pts], [p for _, p in pts], marker="o", label=s["name"],
                     **style)
        ax2.plot([r["length"] for r in rows], [r["ppl"] for r in rows], marker="o",
                 label=s["name"], **style)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel(f"context position (bucket centre), windows of {Lmax} tokens")
    ax1.set_ylabel("perplexity")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("window length")
    ax2.set_ylabel("perplexity over the window")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
    ax1.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(str(out), dpi=120)
    plt.close(fig)
