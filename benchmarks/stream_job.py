"""Shared by bench_stream.py: write a pre-tokenised ChatML Parquet file, and run one masking job in a fresh process.

    python benchmarks/stream_job.py write OUT.parquet ROWS      # ~110 tokens per row, written in chunks
    python benchmarks/stream_job.py mask IN.parquet OUT.parquet  # prints one JSON line: report + peak RSS
    python benchmarks/stream_job.py copy IN.parquet OUT.parquet  # the same read and write, no labels (baseline)

Each job runs in its own process so that its peak RSS (``ru_maxrss``) is its own.
"""

from __future__ import annotations

import json
import resource
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

# Qwen2.5's ChatML ids (as in benchmarks/conftest.py)
IM_START, IM_END, NL, USER, ASSISTANT, TOOL = 151644, 151645, 198, 872, 77091, 14172
CHUNK = 250_000


def chatml_chunk(n_rows: int, seed: int) -> pa.Table:
    """``n_rows`` rows of one user turn and one assistant turn (20-79 body tokens each); 3% have no assistant turn."""
    rng = np.random.default_rng(seed)
    user = rng.integers(20, 80, n_rows)
    answer = rng.integers(20, 80, n_rows)
    lengths = user + answer + 10  # <im_start> role \n ... <im_end> \n, twice
    offsets = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = rng.integers(1000, 150_000, int(offsets[-1]), dtype=np.int32)
    start = offsets[:-1]
    second = start + user + 5
    role = np.where(rng.random(n_rows) < 0.03, TOOL, ASSISTANT)
    for at, token in ((start, IM_START), (start + 1, USER), (start + 2, NL), (second - 2, IM_END), (second - 1, NL),
                      (second, IM_START), (second + 1, role), (second + 2, NL), (offsets[1:] - 2, IM_END),
                      (offsets[1:] - 1, NL)):
        values[at] = token
    input_ids = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))
    return pa.table({"id": pa.array(np.arange(n_rows, dtype=np.int64) + seed * CHUNK), "input_ids": input_ids})


def write(path: str, n_rows: int) -> None:
    schema = chatml_chunk(1, 0).schema
    with pq.ParquetWriter(path, schema) as writer:
        for k, first in enumerate(range(0, n_rows, CHUNK)):
            writer.write_table(chatml_chunk(min(CHUNK, n_rows - first), seed=k), row_group_size=50_000)


def markers():
    import lossmask

    return lossmask.Markers(response=[[IM_START, ASSISTANT, NL]], instruction=[[IM_START]], end=[[IM_END]])


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def mask(src: str, dst: str) -> dict:
    import lossmask

    lossmask.make_labels(pa.array([[1, 2]], pa.list_(pa.int32())), markers())  # load the compiled kernel first
    baseline_rss = peak_rss_mib()
    started = time.perf_counter()
    report = lossmask.mask_files(src, dst, markers=markers(), progress=False)
    seconds = time.perf_counter() - started
    return {**report.to_dict(), "wall_seconds": seconds, "peak_rss_mib": peak_rss_mib(), "rss_before_mib": baseline_rss}


def copy(src: str, dst: str) -> dict:
    """Read and write the same batches (same scanner settings and compression), labelling nothing."""
    import pyarrow.dataset as ds

    import lossmask  # noqa: F401  (the same imports as the masking job)

    baseline_rss = peak_rss_mib()
    started = time.perf_counter()
    fmt = ds.ParquetFileFormat(default_fragment_scan_options=ds.ParquetFragmentScanOptions(pre_buffer=False))
    dataset = ds.dataset(src, format=fmt)  # as mask_files reads
    rows = 0
    # the writer settings of mask_files: snappy, no dictionary or statistics on the token column
    with pq.ParquetWriter(dst, dataset.schema, compression="snappy", use_dictionary=["id"], write_statistics=["id"]) as writer:
        for batch in dataset.scanner(batch_size=16_384, batch_readahead=1, fragment_readahead=1).to_batches():
            writer.write_table(pa.Table.from_batches([batch]))
            rows += batch.num_rows
    seconds = time.perf_counter() - started
    return {"rows": rows, "wall_seconds": seconds, "peak_rss_mib": peak_rss_mib(), "rss_before_mib": baseline_rss}


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "write":
        write(args[0], int(args[1]))
    elif command == "mask":
        print(json.dumps(mask(args[0], args[1])))
    elif command == "copy":
        print(json.dumps(copy(args[0], args[1])))
    else:
        raise SystemExit(__doc__)
