"""How large a trained model's online memory grows with context, per layer.

Feeds one passkey haystack (``recall_common.passkey_batch``, needle at ``--depth``) through
models saved by ``niah.py --save-dir`` and records, every ``--every`` tokens, the largest
absolute entry of each online-memory tensor (``W1``/``W2`` for ``dla``/``titans``, ``S`` for the
linear memories). A memory that grows geometrically overflows float32 at some length, and from
there the model's output is NaN whatever it learned: that is a numerical limit, not a modelling
one, and ``niah.py --eval-dtype float64`` tells the two apart.

    python experiments/recall/niah.py --families dla titans --variants none grm --no-attention \\
        --save-dir /tmp/niah_deep_w --out experiments/recall/results/niah_deep.json
    python experiments/recall/state_growth.py --load-dir /tmp/niah_deep_w \\
        --jsonl experiments/recall/results/niah_deep.jsonl

Prints a table and writes ``results/state_growth.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from niah import _weights_path  # noqa: E402
from recall_common import (  # noqa: E402
    build_model,
    env_info,
    env_line,
    passkey_batch,
    print_table,
    write_json,
)


def add_saved_model_args(ap: argparse.ArgumentParser, default_names: str) -> None:
    """``--load-dir``, ``--jsonl`` and ``--names``: which of niah.py's saved models to read."""
    ap.add_argument("--load-dir", required=True, help="weights written by niah.py --save-dir")
    ap.add_argument("--jsonl", required=True, help="niah.py's result lines (for the specs)")
    ap.add_argument("--names", nargs="*", default=None,
                    help=f"spec names to measure (default: {default_names})")


def saved_models(load_dir: str, jsonl: str, names: list[str] | None) -> dict[str, dict[str, Any]]:
    """``{name: spec}`` of the recurrent models niah.py saved in ``load_dir`` (or ``names``),
    the specs read from niah.py's ``jsonl`` (the newest line of a name wins)."""
    specs: dict[str, dict[str, Any]] = {}
    for line in Path(jsonl).read_text().splitlines():
        r = json.loads(line)
        specs[r["spec"]["name"]] = r["spec"]
    if names is None:
        names = [n for n, s in specs.items() if s["family"] != "attention"
                 and _weights_path(load_dir, n, must_exist=False).exists()]
    missing = [n for n in names if n not in specs]
    if missing:
        raise ValueError(f"--names {missing}: not in --jsonl {jsonl}")
    return {n: specs[n] for n in names}


def load_saved(load_dir: str, name: str, spec: dict[str, Any], dtype: str = "float32"
               ) -> torch.nn.Module:
    """The model niah.py saved for ``name``, in ``dtype``, in eval mode."""
    model = build_model(spec)
    blob = torch.load(_weights_path(load_dir, name), weights_only=True)
    model.load_state_dict(blob["state_dict"])
    return model.to(getattr(torch, dtype)).eval()


def growth(model: torch.nn.Module, x: torch.Tensor, every: int) -> dict[str, list[float | None]]:
    """``{"L{layer}.{tensor}": [max |entry| after every, 2*every, ... tokens]}`` for the online
    memory of each layer (None where the entry is no longer finite)."""
    out: dict[str, list[float | None]] = {}
    state = model.init_state(x.shape[0])
    with torch.no_grad():
        for t0 in range(0, x.shape[1], every):
            _, state = model(x[:, t0:t0 + every], state)
            for i, ls in enumerate(state.layers):
                for name, t in ls.mc.mem.items():
                    if not torch.is_floating_point(t) or name.endswith("_0"):
                        continue  # W1_0/W2_0: the inner chunk's starting copy of W1/W2
                    m = t.abs().amax().item()
                    out.setdefault(f"L{i}.{name}", []).append(m if math.isfinite(m) else None)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_saved_model_args(ap, "every saved recurrent model")
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--every", type=int, default=32, help="tokens between measurements")
    ap.add_argument("--depth", type=float, default=0.5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--out", default=None,
                    help="JSON path (default results/state_growth.json)")
    a = ap.parse_args(argv)
    if a.length < 1 or a.every < 1 or a.length % a.every:
        raise ValueError(f"--length ({a.length}) must be a positive multiple of --every "
                         f"({a.every})")
    torch.set_num_threads(1)
    saved = saved_models(a.load_dir, a.jsonl, a.names)
    env = env_info()
    print(env_line(env))
    steps = list(range(a.every, a.length + 1, a.every))
    results = []
    for name, spec in saved.items():
        model = load_saved(a.load_dir, name, spec, a.dtype)
        gen = torch.Generator().manual_seed(0)
        x, _ = passkey_batch(a.batch, a.length, gen, spec["n_digits"], depth=a.depth)
        results.append({"name": name, "train_len": spec["train_len"],
                        "max_abs": growth(model, x, a.every)})
    show = [s for s in steps if s in (a.every, 64, 128, 256, 512, 1024, 2048, a.length)]
    rows = []
    for r in results:
        for key, vals in r["max_abs"].items():
            rows.append([f"{r['name']} {key}"] + [
                "overflow" if vals[steps.index(s)] is None else f"{vals[steps.index(s)]:.2g}"
                for s in show])
    print_table(rows, ["memory"] + [f"t={s}" for s in show],
                title=f"Largest |entry| of the online memory ({a.dtype}, needle depth {a.depth})")
    data = {"bench": "state_growth", "env": env, "args": vars(a), "tokens": steps,
            "results": results}
    paths = write_json(data, a.out or "state_growth.json")
    print(f"wrote {', '.join(map(str, paths))}")
    return data


if __name__ == "__main__":
    main()
