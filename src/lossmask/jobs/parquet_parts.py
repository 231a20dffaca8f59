"""One Parquet file from Parquet parts encoded elsewhere: workers encode their batches, the parent appends bytes.

Encoding a batch's token columns to Parquet (levels, pages, compression) costs about as much as rendering and
tokenising it (docs/benchmarks.md, "Workers"). With ``num_proc`` workers each encodes its own finished batch as a
whole Parquet file in memory (``encode_part``); the parent copies each part's row-group bytes into the output in
input order and, at the end, writes one footer that lists every row group (``PartsFile``). The parent then does
no per-token work at all, so the job scales with the workers.

A Parquet file is ``PAR1``, the row groups' column chunks, the footer (a Thrift compact-protocol ``FileMetaData``),
its length (4 bytes, little-endian) and ``PAR1``. A part's chunks move by ``shift`` bytes when copied, so every file
offset in its row groups' metadata moves by ``shift`` too; everything else in the footers is the same for every part
(one schema, one writer configuration), so the first part's footer is kept with its ``num_rows`` and ``row_groups``
replaced. Parts are written without page indexes and bloom filters (``output_writer``), whose offsets lie outside
the row groups.

The Thrift compact protocol is read and written generically (``_read_struct`` / ``_write_struct``): a footer is
decoded to ``[(field id, type, value)]`` and encoded back field by field, so nothing the writer put in it is lost.
"""

from __future__ import annotations

import os
import struct
from typing import Any, BinaryIO

import pyarrow as pa

MAGIC = b"PAR1"

# compact-protocol types
_TRUE, _FALSE, _I8, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)

# FileMetaData / RowGroup / ColumnChunk / ColumnMetaData field ids (parquet.thrift)
_FILE_NUM_ROWS, _FILE_ROW_GROUPS = 3, 4
_GROUP_COLUMNS, _GROUP_FILE_OFFSET, _GROUP_ORDINAL = 1, 5, 7
_CHUNK_FILE_OFFSET, _CHUNK_META, _CHUNK_OFFSET_INDEX, _CHUNK_COLUMN_INDEX = 2, 3, 4, 6
_META_OFFSETS = (9, 10, 11, 14)  # data_page_offset, index_page_offset, dictionary_page_offset, bloom_filter_offset


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def byte(self) -> int:
        value = self.data[self.at]
        self.at += 1
        return value

    def varint(self) -> int:
        shift = result = 0
        while True:
            b = self.byte()
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def take(self, n: int) -> bytes:
        value = self.data[self.at : self.at + n]
        self.at += n
        return value


def _read_value(r: _Reader, kind: int) -> Any:
    if kind in (_TRUE, _FALSE):  # inside a list a boolean is a byte of its own
        return r.byte() == _TRUE
    if kind == _I8:
        return r.byte()
    if kind in (_I16, _I32, _I64):
        return r.zigzag()
    if kind == _DOUBLE:
        return r.take(8)
    if kind == _BINARY:
        return r.take(r.varint())
    if kind in (_LIST, _SET):
        header = r.byte()
        size, element = header >> 4, header & 0x0F
        if size == 15:
            size = r.varint()
        return element, [_read_value(r, element) for _ in range(size)]
    if kind == _MAP:
        size = r.varint()
        if not size:
            return 0, 0, []
        types = r.byte()
        key, value = types >> 4, types & 0x0F
        return key, value, [(_read_value(r, key), _read_value(r, value)) for _ in range(size)]
    if kind == _STRUCT:
        return _read_struct(r)
    raise ValueError(f"unknown Thrift compact type {kind}")


def _read_struct(r: _Reader) -> list:
    fields, last = [], 0
    while True:
        header = r.byte()
        if header == 0:
            return fields
        delta, kind = header >> 4, header & 0x0F
        field = last + delta if delta else r.zigzag()
        if kind in (_TRUE, _FALSE):  # a boolean field's value is its type
            fields.append([field, kind, kind == _TRUE])
        else:
            fields.append([field, kind, _read_value(r, kind)])
        last = field


def _varint(n: int, out: bytearray) -> None:
    while True:
        if n < 0x80:
            out.append(n)
            return
        out.append((n & 0x7F) | 0x80)
        n >>= 7


def _zigzag(n: int, out: bytearray) -> None:
    _varint((n << 1) ^ (n >> 63), out)


def _write_value(kind: int, value: Any, out: bytearray) -> None:
    if kind in (_TRUE, _FALSE):
        out.append(_TRUE if value else _FALSE)
    elif kind == _I8:
        out.append(value & 0xFF)
    elif kind in (_I16, _I32, _I64):
        _zigzag(value, out)
    elif kind == _DOUBLE:
        out += value
    elif kind == _BINARY:
        _varint(len(value), out)
        out += value
    elif kind in (_LIST, _SET):
        element, items = value
        if len(items) < 15:
            out.append(len(items) << 4 | element)
        else:
            out.append(0xF0 | element)
            _varint(len(items), out)
        for item in items:
            _write_value(element, item, out)
    elif kind == _MAP:
        key, val, items = value
        _varint(len(items), out)
        if items:
            out.append(key << 4 | val)
            for k, v in items:
                _write_value(key, k, out)
                _write_value(val, v, out)
    elif kind == _STRUCT:
        _write_struct(value, out)
    else:
        raise ValueError(f"unknown Thrift compact type {kind}")


def _write_struct(fields: list, out: bytearray) -> None:
    last = 0
    for field, kind, value in fields:
        if kind in (_TRUE, _FALSE):
            kind = _TRUE if value else _FALSE
        delta = field - last
        if 0 < delta <= 15:
            out.append(delta << 4 | kind)
        else:
            out.append(kind)
            _zigzag(field, out)
        if kind not in (_TRUE, _FALSE):
            _write_value(kind, value, out)
        last = field
    out.append(0)


def _field(fields: list, field: int) -> list | None:
    return next((f for f in fields if f[0] == field), None)


def _shift_row_group(group: list, shift: int, ordinal: int) -> list:
    """A row group's metadata with every file offset moved by ``shift`` bytes, and its ordinal set."""
    for f in group:
        if f[0] == _GROUP_FILE_OFFSET:
            f[2] += shift
        elif f[0] == _GROUP_ORDINAL:
            f[2] = ordinal
        elif f[0] == _GROUP_COLUMNS:
            for chunk in f[2][1]:
                for c in chunk:
                    if c[0] in (_CHUNK_FILE_OFFSET, _CHUNK_OFFSET_INDEX, _CHUNK_COLUMN_INDEX):
                        c[2] += shift
                    elif c[0] == _CHUNK_META:
                        for m in c[2]:
                            if m[0] in _META_OFFSETS:
                                m[2] += shift
    return group


def split_part(part: bytes | memoryview | pa.Buffer) -> tuple[memoryview, list]:
    """A whole Parquet file's ``(row-group bytes, decoded footer)``."""
    view = memoryview(part)
    if len(view) < 12 or bytes(view[:4]) != MAGIC or bytes(view[-4:]) != MAGIC:
        raise ValueError("not a Parquet file (no PAR1 at its ends)")
    (length,) = struct.unpack("<I", view[-8:-4])
    footer_at = len(view) - 8 - length
    return view[4:footer_at], _read_struct(_Reader(bytes(view[footer_at:-8])))


def encode_part(table: pa.Table, writer_options: dict, row_group_size: int | None) -> pa.Buffer:
    """``table`` as a whole Parquet file in memory, written as the job writes its output (``writer_options``: the
    keyword arguments of ``pq.ParquetWriter`` that ``output_writer`` uses)."""
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(sink, table.schema, **writer_options) as writer:
        writer.write_table(table, row_group_size=row_group_size)
    return sink.getvalue()


def write_part(table: pa.Table, writer_options: dict, row_group_size: int | None, path: str) -> str:
    """``table`` as a whole Parquet file at ``path`` (as ``encode_part`` makes it in memory); returns ``path``."""
    import pyarrow.parquet as pq

    with pq.ParquetWriter(path, table.schema, **writer_options) as writer:
        writer.write_table(table, row_group_size=row_group_size)
    return path


def _part_file(path: str) -> tuple[int, int, list]:
    """A part written to a file: ``(descriptor, length of its row-group bytes, decoded footer)``; the caller
    closes the descriptor."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        tail = os.pread(fd, 8, size - 8) if size >= 12 else b""
        if len(tail) < 8 or tail[-4:] != MAGIC or os.pread(fd, 4, 0) != MAGIC:
            raise ValueError(f"{path}: not a Parquet file (no PAR1 at its ends)")
        (length,) = struct.unpack("<I", tail[:4])
        footer_at = size - 8 - length
        return fd, footer_at - len(MAGIC), _read_struct(_Reader(os.pread(fd, length, footer_at)))
    except BaseException:
        os.close(fd)
        raise


def _copy(source: int, target: int, offset: int, length: int) -> None:
    """``length`` bytes of ``source`` from ``offset`` onto ``target`` at its position: in the kernel
    (``copy_file_range``) where it can, else through a buffer."""
    copy = getattr(os, "copy_file_range", None)
    while length and copy is not None:
        try:
            done = copy(source, target, length, offset)
        except OSError:  # another file system, or a kernel without it: copy what is left through a buffer
            break
        if not done:
            break
        offset, length = offset + done, length - done
    while length:
        chunk = os.pread(source, min(length, 1 << 20), offset)
        if not chunk:
            raise OSError(f"part ended {length} bytes early")
        os.write(target, chunk)
        offset, length = offset + len(chunk), length - len(chunk)


class PartsFile:
    """The output file, assembled from parts in the order they are appended; ``close`` writes the footer.

    ``schema`` and ``writer_options`` write an empty file when no part holds a row. The file is opened by the
    caller's path and written sequentially; a failure leaves a partial file for the caller to remove."""

    def __init__(self, path: str | os.PathLike, schema: pa.Schema, writer_options: dict):
        self.path, self.schema, self.writer_options = path, schema, writer_options
        self.file: BinaryIO = open(path, "wb")
        self.file.write(MAGIC)
        self.at = len(MAGIC)
        self.footer: list | None = None
        self.groups: list = []
        self.rows = 0

    def append(self, part: bytes | memoryview | pa.Buffer | str) -> None:
        """Append a part: its bytes, or the path of a file holding it (copied in the kernel, then removed)."""
        if isinstance(part, str):
            fd, length, footer = _part_file(part)
            try:
                if self._add_groups(footer):
                    self.file.flush()  # then the bytes go onto the descriptor, at its position
                    _copy(fd, self.file.fileno(), len(MAGIC), length)
                    self.at += length
            finally:
                os.close(fd)
                os.remove(part)
            return
        chunks, footer = split_part(part)
        if self._add_groups(footer):
            self.file.write(chunks)
            self.at += len(chunks)

    def _add_groups(self, footer: list) -> bool:
        """Record a part's row groups, shifted to where its bytes go now; False when it holds none."""
        groups = _field(footer, _FILE_ROW_GROUPS)
        if groups is None or not groups[2][1]:
            return False
        shift = self.at - len(MAGIC)
        for group in groups[2][1]:
            self.groups.append(_shift_row_group(group, shift, len(self.groups)))
        self.rows += _field(footer, _FILE_NUM_ROWS)[2]
        if self.footer is None:
            self.footer = footer
        return True

    def close(self) -> None:
        if self.file.closed:
            return
        if self.footer is None:  # no rows at all: the writer's own empty file
            self.file.close()
            import pyarrow.parquet as pq

            pq.ParquetWriter(self.path, self.schema, **self.writer_options).close()
            return
        footer = [list(f) for f in self.footer]
        _field(footer, _FILE_NUM_ROWS)[2] = self.rows
        _field(footer, _FILE_ROW_GROUPS)[2] = (_STRUCT, self.groups)
        out = bytearray()
        _write_struct(footer, out)
        self.file.write(out)
        self.file.write(struct.pack("<I", len(out)))
        self.file.write(MAGIC)
        self.file.close()

    def abandon(self) -> None:
        """Close without a footer (the job failed: the caller removes the file)."""
        self.file.close()
