"""``bench/offline.py --compare --quick``: mcserve, transformers (and llama.cpp when installed)
decode the same random Mamba2 checkpoint in one run and produce the same greedy tokens."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("transformers", reason="the transformers baseline needs 'transformers'")


def test_offline_compare_quick(tmp_path):
    out = tmp_path / "cmp.json"
    env = {**os.environ, "MCSERVE_BENCH_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "offline.py"), "--compare", "--quick",
                        "--threads", "1", "--out", str(out)], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    names = {(x["name"], x["streams"]) for x in data["results"]}
    assert {("mcserve", 1), ("mcserve", 4), ("transformers", 1), ("transformers", 4)} <= names
    agree = {(a["name"], a["streams"]): a["fraction"] for a in data["agreement_with_mcserve"]}
    assert agree[("transformers", 1)] == 1.0 and agree[("transformers", 4)] == 1.0
    if ("llama.cpp", 1) in names:
        assert agree[("llama.cpp", 1)] == 1.0
    else:  # not installed here: the column is skipped with the reason, not silently
        assert any("llama.cpp column skipped" in n for n in data["notes"])
        assert "llama.cpp column skipped" in r.stdout
    assert "mcserve / transformers" in r.stdout


def test_offline_compare_hybrids_quick(tmp_path):
    """``--compare --hybrids --quick``: the 2-layer LFM2 and Granite-4.0-H shapes, mcserve and
    transformers (and llama.cpp when installed) with the same greedy tokens."""
    out = tmp_path / "hybrids.json"
    env = {**os.environ, "MCSERVE_BENCH_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "offline.py"), "--compare",
                        "--hybrids", "--quick", "--threads", "1", "--out", str(out)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    got = {(x["model"], x["name"], x["streams"]) for x in data["results"]}
    for model in ("LFM2", "Granite-4.0-H"):
        assert {(model, m, n) for m in ("mcserve", "transformers") for n in (1, 4)} <= got
    agree = {(a["model"], a["name"], a["streams"]): a["fraction"]
             for a in data["agreement_with_mcserve"]}
    for model in ("LFM2", "Granite-4.0-H"):
        assert agree[(model, "transformers", 1)] == 1.0
        assert agree[(model, "transformers", 4)] == 1.0
        if (model, "llama.cpp", 1) in got:
            assert agree[(model, "llama.cpp", 1)] == 1.0
        else:  # not installed, or the shape does not convert: the reason is printed, not lost
            assert any(n.startswith(f"{model}: llama.cpp column skipped") for n in data["notes"])
    assert "mcserve / transformers" in r.stdout


def test_moe_bench_quick(tmp_path):
    """``bench/moe.py --quick``: a 2-layer Granite-4.0-H with routed experts decoded by mcserve in
    float32 and int8 (and by llama.cpp's F32 / Q8_0 when installed, else a note says why)."""
    out = tmp_path / "moe.json"
    env = {**os.environ, "MCSERVE_BENCH_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "moe.py"), "--quick", "--threads",
                        "1", "--out", str(out)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    got = {(x["name"], x["streams"]) for x in data["results"]}
    assert {(m, n) for m in ("mcserve float32", "mcserve int8") for n in (1, 8)} <= got
    assert all(x["tokens_per_s"] > 0 for x in data["results"])
    if ("llama.cpp F32", 1) in got:  # the same weights: the same greedy tokens
        agree = {(a["name"], a["streams"]): a["fraction"]
                 for a in data["agreement_with_mcserve_float32"]}
        assert agree[("llama.cpp F32", 1)] == 1.0
    else:
        assert data["notes"]
    assert "int8 / Q8_0" in r.stdout
