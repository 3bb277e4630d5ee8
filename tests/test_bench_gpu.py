"""``bench/gpu.py``, the one-run GPU comparison, smoke-tested on the CPU: ``--device cpu --quick``
goes through every section (Mamba2 vs transformers in both dtypes, long context vs the SDPA
Transformer, eager vs graphs) at tiny sizes and writes every section into its JSON; without
``--quick`` on the CPU, or without a CUDA device, it says it needs CUDA and exits 0."""

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("transformers", reason="the baselines are transformers models")


def test_gpu_bench_cpu_quick(tmp_path):
    out = tmp_path / "gpu.json"
    # MCSERVE_CPU_KERNELS=0: the bench's code paths are under test, not the C++ decode kernels,
    # whose first build alone would take minutes
    env = {**os.environ, "MCSERVE_BENCH_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "MCSERVE_CPU_KERNELS": "0", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--device", "cpu",
                        "--quick", "--threads", "1", "--out", str(out)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["bench"] == "gpu" and data["partial"] is False
    assert data["errors"] == [] and data["skipped"] == [], (data["errors"], data["skipped"])
    assert {"card", "versions", "command", "env", "bandwidth"} <= set(data)
    assert data["versions"]["transformers"] and data["bandwidth"]["copy"]["tbs"] > 0

    rows = data["mamba2"]["rows"]
    cells = {(x["impl"], x["dtype"], x["streams"]) for x in rows}
    assert {(i, d, n) for i in ("mcserve", "transformers") for d in ("float32", "bfloat16")
            for n in (1, 4)} <= cells
    for x in rows:
        assert x["decode_tokens_per_s"] > 0 and x["floor_frac_copy"] > 0
        assert "tokens" not in x  # only kept for the agreement check
    ours = [x for x in rows if x["impl"] == "mcserve"]
    assert all(x["vs_transformers"] > 0 and 0 <= x["agreement_with_transformers"] <= 1
               for x in ours)

    lc = {x["model"]: x for x in data["long_context"]["rows"]}
    assert set(lc) == {"grm", "ssc8", "none", "transformer-static"}
    for name in ("grm", "ssc8", "none"):
        assert lc[name]["prefill_vs_transformer"] > 0
        assert lc[name]["decode_vs_transformer_static"] > 0
        assert lc[name]["pool_whole_after"] is True

    graphs = data["graphs"]
    assert "skipped" in graphs or {(x["enforce_eager"], x["streams"]) for x in graphs["rows"]} \
        == {(e, n) for e in (True, False) for n in (1, 4)}

    hyb = {(x["model"], x["streams"]) for x in data["hybrid"]["rows"]}
    assert hyb == {(m, n) for m in ("LFM2", "Granite-4.0-H") for n in (1, 4)}
    assert all(x["decode_tokens_per_s"] > 0 for x in data["hybrid"]["rows"])

    assert len(data["targets"]) == 8 and all("pass" in t for t in data["targets"])
    assert "Targets (printed, not asserted)" in r.stdout


def test_gpu_bench_needs_cuda(capsys):
    mod = runpy.run_path(str(ROOT / "bench" / "gpu.py"), run_name="bench_gpu")
    assert mod["main"](["--device", "cpu"]) == 0  # no --quick: nothing worth timing on a CPU
    assert "needs CUDA" in capsys.readouterr().out
    if not torch.cuda.is_available():
        assert mod["main"]([]) == 0
        assert "needs CUDA" in capsys.readouterr().out
