"""The C++ kernel build: the instruction set it targets, the sources it builds and hashes, and a
build killed half-way (the next start builds and loads).

A real build in a private ``TORCH_EXTENSIONS_DIR``, killed once the build has taken its lock, then
started again under a timeout. The private directory starts as a copy of this process's build with
the library and one object removed, so each start compiles one source and links (seconds) rather
than all of them (minutes): the lock, the kill and the recovery are the same.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mcserve.kernels import cpu
from mcserve.kernels.cpu import build

LOAD = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout);"
        "from mcserve.kernels import cpu; print('STATUS', cpu.status(), flush=True)")


AVX2_FLAGS = frozenset({"sse2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
AVX512_FLAGS = AVX2_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@pytest.mark.parametrize("env,flags,want,noted,march", [
    ({}, AVX512_FLAGS, "native", False, "-march=native"),
    ({"MCSERVE_CPU_ISA": "avx2"}, AVX512_FLAGS, "avx2", False, "-march=x86-64-v3"),
    ({"MCSERVE_CPU_ISA": "AVX2"}, AVX2_FLAGS, "avx2", False, "-march=x86-64-v3"),
    ({"MCSERVE_CPU_ISA": "avx512"}, AVX512_FLAGS, "avx512", False, "-march=x86-64-v4"),
    # never an instruction the CPU lacks: native (what the compiler sees here) instead
    ({"MCSERVE_CPU_ISA": "avx512"}, AVX2_FLAGS, "native", True, "-march=native"),
    ({"MCSERVE_CPU_ISA": "avx2"}, frozenset({"sse2", "avx"}), "native", True, "-march=native"),
    ({"MCSERVE_CPU_ISA": "sse9"}, AVX512_FLAGS, "native", True, "-march=native"),
    ({"MCSERVE_CPU_KERNELS_PORTABLE": "1"}, AVX512_FLAGS, "portable", False, None),
    ({"MCSERVE_CPU_ISA": "portable"}, AVX2_FLAGS, "portable", False, None),
], ids=["default", "avx2", "avx2-upper", "avx512", "avx512-missing", "avx2-missing", "unknown",
        "portable-legacy", "portable"])
def test_isa_choice_and_build_name(monkeypatch, env, flags, want, noted, march):
    import platform

    for k in ("MCSERVE_CPU_ISA", "MCSERVE_CPU_KERNELS_PORTABLE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(build, "cpu_flags", lambda: flags)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    isa, note = build.requested_isa()
    assert isa == want and (note is not None) == noted
    name, cflags = build._build_name()
    assert [f for f in cflags if f.startswith("-march")] == ([march] if march else [])
    # each ISA builds under its own name, so switching never loads another's build
    assert (want in name) == (want != "native")
    assert build._src_tag() in name


def test_every_source_is_built_hashed_and_shipped():
    # a .cpp missing from _SOURCES is never compiled, a .h missing from _HEADERS never hashed
    # (an edit to it would load the stale build), and a file outside package-data is missing
    # from a normal (non-editable) install
    here = Path(build.__file__).parent
    assert sorted(build._SOURCES) == sorted(here.glob("*.cpp"))
    assert sorted(build._HEADERS) == sorted(here.glob("*.h"))
    pyproject = here.parents[2] / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("an installed copy: no pyproject.toml beside it")
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(pyproject, "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["mcserve"]
    for path in build._SOURCES + build._HEADERS:
        rel = path.relative_to(here.parents[1]).as_posix()
        assert any(fnmatch.fnmatch(rel, g) for g in globs), f"{rel} is not in package-data"


def _half_built(root: Path) -> Path:
    """A copy of the loaded build under ``root`` without its library and its smallest
    object (timestamps kept, so ninja rebuilds only that one)."""
    from torch.utils.cpp_extension import _get_build_directory

    name = build._build_name()[0]
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
