"""Building and loading the C++ CPU kernels (``mcserve.kernels.cpu`` re-exports the public
names).

``ops()`` returns the compiled module, or ``None`` where it cannot be built (no C++ compiler,
a non-x86 build, ``MCSERVE_CPU_KERNELS=0``); the reason is in ``status()``. The sources are
the ``.cpp`` and ``.h`` files beside this file (``_SOURCES``, ``_HEADERS``);
``torch.utils.cpp_extension.load`` compiles them once per machine (1–2 minutes on 2 cores)
into torch's extension cache (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``),
under a name that holds the CPU kind and a hash of the sources and their directory, and reuses
it while the sources are unchanged. The build runs under an ``flock`` that a killed build cannot
leave held (``_build_lock``). It targets this CPU (``-march=native``) unless
``$MCSERVE_CPU_ISA`` asks for a fixed level (``avx2``: x86-64-v3, ``avx512``: x86-64-v4,
``portable``), each under its own name, never one this CPU lacks (``requested_isa``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import threading
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("mcserve.kernels.cpu")

_DIR = Path(__file__).parent
#: every file of the build (docs/cpu-kernels.md, "Sources"): ops.cpp binds the module; the float32
#: ops by kind (ops.h; helpers in common.h), the low-precision products (lowp.cpp, lowp_ops.cpp /
#: lowp.h) and the sampling ops (sampling.cpp / sampling.h). All of them go into the source hash.
_SOURCES = tuple(_DIR / f for f in ("ops.cpp", "gemv.cpp", "scan.cpp", "steps.cpp",
                                    "readout.cpp", "blocks.cpp", "lowp.cpp", "lowp_ops.cpp",
                                    "amx.cpp", "pairs.cpp", "mlp.cpp", "sampling.cpp"))
_HEADERS = tuple(_DIR / f for f in ("common.h", "ops.h", "lowp.h", "sampling.h", "vmath.h"))
_lock = threading.Lock()
_state: dict[str, object] = {}



def _cpuinfo_head() -> str:
    """The first processor's lines of ``/proc/cpuinfo`` ("" where there is none)."""
    text = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.strip() == "":  # the first processor is enough
                    break
                text += line
    except OSError:
        pass
    return text


def _cpu_tag() -> str:
    """A short hash of this CPU's model and instruction-set flags: a ``-march=native`` build is
    cached per CPU kind, so a home directory shared by different machines never loads a build
    with instructions its CPU lacks."""
    text = platform.machine()
    head = _cpuinfo_head()
    if head:
        text += "".join(line + "\n" for line in head.splitlines()
                        if line.startswith(("flags", "model name", "Features")))
    else:
        text += platform.processor()
    return hashlib.sha1(text.encode()).hexdigest()[:8]


def cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set flags as ``/proc/cpuinfo`` lists them (empty where unknown)."""
    for line in _cpuinfo_head().splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _src_tag() -> str:
    """A short hash of the C++ sources and of where they are: two checkouts on one machine (of
    different versions, or the same version in two places, such as a CI copy of a work tree)
    build under different names instead of rebuilding over each other (the build's commands
    name the sources by path, so a build from another place recompiles everything)."""
    h = hashlib.sha1(str(_DIR.resolve()).encode())
    for f in _SOURCES + _HEADERS:
        h.update(f.read_bytes())
    return h.hexdigest()[:8]


#: ``MCSERVE_CPU_ISA`` values other than ``native``: the ``-march`` each builds for and the
#: ``/proc/cpuinfo`` flags this CPU must have to run it (x86-64 micro-architecture levels)
ISA_ENV = "MCSERVE_CPU_ISA"
ISAS: dict[str, tuple[str | None, frozenset[str]]] = {
    "portable": (None, frozenset()),  # the compiler's default target (x86-64: SSE2)
    "avx2": ("x86-64-v3", frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})),
    "avx512": ("x86-64-v4", frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe",
                                       "avx512f", "avx512bw", "avx512cd", "avx512dq",
                                       "avx512vl"})),
}


def requested_isa() -> tuple[str, str | None]:
    """The instruction set the C++ ops are built for, and a note when the request was not
    followed: ``$MCSERVE_CPU_ISA`` (``native`` (default), ``avx2``, ``avx512``, ``portable``;
    ``MCSERVE_CPU_KERNELS_PORTABLE=1`` is ``portable``). A level this CPU lacks (``avx512`` on an
    AVX2-only CPU, ``avx2`` on an older one) is never built: ``native`` serves instead, which
    by construction only uses instructions this CPU has."""
    raw = os.environ.get(ISA_ENV, "").strip().lower()
    if not raw and os.environ.get("MCSERVE_CPU_KERNELS_PORTABLE", "") == "1":
        raw = "portable"
    if raw in ("", "native"):
        return "native", None
    if raw not in ISAS:
        return "native", (f"{ISA_ENV}={raw!r} is not one of native, "
                          f"{', '.join(ISAS)}: building for native")
    march, needs = ISAS[raw]
    if march is not None:
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return "native", f"{ISA_ENV}={raw} is an x86-64 level, this is {platform.machine()}"
        missing = needs - cpu_flags()
        if missing:
            return "native", (f"{ISA_ENV}={raw}: this CPU lacks {', '.join(sorted(missing))}; "
                              "building for native instead")
    return raw, None


def _build_name() -> tuple[str, list[str]]:
    flags = ["-O3", "-fopenmp", "-ffp-contract=fast"]
    isa, note = requested_isa()
    if note:
        log.warning("mcserve CPU kernels: %s", note)
    if isa == "native":
        flags.append("-march=native")  # built where it runs: use this CPU's vector width
        return f"mcserve_cpu_ops_{_cpu_tag()}_{_src_tag()}", flags
    march = ISAS[isa][0]
    if march is not None:
        flags.append(f"-march={march}")
    return f"mcserve_cpu_ops_{isa}_{_src_tag()}", flags


#: the highest implementation level of the low-precision kernels (lowp.cpp: 0 scalar, 1 AVX2,
#: 2 AVX-512, 3 AVX-512 VNNI / BF16, 4 AMX-BF16 (bfloat16 only)) each ``MCSERVE_CPU_ISA`` build
#: may use: ``avx2`` and ``avx512`` run as such a CPU would; ``native`` and ``portable`` take what
#: the CPU reports at run time (those kernels pick their instruction set then, so a portable
#: build stays portable)
LOWP_LEVELS = {"portable": 4, "avx2": 1, "avx512": 2, "native": 4}


def isa() -> str:
    """The instruction set of the loaded build (``native``, ``avx2``, ``avx512``, ``portable``),
    or why there is none (``status()``)."""
    ops()
    return str(_state.get("isa") or status())


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``build_dir``'s lock file while building.

    torch's own build lock is a file created with O_EXCL and removed when the build ends: a
    build killed half-way (a timeout, ``docker stop``, a restart) leaves it behind, and every
    later load waits for it forever. An ``flock`` is released by the kernel when its holder
    dies, so a dead process never holds this one; and while we hold it no live process is
    building here, so a leftover torch lock file is stale and is removed.
    """
    import fcntl

    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir.with_name(build_dir.name + ".flock"), "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process that is building the mcserve CPU kernels")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing a stale build lock left by a killed build: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ninja_dir() -> str | None:
    """Where the ``ninja`` package (a dependency) keeps its binary, for the build to run first:
    a build directory's log written by one ninja version reads as stale to another, which then
    recompiles everything (a venv's ninja 1.13 against a system's 1.11 took 2.5 minutes each
    time a script ran the venv's python without activating it)."""
    try:
        import ninja
    except ImportError:
        return None
    d = getattr(ninja, "BIN_DIR", None)
    return d if d and os.path.isfile(os.path.join(d, "ninja")) else None


def _build():
    import time

    from torch.utils.cpp_extension import _get_build_directory, load

    name, flags = _build_name()
    _state["isa"] = requested_isa()[0]
    build_dir = Path(_get_build_directory(name, verbose=False))
    with _build_lock(build_dir):
        fresh = not any(build_dir.glob("*.so"))
        if fresh:
            log.info("building mcserve CPU kernels in %s (once per machine and version: "
                     "1-2 minutes on 2 cores)", build_dir)
        t0 = time.perf_counter()
        path = os.environ.get("PATH", "")
        ninja_dir = _ninja_dir()
        if ninja_dir:  # the environment's own ninja, whether or not the venv is activated
            os.environ["PATH"] = ninja_dir + os.pathsep + path
        try:
            # -fopenmp: at::parallel_for splits the weights over torch's intra-op threads
            mod = load(name=name, sources=[str(f) for f in _SOURCES], extra_cflags=flags,
                       extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
        finally:
            os.environ["PATH"] = path
        if fresh:
            log.info("built mcserve CPU kernels in %.0f s", time.perf_counter() - t0)
    return mod


_local = threading.local()


@contextlib.contextmanager
def twins_only() -> Iterator[None]:
    """Within the block (this thread), every op takes its torch twin: for flop counters and
    profilers that see only torch ops, and for comparing whole models against the twins."""
    prev = getattr(_local, "off", False)
    _local.off = True
    try:
        yield
    finally:
        _local.off = prev


def ops():
    """The compiled module, building it on the first call; ``None`` if unavailable (or inside
    ``twins_only()``)."""
    if getattr(_local, "off", False):
        return None
    if "mod" in _state:
        return _state["mod"]
    with _lock:
        if "mod" not in _state:
            mod, why = None, None
            if os.environ.get("MCSERVE_CPU_KERNELS", "1").strip() in ("0", "false", "no"):
                why = "disabled by MCSERVE_CPU_KERNELS=0"
            else:
                try:
                    mod = _build()
                except Exception as e:  # no compiler / headers: the torch twins serve
                    why = f"build failed: {type(e).__name__}: {str(e).strip()[-300:]}"
                    log.warning("mcserve CPU kernels unavailable (%s); using torch ops", why)
            if mod is not None:
                # the low-precision kernels pick their instruction set at run time: never above
                # the level MCSERVE_CPU_ISA asks for
                mod.lowp_set_cap(LOWP_LEVELS[str(_state.get("isa", "native"))])
            _state["mod"], _state["why"] = mod, why
            if mod is None:
                _state.pop("isa", None)
    return _state["mod"]


def status() -> str | None:
    """``None`` when the C++ ops are built and in use, else why not."""
    if getattr(_local, "off", False):
        return "inside twins_only()"
    ops()
    return _state["why"]  # type: ignore[return-value]


def enabled() -> bool:
    return ops() is not None
