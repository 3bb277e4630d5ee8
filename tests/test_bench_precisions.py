"""The weight-precision benchmarks' smoke runs: ``bench/offline.py --compare --precisions
--quick`` (mcserve float32, bf16 and int8 weights on one random Mamba2 checkpoint in one run,
with the CPU's features and a prefill row) and ``bench/weight_memory.py --quick`` (the memory
each precision holds)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("transformers", reason="the random Mamba2 checkpoint needs 'transformers'")


def test_offline_compare_precisions_quick(tmp_path):
    out = tmp_path / "prec.json"
    env = {**os.environ, "MCSERVE_BENCH_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "offline.py"), "--compare",
                        "--precisions", "--quick", "--threads", "1", "--out", str(out)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    names = {(x["name"], x["streams"]) for x in data["decode"]}
    assert {(f"mcserve {p}", n) for p in ("float32", "bf16", "int8") for n in (1, 4)} <= names
    assert all(x["tokens_per_s"] > 0 for x in data["decode"] + data["prefill"])
    assert {x["name"] for x in data["prefill"]} >= {"mcserve float32", "mcserve int8"}
    assert "CPU features:" in r.stdout and "prefill, 128 tokens" in r.stdout
    assert data["batch_invariant"]["mcserve int8"] and data["batch_invariant"]["mcserve bf16"]
    if not any(x["name"].startswith("llama.cpp") for x in data["decode"]):
        assert any("llama.cpp columns skipped" in n for n in data["notes"])


def test_weight_memory_bench_quick(tmp_path):
    """``bench/weight_memory.py --quick``: every configuration loads and generates in its own
    process; int8 and bf16 keep only their compact weights, with the same greedy tokens as the
    same precision with the float32 weights kept."""
    out = tmp_path / "mem.json"
    env = {**os.environ, "MCSERVE_BENCH_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "weight_memory.py"), "--quick",
                        "--threads", "1", "--out", str(out)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    for model in {x["model"] for x in data["results"]}:
        got = {x["name"]: x for x in data["results"] if x["model"] == model}
        assert not [x for x in got.values() if "error" in x], got
        for kind in ("int8", "bf16"):
            assert got[kind]["float32_kept_bytes"] == 0 < got[f"{kind} kept"]["float32_kept_bytes"]
            assert got[kind]["tokens"] == got[f"{kind} kept"]["tokens"]
            assert len(got[kind]["tokens"]) == 8
        assert got["int8"]["held_bytes"] < got["bf16"]["held_bytes"] < got["float32"]["held_bytes"]
        assert got["float32"]["loaded"]["anon_peak"] > 0
    assert "resident memory (MB) by weight precision" in r.stdout
