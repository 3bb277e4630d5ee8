"""Multi-Query Associative Recall (MQAR): does Memory Caching close the recall gap?

Trains tiny 2-layer models from scratch on CPU, one per (memory family × MC variant × width ×
sequence length), plus a softmax-attention baseline of the same width (``TinyTransformer`` in
``recall_common.py``), and reports answer accuracy per number of key–value pairs. The task is
Zoology's MQAR (keys in the lower half of the vocabulary, values in the upper half, queries at
power-law gaps, loss only on the answers), generated on the fly from the seed. Each model trains
on a mix of pair counts (every batch holds each of ``--train-pairs`` equally) and is evaluated on
fixed held-out sets (the same for every model) for each of ``--pairs``.

    python experiments/recall/mqar.py --quick    # smoke (< 3 min): learns above chance
    python experiments/recall/mqar.py            # the default reduced grid
    python experiments/recall/mqar.py --families linear swla dla titans \\
        --variants none residual grm soup ssc loglinear --d-models 64 128 \\
        --seq-lens 128 256 512 --pairs 8 16 32 64     # the full grid (many hours)

Results: a Markdown table on stdout, ``results/mqar.json`` (or ``--out``), a JSONL of the
finished runs (``--jsonl``; ``--resume`` skips what is already there) and a plot of accuracy vs
pairs (``--plot``). The targets of FINDINGS.md are printed as PASS/FAIL, not asserted.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from recall_common import (  # noqa: E402
    answer_accuracy,
    build_model,
    env_info,
    env_line,
    mqar_batch,
    print_table,
    results_path,
    run_many,
    state_floats,
    train_loop,
    write_json,
)

from mcserve.config import MEMORIES  # noqa: E402

VARIANTS = ("none", "residual", "grm", "soup", "ssc", "loglinear")
EVAL_SEED = 1_000_003  # held-out sets: the same for every model and every training seed


def eval_sets(spec: dict[str, Any]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for p in spec["eval_pairs"]:
        gen = torch.Generator().manual_seed(EVAL_SEED + 7919 * p + spec["seq_len"])
        out[p] = mqar_batch(spec["eval_n"], spec["seq_len"], p, spec["vocab"], gen)
    return out


def train_batch(spec: dict[str, Any], gen: torch.Generator, step: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` examples split evenly over ``train_pairs`` (one sequence length); during the
    first ``curriculum`` fraction of the steps only the smallest pair count."""
    ps = spec["train_pairs"]
    if step < spec.get("curriculum", 0.0) * spec["steps"]:
        ps = [min(ps)]
    xs, ys = [], []
    for i, p in enumerate(ps):
        n = spec["batch"] // len(ps) + (i < spec["batch"] % len(ps))
        if n:
            x, y = mqar_batch(n, spec["seq_len"], p, spec["vocab"], gen)
            xs.append(x)
            ys.append(y)
    return torch.cat(xs), torch.cat(ys)


def run_mqar(spec: dict[str, Any]) -> dict[str, Any]:
    """Train and evaluate one model; the dict that goes into the JSON."""
    torch.manual_seed(spec["seed"])
    device = spec.get("device", "cpu")
    # initialised on the CPU in float32: the same starting point on every device and dtype
    model = build_model(spec).to(device, getattr(torch, spec.get("dtype", "float32")))
    sets = eval_sets(spec)
    n_curve = min(spec["eval_n"], 128)

    def evaluate(m, final: bool) -> dict[str, Any]:
        acc = {}
        for p, (x, y) in sets.items():
            if not final:
                x, y = x[:n_curve], y[:n_curve]
            hit, tot, _, _ = answer_accuracy(m, x, y, batch=spec.get("eval_batch", 128))
            acc[str(p)] = round(hit / tot, 4)
        return {"acc": acc}

    tag = spec["name"]
    print(f"[{time.strftime('%H:%M:%S')}] start {tag}", flush=True)
    res = train_loop(
        model, lambda step, gen: train_batch(spec, gen, step), evaluate, steps=spec["steps"],
        lr=spec["lr"], seed=spec["seed"], eval_at=spec.get("eval_at", ()),
        max_seconds=spec.get("max_seconds"),
        log=lambda s: print(f"[{tag}] {s}", flush=True), log_every=spec.get("log_every", 50),
        device=device)
    print(f"[{time.strftime('%H:%M:%S')}] done {tag}: {res['eval']['acc']} "
          f"({res['train_s']} s train)", flush=True)
    return {"spec": spec, "params": sum(p.numel() for p in model.parameters()),
            "state_floats": state_floats(model, spec["seq_len"]), **res,
            **winit_norms(model)}


def winit_norms(model: torch.nn.Module) -> dict[str, Any]:
    """Deep memories: the largest per-head spectral norm of each layer's learned W1^init and
    W2^init after training (training grows them; docs/deep-memory.md)."""
    out = []
    with torch.no_grad():
        for layer in getattr(model, "layers", []):
            mixer = getattr(layer, "mixer", None)  # the attention baseline's blocks have none
            if not hasattr(mixer, "w1_init"):
                return {}
            out.append([round(float(torch.linalg.matrix_norm(w.float(), ord=2).max()), 3)
                        if torch.isfinite(w).all() else None  # a diverged run
                        for w in (mixer.w1_init, mixer.w2_init)])
    return {"winit_spectral": out} if out else {}


# --------------------------------------------------------------------------- grid


def make_specs(a: argparse.Namespace) -> list[dict[str, Any]]:
    specs = []
    var_steps = dict(kv.split("=") for kv in a.variant_steps)
    fam_lr = {}
    for kv in a.family_lr:
        fam, _, lr = kv.partition("=")
        try:
            value = float(lr)
        except ValueError:
            value = float("nan")
        if fam not in MEMORIES or not value > 0:
            raise ValueError(f"--family-lr: expected FAMILY=LR with FAMILY one of {MEMORIES} "
                             f"and LR > 0, got {kv!r}")
        fam_lr[fam] = value
    hd = f"k{a.head_dim}" if a.head_dim != 32 else ""
    for seed, d, T in ((s, d, T) for s in (a.seeds or [a.seed]) for d in a.d_models
                       for T in a.seq_lens):
        if True:
            ok = lambda p: 4 * p <= T and p < a.vocab // 2  # noqa: B023
            eval_pairs = [p for p in a.pairs if ok(p)]
            train_pairs = [p for p in (a.train_pairs or a.pairs) if ok(p)]
            if not eval_pairs or not train_pairs:
                continue
            base = dict(d_model=d, seq_len=T, vocab=a.vocab, train_pairs=train_pairs,
                        eval_pairs=eval_pairs, batch=a.batch, lr=a.lr, seed=seed,
                        curriculum=a.curriculum, head_dim=a.head_dim, device=a.device,
                        eval_n=a.eval_n, max_seconds=a.max_minutes * 60 if a.max_minutes else None)
            dt = ""
            if a.dtype != "float32":  # only then: older result lines keep their spec keys
                base["dtype"], dt = a.dtype, "+f64"
            models = []
            if a.attention:
                models.append(("attention", "-", {}))
            for fam in a.families:
                deep = fam in ("dla", "titans")
                for v in (a.deep_variants if deep and a.deep_variants else a.variants):
                    if v == "soup" and fam in ("linear", "swla"):
                        continue  # equals grm on a linear memory
                    for mode in ([None] if v == "none" else a.mc_modes):
                        mc = {} if v == "none" else {"segment_len": a.segment_len}
                        if v == "ssc":
                            mc["mc_top_k"] = a.top_k
                        if mode not in (None, "checkpoint"):
                            mc["mc_mode"] = mode
                        models.append((fam, v, mc))
            for fam, v, mc in models:
                steps = int(var_steps.get(f"{fam}/{v}", var_steps.get(
                    v, var_steps.get(fam, a.steps))))
                every = max(1, steps // 4)
                tag = "+ind" if mc.get("mc_mode") == "independent" else ""
                name = f"{fam}/{v}{tag}{dt}/d{d}{hd}/T{T}/s{seed}"
                specs.append(dict(base, name=name, family=fam, variant=v, mc=mc, steps=steps,
                                  eval_at=[every, 2 * every, 3 * every],
                                  lr=fam_lr.get(fam, a.lr)))
                if v == "loglinear" and "grm" in a.variants:
                    # loglinear is trained on a smaller budget (its forward is a per-token loop):
                    # add grm on that same budget so that the comparison is like for like
                    g_steps = int(var_steps.get(f"{fam}/grm", var_steps.get(
                        "grm", var_steps.get(fam, a.steps))))
                    if g_steps != steps:
                        specs.append(dict(specs[-1], name=f"{fam}/grm{dt}/d{d}{hd}/T{T}/s{seed}"
                                          f"/steps{steps}", variant="grm",
                                          mc={"segment_len": a.segment_len}))
    return specs


def _label(spec: dict[str, Any]) -> str:
    """The variant, with ``@steps`` for the extra equal-budget runs."""
    ind = "+ind" if spec.get("mc", {}).get("mc_mode") == "independent" else ""
    ind += "+f64" if spec.get("dtype") == "float64" else ""
    return spec["variant"] + ind + (f"@{spec['steps']}" if "/steps" in spec["name"] else "")


def _hd(spec: dict[str, Any]) -> int:
    return spec.get("head_dim", 32)


def _by_model(rs: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Results of one (d_model, T, head_dim) group per (family, label), over the seeds."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rs:
        s = r["spec"]
        fam = s["family"]
        by.setdefault((fam, "attention" if fam == "attention" else _label(s)), []).append(r)
    return by


def _stats(rs: list[dict[str, Any]], p: int) -> tuple[float, float, float]:
    """Mean, min and max accuracy at ``p`` pairs over the seeds of one model."""
    xs = [r["eval"]["acc"][str(p)] for r in rs]
    return sum(xs) / len(xs), min(xs), max(xs)


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Print the accuracy tables and check the targets (FINDINGS.md) on the mean over the seeds;
    returns the target verdicts."""
    verdicts: dict[str, Any] = {}
    groups: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    for r in results:
        if "error" in r:
            print(f"ERROR {r['spec']['name']}: {r['error']}")
            continue
        s = r["spec"]
        groups.setdefault((s["d_model"], s["seq_len"], _hd(s)), []).append(r)
    for (d, T, hd), rs in sorted(groups.items()):
        pairs = rs[0]["spec"]["eval_pairs"]
        title = f"d_model {d}, seq_len {T}" + (f", heads of {hd}" if hd != 32 else "")
        rows = []
        for r in rs:
            s = r["spec"]
            rows.append([s["family"], _label(s), s["seed"]]
                        + [f"{100 * r['eval']['acc'][str(p)]:.1f}" for p in pairs]
                        + [r["steps_done"], r["params"], r["state_floats"], r["s_per_step"]])
        print_table(rows, ["family", "variant", "seed"] + [f"{p} pairs" for p in pairs]
                    + ["steps", "params", "state floats", "s/step"],
                    title=f"MQAR accuracy (%), {title}", align="lll" + "r" * (len(pairs) + 4))
        by = _by_model(rs)
        seeds = sorted({r["spec"]["seed"] for r in rs})
        if len(seeds) > 1:
            rows = []
            for (fam, lab), xs in by.items():
                cells = []
                for p in pairs:
                    m, lo, hi = _stats(xs, p)
                    cells.append(f"{100 * m:.1f} ({100 * lo:.1f}-{100 * hi:.1f})")
                rows.append([fam, lab, len(xs)] + cells)
            print_table(rows, ["family", "variant", "seeds"] + [f"{p} pairs" for p in pairs],
                        title=f"MQAR accuracy (%), mean (min-max) over seeds, {title}",
                        align="lll" + "r" * len(pairs))
        att = by.get(("attention", "attention"))
        ok_pairs = [p for p in pairs if att and _stats(att, p)[0] > 0.9]
        hard = max(ok_pairs) if ok_pairs else None
        for fam in sorted({f for f, _ in by if f != "attention"}):
            key = f"d{d}/T{T}/{fam}" + (f"/k{hd}" if hd != 32 else "")
            v: dict[str, Any] = {}
            if hard is None:
                v["note"] = "no setting where attention > 90%: the targets cannot be checked"
            else:
                acc = {lab: round(_stats(xs, hard)[0], 4) for (f, lab), xs in by.items()
                       if f == fam}
                v["hardest_pairs"] = hard
                v["seeds"] = seeds
                v["acc"] = acc  # mean over the seeds
                if "grm" in acc and "none" in acc:
                    v["grm_minus_none_pts"] = round(100 * (acc["grm"] - acc["none"]), 1)
                    v["grm_beats_none_by_20"] = acc["grm"] - acc["none"] >= 0.20
                    g = {r["spec"]["seed"]: r["eval"]["acc"][str(hard)] for r in by[(fam, "grm")]}
                    n = {r["spec"]["seed"]: r["eval"]["acc"][str(hard)]
                         for r in by[(fam, "none")]}
                    v["grm_minus_none_pts_per_seed"] = {
                        str(k): round(100 * (g[k] - n[k]), 1) for k in sorted(set(g) & set(n))}
                if {"grm", "none", "ssc"} <= set(acc):
                    lo, hi = sorted((acc["none"], acc["grm"]))
                    v["ssc_between"] = lo <= acc["ssc"] <= hi
                if "loglinear" in acc:
                    # like for like: grm trained on loglinear's budget when there is one
                    same = [k for k in acc if k.startswith("grm@")]
                    ref = same[0] if same else "grm" if "grm" in acc else None
                    if ref:
                        v["loglinear_vs"] = ref
                        v["constant_beats_loglinear"] = acc[ref] > acc["loglinear"]
            verdicts[key] = v
            flags = " ".join(f"{k}={'PASS' if x else 'FAIL'}" for k, x in v.items()
                             if isinstance(x, bool))
            print(f"targets {key} at {hard} pairs: {flags or v.get('note')} "
                  f"{v.get('acc', '')}")
    return verdicts


def plot(results: list[dict[str, Any]], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    ok = [r for r in results if "error" not in r]
    panels = sorted({(r["spec"]["d_model"], r["spec"]["seq_len"], _hd(r["spec"]),
                      r["spec"]["family"]) for r in ok if r["spec"]["family"] != "attention"})
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (d, T, hd, fam) in zip(axes[0], panels):
        rs = [r for r in ok if (r["spec"]["d_model"], r["spec"]["seq_len"], _hd(r["spec"]))
              == (d, T, hd) and r["spec"]["family"] in (fam, "attention")]
        for (f, lab), xs in _by_model(rs).items():
            ps = xs[0]["spec"]["eval_pairs"]
            st = [_stats(xs, p) for p in ps]
            m = [100 * x[0] for x in st]
            err = [[100 * (x[0] - x[1]) for x in st], [100 * (x[2] - x[0]) for x in st]]
            style = "k--" if f == "attention" else "o-"
            ax.errorbar(ps, m, yerr=err if len(xs) > 1 else None, fmt=style, capsize=3,
                        label=lab + (f" ({len(xs)} seeds)" if len(xs) > 1 else ""))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("key-value pairs")
        ax.set_ylabel("accuracy (%)")
        ax.set_ylim(-2, 102)
        ax.set_title(f"{fam}, d_model {d}, T {T}" + (f", K {hd}" if hd != 32 else ""))
        ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="CI smoke: linear/grm, vocab 64, T 64, 4 pairs, 300 steps; "
                         "asserts accuracy > 3x chance")
    ap.add_argument("--families", nargs="+", default=["linear", "dla"], choices=MEMORIES)
    ap.add_argument("--variants", nargs="+", default=["none", "residual", "grm", "ssc",
                                                      "loglinear"], choices=VARIANTS)
    ap.add_argument("--deep-variants", nargs="*", default=["none", "grm", "ssc"],
                    choices=VARIANTS, help="variants for dla/titans (empty: --variants)")
    ap.add_argument("--no-attention", dest="attention", action="store_false")
    ap.add_argument("--d-models", type=int, nargs="+", default=[64])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[64])
    ap.add_argument("--pairs", type=int, nargs="+", default=[4, 8, 16],
                    help="evaluated pair counts (those with 4·pairs ≤ seq_len)")
    ap.add_argument("--train-pairs", type=int, nargs="+", default=None,
                    help="pair counts mixed in every training batch (default: --pairs)")
    ap.add_argument("--curriculum", type=float, default=0.4,
                    help="fraction of the steps trained on the smallest --train-pairs only")
    ap.add_argument("--vocab", type=int, default=64,
                    help="vocabulary (keys 1..V/2-1, values V/2..V-1); 256 for 64 pairs")
    ap.add_argument("--segment-len", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=1,
                    help="ssc: cached segments read (of at most T/C - 1)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--variant-steps", nargs="*",
                    default=["dla=800", "titans=800"],
                    help="step counts per family/variant, variant or family, e.g. "
                         "loglinear=200 dla=300 dla/grm=400 (most specific wins)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--family-lr", nargs="*", default=[],
                    help="learning rate per family, e.g. titans=3e-3 (titans diverges at the "
                         "default 1e-2 on some seeds: docs/deep-memory.md)")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="several training seeds (one run per seed per model; overrides --seed)")
    ap.add_argument("--head-dim", type=int, default=32,
                    help="width K of each head (n_heads = d_model // K); the memory state is "
                         "n_heads·K² per layer, so a smaller K holds fewer pairs")
    ap.add_argument("--mc-modes", nargs="+", default=["checkpoint"],
                    choices=["checkpoint", "independent"],
                    help="MC mode(s) of the MC variants; independent runs are labelled +ind")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                    help="parameter and state dtype; float64 for dla beyond T = 64, whose memory "
                         "overflows float32 (FINDINGS.md); runs labelled "
                         "+f64")
    ap.add_argument("--device", default="cpu",
                    help="torch device for training/eval (data is drawn on the CPU and moved)")
    ap.add_argument("--plot-from", default=None,
                    help="only redraw the plot (and the tables) from this result JSON")
    ap.add_argument("--eval-n", type=int, default=512, help="held-out examples per pair count")
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="safety limit per run (the run is marked truncated)")
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--only", nargs="*", default=None,
                    help="run only the specs whose name matches one of these globs")
    ap.add_argument("--jsonl", default=None, help="finished runs (default next to --out)")
    ap.add_argument("--resume", action="store_true", help="skip runs already in --jsonl")
    ap.add_argument("--out", default=None, help="JSON path (default results/mqar.json)")
    ap.add_argument("--plot", default=None, help="PNG path (default next to --out)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    if a.plot_from:
        import json

        data = json.loads(Path(a.plot_from).read_text())
        summarize(data["results"])
        png = plot(data["results"], a.plot or str(Path(a.plot_from).with_suffix(".png")))
        print(f"wrote {png}")
        return data
    if a.quick:
        a.families, a.variants, a.attention = ["linear"], ["grm"], False
        a.deep_variants = []
        a.d_models, a.seq_lens, a.pairs, a.train_pairs = [64], [64], [4], [4]
        a.steps, a.batch, a.eval_n, a.segment_len, a.variant_steps = 300, 32, 256, 16, []
        a.vocab, a.lr, a.curriculum = 64, 3e-3, 0.0
        a.out = a.out or "tmp_mqar_quick.json"
    out = a.out or "mqar.json"
    torch.set_num_threads(a.threads)
    specs = make_specs(a)
    if a.only:
        specs = [s for s in specs if any(fnmatch.fnmatchcase(s["name"], o) for o in a.only)]
    jsonl = a.jsonl or str(results_path(out).with_suffix(".jsonl"))
    env = env_info()
    print(env_line(env))
    print(f"{len(specs)} runs, {a.jobs} at a time: " + ", ".join(s["name"] for s in specs))
    t0 = time.perf_counter()
    results = run_many(run_mqar, specs, jsonl, jobs=a.jobs, threads=a.threads, resume=a.resume,
                       start_method="fork" if a.device == "cpu" else "spawn")
    wall = time.perf_counter() - t0
    verdicts = summarize(results)
    png = plot(results, a.plot or str(results_path(out).with_suffix(".png")))
    data = {"bench": "mqar", "env": env, "args": vars(a), "wall_s": round(wall, 1),
            "targets": verdicts, "plot": png, "results": results}
    paths = write_json(data, out)
    print(f"\nwall {wall:.0f} s; wrote {', '.join(map(str, paths))}" + (f", {png}" if png else ""))
    if a.quick:
        acc = results[0]["eval"]["acc"]["4"]
        chance = 1 / (a.vocab - a.vocab // 2)
        print(f"quick: accuracy {100 * acc:.1f}% vs chance {100 * chance:.1f}%")
        assert acc > 3 * chance, f"MQAR quick: accuracy {acc} not above chance {chance}"
    return data


if __name__ == "__main__":
    main()
