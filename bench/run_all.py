"""Run every benchmark: ``--quick`` as a CI smoke test, or in full with plots.

    python bench/run_all.py --quick     # every script at small sizes, a few minutes, no plots
    python bench/run_all.py             # full results (bench/results/*.json) + plots (*.png)
    python bench/run_all.py --plots-only  # redraw the plots from the JSON already there
    python bench/run_all.py --only long_context roofline   # a subset

Scripts, in order: ``mc_layer.py`` (one MC layer vs the number of cached segments),
``offline.py`` (batched ``LLM.generate``), ``serving.py`` (HTTP server, when present),
``multi_turn.py`` (multi-turn chat over HTTP, state reuse on and off),
``long_context.py`` (decode vs a KV-cache Transformer up to 32K), ``prefill_ratio.py`` (a long
prompt's prefill of the MC models against the Transformer's, round-robin), ``roofline.py`` (machine
limits and the decode step against them), ``cpu_kernels.py`` (the C++ decode kernels),
``structured.py`` (decode with a JSON-schema constraint against without), ``attention.py``
(hybrids' paged decode attention, in place against gathered). The
recall experiments (``experiments/recall/``) train models for minutes to hours and are run on
their own. Each script runs in its own process with the same Python
(``--quick`` is passed through, and ``--threads N``: 1 by default with ``--quick``); its output
is shown and saved to ``bench/results/tmp_logs/<script>.log`` (quick: in the temporary
directory). No timing is asserted: the exit status is non-zero only if a script fails (a
traceback, a non-zero exit, or a timeout of ``--timeout`` seconds).

``--quick`` runs copies of the scripts in a temporary directory (``mcserve`` is imported from
this checkout through ``PYTHONPATH``), so their results and logs go to ``<tmp>/bench/results``
and a smoke run never touches ``bench/results/`` (some scripts write the same JSON name in quick
and full runs, e.g. ``offline.py``); the directory is removed unless a script failed or
``--keep`` is given.

Plots (matplotlib; skipped with a message when it is not installed), from the full JSON files:

* ``decode_vs_context.png``: decode tokens/s vs context length (log x), batch 1 and 8, every
  model of ``long_context.json``;
* ``memory_vs_context.png``: cache bytes per sequence vs context length (log-log), device tier
  (solid) and host tier (dashed);
* ``mc_overhead.png``: decode time of each MC variant over ``none`` vs the number of cached
  segments N, from ``mc_layer.json`` (model path and paged engine path, batch 1 and 8).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
SCRIPTS = ["mc_layer", "prefill", "offline", "serving", "multi_turn", "long_context",
           "prefill_ratio", "roofline", "cpu_kernels", "structured", "attention", "moe",
           "weight_memory"]
# helpers, and the CUDA-only scripts (kernels.py, gpu.py)
NOT_BENCHMARKS = {"common", "run_all", "baselines", "llama_cpp_baseline",
                  "multi_turn_backends", "kernels", "gpu", "gpu_runs", "gpu_sections",
                  "long_context_runs"}


def run_script(name: str, args, bench_dir: Path) -> dict:
    path = bench_dir / f"{name}.py"
    cmd = [sys.executable, str(path)]
    if args.quick:
        cmd.append("--quick")
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    cmd += args.extra.get(name, [])
    shown = " ".join(["python", f"bench/{name}.py"] + cmd[2:])
    print(f"\n=== {shown}", flush=True)
    logs = bench_dir / "results" / "tmp_logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{name}.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in
                                          env.get("PYTHONPATH", "").split(os.pathsep) if p])
    t0 = time.perf_counter()
    status, rc = "ok", None
    timed_out = threading.Event()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=ROOT, bufsize=1, env=env)

        def kill() -> None:
            timed_out.set()
            proc.kill()

        timer = threading.Timer(args.timeout, kill) if args.timeout else None
        if timer:
            timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
            rc = proc.wait()
        finally:
            if timer:
                timer.cancel()
    if timed_out.is_set():
        status = f"timeout after {args.timeout:.0f} s"
    if status == "ok" and rc != 0:
        status = f"exit status {rc}"
    dt = time.perf_counter() - t0
    print(f"=== {name}: {status} ({dt:.0f} s; log {log_path})", flush=True)
    return {"script": name, "command": shown, "status": status, "seconds": dt}


# --------------------------------------------------------------------------- plots


def _load(name: str) -> dict | None:
    p = RESULTS / name
    if not p.is_file():
        print(f"plots: {p.relative_to(BENCH.parent)} missing; its plot is skipped")
        return None
    return json.loads(p.read_text(encoding="utf-8"))


def make_plots() -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots: matplotlib is not installed; no plots (pip install matplotlib)")
        return []
    made = []
    lc = _load("long_context.json")
    if lc:
        made += _plot_long_context(lc, plt)
    ml = _load("mc_layer.json")
    if ml:
        made += _plot_mc_overhead(ml, plt)
    for p in made:
        print(f"plots: wrote {p.relative_to(BENCH.parent)}")
    return made


def _series(lc: dict, key) -> dict[str, tuple[list[int], list[float]]]:
    out: dict[str, tuple[list[int], list[float]]] = {}
    for r in lc["results"]:
        v = key(r)
        if v is None:
            continue
        xs, ys = out.setdefault(r["model"], ([], []))
        xs.append(r["length"])
        ys.append(v)
    return out


_MARKERS = {"none": "o", "residual": "v", "grm": "^", "ssc2": "<", "ssc8": ">", "ssc8-host": "D",
            "loglinear": "x"}


def _style(model: str) -> dict:
    if model == "transformer":
        return {"color": "black", "marker": "s", "linewidth": 2}
    return {"marker": _MARKERS.get(model, "o"), "markersize": 5}


def _plot_long_context(lc: dict, plt) -> list[Path]:
    env = lc.get("env", {})
    sub = f"{env.get('cpu_model', '?')}, {env.get('threads', '?')} threads, {env.get('date', '')}"
    batches = lc["config"]["batches"]
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
    for ax, B in zip(axes[0], batches, strict=True):
        s = _series(lc, lambda r, B=B: (r.get(f"b{B}") or {}).get("tokens_per_s"))
        for m, (xs, ys) in s.items():
            ax.plot(xs, ys, label=m, **_style(m))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"batch {B}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"decode throughput vs context length ({sub})", fontsize=9)
    fig.tight_layout()
    p1 = RESULTS / "decode_vs_context.png"
    fig.savefig(p1, dpi=120)
    plt.close(fig)

    B0 = batches[0]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    dev = _series(lc, lambda r: ((r.get(f"b{B0}") or {}).get("device_bytes")
                                 or r.get("kv_bytes_formula")))
    host = _series(lc, lambda r: (r.get(f"b{B0}") or {}).get("host_bytes") or None)
    for m, (xs, ys) in dev.items():
        st = _style(m)
        line, = ax.plot(xs, [y / 2**20 for y in ys], label=f"{m} (device)", **st)
        if m in host:
            hx, hy = host[m]
            ax.plot(hx, [y / 2**20 for y in hy], linestyle="--", color=line.get_color(),
                    marker=st.get("marker"), label=f"{m} (host tier)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("cache MiB per sequence")
    ax.set_title(f"cache memory vs context length, batch {B0} ({sub})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    p2 = RESULTS / "memory_vs_context.png"
    fig.savefig(p2, dpi=120)
    plt.close(fig)
    return [p1, p2]


def _plot_mc_overhead(ml: dict, plt) -> list[Path]:
    res = ml["results"]
    paths = list(res[0]["decode"])  # forward_B1, paged_B1, forward_B8, paged_B8
    variants = [v for v in ml["config"]["variants"] if v != "none"]
    cols = 2
    nrows = -(-len(paths) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(11, 4 * nrows), squeeze=False, sharey=True)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(paths):]:
        ax.set_visible(False)
    for ax, path in zip(flat, paths, strict=False):
        for v in variants:
            xs, ys = [], []
            for r in res:
                cell = r["decode"][path]
                if v in cell and "none" in cell:
                    xs.append(r["N"])
                    ys.append(cell[v]["median"] / cell["none"]["median"])
            if xs:
                ax.plot(xs, ys, marker="o", label=v)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("cached segments N")
        ax.set_title(path.replace("_", ", "))
        ax.grid(True, which="both", alpha=0.3)
    for row in axes:
        row[0].set_ylabel("decode time / none")
    seen: dict[str, object] = {}
    for ax in flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(lab, h)
    fig.legend(list(seen.values()), list(seen), loc="center right", fontsize=8)
    cfg, env = ml["config"], ml.get("env", {})
    fig.suptitle(f"MC overhead vs cached segments: one linear layer H={cfg['H']} K={cfg['K']} "
                 f"C={cfg['C']}, {cfg.get('clock', 'wall')} clock, {env.get('date', '')}",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.88, 1))
    p = RESULTS / "mc_overhead.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return [p]


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, no plots (CI smoke)")
    ap.add_argument("--only", nargs="+", choices=SCRIPTS, default=None)
    ap.add_argument("--skip", nargs="+", choices=SCRIPTS, default=[])
    ap.add_argument("--threads", type=int, default=None,
                    help="passed to every script (default: 1 with --quick, which bounds the "
                         "time on a busy machine; the scripts' own default otherwise)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per script (default: 600 with --quick, none otherwise)")
    ap.add_argument("--args", action="append", default=[], metavar="SCRIPT=ARGS",
                    help="extra arguments for one script, e.g. "
                         "--args 'long_context=--lengths 1024 8192' (repeatable)")
    ap.add_argument("--keep", action="store_true", help="--quick: keep the temporary results")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--plots-only", action="store_true", help="only redraw the plots")
    args = ap.parse_args(argv)
    if args.plots_only:
        make_plots()
        return 0
    if args.timeout is None and args.quick:
        args.timeout = 600.0
    if args.threads is None and args.quick:
        args.threads = 1  # OpenMP threads spin-waiting on a loaded machine can take 10x longer
    args.extra = {}
    for a in args.args:
        name, _, rest = a.partition("=")
        if name not in SCRIPTS:
            ap.error(f"--args {a!r}: {name!r} is not one of {SCRIPTS}")
        args.extra[name] = rest.split()
    present = sorted(p.stem for p in BENCH.glob("*.py"))
    unknown = [n for n in present if n not in SCRIPTS and n not in NOT_BENCHMARKS]
    if unknown:
        print(f"note: bench scripts not run by run_all: {unknown}")
    names = [n for n in (args.only or SCRIPTS) if n not in args.skip]
    todo = []
    for n in names:
        if (BENCH / f"{n}.py").is_file():
            todo.append(n)
        else:
            print(f"note: bench/{n}.py not present; skipped")
    bench_dir, tmp = BENCH, None
    if args.quick:  # copies in a temporary directory: a smoke run never touches bench/results
        tmp = Path(tempfile.mkdtemp(prefix="mcserve-bench-quick-"))
        bench_dir = tmp / "bench"
        bench_dir.mkdir()
        for p in BENCH.glob("*.py"):
            shutil.copy2(p, bench_dir / p.name)
        print(f"quick run in {bench_dir}")
    t0 = time.perf_counter()
    runs = [run_script(n, args, bench_dir) for n in todo]
    print("\nsummary")
    for r in runs:
        print(f"  {r['status']:>24}  {r['seconds']:6.0f} s  {r['command']}")
    failed = [r for r in runs if r["status"] != "ok"]
    print(f"total {time.perf_counter() - t0:.0f} s; {len(runs) - len(failed)}/{len(runs)} ok")
    if tmp is not None:
        if failed or args.keep:
            print(f"quick results and logs kept in {bench_dir / 'results'}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if not args.quick and not args.no_plots:
        make_plots()  # from whatever full JSON is there (a failed script's old file included)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
