"""Small shared helpers for the bench scripts: timing, environment info, JSON results, tables.

Timing: ``timeit(fn)`` calls ``fn`` a few times to warm up, picks an inner loop count so that one
sample lasts at least ``min_sample_s`` (short calls are dominated by timer resolution otherwise),
then takes ``repeats`` samples and reports the *median* time per call, with the min and the
quartiles so that the noise of a shared machine is visible in the results. ``timeit_many``
interleaves the samples of several functions round-robin (steadier ratios under drifting load).
Both record wall time and process CPU time; ``clock="cpu"`` reports the latter, which leaves out
time spent descheduled (use it with one thread on an oversubscribed machine).

    from common import env_info, print_table, set_threads, timeit, timeit_many, write_json
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# --------------------------------------------------------------------------- threads / timing


def set_threads(threads: int | None) -> int:
    """``torch.set_num_threads(threads)``; None or <= 0 keeps every core. Returns the count used."""
    if threads is None or threads <= 0:
        threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    return torch.get_num_threads()


def quantile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs``, linear between the two nearest samples."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _sample(fn: Callable[[], Any], n: int) -> tuple[float, float]:
    """(wall, cpu) seconds per call over n back-to-back calls."""
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        fn()
    t1, c1 = time.perf_counter(), time.process_time()
    return (t1 - t0) / n, (c1 - c0) / n


def _inner(fn: Callable[[], Any], warmup: int, min_sample_s: float, max_inner: int) -> int:
    t_warm = float("inf")
    for _ in range(max(1, warmup)):
        t0 = time.perf_counter()
        fn()
        t_warm = min(t_warm, time.perf_counter() - t0)
    return int(min(max_inner, max(1, min_sample_s / max(t_warm, 1e-9))))


def timeit(fn: Callable[[], Any], *, repeats: int = 7, warmup: int = 2,
           min_sample_s: float = 0.005, max_inner: int = 10_000, clock: str = "wall"
           ) -> dict[str, Any]:
    """Median seconds per call of ``fn()`` over ``repeats`` samples, after ``warmup`` calls.

    Each sample runs ``fn`` ``inner`` times back to back, ``inner`` chosen (from the warm-up
    timings) so that a sample lasts about ``min_sample_s``. Returns seconds per call on
    ``clock``: ``median``, ``min``, ``p25``, ``p75``, ``max``, plus ``inner``, ``repeats`` and
    the other clock's median (``wall_median`` / ``cpu_median``).

    ``clock="cpu"`` is the process CPU time (all threads): on a shared, oversubscribed machine it
    leaves out the time the process sat descheduled, so at one thread it is a much steadier
    measure of the work than wall time (memory stalls still count).
    """
    return timeit_many({"f": fn}, repeats=repeats, warmup=warmup, min_sample_s=min_sample_s,
                       max_inner=max_inner, clock=clock)["f"]


def timeit_many(fns: dict[str, Callable[[], Any]], *, repeats: int = 7, warmup: int = 2,
                min_sample_s: float = 0.005, max_inner: int = 10_000, clock: str = "wall"
                ) -> dict[str, dict[str, Any]]:
    """``timeit`` for several functions, samples interleaved round-robin.

    On a shared machine the load drifts over seconds; taking sample i of every function in the
    same pass makes their *ratios* much steadier than timing them one after another.
    """
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    inner = {name: _inner(fn, warmup, min_sample_s, max_inner) for name, fn in fns.items()}
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            w, c = _sample(fn, inner[name])
            wall[name].append(w)
            cpu[name].append(c)
    out = {}
    for name in fns:
        main, other = (wall[name], cpu[name]) if clock == "wall" else (cpu[name], wall[name])
        st = _stats(main, inner[name])
        st["clock"] = clock
        st["cpu_median" if clock == "wall" else "wall_median"] = statistics.median(other)
        out[name] = st
    return out


def _stats(samples: Sequence[float], inner: int) -> dict[str, Any]:
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "p25": quantile(samples, 0.25),
        "p75": quantile(samples, 0.75),
        "max": max(samples),
        "inner": inner,
        "repeats": len(samples),
    }


def fmt_time(seconds: float | None) -> str:
    """Seconds in a short human unit: ``12.3 µs``, ``4.56 ms``, ``1.23 s``."""
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


# --------------------------------------------------------------------------- environment


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_rev() -> str | None:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=5, cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def env_info() -> dict[str, Any]:
    """What a result depends on: torch, threads, CPU, load, date (UTC, ISO 8601)."""
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "loadavg": load,
        "git": _git_rev(),
    }


def env_line(env: dict[str, Any]) -> str:
    load = env.get("loadavg")
    load_s = "/".join(f"{x:.1f}" for x in load) if load else "?"
    return (f"{env['date']}  torch {env['torch']}  {env['cpu_model']} ({env['cpu_count']} cpus, "
            f"{env['cpu_capability']})  threads {env['threads']}  load {load_s}")


# --------------------------------------------------------------------------- results


def results_path(name: str | os.PathLike) -> Path:
    """Where :func:`write_json` writes ``name``: ``bench/results/<name>`` for a bare file name,
    ``name`` itself for a path. Writes nothing (a long run must not clobber the file it will
    replace before it has something to put there)."""
    p = Path(name)
    return RESULTS_DIR / p if p.parent == Path(".") else p


def write_json(data: Any, name: str | os.PathLike, *, extra: str | os.PathLike | None = None
               ) -> list[Path]:
    """Write ``data`` as JSON to ``bench/results/<name>`` (a bare file name) or to ``name`` when
    it is a path; also to ``extra`` if given. Returns the paths written."""
    paths = []
    for p in (name, extra):
        if p is None:
            continue
        p = results_path(p)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n", encoding="utf-8")
        paths.append(p)
    return paths


def format_table(rows: Sequence[Sequence[Any]], headers: Sequence[str],
                 align: str | None = None) -> str:
    """A Markdown (GitHub) table; ``align`` is one char per column, ``l`` or ``r`` (default: the
    first column left, the rest right)."""
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in r] for r in rows]
    n = len(headers)
    align = align or ("l" + "r" * (n - 1))
    width = [max(len(r[i]) for r in cells) for i in range(n)]

    def line(r):
        return "| " + " | ".join(
            r[i].ljust(width[i]) if align[i] == "l" else r[i].rjust(width[i]) for i in range(n)
        ) + " |"

    sep = "|" + "|".join(
        ("-" * (width[i] + 1) + ":") if align[i] == "r" else (":" + "-" * (width[i] + 1))
        for i in range(n)
    ) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def print_table(rows: Sequence[Sequence[Any]], headers: Sequence[str], *, title: str | None = None,
                align: str | None = None) -> None:
    if title:
        print(f"\n{title}")
    print(format_table(rows, headers, align), flush=True)
