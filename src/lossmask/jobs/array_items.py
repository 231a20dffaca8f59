"""Where the items of a file holding one JSON array begin and end, found in its bytes without parsing a row.

An item ends at a comma outside every string at depth 1 (inside the array's brackets, in no object or list of an
item). ``ArrayScan`` finds those commas a chunk of bytes at a time with a numba kernel (``item_commas``: one pass,
the body of a string skipped at a compare a byte), carrying from one chunk to the next whether the bytes are inside
a string, the depth, and whether a backslash ended the chunk (the quote after it is part of the string).
``reference_item_commas`` is the same, written plainly; ``tests/test_workers.py`` holds the two equal. Nothing here
checks that the items are JSON: the reader of each range does that (``read_json._array_items``), with the same
messages as when the file is read whole. What would make a range reader's messages differ from the whole file's, or
its memory unbounded, makes the scan give up (``failed``): text after the array's end, a file that ends inside it,
brackets that close more than they open, a trailing comma, an item longer than ``formats.MAX_LINE_BYTES``. The file
is then read whole, which names the fault.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import formats

FINE = 1 << 16  # the ranges a scan cuts: joined into a job's slices once the file's size is known
WHITE = b" \t\n\r"  # JSON's white space, and what may stand before and after the array (a byte order mark too)


class ArrayScan:
    """The item boundaries of one JSON array fed to ``feed`` in consecutive chunks, cut into ranges of about
    ``about`` bytes (``ranges`` once ``finish`` said the scan held).

    After ``finish``: ``ranges`` is ``[(start, end, first item, items)]``, ``start`` the byte after the ``[`` or the
    comma before the range, ``end`` the comma after it or the closing ``]``; ``items`` the array's items."""

    def __init__(self, about: int):
        self.about = about
        self.offset = 0  # bytes fed so far
        self.depth = 0
        self.in_string = 0
        self.backslashes = 0  # the run of backslashes that ended the bytes fed
        self.opened: int | None = None  # the byte after the opening bracket
        self.closed: int | None = None  # the closing bracket
        self.separators = 0  # item-ending commas so far
        self.last = 0  # where the last item began (after the opening bracket or a comma)
        self.cuts: list[tuple[int, int]] = []  # (a comma's byte, the number of commas before it)
        self.failed = False
        self.ranges: list[tuple[int, int, int, int]] = []
        self.items = 0
        self.content = False  # non-white bytes seen since the last item began

    def feed(self, chunk: bytes) -> bool:
        """Scan the next ``chunk`` of the file; False once the scan gave up (``failed``)."""
        if self.failed or not chunk:
            return not self.failed
        base, self.offset = self.offset, self.offset + len(chunk)
        if self.closed is not None:  # after the array: white space only
            self.failed = bool(chunk.strip(WHITE))
            return not self.failed
        codes = np.frombuffer(chunk, dtype=np.uint8)
        commas = np.empty(codes.size, dtype=np.int64)  # pages are touched only for the commas found
        found, close, first, self.depth, self.in_string, self.backslashes = item_commas(
            codes, self.depth, self.in_string, self.backslashes, commas)
        if self.opened is None:
            if first < 0 or chunk[first:first + 1] != b"[" or chunk[:first].lstrip(b"\xef\xbb\xbf" + WHITE):
                self.failed = True
                return False
            self.opened = self.last = base + first + 1
        if close == -2 or close >= 0 and (chunk[close:close + 1] != b"]" or chunk[close + 1:].strip(WHITE)):
            self.failed = True
            return False
        if close >= 0:
            self.closed = base + close
        commas = base + commas[:found]
        starts = np.concatenate(([self.last], commas + 1))
        stops = np.concatenate((commas, [self.closed if self.closed is not None else self.offset]))
        if (stops - starts > formats.MAX_LINE_BYTES).any():
            self.failed = True
            return False
        self._cut(commas)
        if commas.size:
            self.last, self.content = int(commas[-1]) + 1, False
        if not self.content:
            stop = len(chunk) if self.closed is None else self.closed - base
            self.content = bool(chunk[max(0, self.last - base):stop].strip(WHITE))
        self.separators += commas.size
        return True

    def _cut(self, commas: np.ndarray) -> None:
        """Record a cut at the first item-ending comma at or past every ``about`` bytes since the last cut."""
        target = (self.cuts[-1][0] if self.cuts else self.opened) + self.about
        while commas.size:
            k = int(np.searchsorted(commas, target))
            if k >= commas.size:
                return
            self.cuts.append((int(commas[k]), self.separators + k))
            target = int(commas[k]) + self.about

    def finish(self) -> bool:
        """Close the scan at the end of the file; False when it gave up (``failed``), else ``ranges`` is set."""
        if self.failed or self.closed is None:
            self.failed = True
            return False
        if not self.content:
            if self.separators:  # a comma before the closing bracket: the whole file's reader names the item
                self.failed = True
                return False
            self.items, self.ranges = 0, []
            return True
        self.items = self.separators + 1
        start, first = self.opened, 0
        for comma, before in self.cuts:
            self.ranges.append((start, comma, first, before + 1 - first))
            start, first = comma + 1, before + 1
        self.ranges.append((start, self.closed, first, self.items - first))
        return True


def scan_array(fh, about: int, chunk: int = 4 << 20) -> ArrayScan:
    """``ArrayScan`` of the binary file ``fh`` read from its start, finished."""
    scan = ArrayScan(about)
    while True:
        data = fh.read(chunk)
        if not data or not scan.feed(data):
            break
    scan.finish()
    return scan


@njit(cache=True, nogil=True)
def item_commas(codes, depth, in_string, backslashes, commas):
    """One pass over ``codes`` (a chunk's bytes), from the state the last chunk left (``depth``; ``in_string``; a
    ``backslashes`` run inside a string that ended it, of which only the parity counts): the commas at depth 1
    outside strings written to ``commas``. Returns ``(commas found, the closing bracket's byte: -1 if not in the
    chunk, -2 where brackets close more than they opened, the opening bracket's byte: -1 if not in the chunk, then
    the state at the chunk's end)``. Stops at the closing bracket."""
    found, first = 0, -1
    escaped = backslashes & 1
    i, n = 0, codes.shape[0]
    while i < n:
        c = codes[i]
        if in_string:
            if escaped:
                escaped = 0
            elif c == 92:
                escaped = 1
            elif c == 34:
                in_string = 0
            i += 1
            while in_string and not escaped and i < n and codes[i] != 34 and codes[i] != 92:
                i += 1  # the body of a string, at the speed of a compare a byte
            continue
        if c == 34:
            in_string = 1
        elif c == 44:
            if depth == 1:
                commas[found] = i
                found += 1
        elif c == 91 or c == 123:
            if depth == 0 and first < 0:
                first = i
            depth += 1
        elif c == 93 or c == 125:
            depth -= 1
            if depth == 0:
                return found, i, first, depth, in_string, escaped
            if depth < 0:
                return found, -2, first, depth, in_string, escaped
        i += 1
    return found, -1, first, depth, in_string, escaped


def reference_item_commas(data: bytes) -> list[int]:
    """The bytes of ``data`` (a whole JSON array) that are commas between its items, found one byte at a time."""
    depth, inside, escaped, commas = 0, False, False, []
    for i, byte in enumerate(data):
        if inside:
            if escaped:
                escaped = False
            elif byte == 92:
                escaped = True
            elif byte == 34:
                inside = False
        elif byte == 34:
            inside = True
        elif byte in b"[{":
            depth += 1
        elif byte in b"]}":
            depth -= 1
        elif byte == 44 and depth == 1:
            commas.append(i)
    return commas
