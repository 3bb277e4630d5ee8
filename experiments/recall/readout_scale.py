"""How much a deep memory's readout relies on its content being as large as it learned.

A deep memory reads ``M_W(q) = q + W1 gelu(W2 q)``: an identity term plus the content the memory
wrote. Every MC mix ``sum_i gamma_i M_i(q)`` with weights summing to one keeps the identity term
whole and gives each memory's content the weight ``gamma_i < 1``, so mixing two memories, one of
which holds nothing useful, halves the useful content relative to ``q``. A model whose content
is of the size of ``q`` (not far larger, as a ``dla`` memory's grows) can be thrown off by that
alone. This script measures both sides on models saved by ``niah.py --save-dir``:

* ``ratio``: median ``|M(q) - q| / |q|`` per layer and head over the last ``--tail`` positions
  (where the passkey is read), along haystacks of each ``--lengths``;
* ``exact``: passkey exact match at each length with every layer's content scaled by ``s``
  (``M(q) -> q + s (M(q) - q)``, on the plain model's own single memory; ``s = 0.5`` is what an
  equal mix of two memories does to one memory's content);
* ``posthoc``: passkey exact match under post-hoc ``post`` MC (``--posthoc``) as defined (each of
  the s memories weighted 1/s) and with every memory's content weighted 1 (content x s, the
  identity term still once): if mixing failed only by diluting the content, the second would
  recover what the segment-reset baseline finds.

    python experiments/recall/readout_scale.py --load-dir /tmp/niah_deep_w \\
        --jsonl experiments/recall/results/niah_deep.jsonl

Prints three tables and writes ``results/readout_scale.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from niah import _Setting, eval_grid, posthoc_settings  # noqa: E402
from recall_common import env_info, env_line, passkey_batch, print_table, write_json  # noqa: E402
from state_growth import add_saved_model_args, load_saved, saved_models  # noqa: E402


@contextlib.contextmanager
def scaled_content(model: torch.nn.Module, scale: float,
                   record: list[tuple[torch.Tensor, torch.Tensor]] | None = None
                   ) -> Iterator[None]:
    """Inside the block every memory readout is ``q + scale (M(q) - q)``, the online one and,
    under MC, the cached ones (a mix ``sum_i g_i M_i(q)`` becomes ``q + scale sum_i g_i
    (M_i(q) - q)`` when the g_i sum to one); ``record`` (if given) receives ``(|M(q) - q|,
    |q|)`` of the online memory, each ``(B, T, H)``, per layer call in order. Only this model's
    memories are wrapped, and only for the block."""
    families = []
    for block in model.layers:
        fam = block.mixer.memory.family
        if fam.name not in ("dla", "titans"):
            raise ValueError(f"readout scaling needs a deep memory (dla, titans), got {fam.name}")
        families.append(fam)

    def wrap(original):
        def scan(state, q, k, v, gates):
            o, new = original(state, q, k, v, gates)
            content = o - q
            if record is not None:
                record.append((content.double().norm(dim=-1), q.double().norm(dim=-1)))
            return q + scale * content, new
        return scan

    def wrap_mix(original):
        def readout_mix(mem, q, w):  # the cached memories' share of an MC mix
            out = original(mem, q, w)
            identity = w.sum(dim=2)[..., None] * q  # (B, T, H, 1) * (B, T, H, K)
            return identity + scale * (out - identity)
        return readout_mix

    for fam in families:  # instance attributes shadow the methods
        fam.scan = wrap(type(fam).scan.__get__(fam))
        fam.readout_mix = wrap_mix(type(fam).readout_mix.__get__(fam))
    try:
        yield
    finally:
        for fam in families:
            del fam.scan, fam.readout_mix


def content_ratio(model: torch.nn.Module, spec: dict[str, Any], length: int, batch: int,
                  tail: int) -> list[list[float]]:
    """Median ``|M(q) - q| / |q|`` over the last ``tail`` positions: ``[layer][head]``."""
    gen = torch.Generator().manual_seed(0)
    x, _ = passkey_batch(batch, length, gen, spec["n_digits"])
    record: list[tuple[torch.Tensor, torch.Tensor]] = []
    with scaled_content(model, 1.0, record), torch.no_grad():
        model(x)
    out = []
    for c, qn in record:
        r = (c / qn.clamp_min(1e-30))[:, -tail:]  # (B, tail, H)
        out.append([round(r[..., h].median().item(), 6) for h in range(r.shape[-1])])
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_saved_model_args(ap, "every saved plain (variant none) deep model")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--scales", type=float, nargs="+", default=[1.0, 0.5, 0.25, 2.0])
    ap.add_argument("--posthoc", default="post:{T/2},post:{T},post:{2T}",
                    help="post-hoc MC settings (niah.py's syntax) to run with each memory's "
                         "content weighted 1 instead of 1/s: content x (number of segments)")
    ap.add_argument("--eval-n", type=int, default=50,
                    help="haystacks per needle depth and length (niah.py's default is 100)")
    ap.add_argument("--batch", type=int, default=16, help="haystacks for the content ratio")
    ap.add_argument("--tail", type=int, default=6, help="last positions the ratio looks at")
    ap.add_argument("--out", default=None,
                    help="JSON path (default results/readout_scale.json)")
    a = ap.parse_args(argv)
    if a.tail < 1 or a.eval_n < 1 or a.batch < 1:
        raise ValueError("--tail, --eval-n and --batch must be >= 1")
    torch.set_num_threads(1)
    saved = saved_models(a.load_dir, a.jsonl, a.names)
    if a.names is None:
        saved = {n: s for n, s in saved.items()
                 if s["family"] in ("dla", "titans") and s.get("variant") == "none"}
    env = env_info()
    print(env_line(env))
    results = []
    for name, spec in saved.items():
        model = load_saved(a.load_dir, name, spec)
        ratio = {str(T): content_ratio(model, spec, T, a.batch, a.tail) for T in a.lengths}
        exact = {}
        for s in a.scales:
            with scaled_content(model, s), torch.no_grad():
                grid = eval_grid(model, dict(spec, eval_n=a.eval_n), a.lengths)
            exact[str(s)] = {T: v["exact"] for T, v in grid.items()}
        summed = {}
        for st in posthoc_settings(a.posthoc, spec["train_len"]):
            if st.kind != "mc" or st.variant != "post":
                continue
            mixed = _Setting(model, st)
            for T in a.lengths:
                n_seg = -(-T // st.segment_len)  # segments at the last positions: post's 1/s
                for s in sorted({1.0, float(n_seg)}):
                    with scaled_content(mixed.inner, s), torch.no_grad():
                        grid = eval_grid(mixed, dict(spec, eval_n=a.eval_n), [T])
                    summed.setdefault(st.name, {}).setdefault(str(T), {})[str(s)] = \
                        grid[str(T)]["exact"]
        results.append({"name": name, "ratio": ratio, "exact": exact, "posthoc": summed})
    rows = [[f"{r['name']} L{li}.h{h}"] + [f"{r['ratio'][str(T)][li][h]:.3g}" for T in a.lengths]
            for r in results for li in range(len(r["ratio"][str(a.lengths[0])]))
            for h in range(len(r["ratio"][str(a.lengths[0])][li]))]
    print_table(rows, ["layer/head"] + [f"T={T}" for T in a.lengths],
                title=f"median |M(q) - q| / |q| over the last {a.tail} positions")
    rows = [[r["name"], f"{s:g}"] + [f"{100 * r['exact'][str(s)][str(T)]:.1f}"
                                      for T in a.lengths]
            for r in results for s in a.scales]
    print_table(rows, ["model", "content x"] + [f"T={T}" for T in a.lengths],
                title="passkey exact match (%) with the memory content scaled")
    rows = []
    for r in results:
        for st, by_len in r["posthoc"].items():
            for T, by_s in by_len.items():
                vals = list(by_s.values())
                rows.append([r["name"], st, T, f"{100 * vals[0]:.1f}",
                             f"{100 * vals[-1]:.1f}" if len(vals) > 1 else "="])
    print_table(rows, ["model", "post-hoc", "T", "mean of memories", "sum of contents"],
                title="passkey exact match (%) under post-hoc MC: each content weighted 1/s "
                      "(as defined) or 1")
    data = {"bench": "readout_scale", "env": env, "args": vars(a), "results": results}
    paths = write_json(data, a.out or "readout_scale.json")
    print(f"wrote {', '.join(map(str, paths))}")
    return data


if __name__ == "__main__":
    main()
