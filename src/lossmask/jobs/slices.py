"""Slices of a job's input that a worker reads itself: the parent plans them, and never reads a row.

A slice of a Parquet file is a run of whole row groups (``ParquetSlice``): its rows are known from the file's footer
before anything is read, so the parent knows the job's row of each slice, and names a row (``row 70 (data.parquet,
row 70)``) as it does when it reads the file itself. A row group is never split between workers: each worker that read a
part of it would decode the rows before that part (Parquet pages are decoded from the start of their row group),
which costs about as much as the parent reading the file. So files written in row groups much larger than a slice
(one row group for the whole file, as ``pandas.to_parquet`` writes a small one) are read by the parent. A worker reads its slice in batches of about
``batch_bytes``, each checked as the parent checks what it reads (strings that are UTF-8), and labels them one
after another (``jobs/workers.py``).

Only Parquet files whose schema is the job's are sliced here; other inputs are read by the parent and handed out
as batches.
"""

from __future__ import annotations

from dataclasses import dataclass
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


def parquet_slices(files: Any, rows_per_slice: int, workers: int) -> list[ParquetSlice] | None:
    """The slices of a job's Parquet files, in input order: consecutive row groups of one file, together about
    ``rows_per_slice`` rows. None when the row groups are too large for slices to keep ``workers`` busy and their
    memory bounded (fewer than two slices a worker, or a row group of more than twice ``rows_per_slice`` rows: a
    file written in one row group): the parent then reads the rows and hands them out as batches. A slice is
    recorded with ``files`` (``InputFiles.record``) when it is handed out, so that its rows can be named."""
    import pyarrow.parquet as pq

    from .inputs import _first_line

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


def read_slice(piece: ParquetSlice, schema: pa.Schema, max_rows: int, max_bytes: int | None) -> Iterator[pa.Table]:
    """The rows of ``piece`` as tables of at most ``max_rows`` rows and about ``max_bytes`` bytes, checked as the
    parent checks the batches it reads; a file that cannot be read is one ``ValueError`` line naming it."""
    import pyarrow.parquet as pq

    from .inputs import _check_utf8, _first_line, _holds_text, _rows_in_bytes

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

