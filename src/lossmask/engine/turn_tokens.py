"""Turn spans to token labels: which tokens of a row train, given each assistant turn's span of characters.

Labels from the rendering ask it (``trained_by_spans``) for the rows whose turns were read off a learnt conversation shape
(``lossmask.chat.shape_cache``). It decides only the common case, and says so per row (``done``); any other row is
left to the row-by-row code in ``lossmask.chat.turn_spans``, which decides every case. Inputs are flat buffers:

- ``token_spans``: ``(n, 2)`` int32, each token's ``[start, end)`` characters in its own row's text; ``special``: a
  bool per token (a control token of the tokenizer);
- per row: ``row_lo`` / ``row_hi``, its tokens; ``text_lengths``, its text's length in characters;
- ``spans``: ``(m, 3)`` int64 ``(start, text end, end)`` of each turn, ``span_offsets`` (rows + 1) where each row's
  begin; ``pieces``: ``(p, 3)`` int64 ``(start, end, must)`` of each message's text (``must``: 1, every token inside it
  trains; 0, none does; -1, not asked), ``piece_offsets`` (rows + 1).

A row is done when its tokens' starts and ends rise and lie in its text, and for each turn no token crosses its
start, the first token from its start is not a control token running past its end, and (the template closing its
turns with a control token of its own, ``closes``) a control token ending after the turn's text and not past its end
lies in it: the turn trains from its first token to the last such. Its message pieces then keep the role invariant.
Out: ``trained`` (a bool per token; rows not done are left False) and ``done`` (a bool per row).

``reference_turn_tokens`` is the same, written plainly; ``tests/test_rendering_shapes.py`` holds the two equal, and
the labels of the rows done to the row-by-row code's. numba is imported with this module, which ``chat.turn_spans``
imports on first use.
"""

from __future__ import annotations

import numpy as np
from numba import njit


def trained_by_spans(token_spans: np.ndarray, special: np.ndarray, row_lo: np.ndarray, row_hi: np.ndarray,
                     text_lengths: np.ndarray, spans: np.ndarray, span_offsets: np.ndarray, pieces: np.ndarray,
                     piece_offsets: np.ndarray, closes: bool, trained: np.ndarray) -> np.ndarray:
    """Mark in ``trained`` (a bool per token of the batch) the tokens of each row done, and return ``done``, a bool
    per row (see the module notes for the buffers). One kernel call a batch."""
    done = np.zeros(row_lo.shape[0], dtype=bool)
    turn_tokens(np.ascontiguousarray(token_spans, dtype=np.int32), np.ascontiguousarray(special, dtype=np.bool_),
                _int64(row_lo), _int64(row_hi), _int64(text_lengths), _int64(spans).reshape(-1, 3),
                _int64(span_offsets), _int64(pieces).reshape(-1, 3), _int64(piece_offsets), bool(closes), trained, done)
    return done


def _int64(values) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.int64)


@njit(cache=True, nogil=True, inline="always")
def _first_at_least(values, column, lo, hi, x):
    """The first index in ``[lo, hi)`` whose ``values[i, column] >= x`` (they rise there)."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if values[mid, column] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True, nogil=True, inline="always")
def _first_past(values, column, lo, hi, x):
    """The first index in ``[lo, hi)`` whose ``values[i, column] > x`` (they rise there)."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if values[mid, column] <= x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True, nogil=True)
def _row(token_spans, special, t0, t1, length, spans, s0, s1, pieces, p0, p1, closes, trained):
    for t in range(t0, t1):
        if token_spans[t, 0] < 0 or token_spans[t, 1] > length or token_spans[t, 1] < token_spans[t, 0]:
            return False
        if t > t0 and (token_spans[t, 0] < token_spans[t - 1, 0] or token_spans[t, 1] < token_spans[t - 1, 1]):
            return False
    for k in range(s0, s1):
        start, text_end, end = spans[k, 0], spans[k, 1], spans[k, 2]
        a = _first_at_least(token_spans, 0, t0, t1, start)
        if _first_past(token_spans, 1, t0, t1, start) < a:  # a token crosses the start
            return False
        b = _first_at_least(token_spans, 0, t0, t1, end)
        if a >= b:
            continue
        if special[a] and token_spans[a, 1] > end:
            return False
        lo = max(a, _first_past(token_spans, 1, t0, t1, text_end))
        hi = min(b, _first_past(token_spans, 1, t0, t1, end))
        last = -1
        for t in range(hi - 1, lo - 1, -1):
            if special[t]:
                last = t
                break
        if last < 0 or not closes:
            return False
        for t in range(a, last + 1):
            trained[t] = True
    for k in range(p0, p1):
        must = pieces[k, 2]
        if must < 0:
            continue
        lo = _first_at_least(token_spans, 0, t0, t1, pieces[k, 0])
        hi = max(lo, _first_past(token_spans, 1, t0, t1, pieces[k, 1]))
        for t in range(lo, hi):
            if token_spans[t, 1] > token_spans[t, 0] and trained[t] != (must == 1):
                return False
    return True


@njit(cache=True, nogil=True)
def turn_tokens(token_spans, special, row_lo, row_hi, text_lengths, spans, span_offsets, pieces, piece_offsets, closes,
                trained, done):
    for r in range(row_lo.shape[0]):
        t0, t1 = row_lo[r], row_hi[r]
        done[r] = _row(token_spans, special, t0, t1, text_lengths[r], spans, span_offsets[r], span_offsets[r + 1],
                       pieces, piece_offsets[r], piece_offsets[r + 1], closes, trained)
        if not done[r]:
            for t in range(t0, t1):
                trained[t] = False


def reference_turn_tokens(token_spans, special, row_lo, row_hi, text_lengths, spans, span_offsets, pieces,
                          piece_offsets, closes, trained, done):
    """``turn_tokens`` written plainly: each condition as a scan over the row's tokens, no bisection."""
    for r in range(len(row_lo)):
        t0, t1 = int(row_lo[r]), int(row_hi[r])
        done[r] = _reference_row(token_spans, special, t0, t1, int(text_lengths[r]),
                                 spans[int(span_offsets[r]): int(span_offsets[r + 1])],
                                 pieces[int(piece_offsets[r]): int(piece_offsets[r + 1])], closes, trained)
        if not done[r]:
            trained[t0:t1] = False


def _reference_row(token_spans, special, t0, t1, length, spans, pieces, closes, trained) -> bool:
    tokens = [(int(token_spans[t, 0]), int(token_spans[t, 1]), bool(special[t])) for t in range(t0, t1)]
    if any(s < 0 or e > length or e < s for s, e, _ in tokens):
        return False
    if any(tokens[i][0] < tokens[i - 1][0] or tokens[i][1] < tokens[i - 1][1] for i in range(1, len(tokens))):
        return False
    for start, text_end, end in spans.tolist():
        if any(s < start < e for s, e, _ in tokens):
            return False
        inside = [i for i, (s, _, _) in enumerate(tokens) if start <= s < end]
        if not inside:
            continue
        first = inside[0]
        if tokens[first][2] and tokens[first][1] > end:
            return False
        stops = [i for i in inside if tokens[i][2] and text_end < tokens[i][1] <= end]
        if not stops or not closes:
            return False
        trained[t0 + first: t0 + stops[-1] + 1] = True
    for start, end, must in pieces.tolist():
        if must < 0:
            continue
        if any(s >= start and e <= end and e > s and bool(trained[t0 + i]) != (must == 1)
               for i, (s, e, _) in enumerate(tokens)):
            return False
    return True
