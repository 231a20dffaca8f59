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
refused line named). A file that can be read only from its start is not sliced: JSON compressed with gzip, bzip2 or
zstd (no offset in it can be sought without decompressing all before), and a file holding one JSON array (its items
are found only by parsing it); those, and a line longer than ``formats.MAX_LINE_BYTES``, are read by the parent and
handed out as batches, as any input is whose files are not all of one sliceable kind.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Iterator

import pyarrow as pa


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


def json_lines_slices(files: Any, about: int) -> list[JsonLinesSlice] | None:
    """The byte ranges of a job's JSON Lines files, of about ``about`` bytes each, cut after a line end; None when a
    file is not JSON Lines that can be read from any line (compressed, a JSON array) or a line is too long to cut
    after (the parent then reads the files and reports the line)."""
    from .formats import MAX_LINE_BYTES, _codec_of

    plan: list[JsonLinesSlice] = []
    for path in files.paths:
        local = files._local(path)
        with open(local, "rb") as fh:
            head = fh.read(1 << 12)
            if _codec_of(head) is not None or head.lstrip(b"\xef\xbb\xbf" + _WHITE).startswith(b"["):
                return None
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
                        if seen > MAX_LINE_BYTES:
                            return None
                plan.append(JsonLinesSlice(path, local, start, end))
                start = end
    return plan


def _slice_bytes(piece: JsonLinesSlice) -> bytes:
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


def counted(plan: list[JsonLinesSlice], counts: Any) -> Iterator[JsonLinesSlice]:
    """The slices of ``plan`` with their job rows and lines, from their ``count_json_lines`` (in order); a slice of
    no row (blank lines only) is left out."""
    row, line, path = 0, 1, None
    for piece, (ends, runs) in zip(plan, counts):
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
    from .formats import MAX_LINE_BYTES, _too_long
    from .read_json import _json_table

    lines = _slice_bytes(piece).split(b"\n")
    for offset, rows in piece.runs:
        for at in range(offset, offset + rows, max_rows):
            block = lines[at:min(at + max_rows, offset + rows)]
            for k, raw in enumerate(block):
                if len(raw) > MAX_LINE_BYTES:
                    raise _too_long(piece.path, "line", piece.line + at + k)
            table = _json_table(piece.path, block, piece.line + at, schema, "line", typed=typed)
            for batch in table.to_batches():
                yield from _pieces(batch, max_bytes)


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


SLICES = (ParquetSlice, JsonLinesSlice, ArrowSlice)  # what a worker reads itself
