"""``bench/multi_turn.py --quick``: the multi-turn chat, shared-system and branch workloads run
against a reuse-on and a reuse-off server in one run; the JSON has one row per turn for both, and
the server with prefix caching off reports no cached prompt tokens. No timing is asserted."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_multi_turn_quick(tmp_path):
    out = tmp_path / "multi_turn.json"
    # MCSERVE_CPU_KERNELS=0: the bench's code paths are under test, not the C++ decode kernels,
    # whose first build alone would take most of a minute
    env = {**os.environ, "MCSERVE_BENCH_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "MCSERVE_CPU_KERNELS": "0"}
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "multi_turn.py"), "--quick",
                        "--threads", "1", "--no-llama-server", "--out", str(out)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    turns = data["args"]["turns"]
    assert turns == 3 and data["args"]["users"] == 2
    chat = data["workloads"]["chat"]
    for mode in ("on", "off"):
        rows = chat[mode]["turns"]
        assert [row["turn"] for row in rows] == list(range(1, turns + 1))
        for row in rows:
            assert row["errors"] == 0 and row["requests"] == 2
            assert all(p and p > 0 for p in row["per_user"]["prompt_tokens"])
        # each turn carries the previous one verbatim: the prompt grows
        prompts = [sum(row["per_user"]["prompt_tokens"]) for row in rows]
        assert prompts == sorted(prompts) and prompts[0] < prompts[-1]
        assert data["servers"][mode]["rss_max_bytes"] > 0
    # prefix caching off: nothing is served from a cache, on any turn or workload
    for row in chat["off"]["turns"]:
        assert row["cached_tokens"] == 0 and row["per_user"]["cached_tokens"] == [0, 0]
    for wl in ("shared_system", "branch"):
        assert all(x["cached_tokens"] == 0 for x in data["workloads"][wl]["off"]["requests"])
        assert len(data["workloads"][wl]["on"]["requests"]) == len(
            data["workloads"][wl]["off"]["requests"])
    assert "--no-enable-prefix-caching" in data["servers"]["off"]["flags"]
    assert "skipped" in chat["llama_server"] and "llama-server column skipped" in r.stdout
    assert {t["pass"] for t in data["targets"]} <= {True, False, None}
    assert "Targets (printed, not asserted)" in r.stdout
