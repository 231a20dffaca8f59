"""The CPU engine: one pass per row, rows in parallel (``prange``), over flat Arrow buffers.

Equal to ``reference.py`` bit for bit. The scan keeps three positions per row instead of the sets
of SPEC.md: the latest open, the latest close and the end of the latest mask_out match. At token
``i`` the events that land on ``i`` are exactly

- a response or instruction pattern that *starts* at ``i`` (close at ``i``), and a mask_out pattern
  that starts at ``i`` (covers ``[i, i+len)``): checked forwards from ``t[i]``;
- a response pattern that *ends* at ``i-1`` (open at ``i``) and an end pattern that ends at ``i-1``
  (close at ``i``): checked backwards from ``t[i-1]``.

So one forward scan sees every event in order. A per-token-id flag table (``flags``) keeps the
pattern loops off the common path: most tokens neither start nor end any pattern, and between two
flagged tokens the label is either every token or ``ignore_index``, written by a tight loop.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..markers import END, ENDS_PATTERN, INSTRUCTION, MASK_OUT, RESPONSE, STARTS_PATTERN, Markers
from ..outcomes import Outcome

_TRAINED = np.int8(Outcome.TRAINED)
_NO_RESPONSE = np.int8(Outcome.NO_RESPONSE)
_EMPTY_RESPONSE = np.int8(Outcome.EMPTY_RESPONSE)
_EMPTY = np.int8(Outcome.EMPTY)


@njit(cache=True, nogil=True, inline="always")
def _matches(values, at, lo, hi, tokens, p_lo, p_hi):
    """Does the pattern ``tokens[p_lo:p_hi]`` occur at ``values[at:]`` within the row ``[lo, hi)``?"""
    if at < lo or at + (p_hi - p_lo) > hi:
        return False
    for k in range(p_hi - p_lo):
        if values[at + k] != tokens[p_lo + k]:
            return False
    return True


@njit(cache=True, nogil=True)
def _last_open(values, lo, hi, tokens, offsets, kinds, flags):
    """max(OPEN) for the row, scanning backwards from its end; -1 when no response pattern occurs."""
    for i in range(hi, lo, -1):  # an open at i comes from a response pattern ending at i-1
        if not (_flag(values[i - 1], flags) & ENDS_PATTERN):
            continue
        for k in range(kinds.shape[0]):
            if kinds[k] == RESPONSE:
                length = offsets[k + 1] - offsets[k]
                if _matches(values, i - length, lo, hi, tokens, offsets[k], offsets[k + 1]):
                    return i
    return -1


@njit(cache=True, nogil=True, inline="always")
def _flag(v, flags):
    """The flag bits of token ``v``; ids outside the table start and end nothing."""
    if v < 0 or v >= flags.shape[0]:
        return 0
    return flags[v]


@njit(cache=True, nogil=True)
def _label_row(values, lo, hi, tokens, offsets, kinds, flags, last_turn_only, ignore_index, out, write_mask):
    """Label one row in place; return (trained tokens, outcome code, first negative index or -1).

    The state (trained or not) can only change on a token that starts or ends a pattern, or where a
    mask_out match ends. So the row is walked as: settle the events at ``i``, then write the run of
    tokens up to the next such place with one tight loop that only looks at ``flags``.
    """
    if hi <= lo:
        return 0, _EMPTY, -1
    n_patterns = kinds.shape[0]
    n_flags = np.uint64(flags.shape[0])  # unsigned: a negative id compares as huge and skips the lookup
    only_open = _last_open(values, lo, hi, tokens, offsets, kinds, flags) if last_turn_only else -2
    trained_value = 1 if write_mask else 0
    untrained_value = 0 if write_mask else ignore_index
    last_open = -1
    last_close = -1
    masked_until = -1
    saw_response = False
    n_trained = 0
    sign = values[lo] & 0  # OR of the tokens written by the fast loops: negative iff one of them was
    i = lo
    while i <= hi:  # i == hi only settles a response pattern that ends the row
        # Events at i from patterns that end at i-1 (checked backwards) ...
        if i > lo and _flag(values[i - 1], flags) & ENDS_PATTERN:
            previous = values[i - 1]
            for k in range(n_patterns):  # last token first: the cheapest test rules out most patterns
                if tokens[offsets[k + 1] - 1] == previous and (kinds[k] == RESPONSE or kinds[k] == END):
                    if _matches(values, i - (offsets[k + 1] - offsets[k]), lo, hi, tokens, offsets[k], offsets[k + 1]):
                        if kinds[k] == RESPONSE:
                            last_open = i
                            saw_response = True
                        else:
                            last_close = i
        if i == hi:
            break
        # ... and from patterns that start at i (checked forwards).
        v = values[i]
        sign |= v
        flag = _flag(v, flags)
        if flag & STARTS_PATTERN:
            for k in range(n_patterns):
                if tokens[offsets[k]] == v and kinds[k] != END and _matches(values, i, lo, hi, tokens, offsets[k], offsets[k + 1]):
                    if kinds[k] == MASK_OUT:
                        masked_until = max(masked_until, i + offsets[k + 1] - offsets[k])
                    else:
                        last_close = i
        trained = last_open > last_close and i >= masked_until
        if last_turn_only:
            trained = trained and last_open == only_open
        # The run: from i to the next token with a flag, the end of the mask_out match, or i+1 when
        # token i itself ends a pattern (its event lands on i+1).
        run_end = hi
        if i < masked_until < hi:
            run_end = masked_until
        if flag & ENDS_PATTERN:
            run_end = i + 1
        j = i + 1
        if trained and not write_mask:
            out[i] = v
            while j < run_end:
                w = values[j]
                if np.uint64(w) < n_flags and flags[w] != 0:
                    break
                out[j] = w
                sign |= w
                j += 1
        else:
            fill = trained_value if trained else untrained_value
            out[i] = fill
            while j < run_end:
                w = values[j]
                if np.uint64(w) < n_flags and flags[w] != 0:
                    break
                out[j] = fill
                sign |= w
                j += 1
        if trained:
            n_trained += j - i
        i = j
    first_bad = -1
    if sign < 0:  # rare: find the first negative id for the error message
        for k in range(lo, hi):
            if values[k] < 0:
                first_bad = k
                break
    if n_trained:
        return n_trained, _TRAINED, first_bad
    return 0, (_EMPTY_RESPONSE if saw_response else _NO_RESPONSE), first_bad


@njit(cache=True, nogil=True, inline="always")
def _label_into(r, values, starts, ends, tokens, offsets, kinds, flags, last_turn_only, ignore_index, out, write_mask,
                trained_tokens, outcomes, first_bad):
    n, code, bad = _label_row(
        values, starts[r], ends[r], tokens, offsets, kinds, flags, last_turn_only, ignore_index, out, write_mask
    )
    trained_tokens[r] = n
    outcomes[r] = code
    first_bad[r] = bad


# Two drivers, one per schedule: waking the thread pool costs more than it saves on small batches
# (a collator's 16 rows), and far more on a loaded machine. They must be two Python functions: numba
# keys its on-disk cache by function, so one body compiled twice would load one schedule for both.
@njit(cache=True, parallel=True, nogil=True)
def _label_rows_parallel(values, starts, ends, tokens, offsets, kinds, flags, last_turn_only, ignore_index, out, write_mask):
    n_rows = starts.shape[0]
    trained_tokens, outcomes, first_bad = np.zeros(n_rows, np.int64), np.zeros(n_rows, np.int8), np.full(n_rows, -1, np.int64)
    for r in prange(n_rows):
        _label_into(r, values, starts, ends, tokens, offsets, kinds, flags, last_turn_only, ignore_index, out, write_mask,
                    trained_tokens, outcomes, first_bad)
    return trained_tokens, outcomes, first_bad


@njit(cache=True, nogil=True)
def _label_rows_serial(values, starts, ends, tokens, offsets, kinds, flags, last_turn_only, ignore_index, out, write_mask):
    n_rows = starts.shape[0]
    trained_tokens, outcomes, first_bad = np.zeros(n_rows, np.int64), np.zeros(n_rows, np.int8), np.full(n_rows, -1, np.int64)
    for r in range(n_rows):
        _label_into(r, values, starts, ends, tokens, offsets, kinds, flags, last_turn_only, ignore_index, out, write_mask,
                    trained_tokens, outcomes, first_bad)
    return trained_tokens, outcomes, first_bad


PARALLEL_MIN_TOKENS = 1 << 18


def label_rows(values, starts, ends, markers: Markers, *, last_turn_only, ignore_index, out, write_mask):
    """Backend entry point (see ``lossmask.kernels``)."""
    c = markers.compiled()
    kernel = _label_rows_parallel if values.shape[0] >= PARALLEL_MIN_TOKENS else _label_rows_serial
    return kernel(
        values, starts, ends, c.tokens, c.offsets, c.kinds, c.flags,
        bool(last_turn_only), out.dtype.type(ignore_index), out, bool(write_mask),
    )
