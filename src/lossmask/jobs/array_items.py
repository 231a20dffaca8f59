"""Where the items of a file holding one JSON array begin and end, found in its bytes without parsing a row.

An item ends at a comma outside every string at depth 1 (inside the array's brackets, in no object or list of an
item). ``ArrayScan`` finds those commas a chunk of bytes at a time with numpy, carrying from one chunk to the next
whether the bytes are inside a string, the depth, and the backslashes that ended the chunk (a quote after an odd run
of them is part of the string). Nothing here checks that the items are JSON: the reader of each range does that
(``read_json._array_items``), with the same messages as when the file is read whole. What would make a range
reader's messages differ from the whole file's, or its memory unbounded, makes the scan give up (``failed``): text
after the array's end, a file that ends inside it, brackets that close more than they open, a trailing comma, an
item longer than ``formats.MAX_LINE_BYTES``. The file is then read whole, which names the fault.
"""

from __future__ import annotations

import numpy as np

from . import formats

_QUOTE, _BACKSLASH, _COMMA = ord('"'), ord("\\"), ord(",")
_STRUCTURE = np.zeros(256, dtype=bool)
_STRUCTURE[list(b"[]{},")] = True
_DEPTH = np.zeros(256, dtype=np.int64)
_DEPTH[list(b"[{")] = 1
_DEPTH[list(b"]}")] = -1
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
        quotes = self._real_quotes(codes)
        at = np.flatnonzero(_STRUCTURE[codes])
        if at.size:  # keep the brackets and commas outside strings
            at = at[((np.searchsorted(quotes, at) + self.in_string) & 1) == 0]
        self.in_string = (self.in_string + quotes.size) & 1
        depth = self.depth + np.cumsum(_DEPTH[codes[at]])
        if self.opened is None:
            if not at.size or codes[at[0]] != ord("[") or chunk[:at[0]].lstrip(b"\xef\xbb\xbf" + WHITE):
                self.failed = True
                return False
            self.opened = self.last = base + int(at[0]) + 1
        ends = np.flatnonzero(depth <= 0)
        if ends.size:
            close = int(at[ends[0]])
            if depth[ends[0]] < 0 or codes[close] != ord("]") or chunk[close + 1:].strip(WHITE):
                self.failed = True
                return False
            self.closed = base + close
            at, depth = at[:ends[0]], depth[:ends[0]]
        commas = base + at[(depth == 1) & (codes[at] == _COMMA)]
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
        if depth.size:
            self.depth = int(depth[-1])
        return True

    def _real_quotes(self, codes: np.ndarray) -> np.ndarray:
        """The quotes of ``codes`` that open or close a string: those after an even run of backslashes."""
        quotes = np.flatnonzero(codes == _QUOTE)
        slashes = np.flatnonzero(codes == _BACKSLASH)
        carried, self.backslashes = self.backslashes, 0
        if not slashes.size:
            if carried and quotes.size and quotes[0] == 0:
                quotes = quotes[1:] if carried & 1 else quotes
            return quotes
        # the first backslash of the run each backslash is in
        begins = np.concatenate(([True], np.diff(slashes) != 1))
        first = slashes[np.maximum.accumulate(np.where(begins, np.arange(slashes.size), 0))]
        runs = np.zeros(quotes.size, dtype=np.int64)
        after = quotes[(quotes > 0)]
        after = after[codes[after - 1] == _BACKSLASH]
        if after.size:
            k = np.searchsorted(slashes, after - 1)
            runs[np.searchsorted(quotes, after)] = after - first[k] + np.where(first[k] == 0, carried, 0)
        if quotes.size and quotes[0] == 0:
            runs[0] = carried
        if slashes[-1] == codes.size - 1:
            self.backslashes = int(codes.size - first[-1]) + (carried if first[-1] == 0 else 0)
        return quotes[(runs & 1) == 0]

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
