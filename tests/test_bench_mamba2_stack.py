"""``bench/mamba2_stack.py --quick`` runs both modes, finds the stack used and the tokens the
same, and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mamba2_stack_bench_quick(tmp_path):
    out = tmp_path / "stack.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "mamba2_stack.py"), "--quick",
                        "--threads", "1", "--weights", "float32", "int8", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    assert [(x["weights"], x["streams"]) for x in data["results"]] == [
        ("float32", 1), ("float32", 3), ("int8", 1), ("int8", 3)]
    assert all(x["same_tokens"] for x in data["results"])
    assert all(x["stack_used"] for x in data["results"] if x["streams"] == 1)
