"""The C++ kernel build survives being killed half-way: the next start builds and loads.

A real build in a private ``TORCH_EXTENSIONS_DIR``, killed once the build has taken its lock, then
started again under a timeout. The private directory starts as a copy of this process's build with
the library and one object removed, so each start compiles one source and links (seconds) rather
than all of them (minutes): the lock, the kill and the recovery are the same.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mcserve.kernels import cpu

LOAD = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout);"
        "from mcserve.kernels import cpu; print('STATUS', cpu.status(), flush=True)")


def _half_built(root: Path) -> Path:
    """A copy of the loaded build under ``root`` without its library and its smallest
    object (timestamps kept, so ninja rebuilds only that one)."""
    from torch.utils.cpp_extension import _get_build_directory

    name = cpu._build_name()[0]
    src = Path(_get_build_directory(name, verbose=False))
    dst = root / src.parent.name / name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("lock"))
    for so in dst.glob("*.so"):
        so.unlink()
    for obj in sorted(dst.glob("*.o"), key=lambda p: p.stat().st_size)[:1]:
        obj.unlink()
    return dst


@pytest.mark.skipif(cpu.status() is not None,
                    reason=f"the C++ kernels cannot be built here: {cpu.status()}")
def test_start_after_a_build_killed_half_way(tmp_path: Path):
    build = _half_built(tmp_path)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / build.parent.name)}
    first = subprocess.Popen([sys.executable, "-c", LOAD], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (build / "lock").exists() and time.monotonic() < deadline:
            assert first.poll() is None, first.stdout.read().decode()
            time.sleep(0.05)
        assert (build / "lock").exists(), "the build never took torch's lock"
        time.sleep(0.5)  # the compiler is running
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert (build / "lock").exists(), "the killed build should leave its lock file behind"
    assert not list(build.glob("*.so")), "the build was killed before it linked"
    again = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True,
                           text=True, timeout=400)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out
    assert "STATUS None" in out, out  # built and loaded, not the torch twins
    assert "stale build lock" in out, out
    assert list(build.glob("*.so")), out
