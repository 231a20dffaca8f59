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

Two kernels share that plan. Both find the stops with a *block prefilter*: 64 tokens at a time are
compared against the (at most four) anchor ids, a test with no table lookup that the compiler turns
into vector compares; only a block that holds a candidate is looked at token by token.

- ``_direct_block`` (the default): at a candidate, each pattern anchored on it is compared with the
  tokens around it, and a match's events wait in a short sorted list; labels are written a stretch
  at a time between events. It serves every call but ``last_turn_only`` and marker sets with more
  than four anchor ids.
- ``_label_block`` (the automaton and its event ring, above): those two cases.

``tests/test_automaton.py`` runs both against ``reference.py`` on the same cases.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
from numba import njit, prange
from numba.cpython.unsafe.numbers import trailing_zeros

from ..automaton import (CLOSE_AT_START, CLOSE_NEXT, DIRECT_END as _D_END, DIRECT_INSTRUCTION as _D_INSTRUCTION,
                         DIRECT_RESPONSE as _D_RESPONSE, MASK, OPEN_NEXT)
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
# Tokens tested at once for a candidate stop, and how many anchor ids the test compares against.
_BLOCK = 64  # one bit each in a uint64
_PREFILTER = 4


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


@njit(cache=True, nogil=True)
def _first_negative(values, lo, hi):
    """Index of the first negative id in ``values[lo:hi]``, or -1: called only for a row whose ``sign`` (the
    OR of its ids) says it holds one."""
    for k in range(lo, hi):
        if values[k] < 0:
            return k
    return -1


# A row's results are stored by the kernels' own code, not by a helper taking the arrays: numba counts
# references on every array handed to a call, inlined or not, with atomic increments and decrements.
# Eight per row cost about 7% on one thread, and more on two, where the threads share those counters.

@njit(cache=True, nogil=True, inline="always")
def _max(a, b):
    """``max`` of two integers, inlined (the builtin is a call into another module, with a vzeroupper)."""
    return a if a > b else b


@njit(cache=True, nogil=True, inline="always")
def _min(a, b):
    return a if a < b else b


# The class of a token id, written out wherever it is needed (never as a call: see _label_block):
# ``classes[min(uint64(v), last)]``: every id at or past the table's last slot (negative ids too,
# as unsigned) reads that slot, branch-free. It holds 0, or the BIG class ``n_classes`` when some
# pattern ids lie beyond the table; those go to ``_big_class``.


@njit(cache=True, nogil=True)
def _label_block(r_lo, r_hi, values, starts, ends, auto, ring_size, last_turn_only, ignore_index, out, write_mask,
                 prefilter, use_prefilter, trained_tokens, outcomes, first_bad):
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
    # The block prefilter (``prefilter_ids``): the anchor ids and a zero, in the values' own dtype, so the
    # compares run on as many lanes as the ids fill. Unused when there are more anchor ids than it holds.
    a0, a1, a2, a3, zero = prefilter[0], prefilter[1], prefilter[2], prefilter[3], prefilter[4]
    block = np.uint64(_BLOCK)
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
                c = np.int64(classes[_min(np.uint64(values[np.uint64(i)]), last)])
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
            c = np.int64(classes[_min(np.uint64(v), last)])
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
                # Find u, the next token that is a match's anchor here (or the row's end). Unsigned
                # positions (see the docstring). _BLOCK tokens at a time are compared against the anchor
                # ids (and for a negative id): no table lookup, so the compares vectorise, and they give
                # a bit per candidate; only the candidates are classified, one per set bit.
                one = np.uint64(1)
                u_hi = np.uint64(hi)
                u = np.uint64(i) + one
                found = False
                while u < u_hi:
                    if use_prefilter and u + block <= u_hi:
                        bits = np.uint64(0)
                        for k in range(block):
                            w = values[u + k]
                            bits |= np.uint64((w == a0) | (w == a1) | (w == a2) | (w == a3) | (w < zero)) << k
                        at = u
                        u += block
                        while bits != 0:
                            t = at + trailing_zeros(bits)
                            bits &= bits - one
                            w = values[t]
                            sign |= w
                            a = np.int64(classes[_min(np.uint64(w), last)])
                            if a >= n_quiet:  # some pattern's anchor: is it one here? (Automaton.pair)
                                b = np.int64(classes[_min(np.uint64(values[t + one]), last)]) if t + one < u_hi else np.int64(0)
                                if pair[np.uint64(a * width + b)] != 0:
                                    u = t
                                    found = True
                                    break
                        if found:
                            break
                    else:  # the row's last tokens, or more anchor ids than the prefilter holds
                        w = values[u]
                        if not use_prefilter or (w == a0) | (w == a1) | (w == a2) | (w == a3) | (w < zero):
                            sign |= w
                            a = np.int64(classes[_min(np.uint64(w), last)])
                            if a >= n_quiet:
                                b = np.int64(classes[_min(np.uint64(values[u + one]), last)]) if u + one < u_hi else np.int64(0)
                                if pair[np.uint64(a * width + b)] != 0:
                                    break
                        u += one
                # Up to u, one decision: the labels are the ids, or one value.
                if trained and not write_mask:
                    for k in range(np.uint64(i), u):
                        out[k] = values[k]
                else:
                    fill = trained_value if trained else untrained_value
                    for k in range(np.uint64(i), u):
                        out[k] = fill
                j = np.int64(u)
                if j < hi:
                    # Stopped at u, which may be a match's anchor: every match not found yet starts at or
                    # after u - max_anchor (and after i, where nothing was pending), and none ends before
                    # u, so stepping the automaton over those tokens fires nothing. It gives the state at
                    # u - 1, whose pending tokens are labelled again by the automaton from u on.
                    q = _max(i, j - max_anchor)
                    state = 0
                    while q < j:
                        c = np.int64(classes[_min(np.uint64(values[np.uint64(q)]), last)])
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
        trained_tokens[r] = n_trained
        outcomes[r] = _TRAINED if n_trained else (_EMPTY_RESPONSE if saw_response else _NO_RESPONSE)
        first_bad[r] = _first_negative(values, lo, hi) if sign < 0 else -1


# -- Matching at the anchors ----------------------------------------------------------------------
#
# The automaton above steps through every token of a match, a chain of dependent table loads. At real
# templates' density (a stop every 40-60 tokens) those steps, not the scan, set the speed. So where the
# prefilter holds the anchor ids, each pattern is instead compared at its anchor, directly: a candidate
# found by the block scan is classified, and each pattern anchored on its class is checked against the
# tokens around it (``Automaton.group_*``). A match's events (SPEC.md's OPEN, CLOSE, and mask_out's
# cover) go into a short list sorted by position; the labels up to the earliest position a later match
# could still touch (``t - max_anchor`` for a candidate at ``t``) are final, and are written a stretch at
# a time, each stretch one decision. Every occurrence of every pattern is found, at its one anchor, so
# the labels are SPEC.md's, as the automaton's are.

_OPEN, _CLOSE, _COVER = 1, 2, 3
# What the scan of _direct_block found next.
_CANDIDATE, _FLUSH, _ROW_END = range(3)
# Groups of at most this many patterns sharing an anchor are compared pattern by pattern.
_DIRECT_GROUP = 4


@njit(cache=True, nogil=True, inline="always")
def _form(trained, keep_copy, keep_none, base_trained, untrained_value):
    """``(keep, base)`` of a stretch: its labels are ``(id & keep) + base`` (see ``_direct_block``)."""
    if trained:
        return keep_copy, base_trained
    return keep_none, untrained_value


@njit(cache=True, nogil=True)
def _direct_block(r_lo, r_hi, values, starts, ends, auto, groups, prefilter, ignore_index, out, write_mask,
                  trained_tokens, outcomes, first_bad):
    """Label rows ``[r_lo, r_hi)`` by matching each pattern at its anchor (see above); as ``_label_block``
    without ``last_turn_only``."""
    (classes, big_ids, big_classes, n_classes, max_anchor, goto, outputs, close_offsets, close_lengths,
     mask_length) = auto
    group_offsets, group_kinds, group_anchors, group_lengths, group_starts, group_ids, slot_groups = groups
    last = np.uint64(classes.shape[0] - 1)
    a0, a1, a2, a3, zero = prefilter[0], prefilter[1], prefilter[2], prefilter[3], prefilter[4]
    one = np.uint64(1)
    block = np.uint64(_BLOCK)
    max_length = np.int64(0)
    for k in range(group_lengths.shape[0]):
        max_length = _max(max_length, group_lengths[k])
    # The events of one candidate before they are sorted in: two per pattern of a small group, or what the
    # automaton fires over max_anchor + max_length tokens (an open, a close, a cover and the closes at starts).
    most_closes = 0
    for k in range(close_offsets.shape[0] - 1):
        most_closes = _max(most_closes, close_offsets[k + 1] - close_offsets[k])
    staged = _max(2 * _DIRECT_GROUP, (max_anchor + max_length + 1) * (3 + most_closes))
    st_pos = np.empty(staged, np.int64)
    st_kind = np.empty(staged, np.int8)
    st_end = np.empty(staged, np.int64)
    # Pending events, sorted by position, one of a kind per position. They are written at the next clean
    # block; before that, only when a candidate's events might not fit: a match found at t has its events
    # in [t - max_anchor, t + max_length], so writing those before t - max_anchor leaves at most three
    # per position of that window.
    capacity = 3 * (max_anchor + max_length + 2) + staged + 256
    ev_pos = np.empty(capacity, np.int64)
    ev_kind = np.empty(capacity, np.int8)
    ev_end = np.empty(capacity, np.int64)  # a cover's end (exclusive)
    # A label is ``(id & keep) + base``, written without a branch: a trained token keeps its id (or is
    # 1 in a mask), any other takes ignore_index (0 in a mask).
    untrained_value = np.int64(0 if write_mask else ignore_index)
    base_trained = np.int64(1 if write_mask else 0)
    keep_none = prefilter[4]  # zero, in the values' dtype
    keep_copy = keep_none if write_mask else ~keep_none
    for r in range(r_lo, r_hi):
        lo, hi = starts[r], ends[r]
        if hi <= lo:
            trained_tokens[r] = 0
            outcomes[r] = _EMPTY
            first_bad[r] = -1
            continue
        u_lo, u_hi = np.uint64(lo), np.uint64(hi)
        last_open = np.int64(-1)
        last_close = np.int64(-1)
        covered_to = np.int64(lo)  # positions below it are under some mask_out match
        saw_response = False
        n_trained = np.int64(0)
        n_ev = 0
        p = np.int64(lo)  # the first position not written yet
        sign = values[lo] & 0
        u = u_lo
        bits = np.uint64(0)
        at = u_lo
        dirty = False  # candidates of the block before u were looked at: write up to u before going on
        while True:
            # What comes next: a candidate t (a set bit of the current block, or of a later block that has
            # one); a block with none after something left pending (FLUSH: write up to its end); the row's end.
            mode = _CANDIDATE
            t = np.int64(hi)
            if bits == 0 and dirty:  # a block's candidates are done: write up to its end, as after a clean block
                dirty = False
                mode = _FLUSH
            elif bits == 0:
                while u + block <= u_hi:
                    for k in range(block):
                        w = values[u + k]
                        bits |= np.uint64((w == a0) | (w == a1) | (w == a2) | (w == a3) | (w < zero)) << k
                    if bits != 0:
                        at = u
                        u += block
                        dirty = True
                        break
                    if p == np.int64(u) - max_anchor and n_ev == 0 and covered_to <= p:
                        # Nothing pending, and the positions before this block (from p) already hold the
                        # decision: the block takes it too, and the positions up to its end less max_anchor
                        # (where a match anchored further on could still start) are final.
                        keep, base = _form(last_open > last_close, keep_copy, keep_none, base_trained, untrained_value)
                        if last_open > last_close:
                            n_trained += _BLOCK
                        for k in range(block):
                            out[u + k] = np.int64(values[u + k] & keep) + base
                        u += block
                        p += _BLOCK
                        continue
                    u += block
                    mode = _FLUSH
                    break
                if mode == _CANDIDATE:
                    if bits != 0:
                        t = np.int64(at + trailing_zeros(bits))
                        bits &= bits - one
                    else:  # the row's last tokens (fewer than a block), one at a time
                        while u < u_hi:
                            w = values[u]
                            if (w == a0) | (w == a1) | (w == a2) | (w == a3) | (w < zero):
                                break
                            u += one
                        if u >= u_hi:
                            mode = _ROW_END
                        else:
                            t = np.int64(u)
                            u += one
            else:
                t = np.int64(at + trailing_zeros(bits))
                bits &= bits - one
            if mode == _CANDIDATE:
                w = values[np.uint64(t)]
                sign |= w
                # Its group of patterns, by which prefilter id it is (selects, not branches: the anchors of
                # one template alternate); none for a negative id.
                g = slot_groups[3] if w == a3 else -1
                g = slot_groups[2] if w == a2 else g
                g = slot_groups[1] if w == a1 else g
                g = slot_groups[0] if w == a0 else g
                if g < 0:
                    continue
                # Events wait for the next clean block (or the row's end) to be written, in one stretch;
                # only a list about to overflow writes what it may now: positions before t - max_anchor.
                final = t - max_anchor if n_ev + staged > capacity else p
            elif mode == _FLUSH:  # no match can start before the block's end less max_anchor
                final = np.int64(u) - max_anchor
            else:
                final = np.int64(hi)
            # Write every position that no match found from here on can reach: those before final.
            k = 0
            while final > p or (k < n_ev and ev_pos[k] < final):
                x = ev_pos[k] if k < n_ev and ev_pos[k] < final else final
                if x > p:  # the stretch [p, x): one decision, but for a cover ending inside it
                    split = _min(_max(covered_to, p), x)
                    if split > p:
                        for q in range(np.uint64(p), np.uint64(split)):
                            out[q] = untrained_value
                    keep, base = _form(last_open > last_close, keep_copy, keep_none, base_trained, untrained_value)
                    if last_open > last_close:
                        n_trained += x - split
                    for q in range(np.uint64(split), np.uint64(x)):  # branch-free: the id, or one value
                        out[q] = np.int64(values[q] & keep) + base
                    p = x
                if x == final:
                    break
                kind = ev_kind[k]
                last_open = x if kind == _OPEN else last_open
                last_close = x if kind == _CLOSE else last_close
                if kind == _COVER:
                    covered_to = _max(covered_to, ev_end[k])
                k += 1
            if k:  # drop the events applied
                for m in range(k, n_ev):
                    ev_pos[m - k] = ev_pos[m]
                    ev_kind[m - k] = ev_kind[m]
                    ev_end[m - k] = ev_end[m]
                n_ev -= k
            if mode == _FLUSH:
                if n_ev == 0 and covered_to <= p:  # [p, u) takes the decision now in force, for the next block
                    keep, base = _form(last_open > last_close, keep_copy, keep_none, base_trained, untrained_value)
                    for q in range(np.uint64(p), u):
                        out[q] = np.int64(values[q] & keep) + base
                continue
            if mode == _ROW_END:
                break
            # The matches anchored here, as events staged in any order: a small group's patterns are each
            # compared where the anchor puts them; a large one's (dozens of whitespace variants sharing their
            # anchor) are found by stepping the automaton over the tokens any of them can span.
            n_stage = 0
            if group_offsets[g + 1] - group_offsets[g] <= _DIRECT_GROUP:
                for k in range(group_offsets[g], group_offsets[g + 1]):
                    length = group_lengths[k]
                    s = t - group_anchors[k]
                    if length < 0 or s < lo or s + length > hi:
                        continue
                    first = group_starts[k]
                    same = True
                    for m in range(length):  # no early exit: a pattern's length is the same every time
                        same &= values[np.uint64(s + m)] == group_ids[first + m]
                    if not same:
                        continue
                    kind = group_kinds[k]
                    if kind == _D_RESPONSE:  # close at its start, open after it
                        saw_response = True
                        st_pos[n_stage], st_kind[n_stage], st_end[n_stage] = s, _CLOSE, s
                        st_pos[n_stage + 1], st_kind[n_stage + 1], st_end[n_stage + 1] = s + length, _OPEN, s
                        n_stage += 2
                    else:
                        if kind == _D_INSTRUCTION:
                            st_pos[n_stage], st_kind[n_stage], st_end[n_stage] = s, _CLOSE, s
                        elif kind == _D_END:
                            st_pos[n_stage], st_kind[n_stage], st_end[n_stage] = s + length, _CLOSE, s
                        else:
                            st_pos[n_stage], st_kind[n_stage], st_end[n_stage] = s, _COVER, s + length
                        n_stage += 1
            else:
                # Every match anchored at t starts at or after t - max_anchor and ends before t + max_length.
                # Others found on the way start there too, so their events are still pending: staged twice,
                # kept once.
                state = 0
                for q in range(_max(lo, t - max_anchor), _min(hi, t + max_length)):
                    c = np.int64(classes[_min(np.uint64(values[np.uint64(q)]), last)])
                    if c == n_classes:
                        c = _big_class(values[np.uint64(q)], big_ids, big_classes)
                    state = goto[np.uint64(state * n_classes + c)]
                    bits_out = outputs[np.uint64(state)]
                    if bits_out == 0:
                        continue
                    if bits_out & OPEN_NEXT:
                        saw_response = True
                        st_pos[n_stage], st_kind[n_stage], st_end[n_stage] = q + 1, _OPEN, q + 1
                        n_stage += 1
                    if bits_out & CLOSE_NEXT:
                        st_pos[n_stage], st_kind[n_stage], st_end[n_stage] = q + 1, _CLOSE, q + 1
                        n_stage += 1
                    if bits_out & CLOSE_AT_START:
                        for m in range(close_offsets[state], close_offsets[state + 1]):
                            st_pos[n_stage], st_kind[n_stage], st_end[n_stage] = q + 1 - close_lengths[m], _CLOSE, q + 1
                            n_stage += 1
                    if bits_out & MASK:
                        st_pos[n_stage], st_kind[n_stage], st_end[n_stage] = q + 1 - mask_length[state], _COVER, q + 1
                        n_stage += 1
            # Into the pending events, in position order; one event of a kind per position (a cover keeps
            # its furthest end).
            for k in range(n_stage):
                pos, ev, end = st_pos[k], st_kind[k], st_end[k]
                if n_ev == 0 or ev_pos[n_ev - 1] < pos:  # the common case: after every pending event
                    ev_pos[n_ev], ev_kind[n_ev], ev_end[n_ev] = pos, ev, end
                    n_ev += 1
                    continue
                m = n_ev
                while m > 0 and ev_pos[m - 1] > pos:
                    m -= 1
                dup = m - 1
                while dup >= 0 and ev_pos[dup] == pos and ev_kind[dup] != ev:
                    dup -= 1
                if dup >= 0 and ev_pos[dup] == pos:
                    ev_end[dup] = _max(ev_end[dup], end)
                    continue
                for q in range(n_ev, m, -1):
                    ev_pos[q] = ev_pos[q - 1]
                    ev_kind[q] = ev_kind[q - 1]
                    ev_end[q] = ev_end[q - 1]
                ev_pos[m] = pos
                ev_kind[m] = ev
                ev_end[m] = end
                n_ev += 1
        trained_tokens[r] = n_trained
        outcomes[r] = _TRAINED if n_trained else (_EMPTY_RESPONSE if saw_response else _NO_RESPONSE)
        first_bad[r] = _first_negative(values, lo, hi) if sign < 0 else -1


@njit(cache=True, parallel=True, nogil=True)
def _direct_rows_parallel(values, starts, ends, auto, groups, prefilter, ignore_index, out, write_mask):
    n_rows = starts.shape[0]
    trained_tokens, outcomes, first_bad = np.zeros(n_rows, np.int64), np.zeros(n_rows, np.int8), np.full(n_rows, -1, np.int64)
    n_blocks = (n_rows + _ROWS_PER_BLOCK - 1) // _ROWS_PER_BLOCK
    for b in prange(n_blocks):
        _direct_block(b * _ROWS_PER_BLOCK, _min(n_rows, (b + 1) * _ROWS_PER_BLOCK), values, starts, ends, auto, groups,
                      prefilter, ignore_index, out, write_mask, trained_tokens, outcomes, first_bad)
    return trained_tokens, outcomes, first_bad


@njit(cache=True, nogil=True)
def _direct_rows_serial(values, starts, ends, auto, groups, prefilter, ignore_index, out, write_mask):
    n_rows = starts.shape[0]
    trained_tokens, outcomes, first_bad = np.zeros(n_rows, np.int64), np.zeros(n_rows, np.int8), np.full(n_rows, -1, np.int64)
    _direct_block(0, n_rows, values, starts, ends, auto, groups, prefilter, ignore_index, out, write_mask,
                  trained_tokens, outcomes, first_bad)
    return trained_tokens, outcomes, first_bad


# Two drivers, one per schedule: waking the thread pool costs more than it saves on small batches
# (a collator's 16 rows), and far more on a loaded machine. They must be two Python functions: numba
# keys its on-disk cache by function, so one body compiled twice would load one schedule for both.
@njit(cache=True, parallel=True, nogil=True)
def _label_rows_parallel(values, starts, ends, auto, ring_size, last_turn_only, ignore_index, out, write_mask,
                         prefilter, use_prefilter):
    n_rows = starts.shape[0]
    trained_tokens, outcomes, first_bad = np.zeros(n_rows, np.int64), np.zeros(n_rows, np.int8), np.full(n_rows, -1, np.int64)
    n_blocks = (n_rows + _ROWS_PER_BLOCK - 1) // _ROWS_PER_BLOCK
    for b in prange(n_blocks):
        _label_block(b * _ROWS_PER_BLOCK, _min(n_rows, (b + 1) * _ROWS_PER_BLOCK), values, starts, ends, auto,
                     ring_size, last_turn_only, ignore_index, out, write_mask, prefilter, use_prefilter,
                     trained_tokens, outcomes, first_bad)
    return trained_tokens, outcomes, first_bad


@njit(cache=True, nogil=True)
def _label_rows_serial(values, starts, ends, auto, ring_size, last_turn_only, ignore_index, out, write_mask,
                       prefilter, use_prefilter):
    n_rows = starts.shape[0]
    trained_tokens, outcomes, first_bad = np.zeros(n_rows, np.int64), np.zeros(n_rows, np.int8), np.full(n_rows, -1, np.int64)
    _label_block(0, n_rows, values, starts, ends, auto, ring_size, last_turn_only, ignore_index, out, write_mask,
                 prefilter, use_prefilter, trained_tokens, outcomes, first_bad)
    return trained_tokens, outcomes, first_bad


PARALLEL_MIN_TOKENS = 1 << 18


def automaton_args(a) -> tuple[tuple, int]:
    """``(auto, ring_size)``: the ``Automaton`` as the drivers take it, and the size of the event ring."""
    auto = (a.n_quiet, a.n_classes, a.max_response_length, a.max_anchor) + a.kernel_args()
    return auto, 1 << (a.max_length + 1).bit_length()  # a power of two >= max_length + 2


def prefilter_ids(anchor_ids: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, bool]:
    """``(ids, usable)``: the anchor ids as the block prefilter compares them, padded to ``_PREFILTER`` by
    repeats, then a zero, all in ``dtype``; ``usable`` is False when there are more than it holds.

    An anchor id that ``dtype`` cannot hold never occurs in the values, so it is left out; a prefilter
    that matches too much costs only speed (its candidates are classified by the table), never labels.
    """
    info = np.iinfo(dtype)
    fits = [int(t) for t in anchor_ids if info.min <= int(t) <= info.max]
    usable = len(fits) <= _PREFILTER
    fits = (fits or [0])[:_PREFILTER]
    return np.array(fits + [fits[0]] * (_PREFILTER - len(fits)) + [0], dtype=dtype), usable


def direct_args(a) -> tuple:
    """The ``Automaton`` as ``_direct_block`` takes it."""
    return (a.classes, a.big_ids, a.big_classes, a.n_classes, a.max_anchor, a.goto, a.outputs, a.close_offsets,
            a.close_lengths, a.mask_length)


def direct_groups(automaton, dtype: np.dtype, prefilter: np.ndarray) -> tuple:
    """``Automaton.group_*`` as ``_direct_block`` reads them, with the ids in ``dtype`` (a pattern holding an
    id that ``dtype`` cannot hold never matches, and gets the length -1), and last the group of each id of
    the ``prefilter`` (-1 for one that is no anchor)."""
    info = np.iinfo(dtype)
    ids = automaton.group_ids
    fits = (ids >= info.min) & (ids <= info.max)
    lengths = automaton.group_lengths.copy()
    for k in range(lengths.shape[0]):
        if not fits[automaton.group_starts[k]:automaton.group_starts[k] + lengths[k]].all():
            lengths[k] = -1
    slot_classes = automaton.class_of(prefilter[:_PREFILTER].astype(np.int64))
    slot_groups = np.where(slot_classes >= automaton.n_quiet, slot_classes - automaton.n_quiet, -1).astype(np.int64)
    return (automaton.group_offsets, automaton.group_kinds, automaton.group_anchors, lengths,
            automaton.group_starts, np.where(fits, ids, 0).astype(dtype), slot_groups)


@functools.lru_cache(maxsize=64)
def scan_inputs(automaton, dtype: np.dtype) -> tuple:
    """``(prefilter, usable, groups)`` of a marker set's automaton for values of ``dtype``, built once: on a
    collator's batch of 16 rows, building them took most of the call."""
    prefilter, usable = prefilter_ids(automaton.anchor_ids, dtype)
    return prefilter, usable, direct_groups(automaton, dtype, prefilter) if usable else None


def label_rows(values, starts, ends, markers: Markers, *, last_turn_only, ignore_index, out, write_mask):
    """Backend entry point (see ``lossmask.engine.kernels``)."""
    # anchored where these tokens make the engine stop least (CompiledMarkers.automaton_for)
    automaton = markers.compiled().automaton_for(values)
    prefilter, use_prefilter, groups = scan_inputs(automaton, values.dtype)
    parallel = values.shape[0] >= PARALLEL_MIN_TOKENS and numba.get_num_threads() > 1
    if use_prefilter and not last_turn_only:  # each pattern checked at its anchor (see _direct_block)
        kernel = _direct_rows_parallel if parallel else _direct_rows_serial
        return kernel(
            values, starts, ends, direct_args(automaton), groups, prefilter, out.dtype.type(ignore_index), out,
            bool(write_mask),
        )
    auto, ring_size = automaton_args(automaton)
    kernel = _label_rows_parallel if parallel else _label_rows_serial
    return kernel(
        values, starts, ends, auto, ring_size,
        bool(last_turn_only), out.dtype.type(ignore_index), out, bool(write_mask), prefilter, use_prefilter,
    )
