"""Keep freed host memory for reuse (glibc's ``mallopt``), for the engine on the CPU.

glibc serves a large allocation (above a threshold that starts at 128 KiB) with a fresh ``mmap``
and unmaps it when freed, so every large temporary of a step, a 130M Mamba2 layer's 786 KiB
state, a prefill's activations, is first touched page by page again: a sixteen-token prefill
of that model spent about a third of its time in page faults. ``keep_freed_memory`` raises the
threshold to 64 MiB and lets the heap keep up to 256 MiB of freed memory (and grow by 64 MiB at
a time), so the same buffers come back warm: that prefill takes 48.6 ms instead of 79.0
(``bench/host_malloc.py``: int8 weights, 2 threads). The cost is resident memory the process
keeps after a peak, bounded by the trim threshold.

It is done once per process, on Linux with glibc only (elsewhere, or when ``MALLOC_*`` variables
or ``MCSERVE_HOST_MALLOC=0`` say otherwise, nothing changes). Allocations made before it (the
weights) keep the pages they have.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = {_M_MMAP_THRESHOLD: 64 << 20, _M_TRIM_THRESHOLD: 256 << 20, _M_TOP_PAD: 64 << 20}
_done: bool | None = None


def _glibc():
    """glibc through ctypes, or None (another libc, or none found)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        version = libc.gnu_get_libc_version  # absent outside glibc
    except (OSError, AttributeError):
        return None
    version.restype = ctypes.c_char_p
    return libc


def return_freed_memory() -> bool:
    """Give the pages of memory freed so far back to the system (glibc's ``malloc_trim``): what
    releasing a low-precision model's float32 weights frees (``models/compact_weight.py``)
    stays in the process otherwise, since those weights and the compact copies made beside them
    share the heap. True when glibc returned some."""
    if not sys.platform.startswith("linux"):
        return False
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc.malloc_trim(0) == 1


def keep_freed_memory() -> bool:
    """Apply ``SETTINGS`` with ``mallopt`` (once per process); True when they are in effect."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if (not sys.platform.startswith("linux") or os.environ.get("MCSERVE_HOST_MALLOC") == "0"
            or any(k.startswith("MALLOC_") for k in os.environ)):
        return False
    libc = _glibc()
    if libc is None:
        return False
    gnu = libc.gnu_get_libc_version().decode()
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = all(mallopt(k, v) == 1 for k, v in SETTINGS.items())
    log.debug("glibc %s mallopt %s: %s", gnu, SETTINGS, "applied" if _done else "refused")
    return _done
