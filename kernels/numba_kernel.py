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
compared against the (at most four) anchor ids, a test with no table lookup written as LLVM vector
code (``_candidates``) that gives a bit per candidate; only the candidates are looked at one by one.

- ``_direct_block`` (the default): at a candidate, each pattern anchored on it is compared with the
  tokens around it, and a match's events are bits of its block; each block of 64 labels is written
  once, from a mask of its trained positions. It serves every call but ``last_turn_only`` and marker
  sets with more than four anchor ids.
- ``_label_block`` (the automaton and its event ring, above): those two cases.

``tests/test_automaton.py`` runs both against ``reference.py`` on the same cases.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import intrinsic

from ..automaton import (CLOSE_AT_START, CLOSE_NEXT, DIRECT_END as _D_END, DIRECT_MASK as _D_MASK,
                         DIRECT_RESPONSE as _D_RESPONSE, MASK, OPEN_NEXT)
from ..outcomes import Outcome
from ..patterns import Markers
from . import serial_here

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


def _candidates_codegen(dtype):
    """The body of ``_candidates``: its arguments are the values, ``at``, the ids, and last ``zero``."""
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        lanes = ir.VectorType(context.get_value_type(dtype), _BLOCK)
        tokens = builder.load(builder.bitcast(builder.gep(data, [args[1]]), lanes.as_pointer()), align=1)
        first = ir.Constant(ir.VectorType(ir.IntType(32), _BLOCK), [0] * _BLOCK)

        def splat(x):
            one = builder.insert_element(ir.Constant(lanes, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
            return builder.shuffle_vector(one, ir.Constant(lanes, ir.Undefined), first)

        hit = builder.icmp_unsigned("==", tokens, splat(args[2]))
        for x in args[3:-1]:
            hit = builder.or_(hit, builder.icmp_unsigned("==", tokens, splat(x)))
        if dtype.signed:
            hit = builder.or_(hit, builder.icmp_signed("<", tokens, splat(args[-1])))
        return builder.bitcast(hit, ir.IntType(_BLOCK))

    return codegen


@intrinsic
def _candidates(typingctx, values, at, a0, a1, a2, a3, zero):
    """A uint64 whose bit k says whether ``values[at + k]`` is ``a0``, ``a1``, ``a2`` or ``a3`` (or below
    ``zero``, for signed ids), for the _BLOCK (64) tokens from ``at``, which must all lie in ``values``.

    Written as LLVM vector code: one compare of 64 lanes per id, and the lanes' bits taken as they are (a
    ``kmov`` where AVX-512 has mask registers, a ``movmsk`` elsewhere). The same loop written in Python
    builds the bits lane by lane with 64-bit shifts and a final reduction: twice the instructions, on
    half as many lanes (``bench_engine.py``: the scan was 40% of the kernel's time on qwen3).
    """
    return types.uint64(values, at, a0, a1, a2, a3, zero), _candidates_codegen(values.dtype)


@intrinsic
def _candidates2(typingctx, values, at, a0, a1, zero):
    """``_candidates`` for two anchor ids, most templates' number: three compares a lane instead of five."""
    return types.uint64(values, at, a0, a1, zero), _candidates_codegen(values.dtype)


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
                        bits = _candidates(values, u, a0, a1, a2, a3, zero)
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
# tokens around it (``Automaton.group_*``). Every occurrence of every pattern is found, at its one
# anchor, so the labels are SPEC.md's, as the automaton's are.
#
# A match's events (SPEC.md's OPEN, CLOSE, and mask_out's cover) are bits: one uint64 per kind per
# block of _BLOCK positions, in a small ring of blocks. A block's labels are written once, behind the
# scan by as many blocks as a match may start before its anchor (max_anchor tokens: one block for real
# templates, none where every pattern is anchored on its first token). From the decision in force at
# the block's start and its event bits, a 64-bit mask of its trained positions is made with a few
# integer operations per event, and the block is written in one branch-free loop, the id or
# ``ignore_index`` by that mask. A block with no event (most of them) takes one decision, written by
# the cheapest loop. Nothing is sorted, and no write is split at an event.

# Kinds of event, each a uint64 of the ring per block.
_K_OPEN, _K_CLOSE, _K_COVER, _KINDS = 0, 1, 2, 4
# Groups of at most this many patterns sharing an anchor are compared pattern by pattern.
_DIRECT_GROUP = 4


@njit(cache=True, nogil=True, inline="always")
def _popcount(x):
    """Set bits of a uint64 (LLVM turns this form into one popcnt)."""
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return np.int64((x * np.uint64(0x0101010101010101)) >> np.uint64(56))


@njit(cache=True, nogil=True)
def _direct_block(r_lo, r_hi, values, starts, ends, auto, groups, prefilter, ignore_index, out, write_mask,
                  trained_tokens, outcomes, first_bad):
    """Label rows ``[r_lo, r_hi)`` by matching each pattern at its anchor (see above); as ``_label_block``
    without ``last_turn_only``."""
    (classes, big_ids, big_classes, n_classes, max_anchor, goto, outputs, close_offsets, close_lengths,
     mask_length) = auto
    (group_offsets, group_kinds, group_anchors, group_lengths, group_starts, group_ids, slot_groups, prefix_lengths,
     prefix_states) = groups
    last = np.uint64(classes.shape[0] - 1)
    a0, a1, a2, a3, zero = prefilter[0], prefilter[1], prefilter[2], prefilter[3], prefilter[4]
    two_ids = a2 == a0 and a3 == a0  # the padding of two anchor ids (prefilter_ids)
    one = np.uint64(1)
    nothing = np.uint64(0)
    full = ~nothing
    block = np.uint64(_BLOCK)
    n_values = np.uint64(values.shape[0])
    max_length = np.int64(0)
    for k in range(group_lengths.shape[0]):
        max_length = _max(max_length, group_lengths[k])
    # Per group, how far before and after its anchor its patterns reach: a large group's automaton steps
    # over that span only (qwen3's whitespace variants: 3 tokens, not max_anchor + max_length = 4).
    n_groups = group_offsets.shape[0] - 1
    reach_back = np.zeros(n_groups, np.int64)
    reach_ahead = np.zeros(n_groups, np.int64)
    for g in range(n_groups):
        for k in range(group_offsets[g], group_offsets[g + 1]):
            if group_lengths[k] >= 0:
                reach_back[g] = _max(reach_back[g], group_anchors[k])
                reach_ahead[g] = _max(reach_ahead[g], group_lengths[k] - group_anchors[k])
    # Blocks are written ``lag`` behind the scan: a match anchored in block b starts in block b - lag at
    # the earliest. The ring holds the blocks from the one being written to the furthest a match found now
    # reaches (t + max_length); padded by a cache line on each side so that two threads' rings share none.
    lag = (max_anchor + _BLOCK - 1) // _BLOCK
    n_ring = 4
    while n_ring < lag + (max_length >> 6) + 3:
        n_ring *= 2
    ring_mask = np.uint64(n_ring - 1)
    pad = _CACHE_LINE // 8
    ring = np.zeros(_KINDS * n_ring + 2 * pad, np.uint64)[pad:pad + _KINDS * n_ring]
    # A label is ``(id & keep) + base`` with one (keep, base) for a block of one decision; in a mixed block,
    # lane = -1 where trained, 0 elsewhere: ``(id & keep_copy & lane) + (delta & lane) + untrained``.
    untrained = np.int64(0 if write_mask else ignore_index)
    base_trained = np.int64(1 if write_mask else 0)
    keep_copy = np.int64(0 if write_mask else -1)
    delta = base_trained - untrained
    for r in range(r_lo, r_hi):
        lo, hi = np.int64(starts[r]), np.int64(ends[r])
        if hi <= lo:
            trained_tokens[r] = 0
            outcomes[r] = _EMPTY
            first_bad[r] = -1
            continue
        u_lo, u_hi = np.uint64(lo), np.uint64(hi)
        n_blocks = np.int64((u_hi - u_lo + block - one) >> np.uint64(6))
        state = nothing  # the decision in force after the blocks written: full = trained
        saw_response = False
        n_trained = np.int64(0)
        sign = values[lo] & 0
        for bi in range(n_blocks + lag):
            if bi < n_blocks:
                # Block bi's candidates: the tokens equal to an anchor id (or negative), one bit each.
                b = u_lo + np.uint64(bi) * block
                bits = nothing
                if b + block <= n_values:  # whole vectors, even past the row's end (those bits are dropped)
                    if two_ids:
                        bits = _candidates2(values, b, a0, a1, zero)
                    else:
                        bits = _candidates(values, b, a0, a1, a2, a3, zero)
                    if b + block > u_hi:
                        bits &= (one << (u_hi - b)) - one
                else:  # the values' last tokens
                    for k in range(u_hi - b):
                        w = values[b + k]
                        bits |= np.uint64((w == a0) | (w == a1) | (w == a2) | (w == a3) | (w < zero)) << k
                while bits != nothing:
                    t = np.int64(b + trailing_zeros(bits))
                    bits &= bits - one
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
                    if group_offsets[g + 1] - group_offsets[g] <= _DIRECT_GROUP:
                        # Each pattern of a small group compared where the anchor puts it.
                        for k in range(group_offsets[g], group_offsets[g + 1]):
                            length = group_lengths[k]
                            s = t - group_anchors[k]
                            if length < 0 or s < lo or s + length > hi:
                                continue
                            first = group_starts[k]
                            same = True
                            for m in range(length):  # no early exit: a pattern's length is the same every time
                                same &= values[np.uint64(s + m)] == group_ids[np.uint64(first + m)]
                            if not same:
                                continue
                            kind = group_kinds[k]
                            if kind == _D_MASK:  # covers [s, s + length)
                                x, x_end = np.uint64(s - lo), np.uint64(s + length - lo)
                                while x < x_end:
                                    stop = _min(x_end, (x | np.uint64(63)) + one)
                                    ring[(((x >> np.uint64(6)) & ring_mask) << np.uint64(2)) + np.uint64(_K_COVER)] |= (
                                        (full >> (block - (stop - x))) << (x & np.uint64(63)))
                                    x = stop
                                continue
                            if kind == _D_RESPONSE:  # opens after it
                                saw_response = True
                                if s + length < hi:
                                    x = np.uint64(s + length - lo)
                                    ring[(((x >> np.uint64(6)) & ring_mask) << np.uint64(2)) + np.uint64(_K_OPEN)] |= (
                                        one << (x & np.uint64(63)))
                            # a response or instruction closes at its start, an end after it
                            c = s + length if kind == _D_END else s
                            if c < hi:
                                x = np.uint64(c - lo)
                                ring[(((x >> np.uint64(6)) & ring_mask) << np.uint64(2)) + np.uint64(_K_CLOSE)] |= (
                                    one << (x & np.uint64(63)))
                    else:
                        # A large group (dozens of whitespace variants sharing their anchor): the automaton
                        # stepped over the tokens any of them can span: every match of the group anchored at
                        # t starts at or after t - reach_back[g] and ends before t + reach_ahead[g]. Others
                        # found on the way start there too (after t - max_anchor), so their blocks are not
                        # written yet, and finding them twice sets the same bits.
                        state_a = 0
                        q_from = _max(lo, t - reach_back[g])
                        common = prefix_lengths[g]
                        if common > 0:  # the tokens every pattern of the group begins with, compared directly
                            s = t - reach_back[g]
                            if s < lo or s + common > hi:
                                continue
                            first = group_starts[group_offsets[g]]
                            same = True
                            for m in range(common):
                                same &= values[np.uint64(s + m)] == group_ids[np.uint64(first + m)]
                            if not same:
                                continue
                            state_a = prefix_states[g]
                            q_from = s + common
                        for q in range(q_from, _min(hi, t + reach_ahead[g])):
                            c = np.int64(classes[_min(np.uint64(values[np.uint64(q)]), last)])
                            if c == n_classes:
                                c = _big_class(values[np.uint64(q)], big_ids, big_classes)
                            state_a = goto[np.uint64(state_a * n_classes + c)]
                            bits_out = outputs[np.uint64(state_a)]
                            if bits_out == 0:
                                continue
                            x = np.uint64(q + 1 - lo)
                            at = (((x >> np.uint64(6)) & ring_mask) << np.uint64(2))
                            if q + 1 < hi:
                                if bits_out & OPEN_NEXT:
                                    saw_response = True
                                    ring[at + np.uint64(_K_OPEN)] |= one << (x & np.uint64(63))
                                if bits_out & CLOSE_NEXT:
                                    ring[at + np.uint64(_K_CLOSE)] |= one << (x & np.uint64(63))
                            elif bits_out & OPEN_NEXT:
                                saw_response = True
                            if bits_out & CLOSE_AT_START:
                                for m in range(close_offsets[state_a], close_offsets[state_a + 1]):
                                    y = x - np.uint64(close_lengths[m])
                                    ring[(((y >> np.uint64(6)) & ring_mask) << np.uint64(2)) + np.uint64(_K_CLOSE)] |= (
                                        one << (y & np.uint64(63)))
                            if bits_out & MASK:
                                y = x - np.uint64(mask_length[state_a])
                                while y < x:
                                    stop = _min(x, (y | np.uint64(63)) + one)
                                    ring[(((y >> np.uint64(6)) & ring_mask) << np.uint64(2)) + np.uint64(_K_COVER)] |= (
                                        (full >> (block - (stop - y))) << (y & np.uint64(63)))
                                    y = stop
            # Block bi - lag is final: no match found from here on reaches it.
            wb = bi - lag
            if wb < 0:
                continue
            b = u_lo + np.uint64(wb) * block
            slot = (np.uint64(wb) & ring_mask) << np.uint64(2)
            opens, closes, cover = ring[slot + np.uint64(_K_OPEN)], ring[slot + np.uint64(_K_CLOSE)], ring[slot + np.uint64(_K_COVER)]
            trained = state
            if (opens | closes) != nothing:
                ring[slot + np.uint64(_K_OPEN)] = nothing
                ring[slot + np.uint64(_K_CLOSE)] = nothing
                # From each event up, in position order, the decision it sets: trained after an open, not after
                # a close, and not after an open and a close at one position (SPEC.md: open(i) > close(i)).
                sets = opens & ~closes
                events = opens | closes
                while events != nothing:
                    lowest = events & (nothing - events)
                    above = nothing - lowest  # that bit and every bit above it
                    to = nothing - np.uint64((sets & lowest) != nothing)
                    trained = (trained & ~above) | (above & to)
                    events &= events - one
                state = nothing - (trained >> np.uint64(63))
            if cover != nothing:
                ring[slot + np.uint64(_K_COVER)] = nothing
                trained &= ~cover
            if b + block <= u_hi:
                if trained == nothing or trained == full:  # one decision: the ids, or one value
                    keep = keep_copy if trained else np.int64(0)
                    base = base_trained if trained else untrained
                    for k in range(block):
                        out[b + k] = (np.int64(values[b + k]) & keep) + base
                    n_trained += _BLOCK if trained else 0
                else:
                    for k in range(block):
                        lane = np.int64(0) - np.int64((trained >> k) & one)
                        out[b + k] = (np.int64(values[b + k]) & (keep_copy & lane)) + (delta & lane) + untrained
                    n_trained += _popcount(trained)
            else:  # the row's last, shorter block
                n = u_hi - b
                trained &= (one << n) - one
                for k in range(n):
                    lane = np.int64(0) - np.int64((trained >> k) & one)
                    out[b + k] = (np.int64(values[b + k]) & (keep_copy & lane)) + (delta & lane) + untrained
                n_trained += _popcount(trained)
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


# The serial drivers are plain Python around one call of the compiled block: a compiled driver of their own
# was a second function to compile with the block inside it (LLVM optimised the block twice), 1.5 of the
# 5.4 CPU-s of a job's first run on a fresh install, to save three small allocations per batch.
def _direct_rows_serial(values, starts, ends, auto, groups, prefilter, ignore_index, out, write_mask):
    n_rows = starts.shape[0]
    trained_tokens, outcomes, first_bad = np.zeros(n_rows, np.int64), np.zeros(n_rows, np.int8), np.full(n_rows, -1, np.int64)
    _direct_block(0, n_rows, values, starts, ends, auto, groups, prefilter, ignore_index, out, write_mask,
                  trained_tokens, outcomes, first_bad)
    return trained_tokens, outcomes, first_bad


# Two drivers, one per schedule: waking the thread pool costs more than it saves on small batches
# (a collator's 16 rows), and far more on a loaded machine. They must be two Python functions: numba
# keys its on-disk cache by function, so one body compiled twice would load one schedule for both
# (the serial one is plain Python, see _direct_rows_serial).
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
    prefix_lengths, prefix_states = group_prefixes(automaton, lengths)
    return (automaton.group_offsets, automaton.group_kinds, automaton.group_anchors, lengths,
            automaton.group_starts, np.where(fits, ids, 0).astype(dtype), slot_groups, prefix_lengths, prefix_states)


def group_prefixes(automaton, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per group, the tokens all its patterns begin with, where they all start at one offset before the
    anchor, as ``(length, automaton state after them)``; length 0 where there is no such prefix, or where
    a pattern ends inside it (its match would be missed by starting the automaton after the prefix).

    A large group's patterns (Qwen's 31 ``<|im_start|>assistant`` + whitespace variants, OLMo-2's 14
    ``<|assistant|>`` variants) share most of their tokens: ``_direct_block`` compares those directly and
    steps the automaton over the rest only (Qwen3: one step instead of three)."""
    n_groups = automaton.group_offsets.shape[0] - 1
    prefix_lengths = np.zeros(n_groups, np.int64)
    prefix_states = np.zeros(n_groups, np.int64)
    for g in range(n_groups):
        members = [k for k in range(automaton.group_offsets[g], automaton.group_offsets[g + 1]) if lengths[k] >= 0]
        if not members or len({int(automaton.group_anchors[k]) for k in members}) != 1:
            continue
        patterns = [automaton.group_ids[automaton.group_starts[k]:automaton.group_starts[k] + lengths[k]] for k in members]
        common = 0
        while all(common < len(p) for p in patterns) and len({int(p[common]) for p in patterns}) == 1:
            common += 1
        state = 0
        for c in automaton.class_of(patterns[0][:common]):
            state = int(automaton.goto[state * automaton.n_classes + int(c)])
            if automaton.outputs[state]:  # a pattern ends inside the prefix: keep stepping from its start
                common = 0
                break
        prefix_lengths[g] = common
        prefix_states[g] = state if common else 0
    return prefix_lengths, prefix_states


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
    parallel = values.shape[0] >= PARALLEL_MIN_TOKENS and numba.get_num_threads() > 1 and not serial_here()
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
