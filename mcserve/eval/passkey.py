"""S-NIAH-1 passkey retrieval: a random 5-digit key hidden in filler text, then asked for.

Prompt (token ids, built piecewise so its length is exact)::

    <intro> <filler ...> The pass key is 48213. Remember it. 48213 is the pass key. <filler ...>
    What is the pass key? The pass key is

The filler is one repeated sentence group (RULER's S-NIAH-1 "noise" haystack); the needle goes
after a whole number of filler sentences, at the fraction ``depth`` of the filler. The answer is
read by greedy decoding; a trial is correct when the first number in the completion is the key.
Accuracy is reported per setting × length × depth.
"""

from __future__ import annotations

import random
import re
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mcserve.eval.common import EvalModel, Setting, model_for, progress

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about the important information there.\n")
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"


def build_prompt(tokenizer, length: int, depth: float, key: int) -> list[int]:
    """Token ids of exactly ``length`` tokens with the needle at ``depth`` of the filler (at the
    sentence boundary nearest to it)."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    intro, needle, question = enc(INTRO), enc(NEEDLE.format(key=key)), enc(QUESTION)
    sentences = [enc(s + ". ") for s in FILLER.split(". ") if s.strip(". ")]
    n_fill = length - len(intro) - len(needle) - len(question)
    if n_fill < 0:
        raise ValueError(f"length {length} is too short: the prompt without filler takes "
                         f"{length - n_fill} tokens")
    hay: list[int] = []
    starts = []
    while len(hay) < n_fill:
        for sent in sentences:
            starts.append(len(hay))
            hay.extend(sent)
    hay = hay[:n_fill]
    starts = [p for p in starts if p <= n_fill] + [n_fill]
    at = min(starts, key=lambda p: (abs(p - depth * n_fill), p))
    return intro + hay[:at] + needle + hay[at:] + question


def _answer(text: str) -> str | None:
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


@torch.no_grad()
def greedy(em: EvalModel, prompts: torch.Tensor, max_new: int) -> list[list[int]]:
    """Greedy continuation of a batch of equal-length prompts ``(B, T)``."""
    model = em.model
    last, state = em.feed(prompts.to(model.device), None, 0)
    pos = prompts.shape[1]
    out: list[list[int]] = [[] for _ in range(prompts.shape[0])]
    for _ in range(max_new):
        nxt = last.float().argmax(-1)  # (B,)
        for row, t in zip(out, nxt.tolist()):
            row.append(t)
        last, state = em.feed(nxt[:, None], state, pos)
        pos += 1
    return out


def evaluate_passkey(
    base: nn.Module, tokenizer, lengths: list[int], depths: list[float],
    settings: list[Setting], *, trials: int = 5, seed: int = 0, chunk: int = 1024,
    batch_size: int = 8, show_progress: bool = True,
) -> dict[str, Any]:
    lengths = sorted(set(lengths))
    max_new = len(tokenizer.encode(" 99999.", add_special_tokens=False)) + 2
    V = base.config.vocab_size
    cases = []  # (length, depth, trial, key, ids)
    for L in lengths:
        for d in depths:
            for i in range(trials):
                key = random.Random(f"{seed}:{L}:{d}:{i}").randint(10000, 99999)
                ids = build_prompt(tokenizer, L, d, key)
                if max(ids) >= V:
                    raise ValueError(f"the tokenizer produced id {max(ids)} but the model's "
                                     f"vocab_size is {V}: use the model's own tokenizer")
                cases.append((L, d, i, key, ids))
    bar = progress(sum(len(c[4]) for c in cases) * len(settings), "eval passkey", show_progress)
    results, seconds = [], {}
    try:
        for setting in settings:
            model = model_for(base, setting)
            reset = setting.segment_len if setting.kind == "reset" else None
            em = EvalModel(model, reset_every=reset, chunk=chunk)
            answers: dict[tuple, tuple[str, bool]] = {}
            groups: dict[int, list] = {}
            for c in cases:
                groups.setdefault(len(c[4]), []).append(c)
            t0 = time.perf_counter()
            for n, group in sorted(groups.items()):
                for g0 in range(0, len(group), batch_size):
                    part = group[g0:g0 + batch_size]
                    bar.set_postfix_str(f"{setting.name} L={part[0][0]}")
                    gen = greedy(em, torch.tensor([c[4] for c in part]), max_new)
                    for c, toks in zip(part, gen):
                        text = tokenizer.decode(toks)
                        answers[c[:3]] = (text, _answer(text) == str(c[3]))
                    bar.update(n * len(part))
            seconds[setting.name] = round(time.perf_counter() - t0, 3)
            for L in lengths:
                for d in depths:
                    got = [answers[(L, d, i)] for i in range(trials)]
                    correct = sum(ok for _, ok in got)
                    results.append({
                        "setting": setting.name, "length": L, "depth": d, "trials": trials,
                        "correct": correct, "accuracy": correct / trials,
                        "completions": [t for t, _ in got],
                    })
    finally:
        bar.close()
    return {"lengths": lengths, "depths": depths, "trials": trials, "seed": seed,
            "settings": [s.to_dict() for s in settings], "results": results,
            "seconds": seconds}


def format_table(report: dict[str, Any]) -> str:
    """Per setting: rows = lengths, columns = depths, cells = accuracy; plus the mean."""
    depths = report["depths"]
    heads = ["setting", "length"] + [f"d={d:g}" for d in depths] + ["mean"]
    rows = []
    for s in report["settings"]:
        for L in report["lengths"]:
            accs = [next(r["accuracy"] for r in report["results"]
                         if r["setting"] == s["name"] and r["length"] == L and r["depth"] == d)
                    for d in depths]
            rows.append([s["name"], str(L)] + [f"{a:.2f}" for a in accs]
                        + [f"{sum(accs) / len(accs):.2f}"])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
    fmt = lambda row: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                for i, (c, w) in enumerate(zip(row, widths)))
    return "\n".join([fmt(heads), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows])


def plot(report: dict[str, Any], out: str | Path, title: str = "") -> None:
    """One heat map (length × depth accuracy) per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = report["settings"]
    lengths, depths = report["lengths"], report["depths"]
    fig, axes = plt.subplots(1, len(settings), figsize=(3.2 * len(settings) + 1, 3.6),
                             squeeze=False)
    im = None
    for ax, s in zip(axes[0], settings):
        grid = [[next(r["accuracy"] for r in report["results"] if r["setting"] == s["name"]
                      and r["length"] == L and r["depth"] == d) for L in lengths]
                for d in depths]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
        ax.set_xticks(range(len(lengths)), [str(L) for L in lengths], rotation=45)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_title(s["name"], fontsize=9)
        ax.set_xlabel("length")
    axes[0][0].set_ylabel("depth")
    if im is not None:
        fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
    if title:
        fig.suptitle(title)
    fig.savefig(str(out), dpi=120, bbox_inches="tight")
    plt.close(fig)
