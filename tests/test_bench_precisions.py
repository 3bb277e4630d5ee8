"""``bench/offline.py --compare --precisions --quick``: mcserve float32, bf16 and int8 weights on
one random Mamba2 checkpoint in one run, with the CPU's features and a prefill row."""

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
