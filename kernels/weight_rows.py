"""The per-token passes of the weights (``lossmask.engine.weights``) that every weighed batch makes, one pass each.

Not a labelling backend (no ``label_rows``): ``engine/weights.py`` calls these two on flat buffers, rows back to back
(``row_starts``, ``lengths``).

- ``start_weights``: from the marker labels, each token's weight (its row's ``uniform`` weight where the label is not
  ``ignore_index``, else 0) and role code (1, the assistant, where it trains; else 0).
- ``finish_weights``: after the exact rows and the stop-token policy have had their say, the prompt weight for every
  token no source claimed (role 0) in rows where something trains, 0 where ``never`` says so (inside an image), then
  the labels (the id where the weight is > 0) and the totals: trained tokens and weight mass per row and per role
  code, whether any token's training changed from the marker labels', and whether a weight other than 0 or 1 occurs.

``reference_start`` and ``reference_finish`` say the same in NumPy; ``tests/test_weights.py`` holds them equal.
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
