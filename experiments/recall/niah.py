"""Passkey retrieval (S-NIAH-1) beyond the training length, with and without post-hoc MC.

Tiny 2-layer models (``recall_common.build_model``) are trained from scratch at ``--train-len``
on ``passkey_batch`` (a repeated filler sentence, a needle ``[NEEDLE] d1..dn [END]`` at a random
depth, and ``[QUERY] d1..dn`` at the end; loss only on the n digits). Each model is then evaluated
at ``--lengths`` (the training length and longer) and ``--depths``; a row is right when all n
digits are (teacher forced, which is what greedy decoding returns when it is right).

Every model trained *without* MC (``none``) is then evaluated on the same weights under each
``--posthoc`` setting (``mcserve eval``'s syntax, ``VARIANT[:C[:MODE[:TOP_K]]]``; default: the
set of post-training MC, paper §4, at 0.5×, 1× and 2× the training length in
independent mode, at 1× in checkpoint mode, and parameter-free ``grm``/``ssc`` with u = q), plus
the *segment reset* baseline ``reset:C`` for every segment length used (no MC, the memory
restarts every C tokens): if MC does not beat that, the cached memories add nothing.

    python experiments/recall/niah.py --quick          # smoke: linear none, 2 lengths (< 3 min)
    python experiments/recall/niah.py                  # the passkey table of FINDINGS.md
    python experiments/recall/niah.py --families linear dla titans --lengths 256 512 1024 2048 4096

Writes ``results/niah.json`` (or ``--out``) and prints exact-match accuracy tables.
"""

from __future__ import annotations

import argparse
import copy
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
    passkey_batch,
    print_table,
    results_path,
    run_many,
    state_floats,
    train_loop,
    write_json,
)

from mcserve.config import MEMORIES  # noqa: E402
from mcserve.eval.common import EvalModel, Setting, model_for, parse_settings  # noqa: E402
from mcserve.models.native import MCForCausalLM  # noqa: E402

EVAL_SEED = 2_000_003
# the post-hoc set: post at 0.5x/1x/2x the training length (independent), post in
# checkpoint mode, and the parameter-free grm and ssc (u = q, checkpoint mode; ssc top-1 was
# the best post-hoc setting in FINDINGS.md)
POSTHOC = ("post:{T/2},post:{T},post:{2T},post:{T}:checkpoint,grm:{T},ssc:{T}:checkpoint:2,"
           "ssc:{T}:checkpoint:1")


def eval_grid(model: torch.nn.Module, spec: dict[str, Any], lengths: list[int]
              ) -> dict[str, Any]:
    """Exact-match and per-digit accuracy for each length (averaged over the depths)."""
    out = {}
    for T in lengths:
        hit = tot = ex = n = 0
        by_depth = {}
        for j, dep in enumerate(spec["depths"]):
            gen = torch.Generator().manual_seed(EVAL_SEED + 131 * T + j)
            x, y = passkey_batch(spec["eval_n"], T, gen, spec["n_digits"], depth=dep)
            h, t, e, m = answer_accuracy(model, x, y, batch=max(1, 16384 // T))
            hit, tot, ex, n = hit + h, tot + t, ex + e, n + m
            by_depth[str(dep)] = round(e / m, 3)
        out[str(T)] = {"exact": round(ex / n, 4), "digit": round(hit / tot, 4),
                       "by_depth": by_depth}
    return out


class _Setting(torch.nn.Module):
    """A trained model run under an ``mcserve eval`` setting (post-hoc MC or segment reset),
    with the ``model(x) -> (logits, state)`` interface ``answer_accuracy`` calls."""

    def __init__(self, base: MCForCausalLM, setting: Setting):
        super().__init__()
        self.inner = model_for(base, setting)
        self.reset = setting.segment_len if setting.kind == "reset" else None

    def forward(self, x: torch.Tensor):
        parts: list[torch.Tensor] = []
        EvalModel(self.inner, reset_every=self.reset, chunk=x.shape[1]).feed(
            x, None, 0, on_logits=lambda t0, lg: parts.append(lg))
        return torch.cat(parts, 1), None


def posthoc_settings(text: str, train_len: int) -> list[Setting]:
    """The ``--posthoc`` settings (``{T}`` stands for the training length) and one ``reset:C``
    per segment length they use; ``as-is`` is the trained model's own row."""
    text = text.replace("{T/2}", str(max(1, train_len // 2))).replace(
        "{2T}", str(2 * train_len)).replace("{T}", str(train_len))
    return [s for s in parse_settings(text, train_len, with_reset=True) if s.kind != "as-is"]


def _weights_path(folder: str | None, name: str, must_exist: bool = True) -> Path | None:
    if not folder:
        return None
    path = Path(folder) / (name.replace("/", "_") + ".pt")
    if must_exist and not path.exists():
        raise FileNotFoundError(f"--load-dir: no weights for {name} at {path}")
    return path


def _in_eval_dtype(model: torch.nn.Module, spec: dict[str, Any]) -> torch.nn.Module:
    """The model to evaluate: itself, or a copy in ``spec["eval_dtype"]`` (float64 tells a
    model's own limits from float32 overflow: a state that grows without bound overflows float32
    long before the model stops working, see FINDINGS.md)."""
    dtype = getattr(torch, spec.get("eval_dtype", "float32"))
    if dtype == next(model.parameters()).dtype:
        return model
    return copy.deepcopy(model).to(dtype)


def run_niah(spec: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(spec["seed"])
    model = build_model(spec)
    T0 = spec["train_len"]
    tag = spec["name"]

    def sample(step: int, gen: torch.Generator):
        return passkey_batch(spec["batch"], T0, gen, spec["n_digits"])

    def evaluate(m, final: bool) -> dict[str, Any]:
        if not final:
            return {"acc": eval_grid(m, dict(spec, eval_n=16), [T0])}
        return {"acc": eval_grid(_in_eval_dtype(m, spec), spec, spec["lengths"])}

    settings = []
    if spec["family"] != "attention" and spec["variant"] == "none":
        settings = posthoc_settings(spec["posthoc"], T0)
        chunk = model.config.inner_chunk if model.config.memory in ("dla", "titans") else 1
        bad = [st.name for st in settings if st.segment_len % chunk]
        if bad:  # before training, not after it
            raise ValueError(f"--posthoc {bad}: segment lengths must be multiples of the deep "
                             f"memory's inner_chunk ({chunk})")
    print(f"[{time.strftime('%H:%M:%S')}] start {tag}", flush=True)
    saved = _weights_path(spec.get("load_dir"), tag)
    if saved is not None:
        # re-evaluate trained weights (e.g. under more --posthoc settings) without training
        blob = torch.load(saved, weights_only=True)
        model.load_state_dict(blob["state_dict"])
        res = {"loaded_from": str(saved), "steps_done": blob["steps_done"],
               "eval": evaluate(model.eval(), True)}
    else:
        res = train_loop(model, sample, evaluate, steps=spec["steps"], lr=spec["lr"],
                         seed=spec["seed"], eval_at=spec.get("eval_at", ()),
                         max_seconds=spec.get("max_seconds"),
                         log=lambda s: print(f"[{tag}] {s}", flush=True),
                         log_every=spec.get("log_every", 50))
    out = _weights_path(spec.get("save_dir"), tag, must_exist=False)
    if out is not None and saved is None:
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"state_dict": model.state_dict(), "steps_done": res["steps_done"]}, out)
    extra = {}
    model = _in_eval_dtype(model.eval(), spec)
    for st in settings:
        extra[st.name] = {"setting": st.to_dict(),
                          "acc": eval_grid(_Setting(model, st), spec, spec["lengths"])}
    print(f"[{time.strftime('%H:%M:%S')}] done {tag}: "
          + " ".join(f"{T}:{v['exact']}" for T, v in res["eval"]["acc"].items()), flush=True)
    return {"spec": spec, "params": sum(p.numel() for p in model.parameters()),
            "state_floats": state_floats(model, T0), "posthoc": extra, **res}


def make_specs(a: argparse.Namespace) -> list[dict[str, Any]]:
    base = dict(d_model=a.d_model, train_len=a.train_len, lengths=a.lengths, depths=a.depths,
                n_digits=a.digits, batch=a.batch, lr=a.lr, seed=a.seed, eval_n=a.eval_n,
                steps=a.steps, vocab=256, posthoc=a.posthoc, eval_dtype=a.eval_dtype,
                save_dir=a.save_dir, load_dir=a.load_dir,
                max_seconds=a.max_minutes * 60 if a.max_minutes else None)
    specs = []
    if a.attention:
        specs.append(dict(base, name=f"attention/-/T{a.train_len}", family="attention",
                          variant="-", mc={}))
    for fam in a.families:
        for v in a.variants:
            mc = {} if v == "none" else {"segment_len": a.segment_len}
            specs.append(dict(base, name=f"{fam}/{v}/T{a.train_len}", family=fam, variant=v,
                              mc=mc))
    for s in specs:
        s["eval_at"] = [s["steps"] // 2]
    return specs


def summarize(results: list[dict[str, Any]]) -> None:
    """Exact match by length, and by needle depth at the longest length."""
    rows, deep = [], []
    lengths = depths = None
    for r in results:
        if "error" in r:
            print(f"ERROR {r['spec']['name']}: {r['error']}")
            continue
        s = r["spec"]
        lengths, depths = s["lengths"], s["depths"]
        label = s["family"] if s["family"] == "attention" else f"{s['family']} {s['variant']}"
        evals = [(label, r["eval"], r["steps_done"])] + [
            (f"{label} +{name}", e, "-") for name, e in r.get("posthoc", {}).items()]
        for lab, e, steps in evals:
            rows.append([lab] + [f"{100 * e['acc'][str(T)]['exact']:.0f}" for T in lengths]
                        + [steps])
            by = e["acc"][str(lengths[-1])]["by_depth"]
            deep.append([lab] + [f"{100 * by[str(d)]:.0f}" for d in depths])
    if lengths:
        T0 = results[0]["spec"]["train_len"]
        print_table(rows, ["model"] + [f"T={T}" for T in lengths] + ["steps"],
                    title=f"Passkey exact-match accuracy (%), trained at T={T0}")
        print_table(deep, ["model"] + [f"depth {d}" for d in depths],
                    title=f"Passkey exact-match accuracy (%) by needle depth at T={lengths[-1]}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--families", nargs="+", default=["linear"], choices=MEMORIES)
    ap.add_argument("--variants", nargs="+", default=["none", "grm"])
    ap.add_argument("--no-attention", dest="attention", action="store_false")
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--train-len", type=int, default=64)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--digits", type=int, default=5)
    ap.add_argument("--segment-len", type=int, default=16)
    # 8000 steps at lr 3e-3: the plain linear model leaves the ln-10 plateau after ~2600 steps
    # (at lr 1e-2 and 1200 steps it never did); grm after ~700
    ap.add_argument("--steps", type=int, default=8000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--posthoc", default=POSTHOC,
                    help="post-hoc MC settings for the models trained without MC (mcserve eval "
                    "syntax; {T}, {T/2}, {2T} = the training length and its half and double)")
    ap.add_argument("--save-dir", default=None,
                    help="save each trained model's weights here (for --load-dir)")
    ap.add_argument("--load-dir", default=None,
                    help="evaluate the weights --save-dir wrote instead of training")
    ap.add_argument("--eval-n", type=int, default=40, help="examples per (length, depth)")
    ap.add_argument("--eval-dtype", choices=["float32", "float64"], default="float32",
                    help="dtype of the final evaluation (training is float32)")
    ap.add_argument("--max-minutes", type=float, default=None)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", nargs="*", default=None,
                    help="run only the specs whose name matches one of these globs")
    ap.add_argument("--jsonl", default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default results/niah.json)")
    a = ap.parse_args(argv)
    if a.quick:
        a.attention, a.families, a.variants = False, ["linear"], ["none"]
        a.train_len, a.lengths, a.steps, a.eval_n, a.digits = 64, [64, 256], 150, 16, 2
        a.segment_len = 16
        a.out = a.out or "tmp_niah_quick.json"
    out = a.out or "niah.json"
    torch.set_num_threads(a.threads)
    specs = make_specs(a)
    if a.only:
        specs = [s for s in specs if any(fnmatch.fnmatchcase(s["name"], o) for o in a.only)]
    out_path = results_path(out)
    jsonl = a.jsonl or str(out_path.with_suffix(".jsonl"))
    env = env_info()
    print(env_line(env))
    t0 = time.perf_counter()
    results = run_many(run_niah, specs, jsonl, jobs=a.jobs, threads=a.threads, resume=a.resume)
    wall = time.perf_counter() - t0
    summarize(results)
    data = {"bench": "niah", "env": env, "args": vars(a), "wall_s": round(wall, 1),
            "results": results}
    paths = write_json(data, out)
    print(f"\nwall {wall:.0f} s; wrote {', '.join(map(str, paths))}")
    return data


if __name__ == "__main__":
    main()
