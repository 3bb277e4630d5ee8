"""``engine/host_malloc.py``: glibc keeps freed large blocks once the engine runs on the CPU;
``MCSERVE_HOST_MALLOC=0`` or a ``MALLOC_*`` variable leaves the allocator alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CODE = ("from mcserve.engine.host_malloc import keep_freed_memory as k; "
        "print(k(), k())")


def _run(**env: str) -> str:
    base = {k: v for k, v in os.environ.items()
            if k != "MCSERVE_HOST_MALLOC" and not k.startswith("MALLOC_")}
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                       env={**base, **env}, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def _glibc() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").gnu_get_libc_version  # noqa: B018
    except (OSError, AttributeError):
        return False
    return sys.platform.startswith("linux")


@pytest.mark.skipif(not _glibc(), reason="needs Linux with glibc (mallopt)")
def test_applied_once_on_glibc_and_left_alone_when_asked():
    assert _run() == "True True"  # applied, and the second call reports the same
    assert _run(MCSERVE_HOST_MALLOC="0") == "False False"
    assert _run(MALLOC_ARENA_MAX="2") == "False False"  # the user tunes malloc: hands off


def test_the_engine_applies_it_on_the_cpu(monkeypatch):
    from mcserve.engine import llm_engine

    calls = []
    monkeypatch.setattr(llm_engine, "keep_freed_memory", lambda: calls.append(1) or True)
    llm_engine.LLMEngine()
    assert calls == [1]
