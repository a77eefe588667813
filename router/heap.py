"""Keep large, short-lived allocations out of the C heap (glibc), so abusive bodies do not raise RSS for good.

glibc serves allocations above its mmap threshold (128 KiB) with ``mmap`` and returns them to the OS when freed;
but each such free raises the threshold (up to 32 MiB), after which the same sizes come from the heap and stay
there once freed. A router parsing a 16 MiB body (the body, its chunks, simdjson's document: several times the
body's size, in a worker thread's arena) would keep about 100 MB more RSS after rejecting it. Fixing the threshold
at its default turns that dynamic adjustment off. Elsewhere (musl, macOS) nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util

#: glibc's mallopt parameter number for the mmap threshold (malloc.h)
M_MMAP_THRESHOLD = -3
#: allocations at least this large are mmapped and returned to the OS when freed, bytes (glibc's default)
MMAP_THRESHOLD_BYTES = 128 * 1024


def pin_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at ``MMAP_THRESHOLD_BYTES``; True when it was set (glibc), False elsewhere."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
