"""Markdown tables from the JSON reports of ``mcserve eval ppl`` / ``passkey`` (run_eval.sh).

    python experiments/posthoc/summarize.py experiments/posthoc/results/*.json

Table 1: window perplexity per setting × length, and at the longest three lengths the ratio to
``reset:T`` (T = the shortest length, the training length) on the same windows. ``reset:T``
restarts the memory every T tokens, so every position sees at most T tokens of context, as in
training: its window perplexity is the model's 1× perplexity on exactly those tokens, and the
ratio is the degradation past the training length with the text held fixed. Table 2: perplexity
per position bucket at the longest length. Passkey reports give accuracy per setting × length
(mean over depths). A report's ``delta_scale`` (``--delta-scale``) is shown in the setting's name.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _name(rep: dict, setting: str) -> str:
    ds = rep.get("delta_scale")
    if ds is None:
        return setting
    if isinstance(ds, list):
        ds = ",".join(f"{x:g}" for x in ds) if len(set(ds)) > 1 else f"{ds[0]:g}"
    return f"{setting} + Δ×{ds}"


def main(paths: list[str]) -> None:
    ppl_rows: dict[str, dict[int, float]] = {}
    pos_rows: dict[str, list[float | None]] = {}
    buckets: list[list[int]] = []
    lengths: set[int] = set()
    pk_rows: dict[str, dict[int, float]] = {}
    speed: dict[str, dict[int, float]] = {}
    reports = [json.loads(Path(p).read_text()) for p in paths]
    reports = [r for r in reports if "results" in r]
    longest = max((max(r["lengths"]) for r in reports if "bucket_ppl" in r["results"][0]),
                  default=0)
    for rep in reports:
        for r in rep["results"]:
            name = _name(rep, r["setting"])
            if "bucket_ppl" in r:
                ppl_rows.setdefault(name, {})[r["length"]] = r["ppl"]
                speed.setdefault(name, {})[r["length"]] = (r["length"] * r["windows"]
                                                           / max(r["seconds"], 1e-9))
                lengths.add(r["length"])
                if r["length"] == longest:
                    buckets = rep["buckets"]
                    pos_rows[name] = r["bucket_ppl"]
            elif "accuracy" in r:
                pk_rows.setdefault(name, {}).setdefault(r["length"], [])
                pk_rows[name][r["length"]].append(r["accuracy"])
    if ppl_rows:
        L = sorted(lengths)
        L0 = L[0]
        ref = ppl_rows.get(f"reset:{L0}")
        rel = L[-3:] if ref and len(L) > 3 else []  # the longest three, relative to reset:T
        print("| setting | " + " | ".join(f"{n} ({n // L0}×)" for n in L)
              + "".join(f" | {n // L0}× vs 1×" for n in rel) + " |")
        print("|---" * (len(L) + 1 + len(rel)) + "|")
        for name, row in ppl_rows.items():
            cells = [f"{row[n]:.2f}" if n in row else "-" for n in L]
            cells += [f"{row[n] / ref[n] - 1:+.0%}" if n in row and n in ref else "-"
                      for n in rel]
            print(f"| {name} | " + " | ".join(cells) + " |")
        print()
        print("| setting | " + " | ".join(f"[{a},{b})" for a, b in buckets) + " |")
        print("|---" * (len(buckets) + 1) + "|")
        for name, row in pos_rows.items():
            print(f"| {name} | " + " | ".join("-" if p is None else f"{p:.2f}" for p in row)
                  + " |")
    if speed:
        L = sorted(lengths)
        print()
        print("| setting (tokens/s, 1 thread) | " + " | ".join(str(n) for n in L) + " |")
        print("|---" * (len(L) + 1) + "|")
        for name, row in speed.items():
            print(f"| {name} | " + " | ".join(f"{row[n]:.0f}" if n in row else "-" for n in L)
                  + " |")
    if pk_rows:
        L = sorted({n for row in pk_rows.values() for n in row})
        print()
        print("| setting | " + " | ".join(str(n) for n in L) + " |")
        print("|---" * (len(L) + 1) + "|")
        for name, row in pk_rows.items():
            print(f"| {name} | " + " | ".join(
                f"{sum(row[n]) / len(row[n]):.2f}" if n in row else "-" for n in L) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
