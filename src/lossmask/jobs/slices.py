"""Slices of a job's input that a worker reads itself: the parent plans them, and never reads a row.

A slice of a Parquet file is a run of whole row groups (``ParquetSlice``): its rows are known from the file's footer
before anything is read, so the parent knows the job's row of each slice, and names a row (``row 70 (data.parquet,
row 70)``) as it does when it reads the file itself. A row group is never split between workers: each worker that read a
part of it would decode the rows before that part (Parquet pages are decoded from the start of their row group),
which costs about as much as the parent reading the file. So files written in row groups much larger than a slice
(one row group for the whole file, as ``pandas.to_parquet`` writes a small one) are read by the parent. A worker reads its slice in batches of about
``batch_bytes``, each checked as the parent checks what it reads (strings that are UTF-8), and labels them one
after another (``jobs/workers.py``).

A slice of a JSON Lines file is a range of its bytes that starts and ends at a line end (``JsonLinesSlice``). The parent
cuts the files at the first line end past every ``about`` bytes (a few small reads at each cut, never a parse); the
workers then count each slice's rows (``count_json_lines``: its line ends, and its blank lines, which are no rows)
and the parent adds those counts up, so that each slice knows the job's row and the file's line it starts at before
it is labelled. A worker reads its slice's bytes, cuts them into lines and reads runs of them as the parent reads
JSON Lines (``read_json._json_table``: Arrow's JSON reader with the job's types, Python for the lines it refuses, each
refused line named). A line longer than ``formats.MAX_LINE_BYTES`` makes the parent read the files.

A slice of a file holding one JSON array is a range of its bytes holding whole items (``JsonArraySlice``): the parent
finds the commas between items (``array_items.ArrayScan``, numpy over the bytes, no row parsed), so it knows each
slice's items before it is handed out. A worker reads its range between brackets with the reader of whole arrays
(``read_json._array_items``), so an item at fault is named as when the file is read whole. A file compressed with
gzip, bzip2 or zstd is decompressed once into a temporary copy (``InputFiles.decompressed``), then sliced as above.
Input whose files cannot all be cut so is read by the parent and handed out as batches.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Iterator

import pyarrow as pa

from . import formats


@dataclass(frozen=True)
class ParquetSlice:
    """Rows ``first_row`` to ``first_row + num_rows - 1`` of a job: row groups ``groups`` of the Parquet file at
    ``local`` (named ``path``), whose first row is row ``first`` of that file."""

    path: str
    local: str
    groups: tuple[int, ...]
    first: int
    first_row: int
    num_rows: int

    def segments(self) -> Iterator[tuple[int, int, int, str]]:
        """``(job row, rows, first row in the file, "row")``: where the slice's rows are named from."""
        yield self.first_row, self.num_rows, self.first, "row"


def parquet_slices(files: Any, rows_per_slice: int, workers: int) -> list[ParquetSlice] | None:
    """The slices of a job's Parquet files, in input order: consecutive row groups of one file, together about
    ``rows_per_slice`` rows. None when the row groups are too large for slices to keep ``workers`` busy and their
    memory bounded (fewer than two slices a worker, or a row group of more than twice ``rows_per_slice`` rows: a
    file written in one row group): the parent then reads the rows and hands them out as batches. A slice is
    recorded with ``files`` (``InputFiles.record``) when it is handed out, so that its rows can be named."""
    import pyarrow.parquet as pq

    from .formats import _first_line

    plan: list[ParquetSlice] = []
    row = 0
    for path in files.paths:
        local = files._local(path)
        try:
            metadata = pq.ParquetFile(local).metadata
        except (pa.ArrowInvalid, OSError) as exc:
            raise ValueError(f"{path}: reading failed ({_first_line(exc)}); the file may be truncated or corrupt") \
                from None
        first, groups, rows = 0, [], 0
        for g in range(metadata.num_row_groups):
            n = metadata.row_group(g).num_rows
            if n > 2 * rows_per_slice:
                return None
            if groups and rows + n > rows_per_slice:
                plan.append(ParquetSlice(path, local, tuple(groups), first, row, rows))
                row, first, groups, rows = row + rows, first + rows, [], 0
            if n:
                groups.append(g)
                rows += n
        if groups:
            plan.append(ParquetSlice(path, local, tuple(groups), first, row, rows))
            row += rows
    return plan if len(plan) >= 2 * workers else None


def read_piece(piece: Any, step: dict) -> Iterator[pa.Table]:
    """The rows of a slice of either kind, in a worker: ``step`` as ``workers.step_in_worker`` has it."""
    options = step["options"]
    if isinstance(piece, ArrowSlice):
        return iter([read_arrow_slice(piece)])
    if isinstance(piece, JsonArraySlice):
        return read_json_array_slice(piece, step["input_schema"], step["typed"], options.batch_size,
                                     options.batch_bytes)
    if isinstance(piece, JsonLinesSlice):
        return read_json_lines_slice(piece, step["input_schema"], step["typed"], options.batch_size,
                                     options.batch_bytes)
    return read_slice(piece, step["input_schema"], options.batch_size, options.batch_bytes)


def read_slice(piece: ParquetSlice, schema: pa.Schema, max_rows: int, max_bytes: int | None) -> Iterator[pa.Table]:
    """The rows of ``piece`` as tables of at most ``max_rows`` rows and about ``max_bytes`` bytes, checked as the
    parent checks the batches it reads; a file that cannot be read is one ``ValueError`` line naming it."""
    import pyarrow.parquet as pq

    from .formats import _check_utf8, _first_line, _holds_text
    from .read_arrow import _rows_in_bytes

    text = [i for i, field in enumerate(schema) if _holds_text(field.type)]
    first = piece.first
    try:
        with pq.ParquetFile(piece.local, pre_buffer=False) as parquet:
            rows = max_rows if max_bytes is None else min(max_rows, _rows_in_bytes(parquet.metadata, max_bytes))
            for batch in parquet.iter_batches(batch_size=max(1, rows), row_groups=list(piece.groups),
                                              use_threads=False):
                for i in text:
                    _check_utf8(batch.column(i), batch.schema.names[i], piece.path, first)
                first += batch.num_rows
                yield pa.Table.from_batches([batch])
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OSError) as exc:
        raise ValueError(f"{piece.path}: reading failed ({_first_line(exc)}); the file may be truncated or corrupt") \
            from None



@dataclass(frozen=True)
class JsonLinesSlice:
    """Bytes ``start`` to ``end`` of the JSON Lines file at ``local`` (named ``path``), which start at line ``line``
    (1-based). Once counted (``count_json_lines``): rows ``first_row`` to ``first_row + num_rows - 1`` of the job, in
    ``runs`` of consecutive non-blank lines, each ``(line offset from line, rows)``."""

    path: str
    local: str
    start: int
    end: int
    line: int = 1
    first_row: int = 0
    num_rows: int = 0
    runs: tuple[tuple[int, int], ...] = ()

    def segments(self) -> Iterator[tuple[int, int, int, str]]:
        """``(job row, rows, first line, "line")`` for each run of the slice: where its rows are named from."""
        row = self.first_row
        for offset, rows in self.runs:
            yield row, rows, self.line + offset, "line"
            row += rows


_WHITE = b" \t\n\r\x0b\x0c"  # what bytes.strip() strips: a line of these alone is blank, and no row
_WHITE_CODES = list(_WHITE)


MAX_SLICE_BYTES = 32 << 20  # a worker holds its slice's bytes while it reads them


def json_slices(files: Any, batch_size: int, workers: int) -> list[Any] | None:
    """The slices of a job's JSON files, in input order: byte ranges of about ``batch_size`` rows (the mean row of
    the first file), at least ``4 * workers`` of them and at most ``MAX_SLICE_BYTES`` each, cut after a line end of
    JSON Lines (``JsonLinesSlice``, counted by the workers: ``count_json_lines``) or after an item of a JSON array
    (``JsonArraySlice``, its items counted here: ``array_items.ArrayScan``). A compressed file is decompressed
    once into a temporary copy first (``InputFiles.decompressed``), which is sliced. None when a file cannot be cut
    so (a line or an item too long, an array the scan gave up on, a copy that failed): the parent then reads the
    files itself, and names what is at fault."""
    from .array_items import FINE, WHITE, scan_array
    from .formats import _codec_of

    files_read = []
    for path in files.paths:
        local = files._local(path)
        with open(local, "rb") as fh:
            head = fh.read(1 << 12)
        scan = None
        if _codec_of(head) is not None:
            copied = files.decompressed(path)
            if copied is None:
                return None
            local, scan = copied
        elif head.lstrip(b"\xef\xbb\xbf" + WHITE).startswith(b"["):
            with open(local, "rb") as fh:
                scan = scan_array(fh, FINE)
        if scan is not None and scan.failed:
            return None
        files_read.append((path, local, scan))
    path, local, scan = files_read[0]
    if scan is None:
        with open(local, "rb") as fh:
            sample = fh.read(1 << 20)
        row = len(sample) / max(1, sample.count(b"\n"))
    else:
        row = (scan.closed - scan.opened) / max(1, scan.items)
    size = sum(os.path.getsize(local) for _, local, _ in files_read)
    about = int(max(1 << 16, min(batch_size * row, size / (4 * workers), MAX_SLICE_BYTES)))
    plan: list[Any] = []
    for path, local, scan in files_read:
        if scan is None:
            pieces = _json_lines_file_slices(path, local, about)
            if pieces is None:
                return None
            plan += pieces
        else:
            plan += [JsonArraySlice(path, local, start, end, first, num_rows=items)
                     for start, end, first, items in _joined_ranges(scan.ranges, about)]
    return plan


def _joined_ranges(ranges: list[tuple[int, int, int, int]], about: int) -> Iterator[tuple[int, int, int, int]]:
    """Consecutive ``(start, end, first item, items)`` ranges of an array joined into ranges of at least ``about``
    bytes (the last may be shorter)."""
    joined = None
    for start, end, first, items in ranges:
        if joined is None:
            joined = [start, end, first, items]
        else:
            joined[1], joined[3] = end, joined[3] + items
        if joined[1] - joined[0] >= about:
            yield tuple(joined)
            joined = None
    if joined is not None:
        yield tuple(joined)


def _json_lines_file_slices(path: str, local: str, about: int) -> list[JsonLinesSlice] | None:
    """The byte ranges of a JSON Lines file, of about ``about`` bytes each, cut after a line end; None when a line
    is too long to cut after (the parent then reads the file and names the line)."""
    plan: list[JsonLinesSlice] = []
    with open(local, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        start = 0
        while start < size:
            end = start + about
            if end >= size:
                end = size
            else:
                fh.seek(end)
                seen = 0
                while True:  # the first line end at or past the cut
                    chunk = fh.read(1 << 16)
                    at = chunk.find(b"\n")
                    if at >= 0:
                        end += seen + at + 1
                        break
                    if not chunk:
                        end = size
                        break
                    seen += len(chunk)
                    if seen > formats.MAX_LINE_BYTES:
                        return None
            plan.append(JsonLinesSlice(path, local, start, end))
            start = end
    return plan


def _slice_bytes(piece: Any) -> bytes:
    with open(piece.local, "rb") as fh:
        fh.seek(piece.start)
        return fh.read(piece.end - piece.start)


def count_json_lines(piece: JsonLinesSlice) -> tuple[int, tuple[tuple[int, int], ...]]:
    """``(line ends in the slice, its runs of consecutive non-blank lines)``, in a worker: the line ends found at
    memory speed (numpy), and a line-by-line look only where a line may be blank (one starting with white space)."""
    import numpy as np

    data = _slice_bytes(piece)
    codes = np.frombuffer(data, dtype=np.uint8)
    ends = np.flatnonzero(codes == 10)
    lines = ends.size + (1 if data and not data.endswith(b"\n") else 0)
    starts = ends[: lines - 1] + 1
    if not (data[:1] and data[:1] in _WHITE) and not np.isin(codes[starts], _WHITE_CODES).any():
        return int(ends.size), ((0, lines),) if lines else ()
    runs: list[list[int]] = []
    for k, raw in enumerate(data.split(b"\n")[:lines]):
        if not raw.strip():
            continue
        if runs and runs[-1][0] + runs[-1][1] == k:
            runs[-1][1] += 1
        else:
            runs.append([k, 1])
    return int(ends.size), tuple((offset, rows) for offset, rows in runs)


def counted(plan: list[Any], counts: Any) -> Iterator[Any]:
    """The slices of ``plan`` with their job rows (and lines), from the ``count_json_lines`` of its JSON Lines slices
    (in order; the other slices know their rows); a slice of no row (blank lines only) is left out."""
    row, line, path = 0, 1, None
    counts = iter(counts)
    for piece in plan:
        if not isinstance(piece, JsonLinesSlice):
            if piece.num_rows:
                yield replace(piece, first_row=row)
            row += piece.num_rows
            continue
        ends, runs = next(counts)
        if piece.path != path:
            path, line = piece.path, 1
        rows = sum(n for _, n in runs)
        if rows:
            yield replace(piece, line=line, first_row=row, num_rows=rows, runs=runs)
        row, line = row + rows, line + ends


def read_json_lines_slice(piece: JsonLinesSlice, schema: pa.Schema, typed: bool, max_rows: int,
                          max_bytes: int | None) -> Iterator[pa.Table]:
    """The rows of ``piece`` as the parent reads JSON Lines (``read_json.read_json_lines``): runs of at most
    ``max_rows`` consecutive non-blank lines, each read as ``schema`` (``typed``: Arrow's types of the first rows),
    then cut into tables of about ``max_bytes``; a line that cannot be read is one ``ValueError`` naming it."""
    from .formats import _too_long
    from .read_json import _json_table

    lines = _slice_bytes(piece).split(b"\n")
    for offset, rows in piece.runs:
        for at in range(offset, offset + rows, max_rows):
            block = lines[at:min(at + max_rows, offset + rows)]
            for k, raw in enumerate(block):
                if len(raw) > formats.MAX_LINE_BYTES:
                    raise _too_long(piece.path, "line", piece.line + at + k)
            table = _json_table(piece.path, block, piece.line + at, schema, "line", typed=typed)
            for batch in table.to_batches():
                yield from _pieces(batch, max_bytes)


@dataclass(frozen=True)
class JsonArraySlice:
    """Bytes ``start`` to ``end`` of the file at ``local`` (named ``path``) holding one JSON array: its items
    ``first`` to ``first + num_rows - 1`` and the commas between them, which are rows ``first_row`` on of the job."""

    path: str
    local: str
    start: int
    end: int
    first: int
    first_row: int = 0
    num_rows: int = 0

    def segments(self) -> Iterator[tuple[int, int, int, str]]:
        """``(job row, rows, first item, "row")``: where the slice's rows are named from."""
        yield self.first_row, self.num_rows, self.first, "row"


def read_json_array_slice(piece: JsonArraySlice, schema: pa.Schema, typed: bool, max_rows: int,
                          max_bytes: int | None) -> Iterator[pa.Table]:
    """The rows of ``piece`` as the parent reads a JSON array (``read_json.read_json_lines``): its items read as an
    array of their own, in runs of at most ``max_rows``, each read as ``schema``, then cut into tables of about
    ``max_bytes``; an item that cannot be read is one ``ValueError`` naming it, as the whole file's reader names it."""
    from .read_json import _json_table

    block: list[bytes] = []
    first = piece.first
    for number, raw in _array_slice_items(piece):
        block.append(raw)
        if len(block) == max_rows:
            for batch in _json_table(piece.path, block, first, schema, "row", typed=typed).to_batches():
                yield from _pieces(batch, max_bytes)
            block, first = [], number + 1
    if block:
        for batch in _json_table(piece.path, block, first, schema, "row", typed=typed).to_batches():
            yield from _pieces(batch, max_bytes)


def _array_slice_items(piece: JsonArraySlice) -> Iterator[tuple[int, bytes]]:
    """``read_json._array_items`` of the slice's bytes between brackets. Should they fail, the items are read again
    from the slice's start through the rest of the file, as the whole file's reader reads them, so that the error
    raised is the one it raises (an item that the scan cut wrongly, being malformed, fails there as in the file)."""
    import io

    from .read_json import _array_items

    try:
        yield from _array_items(io.BytesIO(b"[" + _slice_bytes(piece) + b"]"), piece.path, first=piece.first)
    except ValueError as exc:
        with open(piece.local, "rb") as fh:
            fh.seek(piece.start)
            for _ in _array_items(_Prefixed(b"[", fh), piece.path, first=piece.first):
                pass
        raise exc from None


class _Prefixed:
    """A binary file read after ``prefix``."""

    def __init__(self, prefix: bytes, fh: Any):
        self.prefix, self.fh = prefix, fh

    def read(self, size: int = -1) -> bytes:
        head, self.prefix = self.prefix, b""
        return head + self.fh.read(size if size < 0 else max(0, size - len(head)))


def _pieces(batch: pa.RecordBatch, max_bytes: int | None) -> Iterator[pa.Table]:
    """``batch`` cut into even pieces of about ``max_bytes`` (slices, no copy), as ``InputFiles.batches`` cuts it."""
    pieces = 1 if max_bytes is None else max(1, min(batch.num_rows, -(-batch.nbytes // max_bytes)))
    step = -(-batch.num_rows // pieces)
    for at in range(0, batch.num_rows, step):
        yield pa.Table.from_batches([batch.slice(at, step) if pieces > 1 else batch])


@dataclass(frozen=True)
class ArrowSlice:
    """Rows ``first`` to ``first + num_rows - 1`` of the Arrow files ``files`` read one after another (a
    ``datasets.Dataset``'s cache files), which are rows ``first_row`` on of the job."""

    files: tuple[str, ...]
    first: int
    first_row: int
    num_rows: int


def dataset_slices(dataset: Any, rows_per_slice: int) -> list[ArrowSlice] | None:
    """Slices of ``rows_per_slice`` rows of a ``datasets.Dataset`` whose table is its Arrow cache files as they are,
    one after another (no index mapping, no operation replayed on a file's table, no file joined beside another);
    None otherwise (a dataset in memory, one selected, shuffled or renamed in memory): the parent then hands its rows
    out as batches."""
    from datasets.table import ConcatenationTable, MemoryMappedTable

    if getattr(dataset, "_indices", None) is not None:
        return None
    table = dataset.data
    if isinstance(table, MemoryMappedTable):
        blocks = [table]
    elif isinstance(table, ConcatenationTable) and all(len(row) == 1 for row in table.blocks):
        blocks = [row[0] for row in table.blocks]
    else:
        return None
    if not blocks or any(not isinstance(b, MemoryMappedTable) or _changes_rows(b.replays) for b in blocks):
        return None
    files = tuple(b.path for b in blocks)
    return [ArrowSlice(files, start, start, min(rows_per_slice, table.num_rows - start))
            for start in range(0, table.num_rows, rows_per_slice)]


def _changes_rows(replays: Any) -> bool:
    """Whether operations that ``datasets`` replays on a file's table change its rows or columns (a new schema
    metadata, which every loaded dataset has, does not)."""
    return any(name != "replace_schema_metadata" for name, _, _ in replays or ())


_OPENED: dict[tuple[str, ...], pa.Table] = {}


def read_arrow_slice(piece: ArrowSlice) -> pa.Table:
    """The rows of ``piece``, from its files mapped into memory (opened once a worker, never copied)."""
    table = _OPENED.get(piece.files)
    if table is None:
        tables = [pa.ipc.open_stream(pa.memory_map(path)).read_all() for path in piece.files]
        table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
        _OPENED.clear()
        _OPENED[piece.files] = table
    return table.slice(piece.first, piece.num_rows)


SLICES = (ParquetSlice, JsonLinesSlice, JsonArraySlice, ArrowSlice)  # what a worker reads itself
