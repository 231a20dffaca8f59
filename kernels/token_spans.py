"""Token spans from token bytes: where each token of a row lies in the row's text, read off the bytes it stands for.

Not a labelling backend (it has no ``label_rows``): the messages path asks it, through ``lossmask.engine.token_spans``,
for each token's character span instead of tokenising again with offsets. Inputs are flat buffers:

- ``meta``: per id, where its bytes start in ``pieces``, how many there are (unknown: ``_UNKNOWN``), how many
  characters they begin and whether it is an added token, packed in one uint64 (``pack_table``: one load per token
  instead of four, from a table the size of the vocabulary); ``pieces``: the bytes, with 8 more after the last;
- ``prepend``: 0, or where the tokeniser wrote a ``▁`` that is not in the text (1: before the row's first token,
  2: also after every added token; plus 4 where it writes none before text that begins with a space, as
  ``Metaspace`` does), which the first byte of such a token, a space, is then taken as;
- ``ids``, ``offsets`` (``n_rows + 1``): the rows' tokens; ``text``: the rows' texts, UTF-8, back to back, and
  ``text_offsets`` (``n_rows + 1``): where each begins (an Arrow string array's two buffers, as they are).

A token's bytes are compared with the text's 8 at a time (two unaligned loads, a xor and a mask): most tokens hold
1-8 bytes, so one compare a token. ``pieces`` has 8 bytes of padding after its last piece; the texts' buffer has none
of its own, so the loads within its last 8 bytes read byte by byte.

Out: ``spans`` (int32 ``[start, end)`` characters in the token's own row; a token holding part of a character's bytes
covers that character; a taken-off ``▁`` alone covers the character after it, as ``tokenizers`` says) and ``exact``
per row: do its tokens' bytes, back to back, equal its text's? A row that is not exact has meaningless spans.

``reference_spans`` is the same, written plainly; ``tests/test_token_text.py`` holds the two equal.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_START_BITS, _LENGTH_SHIFT, _CHARS_SHIFT, _ADDED_SHIFT = 32, 32, 48, 63
_UNKNOWN = 0xFFFF  # the length of an id whose bytes are not known (a row holding it is never exact)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
PADDING = 8  # bytes after ``pieces`` that an 8-byte load may read


def pack_table(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray, chars: np.ndarray,
               added: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``(meta, pieces)`` for ``token_spans`` from a vocabulary's bytes (``lengths`` -1 where unknown), or None when
    they do not fit the packing (a piece of 65,535 bytes or more, 4 GiB of pieces)."""
    known = lengths >= 0
    if lengths.shape[0] and (lengths.max() >= _UNKNOWN or data.shape[0] >= 2 ** _START_BITS or chars.max() >= 2 ** 15):
        return None
    length = np.where(known, lengths, _UNKNOWN).astype(np.uint64)
    meta = (np.where(known, starts, 0).astype(np.uint64) | (length << np.uint64(_LENGTH_SHIFT))
            | (np.where(known, chars, 0).astype(np.uint64) << np.uint64(_CHARS_SHIFT))
            | (added.astype(np.uint64) << np.uint64(_ADDED_SHIFT)))
    return meta, np.concatenate([data, np.zeros(PADDING, np.uint8)])


@intrinsic
def _load8(typingctx, values, at):
    """The 8 bytes of the uint8 array ``values`` from byte ``at``, as a little-endian uint64 (an unaligned load; the
    caller keeps ``at + 8`` inside the buffer)."""
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        pointer = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(64).as_pointer())
        return builder.load(pointer, align=1)

    return types.uint64(values, at), codegen


@njit(cache=True, nogil=True, inline="always")
def _low_bytes(n):
    """A mask of the low ``n`` bytes of a uint64 (``n`` <= 8)."""
    return _ALL if n >= 8 else (np.uint64(1) << np.uint64(8 * n)) - np.uint64(1)


@njit(cache=True, nogil=True, inline="always")
def _load_tail(values, at, end):
    """``_load8`` where fewer than 8 bytes are left before ``end``: those bytes, 0 above them."""
    word = np.uint64(0)
    for j in range(min(8, end - at)):
        word |= np.uint64(values[at + j]) << np.uint64(8 * j)
    return word


@njit(cache=True, nogil=True, inline="always")
def _unpack(packed):
    """An id's ``meta`` entry: where its bytes start in ``pieces``, how many (``_UNKNOWN``: not known), how many
    characters they begin, and whether it is an added token."""
    return (np.int64(packed & np.uint64(0xFFFFFFFF)), np.int64((packed >> np.uint64(_LENGTH_SHIFT)) & np.uint64(0xFFFF)),
            np.int64((packed >> np.uint64(_CHARS_SHIFT)) & np.uint64(0x7FFF)), (packed >> np.uint64(_ADDED_SHIFT)) != 0)


@njit(cache=True, nogil=True, inline="always")
def _compare(text, n_text, cursor, pieces, start, length):
    """The token's first 8 text bytes (as ``_load8`` gives them) and how they and the rest differ from its piece's
    (0: not at all)."""
    word = _load8(text, cursor) if cursor + 8 <= n_text else _load_tail(text, cursor, n_text)
    differ = (word ^ _load8(pieces, start)) & _low_bytes(length)
    for j in range(8, length, 8):  # pieces longer than 8 bytes
        at = cursor + j
        later = _load8(text, at) if at + 8 <= n_text else _load_tail(text, at, n_text)
        differ |= (later ^ _load8(pieces, start + j)) & _low_bytes(length - j)
    return word, differ


@njit(cache=True, nogil=True, inline="always")
def _row_plain(meta, pieces, row_ids, text, n_text, cursor, row_end, row_lo, row_hi):
    """One row of a vocabulary that writes no ``▁`` of its own (``prepend`` 0: byte-level ones): its spans, and
    whether its tokens' bytes are its text's. The differences are gathered and looked at once, at the row's end: the
    loop has no branch a token but the bounds'."""
    size = meta.shape[0]
    chars = 0  # characters begun so far in this row
    differ = np.uint64(0)
    for k in range(row_ids.shape[0]):
        v = row_ids[k]
        if v < 0 or v >= size:
            return False, cursor
        start, length, begun, _ = _unpack(meta[np.uint64(v)])
        if length == _UNKNOWN or cursor + length > row_end:
            return False, cursor
        word, unlike = _compare(text, n_text, cursor, pieces, start, length)
        differ |= unlike
        # it begins inside a character when its first byte continues one
        lo = chars - np.int64(cursor < row_end and (word & np.uint64(0xC0)) == np.uint64(0x80))
        chars += begun
        cursor += length
        row_lo[k] = lo
        row_hi[k] = chars if length > 0 else lo
    return differ == 0, cursor


@njit(cache=True, nogil=True, inline="always")
def _row_prepend(meta, pieces, prepend, row_ids, text, n_text, cursor, row_end, row_lo, row_hi):
    """``_row_plain`` where the tokeniser writes ``▁`` that the text does not hold (``prepend``)."""
    size = meta.shape[0]
    chars = 0
    previous_added = True  # the row's start counts as a stretch's start
    for k in range(row_ids.shape[0]):
        v = row_ids[k]
        if v < 0 or v >= size:
            return False, cursor
        start, length, begun, is_added = _unpack(meta[np.uint64(v)])
        if length == _UNKNOWN:
            return False, cursor
        emptied = False
        if previous_added and not is_added and length > 0 and pieces[start] == 32 \
                and ((prepend & 3) == 2 or k == 0) \
                and not ((prepend & 4) != 0 and cursor < row_end and text[cursor] == 32):
            start += 1
            length -= 1
            begun -= 1
            emptied = length == 0
        previous_added = is_added
        if cursor + length > row_end:
            return False, cursor
        word, differ = _compare(text, n_text, cursor, pieces, start, length)
        if differ != 0:
            return False, cursor
        lo = chars
        if cursor < row_end and (word & np.uint64(0xC0)) == np.uint64(0x80):
            lo = chars - 1  # it begins inside a character
        chars += begun
        cursor += length
        hi = chars
        if length == 0:
            hi = lo + 1 if emptied and cursor < row_end else lo
        row_lo[k] = lo
        row_hi[k] = hi
    return True, cursor


@njit(cache=True, nogil=True)
def token_spans(meta, pieces, prepend, ids, offsets, text, text_offsets):
    n_rows = offsets.shape[0] - 1
    n_text = text.shape[0]  # loads that would pass the buffer's end read byte by byte
    # a row's characters fit an int32 (half the pages to touch); starts and ends each contiguous, returned as (n, 2)
    by_column = np.empty((2, ids.shape[0]), np.int32)
    exact = np.zeros(n_rows, np.bool_)
    for r in range(n_rows):
        row_end = text_offsets[r + 1]  # row r's text: its bytes, from text_offsets[r]
        # the row as slices walked from 0: no negative-index wrap-around in the loop
        row_ids = ids[offsets[r]:offsets[r + 1]]
        row_lo, row_hi = by_column[0, offsets[r]:offsets[r + 1]], by_column[1, offsets[r]:offsets[r + 1]]
        if prepend == 0:
            ok, cursor = _row_plain(meta, pieces, row_ids, text, n_text, text_offsets[r], row_end, row_lo, row_hi)
        else:
            ok, cursor = _row_prepend(meta, pieces, prepend, row_ids, text, n_text, text_offsets[r], row_end, row_lo,
                                      row_hi)
        # Exact: the tokens' bytes are the row's, all of them and no more.
        if ok and cursor == row_end:
            exact[r] = True
        else:
            row_lo[:] = 0
            row_hi[:] = 0
    return by_column.T, exact


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
