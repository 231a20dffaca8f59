"""``keep_heaps_small()``: glibc's allocator set for a long job in the ``lossmask`` program's own process.

A job renders, tokenises and writes on threads of their own. glibc gives each thread that contends for the heap an
arena of its own (up to 8 per core) and serves allocations up to 32 MiB from those arenas once its threshold has
adapted; an arena keeps what it once held, free or not. Two arenas and a fixed 1 MiB threshold (larger blocks,
such as Arrow's batch buffers, are mapped and returned on free) took the peak of 100,000 real chats from 973-990 to
780-846 MiB, at the same speed within the noise (``docs/benchmarks.md``, Memory).

Only the command-line program calls this: the settings are process-wide and cannot be put back, so a library call
(``mask_files`` in a notebook or a trainer) leaves the allocator as its caller has it. The environment's own
settings win: with ``MALLOC_ARENA_MAX`` or ``MALLOC_MMAP_THRESHOLD_`` set (or ``LOSSMASK_MALLOC=default``), nothing
is changed. Other C libraries (musl, macOS) are left alone.
"""

from __future__ import annotations

import ctypes
import os
import sys

ARENAS = 2
MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # mallopt parameters, from glibc's malloc.h
_M_ARENA_MAX = -8
_USER_SETTINGS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_")


def keep_heaps_small() -> bool:
    """Set glibc's arena count and mmap threshold for this process; True when both were set."""
    if not sys.platform.startswith("linux") or os.environ.get("LOSSMASK_MALLOC", "").lower() == "default":
        return False
    if any(os.environ.get(name) for name in _USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: another libc's mallopt may take other numbers
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_ARENA_MAX, ARENAS)) and bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
