"""Worker processes that carry the whole batch step: ``mask_files(num_proc=N)``.

Each worker reads a batch (an Arrow IPC stream), renders, locates, tokenises and labels it (``mask_batch``, the
step every path shares), and encodes the rows it keeps as a Parquet part (``parquet_parts.encode_part``). It sends
back the part's bytes and the batch's tally. Input that can be sliced is read by the workers themselves (runs of
Parquet row groups, byte ranges of JSON Lines, row ranges of a dataset's Arrow files): the parent plans the slices
(``jobs/slices.py``) and sends only where they are. Other input is read by the parent and handed out as batches.
Then the parent only orders the results, adds the tallies in input order, copies each part's bytes into the output
and commits it: it does no per-row or per-token work, so a job scales with its workers (docs/benchmarks.md,
"Workers").

Workers are forked on Linux (``worker_start_method``): they start with the tokenizer in memory, and with numba and
the kernels' module imported (``imports_before_fork``). A forked worker labels with the serial kernels
(``one_thread``), never numba's thread pool, which the parent may have started, and caps the Rust tokeniser's
threads so that the workers share the cores.

Workers die with their job. On Linux each asks the kernel for SIGKILL when its parent ends (``PR_SET_PDEATHSIG``),
so a job killed outright (the out-of-memory killer, ``kill -9``) leaves no worker behind, and none of them holds the
output's lock (``outputs.output_lock``). A worker that dies while the job runs (killed, or out of memory) ends the
job with ``WorkerDied``, one line naming the signal and the rows it held; the other workers are killed, and the
job's partial output is removed as after any failure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Iterable, Iterator

import pyarrow as pa

from ..engine import one_thread
from .batch_step import mask_batch
from .parquet_parts import encode_part, write_part
from .report import Tally
from . import slices
from .stopping import kernel_call

_STEP: dict[str, Any] = {}
PR_SET_PDEATHSIG = 1  # prctl(2)


class WorkerDied(ChildProcessError):
    """A worker process ended while the job ran: killed by a signal, or exited. One line: the signal (or status)
    and the rows of the job the worker held (``first_row``, ``rows``; ``rows`` 0 when not known)."""

    def __init__(self, status: int, first_row: int = 0, rows: int = 0, where: str | None = None):
        self.status, self.first_row, self.rows = status, first_row, rows
        if status < 0:
            try:
                name = signal.Signals(-status).name
            except ValueError:
                name = "unknown"
            oom = ", most often the out-of-memory killer" if -status == signal.SIGKILL else ""
            cause = f"was killed by signal {-status} ({name}{oom})"
        else:
            cause = f"exited with status {status}"
        held = f" while it held rows {first_row}-{first_row + rows - 1}" if rows > 0 else " before it took any rows"
        held += f" ({where})" if where and rows > 0 else ""
        super().__init__(f"a worker process {cause}{held}; the job stopped and its partial output was removed")


def worker_start_method() -> str:
    """``fork`` on Linux, ``spawn`` elsewhere (``LOSSMASK_START_METHOD`` overrides): macOS and Windows fork
    unsafely or not at all."""
    method = os.environ.get("LOSSMASK_START_METHOD")
    if method:
        return method
    return "fork" if sys.platform.startswith("linux") else "spawn"


def die_with_parent(parent: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent ends (Linux); exit now if it has ended already."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
            pass
    if os.getppid() != parent:  # the parent ended before the request was made
        os._exit(1)


def start_step_worker(threads: int, tokenizer: Any, parent: int = 0, held: Any = None) -> None:
    """Process-pool initializer: the job's tokenizer, once per worker (a forked worker has it in memory already).

    ``threads`` caps the Rust thread pools of this worker (set before any tokeniser runs here). The fast tokeniser
    starts loading now, in this worker (``ChatTokenizer.begin_job``). Ctrl-C, which a terminal sends to every
    process of the job, is the parent's to handle (it stops the job and ends the pool): a worker ignores it rather
    than print a traceback of its own. SIGTERM and SIGHUP end a worker at once (the parent's handlers, which stop
    a job between kernel calls, are not a worker's). ``parent``: the job's process, which this worker dies with.
    ``held``: the shared slots where each worker says which rows it holds (``WorkerPool``)."""
    if parent:
        die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    _STEP["held"] = held
    if held is not None:
        _claim_slot(held)
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    # A forked worker has none of the parent's Rust thread-pool threads: a parallel encode there waits forever for
    # them (seen). ``tokenizers`` encodes serially with parallelism off; a spawned worker starts pools of its own.
    forked = worker_start_method() == "fork"
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 and not forked else "false"
    _STEP["tokenizer"] = tokenizer
    tokenizer.begin_job()


def imports_before_fork() -> None:
    """Import here, once, what every worker would otherwise import on its first batch: numba and the kernels'
    module (about 0.5 CPU-s a process; importing starts no thread, numba's pool starts with its first parallel
    call), and pandas, which pyarrow imports on the first ``to_numpy`` where it is installed."""
    from ..engine import get_backend

    with contextlib.suppress(ImportError):  # a machine without numba labels with another backend
        get_backend("numba")
        from numba.core.registry import cpu_target

        # the typing and lowering registries, which numba loads on its first compile or cache load in a process
        # (about 0.4 CPU-s); nothing is compiled and no thread started
        cpu_target.target_context.refresh()
    pa.array([0]).to_numpy()


def worker_started() -> int:
    """A task that only makes the pool start its processes."""
    return os.getpid()


def step_in_worker(batch: Any, first_row: int, step: dict[str, Any]) -> tuple[pa.Buffer | None, int, Tally]:
    """One batch through the whole step in a worker: ``(Parquet part or None when no row is kept, rows kept,
    tally)``. ``batch``: the rows as an Arrow IPC stream, or a slice of the input that this worker reads itself
    (``jobs/slices.py``), in pieces of about ``options.batch_bytes``. ``step``: what every batch of the job shares
    (``markers``, ``options``, ``kind``, ``source``, ``write_weights``, ``schema``, ``input_schema``,
    ``writer_options``, ``row_group_size``, ``parts``: a few kB). With ``parts`` (a folder), the Parquet part is
    written there and its path returned: the parent copies it into the output without reading it. An error about a row is raised as it is; the parent names the
    row's file and line."""
    started, start = time.perf_counter(), first_row
    tally = Tally()
    if isinstance(batch, slices.SLICES):
        _hold(first_row, batch.num_rows)
        tables: Iterable[pa.Table] = slices.read_piece(batch, step)
    else:
        tables = [pa.ipc.open_stream(batch).read_all()]
        _hold(first_row, tables[0].num_rows)
    outs = []
    read_started = time.perf_counter()
    for table in tables:
        tally.time("read", time.perf_counter() - read_started)
        with one_thread(), kernel_call():  # the step every path shares (jobs/batch_step.py)
            out = mask_batch(table, step["markers"], step["options"], tally, tokenizer=_STEP["tokenizer"],
                             kind=step["kind"], first_row=first_row, source=step["source"],
                             write_weights=step["write_weights"], truncated_at=step.get("truncated_at"))
        first_row += table.num_rows
        if out.num_rows:
            outs.append(out if out.schema == step["schema"] else out.cast(step["schema"]))
        read_started = time.perf_counter()
    part, kept = None, sum(out.num_rows for out in outs)
    if kept:
        encoding = time.perf_counter()
        out = outs[0] if len(outs) == 1 else pa.concat_tables(outs)
        if step.get("parts") is not None:  # a file's share, as a file the parent copies in the kernel
            part = write_part(out, step["writer_options"], step["row_group_size"],
                              os.path.join(step["parts"], f"{start}.parquet"))
        elif step.get("writer_options") is not None:  # a file's share: Parquet, joined by the parent
            part = encode_part(out, step["writer_options"], step["row_group_size"])
        else:  # a dataset's share: the table itself, read back by the parent without a copy
            part = compact(out)
        tally.time("encode_part", time.perf_counter() - encoding)
    tally.time("worker", time.perf_counter() - started)
    return part, kept, tally


def _claim_slot(held: Any) -> None:
    """Take the first free slot of ``held`` (a pid of 0) for this worker."""
    with held.get_lock():
        for k in range(0, len(held), 3):
            if held[k] == 0:
                held[k] = os.getpid()
                _STEP["slot"] = k
                return


def _hold(first_row: int, rows: int) -> None:
    """Say in this worker's slot which rows it holds now (read by the parent only if this worker dies)."""
    held, k = _STEP.get("held"), _STEP.get("slot")
    if held is not None and k is not None:
        held[k + 1], held[k + 2] = first_row, rows


class WorkerPool(ProcessPoolExecutor):
    """The job's worker processes, which can say which of them died and what it held (``died``)."""

    def __init__(self, workers: int, context: Any, tokenizer: Any, threads: int):
        # three numbers a worker: its pid, the first row and the number of rows it holds (each worker claims a
        # slot under the lock as it starts, then writes only its own)
        self.held = context.Array("q", 3 * workers)
        super().__init__(workers, mp_context=context, initializer=start_step_worker,
                         initargs=(threads, tokenizer, os.getpid(), self.held))
        self.seen: dict[int, Any] = {}

    def start(self) -> None:
        """Start the processes now (forked at once; spawned ones start as work comes)."""
        self.submit(worker_started)
        self.started

    @property
    def started(self) -> list[Any]:
        """Every process this pool started, ended ones included (kept here, to ask later how they ended)."""
        self.seen.update(getattr(self, "_processes", None) or {})
        return list(self.seen.values())

    def died(self) -> WorkerDied:
        """The worker that ended first, as far as can be told: one killed by another signal than the SIGTERM
        the pool sends the others once one has died, else any that ended."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(p.exitcode for p in self.started):
            time.sleep(0.01)
        ended = [p for p in self.started if p.exitcode]
        ended.sort(key=lambda p: p.exitcode == -signal.SIGTERM)
        if not ended:
            return WorkerDied(-signal.SIGKILL)
        first = ended[0]
        for k in range(0, len(self.held), 3):
            if self.held[k] == first.pid:
                return WorkerDied(first.exitcode, self.held[k + 1], self.held[k + 2])
        return WorkerDied(first.exitcode)

    def ended(self) -> WorkerDied | None:
        """``died()`` when a worker has ended (a pool's workers live until it shuts down); None while all live. A
        process's sentinel is ready once it has ended, whichever thread reaped it."""
        from multiprocessing.connection import wait

        ended = getattr(self, "_broken", False) or wait([p.sentinel for p in self.started], timeout=0)
        return self.died() if ended else None

    def kill(self) -> None:
        """End every worker at once (SIGKILL): after a failure, none may be left writing to a pipe nobody reads."""
        for process in self.started:
            if process.exitcode is None:
                with contextlib.suppress(OSError, AttributeError, ValueError):
                    process.kill()


@contextlib.contextmanager
def worker_pool(workers: int, tokenizer: Any, threads: int) -> Iterator[Any]:
    """``workers`` processes started now (None for one or fewer: the job runs in this process), ended with the
    job: waited for after a job that succeeded, stopped with their pending batches cancelled after one that
    failed: killed, so that none is left blocked on a pipe. A worker that died is raised as ``WorkerDied`` (the
    caller may name its rows first: ``WorkerDied.first_row``). Forked, a worker shares this process's fast
    tokeniser, loaded here first."""
    if workers <= 1:
        yield None
        return
    import multiprocessing
    from concurrent.futures.process import BrokenProcessPool

    fast = getattr(tokenizer, "fast_tokens", None)
    if worker_start_method() == "fork":
        if fast is not None:
            fast.ready()  # loaded once and shared by every forked worker
        imports_before_fork()
    pool = WorkerPool(workers, multiprocessing.get_context(worker_start_method()), tokenizer, threads)
    try:
        pool.start()  # the processes start here (forked at once), before anything below runs
        yield pool
    except BrokenProcessPool:
        died = pool.died()
        pool.kill()
        pool.shutdown(wait=False, cancel_futures=True)
        raise died from None
    except BaseException:
        pool.kill()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    died = pool.ended()  # a worker that died since the job's last look: shutting down would wait for it for ever
    if died is not None:
        pool.kill()
        pool.shutdown(wait=False, cancel_futures=True)
        raise died
    pool.shutdown(wait=True)


def in_order(pool: Any, batches: Iterable[Any], step: dict[str, Any], workers: int,
             tally: Tally) -> Iterator[tuple[Any, int, Any]]:
    """``(batch, first_row, future of step_in_worker's result)`` in input order, with at most ``2 * workers``
    batches handed out and not yet taken; the futures not taken are cancelled when the caller stops early. A batch
    is a record batch or table (sent as Arrow IPC) or a slice of the input (sent as it is: the worker reads it)."""
    import collections

    pending: collections.deque = collections.deque()
    first_row = 0
    try:
        for batch in batches:
            started = time.perf_counter()
            rows = batch if isinstance(batch, slices.SLICES) else compact(batch)
            pending.append((batch, first_row, pool.submit(step_in_worker, rows, first_row, step)))
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
