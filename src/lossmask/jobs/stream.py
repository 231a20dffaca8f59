"""``mask_files``: files in, one Parquet file out, batch by batch, with memory bounded by the batch size.

Input: a Parquet file, a folder or glob of Parquet files, Arrow IPC (``.arrow`` / ``.feather`` /
``.ipc``), or JSON Lines or a JSON array (``.jsonl`` / ``.json``, also gzip, bzip2 or zstd compressed),
from files, stdin or pipes, read one batch at a time (``inputs.py``).
Output: Parquet written as the batches are labelled, to a hidden partial name beside the target,
renamed onto it (with the report) only when the whole job (safety net included) succeeded; a failed
job leaves no file that looks complete (``outputs.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, Callable, NamedTuple

import pyarrow as pa

from ..engine import one_thread
from .display import SHOW_TOKENS
from .inputs import InputFiles, open_inputs
from ..chat.turn_spans import FromRendering
from ..engine.patterns import Markers
from ..options import SHAREGPT_COLUMN, MaskOptions
from ..chat.render import ChatTemplateError
from .batch_step import input_kind, mask_batch, output_schema
from .display import escaped
from .outputs import (OutputError, as_output_error, check_compression, check_output, check_output_format, commit,
                      output_lock, partial_name, remove_quietly, remove_stale_partials)
from .report import MaskReport, Tally
from .safety import TooManyDroppedRows, check_drop_fraction
from .stopping import handing_over, kernel_call
from .workers import WorkerDied, worker_pool


def mask_files(
    input: str | os.PathLike | list | None,
    output: str | os.PathLike,
    *,
    tokenizer: Any = None,
    chat_template: str | os.PathLike | None = None,
    model_name: str | None = None,
    markers: Markers | dict | str | os.PathLike | None = None,
    strict: bool = False,
    input_format: str | None = None,
    options: MaskOptions | None = None,
    row_group_size: int | None = None,
    compression: str = "snappy",
    num_proc: int = 1,
    progress: bool | None = None,
    report: str | os.PathLike | None = None,
    dataset_info: str | os.PathLike | None = None,
    dataset: str | None = None,
    **option_fields: Any,
) -> MaskReport:
    """Label every row of ``input`` and write the rows that train something to the Parquet file ``output``.

    Markers come from ``markers`` (a ``Markers``, its dict, or a JSON file) or, when not given, from
    ``tokenizer`` through ``lossmask.resolve_markers`` (with ``model_name`` and ``strict``). How rows are
    read, labelled and kept is ``options`` (a ``MaskOptions``) or its fields as keywords
    (``max_length=2048, keep_dropped=True, completion_mask=True, batch_size=...``). A tokenizer
    is also needed for ``messages`` and ``prompt``/``completion`` input; ``chat_template`` (a Jinja
    file or string) replaces its template, for tokenizers that ship none. ``num_proc`` > 1 labels chat and
    prompt/completion rows in up to ``num_proc`` worker processes, each carrying the whole step of a batch (render,
    tokenise, label, encode its share of the Parquet file), where the cores and rows pay for them (``plan_workers``);
    this process only orders their results and joins them, so the output and report are the same as one process
    writes. ``progress`` shows a bar (default: when stderr is a terminal). ``report``: a path to write the JSON report to. Returns the ``MaskReport``;
    raises ``TooManyDroppedRows`` (and writes nothing) when more than ``options.max_drop_fraction`` of the rows
    would train nothing.

    ``messages`` and ``prompt``/``completion`` rows are rendered here, so message text stays data: a
    special-token string in it is text by default (``special_tokens_in_content``), no marker matches
    inside it, and a row whose message the template dropped is counted as ``content_dropped``.
    Pre-tokenised ``input_ids`` cannot be fixed that way: a marker's text inside a message acts as
    the marker there.
    Weights (docs/weights.md): ``roles_to_train``, ``weights_by_role``, the messages' weight fields and spans,
    ``reasoning``, ``prompt_weight`` and ``train_on_eos`` give a float per token, written as ``loss_weights``
    when one can be other than 0 and 1 (or ``loss_weights=True``); labels train where it is > 0. Pre-tokenised
    ``input_ids`` take only the marker-level ones (``prompt_weight``, ``train_on_eos``, ``last_turn_only``).
    Every output location is checked before any row is read (``output`` may not be an input, a folder, in a
    missing or unwritable folder, or named for another format than Parquet); the data and the report are
    committed together or not at all, and a failed job leaves neither (``OutputError`` names the path and the
    cause of an OS error). While the job runs it holds a lock on ``output``: a second job on it is refused.
    ``input="-"`` reads stdin; stdin and pipes are copied to a temporary file once (see ``docs/inputs.md``).
    With a tokenizer, token ids it does not have are refused, naming the file, row and position.
    ``dataset_info`` (LLaMA-Factory's ``dataset_info.json``) and ``dataset`` (a name registered there) stand for
    ``input``: the entry's file is read with its ``formatting``, ``columns`` and ``tags`` (``jobs/dataset_info.py``);
    pass ``None`` as ``input`` then.
    """
    options = MaskOptions.resolve(options, **option_fields)
    if dataset_info is not None or dataset is not None:
        input, options = registered_input(input, dataset_info, dataset, options)
    if input is None:
        raise ValueError("no input: pass INPUT (a file, folder or glob), or a dataset of LLaMA-Factory's "
                         "dataset_info.json (--dataset-info FILE --dataset NAME; dataset_info=, dataset= in Python)")
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"num_proc={num_proc!r} must be a positive number of processes")
    check_compression(compression)
    started = time.perf_counter()
    output = os.fspath(output)
    check_output_format(output)
    report = None if report is None else os.fspath(report)
    files = open_inputs(input, input_format=input_format, exclude=(output, report))
    try:
        check_output(output, inputs=files.paths)
        if report is not None:
            check_output(report, what="report", inputs=files.paths)
            if os.path.realpath(report) == os.path.realpath(output):
                raise ValueError(f"report {report} is the output {output}; write the report to another path")
        with output_lock(output):
            return _mask_job(files, output, report, tokenizer=tokenizer, chat_template=chat_template,
                             model_name=model_name, markers=markers, strict=strict, options=options,
                             row_group_size=row_group_size, compression=compression, num_proc=num_proc,
                             progress=progress, started=started)
    finally:
        files.close()


def registered_input(input: Any, dataset_info: Any, dataset: str | None, options: MaskOptions) -> tuple[str, MaskOptions]:
    """The file of a dataset registered in LLaMA-Factory's ``dataset_info.json``, and ``options`` reading it as
    LLaMA-Factory does (``jobs/dataset_info.py``)."""
    from .dataset_info import dataset_entry

    if dataset_info is None or dataset is None:
        raise ValueError("dataset_info= and dataset= go together: the dataset_info.json and the name of a dataset it "
                         "registers (--dataset-info FILE --dataset NAME)")
    if input is not None:
        raise ValueError(f"input {input!r} and dataset_info= both name the input; pass one (with --dataset-info, give "
                         "only OUTPUT on the command line)")
    entry = dataset_entry(dataset_info, dataset)
    return entry.input, dataclasses.replace(options, **entry.fields)

def _mask_job(dataset: InputFiles, output: str, report: str | None, *, tokenizer: Any, chat_template: Any,
              model_name: str | None, markers: Any, strict: bool, options: MaskOptions, row_group_size: int | None,
              compression: str, num_proc: int, progress: bool | None, started: float) -> MaskReport:
    """The job of ``mask_files`` once its inputs are open, its outputs checked and the output locked."""
    source = dataset.source
    kind = job_input_kind(dataset, options)
    tokenizer, bare = _job_tokenizer(tokenizer, chat_template, kind, source), tokenizer
    text_pairs = kind == "prompt_completion" and is_text_pairs(dataset.schema, options)
    renders = kind in ("messages", "alpaca") or (kind == "prompt_completion" and not text_pairs)
    total_rows = dataset.count_rows()
    in_workers = renders and tokenizer is not None and getattr(tokenizer, "processor", None) is None
    workers, batch_size = plan_workers(num_proc, total_rows, options.batch_size, renders=renders)
    if not in_workers:  # token ids and text pairs have nothing to render; images expand in this process
        workers = 1
    notes: tuple = ()
    if renders and workers < num_proc:
        rows = "" if total_rows is None else f" for {total_rows:,} rows"
        why = ("images are expanded in this process" if not in_workers else
               f"a worker pays from {2 * MIN_ROWS_PER_WORKER:,} rows, at most one per core")
        notes = (f"num_proc={num_proc}: {workers} worker{'s' * (workers > 1)} on {_cores()} cores{rows} ({why})",)
    # workers start before this process runs a Rust tokeniser or a numba thread pool, whose threads a fork
    # would not carry (jobs/workers.py)
    with worker_pool(workers, tokenizer, _worker_threads(workers)) as pool:
        return _prepared_job(dataset, output, report, tokenizer=tokenizer, bare=bare, chat_template=chat_template,
                             model_name=model_name, markers=markers, strict=strict, options=options,
                             row_group_size=row_group_size, compression=compression, progress=progress,
                             started=started, kind=kind, text_pairs=text_pairs, renders=renders,
                             total_rows=total_rows, workers=workers, batch_size=batch_size, notes=notes, pool=pool)


def _prepared_job(dataset: InputFiles, output: str, report: str | None, *, tokenizer: Any, bare: Any,
                  chat_template: Any, model_name: str | None, markers: Any, strict: bool, options: MaskOptions,
                  row_group_size: int | None, compression: str, progress: bool | None, started: float, kind: str,
                  text_pairs: bool, renders: bool, total_rows: int | None, workers: int, batch_size: int,
                  notes: tuple, pool: Any) -> MaskReport:
    """The job once its shape is known and its workers (``pool``, when ``workers > 1``) started: markers, then the
    batches, then the commit."""
    source = dataset.source
    if tokenizer is not None and kind != "input_ids":
        tokenizer.begin_job()  # the fast tokeniser loads on a thread while markers are resolved
        try:  # a template that never ends, or breaks out of the sandbox, stops the job here, not after a warning
            tokenizer.check_templates()
        except ChatTemplateError as exc:
            if isinstance(chat_template, (str, os.PathLike)) and "{" not in os.fspath(chat_template):
                raise type(exc)(f"{escaped(os.fspath(chat_template))}: {exc}") from None  # the file given names it
            raise
    if text_pairs:
        if tokenizer is None:
            raise ValueError(f"{source}: prompt/completion text needs a tokenizer (--tokenizer DIR / tokenizer=)")
        resolved, markers_source, messages = None, "position", (POSITION_NOTE,)
    else:
        resolved, markers_source, messages = resolve_job_markers(
            markers, tokenizer=tokenizer if tokenizer is not None or markers is not None else bare,
            model_name=model_name, strict=strict,
        )
    schema = output_schema(dataset.schema, options, kind, source=source)
    messages = (*messages, *dataset.skipped, *remove_stale_partials(output),
                *remove_stale_partials(f"{output}.parts"),
                *(remove_stale_partials(report) if report is not None else ()), *notes)
    tally = Tally()
    tally.time("setup", time.perf_counter() - started)  # open, load the tokenizer, choose and verify the markers
    temporary = partial_name(output)
    report_partial = partial_name(report) if report is not None else None
    show = _progress_bar(progress, total=total_rows)
    try:
        write_weights = options.loss_weights_column in schema.names
        if workers > 1:  # the whole step in the workers; here only ordering, counting and joining their parts
            step = dict(tokenizer=tokenizer, markers=resolved, options=options, kind=kind, source=source,
                        write_weights=write_weights, schema=schema, row_group_size=row_group_size,
                        writer_options=writer_options(schema, options, compression))
            step["parts"] = partial_name(f"{output}.parts")  # a folder the workers write their parts in
            _job_in_workers(dataset, batch_size, tally, pool, workers, step, temporary, show)
        else:
            _job_in_process(dataset, batch_size, source, tally, kind, options, tokenizer, resolved, renders,
                            schema, compression, row_group_size, write_weights, temporary, show)
        show(None, tally)
        check_job_drops(tally, tokenizer, options)
        tally.seconds["total"] = time.perf_counter() - started
        result = MaskReport.build(
            tally, markers=resolved, markers_source=markers_source, keep_dropped=options.keep_dropped,
            input=source, output=output, messages=messages,
            decode=(lambda t: tokenizer.decode([t])) if tokenizer is not None else None,
        )
        if report_partial is not None:
            result.to_json(report_partial)
        if pool is not None:  # a worker killed since its last part: the job stops, as at any other stage
            died = pool.ended()
            if died is not None:
                raise WorkerDied(died.status, died.first_row, died.rows,
                                 where=rows_where(dataset, died.first_row, died.rows))
        commit([(temporary, output)] + ([(report_partial, report)] if report is not None else []))
    except BaseException as exc:
        show(None, tally)
        remove_quietly(temporary)
        remove_quietly(report_partial)
        if isinstance(exc, OSError) and not isinstance(exc, (OutputError, WorkerDied)):
            raise _os_error(exc, output, report, report_partial) from None
        raise
    return result


def _job_in_workers(dataset, batch_size, tally, pool, workers, step, temporary, show) -> None:
    """The job's batches through the ``workers`` processes of ``pool``, each carrying the whole step
    (``jobs/workers.py``); this process adds their tallies in input order and joins their Parquet parts into
    ``temporary``. The workers write their parts as files in the folder ``step["parts"]`` (a partial beside the
    output, removed with the job), which are copied into ``temporary`` in the kernel, never read here."""
    from concurrent.futures.process import BrokenProcessPool

    from .parquet_parts import PartsFile
    from .workers import in_order

    step = {name: value for name, value in step.items() if name != "tokenizer"}  # the workers have theirs
    parts = PartsFile(temporary, step["schema"], step["writer_options"])
    try:
        os.mkdir(step["parts"])
        plan = _planned_slices(dataset, batch_size, workers, pool)
        if plan is not None:  # the workers read their rows themselves: this process planned slices
            step["input_schema"], step["typed"] = dataset.schema, dataset.heads is not None
            batches = map(dataset.record, plan)
        else:
            batches = _timed_reads(_batches(dataset, batch_size, step["options"]), tally)
        for batch, first_row, future in _handed_over(in_order(pool, batches, step, workers, tally)):
            seen = len(tally.invalid_examples)
            try:
                with handing_over():
                    part, kept, batch_tally = future.result()
            except (ValueError, TypeError) as exc:
                raise _with_message(exc, dataset.name_rows(str(exc), count=1)) from None
            except BrokenProcessPool:  # a worker died: one line naming the signal and the rows it held
                died = pool.died()
                raise WorkerDied(died.status, died.first_row, died.rows,
                                 where=rows_where(dataset, died.first_row, died.rows)) from None
            tally += batch_tally  # in input order
            tally.invalid_examples[seen:] = [dataset.name_rows(e, count=1) for e in tally.invalid_examples[seen:]]
            if part is not None:
                started = time.perf_counter()
                parts.append(part)
                tally.time("write", time.perf_counter() - started)
            show(batch.num_rows, tally)
        started = time.perf_counter()
        parts.close()
        tally.time("write", time.perf_counter() - started)
    except BaseException:
        parts.abandon()
        raise
    finally:
        remove_quietly(step["parts"])


def _planned_slices(dataset: InputFiles, batch_size: int, workers: int, pool: Any):
    """The slices of the input that the workers read themselves (``jobs/slices.py``), in order; None when the
    parent reads the input and hands it out as batches. The slices of JSON Lines are counted by the workers
    (``count_json_lines``) as the job goes: this process adds the counts up."""
    from . import slices

    kind = dataset.sliceable()
    if kind == "parquet":
        return slices.parquet_slices(dataset, batch_size, workers)
    if kind != "json":
        return None
    plan = slices.json_slices(dataset, batch_size, workers)
    if plan is None:
        return None
    return slices.counted(plan, pool.map(slices.count_json_lines,
                                         [p for p in plan if isinstance(p, slices.JsonLinesSlice)]))


def rows_where(dataset: InputFiles, first_row: int, rows: int) -> str | None:
    """Where rows ``first_row`` to ``first_row + rows - 1`` of a job are: ``chats.jsonl, lines 4001-4512`` (None
    when they are not named by more than their numbers, as the rows of one Parquet file are)."""
    if rows <= 0:
        return None
    first, last = dataset.where(first_row), dataset.where(first_row + rows - 1)
    if first is None and last is None:  # not named yet (or a Parquet file's rows): the file at least
        return escaped(dataset.paths[0]) if len(dataset.paths) == 1 and dataset.paths[0] != "-" else None
    if first is None or last is None:
        return first or last
    head, _, start = first.rpartition(" ")
    last_head, _, end = last.rpartition(" ")
    if head == last_head:
        return f"{head}s {start}-{end}"  # "file, line" + "s"
    return f"{first} to {last}"


def _job_in_process(dataset, batch_size, source, tally, kind, options, tokenizer, resolved, renders, schema,
                    compression, row_group_size, write_weights, temporary, show) -> None:
    """The job in this process: rendering, tokenising (a thread) and writing (another) overlapped."""
    writer = output_writer(temporary, schema, options, compression)
    # rendering jobs keep both cores busy with Python and the tokeniser: label on one thread alone
    single = one_thread if renders and (options.backend or "numba") == "numba" else nullcontext

    def label(batch, first_row, encoded) -> _Labelled:
        """``mask_batch`` on the thread that tokenised the batch, into a tally of its own: this thread goes on
        rendering meanwhile (the kernels release the GIL; labelling here waited for it after each of them)."""
        batch_tally = Tally()
        with single():
            out = mask_batch(batch, resolved, options, batch_tally, tokenizer=tokenizer, kind=kind,
                             first_row=first_row, source=source, encoded=encoded, write_weights=write_weights)
        return _Labelled(out, batch_tally)

    with _BackgroundWriter(writer, schema, row_group_size, tally) as background, single():
        for batch, first_row, encoded in _encoded_batches(dataset, batch_size, source, tally, kind, options,
                                                         tokenizer, resolved, renders=renders, label=label):
            seen = len(tally.invalid_examples)
            try:
                if isinstance(encoded, Future):  # tokenised (and labelled) on a thread
                    with handing_over():
                        encoded = encoded.result()
                if isinstance(encoded, _Labelled):
                    out = encoded.table
                    tally += encoded.tally  # in input order
                else:
                    with kernel_call():  # a stop signal waits for the kernel (jobs/stopping.py)
                        out = mask_batch(batch, resolved, _batch_options(options, dataset, first_row, tokenizer),
                                         tally, tokenizer=tokenizer, kind=kind, first_row=first_row,
                                         source=source, encoded=encoded, write_weights=write_weights)
            except (ValueError, TypeError) as exc:
                raise _with_message(exc, dataset.name_rows(str(exc), count=1)) from None
            tally.invalid_examples[seen:] = [dataset.name_rows(e, count=1) for e in tally.invalid_examples[seen:]]
            background.put(out)
            show(batch.num_rows, tally)


def output_writer(path: str, schema: pa.Schema, options: MaskOptions, compression: str = "snappy") -> Any:
    """The ``pyarrow.parquet.ParquetWriter`` a job writes its output with."""
    import pyarrow.parquet as pq

    return pq.ParquetWriter(path, schema, **writer_options(schema, options, compression))


def writer_options(schema: pa.Schema, options: MaskOptions, compression: str = "snappy") -> dict:
    """The ``ParquetWriter`` settings of a job's output, the same whether the parent or a worker encodes it."""
    # (loss_weights keeps them: a handful of distinct values, which a dictionary stores in a few bits each)
    token_columns = {options.input_ids_column, options.labels_column, options.completion_mask_column}
    other_columns = [name for name in schema.names if name not in token_columns]
    # Token columns are high-cardinality lists: dictionary encoding and statistics only cost time there. No page
    # index and no bloom filter: their offsets lie outside the row groups, which workers' parts are joined by
    # (jobs/parquet_parts.py).
    return dict(compression=compression, use_dictionary=other_columns or False,
                write_statistics=other_columns or False, write_page_index=False)


def job_input_kind(dataset: InputFiles, options: MaskOptions) -> str:
    """The input shape of every file of a job, which must be the same: never decided from the first file alone."""
    kinds = [input_kind(schema, options, source=path) for path, schema in zip(dataset.paths, dataset.file_schemas)]
    for path, kind in zip(dataset.paths[1:], kinds[1:]):
        if kind != kinds[0]:
            raise ValueError(
                f"{path} holds {KIND_NAMES[kind]} but {dataset.paths[0]} holds {KIND_NAMES[kinds[0]]}; the files of "
                "one job must hold the same input shape: mask them separately"
            )
    kind = input_kind(dataset.schema, options, source=dataset.source)
    if kind == "messages":
        _warn_unread_conversations(dataset, options)
    if kind == "input_ids" and options.messages_column in dataset.schema.names:
        import warnings

        warnings.warn(
            f"{dataset.source} has both {options.input_ids_column!r} and {options.messages_column!r}: the token ids "
            f"in {options.input_ids_column!r} are labelled as they are, and the messages are not rendered. To label the "
            "messages instead, pass --input-ids-column NAME (input_ids_column=NAME in Python) with a name the input "
            "does not have: the ids tokenised from the messages are written there", UserWarning, stacklevel=4,
        )
    return kind


def _warn_unread_conversations(dataset: InputFiles, options: MaskOptions) -> None:
    """One warning per file that holds both the messages column and ShareGPT's ``conversations``: only the first
    is read, which must not pass without a word (docs/inputs.md)."""
    import warnings

    column = options.chat_column(dataset.schema.names)
    if column == SHAREGPT_COLUMN:
        return
    for path, schema in zip(dataset.paths, dataset.file_schemas):
        if column in schema.names and SHAREGPT_COLUMN in schema.names:
            warnings.warn(
                f"{path} has both {column!r} and {SHAREGPT_COLUMN!r}: the chats are read from {column!r}, and "
                f"{SHAREGPT_COLUMN!r} is not read; pass --messages-column {SHAREGPT_COLUMN} "
                f"(messages_column={SHAREGPT_COLUMN!r}) to read it instead", UserWarning, stacklevel=5,
            )


KIND_NAMES = {"input_ids": "token ids (input_ids)", "messages": "chat messages",
              "prompt_completion": "prompt/completion pairs", "alpaca": "Alpaca rows (instruction, input, output)"}


def _with_message(exc: BaseException, message: str) -> BaseException:
    if str(exc) == message:
        return exc
    try:
        return type(exc)(message)
    except TypeError:  # an exception class with other arguments: keep it as it is
        return exc


def _os_error(exc: OSError, output: str, report: str | None, report_partial: str | None) -> OSError:
    """An OS error of a job as one line naming the path: the output, the report, or the file that was read."""
    filename = getattr(exc, "filename", None)
    if filename and report is not None and os.fspath(filename) == report_partial:
        return as_output_error(exc, report)
    if filename and not os.path.basename(os.fspath(filename)).endswith(".partial"):
        cause = exc.strerror or str(exc).splitlines()[0]
        error = OSError(f"{filename}: {cause}")
        error.errno = exc.errno
        return error
    return as_output_error(exc, output)


class _BackgroundWriter:
    """Writes labelled batches on a thread while the next batch is read and labelled (Arrow releases the GIL).

    At most two batches wait, so memory stays bounded by the batch size. An error in the writer is
    raised in the caller at the next ``put`` or at exit.
    """

    def __init__(self, writer, schema: pa.Schema, row_group_size: int | None, tally: Tally):
        import queue
        import threading

        self.writer, self.schema, self.row_group_size, self.tally = writer, schema, row_group_size, tally
        self.queue: queue.Queue = queue.Queue(maxsize=2)
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.thread = threading.Thread(target=self._run, name="lossmask-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            table = self.queue.get()
            if table is None:
                return
            if self.error is not None:
                continue  # drain after a failure
            started = time.perf_counter()
            try:
                if table.num_rows:
                    if table.schema != self.schema:
                        table = table.cast(self.schema)
                    self.writer.write_table(table, row_group_size=self.row_group_size)
            except BaseException as exc:  # raised in the caller
                self.error = exc
            self.seconds += time.perf_counter() - started

    def put(self, table: pa.Table) -> None:
        if self.error is not None:
            raise self.error
        started = time.perf_counter()
        with handing_over():
            self.queue.put(table)
        self.tally.time("write_wait", time.perf_counter() - started)

    def __enter__(self) -> "_BackgroundWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        with handing_over():
            self.queue.put(None)
            self.thread.join()
        self.tally.time("write", self.seconds)
        try:
            self.writer.close()
        except BaseException:
            if exc_type is None and self.error is None:
                raise
        if exc_type is None and self.error is not None:
            raise self.error


MIN_ROWS_PER_WORKER = 2_000  # below this, starting a process (a fork, a tokenizer's threads) costs more than it renders
MIN_WORKER_BATCH = 512


def plan_workers(num_proc: int, rows: int | None, batch_size: int, *, renders: bool,
                 cores: int | None = None) -> tuple[int, int]:
    """``(processes, batch size)`` for a job: as many worker processes as the work and the cores pay for, batches
    small enough that each gets several, and the job itself in one process when rendering is not what it does.

    ``num_proc`` counts the workers, each of which carries the whole step of a batch (render, locate, tokenise,
    label, encode its Parquet part: ``jobs/workers.py``); this process only hands batches out, orders the results
    and joins the parts. At most ``cores`` workers. A job of ``rows`` rows uses at most
    ``rows // MIN_ROWS_PER_WORKER`` workers, with batches of ``rows / (4 * workers)`` rows (at least
    ``MIN_WORKER_BATCH``, at most ``batch_size``), so the last batch does not leave one worker running alone. One
    process (``processes == 1``: no worker) renders a batch while a thread tokenises the one before and another
    writes; it takes batches of ``rows / 8``, so that they overlap. When ``rows`` is not known (JSON Lines beyond
    the rows read for the schema, stdin), batches are of at most ``4 * MIN_WORKER_BATCH`` rows.
    """
    if not renders:
        return 1, batch_size
    cores = _cores() if cores is None else cores
    num_proc = min(num_proc, cores)
    if rows is None:  # batches small enough that the first one's rendering is not all the job does alone
        return (max(num_proc, 1), min(batch_size, 4 * MIN_WORKER_BATCH))
    num_proc = min(num_proc, rows // MIN_ROWS_PER_WORKER)
    if num_proc <= 1:
        return 1, min(batch_size, max(MIN_WORKER_BATCH, -(-rows // 8)))
    return num_proc, min(batch_size, max(MIN_WORKER_BATCH, -(-rows // (4 * num_proc))))


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def _worker_threads(workers: int) -> int:
    return max(1, _cores() // workers)


class _Labelled(NamedTuple):
    """A batch labelled on the tokenising thread, and its tally (added to the job's in input order)."""

    table: pa.Table
    tally: Tally


def _batch_options(options: MaskOptions, dataset: InputFiles, first_row: int, tokenizer: Any) -> MaskOptions:
    """``options`` for one batch: through a processor, with no ``media_dir`` given, a relative image path is read
    from the folder of the data file that holds the row (a batch is read from one file)."""
    if options.media_dir is not None or getattr(tokenizer, "processor", None) is None:
        return options
    folder = dataset.folder_of(first_row)
    return options if folder is None else dataclasses.replace(options, media_dir=folder)


def _encoded_batches(dataset, batch_size, source, tally, kind, options, tokenizer, markers="unknown", *,
                     renders=False, label: Callable | None = None):
    """``(batch, first_row, encoded)`` in input order. ``encoded`` is None when the batch is encoded by ``mask_batch``
    (token ids, plain-text prompt/completion), else a ``Future`` of its ``EncodedBatch``, tokenised on a thread while
    the next batch renders here. With ``label``
    (``label(batch, first_row, encoded)``), the future holds what that returns, called on the same thread. The caller
    takes ``.result()``, where an error about a row is named by its file and line."""
    batches = _timed_reads(_batches(dataset, batch_size, options), tally)
    vision = getattr(tokenizer, "processor", None) is not None  # images expand in the batch step, in this process
    if vision or not renders or tokenizer is None:
        first_row = 0
        for batch in batches:
            yield batch, first_row, None
            first_row += batch.num_rows
        return
    import collections

    from ..chat.encode_batch import tokenize_rendered

    def tokenise(batch, first_row, rendered):  # on the thread: a worker's batch is waited for there, not here
        waited = 0.0
        if isinstance(rendered, Future):
            started = time.perf_counter()
            rendered = rendered.result()
            waited = time.perf_counter() - started
        encoded = tokenize_rendered(tokenizer, rendered, options, markers=markers)
        if waited:  # added to the tally with the batch's other stages
            encoded.seconds["encode_wait"] = waited
        return encoded if label is None else label(batch, first_row, encoded)

    # Rendering and locating are Python under the GIL; tokenising (Rust) and labelling (numba) release it. So
    # batch k is tokenised on a thread while the next batches render, and labelled there too when ``label`` is
    # given (else by the caller), then written.
    with ThreadPoolExecutor(1, thread_name_prefix="lossmask-tokenise") as threads:
        ahead: collections.deque = collections.deque()
        for batch, first_row, rendered in _rendered_batches(batches, kind, options, tokenizer):
            with handing_over():
                ahead.append((batch, first_row, threads.submit(tokenise, batch, first_row, rendered)))
            if len(ahead) >= 2:
                yield ahead.popleft()
        while ahead:
            yield ahead.popleft()


def _rendered_batches(batches, kind, options, tokenizer):
    """``(batch, first_row, rendered)``: a ``RenderedBatch`` rendered here and its message text located, or a
    ``Future`` holding the failure (raised where the caller names the row)."""
    from ..chat.encode_batch import render_table

    first_row = 0
    for batch in batches:
        try:
            # message text is located here too: on the tokenising thread, under the GIL, it held up the renderer
            rendered = render_table(tokenizer, pa.Table.from_batches([batch]), kind, options, first_row=first_row,
                                    locate=True)
        except Exception as exc:  # raised where the caller names the row
            rendered = _failed(exc)
        yield batch, first_row, rendered
        first_row += batch.num_rows


def _failed(exc: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(exc)
    return future


def _timed_reads(batches, tally):
    """The batches, with the time spent waiting for each added to the tally as ``read``."""
    read_started = time.perf_counter()
    for batch in _handed_over(batches):
        tally.time("read", time.perf_counter() - read_started)
        yield batch
        read_started = time.perf_counter()


def _handed_over(items):
    """``items``, a stop signal waiting while the next is taken (``handing_over``): a reading thread hands batches
    over through a queue, and a worker pool takes them through its own."""
    items, done = iter(items), object()
    try:
        while True:
            with handing_over():
                item = next(items, done)
            if item is done:
                return
            yield item
    finally:
        getattr(items, "close", lambda: None)()  # a generator's clean-up (its thread, its pending batches) now


def _batches(dataset: InputFiles, batch_size: int, options: MaskOptions):
    """Batches of at most ``batch_size`` rows and about ``options.batch_bytes`` bytes, reading ahead little, so
    that memory stays bounded by bytes, not rows."""
    return dataset.batches(batch_size, options.batch_bytes)


POSITION_NOTE = "prompt/completion text: the completion tokens and EOS train, the prompt tokens do not (by position)"


def is_text_pairs(schema: pa.Schema, options: MaskOptions) -> bool:
    """Prompt/completion given as plain strings (labelled by position, without markers)."""
    field = schema.field(options.prompt_column)
    return pa.types.is_string(field.type) or pa.types.is_large_string(field.type)


def resolve_job_markers(markers: Any, *, tokenizer: Any, model_name: str | None, strict: bool):
    """``(Markers or None, where they came from, messages for the user)`` for a job; a processor's media tokens are
    added to ``mask_out`` (``markers.media``), however the markers came."""
    from ..markers.media import with_media

    resolved, source, messages = _resolve_job_markers(markers, tokenizer=tokenizer, model_name=model_name, strict=strict)
    return with_media(resolved, tokenizer), source, messages


def _resolve_job_markers(markers: Any, *, tokenizer: Any, model_name: str | None, strict: bool):
    if markers is not None:
        if isinstance(markers, Markers):
            return markers, "given", ()
        if isinstance(markers, FromRendering):  # asked for: each row labelled from its own rendering
            return markers, "rendered", ()
        if isinstance(markers, dict):
            return Markers.from_dict(markers), "given", ()
        path = os.fspath(markers)
        return Markers.from_json(path), f"file {path}", ()
    if tokenizer is None:
        raise ValueError("pass markers= (a Markers value or a JSON file, --markers FILE.json) or tokenizer= "
                         "(--tokenizer DIR) to derive them from its chat template")
    try:
        from ..markers.policy import resolve_markers
    except ImportError:  # pragma: no cover - a build without markers.policy
        from ..markers.detect import detect_markers

        return detect_markers(tokenizer), "detected", ()
    resolution = resolve_markers_cached(tokenizer, lambda: resolve_markers(tokenizer, model_name=model_name, strict=strict),
                                 model_name=model_name, strict=strict)
    return resolution.markers, resolution.source, tuple(resolution.messages)


def resolve_markers_cached(tokenizer: Any, resolve, **arguments: Any):
    """``resolve()`` through the on-disk marker cache (``markers.cache``) when the tokenizer is a ``ChatTokenizer``."""
    from ..chat.tokenizer import ChatTokenizer

    if not isinstance(tokenizer, ChatTokenizer):
        return resolve()
    from ..markers.cache import resolve_cached

    return resolve_cached(tokenizer, resolve, **arguments)


def _job_tokenizer(tokenizer: Any, chat_template: Any, kind: str, source: str):
    """The job's tokenizer adapter; None for pre-tokenised rows when the tokenizer has no chat template (a base
    model: the policy then decides, and says so). Chat rows need a template: the error names --chat-template."""
    if tokenizer is None:
        return None
    from ..chat.tokenizer import ChatTemplateError

    try:
        return load_chat_tokenizer(tokenizer, chat_template=chat_template)
    except ChatTemplateError as exc:
        if kind == "input_ids":
            return None
        raise ChatTemplateError(
            f"{exc}. {source}: {kind} rows are rendered with a chat template: pass the one you train with "
            "(--chat-template FILE.jinja, or chat_template= in Python)"
        ) from None


def load_chat_tokenizer(tokenizer: Any, *, chat_template: str | os.PathLike | None = None):
    """The tokenizer adapter of a job, with its chat template replaced when ``chat_template`` is given."""
    from ..chat.encode_batch import chat_tokenizer

    check_tokenizer_path(tokenizer)
    if chat_template is None:
        try:
            return chat_tokenizer(tokenizer)
        except ValueError:
            check_tokenizer_path(tokenizer, loaded=False)
            raise
    from ..chat.tokenizer import ChatTokenizer

    text = os.fspath(chat_template)
    if "{" not in text:  # a path, not a template
        if not os.path.isfile(text):
            raise FileNotFoundError(f"chat_template={text!r}: no such file (pass a Jinja template file or string)")
        with open(text, encoding="utf-8") as fh:
            text = fh.read()
    if isinstance(tokenizer, (str, os.PathLike)):  # its folder may hold no template at all: load it bare
        from ..chat.tokenizer import auto_tokenizer

        path = os.fspath(tokenizer)
        try:
            hf_tokenizer = auto_tokenizer(path)
        except Exception as exc:
            check_tokenizer_path(path, loaded=False)
            raise ValueError(f"could not load a tokenizer from {path!r} offline ({type(exc).__name__}: {exc})") from exc
        hf_tokenizer.chat_template = text  # ours alone: a trainer given it renders as we do
        return ChatTokenizer(hf_tokenizer, chat_template=text, name=path)
    adapter = chat_tokenizer(tokenizer)
    return ChatTokenizer(adapter.tokenizer, chat_template=text, name=adapter.name)


_MODEL_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def check_tokenizer_path(tokenizer: Any, *, loaded: bool | None = None) -> None:
    """Refuse a tokenizer path that does not exist with that said, not with what Hugging Face says of it ("Repo id
    must be in the form ..."). A name that could be a model id (``org/name``) may still load from the local Hugging
    Face cache, so it is refused only once loading it failed (``loaded=False``)."""
    if not isinstance(tokenizer, (str, os.PathLike)):
        return
    path = os.fspath(tokenizer)
    if os.path.exists(path):
        return
    could_be_id = _MODEL_ID.fullmatch(path) is not None and ".." not in path
    if not could_be_id:
        raise FileNotFoundError(f"tokenizer {path}: the folder does not exist; pass a folder holding tokenizer.json "
                                "and tokenizer_config.json")
    if loaded is False:
        raise FileNotFoundError(f"tokenizer {path}: the folder does not exist, and no model of that id is in the local "
                                "Hugging Face cache (tokenizers load offline); pass a folder holding tokenizer.json "
                                "and tokenizer_config.json")


def preview_rows(path: str | os.PathLike, tokenizer: Any, *, rows: int = 2, input_ids_column: str = "input_ids",
                 labels_column: str | None = "labels", ignore_index: int = -100, colour: bool = False,
                 markers: Markers | dict | None = None, max_tokens: int = SHOW_TOKENS,
                 completion_mask_column: str | None = None) -> str:
    """The first ``rows`` rows of a masked Parquet file as token text, trained tokens highlighted, a line per
    message (where ``markers``' instruction and response patterns begin, and where each trained run ends). A row
    longer than ``max_tokens`` (0: no limit) shows each message's head and tail, the count of what was left out
    where ``…`` stands (``display.preview_lines``). An output written without labels (``labels_column=None``) is
    read from its ``completion_mask_column`` instead: 1 trains."""
    import pyarrow.parquet as pq

    from .display import message_starts, preview_lines

    mask_column = labels_column or completion_mask_column
    if not mask_column:
        raise ValueError("preview_rows needs the labels column, or completion_mask_column= for an output written "
                         "without labels")
    table = pq.ParquetFile(path).iter_batches(batch_size=rows, columns=[input_ids_column, mask_column])
    batch = next(table, None)
    if batch is None:
        return "(no rows)"
    if isinstance(markers, Markers):
        markers = markers.to_dict()
    headers = [p for kind in ("instruction", "response") for p in (markers or {}).get(kind) or ()]
    lines = []
    for r, (ids, labels) in enumerate(zip(batch.column(0).to_pylist()[:rows], batch.column(1).to_pylist()[:rows])):
        texts = [tokenizer.decode([t]) if tokenizer is not None else str(t) for t in ids]
        trained = [label != ignore_index for label in labels] if labels_column else [bool(m) for m in labels]
        starts = message_starts(ids, trained, headers, texts if tokenizer is not None else None)
        texts = [repr(t)[1:-1] for t in texts]
        body, left_out = preview_lines(texts, trained, starts, max_tokens=max_tokens, colour=colour)
        cut = f"; {left_out:,} of them left out where … stands" if left_out else ""
        lines.append(f"row {r} ({sum(trained):,} of {len(ids):,} tokens trained{cut}):")
        lines.extend("  " + line for line in body)
    return "\n".join(lines)


def check_job_drops(tally: Tally, tokenizer: Any, options: MaskOptions, *, truncation: str | None = None) -> None:
    """The safety net: the engine's outcomes first (its message names the cause the dropped rows show,
    with an example row each), then rows rejected as invalid. ``truncation`` names the length that cut
    the rows when it was not lossmask's own ``max_length`` (e.g. ``"max_length=40 (SFTConfig.max_length)"``)."""
    from .display import format_row

    decode = (lambda t: tokenizer.decode([t])) if tokenizer is not None else str
    example = None
    if tally.dropped_example is not None:
        ids, labels = tally.dropped_example
        example = format_row(ids, labels, decode, ignore_index=options.ignore_index)
    examples = {cause: f"row {row} (0-based; trained tokens in [brackets]):\n    "
                       + format_row(ids, labels, decode, ignore_index=options.ignore_index, max_tokens=40)
                for cause, (row, ids, labels) in tally.drop_examples.items()}
    if truncation is None and options.max_length:
        truncation = f"max_length={options.max_length} (--max-length / MaskOptions.max_length)"
    max_drop_fraction = options.max_drop_fraction
    check_drop_fraction(tally.counts, max_drop_fraction=max_drop_fraction, example=example,
                        causes=tally.drop_causes, examples=examples, truncation=truncation)
    rows_in = tally.rows_in
    rejected = tally.invalid + sum(tally.rejected.values())
    untrained = rejected + tally.counts.rows_dropped
    if rows_in and untrained / rows_in > max_drop_fraction:
        examples = "\n  ".join(tally.invalid_examples + tally.rejected_examples)
        reasons = ", ".join(f"{reason} {n}" for reason, n in {"invalid": tally.invalid, **tally.rejected}.items() if n)
        raise TooManyDroppedRows(
            f"{untrained} of {rows_in} rows ({untrained / rows_in:.1%}) would train no token (allowed: "
            f"{max_drop_fraction:.0%}), {rejected} of them rejected before labelling ({reasons}), e.g.:\n  {examples}\n"
            "Fix those rows as each line above says (docs/inputs.md lists the row shapes read), or raise "
            "max_drop_fraction.",
            tally.counts,
        )


def _progress_bar(progress: bool | None, *, total: int | None) -> Callable[[int | None, Tally], None]:
    """A tqdm bar on stderr when it is a terminal (or ``progress=True``); a no-op otherwise.

    Called with the rows just done and the tally; called with ``None`` to close.
    """
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        return lambda rows, tally: None
    from tqdm import tqdm

    bar = tqdm(total=total, unit=" rows", unit_scale=True, dynamic_ncols=True, file=sys.stderr, desc="masking")
    started = time.perf_counter()

    def update(rows: int | None, tally: Tally) -> None:
        if rows is None:
            bar.close()
            return
        elapsed = max(time.perf_counter() - started, 1e-9)
        dropped = tally.invalid + sum(tally.rejected.values()) + tally.counts.rows_dropped
        bar.set_postfix_str(f"{tally.counts.tokens / elapsed:,.0f} tok/s, dropped {dropped:,}", refresh=False)
        bar.update(rows)

    return update
