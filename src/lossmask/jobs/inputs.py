"""The input files of a masking job: which files, one schema over all of them, and their rows batch by batch.

``open_inputs`` lists the files (a file, a folder, a glob or a list), leaves out the job's own
output, report and partial files, reads every file's schema and unites them: a column that only some
files have is null in the others; a column whose types cannot be united is refused, naming both files.
Parquet and Arrow IPC are read with ``pyarrow.dataset``. JSON Lines are read here, block by block:
objects and lists of objects (messages, tool calls, tool schemas) are kept as JSON text per message
or per value (``arrow.json``), so rows whose keys or argument types differ are read as they are;
malformed lines and non-UTF-8 bytes are refused naming the file and line.

Every batch is recorded with the file it came from and where it starts there, so that a row of the
job (``row 70``) can be named as the user knows it (``row 70 (chats.jsonl, line 71)``).
"""

from __future__ import annotations

import bisect
import glob
import io
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Iterator

import pyarrow as pa

FORMATS = {
    ".parquet": "parquet", ".pq": "parquet",
    ".arrow": "ipc", ".feather": "ipc", ".ipc": "ipc",
    ".jsonl": "json", ".json": "json", ".ndjson": "json",
}
PARTIAL_SUFFIX = ".partial"
INFER_LINES = 10_000  # JSON Lines: the rows of each file whose values fix the column types


@dataclass(frozen=True)
class _Segment:
    """One batch as read: rows ``[first_row, first_row + rows)`` of the job are rows (or lines) ``first`` on of ``path``."""

    first_row: int
    rows: int
    path: str
    first: int
    unit: str  # "row" (0-based row of a Parquet/IPC file) or "line" (1-based line of a JSON Lines file)


class InputFiles:
    """The files of a job, their united ``schema``, and ``batches`` over all of them in order."""

    def __init__(self, paths: list[str], fmt: str, source: str, schema: pa.Schema, schemas: list[pa.Schema],
                 skipped: list[str]):
        self.paths, self.format, self.source, self.schema = paths, fmt, source, schema
        self.file_schemas = schemas
        self.skipped = skipped  # messages for the report: files left out (the job's own output...)
        self._segments: list[_Segment] = []
        self._starts: list[int] = []

    # -- reading -------------------------------------------------------------------------------------

    def batches(self, batch_size: int) -> Iterator[pa.RecordBatch]:
        """Record batches of at most ``batch_size`` rows, in file order; each is recorded for ``name_row``."""
        row = 0
        reader = self._json_batches(batch_size) if self.format == "json" else self._dataset_batches(batch_size)
        for batch, path, first, unit in reader:
            if not batch.num_rows:
                continue
            self._starts.append(row)
            self._segments.append(_Segment(row, batch.num_rows, path, first, unit))
            row += batch.num_rows
            yield batch

    def _dataset_batches(self, batch_size: int):
        import pyarrow.dataset as ds

        fmt: Any = self.format
        if fmt == "parquet":
            # pre_buffer caches the ranges it has read until the file is closed: memory would grow with the file
            fmt = ds.ParquetFileFormat(default_fragment_scan_options=ds.ParquetFragmentScanOptions(pre_buffer=False))
        dataset = ds.dataset(self.paths, format=fmt, schema=self.schema)
        scanner = dataset.scanner(batch_size=batch_size, batch_readahead=1, fragment_readahead=1, use_threads=True)
        iterator = iter(scanner.scan_batches())
        within: dict[str, int] = {}
        path = self.paths[0]
        while True:
            try:
                tagged = next(iterator)
            except StopIteration:
                return
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OSError) as exc:
                raise ValueError(f"{self._next_file(path, within)}: reading failed ({_first_line(exc)}); "
                                 "the file may be truncated or corrupt") from None
            path = tagged.fragment.path
            batch = tagged.record_batch
            first = within.get(path, 0)
            within[path] = first + batch.num_rows
            yield batch, path, first, "row"

    def _next_file(self, last: str, within: dict[str, int]) -> str:
        """The file a failed read was on: the last one read from, or the next one not read yet."""
        unread = [p for p in self.paths if p not in within]
        return unread[0] if last in within and unread else last

    def _json_batches(self, batch_size: int):
        def blocks():
            for path in self.paths:
                for table, first_line in read_json_lines(path, self.schema, batch_size):
                    yield table, path, first_line

        for table, path, first_line in _read_ahead(blocks()):
            for batch in table.to_batches():
                yield batch, path, first_line, "line"
                first_line += batch.num_rows

    def count_rows(self) -> int | None:
        """Rows in the input when it is cheap to know (Parquet metadata); None otherwise."""
        if self.format != "parquet":
            return None
        import pyarrow.parquet as pq

        try:
            return sum(pq.ParquetFile(path).metadata.num_rows for path in self.paths)
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
        return f"{segment.path}, {segment.unit} {segment.first + row - segment.first_row}"

    def name_rows(self, text: str, *, count: int = 0) -> str:
        """``text`` with ``row N`` (a row of the job) followed by where that row is: ``row N (file, line L)``."""

        def named(match: re.Match) -> str:
            where = self.where(int(match.group(1)))
            return match.group(0) if where is None else f"{match.group(0)} ({where})"

        return _ROW.sub(named, text, count=count)


def _read_ahead(items: Iterator, depth: int = 1) -> Iterator:
    """``items`` produced on a thread, ``depth`` ahead of the consumer (Arrow's JSON parsing releases the GIL,
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
    """The files of ``input`` (a file, folder, glob or list of files) and their united schema.

    ``exclude``: paths that are never input (the job's output and report). A file given by name that is
    one of them is refused; one found in a folder or by a glob is left out and said so (``skipped``).
    """
    paths, source, explicit = _list_paths(input)
    excluded = {os.path.realpath(p) for p in exclude if p is not None}
    kept, skipped = [], []
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
    for path in kept:
        if os.path.isfile(path) and os.path.getsize(path) == 0:
            raise ValueError(f"{path}: the file is empty (0 bytes); remove it or regenerate it")
    fmt = input_format or _format_of(kept, source)
    if fmt not in ("parquet", "ipc", "json"):
        raise ValueError(f"input_format={fmt!r} is not supported; pass 'parquet', 'ipc' (Arrow/Feather) or 'json' (JSON Lines)")
    schemas = [_file_schema(path, fmt) for path in kept]
    return InputFiles(kept, fmt, source, unite_schemas(kept, schemas), schemas, skipped)


def _list_paths(input: Any) -> tuple[list[str], str, bool]:
    """``(paths, a name for errors, whether the paths were named one by one)``."""
    if isinstance(input, (list, tuple)):
        paths = [os.fspath(p) for p in input]
        if not paths:
            raise FileNotFoundError("input=[]: no file given")
        missing = [p for p in paths if not os.path.exists(p)]
        if missing:
            raise FileNotFoundError(f"{missing[0]}: no such file or folder")
        return paths, (f"{len(paths)} files" if len(paths) != 1 else paths[0]), True
    source = os.fspath(input)
    if any(ch in source for ch in "*?["):
        paths = sorted(p for p in glob.glob(source, recursive=True) if os.path.isfile(p))
        if not paths:
            raise FileNotFoundError(f"{source}: the pattern matches no file")
        return paths, source, False
    if os.path.isdir(source):
        paths = sorted(
            os.path.join(root, name) for root, folders, names in os.walk(source) for name in names
            if not name.startswith((".", "_"))
        )
        if not paths:
            raise FileNotFoundError(f"{source}: the folder holds no data file")
        return paths, source, False
    if os.path.exists(source):
        return [source], source, True
    raise FileNotFoundError(f"{source}: no such file or folder")


def _format_of(paths: list[str], source: str) -> str:
    kinds = {FORMATS.get(os.path.splitext(p)[1].lower()) for p in paths}
    if None in kinds or len(kinds) != 1:
        suffixes = sorted({os.path.splitext(p)[1] or "(none)" for p in paths})
        raise ValueError(
            f"{source}: cannot tell the format from the file suffixes {suffixes}; name the files .parquet, .arrow or "
            ".jsonl, or pass input_format= (--input-format parquet|ipc|json)"
        )
    return kinds.pop()


def _file_schema(path: str, fmt: str) -> pa.Schema:
    if fmt == "json":
        return json_lines_schema(path)
    import pyarrow.dataset as ds

    try:
        return ds.dataset(path, format=fmt).schema
    except (pa.ArrowInvalid, OSError) as exc:
        raise ValueError(f"{path}: cannot be read as {fmt} ({_first_line(exc)}); is the file complete? "
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


# -- JSON Lines ----------------------------------------------------------------------------------------


def json_lines_schema(path: str) -> pa.Schema:
    """Column types from the first ``INFER_LINES`` rows of a JSON Lines file.

    Lists of integers are ``list<int64>`` (token ids), strings, numbers and booleans their Arrow
    types; objects, and anything holding an object, are JSON text (``arrow.json``), a list of objects
    as a list of JSON texts (one per message), so that no later row can fail to fit.
    """
    rows = []
    for line, raw in _lines(path):
        rows.append(_parse_line(path, line, raw))
        if len(rows) >= INFER_LINES:
            break
    if not rows:
        raise ValueError(f"{path}: the file holds no JSON object (only blank lines)")
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    return pa.schema([pa.field(name, _infer_type([row.get(name) for row in rows])) for name in names])


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


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
    """``(line number, bytes)`` for each non-blank line."""
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if raw.strip():
                yield number, raw


def read_json_lines(path: str, schema: pa.Schema, batch_size: int) -> Iterator[tuple[pa.Table, int]]:
    """``(table, line of its first row)`` for runs of at most ``batch_size`` consecutive non-blank lines."""
    block: list[bytes] = []
    first = next_line = 0
    for number, raw in _lines(path):
        if block and (number != next_line or len(block) == batch_size):
            yield _json_table(path, block, first, schema), first
            block = []
        if not block:
            first = number
        block.append(raw)
        next_line = number + 1
    if block:
        yield _json_table(path, block, first, schema), first


def _json_table(path: str, lines: list[bytes], first: int, schema: pa.Schema) -> pa.Table:
    """One block of lines as a table of ``schema``: Arrow's reader when no column is JSON text, else Python."""
    if not any(_holds_json(field.type) for field in schema):
        try:
            import pyarrow.json as pj

            data = b"".join(line if line.endswith(b"\n") else line + b"\n" for line in lines)
            table = pj.read_json(
                io.BytesIO(data), read_options=pj.ReadOptions(block_size=max(1 << 22, 2 * max(map(len, lines)))),
                parse_options=pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="error"),
            )
            if table.num_rows == len(lines) and table.schema == schema:
                return table
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            pass  # the row-by-row reading below names the line and the problem
    rows = [_parse_line(path, first + i, raw) for i, raw in enumerate(lines)]
    known = set(schema.names)
    for i, row in enumerate(rows):
        extra = [key for key in row if key not in known]
        if extra:
            raise ValueError(
                f"{path}, line {first + i}: key {extra[0]!r} appears here but in none of the first {INFER_LINES:,} "
                f"rows of the file, which fix its columns; give every row the key (null where absent), "
                "or convert the file to Parquet"
            )
    return pa.table([_json_column(path, first, field, [row.get(field.name) for row in rows]) for field in schema],
                    schema=schema)


def _holds_json(arrow_type: pa.DataType) -> bool:
    if getattr(arrow_type, "extension_name", None) == "arrow.json":
        return True
    return pa.types.is_list(arrow_type) and _holds_json(arrow_type.value_type)


def _json_column(path: str, first: int, field: pa.Field, values: list) -> pa.Array:
    if _holds_json(field.type):
        if pa.types.is_list(field.type):
            for i, value in enumerate(values):
                if value is not None and not isinstance(value, list):
                    raise ValueError(f"{path}, line {first + i}: {field.name!r} is {_json_kind(value)}, "
                                     f"not a list as in the file's first rows")
            texts = [None if v is None else [json.dumps(item, ensure_ascii=False) for item in v] for v in values]
            storage = pa.array(texts, type=pa.list_(pa.string()))
            return pa.ListArray.from_arrays(storage.offsets, pa.ExtensionArray.from_storage(pa.json_(), storage.values),
                                            mask=storage.is_null() if storage.null_count else None)
        storage = pa.array([None if v is None else json.dumps(v, ensure_ascii=False) for v in values], pa.string())
        return pa.ExtensionArray.from_storage(pa.json_(), storage)
    try:
        return pa.array(values, type=field.type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
        pass
    for i, value in enumerate(values):
        try:
            pa.array([value], type=field.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
            shown = json.dumps(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise ValueError(
                f"{path}, line {first + i}: {field.name!r} holds {shown}, which does not fit {field.type} "
                f"(its type in the file's first rows); fix the row, or convert the file to Parquet with one type"
            ) from None
    raise ValueError(f"{path}, lines {first}-{first + len(values) - 1}: column {field.name!r} cannot be read as {field.type}")


def _parse_line(path: str, line: int, raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8-sig" if line == 1 else "utf-8")  # a byte order mark may open the file
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}, line {line}: not UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} of the "
                         "line); re-encode the file as UTF-8") from None
    try:
        value = json.loads(text.rstrip("\r\n"))
    except ValueError as exc:
        reason = getattr(exc, "msg", str(exc))
        column = getattr(exc, "colno", None)
        raise ValueError(f"{path}, line {line}: not valid JSON ({reason}"
                         f"{f' at column {column}' if column else ''})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}, line {line}: holds {_json_kind(value)}, not a JSON object (one row per line)")
    return value


def _json_kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)
