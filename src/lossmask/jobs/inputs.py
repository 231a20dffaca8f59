"""The input of a masking job: its files, one schema over all of them, and their rows batch by batch, each row
named as the user knows it.

The work is split by concept, imports running one way (each module imports only those above it here):

- ``formats``: what the files hold: the format (suffix, else first bytes), the compression, the united schema,
  the UTF-8 check of text read from Parquet and Arrow;
- ``locations``: where the rows are: listing a file, folder, glob or list, each file read once, the job's own
  output and partial files left out, temporary copies of stdin and pipes;
- ``read_arrow`` (Parquet, Arrow IPC) and ``read_json`` (JSON Lines, JSON arrays): one reader per format, each able
  to read a part of a file (``jobs/slices.py`` reads a worker's slice with them);
- this module: ``open_inputs`` and ``InputFiles``, which reads the files one after another and records every batch
  with the file it came from and where it starts there, so that a row of the job (``row 70``) can be named as the
  user knows it (``row 70 (chats.jsonl, line 71)``).
"""

from __future__ import annotations

import bisect
import os
import re
from dataclasses import dataclass
from typing import Any, Iterator

import pyarrow as pa

from .display import escaped
from .formats import _check_utf8, _first_line, _format_of, _holds_text, unite_schemas
from .locations import PARTIAL_SUFFIX, _copy_stream, _list_paths, _read_once, decompressed_copy, remove_copy
from .read_arrow import _parquet_batches, _scanned_batches
from .read_json import _Head, _typed_json_inputs, json_lines_schema, read_json_lines


@dataclass(frozen=True)
class _Segment:
    """One batch as read: rows ``[first_row, first_row + rows)`` of the job are rows (or lines) ``first`` on of ``path``."""

    first_row: int
    rows: int
    path: str
    first: int
    unit: str  # "row" (0-based row of a Parquet/IPC file or item of a JSON array) or "line" (1-based, JSON Lines)


class InputFiles:
    """The files of a job, their united ``schema``, and ``batches`` over all of them in order."""

    def __init__(self, paths: list[str], fmt: str, source: str, schema: pa.Schema, schemas: list[pa.Schema],
                 skipped: list[str], copies: dict[str, str] | None = None, heads: dict[str, _Head] | None = None):
        self.paths, self.format, self.source, self.schema = paths, fmt, source, schema
        self.file_schemas = schemas
        self.skipped = skipped  # messages for the report: files left out (the job's own output...)
        self.copies = copies or {}  # a path as named -> the temporary copy read instead (stdin, pipes)
        # JSON Lines read as typed Arrow: each file's first rows, parsed once for the schema and kept to be read
        self.heads = heads
        # ... and the rows of the input, when every file was read whole for its schema
        self._json_rows = (sum(len(h.numbers) for h in heads.values())
                           if heads is not None and len(heads) == len(paths) and all(h.whole for h in heads.values())
                           else None)
        self._segments: list[_Segment] = []
        self._starts: list[int] = []
        self._decompressed: dict[str, Any] = {}

    def close(self) -> None:
        """Remove the temporary copies of stdin and pipes, and the decompressed ones (also done at exit, should a
        job not call this)."""
        for copy in self.copies.values():
            remove_copy(copy)
        for copied in self._decompressed.values():
            if copied is not None:
                remove_copy(copied[0])
        self._decompressed.clear()

    def _local(self, path: str) -> str:
        return self.copies.get(path, path)

    def decompressed(self, path: str) -> tuple[str, Any] | None:
        """The compressed JSON file ``path`` decompressed once into a temporary copy, for workers to read slices of
        (``locations.decompressed_copy``): ``(its path, the scan of a JSON array or None)``; None when it cannot be."""
        if path not in self._decompressed:
            self._decompressed[path] = decompressed_copy(self._local(path))
        return self._decompressed[path]

    # -- reading -------------------------------------------------------------------------------------

    def batches(self, batch_size: int, max_bytes: int | None = None) -> Iterator[pa.RecordBatch]:
        """Record batches of at most ``batch_size`` rows, in file order; each is recorded for ``name_row``. With
        ``max_bytes``, a batch read larger than that (its Arrow buffers) is cut into even pieces of about that size
        (slices, no copy): the rows' length then bounds how many of them are labelled at once."""
        row = 0
        reader = self._json_batches(batch_size) if self.format == "json" else \
            self._dataset_batches(batch_size, max_bytes)
        for whole, path, first, unit in reader:
            if not whole.num_rows:
                continue
            pieces = 1 if max_bytes is None else max(1, min(whole.num_rows, -(-whole.nbytes // max_bytes)))
            step = -(-whole.num_rows // pieces)
            for at in range(0, whole.num_rows, step):
                batch = whole.slice(at, step) if pieces > 1 else whole
                self._starts.append(row)
                self._segments.append(_Segment(row, batch.num_rows, path, first + at, unit))
                row += batch.num_rows
                yield batch

    def _dataset_batches(self, batch_size: int, max_bytes: int | None):
        # Arrow reads ahead on its own threads; the UTF-8 check of each batch's text (a full pass over it, with
        # the GIL released) runs on the read-ahead thread too, off the thread that renders
        return _read_ahead(self._checked_dataset_batches(batch_size, max_bytes))

    def _checked_dataset_batches(self, batch_size: int, max_bytes: int | None):
        named = {self._local(path): path for path in self.paths}
        if self.format == "parquet" and all(s.equals(self.schema) for s in self.file_schemas):
            # files of the job's own schema stream batch by batch: the scanner decodes a whole row group before its
            # first batch, which the renderer then waits for (a 4,000-row file of chats: 30-110 ms against 10)
            iterator = _parquet_batches(named, batch_size, max_bytes)
        else:
            iterator = _scanned_batches(named, self.format, self.schema, batch_size)
        text = [i for i, field in enumerate(self.schema) if _holds_text(field.type)]
        within: dict[str, int] = {}
        path = self.paths[0]
        while True:
            try:
                local, batch = next(iterator)  # the file's local path, a batch
            except StopIteration:
                return
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OSError) as exc:
                raise ValueError(f"{self._next_file(path, within)}: reading failed ({_first_line(exc)}); "
                                 "the file may be truncated or corrupt") from None
            path = named.get(local, local)
            first = within.get(path, 0)
            within[path] = first + batch.num_rows
            for i in text:
                _check_utf8(batch.column(i), batch.schema.names[i], path, first)
            yield batch, path, first, "row"

    def _next_file(self, last: str, within: dict[str, int]) -> str:
        """The file a failed read was on: the last one read from, or the next one not read yet."""
        unread = [p for p in self.paths if p not in within]
        return unread[0] if last in within and unread else last

    def _json_batches(self, batch_size: int):
        def blocks():
            for path in self.paths:
                head = None if self.heads is None else self.heads.pop(path, None)
                for table, first, unit in read_json_lines(self._local(path), self.schema, batch_size, name=path,
                                                          typed=self.heads is not None, head=head):
                    yield table, path, first, unit

        for table, path, first, unit in _read_ahead(blocks()):
            for batch in table.to_batches():
                yield batch, path, first, unit
                first += batch.num_rows

    def sliceable(self) -> str | None:
        """How workers can read this input's rows themselves (``jobs/slices.py``): ``"parquet"`` for Parquet files of
        the job's own schema, ``"json"`` for JSON (byte ranges of JSON Lines cut at line ends, of a JSON array cut
        between items, of a compressed file's decompressed copy); None otherwise."""
        if self.format == "parquet" and all(s.equals(self.schema) for s in self.file_schemas):
            return "parquet"
        return "json" if self.format == "json" else None

    def record(self, piece: Any) -> Any:
        """Record a slice a worker reads (its ``segments``: job row, rows, where they start in the file, unit), so
        that its rows are named as those the parent reads; returns it."""
        for first_row, rows, first, unit in piece.segments():
            self._starts.append(first_row)
            self._segments.append(_Segment(first_row, rows, piece.path, first, unit))
        return piece

    def count_rows(self) -> int | None:
        """Rows in the input when it is cheap to know (Parquet metadata; JSON Lines read whole for the schema);
        None otherwise."""
        if self.format == "json":
            return self._json_rows
        if self.format != "parquet":
            return None
        import pyarrow.parquet as pq

        try:
            return sum(pq.ParquetFile(self._local(path)).metadata.num_rows for path in self.paths)
        except (pa.ArrowInvalid, OSError):
            return None

    # -- naming rows ---------------------------------------------------------------------------------

    def where(self, row: int) -> str | None:
        """``file, line L`` (JSON Lines) or ``file, row R`` for row ``row`` of the job, once it has been read."""
        k = bisect.bisect_right(self._starts, row) - 1
        if k < 0:
            return None
        segment = self._segments[k]
        if row >= segment.first_row + segment.rows or (segment.unit == "row" and len(self.paths) == 1):
            return None  # a row of the one Parquet/IPC file is already named by its number
        return f"{escaped(segment.path)}, {segment.unit} {segment.first + row - segment.first_row}"

    def folder_of(self, row: int) -> str | None:
        """The folder of the file that holds row ``row`` of the job, once read (None for stdin, or a row not read):
        where a relative image path in that row is read from."""
        k = bisect.bisect_right(self._starts, row) - 1
        if k < 0 or self._segments[k].path == "-":
            return None
        return os.path.dirname(os.path.abspath(self._segments[k].path))

    def name_rows(self, text: str, *, count: int = 0) -> str:
        """``text`` with ``row N`` (a row of the job) followed by where that row is: ``row N (file, line L)``."""

        def named(match: re.Match) -> str:
            where = self.where(int(match.group(1)))
            return match.group(0) if where is None else f"{match.group(0)} ({where})"

        return _ROW.sub(named, text, count=count)


def _read_ahead(items: Iterator, depth: int = 1) -> Iterator:
    """``items`` produced on a thread, ``depth`` ahead of the consumer (Arrow's parsing and checks release the GIL,
    so the next block is read while this one is labelled, as ``pyarrow.dataset``'s readahead does)."""
    import queue
    import threading

    done = object()
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        ready.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            ready.put((done, None))
        except BaseException as exc:  # raised in the consumer
            ready.put((done, exc))

    thread = threading.Thread(target=produce, name="lossmask-reader", daemon=True)
    thread.start()
    try:
        while True:
            item, error = ready.get()
            if error is not None:
                raise error
            if item is done:
                return
            yield item
    finally:
        stop.set()
        while thread.is_alive():
            try:
                ready.get(timeout=0.1)
            except queue.Empty:
                pass


_ROW = re.compile(r"\brow (\d+)\b(?! \()")


def open_inputs(input: Any, *, input_format: str | None = None, exclude: tuple[str, ...] = ()) -> InputFiles:
    """The files of ``input`` (a file, folder, glob or list of files, or ``"-"`` for stdin) and their united schema.

    ``exclude``: paths that are never input (the job's output and report). A file given by name that is
    one of them is refused; one found in a folder or by a glob is left out and said so (``skipped``).
    Stdin, pipes and FIFOs are copied to temporary files first (``InputFiles.close`` removes them).
    """
    paths, source, explicit, skipped = _list_paths(input)
    excluded = {os.path.realpath(p) for p in exclude if p is not None}
    kept = []
    for path in paths:
        real = os.path.realpath(path)
        if real in excluded:
            if explicit:
                raise ValueError(f"{path} is both an input and an output of this job ({real}); "
                                 "write the output to another path")
            skipped.append(f"skipped {path}: it is this job's output (left by an earlier run)")
            continue
        if os.path.basename(path).endswith(PARTIAL_SUFFIX):
            skipped.append(f"skipped {path}: a partial output of a job, not input")
            continue
        kept.append(path)
    if not kept:
        raise FileNotFoundError(f"{source}: holds no data file besides this job's own output")
    copies: dict[str, str] = {}
    try:
        for path in kept:
            if _read_once(path):
                copies[path] = _copy_stream(path)
            if os.path.getsize(copies.get(path, path)) == 0:
                raise ValueError(f"{path}: the file is empty (0 bytes); remove it or regenerate it")
        local = [copies.get(path, path) for path in kept]
        fmt = input_format or _format_of(kept, local, source)
        if fmt not in ("parquet", "ipc", "json"):
            raise ValueError(f"input_format={fmt!r} is not supported; pass 'parquet', 'ipc' (Arrow/Feather) or 'json' "
                             "(JSON Lines, or a JSON array; gzip, bzip2 or zstd compressed)")
        if fmt == "json":
            typed = _typed_json_inputs(local, kept)
            if typed is not None:
                schema, schemas, heads = typed
                return InputFiles(kept, fmt, source, schema, schemas, skipped, copies, heads)
        schemas = [_file_schema(path, fmt, name) for path, name in zip(local, kept)]
        return InputFiles(kept, fmt, source, unite_schemas(kept, schemas), schemas, skipped, copies)
    except BaseException:
        for copy in copies.values():
            remove_copy(copy)
        raise


def _file_schema(path: str, fmt: str, name: str | None = None) -> pa.Schema:
    name = path if name is None else name
    if fmt == "json":
        return json_lines_schema(path, name=name)
    import pyarrow.dataset as ds

    try:
        return ds.dataset(path, format=fmt).schema
    except (pa.ArrowInvalid, OSError) as exc:
        raise ValueError(f"{name}: cannot be read as {fmt} ({_first_line(exc)}); is the file complete? "
                         "(a truncated Parquet file has no footer)") from None
