"""The input files of a masking job: which files, one schema over all of them, and their rows batch by batch.

``open_inputs`` lists the files (a file, a folder, a glob or a list), leaves out the job's own
output, report and partial files, reads every file's schema and unites them: a column that only some
files have is null in the others; a column whose types cannot be united is refused, naming both files.
A file reached under two names (a symlink, a hard link, a recursive glob through a symlink loop) is read
once: files are told apart by device and inode.
Parquet and Arrow IPC are read with ``pyarrow.dataset``. JSON Lines are read here, block by block, by
Arrow's JSON reader with the types of each file's first rows (``typed_json_head``): messages of string
values as ``list<struct>``, parsed once, with no Python object per message. A file whose first rows hold
objects, messages holding lists or numbers, or a value whose type changes between rows is read as JSON
text instead (``json_lines_schema``): objects and lists of objects (messages, tool calls, tool schemas)
are kept as JSON text per message or per value (``arrow.json``), so rows whose keys or argument types
differ are read as they are. Malformed lines and non-UTF-8 bytes are refused naming the file and line. A
JSON file that holds one array of objects is read the same way, its items as rows. JSON compressed with
gzip, bzip2 or zstd is told by its magic bytes and read as it is decompressed. Input that can only be read once (stdin, a
pipe, a FIFO) is first copied to a temporary file, which is removed when the job ends.

Every batch is recorded with the file it came from and where it starts there, so that a row of the
job (``row 70``) can be named as the user knows it (``row 70 (chats.jsonl, line 71)``).
"""

from __future__ import annotations

import atexit
import bisect
import fnmatch
import functools
import glob
import io
import itertools
import json
import os
import re
import stat
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import pyarrow as pa

from .display import escaped, json_kind, quoted, shortened

FORMATS = {
    ".parquet": "parquet", ".pq": "parquet",
    ".arrow": "ipc", ".feather": "ipc", ".ipc": "ipc",
    ".jsonl": "json", ".json": "json", ".ndjson": "json",
}
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".zstd": "zstd"}  # of JSON files
_MAGIC = ((b"\x1f\x8b", "gzip"), (b"BZh", "bz2"), (b"\x28\xb5\x2f\xfd", "zstd"))
PARTIAL_SUFFIX = ".partial"
INFER_LINES = 10_000  # JSON Lines: the rows of each file whose values fix the column types
# One line of JSON Lines (or one item of a JSON array) is held in memory whole: without a bound, a file
# with no line end (/dev/zero, a binary file read as JSON) would take all the memory there is.
MAX_LINE_BYTES = 64 << 20
STDIN = "<stdin>"  # the name of input "-" in messages


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

    def close(self) -> None:
        """Remove the temporary copies of stdin and pipes (also done at exit, should a job not call this)."""
        for copy in self.copies.values():
            _remove_copy(copy)

    def _local(self, path: str) -> str:
        return self.copies.get(path, path)

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
        the job's own schema, ``"json"`` for JSON Lines (the files' bytes are cut at line ends, once it is known that
        they are neither compressed nor a JSON array); None otherwise."""
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


def _parquet_batches(named: dict[str, str], batch_size: int,
                     max_bytes: int | None = None) -> Iterator[tuple[str, pa.RecordBatch]]:
    """``(local path, batch)`` for Parquet files read one after another, a batch at a time. With ``max_bytes``,
    a file's batches hold as many rows as its mean row (from the footer's uncompressed sizes) fits in that many
    bytes: a batch cut from a larger one would keep the whole decoded read alive until its last slice is written."""
    import pyarrow.parquet as pq

    for local in named:
        with pq.ParquetFile(local, pre_buffer=False) as parquet:
            rows = batch_size if max_bytes is None else min(batch_size, _rows_in_bytes(parquet.metadata, max_bytes))
            for batch in parquet.iter_batches(batch_size=rows, use_threads=True):
                yield local, batch


def _rows_in_bytes(metadata: Any, max_bytes: int) -> int:
    """How many of a Parquet file's rows fit in ``max_bytes``, by the mean of its row groups' uncompressed sizes."""
    rows = metadata.num_rows
    size = sum(metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups))
    return max(1, int(max_bytes * rows // size)) if rows and size else max(1, rows)


def _scanned_batches(named: dict[str, str], fmt: Any, schema: pa.Schema,
                     batch_size: int) -> Iterator[tuple[str, pa.RecordBatch]]:
    """``(local path, batch)`` through ``pyarrow.dataset``, each file's columns read as ``schema`` has them."""
    import pyarrow.dataset as ds

    if fmt == "parquet":
        # pre_buffer caches the ranges it has read until the file is closed: memory would grow with the file
        fmt = ds.ParquetFileFormat(default_fragment_scan_options=ds.ParquetFragmentScanOptions(pre_buffer=False))
    dataset = ds.dataset(list(named), format=fmt, schema=schema)
    scanner = dataset.scanner(batch_size=batch_size, batch_readahead=1, fragment_readahead=1, use_threads=True)
    for tagged in scanner.scan_batches():
        yield tagged.fragment.path, tagged.record_batch


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
            _remove_copy(copy)
        raise


def _list_paths(input: Any) -> tuple[list[str], str, bool, list[str]]:
    """``(paths, a name for errors, whether the paths were named one by one, messages on paths left out)``."""
    if isinstance(input, (list, tuple)):
        paths = [os.fspath(p) for p in input]
        if not paths:
            raise FileNotFoundError("input=[]: no file given")
        missing = [p for p in paths if p != "-" and not os.path.exists(p)]
        if missing:
            raise FileNotFoundError(f"{missing[0]}: no such file or folder")
        paths = [STDIN if p == "-" else p for p in paths]
        return paths, (f"{len(paths)} files" if len(paths) != 1 else paths[0]), True, []
    source = os.fspath(input)
    if source == "-":
        return [STDIN], STDIN, True, []
    if any(ch in source for ch in "*?["):
        paths, skipped = _once_each(glob_files(source))
        if not paths:
            raise FileNotFoundError(f"{source}: the pattern matches no file")
        return paths, source, False, skipped
    if os.path.isdir(source):
        found = sorted(
            os.path.join(root, name) for root, folders, names in os.walk(source) for name in names
            if not name.startswith((".", "_"))
        )
        paths, skipped = _once_each(found)
        if not paths:
            raise FileNotFoundError(f"{source}: the folder holds no data file")
        return paths, source, False, skipped
    if os.path.exists(source):
        return [source], source, True, []
    raise FileNotFoundError(f"{source}: no such file or folder")


def _once_each(paths: list[str]) -> tuple[list[str], list[str]]:
    """The regular files of ``paths``, each under the first of its names; and messages on those left out.

    A FIFO or device in a folder is left out: opening it could wait for ever for a writer."""
    kept, seen, skipped, again = [], {}, [], []
    for path in paths:
        try:
            info = os.stat(path)
        except OSError as exc:
            skipped.append(f"skipped {path}: {exc.strerror or exc} (a broken link?)")
            continue
        if not stat.S_ISREG(info.st_mode):
            skipped.append(f"skipped {path}: not a regular file (a FIFO, socket or device); name it alone to read it")
            continue
        file = (info.st_dev, info.st_ino)  # one file under two names: symbolic links and hard links alike
        if file in seen:
            again.append((path, seen[file]))
            continue
        seen[file] = path
        kept.append(path)
    if len(again) <= 3:
        skipped += [f"skipped {path}: the same file as {first} ({_link_kind(path, first)}), read once"
                    for path, first in again]
    else:
        skipped.append(f"skipped {len(again):,} paths that name files already read (through symbolic or hard links), "
                       f"e.g. {again[0][0]}, the same file as {again[0][1]}")
    return kept, skipped


def _link_kind(path: str, first: str) -> str:
    return "a symbolic link" if os.path.realpath(path) == os.path.realpath(first) else "a hard link"


def glob_files(pattern: str) -> list[str]:
    """The files matching ``pattern`` in sorted order, as ``glob.glob(pattern, recursive=True)`` finds them, except
    that ``**`` does not enter a folder that holds itself (``sub/up -> ..``): ``glob`` would list every file once
    per turn of such a loop (41 times, up to the kernel's limit on symbolic links), and 2^40 times with two loops.
    Names starting with ``.`` are matched only by pattern parts that start with ``.``, as in ``glob``."""
    if "**" not in pattern:
        return sorted(path for path in glob.glob(pattern) if os.path.isfile(path))
    parts = pattern.split(os.sep)
    fixed = 0
    while fixed < len(parts) and not glob.has_magic(parts[fixed]):
        fixed += 1
    base = os.sep.join(parts[:fixed]) or (os.sep if pattern.startswith(os.sep) else "")
    rest = tuple(parts[fixed:])
    found: list[str] = []

    hidden = any(part.startswith(".") for part in rest)

    def walk(folder: str, names: tuple[str, ...], ancestors: frozenset) -> None:
        try:
            entries = sorted(os.scandir(folder or os.curdir), key=lambda entry: entry.name)
        except OSError:
            return
        for entry in entries:
            path = os.path.join(folder, entry.name) if folder else entry.name
            inner = names + (entry.name,)
            try:
                is_dir = entry.is_dir()  # through symbolic links, as glob goes
            except OSError:
                continue
            if is_dir and (hidden or not entry.name.startswith(".")):
                real = os.path.realpath(path)
                if real not in ancestors:  # a folder that holds itself is not entered again
                    walk(path, inner, ancestors | {real})
            elif not is_dir and _path_matches(rest, inner) and os.path.isfile(path):
                found.append(path)

    if os.path.isdir(base or os.curdir):
        walk(base, (), frozenset({os.path.realpath(base or os.curdir)}))
    return sorted(found)


def _path_matches(parts: tuple[str, ...], names: tuple[str, ...]) -> bool:
    """Whether the path ``names`` (its parts) matches the pattern ``parts``, ``**`` standing for any folders."""
    if not parts:
        return not names
    if parts[0] == "**":
        return any(_path_matches(parts[1:], names[i:]) for i in range(len(names) + 1)
                   if not any(name.startswith(".") for name in names[:i]))
    return bool(names) and _name_matches(parts[0], names[0]) and _path_matches(parts[1:], names[1:])


def _name_matches(part: str, name: str) -> bool:
    if name.startswith(".") and not part.startswith("."):
        return False
    return fnmatch.fnmatch(name, part)


def _read_once(path: str) -> bool:
    """Whether ``path`` can only be read once: stdin, a pipe or FIFO (``<(zcat x.gz)`` is /dev/fd/63), a device.
    Anything under /dev or /proc counts, since on some systems /dev/stdin shares its offset with fd 0."""
    if path == STDIN or path.startswith(("/dev/", "/proc/")):
        return True
    mode = os.stat(path).st_mode
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


_COPIES: set[str] = set()


def _copy_stream(path: str) -> str:
    """Copy stdin, a pipe or a FIFO to a temporary file once, and return its path.

    Unless the stream is a compressed or a Parquet/Arrow file, a run of ``MAX_LINE_BYTES`` without a line
    end stops the copy there (``/dev/zero`` would otherwise fill the disk). A temporary folder that is full
    or cannot be written is one line naming the stream and ``TMPDIR``, and what to do."""
    import tempfile

    try:
        fd, copy = tempfile.mkstemp(prefix="lossmask-input-", suffix=".copy")
    except OSError as exc:
        raise _no_room(path, tempfile.gettempdir(), exc) from None
    _COPIES.add(copy)
    if len(_COPIES) == 1:
        atexit.register(_remove_copies)
    reading = False
    try:
        with os.fdopen(fd, "wb") as out, (sys.stdin.buffer if path == STDIN else open(path, "rb")) as stream:
            check, line, since = None, 1, 0
            while True:
                reading = True
                chunk = stream.read(1 << 20)
                reading = False
                if not chunk:
                    break
                if check is None:
                    check = not chunk.startswith((b"PAR1", b"ARROW1", b"FEA1", *(magic for magic, _ in _MAGIC)))
                if check:
                    end = chunk.rfind(b"\n")
                    if end < 0:
                        since += len(chunk)
                    else:
                        line += chunk.count(b"\n")
                        since = len(chunk) - end - 1
                    if since > MAX_LINE_BYTES:
                        raise _too_long(path, "line", line)
                out.write(chunk)
    except OSError as exc:
        _remove_copy(copy)
        if reading:  # the stream's own error
            raise
        raise _no_room(path, os.path.dirname(copy), exc) from None
    except BaseException:
        _remove_copy(copy)
        raise
    return copy


def _no_room(path: str, folder: str, exc: OSError) -> OSError:
    error = OSError(f"{path}: cannot copy the stream to a temporary file in TMPDIR ({folder}): {exc.strerror or exc}; "
                    "set TMPDIR to a folder with room for the whole input, or pass the input as a file")
    error.errno = exc.errno
    return error


def _remove_copy(copy: str) -> None:
    _COPIES.discard(copy)
    try:
        os.remove(copy)
    except OSError:
        pass


def _remove_copies() -> None:
    for copy in list(_COPIES):
        _remove_copy(copy)


def _too_long(name: str, unit: str, number: int) -> ValueError:
    return ValueError(
        f"{name}, {unit} {number}: longer than {MAX_LINE_BYTES >> 20} MiB, the limit on one row of JSON "
        f"(lossmask.jobs.inputs.MAX_LINE_BYTES); is the file JSON at all? Store rows this long in Parquet"
    )


def _suffix_format(path: str) -> str | None:
    """The format a file's suffix names, through a compression suffix (``.jsonl.gz``: JSON)."""
    root, suffix = os.path.splitext(path.lower())
    if suffix in COMPRESSIONS:
        kind = FORMATS.get(os.path.splitext(root)[1])
        return kind if kind == "json" else None
    return FORMATS.get(suffix)


def _sniffed_format(path: str) -> str | None:
    """The format of a file without a known suffix, from its first bytes (decompressed, for JSON)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
        if head.startswith(b"PAR1"):
            return "parquet"
        if head.startswith((b"ARROW1", b"FEA1")):
            return "ipc"
        if _codec_of(head) is not None:
            with _open_json(path)[0] as fh:
                head = fh.read(1024)
        return "json" if head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith((b"{", b"[")) else None
    except (OSError, EOFError, ValueError, pa.ArrowException):
        return None


def _format_of(paths: list[str], local: list[str], source: str) -> str:
    kinds = {_suffix_format(p) or _sniffed_format(f) for p, f in zip(paths, local)}
    if None in kinds or len(kinds) != 1:
        suffixes = sorted({os.path.splitext(p)[1] or "(none)" for p in paths})
        raise ValueError(
            f"{source}: cannot tell the format from the file suffixes {suffixes} or the first bytes; name the files "
            ".parquet, .arrow or .jsonl (.jsonl.gz, .jsonl.zst, .jsonl.bz2), or pass input_format= "
            "(--input-format parquet|ipc|json)"
        )
    return kinds.pop()


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


def unite_schemas(paths: list[str], schemas: list[pa.Schema]) -> pa.Schema:
    """One schema holding every file's columns (in order of appearance); conflicting types are refused."""
    united = schemas[0]
    for path, schema in zip(paths[1:], schemas[1:]):
        try:
            united = pa.unify_schemas([united, schema], promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            for field in schema:
                if field.name in united.names and not _unites(united.field(field.name), field):
                    first = next(p for p, s in zip(paths, schemas) if field.name in s.names)
                    raise ValueError(
                        f"{path}: column {field.name!r} is {field.type} here but {united.field(field.name).type} in "
                        f"{first}; files of one input must agree on column types (cast one, or mask them separately)"
                    ) from None
            raise
    return united


def _unites(a: pa.Field, b: pa.Field) -> bool:
    try:
        pa.unify_schemas([pa.schema([a]), pa.schema([b])], promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return False
    return True


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# -- JSON Lines, JSON arrays -----------------------------------------------------------------------------


def json_lines_schema(path: str, *, name: str | None = None) -> pa.Schema:
    """Column types from the first ``INFER_LINES`` rows of a JSON Lines file (or JSON array file).

    Lists of integers are ``list<int64>`` (token ids), strings, numbers and booleans their Arrow
    types; objects, and anything holding an object, are JSON text (``arrow.json``), a list of objects
    as a list of JSON texts (one per message), so that no later row can fail to fit. ``name``: the
    file as the user named it, for messages (``path`` may be a temporary copy of a pipe).
    """
    name = path if name is None else name
    rows = []
    with _json_rows(path, name) as (unit, records):
        for number, raw in records:
            rows.append(_parse_line(name, number, raw, unit))
            if len(rows) >= INFER_LINES:
                break
    if not rows:
        raise ValueError(f"{name}: the file holds no JSON object (only blank lines)")
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    return pa.schema([_json_field(name, [row.get(name) for row in rows]) for name in names])


NUMERIC_KEYS = b"lossmask.numeric_keys"  # field metadata: keys of the JSON objects in it that hold numbers


def _json_field(name: str, values: list) -> pa.Field:
    """A column's field; for JSON text, the keys that held numbers in the rows read (weights, docs/weights.md:
    whether a ``loss_weights`` column is written is decided from the schema, before the rows are read)."""
    arrow_type = _infer_type(values)
    if "json" not in str(arrow_type):
        return pa.field(name, arrow_type)
    keys: set[str] = set()
    stack = [v for v in values if isinstance(v, (dict, list))]
    while stack and len(keys) < 64:
        value = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(item, (int, float)) and not isinstance(item, bool) and isinstance(key, str):
                keys.add(key)
            elif isinstance(item, (dict, list)):
                stack.append(item)
    return pa.field(name, arrow_type, metadata={NUMERIC_KEYS: ",".join(sorted(keys)).encode()} if keys else None)


def _infer_type(values: list) -> pa.DataType:
    present = [v for v in values if v is not None]
    if not present:
        return pa.json_()
    if all(isinstance(v, list) for v in present):
        items = [item for v in present for item in v]
        if all(isinstance(item, int) and not isinstance(item, bool) for item in items):
            return pa.list_(pa.int64())
        if any(isinstance(item, (dict, list)) for item in items):
            return pa.list_(pa.json_())
    elif any(isinstance(v, (dict, list)) for v in present):
        return pa.json_()
    try:
        inferred = pa.array(present).type
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        return pa.json_()
    return pa.json_() if pa.types.is_null(inferred) else inferred


def _codec_of(head: bytes) -> str | None:
    return next((codec for magic, codec in _MAGIC if head.startswith(magic)), None)


def _open_json(path: str) -> tuple[Any, str | None]:
    """``(binary file, codec)``: the file, decompressed as it is read when its magic bytes name gzip, bzip2 or zstd
    (whatever its suffix says: a ``.jsonl`` that is gzip is read, a ``.gz`` that is not is read as it is)."""
    with open(path, "rb") as fh:
        codec = _codec_of(fh.read(4))
    if codec == "gzip":
        import gzip

        return gzip.open(path, "rb"), codec
    if codec == "bz2":
        import bz2

        return bz2.open(path, "rb"), codec
    if codec == "zstd":  # the standard library has no zstd before Python 3.14; pyarrow does
        return io.BufferedReader(pa.input_stream(path, compression="zstd"), buffer_size=1 << 16), codec
    return open(path, "rb", buffering=1 << 16), None


@contextmanager
def _json_rows(path: str, name: str):
    """``(unit, records)``: records are ``(number, one row's JSON text as one line of bytes)`` for each non-blank line
    of JSON Lines (unit ``"line"``, from 1), or each item of a file holding one JSON array (unit ``"row"``, from 0)."""
    fh, codec = _open_json(path)
    with fh:
        try:
            head = fh.peek(1 << 12)[: 1 << 12]
        except (OSError, EOFError, ValueError, pa.ArrowException) as exc:
            raise _not_decompressed(name, codec, exc) from None
        array = head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")
        records = _array_items(fh, name) if array else _lines(fh, name)
        yield ("row" if array else "line"), (records if codec is None else _decompressing(records, name, codec))


def _decompressing(records: Iterator, name: str, codec: str) -> Iterator:
    """``records``, with a failure of the decompression (a truncated or corrupt file) as one line naming the file."""
    import zlib

    try:
        yield from records
    except (OSError, EOFError, zlib.error, pa.ArrowException) as exc:
        raise _not_decompressed(name, codec, exc) from None


def _not_decompressed(name: str, codec: str | None, exc: BaseException) -> ValueError:
    return ValueError(f"{name}: cannot be read as {codec or 'uncompressed'} data ({_first_line(exc)}); "
                      "the file may be truncated or corrupt")


def _lines(fh, name: str) -> Iterator[tuple[int, bytes]]:
    """``(line number, bytes)`` for each non-blank line; a line over ``MAX_LINE_BYTES`` is refused as it is read."""
    for number, raw in enumerate(iter(functools.partial(fh.readline, MAX_LINE_BYTES + 1), b""), start=1):
        if len(raw) - raw.endswith(b"\n") > MAX_LINE_BYTES:
            raise _too_long(name, "line", number)
        if raw.strip():
            yield number, raw


_SPACE = re.compile(r"[ \t\r\n]*")


def _array_items(fh, name: str) -> Iterator[tuple[int, bytes]]:
    """``(item number, its JSON text on one line)`` for each item of a file holding one JSON array, read in
    chunks: one item at a time is held in memory (at most ``MAX_LINE_BYTES``), not the whole array."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8-sig")()
    scan = json.JSONDecoder().raw_decode
    text, pos, index, ended = "", 0, 0, False

    def read(size: int = 1 << 20) -> bool:
        """Append the next ``size`` bytes to ``text`` (dropping what was parsed); False at the end of the file."""
        nonlocal text, pos, ended
        data = fh.read(size)
        ended = not data
        try:
            text = text[pos:] + decoder.decode(data, final=ended)
        except UnicodeDecodeError as exc:
            raise ValueError(f"{name}, row {index}: not UTF-8 (byte 0x{exc.object[exc.start]:02x}); re-encode the file "
                             "as UTF-8") from None
        pos = 0
        return not ended

    def next_char() -> str:
        nonlocal pos
        while True:
            pos = _SPACE.match(text, pos).end()
            if pos < len(text):
                return text[pos]
            if not read():
                return ""

    if next_char() != "[":
        raise ValueError(f"{name}: not a JSON array")
    pos += 1
    closed = next_char() == "]"
    while not closed:
        if next_char() == "":
            raise ValueError(f"{name}, row {index}: the file ends inside the array (is it truncated?)")
        while True:
            try:
                value, end = scan(text, pos)
                break
            except json.JSONDecodeError as exc:
                if ended:
                    raise ValueError(f"{name}, row {index}: not valid JSON ({exc.msg})") from None
                if len(text) - pos > MAX_LINE_BYTES:
                    raise _too_long(name, "row", index) from None
                read(max(1 << 20, 2 * (len(text) - pos)))  # the item may go on beyond the text read so far
            except RecursionError:
                raise _too_deep(name, "row", index) from None
        if not isinstance(value, dict):
            raise ValueError(f"{name}, row {index}: holds {json_kind(value)}, not a JSON object (one row per item)")
        # JSON text holds no raw line break inside a string: as one line, the item is read as JSON Lines are
        yield index, text[pos:end].replace("\n", " ").replace("\r", " ").encode()
        index, pos = index + 1, end
        after = next_char()
        if after == "]":
            closed = True
        elif after == ",":
            pos += 1
        else:
            raise ValueError(f"{name}, row {index - 1}: expected ',' or ']' after the row, found "
                             f"{after!r}" if after else f"{name}: the file ends inside the array (is it truncated?)")
    pos += 1
    if next_char() != "":
        raise ValueError(f"{name}: holds more after the JSON array ends; a JSON file holds one array of rows "
                         "(or name it .jsonl: one object per line)")


def read_json_lines(path: str, schema: pa.Schema, batch_size: int, *, name: str | None = None, typed: bool = False,
                    head: _Head | None = None) -> Iterator[tuple[pa.Table, int, str]]:
    """``(table, number of its first row, unit)`` for runs of at most ``batch_size`` consecutive non-blank lines
    (unit ``"line"``), or items of a JSON array (``"row"``). ``typed``: ``schema`` came from Arrow's reading of the
    first rows (``typed_json_head``), which reads every block; ``head``: those rows, already read."""
    name = path if name is None else name
    block: list[bytes] = []
    first = following = 0
    with _json_rows(path, name) as (unit, records):
        if head is not None:
            yield from _head_blocks(head, batch_size)
            records = itertools.islice(records, len(head.numbers), None)
        for number, raw in records:
            if block and (number != following or len(block) == batch_size):
                yield _json_table(name, block, first, schema, unit, typed=typed), first, unit
                block = []
            if not block:
                first = number
            block.append(raw)
            following = number + 1
        if block:
            yield _json_table(name, block, first, schema, unit, typed=typed), first, unit


def _head_blocks(head: _Head, batch_size: int) -> Iterator[tuple[pa.Table, int, str]]:
    """The rows of ``head`` as ``read_json_lines`` yields rows: at most ``batch_size``, on consecutive lines."""
    numbers, start = head.numbers, 0
    while start < len(numbers):
        end = start + 1
        while end < len(numbers) and end - start < batch_size and numbers[end] == numbers[end - 1] + 1:
            end += 1
        yield head.table.slice(start, end - start), numbers[start], head.unit
        start = end


def _json_table(path: str, lines: list[bytes], first: int, schema: pa.Schema, unit: str = "line", *,
                typed: bool = False) -> pa.Table:
    """One block of lines as a table of ``schema``: Arrow's reader when the schema is typed (or holds no JSON text),
    else Python, which also reads the lines Arrow's reader refuses, naming the line and the problem."""
    if typed or not any(_holds_json(field.type) for field in schema):
        reading = _reading_schema(schema) if typed else schema
        table = _arrow_json(_joined(lines), reading, lines)
        if table is not None and table.num_rows == len(lines) and table.schema == reading:
            return _with_json_nulls(table, schema) if typed else table
    rows = [_parse_line(path, first + i, raw, unit) for i, raw in enumerate(lines)]
    known = set(schema.names)
    for i, row in enumerate(rows):
        extra = [key for key in row if key not in known]
        if extra:
            raise ValueError(
                f"{path}, {unit} {first + i}: key {quoted(extra[0])} appears here but in none of the first {INFER_LINES:,} "
                f"rows of the file, which fix its columns; give every row the key (null where absent), "
                "or convert the file to Parquet"
            )
    return pa.table([_json_column(path, first, field, [row.get(field.name) for row in rows], unit) for field in schema],
                    schema=schema)


# -- JSON Lines as typed Arrow ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Head:
    """The first rows of a JSON Lines file as Arrow read them for its schema; row ``i`` is line (or item) ``numbers[i]``."""

    table: pa.Table
    numbers: list[int]
    unit: str
    whole: bool  # the rows are all the file holds


def _typed_json_inputs(local: list[str], names: list[str]):
    """``(united schema, each file's schema, each file's head)`` when every file's first rows read as typed Arrow
    (``typed_json_head``) and their schemas unite; None when the files are to be read as JSON text instead."""
    heads, schemas = {}, []
    for path, name in zip(local, names):
        head = typed_json_head(path, name=name)
        if head is None:
            return None
        heads[name] = head
        schemas.append(head.table.schema)
    try:
        united = unite_schemas(names, schemas)
    except (ValueError, pa.ArrowException):
        return None  # the reading as JSON text unites them, or says which column differs
    # a file whose columns are fewer than the united ones is read again, as the united schema
    return united, schemas, {name: head for name, head in heads.items() if head.table.schema == united}


def typed_json_head(path: str, *, name: str | None = None) -> _Head | None:
    """The first ``INFER_LINES`` rows of a JSON Lines (or JSON array) file read by Arrow's JSON reader, its types
    inferred, when they are types that no later row of the same shape reads otherwise in Python (``_typed_field``):
    strings, integers, floats, booleans, lists of them, and lists of objects whose values are all strings
    (``messages`` of ``{role, content}``, ShareGPT's ``{from, value}``) as ``list<struct>``. None when any row or
    column is otherwise (a value whose type changes between rows, an object, a message holding a list or a
    number, bytes that are not UTF-8, a line that is not JSON): the file is then read as JSON text
    (``json_lines_schema``), which also names the line at fault."""
    name = path if name is None else name
    numbers, lines, whole = [], [], True
    with _json_rows(path, name) as (unit, records):
        for number, raw in records:
            if len(lines) >= INFER_LINES:
                whole = False
                break
            numbers.append(number)
            lines.append(raw)
    if not lines:
        return None
    data = _joined(lines)
    table = _arrow_json(data, None, lines)
    if table is None or table.num_rows != len(lines):
        return None
    fields = [_typed_field(field) for field in table.schema]
    if any(field is None for field in fields):
        return None
    schema = pa.schema(fields)
    reading = _reading_schema(schema)
    if table.schema != reading:  # a timestamp's text, an empty list's type: read again as the types say
        table = _arrow_json(data, reading, lines)
        if table is None or table.num_rows != len(lines) or table.schema != reading:
            return None
    # one chunk: a batch sliced from it is one batch (Arrow's reader gives a chunk per block of bytes)
    return _Head(_with_json_nulls(table, schema).combine_chunks(), numbers, unit, whole)


_SCALARS = (pa.string(), pa.int64(), pa.float64(), pa.bool_())


def _typed_field(field: pa.Field) -> pa.Field | None:
    """The field for a column as Arrow's reader inferred it, when Python's reading of the same values gives the same
    type (``_infer_type``), or would where Arrow's differs: text that looks like a date stays text, a column of
    nulls is JSON text, a list only ever empty is ``list<int64>``; None for any other type."""
    arrow_type = field.type
    if pa.types.is_null(arrow_type):
        return pa.field(field.name, pa.json_())
    if pa.types.is_timestamp(arrow_type):
        return pa.field(field.name, pa.string())
    if arrow_type in _SCALARS:
        return field
    if not pa.types.is_list(arrow_type):
        return None
    item = arrow_type.value_type
    if pa.types.is_null(item):
        return pa.field(field.name, pa.list_(pa.int64()))
    if pa.types.is_timestamp(item):
        return pa.field(field.name, pa.list_(pa.string()))
    if item in _SCALARS:
        return field
    if pa.types.is_struct(item) and all(pa.types.is_null(item.field(i).type) or pa.types.is_timestamp(item.field(i).type)
                                        or pa.types.is_string(item.field(i).type) for i in range(item.num_fields)):
        return pa.field(field.name, pa.list_(pa.struct([pa.field(item.field(i).name, pa.string())
                                                        for i in range(item.num_fields)])))
    return None


def _reading_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` as Arrow's reader is asked for it: a column of JSON text (only nulls so far) as nulls."""
    return pa.schema([pa.field(f.name, pa.null()) if _holds_json(f.type) else f for f in schema])


def _with_json_nulls(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` as read by ``_reading_schema(schema)``, its columns of nulls typed as ``schema`` says."""
    for i, field in enumerate(schema):
        if _holds_json(field.type):
            table = table.set_column(i, field, pa.nulls(table.num_rows, field.type))
    return table


# an integer beyond int64, which Arrow's reader takes for a float but Python's reading refuses or keeps as text
_LONG_INTEGER = re.compile(rb"(?<![0-9.])[0-9]{19,}(?![0-9.eE])")


def _arrow_json(data: bytes, schema: pa.Schema | None, lines: list[bytes]) -> pa.Table | None:
    """``data`` (JSON Lines) read by Arrow's JSON reader as ``schema`` (or with the types it infers); None where the
    reading is left to Python: bytes that are not UTF-8 (Arrow's reader does not check), a line it refuses (not JSON,
    not an object, a value of another type, a key not in ``schema``, a lone surrogate), a line that may nest deeper
    than it can read (``ARROW_MAX_BRACKETS``), a long integer in a float. ``data``: ``lines`` joined."""
    import pyarrow.json as pj

    if _may_nest_deep(data, lines):
        return None
    longest = max(map(len, lines))
    parse = (pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="error") if schema is not None
             else pj.ParseOptions())
    try:
        table = pj.read_json(io.BytesIO(data), read_options=pj.ReadOptions(block_size=max(1 << 22, 2 * longest)),
                             parse_options=parse)
        table.validate(full=True)  # UTF-8 (at memory speed: far less than decoding the bytes in Python)
        table.schema.names  # noqa: B018 - a key that is not UTF-8 fails here
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, UnicodeDecodeError):
        return None
    floats = [f for f in table.schema if pa.types.is_floating(getattr(f.type, "value_type", f.type))]
    if floats and _LONG_INTEGER.search(data):
        return None
    return table


# Arrow's JSON reader recurses once per level of nesting and crashes the process (a segfault) somewhere past
# 15,000 levels; Python's reader stops at about 1,000 with an error naming the line. A line with more opening
# brackets than this (inside strings or not: an upper bound on its depth) is read by Python.
ARROW_MAX_BRACKETS = 2048


def _may_nest_deep(data: bytes, lines: list[bytes]) -> bool:
    """Whether a line of ``data`` holds more than ``ARROW_MAX_BRACKETS`` opening brackets (counted in C)."""
    if data.count(b"[") + data.count(b"{") <= ARROW_MAX_BRACKETS:
        return False
    return any(line.count(b"[") + line.count(b"{") > ARROW_MAX_BRACKETS for line in lines)


def _joined(lines: list[bytes]) -> bytes:
    return b"".join(line if line.endswith(b"\n") else line + b"\n" for line in lines)


def _holds_json(arrow_type: pa.DataType) -> bool:
    if getattr(arrow_type, "extension_name", None) == "arrow.json":
        return True
    return pa.types.is_list(arrow_type) and _holds_json(arrow_type.value_type)


def _json_column(path: str, first: int, field: pa.Field, values: list, unit: str = "line") -> pa.Array:
    if _holds_json(field.type):
        if pa.types.is_list(field.type):
            for i, value in enumerate(values):
                if value is not None and not isinstance(value, list):
                    raise ValueError(f"{path}, {unit} {first + i}: {field.name!r} is {json_kind(value)}, "
                                     f"not a list as in the file's first rows")
            texts = [None if v is None else [json.dumps(item, ensure_ascii=False) for item in v] for v in values]
            storage = pa.array(texts, type=pa.list_(pa.string()))
            return pa.ListArray.from_arrays(storage.offsets, pa.ExtensionArray.from_storage(pa.json_(), storage.values),
                                            mask=storage.is_null() if storage.null_count else None)
        storage = pa.array([None if v is None else json.dumps(v, ensure_ascii=False) for v in values], pa.string())
        return pa.ExtensionArray.from_storage(pa.json_(), storage)
    if pa.types.is_list(field.type) and pa.types.is_struct(field.type.value_type):
        _check_message_keys(path, first, field, values, unit)
    try:
        return pa.array(values, type=field.type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
        pass
    for i, value in enumerate(values):
        try:
            pa.array([value], type=field.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
            shown = shortened(json.dumps(value, ensure_ascii=False), 60)
            raise ValueError(
                f"{path}, {unit} {first + i}: {field.name!r} holds {shown}, which does not fit {field.type} "
                f"(its type in the file's first rows); fix the row, or convert the file to Parquet with one type"
            ) from None
    raise ValueError(f"{path}, {unit}s {first}-{first + len(values) - 1}: column {field.name!r} cannot be read as "
                     f"{field.type}")


def _check_message_keys(path: str, first: int, field: pa.Field, values: list, unit: str) -> None:
    """Refuse an object of a typed list column (a message) with a key its struct lacks: Arrow would leave it out."""
    struct = field.type.value_type
    known = {struct.field(i).name for i in range(struct.num_fields)}
    for i, value in enumerate(values):
        for item in value if isinstance(value, list) else ():
            extra = [key for key in item if key not in known] if isinstance(item, dict) else []
            if extra:
                raise ValueError(
                    f"{path}, {unit} {first + i}: an object of {field.name!r} has key {quoted(extra[0])}, which none has in the "
                    f"first {INFER_LINES:,} rows of the file, whose objects fix its fields; give it to an object of the "
                    "first rows (null where absent), or convert the file to Parquet"
                )


# an escaped UTF-16 surrogate (\ud800-\udfff): half of a pair, or alone, which is not text
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def _parse_line(path: str, line: int, raw: bytes, unit: str = "line") -> dict:
    try:
        # a byte order mark may open the file
        text = raw.decode("utf-8-sig" if (unit, line) == ("line", 1) else "utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}, {unit} {line}: not UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} of "
                         f"the {unit}); re-encode the file as UTF-8") from None
    try:
        value = json.loads(text.rstrip("\r\n"))
    except ValueError as exc:
        reason = getattr(exc, "msg", str(exc))
        column = getattr(exc, "colno", None)
        raise ValueError(f"{path}, {unit} {line}: not valid JSON ({reason}"
                         f"{f' at column {column}' if column else ''})") from None
    except RecursionError:
        raise _too_deep(path, unit, line) from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}, {unit} {line}: holds {json_kind(value)}, not a JSON object (one row per line)")
    if _SURROGATE.search(raw):
        _check_surrogates(path, unit, line, value)
    return value


def _check_surrogates(path: str, unit: str, line: int, row: dict) -> None:
    """Refuse a string holding a lone surrogate (``"\\ud800"``): it is no character, and no UTF-8 can hold it."""
    for key, value in row.items():
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"{path}, {unit} {line}: {quoted(key)} holds a lone UTF-16 surrogate (\\u{ord(exc.object[exc.start]):04x}), "
                "half of a pair that is not text; remove it or write the whole character"
            ) from None


def _too_deep(path: str, unit: str, line: int) -> ValueError:
    return ValueError(f"{path}, {unit} {line}: nested too deep to read (Python's JSON reader stops at about "
                      f"{sys.getrecursionlimit():,} levels of arrays and objects); flatten it, or store it as a string")


# -- strings in Parquet and Arrow files -----------------------------------------------------------------


def _holds_text(arrow_type: pa.DataType) -> bool:
    """Whether a column of this type holds strings anywhere (in lists, structs, maps, dictionaries)."""
    storage = getattr(arrow_type, "storage_type", arrow_type)
    if pa.types.is_string(storage) or pa.types.is_large_string(storage) or pa.types.is_string_view(storage):
        return True
    if pa.types.is_dictionary(storage):
        return _holds_text(storage.value_type)
    if pa.types.is_map(storage):
        return _holds_text(storage.key_type) or _holds_text(storage.item_type)
    return any(_holds_text(storage.field(i).type) for i in range(storage.num_fields))


def _check_utf8(column: pa.Array, name: str, path: str, first: int) -> None:
    """Refuse strings that are not UTF-8 (Parquet and Arrow files are not checked when read), naming the row."""
    try:
        column.validate(full=True)
    except pa.ArrowInvalid as exc:
        bad = next((row for row in range(len(column)) if not _decodes(column.slice(row, 1))), None)
        where = f"{path}, row {first + bad}" if bad is not None else path
        raise ValueError(f"{where}: column {name!r} holds text that is not UTF-8 ({_first_line(exc)}); re-encode it "
                         "as UTF-8, or store it as binary") from None


def _decodes(row: pa.Array) -> bool:
    try:
        row.to_pylist()
    except UnicodeDecodeError:
        return False
    return True
