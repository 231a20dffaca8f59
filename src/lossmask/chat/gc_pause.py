"""``paused_collection()``: no cyclic garbage collection while a batch's per-row Python runs.

The rows of a batch live as Python objects while it is located and planned (a dict per message, thousands of
them), and those loops allocate a few small containers per row. CPython's collector counts allocations and now and
then walks every live container; on a 4,000-row batch of chats it walked them two extra times when weights were
read, which cost more than reading them (0.15 s of a 0.7 s batch, ``benchmarks/bench_weights.py``). Nothing these
loops make is cyclic, so reference counting frees it all; the collector runs again when the pause ends.

A pause is counted across threads (the render and tokenise threads of a job may both be in one): collection comes
back when the last one ends, and only if it was on when the first began.
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def paused_collection():
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
