"""Turn spans made token labels for a batch of rows at once: NumPy passes over the batch, no loop over rows.

``turn_spans.trained_from_rendering`` makes each turn's span (characters) the tokens that train, and
``label_row_from_rendering`` holds them to the role invariant, one row and one span at a time. For the common case
this module does the same for every row of a batch together, on the batch's tokens laid end to end (each row's
characters shifted past the rows before it, so that one sorted array serves every row):

- no token crosses the span's start (so the turn trains from its first token at or after the start);
- the first of those tokens is not a control token that runs past the turn's end;
- the template closes its turns with a control token of its own (``closes_turns``), and the span holds one after
  the turn's text (its stop): the turn trains up to the last such.

A row where any of these does not hold, or whose token offsets do not rise, or whose labels break the role
invariant, is left to the row-by-row code (its ``False`` in the answer's ``done``), which gives its labels or its
reason exactly as before: this module never decides a case it does not cover.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def trained_by_spans(starts: np.ndarray, ends: np.ndarray, special: np.ndarray, row_tokens: np.ndarray,
                     row_chars: np.ndarray, spans: np.ndarray, span_rows: np.ndarray, pieces: np.ndarray,
                     piece_rows: np.ndarray, closes_turns: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(trained, done)`` for rows laid end to end: ``starts`` / ``ends`` each token's characters in its row's text,
    ``special`` a bool per token (a control token), ``row_tokens`` / ``row_chars`` each row's offsets into the tokens
    and into the characters (``len(rows) + 1`` each). ``spans``: ``(start, text end, end)`` of each turn
    (``turn_spans``), in its row's text, ``span_rows`` its row; ``pieces``: ``(start, end, must train)`` of each
    message's text, ``must train`` 1 where it must train whole, 0 where none of it may, -1 where it is not asked,
    ``piece_rows`` its row. ``trained``: a bool per token; ``done``: a bool per row, False for a row left to the
    row-by-row code."""
    n_rows = len(row_tokens) - 1
    n = int(row_tokens[-1]) if n_rows else 0
    trained = np.zeros(n, dtype=bool)
    done = np.ones(n_rows, dtype=bool)
    if not n_rows or not n:
        return trained, done
    lengths = np.diff(row_tokens)
    row_of = np.repeat(np.arange(n_rows), lengths)
    shift = np.asarray(row_chars[:-1], dtype=np.int64)[row_of]
    gs = np.asarray(starts, dtype=np.int64) + shift
    ge = np.asarray(ends, dtype=np.int64) + shift
    text_length = np.diff(np.asarray(row_chars, dtype=np.int64))
    # a row whose tokens' starts or ends fall, or leave its text, is not read here
    fall = np.zeros(n, dtype=bool)
    fall[1:] = (np.diff(gs) < 0) | (np.diff(ge) < 0)
    fall[row_tokens[:-1][lengths > 0]] = False  # (a row's first token follows the row before it)
    outside = (starts < 0) | (ends > text_length[row_of]) | (ends < starts)
    bad = np.zeros(n_rows, dtype=bool)
    bad[row_of[fall | outside]] = True
    if bad.any():  # its tokens laid flat at its start, so that the batch's stay sorted for the others' searches
        done &= ~bad
        flat_out = bad[row_of]
        gs[flat_out] = ge[flat_out] = shift[flat_out]

    span_row = np.asarray(span_rows, dtype=np.int64)
    if span_row.size:
        values = np.asarray(spans, dtype=np.int64).reshape(-1, 3)
        base = np.asarray(row_chars, dtype=np.int64)[span_row]
        s_at, content_end, e_at = values[:, 0] + base, values[:, 1] + base, values[:, 2] + base
        t0, t1 = row_tokens[span_row], row_tokens[span_row + 1]
        a = np.clip(np.searchsorted(gs, s_at, "left"), t0, t1)  # first token starting at or after the start
        b = np.clip(np.searchsorted(gs, e_at, "left"), t0, t1)  # first token starting at or after the end
        crossed = np.clip(np.searchsorted(ge, s_at, "right"), t0, t1) < a  # a token starts before the start, ends past it
        past_end = np.clip(np.searchsorted(ge, e_at, "right"), t0, t1)  # from here tokens end past the end
        past_text = np.clip(np.searchsorted(ge, content_end, "right"), t0, t1)  # ... past the turn's text
        some = a < b
        a_in = np.minimum(a, n - 1)
        first_out = some & special[a_in] & (ge[a_in] > e_at)
        # the turn's stops: control tokens starting in the span, ending past its text and not past its end
        lo, hi = np.maximum(a, past_text), np.minimum(b, past_end)
        prev_special = np.maximum.accumulate(np.where(special, np.arange(n), -1))
        last = np.where(hi > lo, prev_special[np.maximum(hi - 1, 0)], -1)
        stopped = (hi > lo) & (last >= lo)
        unread = some & (crossed | first_out | ~stopped | (not closes_turns))
        unread |= ~some & crossed
        done[span_row[unread]] = False
        ok = some & ~unread & done[span_row]
        delta = np.zeros(n + 1, dtype=np.int64)
        np.add.at(delta, a[ok], 1)
        np.add.at(delta, last[ok] + 1, -1)
        trained = np.cumsum(delta[:-1]) > 0

    # the role invariant: each message's tokens (those inside its text, not empty) all train or none do
    piece_row = np.asarray(piece_rows, dtype=np.int64)
    if piece_row.size:
        flat = np.asarray(pieces, dtype=np.int64).reshape(-1, 3)
        bounds, must = flat[:, :2], flat[:, 2]
        base = np.asarray(row_chars, dtype=np.int64)[piece_row]
        t0, t1 = row_tokens[piece_row], row_tokens[piece_row + 1]
        lo = np.clip(np.searchsorted(gs, bounds[:, 0] + base, "left"), t0, t1)
        hi = np.maximum(lo, np.clip(np.searchsorted(ge, bounds[:, 1] + base, "right"), t0, t1))
        filled = ge > gs
        count = np.concatenate([[0], np.cumsum(filled)])
        count_trained = np.concatenate([[0], np.cumsum(filled & trained)])
        tokens, trains = count[hi] - count[lo], count_trained[hi] - count_trained[lo]
        broken = ((must == 1) & (trains != tokens)) | ((must == 0) & (trains > 0))
        done[piece_row[broken]] = False
    return trained, done
