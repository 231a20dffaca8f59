"""The JSON reader: JSON Lines and JSON arrays (compressed or not) as Arrow tables, each row named by its line.

JSON Lines are read block by block, by Arrow's JSON reader with the types of each file's first rows
(``typed_json_head``): messages of string values as ``list<struct>``, parsed once, with no Python object per
message. A file whose first rows hold objects, messages holding lists or numbers, or a value whose type changes
between rows is read as JSON text instead (``json_lines_schema``): objects and lists of objects (messages, tool
calls, tool schemas) are kept as JSON text per message or per value (``arrow.json``), so rows whose keys or
argument types differ are read as they are. Malformed lines and non-UTF-8 bytes are refused naming the file and
line. A JSON file that holds one array of objects is read the same way, its items as rows. ``_json_table`` reads
any run of lines, so a worker reads its own byte range of a file with it (``jobs/slices.py``).
"""

from __future__ import annotations

import functools
import io
import itertools
import json
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import pyarrow as pa

from .display import json_kind, quoted, shortened
from . import formats
from .formats import _not_decompressed, _open_json, _too_long, unite_schemas

INFER_LINES = 10_000  # JSON Lines: the rows of each file whose values fix the column types




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


def _lines(fh, name: str) -> Iterator[tuple[int, bytes]]:
    """``(line number, bytes)`` for each non-blank line; a line over ``formats.MAX_LINE_BYTES`` is refused as it is read."""
    for number, raw in enumerate(iter(functools.partial(fh.readline, formats.MAX_LINE_BYTES + 1), b""), start=1):
        if len(raw) - raw.endswith(b"\n") > formats.MAX_LINE_BYTES:
            raise _too_long(name, "line", number)
        if raw.strip():
            yield number, raw


_SPACE = re.compile(r"[ \t\r\n]*")


def _array_items(fh, name: str, first: int = 0) -> Iterator[tuple[int, bytes]]:
    """``(item number, its JSON text on one line)`` for each item of a file holding one JSON array, read in
    chunks: one item at a time is held in memory (at most ``formats.MAX_LINE_BYTES``), not the whole array. ``first``: the
    number of the first item (a worker reads a range of the array's items as an array of its own,
    ``jobs/slices.py``). A byte that is not UTF-8 is named by the item that holds it, wherever the chunks end."""
    import codecs

    # a byte that is not UTF-8 is kept as a lone surrogate, which encoding the item refuses, naming it
    decoder = codecs.getincrementaldecoder("utf-8-sig")("surrogateescape")
    scan = json.JSONDecoder().raw_decode
    text, pos, index, ended = "", 0, first, False

    def read(size: int = 1 << 20) -> bool:
        """Append the next ``size`` bytes to ``text`` (dropping what was parsed); False at the end of the file."""
        nonlocal text, pos, ended
        data = fh.read(size)
        ended = not data
        text = text[pos:] + decoder.decode(data, final=ended)
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
                if ended and "\udc80" <= text[exc.pos:exc.pos + 1] <= "\udcff":
                    raise ValueError(f"{name}, row {index}: not UTF-8 (byte 0x{ord(text[exc.pos]) & 0xff:02x}); "
                                     "re-encode the file as UTF-8") from None
                if ended:
                    raise ValueError(f"{name}, row {index}: not valid JSON ({exc.msg})") from None
                if len(text) - pos > formats.MAX_LINE_BYTES:
                    raise _too_long(name, "row", index) from None
                read(max(1 << 20, 2 * (len(text) - pos)))  # the item may go on beyond the text read so far
            except RecursionError:
                raise _too_deep(name, "row", index) from None
        if not isinstance(value, dict):
            raise ValueError(f"{name}, row {index}: holds {json_kind(value)}, not a JSON object (one row per item)")
        # JSON text holds no raw line break inside a string: as one line, the item is read as JSON Lines are
        try:
            yield index, text[pos:end].replace("\n", " ").replace("\r", " ").encode()
        except UnicodeEncodeError as exc:
            raise ValueError(f"{name}, row {index}: not UTF-8 (byte 0x{ord(exc.object[exc.start]) & 0xff:02x}); "
                             "re-encode the file as UTF-8") from None
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
