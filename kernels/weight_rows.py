"""The per-token passes of the weights (``lossmask.engine.weights``) that every weighed batch makes, one pass each.

Not a labelling backend (no ``label_rows``): ``engine/weights.py`` calls them on flat buffers, rows back to back
(``row_starts``, ``lengths``): ``weigh_batch``, the three steps below in one call, or each step on its own where the
stop-token policy's NumPy passes go between them.

- ``start_weights``: from the marker labels, each token's weight (its row's ``uniform`` weight where the label is not
  ``ignore_index``, else 0) and role code (1, the assistant, where it trains; else 0).
- ``finish_weights``: after the exact rows and the stop-token policy have had their say, the prompt weight for every
  token no source claimed (role 0) in rows where something trains, 0 where ``never`` says so (inside an image), then
  the labels (the id where the weight is > 0) and the totals: trained tokens and weight mass per row and per role
  code, whether any token's training changed from the marker labels', and whether a weight other than 0 or 1 occurs.

- ``weigh_exact``: between the two, the rows whose weights speak about characters (turns that differ, other roles'
  text, spans, parts, reasoning): runs tied to their messages, leads and segments, one row at a time.

``reference_start`` and ``reference_finish`` say the same in NumPy, as ``engine/weights._weigh_exact_numpy`` does for
``weigh_exact`` and ``engine/weights._weigh_tokens_numpy`` for the whole; ``tests/test_weights.py`` holds each pair
equal.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_ASSISTANT, _PROMPT = 1, 2  # role codes (engine/weights.ROLE_NAMES)


# Each row is taken as slices (``labels[lo:hi]``) and walked from 0: numba then knows the indices are not negative and
# leaves out the wrap-around of a negative index, and LLVM turns the loops into vector code. Indexed from the row's
# start instead, the same loops ran 3-5 times slower (2.3 M tokens: start 5 ms against 1, finish 14 against 3-6).


@njit(cache=True, nogil=True, inline="always")
def _start_row(labels, ignore_index, w, weights, role):
    """One row's weights and role codes from its marker labels (slices of the row)."""
    for k in range(labels.shape[0]):
        trained = labels[k] != ignore_index
        weights[k] = w if trained else np.float32(0)
        role[k] = _ASSISTANT if trained else 0


@njit(cache=True, nogil=True)
def start_weights(labels, ignore_index, uniform, row_starts, lengths):
    n = labels.shape[0]
    weights = np.empty(n, np.float32)
    role = np.empty(n, np.int16)
    for r in range(row_starts.shape[0]):
        lo, hi = row_starts[r], row_starts[r] + lengths[r]
        _start_row(labels[lo:hi], ignore_index, uniform[r], weights[lo:hi], role[lo:hi])
    return weights, role


@njit(cache=True, nogil=True, fastmath={"reassoc", "nsz"})
def _finish_stretch(weights, labels, ids, out, never, masked, fill, fill_weight, ignore_index):
    """One stretch of tokens of one role code: the prompt weight where ``fill``, 0 where ``never``, the labels; its
    trained tokens, weight mass, and whether its training changed or a weight other than 0 or 1 occurs. (Reordering
    the sum lets it run as vector code; the weights are >= 0, so only the last bits of the mass can move.)"""
    tokens = 0
    mass = 0.0
    changed = False
    odd = False
    for k in range(weights.shape[0]):
        w = fill_weight if fill else weights[k]
        if masked:
            w = np.float32(0) if never[k] else w
        weights[k] = w
        trained = w > 0
        out[k] = ids[k] if trained else ignore_index
        changed |= trained != (labels[k] != ignore_index)
        odd |= (w != 0) & (w != 1)
        tokens += trained
        mass += w
    return tokens, mass, changed, odd


@njit(cache=True, nogil=True)
def _finish_row(weights, role, labels, ids, out, never, masked, prompt_weight, ignore_index, role_tokens, role_mass):
    """One row's last step (slices of the row): the prompt weight, ``never``, the labels; adds its trained tokens and
    mass per role code to ``role_tokens``/``role_mass``. Returns its trained tokens, its mass, whether its training
    changed from the marker labels' and whether a weight other than 0 or 1 occurs."""
    fill = False
    if prompt_weight != 0:
        for k in range(weights.shape[0]):
            if weights[k] > 0:
                fill = True
                break
    tokens = 0
    mass = 0.0
    changed = False
    odd = False
    k = 0
    while k < role.shape[0]:  # stretch by stretch of one role code: its totals go to that code
        code = role[k]
        e = k + 1
        while e < role.shape[0] and role[e] == code:
            e += 1
        free = fill and code == 0  # no source claimed these: the prompt weight
        if free:
            code = _PROMPT
            role[k:e] = _PROMPT
        t, m, c, o = _finish_stretch(weights[k:e], labels[k:e], ids[k:e], out[k:e], never[k:e] if masked else never,
                                     masked, free, prompt_weight, ignore_index)
        changed |= c
        odd |= o
        tokens += t
        mass += m
        role_tokens[code] += t
        role_mass[code] += m
        k = e
    return tokens, mass, changed, odd


@njit(cache=True, nogil=True)
def _totals(n_rows, n_roles):
    """Trained tokens and weight mass per row and per role code, at 0."""
    return (np.zeros(n_rows, np.int64), np.zeros(n_rows, np.float64), np.zeros(n_roles, np.int64),
            np.zeros(n_roles, np.float64))


@njit(cache=True, nogil=True)
def finish_weights(weights, role, labels, ignore_index, ids, row_starts, lengths, prompt_weight, never, n_roles, out):
    n_rows = row_starts.shape[0]
    row_tokens, row_mass, role_tokens, role_mass = _totals(n_rows, n_roles)
    changed = False
    odd = False
    masked = never.shape[0] != 0
    for r in range(n_rows):
        lo, hi = row_starts[r], row_starts[r] + lengths[r]
        t, m, c, o = _finish_row(weights[lo:hi], role[lo:hi], labels[lo:hi], ids[lo:hi], out[lo:hi],
                                 never[lo:hi] if masked else never, masked, prompt_weight, ignore_index, role_tokens,
                                 role_mass)
        row_tokens[r], row_mass[r] = t, m
        changed |= c
        odd |= o
    return row_tokens, row_mass, role_tokens, role_mass, changed, odd


def reference_start(labels, ignore_index, uniform, row_starts, lengths):
    trained = labels != ignore_index
    weights = (trained * np.repeat(uniform, lengths)).astype(np.float32)
    return weights, trained.astype(np.int16) * _ASSISTANT


def reference_finish(weights, role, labels, ignore_index, ids, row_starts, lengths, prompt_weight, never, n_roles, out):
    row_of = np.repeat(np.arange(lengths.shape[0]), lengths)
    if prompt_weight != 0:
        busy = np.bincount(row_of[weights > 0], minlength=lengths.shape[0]) > 0
        free = (role == 0) & busy[row_of]
        weights[free] = prompt_weight
        role[free] = _PROMPT
    if never.shape[0]:
        weights[never] = 0
    trained = weights > 0
    out[:] = np.where(trained, ids, ignore_index)
    mass = np.where(trained, weights, 0).astype(np.float64)
    return (np.bincount(row_of[trained], minlength=lengths.shape[0]),
            np.bincount(row_of, weights=mass, minlength=lengths.shape[0]),
            np.bincount(role[trained].astype(np.int64), minlength=n_roles),
            np.bincount(role.astype(np.int64), weights=mass, minlength=n_roles),
            bool((trained != (labels != ignore_index)).any()),
            bool(((weights != 0) & (weights != 1)).any()))


@njit(cache=True, nogil=True, inline="always")
def _first_end_after(ends, lo, hi, x):
    """The first index in ``[lo, hi)`` whose end is > ``x`` (``ends`` sorted there), or ``hi``."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if ends[mid] <= x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True, nogil=True, inline="always")
def _starts_before(starts, lo, hi, x):
    """How many indices in ``[lo, hi)`` start before ``x`` (``starts`` sorted there)."""
    first = lo
    while lo < hi:
        mid = (lo + hi) >> 1
        if starts[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo - first


# A segment's tokens, walked as slices from 0 (as the rows above are) and written without a branch: a token takes
# the segment's weight where it qualifies, else keeps its own. On 4,000 chats under roles_to_train (other roles'
# text, about a third of the tokens), timed interleaved with the loop indexed in the row: 27.9 ms against 29.0, and
# 31.3 against 33.3. Most of what exact rows add is reading the tokens' characters (8 bytes a token) from memory.

@njit(cache=True, nogil=True, inline="always")
def _other_text(tr, cs, ce, w, role, g_s, g_e, g_w, code):
    """Text of another role's message that trains: its tokens wholly inside, outside the runs, take its weight and
    its role's code."""
    for t in range(tr.shape[0]):
        s, e = cs[t], ce[t]
        take = (not tr[t]) & (s >= g_s) & (e <= g_e) & (e > s)
        w[t] = g_w if take else w[t]
        role[t] = code if take else role[t]


@njit(cache=True, nogil=True, inline="always")
def _own_text(tr, msg, cs, ce, w, g_s, g_e, g_w, g_m, straddling):
    """A segment of an assistant message's text: first (``straddling`` False) its tokens of the message's turn wholly
    inside take its weight; then (True) those that straddle an edge keep the lower of the two."""
    for t in range(tr.shape[0]):
        s, e = cs[t], ce[t]
        own = tr[t] & (msg[t] == g_m)
        whole = (s >= g_s) & (e <= g_e) & (e > s)
        if straddling:
            w[t] = min(w[t], g_w) if own & (not whole) else w[t]
        else:
            w[t] = g_w if own & whole else w[t]


@njit(cache=True, nogil=True)
def _exact_row(k, c0, tr, row_w, row_role, cs, ce, msg_off, msg_weight, msg_assistant, msg_code, lead_at, lead_w,
               piece_off, piece_s, piece_e, piece_m, seg_off, seg_s, seg_e, seg_w, seg_m, seg_a, tok_msg, run_s, run_e,
               run_m):
    """Steps 2 and 3 on exact row ``k`` (``tr``, ``row_w``, ``row_role``: its runs, weights and role codes; its
    tokens' characters ``cs/ce`` from ``c0``), in place. ``tok_msg`` and ``run_*``: scratch, as long as the row."""
    n, m0 = tr.shape[0], msg_off[k]
    q0, q1 = piece_off[k], piece_off[k + 1]
    row_cs, row_ce = cs[c0:c0 + n], ce[c0:c0 + n]
    msg = tok_msg[:n]
    msg[:] = -1
    # runs of trained tokens, each tied to the first piece ending after it starts (if that piece starts before
    # the run ends and is an assistant's)
    n_runs = 0
    t = 0
    while t < n:
        if not tr[t]:
            t += 1
            continue
        run_s[n_runs] = t
        while t < n and tr[t]:
            t += 1
        run_e[n_runs] = t
        q = _first_end_after(piece_e, q0, q1, row_cs[run_s[n_runs]])
        m = -1
        if q < q1 and piece_s[q] < row_ce[t - 1] and msg_assistant[m0 + piece_m[q]]:
            m = piece_m[q]
        run_m[n_runs] = m
        n_runs += 1
    # runs of one message with no message text between them are one turn (the tokens between train); each takes
    # its message's weight, and its tokens before the answer the reasoning lead's
    i = 0
    while i < n_runs:
        m = run_m[i]
        j = i
        while j + 1 < n_runs and m >= 0 and run_m[j + 1] == m and \
                _starts_before(piece_s, q0, q1, row_ce[run_e[j] - 1]) == \
                _starts_before(piece_s, q0, q1, row_cs[run_s[j + 1]]):
            j += 1
        a, b = run_s[i], run_e[j]
        i = j + 1
        if m < 0:  # tied to no message: it keeps the row's weight
            continue
        tr[a:b] = True
        msg[a:b] = m
        row_role[a:b] = 1
        w = msg_weight[m0 + m]
        row_w[a:b] = w
        lead = lead_at[m0 + m]
        if row_cs[a] < lead:
            lw = lead_w[m0 + m]
            for t in range(a, b):
                if row_cs[t] < lead:
                    row_w[t] = lw if row_ce[t] <= lead else min(w, lw)
    # segments: a token wholly inside takes the segment's weight (other roles' text: their role too); then an
    # assistant token that straddles an edge keeps the lower weight. First come the pieces of other roles'
    # messages that weigh > 0 (roles_to_train), then the plan's own segments.
    for second in range(2):
        for g in range(q0 - q1 if second == 0 else 0, seg_off[k + 1] - seg_off[k]):
            if g < 0:  # a piece, as a segment of its message's weight
                q = q1 + g
                m = piece_m[q]
                if msg_assistant[m0 + m] or msg_weight[m0 + m] <= 0:
                    continue
                g_s, g_e, g_w, g_m, g_a = piece_s[q], piece_e[q], msg_weight[m0 + m], m, False
            else:
                h = seg_off[k] + g
                g_s, g_e, g_w, g_m, g_a = seg_s[h], seg_e[h], seg_w[h], seg_m[h], seg_a[h]
            # its tokens: from the first that ends after it starts, to the first that starts at or after its end
            first = _first_end_after(row_ce, 0, n, g_s)
            last = first + _starts_before(row_cs, first, n, g_e)
            if not g_a:
                if second == 1:
                    continue
                _other_text(tr[first:last], row_cs[first:last], row_ce[first:last], row_w[first:last],
                            row_role[first:last], g_s, g_e, g_w, msg_code[m0 + g_m])
            else:
                _own_text(tr[first:last], msg[first:last], row_cs[first:last], row_ce[first:last], row_w[first:last],
                          g_s, g_e, g_w, g_m, second == 1)


@njit(cache=True, nogil=True)
def _scratch(lens):
    """``_exact_row``'s scratch arrays, as long as the longest exact row."""
    longest = 0
    for k in range(lens.shape[0]):
        longest = max(longest, lens[k])
    return (np.empty(longest, np.int64), np.empty(longest, np.int64), np.empty(longest, np.int64),
            np.empty(longest, np.int64))


@njit(cache=True, nogil=True)
def weigh_exact(row_pos, lens, cs, ce, msg_off, msg_weight, msg_assistant, msg_code, lead_at, lead_w,
                piece_off, piece_s, piece_e, piece_m, seg_off, seg_s, seg_e, seg_w, seg_m, seg_a,
                in_run, weights, role):
    """Steps 2 and 3 of ``engine/weights.py`` on the exact rows, in place (its ``_weigh_exact_numpy`` is the reference).

    Row ``k`` (an exact row) is ``in_run/weights/role[row_pos[k]:row_pos[k] + lens[k]]``; its tokens' characters are
    ``cs/ce`` from ``sum(lens[:k])``; its messages ``msg_*[msg_off[k]:msg_off[k + 1]]`` (``lead_at``: where the
    message's answer starts, for its reasoning lead; -inf for none), its located pieces and its segments likewise, each
    naming its message by its index in the row. On entry a run's tokens weigh the row's weight and have role code 1,
    and the rest weigh 0 (``start_weights``); only the runs tied to a message, and the segments, are written.
    """
    tok_msg, run_s, run_e, run_m = _scratch(lens)
    c0 = 0
    for k in range(lens.shape[0]):
        p0, n = row_pos[k], lens[k]
        _exact_row(k, c0, in_run[p0:p0 + n], weights[p0:p0 + n], role[p0:p0 + n], cs, ce, msg_off, msg_weight,
                   msg_assistant, msg_code, lead_at, lead_w, piece_off, piece_s, piece_e, piece_m, seg_off, seg_s, seg_e,
                   seg_w, seg_m, seg_a, tok_msg, run_s, run_e, run_m)
        c0 += n


@njit(cache=True, nogil=True)
def weigh_batch(labels, ignore_index, uniform, row_starts, lengths, exact_rows, lens, cs, ce, msg_off, msg_weight,
                msg_assistant, msg_code, lead_at, lead_w, piece_off, piece_s, piece_e, piece_m, seg_off, seg_s, seg_e,
                seg_w, seg_m, seg_a, ids, prompt_weight, never, n_roles, out):
    """``start_weights``, ``weigh_exact`` on the exact rows (``exact_rows``, ascending: none where empty) and
    ``finish_weights``, in one call and one row at a time (a row's tokens stay in cache from one step to the next):
    the weights, the role codes and ``finish_weights``'s totals."""
    n, n_rows = labels.shape[0], row_starts.shape[0]
    weights = np.empty(n, np.float32)
    role = np.empty(n, np.int16)
    row_tokens, row_mass, role_tokens, role_mass = _totals(n_rows, n_roles)
    changed = False
    odd = False
    masked = never.shape[0] != 0
    tok_msg, run_s, run_e, run_m = _scratch(lens)
    in_run = np.empty(tok_msg.shape[0], np.bool_)
    k = 0  # the next exact row
    c0 = 0  # where its tokens' characters begin in cs/ce
    for r in range(n_rows):
        lo, hi = row_starts[r], row_starts[r] + lengths[r]
        row_labels, row_w, row_role = labels[lo:hi], weights[lo:hi], role[lo:hi]
        _start_row(row_labels, ignore_index, uniform[r], row_w, row_role)
        if k < exact_rows.shape[0] and exact_rows[k] == r:
            tr = in_run[:hi - lo]
            for t in range(row_labels.shape[0]):
                tr[t] = row_labels[t] != ignore_index
            _exact_row(k, c0, tr, row_w, row_role, cs, ce, msg_off, msg_weight, msg_assistant, msg_code, lead_at,
                       lead_w, piece_off, piece_s, piece_e, piece_m, seg_off, seg_s, seg_e, seg_w, seg_m, seg_a, tok_msg,
                       run_s, run_e, run_m)
            c0 += hi - lo
            k += 1
        t, m, c, o = _finish_row(row_w, row_role, row_labels, ids[lo:hi], out[lo:hi], never[lo:hi] if masked else never,
                                 masked, prompt_weight, ignore_index, role_tokens, role_mass)
        row_tokens[r], row_mass[r] = t, m
        changed |= c
        odd |= o
    return weights, role, row_tokens, row_mass, role_tokens, role_mass, changed, odd
