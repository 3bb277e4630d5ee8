"""``.ci/run`` skips, in its bench smoke, the scripts whose ``--quick`` run a test makes: each
name it skips is a bench script that some test runs with ``--quick``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_skips_only_scripts_a_test_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    m = re.search(r"^covered=\(([^)]*)\)", ci, re.M)
    assert m, "`.ci/run` names the scripts it skips in covered=(...)"
    covered = m.group(1).split()
    assert covered
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_bench*.py"))
    tests += (ROOT / "tests" / "test_rwkv7.py").read_text()
    for name in covered:
        assert (ROOT / "bench" / f"{name}.py").is_file(), name
        assert re.search(rf'"{name}\.py"', tests), f"no test runs bench/{name}.py"
    assert tests.count('"--quick"') >= len(covered)
