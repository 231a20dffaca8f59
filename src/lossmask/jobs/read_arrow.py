"""The Parquet and Arrow IPC reader: a job's files batch by batch, through ``pyarrow.parquet`` where the files
hold the job's own schema, else ``pyarrow.dataset``, which reads each file's columns as the united schema has
them."""

from __future__ import annotations

from typing import Any, Iterator

import pyarrow as pa

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
