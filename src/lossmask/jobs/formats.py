"""What a job's input files hold: their format (from the suffix, else the first bytes), their compression, one
schema over all of them, and the checks every reader makes of what it read.

A format is told by the file's suffix (``FORMATS``; a compression suffix before it: ``.jsonl.gz``), else by its
first bytes: Parquet's and Arrow's magic, or JSON text. JSON compressed with gzip, bzip2 or zstd is told by its
magic bytes whatever its suffix says, and decompressed as it is read (``_open_json``). The files' schemas are
united (``unite_schemas``): a column that only some files have is null in the others; a column whose types cannot
be united is refused, naming both files. Text read from Parquet or Arrow is checked to be UTF-8
(``_check_utf8``), naming the row that is not.
"""

from __future__ import annotations

import io
import os
from typing import Any

import pyarrow as pa

FORMATS = {
    ".parquet": "parquet", ".pq": "parquet",
    ".arrow": "ipc", ".feather": "ipc", ".ipc": "ipc",
    ".jsonl": "json", ".json": "json", ".ndjson": "json",
}
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".zstd": "zstd"}  # of JSON files
_MAGIC = ((b"\x1f\x8b", "gzip"), (b"BZh", "bz2"), (b"\x28\xb5\x2f\xfd", "zstd"))
# One line of JSON Lines (or one item of a JSON array) is held in memory whole: without a bound, a file
# with no line end (/dev/zero, a binary file read as JSON) would take all the memory there is.
MAX_LINE_BYTES = 64 << 20


def _too_long(name: str, unit: str, number: int) -> ValueError:
    return ValueError(
        f"{name}, {unit} {number}: longer than {MAX_LINE_BYTES >> 20} MiB, the limit on one row of JSON "
        f"(lossmask.jobs.formats.MAX_LINE_BYTES); is the file JSON at all? Store rows this long in Parquet"
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


def _not_decompressed(name: str, codec: str | None, exc: BaseException) -> ValueError:
    return ValueError(f"{name}: cannot be read as {codec or 'uncompressed'} data ({_first_line(exc)}); "
                      "the file may be truncated or corrupt")




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
