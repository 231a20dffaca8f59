"""The labelling contract, written straight from SPEC.md. Slow on purpose: it is the oracle.

One row at a time, each set of SPEC.md built as it is defined there:

    OPEN  = { s + len(P) : P in response,                t[s:s+len(P)] == P }
    CLOSE = { s          : P in response or instruction, t[s:s+len(P)] == P }
          ∪ { s + len(P) : P in end,                     t[s:s+len(P)] == P }
    trained(i) = open(i) > close(i) and (not last_turn_only or open(i) == max(OPEN))
                 and no mask_out match covers i
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..outcomes import Outcome
from ..patterns import Markers


def match_starts(row: np.ndarray, pattern: tuple[int, ...]) -> np.ndarray:
    """Every ``s`` with ``row[s:s+len(pattern)] == pattern``, overlapping matches included."""
    if len(pattern) > len(row):
        return np.empty(0, dtype=np.int64)
    windows = sliding_window_view(row, len(pattern))
    return np.flatnonzero((windows == np.asarray(pattern)).all(axis=1))


def latest_at_or_before(positions: np.ndarray, n: int) -> np.ndarray:
    """``out[i] = max { p in positions : p <= i }`` for ``i`` in ``[0, n)``, or -1 where there is none."""
    latest = np.full(n + 1, -1, dtype=np.int64)
    latest[positions[positions <= n]] = positions[positions <= n]
    return np.maximum.accumulate(latest)[:n]


def trained_positions(row: np.ndarray, markers: Markers, *, last_turn_only: bool = False) -> tuple[np.ndarray, bool]:
    """A boolean per token of ``row``: is it trained? Also whether any response pattern occurs."""
    n = len(row)
    opens = [match_starts(row, p) + len(p) for p in markers.response]
    closes = [match_starts(row, p) for p in markers.response + markers.instruction]
    closes += [match_starts(row, p) + len(p) for p in markers.end]
    OPEN = np.concatenate(opens) if opens else np.empty(0, np.int64)
    CLOSE = np.concatenate(closes) if closes else np.empty(0, np.int64)

    covered = np.zeros(n, dtype=bool)
    for p in markers.mask_out:
        for s in match_starts(row, p):
            covered[s : s + len(p)] = True

    open_at = latest_at_or_before(OPEN, n)
    close_at = latest_at_or_before(CLOSE, n)
    trained = (open_at > close_at) & ~covered
    if last_turn_only:
        trained &= open_at == (OPEN.max() if OPEN.size else -1)
    return trained, OPEN.size > 0


def outcome_of(n_tokens: int, n_trained: int, has_response: bool) -> Outcome:
    if n_tokens == 0:
        return Outcome.EMPTY
    if n_trained:
        return Outcome.TRAINED
    return Outcome.EMPTY_RESPONSE if has_response else Outcome.NO_RESPONSE


def label_rows(values, starts, ends, markers: Markers, *, last_turn_only, ignore_index, out, write_mask):
    """Backend entry point (see ``lossmask.engine.kernels``): one Python iteration per row."""
    n_rows = len(starts)
    trained_tokens = np.zeros(n_rows, dtype=np.int64)
    outcomes = np.zeros(n_rows, dtype=np.int8)
    first_bad = np.full(n_rows, -1, dtype=np.int64)
    for r in range(n_rows):
        lo, hi = int(starts[r]), int(ends[r])
        row = np.asarray(values[lo:hi]).astype(np.int64)
        negative = np.flatnonzero(row < 0)
        if negative.size:
            first_bad[r] = lo + negative[0]
        trained, has_response = trained_positions(row, markers, last_turn_only=last_turn_only)
        if write_mask:
            out[lo:hi] = trained
        else:
            out[lo:hi] = np.where(trained, row, ignore_index)
        trained_tokens[r] = trained.sum()
        outcomes[r] = outcome_of(hi - lo, int(trained_tokens[r]), has_response)
    return trained_tokens, outcomes, first_bad
