"""Worker processes that carry the whole batch step: ``mask_files(num_proc=N)``.

Each worker reads a batch (an Arrow IPC stream), renders, locates, tokenises and labels it (``mask_batch``, the
step every path shares), and encodes the rows it keeps as a Parquet part (``parquet_parts.encode_part``). It sends
back the part's bytes and the batch's tally. The parent reads the input, hands batches out, and then only orders
the results, adds the tallies in input order, copies each part's bytes into the output and commits it: it does
no per-row or per-token work, so a job scales with its workers (docs/benchmarks.md, "Workers").

Workers are forked on Linux (``worker_start_method``): they start with the tokenizer and the compiled kernels in
memory. A forked worker labels with the serial kernels (``one_thread``), never numba's thread pool, which the
parent may have started, and caps the Rust tokeniser's threads so that the workers share the cores.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from typing import Any, Iterable, Iterator

import pyarrow as pa

from ..engine import one_thread
from .batch_step import mask_batch
from .parquet_parts import encode_part
from .report import Tally
from .stopping import kernel_call

_STEP: dict[str, Any] = {}


def worker_start_method() -> str:
    """``fork`` on Linux, ``spawn`` elsewhere (``LOSSMASK_START_METHOD`` overrides): macOS and Windows fork
    unsafely or not at all."""
    method = os.environ.get("LOSSMASK_START_METHOD")
    if method:
        return method
    return "fork" if sys.platform.startswith("linux") else "spawn"


def start_step_worker(threads: int, tokenizer: Any) -> None:
    """Process-pool initializer: the job's tokenizer, once per worker (a forked worker has it in memory already).

    ``threads`` caps the Rust thread pools of this worker (set before any tokeniser runs here). The fast tokeniser
    starts loading now, in this worker (``ChatTokenizer.begin_job``). Ctrl-C, which a terminal sends to every
    process of the job, is the parent's to handle (it stops the job and ends the pool): a worker ignores it rather
    than print a traceback of its own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    # A forked worker has none of the parent's Rust thread-pool threads: a parallel encode there waits forever for
    # them (seen). ``tokenizers`` encodes serially with parallelism off; a spawned worker starts pools of its own.
    forked = worker_start_method() == "fork"
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 and not forked else "false"
    _STEP["tokenizer"] = tokenizer
    tokenizer.begin_job()


def worker_started() -> int:
    """A task that only makes the pool start its processes."""
    return os.getpid()


def step_in_worker(batch: pa.Buffer, first_row: int, step: dict[str, Any]) -> tuple[pa.Buffer | None, int, Tally]:
    """One batch through the whole step in a worker: ``(Parquet part or None when no row is kept, rows kept,
    tally)``. ``step``: what every batch of the job shares (``markers``, ``options``, ``kind``, ``source``,
    ``write_weights``, ``schema``, ``writer_options``, ``row_group_size``: a few kB). An error about a row is
    raised as it is; the parent names the row's file and line."""
    started = time.perf_counter()
    table = pa.ipc.open_stream(batch).read_all()
    tally = Tally()
    with one_thread(), kernel_call():  # the step every path shares (jobs/batch_step.py)
        out = mask_batch(table, step["markers"], step["options"], tally, tokenizer=_STEP["tokenizer"],
                         kind=step["kind"], first_row=first_row, source=step["source"],
                         write_weights=step["write_weights"], truncated_at=step.get("truncated_at"))
    part = None
    if out.num_rows:
        encoding = time.perf_counter()
        if out.schema != step["schema"]:
            out = out.cast(step["schema"])
        if step.get("writer_options") is not None:  # a file's share: Parquet, joined by the parent
            part = encode_part(out, step["writer_options"], step["row_group_size"])
        else:  # a dataset's share: the table itself, read back by the parent without a copy
            part = compact(out)
        tally.time("encode_part", time.perf_counter() - encoding)
    tally.time("worker", time.perf_counter() - started)
    return part, out.num_rows, tally


@contextlib.contextmanager
def worker_pool(workers: int, tokenizer: Any, threads: int) -> Iterator[Any]:
    """``workers`` processes started now (None for one or fewer: the job runs in this process), ended with the
    job: waited for after a job that succeeded, stopped with their pending batches cancelled after one that
    failed. Forked, a worker shares this process's fast tokeniser, loaded here first."""
    if workers <= 1:
        yield None
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    fast = getattr(tokenizer, "fast_tokens", None)
    if fast is not None and worker_start_method() == "fork":
        fast.ready()  # loaded once and shared by every forked worker
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(worker_start_method()),
                               initializer=start_step_worker, initargs=(threads, tokenizer))
    try:
        pool.submit(worker_started)  # the processes start here (forked at once), before anything below runs
        yield pool
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def in_order(pool: Any, batches: Iterable[pa.RecordBatch | pa.Table], step: dict[str, Any], workers: int,
             tally: Tally) -> Iterator[tuple[Any, int, Any]]:
    """``(batch, first_row, future of step_in_worker's result)`` in input order, with at most ``2 * workers``
    batches handed out and not yet taken; the futures not taken are cancelled when the caller stops early."""
    import collections

    pending: collections.deque = collections.deque()
    first_row = 0
    try:
        for batch in batches:
            started = time.perf_counter()
            pending.append((batch, first_row, pool.submit(step_in_worker, compact(batch), first_row, step)))
            tally.time("hand_out", time.perf_counter() - started)
            first_row += batch.num_rows
            while len(pending) >= 2 * workers:
                yield pending.popleft()
        while pending:
            yield pending.popleft()
    finally:
        for _, _, future in pending:
            future.cancel()


def compact(batch: pa.RecordBatch | pa.Table) -> pa.Buffer:
    """The batch as an Arrow IPC stream: only its own rows. (Pickling a batch sliced out of a bigger one, as the
    Parquet scanner yields them, sends the whole parent buffers: 8x the bytes for a 20k-row file in 8 batches.)"""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write(batch)
    return sink.getvalue()
