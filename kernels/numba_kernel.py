"""The CPU engine: one pass per row, rows in parallel (``prange``), over flat Arrow buffers.

Equal to ``reference.py`` bit for bit. Each row is scanned once by the Aho-Corasick automaton of
the markers (``lossmask/engine/automaton.py``): one class lookup and one transition per token, whatever
the number of patterns, and the state tells which patterns end at that token.

The labels need more than matches at their ends: a response or instruction match closes at its
*start* and a mask_out match covers the tokens *before* its end. So labels are written with a lag.
A small ring of per-position events (open / close / masked) holds the positions not yet written;
after token ``i`` has moved the automaton to a state whose ``pending`` is ``d`` (the longest suffix of
the row so far that a match may still grow from), no match can still start at or before ``i - d``,
so those positions are final and are written, in order, keeping SPEC.md's "latest open / latest
close at or before ``i``" as two integers. At ``d == 0`` nothing is pending and the automaton is back
in its start state: the common case, where a tight loop takes over. It stops only at a token that
may be some match's *anchor* (one token per pattern, chosen where the data makes the fewest stops:
``Automaton``, ``CompiledMarkers.automaton_for``), and not even there when the token after it does
not go on with any pattern anchored on it (``<|im_start|>`` before ``system``; ``Automaton.pair``).
Up to a stop, the labels are all one decision, written by a loop that only classifies tokens; at a
stop the automaton takes over again, in the state it would be in, found by stepping it over at most
``max_anchor`` tokens.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from ..automaton import CLOSE_AT_START, CLOSE_NEXT, MASK, OPEN_NEXT
from ..outcomes import Outcome
from ..patterns import Markers

_TRAINED = np.int8(Outcome.TRAINED)
_NO_RESPONSE = np.int8(Outcome.NO_RESPONSE)
_EMPTY_RESPONSE = np.int8(Outcome.EMPTY_RESPONSE)
_EMPTY = np.int8(Outcome.EMPTY)

# Bits of the event ring: what happens at a position not yet written.
_EV_OPEN, _EV_CLOSE, _EV_MASKED = 1, 2, 4

# Rows per unit of parallel work: each unit allocates its own event ring once.
_ROWS_PER_BLOCK = 64
_CACHE_LINE = 64


@njit(cache=True, nogil=True, inline="always")
def _big_class(v, big_ids, big_classes):
    """Class of an id beyond the dense table: binary search in the sorted pattern ids there, else 0."""
    u = np.uint64(v)
    lo, hi = 0, big_ids.shape[0]
    while lo < hi:
        mid = (lo + hi) >> 1
        if big_ids[mid] < u:
            lo = mid + 1
        else:
            hi = mid
    if lo < big_ids.shape[0] and big_ids[lo] == u:
        return np.int64(big_classes[lo])
    return np.int64(0)


# The class of a token id, written out wherever it is needed (never as a call: see _label_block):
# ``classes[min(uint64(v), last)]``: every id at or past the table's last slot (negative ids too,
# as unsigned) reads that slot, branch-free. It holds 0, or the BIG class ``n_classes`` when some
# pattern ids lie beyond the table; those go to ``_big_class``.


@njit(cache=True, nogil=True)
def _label_block(r_lo, r_hi, values, starts, ends, auto, ring_size, last_turn_only, ignore_index, out, write_mask,
                 trained_tokens, outcomes, first_bad):
    """Label rows ``[r_lo, r_hi)`` in place, with their trained tokens, outcome codes and first negative index.

    One function body for the whole block (no call per row: numba keeps reference counts on the
    arrays handed to a call, which costs more than a short row). ``ring`` (a power of two, at least
    the longest pattern + 2 long) holds the events of positions not yet written; every row leaves it
    all zero for the next.

    Every array is indexed by an unsigned integer (``np.uint64(i)``): numba gives a signed index a
    negative-index wrap-around, which doubled the instructions of the tight loop and pushed its scalars
    out of registers (one thread on llama-3, ``bench_engine.py``: 0.40x the copy before, 0.56x after).
    """
    (n_quiet, n_classes, max_response_length, max_anchor, classes, big_ids, big_classes, goto, pending, outputs,
     close_offsets, close_lengths, mask_length, pair, back_goto, back_quiet, back_open_length) = auto
    last = np.uint64(classes.shape[0] - 1)  # unsigned: a negative id compares as huge and reads the last slot
    width = n_classes + 1
    # Padded by a cache line on each side: two threads' rings, allocated side by side, would otherwise
    # share a line, and every event written would bounce it between cores (falcon: 2 threads 1.5x one).
    ring = np.zeros(ring_size + 2 * _CACHE_LINE, np.uint8)[_CACHE_LINE:_CACHE_LINE + ring_size]
    ring_mask = np.uint64(ring_size - 1)
    for r in range(r_lo, r_hi):
        lo, hi = starts[r], ends[r]
        if hi <= lo:
            trained_tokens[r] = 0
            outcomes[r] = _EMPTY
            first_bad[r] = -1
            continue
        only_open = -2
        if last_turn_only:  # max(OPEN): scan back from the row's end with the reversed-response automaton
            only_open = -1
            state = 0
            i = hi - 1
            while i >= lo and not (only_open >= 0 and i + max_response_length <= only_open):
                # (once found, no match starting at or before i can open later)
                c = np.int64(classes[min(np.uint64(values[np.uint64(i)]), last)])
                if c == n_classes:
                    c = _big_class(values[np.uint64(i)], big_ids, big_classes)
                if state != 0 or back_quiet[np.uint64(c)] == 0:
                    state = back_goto[np.uint64(state * n_classes + c)]
                    length = back_open_length[np.uint64(state)]  # the longest response pattern starting at i
                    if length != 0 and i + length > only_open:
                        only_open = i + length
                i -= 1
        trained_value = 1 if write_mask else 0
        untrained_value = 0 if write_mask else ignore_index
        last_open = -1
        last_close = -1
        saw_response = False
        n_trained = 0
        sign = values[lo] & 0  # OR of every token: negative iff one of them is
        state = 0
        p = lo  # the first position whose label is not written yet
        i = lo
        while i < hi:
            v = values[np.uint64(i)]
            # The class, written out (see above): numba keeps a reference count on every array handed
            # to a call, even an inlined one, and that costs more than the lookup itself.
            c = np.int64(classes[min(np.uint64(v), last)])
            if c == n_classes:
                c = _big_class(v, big_ids, big_classes)
            if state == 0 and c < n_quiet:
                # Nothing pending (p == i), and no match has its anchor here: one decision up to the next
                # token that may be a match's anchor. Only a match that ended at i-1 can put events on i.
                slot = np.uint64(i) & ring_mask
                event = ring[slot]
                if event != 0:
                    ring[slot] = 0
                    if event & _EV_OPEN:
                        last_open = i
                    if event & _EV_CLOSE:
                        last_close = i
                trained = last_open > last_close and (not last_turn_only or last_open == only_open)
                sign |= v
                # Unsigned positions (see the docstring): the loop that labels most tokens.
                one = np.uint64(1)
                u_hi = np.uint64(hi)
                u = np.uint64(i) + one
                if trained and not write_mask:
                    out[i] = v
                    while u < u_hi:
                        w = values[u]
                        a = np.int64(classes[min(np.uint64(w), last)])
                        if a >= n_quiet:  # some pattern's anchor: is it one here? (Automaton.pair)
                            b = np.int64(classes[min(np.uint64(values[u + one]), last)]) if u + one < u_hi else np.int64(0)
                            if pair[np.uint64(a * width + b)] != 0:
                                break
                        out[u] = w
                        sign |= w
                        u += one
                else:
                    fill = trained_value if trained else untrained_value
                    out[i] = fill
                    while u < u_hi:
                        w = values[u]
                        a = np.int64(classes[min(np.uint64(w), last)])
                        if a >= n_quiet:  # some pattern's anchor: is it one here? (Automaton.pair)
                            b = np.int64(classes[min(np.uint64(values[u + one]), last)]) if u + one < u_hi else np.int64(0)
                            if pair[np.uint64(a * width + b)] != 0:
                                break
                        out[u] = fill
                        sign |= w
                        u += one
                j = np.int64(u)
                if j < hi:
                    # Stopped at u, which may be a match's anchor: every match not found yet starts at or
                    # after u - max_anchor (and after i, where nothing was pending), and none ends before
                    # u, so stepping the automaton over those tokens fires nothing. It gives the state at
                    # u - 1, whose pending tokens are labelled again by the automaton from u on.
                    q = max(i, j - max_anchor)
                    state = 0
                    while q < j:
                        c = np.int64(classes[min(np.uint64(values[np.uint64(q)]), last)])
                        if c == n_classes:
                            c = _big_class(values[np.uint64(q)], big_ids, big_classes)
                        state = goto[np.uint64(state * n_classes + c)]
                        q += 1
                    i = j
                    j -= pending[np.uint64(state)]
                    if j == i:
                        state = 0
                else:
                    i = j
                if trained:
                    n_trained += j - p
                p = j
                continue
            # One automaton step; record the events of every match that ends at i.
            sign |= v
            state = goto[np.uint64(state * n_classes + c)]
            bits = outputs[np.uint64(state)]
            if bits != 0:
                if bits & OPEN_NEXT:
                    ring[np.uint64(i + 1) & ring_mask] |= _EV_OPEN
                    saw_response = True
                if bits & CLOSE_NEXT:
                    ring[np.uint64(i + 1) & ring_mask] |= _EV_CLOSE
                if bits & CLOSE_AT_START:
                    for k in range(close_offsets[state], close_offsets[state + 1]):
                        ring[np.uint64(i + 1 - close_lengths[k]) & ring_mask] |= _EV_CLOSE
                if bits & MASK:
                    for q in range(i + 1 - mask_length[state], i + 1):
                        ring[np.uint64(q) & ring_mask] |= _EV_MASKED
            # Write the positions that no match can reach any more.
            held = pending[np.uint64(state)]
            final = i - held
            while p <= final:
                slot = np.uint64(p) & ring_mask
                event = ring[slot]
                ring[slot] = 0
                if event & _EV_OPEN:
                    last_open = p
                if event & _EV_CLOSE:
                    last_close = p
                trained = last_open > last_close and not (event & _EV_MASKED)
                trained = trained and (not last_turn_only or last_open == only_open)
                if trained:
                    out[np.uint64(p)] = trained_value if write_mask else values[np.uint64(p)]
                    n_trained += 1
                else:
                    out[np.uint64(p)] = untrained_value
                p += 1
            if held == 0:  # nothing the row ends with can grow into a match: back to the start state
                state = 0
            i += 1
        while p < hi:  # the row's end settles whatever was pending
            slot = np.uint64(p) & ring_mask
            event = ring[slot]
            ring[slot] = 0
            if event & _EV_OPEN:
                last_open = p
            if event & _EV_CLOSE:
                last_close = p
            trained = last_open > last_close and not (event & _EV_MASKED)
            trained = trained and (not last_turn_only or last_open == only_open)
            if trained:
                out[np.uint64(p)] = trained_value if write_mask else values[np.uint64(p)]
                n_trained += 1
            else:
                out[np.uint64(p)] = untrained_value
            p += 1
        ring[np.uint64(hi) & ring_mask] = 0  # events one past the row (a response pattern that ends it)
        bad_at = -1
        if sign < 0:  # rare: find the first negative id for the error message
            for k in range(lo, hi):
                if values[k] < 0:
                    bad_at = k
                    break
        trained_tokens[r] = n_trained
        outcomes[r] = _TRAINED if n_trained else (_EMPTY_RESPONSE if saw_response else _NO_RESPONSE)
        first_bad[r] = bad_at


# Two drivers, one per schedule: waking the thread pool costs more than it saves on small batches
# (a collator's 16 rows), and far more on a loaded machine. They must be two Python functions: numba
# keys its on-disk cache by function, so one body compiled twice would load one schedule for both.
@njit(cache=True, parallel=True, nogil=True)
def _label_rows_parallel(values, starts, ends, auto, ring_size, last_turn_only, ignore_index, out, write_mask):
    n_rows = starts.shape[0]
    trained_tokens, outcomes, first_bad = np.zeros(n_rows, np.int64), np.zeros(n_rows, np.int8), np.full(n_rows, -1, np.int64)
    n_blocks = (n_rows + _ROWS_PER_BLOCK - 1) // _ROWS_PER_BLOCK
    for b in prange(n_blocks):
        _label_block(b * _ROWS_PER_BLOCK, min(n_rows, (b + 1) * _ROWS_PER_BLOCK), values, starts, ends, auto,
                     ring_size, last_turn_only, ignore_index, out, write_mask, trained_tokens, outcomes, first_bad)
    return trained_tokens, outcomes, first_bad


@njit(cache=True, nogil=True)
def _label_rows_serial(values, starts, ends, auto, ring_size, last_turn_only, ignore_index, out, write_mask):
    n_rows = starts.shape[0]
    trained_tokens, outcomes, first_bad = np.zeros(n_rows, np.int64), np.zeros(n_rows, np.int8), np.full(n_rows, -1, np.int64)
    _label_block(0, n_rows, values, starts, ends, auto, ring_size, last_turn_only, ignore_index, out, write_mask,
                 trained_tokens, outcomes, first_bad)
    return trained_tokens, outcomes, first_bad


PARALLEL_MIN_TOKENS = 1 << 18


def automaton_args(a) -> tuple[tuple, int]:
    """``(auto, ring_size)``: the ``Automaton`` as the drivers take it, and the size of the event ring."""
    auto = (a.n_quiet, a.n_classes, a.max_response_length, a.max_anchor) + a.kernel_args()
    return auto, 1 << (a.max_length + 1).bit_length()  # a power of two >= max_length + 2


def label_rows(values, starts, ends, markers: Markers, *, last_turn_only, ignore_index, out, write_mask):
    """Backend entry point (see ``lossmask.engine.kernels``)."""
    # anchored where these tokens make the engine stop least (CompiledMarkers.automaton_for)
    auto, ring_size = automaton_args(markers.compiled().automaton_for(values))
    parallel = values.shape[0] >= PARALLEL_MIN_TOKENS and numba.get_num_threads() > 1
    kernel = _label_rows_parallel if parallel else _label_rows_serial
    return kernel(
        values, starts, ends, auto, ring_size,
        bool(last_turn_only), out.dtype.type(ignore_index), out, bool(write_mask),
    )
