"""Ray Data: mask a ``ray.data.Dataset`` across workers, with the drop counts added up from every worker.

Markers are resolved once, on the driver; each worker labels pyarrow batches with the same
``mask_batch`` that files and Hugging Face datasets go through, so labels are identical. Each batch
sends its tally to one small counting actor; the job's report is read from it when the data has been
produced. ``ray`` is imported only here.

On a cluster, the call is the same::

    import ray, lossmask.ray
    ray.init(address="auto")
    ds = ray.data.read_parquet("s3://bucket/chats/")
    masked, report = lossmask.ray.mask_dataset(ds, tokenizer="/models/qwen2.5-7b-instruct",
                                               output="s3://bucket/chats-masked/")
"""

from __future__ import annotations

import os
from typing import Any

import pyarrow as pa

from .markers import Markers
from .report import MaskReport, Tally
from .masking import mask_batch
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
    from .stream import _check_drops, load_chat_tokenizer, resolve_job_markers

    options = MaskOptions.resolve(options, **option_fields)
    if not isinstance(dataset, ray.data.Dataset):
        raise TypeError(f"lossmask.ray.mask_dataset takes a ray.data.Dataset, got {type(dataset).__name__}")
    chat = load_chat_tokenizer(tokenizer) if tokenizer is not None else None
    resolved, source, messages = resolve_job_markers(markers, tokenizer=chat, model_name=model_name, strict=strict)
    counter = ray.remote(num_cpus=0)(_Counter).remote()
    labelled = dataset.map_batches(
        _label_batch, batch_format="pyarrow", batch_size=options.batch_size, zero_copy_batch=True,
        fn_kwargs={"markers": resolved, "options": options, "tokenizer": chat, "counter": counter},
    )
    if output is None:
        result = labelled.materialize()
    else:
        result = _write(labelled, os.fspath(output))
    tally = Tally.from_dict(ray.get(counter.total.remote()))
    try:
        _check_drops(tally, chat, options)
    except ValueError:
        if output is not None:
            _remove(os.fspath(output))
        raise
    report = MaskReport.build(tally, markers=resolved, markers_source=source, keep_dropped=options.keep_dropped,
                              input="ray dataset", output=None if output is None else os.fspath(output),
                              messages=messages)
    return result, report


def _label_batch(batch: pa.Table, *, markers, options, tokenizer, counter) -> pa.Table:
    """One worker batch: labels via ``mask_batch``; the batch's counts go to the job's counter."""
    tally = Tally()
    out = mask_batch(batch, markers, options, tally, tokenizer=tokenizer, source="ray batch")
    # Ray hands a worker no global row index: rows are numbered within their batch
    tally.invalid_examples = [f"{example} (row numbered within its Ray batch)" for example in tally.invalid_examples]
    tally.rejected_examples = [f"{example} (row numbered within its Ray batch)" for example in tally.rejected_examples]
    _ray().get(counter.add.remote(tally.to_dict()))
    return out


class _Counter:
    """Adds up the tallies of every batch, from every worker (a Ray actor)."""

    def __init__(self) -> None:
        self.tally = Tally()

    def add(self, data: dict) -> None:
        self.tally = self.tally + Tally.from_dict(data)

    def total(self) -> dict:
        return self.tally.to_dict()


def _write(labelled: Any, output: str) -> Any:
    """Write Parquet to ``output``; a local folder is written under a temporary name and renamed at the end."""
    ray = _ray()
    local = "://" not in output
    if local and os.path.exists(output):
        raise FileExistsError(f"{output} exists; lossmask.ray writes a new folder (remove it or choose another path)")
    target = os.path.join(os.path.dirname(os.path.abspath(output)), f".{os.path.basename(output)}.partial") if local else output
    labelled.write_parquet(target)
    if local:
        os.replace(target, output)
    return ray.data.read_parquet(output)


def _remove(output: str) -> None:
    import shutil

    if "://" not in output and os.path.isdir(output):
        shutil.rmtree(output)
