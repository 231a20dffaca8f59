"""Token spans from token bytes: where each token of a row lies in the row's text, read off the bytes it stands for.

Not a labelling backend (it has no ``label_rows``): the messages path asks it, through ``lossmask.engine.token_spans``,
for each token's character span instead of tokenising again with offsets. Inputs are flat buffers:

- ``pieces``/``piece_starts``/``piece_lengths``: the bytes each id stands for (``-1``: unknown), and
  ``piece_chars`` the characters they begin; ``added``: which ids are added tokens;
- ``prepend``: 0, or where the tokeniser wrote a ``▁`` that is not in the text (1: before the row's first token,
  2: also after every added token; plus 4 where it writes none before text that begins with a space, as
  ``Metaspace`` does), which the first byte of such a token, a space, is then taken as;
- ``ids``, ``offsets`` (``n_rows + 1``): the rows' tokens; ``text``: the rows' texts, UTF-8, back to back, and
  ``char_lengths``: each text's length in characters.

Out: ``spans`` (int32 ``[start, end)`` characters in the token's own row; a token holding part of a character's bytes
covers that character; a taken-off ``▁`` alone covers the character after it, as ``tokenizers`` says) and ``exact``
per row: do its tokens' bytes, back to back, equal its text's? A row that is not exact has meaningless spans.

``reference_spans`` is the same, written plainly; ``tests/test_token_text.py`` holds the two equal.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, inline="always")
def _is_lead(b):
    return (b & 0xC0) != 0x80


@njit(cache=True, nogil=True)
def token_spans(pieces, piece_starts, piece_lengths, piece_chars, added, prepend, ids, offsets, text, char_lengths):
    """``piece_chars``: the characters each piece begins (its bytes that are not UTF-8 continuation bytes)."""
    n_rows = offsets.shape[0] - 1
    size = piece_lengths.shape[0]
    # a row's characters fit an int32 (half the pages to touch); starts and ends each contiguous, returned as (n, 2)
    by_column = np.empty((2, ids.shape[0]), np.int32)
    spans = by_column.T
    exact = np.zeros(n_rows, np.bool_)
    n_text = text.shape[0]
    cursor = 0  # the first byte of row r's text
    for r in range(n_rows):
        row_start = cursor
        row_chars = char_lengths[r]
        chars = 0  # characters begun so far in this row
        ok = True
        previous_added = True  # the row's start counts as a stretch's start
        for k in range(offsets[r], offsets[r + 1]):
            v = ids[np.uint64(k)]  # unsigned indices: no negative-index wrap-around in the loop (~20% here)
            if v < 0 or v >= size or piece_lengths[v] < 0:
                ok = False
                break
            uv = np.uint64(v)
            start, length, begun = piece_starts[uv], piece_lengths[uv], piece_chars[uv]
            is_added = added[uv]
            emptied = False
            if prepend != 0 and previous_added and not is_added and length > 0 and pieces[start] == 32 \
                    and ((prepend & 3) == 2 or k == offsets[r]) \
                    and not ((prepend & 4) != 0 and chars < row_chars and text[cursor] == 32):
                start += 1
                length -= 1
                begun -= 1
                emptied = length == 0
            previous_added = is_added
            if cursor + length > n_text:
                ok = False
                break
            same = True
            for j in range(length):  # no early exit: most pieces are a few bytes, and they match
                same &= text[np.uint64(cursor + j)] == pieces[np.uint64(start + j)]
            if not same:
                ok = False
                break
            lo = chars
            if cursor < n_text and not _is_lead(text[cursor]):
                lo = chars - 1  # it begins inside a character
            chars += begun
            cursor += length
            hi = chars
            if length == 0:
                hi = min(lo + 1, row_chars) if emptied else lo
            spans[np.uint64(k), 0] = lo
            spans[np.uint64(k), 1] = hi
        # Exact: the tokens' bytes are the row's characters, all of them and no more (a row's text is followed by
        # the first byte of the next one's, or by the end).
        if ok and chars == row_chars and (cursor == n_text or _is_lead(text[cursor])):
            exact[r] = True
            continue
        # Not exact: find where the next row's text begins, by its characters.
        cursor = row_start
        seen = 0
        while cursor < n_text:
            if _is_lead(text[cursor]):
                if seen == row_chars:
                    break
                seen += 1
            cursor += 1
        for k in range(offsets[r], offsets[r + 1]):
            spans[k, 0] = 0
            spans[k, 1] = 0
    return spans, exact


def reference_spans(pieces, piece_starts, piece_lengths, added, prepend, ids, offsets, texts):
    """``token_spans`` written plainly, over the texts as Python strings (``texts[r]`` is row ``r``'s)."""
    spans = np.zeros((len(ids), 2), np.int32)
    exact = np.zeros(len(texts), bool)
    for r, text in enumerate(texts):
        row = [int(v) for v in ids[offsets[r]:offsets[r + 1]]]
        if any(v < 0 or v >= len(piece_lengths) or piece_lengths[v] < 0 for v in row):
            continue
        # each byte of the text, with the character it belongs to
        owner = [c for c, ch in enumerate(text) for _ in ch.encode("utf-8")]
        data = text.encode("utf-8")
        at, row_spans = 0, []
        for k, v in enumerate(row):
            piece = bytes(pieces[piece_starts[v]:piece_starts[v] + piece_lengths[v]])
            first = k == 0 or added[row[k - 1]]
            taken = prepend and first and not added[v] and piece[:1] == b" " and (prepend & 3 == 2 or k == 0) \
                and not (prepend & 4 and data[at:at + 1] == b" ")
            if taken:
                piece = piece[1:]
            if data[at:at + len(piece)] != piece:
                break
            if piece:
                row_spans.append((owner[at], owner[at + len(piece) - 1] + 1))
            else:
                char = owner[at] if at < len(owner) else len(text)
                row_spans.append((char, min(char + 1, len(text)) if taken else char))
            at += len(piece)
        else:
            if at == len(data):
                exact[r] = True
                spans[offsets[r]:offsets[r + 1]] = np.asarray(row_spans, dtype=np.int64).reshape(-1, 2)
    return spans, exact
