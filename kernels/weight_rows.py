"""The per-token passes of the weights (``lossmask.engine.weights``) that every weighed batch makes, one pass each.

Not a labelling backend (no ``label_rows``): ``engine/weights.py`` calls these two on flat buffers, rows back to back
(``row_starts``, ``lengths``).

- ``start_weights``: from the marker labels, each token's weight (its row's ``uniform`` weight where the label is not
  ``ignore_index``, else 0) and role code (1, the assistant, where it trains; else 0).
- ``finish_weights``: after the exact rows and the stop-token policy have had their say, the prompt weight for every
  token no source claimed (role 0) in rows where something trains, 0 where ``never`` says so (inside an image), then
  the labels (the id where the weight is > 0) and the totals: trained tokens and weight mass per row and per role
  code, whether any token's training changed from the marker labels', and whether a weight other than 0 or 1 occurs.

- ``weigh_exact``: between the two, the rows whose weights speak about characters (turns that differ, other roles'
  text, spans, parts, reasoning): runs tied to their messages, leads and segments, one row at a time.

``reference_start`` and ``reference_finish`` say the same in NumPy, as ``engine/weights._weigh_exact_numpy`` does for
``weigh_exact``; ``tests/test_weights.py`` holds each pair equal.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_ASSISTANT, _PROMPT = 1, 2  # role codes (engine/weights.ROLE_NAMES)


@njit(cache=True, nogil=True)
def start_weights(labels, ignore_index, uniform, row_starts, lengths):
    n = labels.shape[0]
    weights = np.empty(n, np.float32)
    role = np.empty(n, np.int16)
    for r in range(row_starts.shape[0]):
        w = uniform[r]
        for k in range(row_starts[r], row_starts[r] + lengths[r]):
            trained = labels[k] != ignore_index
            weights[k] = w if trained else np.float32(0)
            role[k] = _ASSISTANT if trained else 0
    return weights, role


@njit(cache=True, nogil=True)
def finish_weights(weights, role, labels, ignore_index, ids, row_starts, lengths, prompt_weight, never, n_roles, out):
    n_rows = row_starts.shape[0]
    row_tokens = np.zeros(n_rows, np.int64)
    row_mass = np.zeros(n_rows, np.float64)
    role_tokens = np.zeros(n_roles, np.int64)
    role_mass = np.zeros(n_roles, np.float64)
    changed = False
    odd = False
    masked = never.shape[0] != 0
    for r in range(n_rows):
        lo, hi = row_starts[r], row_starts[r] + lengths[r]
        fill = False
        if prompt_weight != 0:
            for k in range(lo, hi):
                if weights[k] > 0:
                    fill = True
                    break
        tokens = 0
        mass = 0.0
        for k in range(lo, hi):
            w = weights[k]
            if fill and role[k] == 0:
                w = prompt_weight
                role[k] = _PROMPT
            if masked and never[k]:
                w = np.float32(0)
            weights[k] = w
            trained = w > 0
            out[k] = ids[k] if trained else ignore_index
            changed |= trained != (labels[k] != ignore_index)
            odd |= (w != 0) & (w != 1)
            if trained:
                tokens += 1
                mass += w
                role_tokens[role[k]] += 1
                role_mass[role[k]] += w
        row_tokens[r] = tokens
        row_mass[r] = mass
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


@njit(cache=True, nogil=True)
def weigh_exact(row_pos, lens, cs, ce, msg_off, msg_weight, msg_assistant, msg_code, lead_at, lead_w,
                piece_off, piece_s, piece_e, piece_m, seg_off, seg_s, seg_e, seg_w, seg_m, seg_a,
                in_run, weights, role):
    """Steps 2 and 3 of ``engine/weights.py`` on the exact rows, in place (its ``_weigh_exact_numpy`` is the reference).

    Row ``k`` (an exact row) is ``in_run/weights/role[row_pos[k]:row_pos[k] + lens[k]]``; its tokens' characters are
    ``cs/ce`` from ``sum(lens[:k])``; its messages ``msg_*[msg_off[k]:msg_off[k + 1]]`` (``lead_at``: where the
    message's answer starts, for its reasoning lead; -inf for none), its located pieces and its segments likewise, each
    naming its message by its index in the row.
    """
    longest = 0
    for k in range(lens.shape[0]):
        longest = max(longest, lens[k])
    tr = np.zeros(longest, np.bool_)
    tok_msg = np.empty(longest, np.int64)
    run_s = np.empty(longest, np.int64)
    run_e = np.empty(longest, np.int64)
    run_m = np.empty(longest, np.int64)
    c0 = 0
    for k in range(lens.shape[0]):
        p0, n, m0 = row_pos[k], lens[k], msg_off[k]
        q0, q1 = piece_off[k], piece_off[k + 1]
        # runs of trained tokens, each tied to the first piece ending after it starts (if that piece starts before
        # the run ends and is an assistant's)
        n_runs = 0
        for t in range(n):
            tr[t] = in_run[p0 + t]
            if tr[t] and (t == 0 or not tr[t - 1]):
                run_s[n_runs] = t
                n_runs += 1
            if tr[t]:
                run_e[n_runs - 1] = t
        for i in range(n_runs):
            q = _first_end_after(piece_e, q0, q1, cs[c0 + run_s[i]])
            m = -1
            if q < q1 and piece_s[q] < ce[c0 + run_e[i]] and msg_assistant[m0 + piece_m[q]]:
                m = piece_m[q]
            run_m[i] = m
        # runs of one message with no message text between them are one turn: the tokens between train
        for t in range(n):
            tok_msg[t] = -1
        i = 0
        while i < n_runs:
            m = run_m[i]
            j = i
            while j + 1 < n_runs and m >= 0 and run_m[j + 1] == m and \
                    _starts_before(piece_s, q0, q1, ce[c0 + run_e[j]]) == \
                    _starts_before(piece_s, q0, q1, cs[c0 + run_s[j + 1]]):
                j += 1
            for t in range(run_s[i], run_e[j] + 1):
                tr[t] = True
                tok_msg[t] = m
            i = j + 1
        # each trained token takes its message's weight (or keeps the row's), the rest weigh 0
        for t in range(n):
            if tr[t]:
                m = tok_msg[t]
                w = msg_weight[m0 + m] if m >= 0 else weights[p0 + t]
                role[p0 + t] = 1
                if m >= 0 and cs[c0 + t] < lead_at[m0 + m]:  # before the answer: the reasoning lead's weight
                    lw = lead_w[m0 + m]
                    w = lw if ce[c0 + t] <= lead_at[m0 + m] else min(w, lw)
                weights[p0 + t] = w
            else:
                weights[p0 + t] = 0
            in_run[p0 + t] = tr[t]
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
                first = _first_end_after(ce, c0, c0 + n, g_s) - c0
                last = first + _starts_before(cs, c0 + first, c0 + n, g_e)
                for t in range(first, last):
                    if g_a:
                        eligible = tr[t] and tok_msg[t] == g_m
                    else:
                        eligible = not tr[t]
                    if not eligible:
                        continue
                    s, e = cs[c0 + t], ce[c0 + t]
                    whole = s >= g_s and e <= g_e and e > s
                    if second == 0 and whole:
                        weights[p0 + t] = g_w
                        if not g_a:
                            role[p0 + t] = msg_code[m0 + g_m]
                    elif second == 1 and not whole and g_a:
                        weights[p0 + t] = min(weights[p0 + t], g_w)
        c0 += n
