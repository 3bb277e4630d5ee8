"""``bench/host_malloc.py --quick`` runs both sides in child processes and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_host_malloc_bench_quick(tmp_path):
    out = tmp_path / "hm.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "host_malloc.py"), "--quick",
                        "--threads", "1", "--out", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    assert len(data["runs"]["on"]) == len(data["runs"]["off"]) == 2
    assert not any(x["applied"] for x in data["runs"]["off"])
    assert all(x["prefill_s"] > 0 and x["generate_s"] > 0 for s in ("on", "off")
               for x in data["runs"][s])
