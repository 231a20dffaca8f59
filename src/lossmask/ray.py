"""Ray Data: mask a ``ray.data.Dataset`` across workers, with the drop counts added up from what Ray committed.

Markers are resolved once, on the driver; each worker labels pyarrow batches with the same
``mask_batch`` that files and Hugging Face datasets go through, so labels are identical. Each batch
returns its tally as data, in one extra row at the end of its output (every other column null), so
a task that Ray retries after a worker died counts once: only the output Ray keeps is counted. The
report is read from those rows once the labelled data is materialised, and the drop threshold is
checked before anything is written. ``ray`` is imported only here.

On a cluster, the call is the same::

    import ray, lossmask.ray
    ray.init(address="auto")
    ds = ray.data.read_parquet("s3://bucket/chats/")
    masked, report = lossmask.ray.mask_dataset(ds, tokenizer="/models/qwen2.5-7b-instruct",
                                               output="s3://bucket/chats-masked/")
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pyarrow as pa

from .engine.patterns import Markers
from .jobs.batch_step import mask_batch
from .jobs.report import MaskReport, Tally
from .options import MaskOptions


def _ray():
    try:
        import ray
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("lossmask.ray needs Ray Data: pip install 'lossmask[ray]'") from None
    return ray


def mask_dataset(
    dataset: Any,
    *,
    tokenizer: Any = None,
    markers: Markers | dict | str | None = None,
    model_name: str | None = None,
    strict: bool = False,
    options: MaskOptions | None = None,
    output: str | os.PathLike | None = None,
    **option_fields: Any,
) -> tuple[Any, MaskReport]:
    """Label a ``ray.data.Dataset`` with ``map_batches`` on pyarrow batches; return ``(dataset, report)``.

    The options are those of ``lossmask.mask_files``: ``options`` (a ``MaskOptions``) or its fields as keywords. The dataset is produced once (the counts need a
    full pass): with ``output`` (a folder path or URI) it is written there as Parquet and read back
    lazily, otherwise it is materialised in the object store. Raises ``TooManyDroppedRows`` when
    more than ``max_drop_fraction`` of all rows train nothing (for a local ``output``, nothing is left
    at that path then).
    """
    ray = _ray()
    from .jobs.stream import check_job_drops, load_chat_tokenizer, resolve_job_markers

    options = MaskOptions.resolve(options, **option_fields)
    if not isinstance(dataset, ray.data.Dataset):
        raise TypeError(f"lossmask.ray.mask_dataset takes a ray.data.Dataset, got {type(dataset).__name__}")
    chat = load_chat_tokenizer(tokenizer) if tokenizer is not None else None
    resolved, source, messages = resolve_job_markers(markers, tokenizer=chat, model_name=model_name, strict=strict)
    labelled = dataset.map_batches(
        _label_batch, batch_format="pyarrow", batch_size=options.batch_size, zero_copy_batch=True,
        fn_kwargs={"markers": resolved, "options": options, "tokenizer": chat,
                   "write_weights": _writes_weights(dataset, options)},
    ).materialize()
    tally = Tally()
    for row in labelled.map_batches(_tallies_only, batch_format="pyarrow", zero_copy_batch=True).take_all():
        tally = tally + Tally.from_dict(json.loads(row[TALLY_COLUMN]))
    check_job_drops(tally, chat, options)  # before anything is written
    rows = labelled.map_batches(_rows_only, batch_format="pyarrow", zero_copy_batch=True)
    result = rows.materialize() if output is None else _write(rows, os.fspath(output))
    report = MaskReport.build(tally, markers=resolved, markers_source=source, keep_dropped=options.keep_dropped,
                              input="ray dataset", output=None if output is None else os.fspath(output),
                              messages=messages)
    return result, report


TALLY_COLUMN = "__lossmask_tally__"


def _writes_weights(dataset: Any, options: MaskOptions) -> bool | None:
    """Whether every batch writes ``loss_weights``, decided once from the dataset's schema (batches of one dataset
    can differ: a message field only some batches hold); None (each batch decides) when Ray cannot tell."""
    from .jobs.batch_step import input_kind, writes_weights

    try:
        schema = dataset.schema()
        schema = getattr(schema, "base_schema", schema)
        if not isinstance(schema, pa.Schema):
            return None
        return writes_weights(schema, options, input_kind(schema, options, source="ray dataset"), source="ray dataset")
    except (TypeError, AttributeError):
        return None


def _label_batch(batch: pa.Table, *, markers, options, tokenizer, write_weights=None) -> pa.Table:
    """One worker batch: labels via ``mask_batch``, then one row holding the batch's tally (JSON)."""
    tally = Tally()
    out = mask_batch(batch, markers, options, tally, tokenizer=tokenizer, source="ray batch",
                     write_weights=write_weights)
    tally.invalid_examples = [_identify(batch, example) for example in tally.invalid_examples]
    tally.rejected_examples = [_identify(batch, example) for example in tally.rejected_examples]
    schema = pa.schema([field.with_nullable(True) for field in out.schema] + [pa.field(TALLY_COLUMN, pa.string())])
    rows = out.append_column(TALLY_COLUMN, pa.nulls(out.num_rows, pa.string())).cast(schema)
    carrier = pa.table([pa.nulls(1, field.type) for field in schema][:-1] + [pa.array([json.dumps(tally.to_dict())])],
                       schema=schema)
    return pa.concat_tables([rows, carrier])


def _identify(batch: pa.Table, example: str) -> str:
    """Ray hands a worker no global row index: rows are numbered within their batch, so an example also
    names the row by its file (the ``path`` column of ``read_*(include_paths=True)``) and its first scalar value."""
    match = re.match(r"row (\d+)", example)
    names = []
    if match and int(match.group(1)) < batch.num_rows:
        r = int(match.group(1))
        scalars = [f.name for f in batch.schema if not pa.types.is_nested(f.type) and f.name != "path"]
        for name in (["path"] if "path" in batch.column_names else []) + scalars[:1]:
            value = batch.column(name)[r].as_py()
            names.append(f"{name}={value!r}"[:120])
    where = "; ".join(["row numbered within its Ray batch", *names])
    return f"{example} ({where})"


def _tallies_only(batch: pa.Table) -> pa.Table:
    column = batch.column(TALLY_COLUMN)
    return pa.table({TALLY_COLUMN: column}).filter(column.is_valid())


def _rows_only(batch: pa.Table) -> pa.Table:
    column = batch.column(TALLY_COLUMN)
    return batch.filter(column.is_null()).drop_columns([TALLY_COLUMN])


def _write(rows: Any, output: str) -> Any:
    """Write Parquet to ``output``; a local folder is written under a partial name and renamed at the end."""
    from .jobs.outputs import partial_name, remove_quietly, remove_stale_partials

    ray = _ray()
    local = "://" not in output
    if not local:
        rows.write_parquet(output)
        return ray.data.read_parquet(output)
    if os.path.exists(output):
        raise FileExistsError(f"{output} exists; lossmask.ray writes a new folder (remove it or choose another path)")
    remove_stale_partials(output)
    target = partial_name(output)
    try:
        rows.write_parquet(target)
        os.makedirs(target, exist_ok=True)  # no row to write (all dropped, allowed): an empty folder
        os.replace(target, output)
    except BaseException:
        remove_quietly(target)
        raise
    return ray.data.read_parquet(output) if os.listdir(output) else ray.data.from_items([])
