"""Shared data for the benchmarks: ChatML-like token rows built with NumPy (no tokenizer needed)."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from lossmask import Markers

# Qwen2.5's ChatML ids, so that the flag table has a realistic size (ids up to 151645).
IM_START, IM_END, NL, SYSTEM, USER, ASSISTANT = 151644, 151645, 198, 8948, 872, 77091
CHATML = Markers(response=[[IM_START, ASSISTANT, NL]], instruction=[[IM_START]], end=[[IM_END]])


def chatml_rows(n_rows: int, *, tokens_per_row: int = 1000, turns: int = 4, seed: int = 0) -> pa.Array:
    """``n_rows`` rows of a system turn and ``turns`` user/assistant pairs, about ``tokens_per_row`` long."""
    rng = np.random.default_rng(seed)
    headers = 3 + 2  # <|im_start|> role \n ... <|im_end|> \n
    body = tokens_per_row // (2 * turns + 1) - headers
    rows = []
    for _ in range(n_rows):
        lengths = rng.integers(body // 2, body * 3 // 2, size=2 * turns + 1)
        parts = []
        for k, length in enumerate(lengths):
            role = SYSTEM if k == 0 else (USER if k % 2 else ASSISTANT)
            parts += [[IM_START, role, NL], rng.integers(1000, 150000, size=length), [IM_END, NL]]
        rows.append(np.concatenate(parts).astype(np.int32))
    offsets = np.zeros(n_rows + 1, dtype=np.int32)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(rows)))


def best_seconds(fn, *, repeat: int = 5, clock=time.perf_counter) -> float:
    """The fastest of ``repeat`` runs: the figure least disturbed by a noisy machine.

    ``clock=time.thread_time`` counts this thread's CPU time instead of the wall clock: on a loaded
    machine, a one-thread figure that ignores the time spent waiting for a core."""
    best = float("inf")
    for _ in range(repeat):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


def copy_baseline_seconds(values: np.ndarray, dtype=np.int64, *, clock=time.perf_counter) -> float:
    """``np.copyto`` of the same tokens into a label-dtype buffer: the memory-speed yardstick."""
    out = np.empty(values.shape, dtype=dtype)
    np.copyto(out, values, casting="unsafe")  # touch the pages once before timing
    return best_seconds(lambda: np.copyto(out, values, casting="unsafe"), clock=clock)
