"""``bench/attention.py --quick`` runs, checks the paged and gathered paths agree, and writes its
table's JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_attention_bench_quick(tmp_path):
    out = tmp_path / "attention.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "attention.py"), "--quick",
                        "--repeats", "2", "--out", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    assert [(x["batch"], x["tokens"]) for x in data["results"]] == [(1, 64), (4, 256)]
    assert "gathered / paged" in r.stdout
