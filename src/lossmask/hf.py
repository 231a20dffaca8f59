"""Hugging Face integration: mask ``datasets`` on their Arrow tables, and a drop-in ``train_on_responses_only``.

``mask_dataset`` reads a ``Dataset`` / ``DatasetDict`` / ``IterableDataset`` as Arrow batches and labels
each batch with one kernel call (no Python function per row, no per-row ``dataset.map``).
``train_on_responses_only(trainer, ...)`` has the call shape Unsloth users know: it masks the
trainer's datasets through the marker policy and installs a collator that pads labels with -100 by
position, so a pad id equal to EOS never masks the real EOS.

``datasets``, ``transformers`` and ``torch`` are imported inside the functions that need them.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from .engine.patterns import Markers
from .chat.turn_spans import FromRendering
from .jobs.batch_step import input_kind, kept_columns, mask_batch, output_schema
from .jobs.report import MaskReport, Tally
from .options import MaskOptions

MIN_ROWS_FOR_STREAMING_CHECK = 1_000  # an IterableDataset is checked once this many rows have gone by
WEIGHTS = "loss_weights"  # a float per token beside labels (the collator's WEIGHTS_COLUMN)
MASK = "completion_mask"  # TRL's 0/1 mask: what an output written without labels carries instead


def mask_dataset(
    dataset: Any,
    tokenizer: Any = None,
    markers: Markers | dict | str | None = None,
    *,
    model_name: str | None = None,
    strict: bool = False,
    response_part: str | Sequence[str] | None = None,
    instruction_part: str | Sequence[str] | None = None,
    options: MaskOptions | None = None,
    return_report: bool = False,
    verbose: bool = False,
    quiet: bool = False,
    num_proc: int = 1,
    dataset_info: str | os.PathLike | None = None,
    dataset_name: str | None = None,
    **option_fields: Any,
):
    """Add ``labels`` to a Hugging Face ``Dataset``, ``DatasetDict`` or ``IterableDataset``.

    Markers: ``markers`` (a ``Markers``, its dict or a JSON file), else ``response_part`` /
    ``instruction_part`` strings located in the tokenizer's rendered template, else the policy
    (``lossmask.resolve_markers``: detection, then the template table by ``model_name``).
    How rows are read, labelled and kept is ``options`` (a ``lossmask.MaskOptions``) or its fields as
    keywords (``max_length=``, ``keep_dropped=``, ``completion_mask=``, ``batch_size=``...). Rows that
    train nothing are removed (``keep_dropped`` keeps them) and counted; more than
    ``max_drop_fraction`` of them raises ``TooManyDroppedRows``.

    ``messages`` and ``prompt``/``completion`` rows are rendered here, so message text stays data
    (``special_tokens_in_content``; rows whose messages the template drops are ``content_dropped``).
    Pre-tokenised ``input_ids`` cannot be told apart that way: a marker's text inside a message acts
    as the marker there.
    Weights (docs/weights.md): ``roles_to_train``, ``weights_by_role``, the messages' weight fields and spans,
    ``reasoning``, ``prompt_weight`` and ``train_on_eos`` give a float per token, written as ``loss_weights``
    when one can be other than 0 and 1 (or ``loss_weights=True``); labels train where it is > 0. Pre-tokenised
    ``input_ids`` take only the marker-level ones (``prompt_weight``, ``train_on_eos``, ``last_turn_only``).

    Returns the masked dataset of the same kind; with ``return_report=True``, ``(dataset, report)``
    where report is a ``MaskReport`` (a dict of them for a ``DatasetDict``; for an ``IterableDataset``,
    a function that returns the report of the rows iterated so far). Dropped rows are logged in one
    line on stderr (``quiet=True`` silences it); ``verbose`` prints the whole summary.

    ``dataset_info`` (LLaMA-Factory's ``dataset_info.json``) and ``dataset_name`` (a dataset it registers) read the
    rows as ``mask_files(dataset_info=, dataset=)`` reads them: the entry's ``formatting``, ``columns`` and ``tags``
    apply to ``dataset``, and with ``dataset=None`` the entry's local file is loaded (``datasets.load_dataset``).

    ``num_proc`` > 1 labels a ``Dataset``'s chat and prompt/completion rows in up to ``num_proc`` worker processes,
    each carrying the whole step of a batch, as ``mask_files(num_proc=)`` does (same rows, labels and report as one
    process); an ``IterableDataset`` streams through this process.
    """
    import datasets

    from .jobs.stream import load_chat_tokenizer

    options = MaskOptions.resolve(options, **option_fields)
    if dataset_info is not None or dataset_name is not None:
        dataset, options = _registered(dataset, dataset_info, dataset_name, options)
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"num_proc={num_proc!r} must be a positive number of processes")
    if num_proc > 1 and isinstance(dataset, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        raise ValueError(f"num_proc={num_proc}: an IterableDataset streams through this process; pass num_proc=1, "
                         "or a Dataset (load_dataset(..., streaming=False)), or write files with lossmask.mask_files")
    chat = load_chat_tokenizer(tokenizer) if tokenizer is not None else None
    if chat is not None and _will_encode(dataset, options):
        chat.begin_job()  # the fast tokeniser loads on a thread while markers are resolved
    resolved, source, messages = _resolve(markers, chat, model_name=model_name, strict=strict,
                                          response_part=response_part, instruction_part=instruction_part)
    job = _Job(options, resolved, source, tuple(messages), chat, verbose, quiet=quiet, num_proc=num_proc)
    if isinstance(dataset, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        results = {split: job.run(part, name=split) for split, part in dataset.items()}
        out = type(dataset)({split: result[0] for split, result in results.items()})
        return (out, {split: result[1] for split, result in results.items()}) if return_report else out
    out, report = job.run(dataset, name=getattr(dataset, "split", None) or "dataset")
    return (out, report) if return_report else out


# the loader of ``datasets.load_dataset`` for each file suffix LLaMA-Factory registers
_LOADERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow", ".txt": "text"}


def _registered(dataset: Any, dataset_info: Any, name: str | None, options: MaskOptions) -> tuple[Any, MaskOptions]:
    """``dataset`` (or the entry's file, loaded) and ``options`` reading it as the ``dataset_info.json`` entry says."""
    from .jobs.dataset_info import dataset_entry

    if dataset_info is None or name is None:
        raise ValueError("dataset_info= and dataset_name= go together: the dataset_info.json and the name of a dataset "
                         "it registers")
    entry = dataset_entry(dataset_info, name)
    options = replace(options, **entry.fields)
    if dataset is not None:
        return dataset, options
    import datasets

    files = sorted(os.path.join(entry.input, f) for f in os.listdir(entry.input)) if os.path.isdir(entry.input) \
        else [entry.input]
    loaders = {_LOADERS.get(os.path.splitext(f)[1].lower()) for f in files}
    if len(loaders) != 1 or None in loaders:
        raise ValueError(f"{os.fspath(dataset_info)}, dataset {name!r}: {entry.input} holds files of "
                         f"{sorted(os.path.splitext(f)[1] for f in files)}; load it yourself (datasets.load_dataset) and "
                         "pass it as dataset")
    return datasets.load_dataset(loaders.pop(), data_files=files, split="train"), options


def _will_encode(dataset: Any, options: MaskOptions) -> bool:
    """Whether some split has no token ids yet (so it will be rendered and tokenised)."""
    names = getattr(dataset, "column_names", None)
    splits = names.values() if isinstance(names, dict) else [names]
    return any(split is None or options.input_ids_column not in split for split in splits)


def _resolve(markers, chat, *, model_name, strict, response_part, instruction_part):
    from .jobs.stream import resolve_job_markers

    if markers is not None or (response_part is None and instruction_part is None):
        return resolve_job_markers(markers, tokenizer=chat, model_name=model_name, strict=strict)
    if chat is None:
        raise ValueError("response_part / instruction_part are strings to locate in the rendered chat template: "
                         "pass the tokenizer too")
    from .markers.policy import resolve_markers

    from .jobs.stream import resolve_markers_cached

    resolution = resolve_markers_cached(chat, lambda: resolve_markers(chat, model_name=model_name, strict=strict,
                                                               response_part=response_part, instruction_part=instruction_part),
                                 model_name=model_name, strict=strict, response_part=response_part,
                                 instruction_part=instruction_part)
    from .markers.media import with_media

    return with_media(resolution.markers, chat), resolution.source, tuple(resolution.messages)


@dataclass
class _Job:
    options: MaskOptions
    markers: Markers | None
    source: str
    messages: tuple[str, ...]
    tokenizer: Any
    verbose: bool
    quiet: bool = False
    truncated_at: int | None = None  # the length a trainer cut the rows to before masking
    truncation: str | None = None  # that length, named for a person ("max_length=40 (SFTConfig.max_length)")
    num_proc: int = 1  # worker processes for a Dataset's rendering rows (jobs/workers.py)

    def run(self, dataset: Any, *, name: str):
        import datasets

        if isinstance(dataset, datasets.IterableDataset):
            return self._run_iterable(dataset, name)
        if not isinstance(dataset, datasets.Dataset):
            raise TypeError(
                f"mask_dataset takes a datasets.Dataset, DatasetDict or IterableDataset, got {type(dataset).__name__}; "
                "for files use lossmask.mask_files, for Ray lossmask.ray.mask_dataset"
            )
        schema = dataset.features.arrow_schema
        kind = input_kind(schema, self.options, source=name)
        out_schema = output_schema(schema, self.options, kind, source=name)
        tally, parts, first_row = Tally(), [], 0
        workers = self._workers(dataset, schema, kind)
        plan = None
        if workers > 1:  # the workers read their shards from the dataset's Arrow cache files themselves
            from .jobs.slices import dataset_slices

            from .jobs.stream import plan_workers

            plan = dataset_slices(dataset, plan_workers(workers, dataset.num_rows, self.options.batch_size,
                                                        renders=True)[1])
        if plan is not None:
            batches = iter(plan)
        elif getattr(dataset, "_indices", None) is None:  # no select/shuffle mapping: slices of the table, zero-copy
            whole = dataset.data.table  # (a slice keeps the row groups it spans as chunks: one call for many of them)
            batches = (whole.slice(start, self.options.batch_size) for start in range(0, whole.num_rows, self.options.batch_size))
        else:
            batches = dataset.with_format("arrow").iter(batch_size=self.options.batch_size)
        write_weights = self.options.loss_weights_column in out_schema.names
        if workers > 1:
            parts = self._in_workers(batches, workers, tally, kind, name, out_schema, write_weights)
        for table in batches if workers <= 1 else ():
            parts.append(mask_batch(table, self.markers, self.options, tally, tokenizer=self.tokenizer, kind=kind,
                                    first_row=first_row, source=name, truncated_at=self.truncated_at,
                                    write_weights=write_weights))
            first_row += table.num_rows
        from .jobs.stream import check_job_drops

        check_job_drops(tally, self.tokenizer, self.options, truncation=self.truncation)
        table = pa.concat_tables([p if p.schema == out_schema else p.cast(out_schema) for p in parts]) if parts else out_schema.empty_table()
        # the input's columns kept keep their features; the rest are written here (a stale input column of the same
        # name that keep_columns left out included)
        kept = set(kept_columns(schema.names, self.options, kind))
        new = datasets.Features.from_arrow_schema(pa.schema([f for f in out_schema if f.name not in kept]))
        features = datasets.Features({name: dataset.features[name] if name in kept else new[name]
                                      for name in out_schema.names})
        info = dataset.info.copy()
        info.features = features
        from datasets.table import InMemoryTable

        # Without a fingerprint, datasets hashes the whole table (pickling it): 10x the labelling itself.
        fingerprint = datasets.fingerprint.Hasher.hash(
            (getattr(dataset, "_fingerprint", None), repr(self.markers), repr(self.options), "lossmask")
        )
        out = datasets.Dataset(InMemoryTable(table), info=info, split=dataset.split, fingerprint=fingerprint)
        report = self._report(tally, name)
        return out, report

    def _workers(self, dataset: Any, schema: pa.Schema, kind: str) -> int:
        """How many worker processes label this dataset: those ``num_proc`` asks for where the rows are rendered
        here (not token ids, text pairs, or images, which expand in this process) and the rows and cores pay."""
        from .chat.encode_batch import is_text_pairs
        from .jobs.stream import plan_workers

        if self.num_proc <= 1 or kind == "input_ids" or self.tokenizer is None:
            return 1
        if getattr(self.tokenizer, "processor", None) is not None:
            return 1
        if kind == "prompt_completion" and is_text_pairs(schema.empty_table(), self.options):
            return 1
        return plan_workers(self.num_proc, dataset.num_rows, self.options.batch_size, renders=True)[0]

    def _in_workers(self, batches, workers: int, tally: Tally, kind: str, name: str, out_schema: pa.Schema,
                    write_weights: bool) -> list:
        """The labelled tables of ``batches`` from ``workers`` processes, each carrying the whole step, in order."""
        from .jobs.stream import _worker_threads
        from .jobs.workers import in_order, worker_pool

        step = dict(markers=self.markers, options=self.options, kind=kind, source=name, write_weights=write_weights,
                    schema=out_schema, writer_options=None, row_group_size=None, truncated_at=self.truncated_at)
        parts = []
        with worker_pool(workers, self.tokenizer, _worker_threads(workers)) as pool:
            for _, _, future in in_order(pool, batches, step, workers, tally):
                part, _, batch_tally = future.result()
                tally += batch_tally  # in input order
                if part is not None:
                    parts.append(pa.ipc.open_stream(part).read_all())
        return parts

    def _run_iterable(self, dataset: Any, name: str):
        from .jobs.stream import check_job_drops

        tally = Tally()
        state = {"first_row": 0}
        options, markers, tokenizer, truncated_at = self.options, self.markers, self.tokenizer, self.truncated_at

        def label(table: pa.Table) -> pa.Table:
            out = mask_batch(table, markers, options, tally, tokenizer=tokenizer, first_row=state["first_row"], source=name,
                             truncated_at=truncated_at)
            state["first_row"] += table.num_rows
            if tally.rows_in >= MIN_ROWS_FOR_STREAMING_CHECK:  # over the rows seen so far (no end to wait for)
                check_job_drops(tally, tokenizer, options, truncation=self.truncation)
            return out

        fmt = getattr(dataset, "_formatting", None)
        out = dataset.with_format("arrow").map(label, batched=True, batch_size=self.options.batch_size)
        out = out.with_format(getattr(fmt, "format_type", None))
        return out, lambda: self._report(tally, name, quiet=True)

    def _report(self, tally: Tally, name: str, *, quiet: bool = False) -> MaskReport:
        report = MaskReport.build(tally, markers=self.markers, markers_source=self.source,
                                  keep_dropped=self.options.keep_dropped, input=name, messages=self.messages)
        if self.verbose and not quiet:
            print(f"lossmask [{name}]: " + report.summary().replace("\n", f"\nlossmask [{name}]: "), file=sys.stderr)
        elif report.rows_dropped and not (quiet or self.quiet):
            print(f"lossmask [{name}]: {report.drop_line()}", file=sys.stderr)
        return report


# -- the drop-in ------------------------------------------------------------------------------


def train_on_responses_only(
    trainer: Any,
    instruction_part: str | Sequence[str] | None = None,
    response_part: str | Sequence[str] | None = None,
    *,
    markers: Markers | dict | str | None = None,
    tokenizer: Any = None,
    model_name: str | None = None,
    strict: bool = False,
    options: MaskOptions | None = None,
    verbose: bool = True,
    **option_fields: Any,
):
    """Mask a ``transformers.Trainer`` / ``trl.SFTTrainer``'s datasets so that only responses train.

    The call shape is Unsloth's (``instruction_part``, ``response_part``), but the strings are located
    in the tokenizer's rendered chat template (never tokenised on their own), and without them the
    markers come from the policy (``lossmask.resolve_markers``). The train and eval datasets get
    ``labels`` (rows that train nothing removed and reported), and the trainer's collator is replaced
    by ``PadByPosition``, which pads ``labels`` with -100 by position. ``options`` (a ``MaskOptions``) or
    its fields as keywords (``max_length=``, ``keep_dropped=``, ``max_drop_fraction=``...) say how rows
    are labelled and kept. Returns the trainer.

    TRL's packing and padding-free training are kept: when the trainer is padding-free
    (``SFTConfig(padding_free=True)``, or ``packing=True`` with the ``bfd`` strategies) the collator is a
    ``CompletionCollator(padding_free=True)``, which builds ``position_ids`` / ``cu_seq_lens`` as TRL's
    does, so packed documents do not attend to each other; packed rows (``seq_lengths``) are labelled
    document by document, and the report counts documents (those that train nothing stay in their pack,
    counted as kept). ``max_length`` defaults to ``SFTConfig.max_length`` (the length TRL cut rows at).
    With ``packing_strategy="wrapped"`` the chunks are labelled as the stream they were cut from, so a
    chunk that opens inside an assistant turn keeps it trained.

    Where a dataset still has its ``messages`` (TRL keeps them unless it packs), those are labelled, as
    ``mask_dataset`` labels them: message text is data. Rows left as token ids only cannot tell message
    text from markers; the drop-in then warns once. For that protection with packing, label the dataset
    with ``mask_dataset`` before building the trainer and leave this drop-in out.

    Rows that carry ``loss_weights`` (``mask_dataset`` output with weights, passed to the trainer) are
    kept as they are (their weights say what trains; markers cannot say it again), the collators carry
    the weights (cut as TRL cut the ids), the column survives ``remove_unused_columns``, and unless the
    trainer is a ``lossmask.collator.WeightedLossMixin`` the weighted loss is installed as its
    ``compute_loss_func`` (``lossmask.collator.WeightedLoss``). TRL's packing drops the column: pack
    with ``padding_free=True`` instead (docs/weighted-loss.md).
    """
    tok = tokenizer if tokenizer is not None else _trainer_tokenizer(trainer)
    model_name = model_name or _model_name(trainer)
    from .jobs.stream import load_chat_tokenizer

    chat = load_chat_tokenizer(tok)
    if chat.processor is not None:  # this drop-in's collator pads token ids: the images would never reach the model
        raise ValueError(
            f"{chat.name!r} is a vision-language processor; train_on_responses_only installs a text collator that would "
            "drop the images. Pass data_collator=lossmask.vision.VisionCollator(processor) to the trainer instead, with "
            "SFTConfig(remove_unused_columns=False, dataset_kwargs={'skip_prepare_dataset': True})")
    resolved, source, messages = _resolve(markers, chat, model_name=model_name, strict=strict,
                                          response_part=response_part, instruction_part=instruction_part)
    options = MaskOptions.resolve(options, **option_fields)
    if options.labels_column != "labels":  # the collator installed here pads the trainer's "labels" column
        raise ValueError(f"train_on_responses_only writes the trainer's 'labels' column, so labels_column="
                         f"{options.labels_column!r} cannot apply; leave it out (to write completion_mask alone, use "
                         "mask_dataset(..., labels_column=None, completion_mask=True) with TRL's own collator)")
    args = getattr(trainer, "args", None)
    limit = getattr(args, "max_length", None)
    limit = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None
    job = _Job(options, resolved, source, tuple(messages), chat, verbose, truncated_at=limit,
               truncation=f"max_length={limit} (the trainer's args.max_length, e.g. SFTConfig(max_length=...); "
                          "the trainer truncated the rows before lossmask saw them)" if limit else None)
    if verbose:
        for message in messages:
            print(f"lossmask: {message}", file=sys.stderr)
    packed = False
    truncation_mode = getattr(args, "truncation_mode", None) or "keep_start"
    wrapped = bool(getattr(args, "packing", False)) and getattr(args, "packing_strategy", None) == "wrapped"
    if isinstance(resolved, FromRendering) and (bool(getattr(args, "packing", False)) or _padding_free(trainer)):
        raise ValueError(
            f"the chat template of {chat.name!r} has no token markers that can be read, so each row is labelled from its "
            "own rendering, and packed or padding-free batches are labelled again from token ids alone; train with "
            "SFTConfig(packing=False, padding_free=False), or pass markers= (lossmask.Markers) that verify")
    plan = _Plan(job, truncation_mode, wrapped, limit)
    if getattr(trainer, "train_dataset", None) is not None:
        trainer.train_dataset, is_packed = plan.mask(trainer.train_dataset, "train")
        packed |= is_packed
    eval_dataset = getattr(trainer, "eval_dataset", None)
    if isinstance(eval_dataset, dict):
        masked = {name: plan.mask(ds, f"eval {name}") for name, ds in eval_dataset.items()}
        trainer.eval_dataset = {name: ds for name, (ds, _) in masked.items()}
        packed |= any(is_packed for _, is_packed in masked.values())
    elif eval_dataset is not None:
        trainer.eval_dataset, is_packed = plan.mask(eval_dataset, "eval")
        packed |= is_packed
    weighted = any(WEIGHTS in (getattr(ds, "column_names", None) or []) for ds in _datasets_of(trainer))
    if plan.from_ids and resolved is not None:
        warnings.warn(_IDS_ONLY.format(names=", ".join(plan.from_ids)), UserWarning, stacklevel=2)
    padding_free = _padding_free(trainer)
    if resolved is None:
        if not (padding_free or packed):  # no markers: the full sequence trains, TRL's collator already does that
            trainer.data_collator = PadByPosition(pad_token_id=_pad_id(chat), padding_side=getattr(chat.tokenizer, "padding_side", "right"),
                                                  truncation_mode=truncation_mode)
        elif weighted:
            warnings.warn("lossmask: the rows carry loss_weights, but without markers the padding-free batches are TRL's, "
                          "which drop them; pass markers= (or response_part=) to train_on_responses_only", UserWarning,
                          stacklevel=2)
    elif padding_free or packed:
        from .collator import CompletionCollator

        trainer.data_collator = CompletionCollator(
            markers=resolved, tokenizer=chat.tokenizer, padding_free=padding_free, last_turn_only=options.last_turn_only,
            pad_to_multiple_of=getattr(args, "pad_to_multiple_of", None),
            truncation_mode=truncation_mode,
            # Rows this drop-in labelled keep their labels: from their messages (message text as data, the role
            # invariant) or, for wrapped chunks, from the stream they were cut from. Rows TRL packed with bfd carry
            # only a copy of their ids, so they are labelled here, per packed sequence.
            row_labels="rebuild" if packed and not wrapped else "keep",
        )
    else:
        trainer.data_collator = PadByPosition(pad_token_id=_pad_id(chat), padding_side=getattr(chat.tokenizer, "padding_side", "right"),
                                              truncation_mode=truncation_mode)
    _keep_label_columns(trainer)
    if weighted:
        _use_weighted_loss(trainer, verbose)
    return trainer


def _datasets_of(trainer: Any) -> list:
    eval_dataset = getattr(trainer, "eval_dataset", None)
    found = [getattr(trainer, "train_dataset", None)]
    found += list(eval_dataset.values()) if isinstance(eval_dataset, dict) else [eval_dataset]
    return [ds for ds in found if ds is not None]


def _use_weighted_loss(trainer: Any, verbose: bool) -> None:
    """The trainer's loss reads the batches' ``loss_weights``: the mixin's, or ``WeightedLoss`` as ``compute_loss_func``."""
    from .collator import WeightedLoss, WeightedLossMixin, keep_weight_columns

    keep_weight_columns(trainer)
    if isinstance(trainer, WeightedLossMixin):
        return
    current = getattr(trainer, "compute_loss_func", None)
    if current is None:
        trainer.compute_loss_func = WeightedLoss().attach(trainer)
        if verbose:
            print("lossmask: the rows carry loss_weights: the trainer's loss is now sum(w * nll) / sum(w) "
                  "(lossmask.collator.WeightedLoss as compute_loss_func)", file=sys.stderr)
    elif isinstance(current, WeightedLoss):
        current.attach(trainer)
    else:
        warnings.warn("lossmask: the rows carry loss_weights but the trainer has its own compute_loss_func, which never "
                      "sees them (transformers passes it only outputs and labels); use lossmask.collator.WeightedLoss, "
                      "or build the trainer with lossmask.collator.WeightedLossMixin", UserWarning, stacklevel=3)


def _pad_id(chat: Any) -> int:
    pad = chat.tokenizer.pad_token_id
    if pad is None:
        pad = chat.eos_token_id if chat.eos_token_id is not None else 0
    return int(pad)


def _padding_free(trainer: Any) -> bool:
    """Whether the trainer trains padding-free (TRL: ``padding_free=True``, or packing with a bfd strategy)."""
    if hasattr(trainer, "padding_free"):
        return bool(trainer.padding_free)
    args = getattr(trainer, "args", None)
    return bool(getattr(args, "padding_free", False)) or (
        bool(getattr(args, "packing", False)) and getattr(args, "packing_strategy", "bfd") in ("bfd", "bfd_split"))


_IDS_ONLY = (
    "lossmask: train_on_responses_only labelled {names} from the trainer's token ids: the rows kept no "
    "'messages' column (packing drops it), so message text cannot be told from the template's markers there. "
    "A quoted marker or special token in a message ('<|im_end|>' in an answer, a user message that writes a "
    "whole assistant turn) acts as the marker, and such rows are not dropped as content_dropped. To keep message "
    "text as data, label the dataset with lossmask.hf.mask_dataset(dataset, tokenizer) before building the trainer "
    "and pass the result to it (TRL keeps a 'labels' column, through packing too), without calling "
    "train_on_responses_only; or keep the 'messages' column and do not pack."
)


@dataclass
class _Plan:
    """How the drop-in labels each of a trainer's datasets, and which ones it could only label from ids."""

    job: "_Job"
    truncation_mode: str
    wrapped: bool  # TRL's packing_strategy="wrapped": chunks of one stream of documents
    limit: int | None  # the trainer's max_length
    from_ids: list = field(default_factory=list)  # the datasets labelled from token ids alone

    def mask(self, dataset: Any, name: str) -> tuple[Any, bool]:
        """``(dataset, packed)``: labelled rows, or packed rows left as they are with their documents counted."""
        names = getattr(dataset, "column_names", None) or []
        job = self.job
        if WEIGHTS in names and job.options.input_ids_column in names and "seq_lengths" not in names:
            # labelled with weights already (mask_dataset output): the weights say what trains, kept as they are
            if job.verbose:
                print(f"lossmask [{name}]: the rows carry loss_weights: kept as they are (labels follow the weights)",
                      file=sys.stderr)
            return dataset, False
        if "seq_lengths" in names:
            _count_packed_documents(job, dataset, name, self.truncation_mode)
            self.from_ids.append(name)
            return dataset, True
        if self.wrapped and job.options.input_ids_column in names:
            self.from_ids.append(name)
            return _label_wrapped_stream(job, dataset, name), False
        if job.markers is not None and job.options.messages_column in names and self.truncation_mode == "keep_start":
            # TRL tokenised these messages and kept them: rendering them here keeps message text as data
            options = job.options if job.options.max_length is not None or self.limit is None else replace(
                job.options, max_length=self.limit)
            stale = [c for c in (options.input_ids_column, "labels", "completion_mask", "assistant_masks") if c in names]
            return replace(job, options=options).run(dataset.remove_columns(stale), name=name)[0], False
        if job.options.input_ids_column in names:
            self.from_ids.append(name)
        return job.run(_without_labels(dataset), name=name)[0], False


def _label_wrapped_stream(job: "_Job", dataset: Any, name: str) -> Any:
    """Label TRL's wrapped chunks as the one stream of documents they were cut from.

    ``packing_strategy="wrapped"`` concatenates the tokenised documents and cuts the stream every
    ``max_length`` tokens, so a chunk can open inside an assistant turn whose header lies in the chunk
    before. The dataset's table holds the chunks in stream order (a later shuffle only maps indices over
    it), so the chunks are joined back, labelled as one row, and each chunk gets its slice of the labels:
    the labels its tokens had before the cut. Chunks are kept as they are (none is dropped); the trainer
    reads them in its own order.
    """
    import pyarrow.compute as pc

    from .engine.labels import label_batch

    column = job.options.input_ids_column
    ids = dataset.data.table.column(column).combine_chunks()  # physical order: the stream, whatever the indices
    lengths = np.asarray(pc.list_value_length(ids).fill_null(0), dtype=np.int64)
    values = pc.list_flatten(ids)
    if job.markers is None:
        labels_values = values.cast(pa.int64())
    else:
        stream = pa.LargeListArray.from_arrays(pa.array([0, len(values)], pa.int64()), values)
        result = label_batch(stream, job.markers, backend=job.options.backend, ignore_index=job.options.ignore_index)
        labels_values = pc.list_flatten(result.labels).cast(pa.int64())
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]), pa.int64())
    labels = pa.LargeListArray.from_arrays(offsets, labels_values).cast(pa.list_(pa.int64()))
    indices = getattr(dataset, "_indices", None)
    if indices is not None:  # the dataset's view order (a shuffle after packing)
        labels = labels.take(indices.column(0).combine_chunks())
    out = dataset.remove_columns([c for c in ("labels", "completion_mask", "assistant_masks") if c in dataset.column_names])
    out = out.add_column("labels", labels)
    trained = int(np.count_nonzero(np.asarray(labels_values) != job.options.ignore_index))
    if job.verbose:
        print(f"lossmask [{name}, wrapped chunks]: {len(lengths)} chunks of one stream of {len(values)} tokens, "
              f"{trained} trained", file=sys.stderr)
    return out


def _count_packed_documents(job: "_Job", dataset: Any, name: str, truncation_mode: str = "keep_start") -> None:
    """Label the documents of packed rows (their ``seq_lengths``) to count and check them; the collator labels
    them again per batch. Documents that train nothing cannot leave their pack: they are counted as kept."""
    import pyarrow.compute as pc

    if job.markers is None:  # no markers: every token trains, nothing to count
        return
    from .engine.labels import label_batch
    from .engine.outcomes import OutcomeCounts
    from .jobs.stream import check_job_drops

    counts = OutcomeCounts()
    for table in dataset.select_columns(["input_ids", "seq_lengths"]).with_format("arrow").iter(batch_size=job.options.batch_size):
        ids = table.column("input_ids").combine_chunks()
        seq_column = table.column("seq_lengths").combine_chunks()
        seq_lengths = np.asarray(pc.list_flatten(seq_column), dtype=np.int64)
        values = pc.list_flatten(ids)
        lengths = np.asarray(pc.list_value_length(ids).fill_null(0), dtype=np.int64)
        seq_row = np.repeat(np.arange(len(lengths)), np.asarray(pc.list_value_length(seq_column).fill_null(0)))
        per_row = np.bincount(seq_row, weights=seq_lengths, minlength=len(lengths)).astype(np.int64)
        if (per_row < lengths).any():
            r = int(np.flatnonzero(per_row < lengths)[0])
            raise ValueError(f"{name} row {r}: seq_lengths add up to {int(per_row[r])} but the row has {int(lengths[r])} "
                             "tokens; seq_lengths must split input_ids exactly (as TRL's pack_dataset writes them)")
        if (per_row > lengths).any():  # cut after packing (SFTConfig(max_length) shorter than the packs): as the collator
            from .collator import cut_packed_sequences

            seq_lengths, _ = cut_packed_sequences(seq_lengths, seq_row, per_row, lengths, from_start=truncation_mode == "keep_end")
        documents = pa.LargeListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(seq_lengths)]), pa.int64()), values)
        counts = counts + label_batch(documents, job.markers, last_turn_only=job.options.last_turn_only).counts
    tally = Tally(counts=counts, rows_out=counts.rows)
    check_job_drops(tally, job.tokenizer, job.options, truncation=job.truncation)
    report = MaskReport.build(tally, markers=job.markers, markers_source=job.source, keep_dropped=True,
                              input=f"{name} (packed documents)", messages=job.messages)
    if job.verbose:
        print(f"lossmask [{name}, packed documents]: " + report.summary().replace("\n", f"\nlossmask [{name}]: "), file=sys.stderr)


def _trainer_tokenizer(trainer: Any) -> Any:
    for attribute in ("processing_class", "tokenizer"):
        tok = getattr(trainer, attribute, None)
        if tok is not None:
            return tok
    raise ValueError("the trainer has no processing_class / tokenizer; pass tokenizer= to train_on_responses_only")


def _model_name(trainer: Any) -> str | None:
    model = getattr(trainer, "model", None)
    config = getattr(model, "config", None)
    return getattr(config, "_name_or_path", None) or getattr(model, "name_or_path", None) or None


def _without_labels(dataset: Any) -> Any:
    """Labels or masks a trainer computed earlier are replaced by ours, so they go before masking."""
    names = getattr(dataset, "column_names", None) or []
    stale = [c for c in ("labels", "completion_mask", "assistant_masks") if c in names]
    return dataset.remove_columns(stale) if stale else dataset


def _keep_label_columns(trainer: Any) -> None:
    """``Trainer`` drops columns its model's forward does not take; ``labels`` is one it takes, so nothing to do
    unless the signature columns were cached before ``labels`` existed."""
    columns = getattr(trainer, "_signature_columns", None)
    if columns is not None and "labels" not in columns:
        columns.append("labels")


class PadByPosition:
    """A collator for rows that carry ``input_ids`` and ``labels``: pads both, plus ``attention_mask``.

    Padding is decided by position (each row's own length), never by comparing ids with the pad id:
    where pad == EOS, the real EOS keeps its label. Labels are padded with ``ignore_index``.
    ``padding_side`` is ``"right"`` or ``"left"``; ``pad_to_multiple_of`` rounds the width up.

    Rows with ``loss_weights`` (a float per token) keep them as a ``loss_weights`` tensor, padded with 0,
    with 0 on each row's first token (nothing predicts it); their labels follow them (the id where the
    weight is > 0, so never on a row's first token). Weights longer than their row (TRL cuts
    ``input_ids`` and ``labels``, not other columns) are cut as the row was (``truncation_mode``). In a
    batch where some rows have none, those get 1 on their labelled tokens.
    """

    def __init__(self, *, pad_token_id: int, padding_side: str = "right", ignore_index: int = -100,
                 pad_to_multiple_of: int | None = None, return_tensors: str = "pt", truncation_mode: str = "keep_start"):
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side={padding_side!r}; pass 'right' or 'left'")
        if truncation_mode not in ("keep_start", "keep_end"):
            raise ValueError(f"truncation_mode={truncation_mode!r}; pass 'keep_start' or 'keep_end' (SFTConfig.truncation_mode)")
        self.pad_token_id = pad_token_id
        self.padding_side = padding_side
        self.ignore_index = ignore_index
        self.pad_to_multiple_of = pad_to_multiple_of
        self.return_tensors = return_tensors
        self.truncation_mode = truncation_mode

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        if not features:
            raise ValueError("PadByPosition got an empty batch")
        weighted = any(f.get(WEIGHTS) is not None for f in features)
        compact = "labels" not in features[0] and MASK in features[0]  # written with labels_column=None
        needed = ("input_ids",) if weighted or compact else ("input_ids", "labels")
        missing = [k for k in needed if k not in features[0]]
        if missing:
            raise KeyError(f"rows reaching the collator lack {missing} (they have {sorted(features[0])}); "
                           "label them first with lossmask.hf.mask_dataset or train_on_responses_only")
        lengths = np.fromiter((len(f["input_ids"]) for f in features), dtype=np.int64, count=len(features))
        width = int(lengths.max()) if lengths.size else 0
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        positions = np.arange(width)[None, :]
        real = positions < lengths[:, None] if self.padding_side == "right" else positions >= (width - lengths)[:, None]
        input_ids = np.full((len(features), width), self.pad_token_id, dtype=np.int64)
        labels = np.full((len(features), width), self.ignore_index, dtype=np.int64)
        input_ids[real] = np.concatenate([np.asarray(f["input_ids"], dtype=np.int64) for f in features])
        if weighted:
            weights = np.zeros((len(features), width), dtype=np.float32)
            weights[real] = np.concatenate([self._row_weights(f, n, r) for r, (f, n) in enumerate(zip(features, lengths))])
            first = np.argmax(real, axis=1)[lengths > 0]
            weights[np.flatnonzero(lengths > 0), first] = 0.0  # nothing predicts a row's first token
            labels[real] = np.where(weights[real] > 0, input_ids[real], self.ignore_index)
        else:
            labels[real] = np.concatenate([self._row_labels(f) for f in features])
        batch = {"input_ids": input_ids, "attention_mask": real.astype(np.int64), "labels": labels}
        if weighted:
            batch[WEIGHTS] = weights
        if self.return_tensors == "np":
            return batch
        import torch

        return {k: torch.from_numpy(v) for k, v in batch.items()}

    def _row_labels(self, row: dict[str, Any]) -> np.ndarray:
        """A row's labels, or, from an output written without them, its ids where its completion_mask is 1."""
        if "labels" in row:
            return np.asarray(row["labels"], dtype=np.int64)
        ids = np.asarray(row["input_ids"], dtype=np.int64)
        return np.where(np.asarray(row[MASK]) != 0, ids, self.ignore_index)

    def _row_weights(self, row: dict[str, Any], n: int, r: int) -> np.ndarray:
        """Row ``r``'s weights, cut to its ``n`` tokens as the trainer cut them; 1 on labelled tokens when it has none."""
        given = row.get(WEIGHTS)
        if given is None:
            if "labels" not in row and MASK not in row:
                raise KeyError(f"row {r} has neither labels, {MASK} nor loss_weights; label every row")
            return (self._row_labels(row) != self.ignore_index).astype(np.float32)
        weights = np.asarray(given.cpu() if hasattr(given, "cpu") else given, dtype=np.float32).reshape(-1)
        if len(weights) < n:
            raise ValueError(f"row {r} has {len(weights)} loss_weights for {n} input_ids; pass one weight per token")
        weights = weights[:n] if self.truncation_mode == "keep_start" else weights[len(weights) - n:]
        if not (np.isfinite(weights) & (weights >= 0)).all():
            raise ValueError(f"row {r} holds a loss weight that is negative or not finite; weights must be finite and >= 0")
        return weights
