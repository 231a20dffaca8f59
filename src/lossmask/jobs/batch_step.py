"""Mask one Arrow batch: the step that files (``stream``), Hugging Face datasets (``hf``) and Ray (``ray``) share.

A batch comes in as a ``pyarrow.RecordBatch`` or ``Table`` with one of three input shapes:

- ``input_ids``: token ids already (list of integers); labelled as they are, zero-copy. Ids cannot tell
  message text from the template's markup, so a marker's text inside a message acts as the marker
  there; give ``messages`` to have message text kept inert;
- ``messages``: chat rows (list of ``{role, content, ...}``), rendered with the tokenizer's chat template
  and tokenised in one batch call; rows the template rejects are dropped as ``invalid``, rows where it
  dropped or rewrote a message as ``content_dropped`` (``chat/encode_rendered.py``). Message text is data: its
  special-token strings are text (``special_tokens_in_content``) and no marker matches inside it;
- ``prompt`` / ``completion``: conversational (lists of messages, joined into one chat; the prompt's own assistant
  turns weigh 0 unless ``train_prompt_turns``) or plain strings (tokenised as the tokenizer's BOS, prompt, then
  completion plus EOS; the completion trains, the prompt does not, by position). Only the completion trains, as
  in TRL;
- Alpaca ``instruction`` / ``input`` / ``output`` (``system``, ``history``): read as a chat (``encode_batch``) and
  rendered like ``messages``; the outputs train.

The batch goes out with its columns in their order (those ``keep_columns`` keeps), ``input_ids`` added when it was
tokenised here, then ``labels`` (unless ``labels_column=None``), ``completion_mask`` on request, and ``loss_weights``
where weights apply (docs/weights.md);
rows that train nothing are removed unless ``keep_dropped``. What happened is added to a ``Tally``.
"""

from __future__ import annotations

import re
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..chat.encode_batch import chat_tokenizer, chats_of_rows
from ..chat.encode_media import encode_rows
from ..chat.turn_spans import (FromRendering, RenderingOverBudget, breaks_message, label_from_rendering, over_budget_message,
                               role_breaks, trained_from_rendering)
from ..engine.buffers import TokenRows, check_label_range, check_vocabulary, labels_to_arrow, rows_from_arrow
from ..engine.labels import label_batch
from ..engine.outcomes import (CAUSES, INVALID, RENDERING_OVER_BUDGET, TEMPLATE_BREAKS_ROLES, Outcome, OutcomeCounts,
                               classify_drops)
from ..engine.patterns import Markers
from ..engine.tally import Tally
from ..options import MaskOptions
from ..engine.weights import weigh_tokens, weight_field_types, weights_to_arrow
from .display import one_line

INPUT_KINDS = ("input_ids", "messages", "prompt_completion", "alpaca")


def input_kind(schema: pa.Schema, options: MaskOptions, *, source: str = "input") -> str:
    """Which input shape a schema holds (``input_ids`` first), or an error naming the columns it has."""
    names = set(schema.names)
    if options.input_ids_column in names:
        field = schema.field(options.input_ids_column)
        if not (pa.types.is_list(field.type) or pa.types.is_large_list(field.type)) or not pa.types.is_integer(
            field.type.value_type
        ):
            raise TypeError(
                f"{source}: column {options.input_ids_column!r} has type {field.type}, not a list of integer token ids; "
                f"cast it to list<int32>, or pass the column that holds token ids (--input-ids-column / input_ids_column=)"
            )
        return "input_ids"
    chat_column = options.chat_column(names)
    if chat_column in names:
        field = schema.field(chat_column)
        if _text_or_chat(field.type) != "chat":
            raise TypeError(
                f"{source}: column {chat_column!r} has type {field.type}, not a list of messages "
                "({role, content} or ShareGPT {from, value} structs or JSON objects); pass the chat column "
                "(--messages-column / messages_column=)"
            )
        return "messages"
    if options.prompt_column in names and options.completion_column in names:
        kinds = {_text_or_chat(schema.field(c).type) for c in (options.prompt_column, options.completion_column)}
        if None in kinds or len(kinds) != 1:
            raise TypeError(
                f"{source}: columns {options.prompt_column!r} ({schema.field(options.prompt_column).type}) and "
                f"{options.completion_column!r} ({schema.field(options.completion_column).type}) must both be strings "
                "or both be lists of messages"
            )
        return "prompt_completion"
    alpaca = options.alpaca()
    if alpaca["instruction"] in names and alpaca["output"] in names:
        for part in ("instruction", "input", "output", "system"):
            if alpaca[part] in names and not _text_or_json(schema.field(alpaca[part]).type):
                raise TypeError(
                    f"{source}: column {alpaca[part]!r} ({schema.field(alpaca[part]).type}) holds the Alpaca {part} and "
                    "must hold strings; pass the column that does (--alpaca-columns / alpaca_columns=)"
                )
        return "alpaca"
    raise ValueError(
        f"{source}: no input column found: expected {options.input_ids_column!r} (token ids), "
        f"{options.messages_column!r} (chat messages; ShareGPT's 'conversations' too), {options.prompt_column!r} + "
        f"{options.completion_column!r}, or Alpaca's {alpaca['instruction']!r} + {alpaca['output']!r}; "
        f"the columns are {schema.names}. Name yours with --input-ids-column / --messages-column / --prompt-column "
        "/ --alpaca-columns (input_ids_column= ... in the API)"
    )


def _text_or_json(arrow_type: pa.DataType) -> bool:
    """Strings, or a column a JSON reader left untyped (only nulls in the first rows: ``arrow.json``)."""
    return (_text_or_chat(arrow_type) == "text" or pa.types.is_null(arrow_type)
            or getattr(arrow_type, "extension_name", None) == "arrow.json")


def _text_column(names: Any, kind: str, options: MaskOptions) -> str:
    """The column that names the rows of ``kind`` in messages: the chat, the prompt, or Alpaca's instruction."""
    if kind == "messages":
        return options.chat_column(names)
    return options.alpaca()["instruction"] if kind == "alpaca" else options.prompt_column


def _text_or_chat(arrow_type: pa.DataType) -> str | None:
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "text"
    if (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)) and _is_message(arrow_type.value_type):
        return "chat"
    return None


def _is_message(arrow_type: pa.DataType) -> bool:
    """A message is a struct, or a JSON object (``arrow.json``, as ``datasets`` stores rows of varying keys)."""
    if pa.types.is_struct(arrow_type):
        return True
    return getattr(arrow_type, "extension_name", None) == "arrow.json"


def output_schema(schema: pa.Schema, options: MaskOptions, kind: str, *, source: str = "input") -> pa.Schema:
    """The schema every output batch has: the input columns kept (``keep_columns``; all by default), then input_ids
    (when tokenised), labels (unless ``labels_column=None``), completion_mask, loss_weights."""
    added = [name for name in (options.labels_column, options.completion_mask_column) if name]
    if writes_weights(schema, options, kind):
        added.append(options.loss_weights_column)
    if kind != "input_ids":
        added.insert(0, options.input_ids_column)
    kept = set(kept_columns(schema.names, options, kind, source=source))
    # an input column that keep_columns leaves out is no clash: a labelled file can be labelled again that way
    clash = [name for name in added if name in kept and not (kind == "input_ids" and name == options.input_ids_column)]
    if clash:
        raise ValueError(
            f"the input already has column(s) {clash}, which masking writes; drop them first or choose other names "
            "(--labels-column / labels_column=, --completion-mask NAME), or leave them out (--keep-columns / "
            "keep_columns=)"
        )
    fields = [field for field in schema if field.name in kept]
    if kind == "input_ids":
        large = pa.types.is_large_list(schema.field(options.input_ids_column).type)
    else:
        large = False
        fields.append(pa.field(options.input_ids_column, pa.list_(pa.int32())))
    wrap = pa.large_list if large else pa.list_
    if options.labels_column:
        fields.append(pa.field(options.labels_column, wrap(pa.from_numpy_dtype(np.dtype(options.label_dtype)))))
    if options.completion_mask_column:
        fields.append(pa.field(options.completion_mask_column, wrap(pa.int8())))
    if writes_weights(schema, options, kind):
        fields.append(pa.field(options.loss_weights_column, pa.list_(pa.float32())))
    return pa.schema(fields, metadata=schema.metadata)


def kept_columns(names: list[str], options: MaskOptions, kind: str, *, source: str = "input") -> list[str]:
    """The input columns written out, in the input's order: all of them unless ``keep_columns`` names some; given
    ids (``input_ids``) are a token column and stay whatever it says. A name the input lacks is refused, naming the
    columns it has."""
    if options.keep_columns is None:
        return list(names)
    unknown = [name for name in options.keep_columns if name not in names]
    if unknown:
        raise ValueError(
            f"{source}: keep_columns names {', '.join(map(repr, unknown))}, which the input does not have; its columns "
            f"are {list(names)}; name some of those (--keep-columns A,B / keep_columns=[...]), or none to write only the "
            "token columns (--drop-input-columns / keep_columns=[])"
        )
    wanted = set(options.keep_columns)
    if kind == "input_ids":
        wanted.add(options.input_ids_column)
    return [name for name in names if name in wanted]


def writes_weights(schema: pa.Schema, options: MaskOptions, kind: str, *, source: str = "input") -> bool:
    """Is a ``loss_weights`` column written for this input (docs/weights.md)? Raises when a message-level weight
    option is given for pre-tokenised ids, which carry no messages."""
    if kind == "input_ids" and options.message_weights():
        raise ValueError(
            f"{source}: roles_to_train, weights_by_role, reasoning and mask_empty_think weigh messages, and column "
            f"{options.input_ids_column!r} holds token ids, which carry none; give the chat ({options.messages_column!r}) "
            "instead, or keep to the options that apply to ids: prompt_weight, train_on_eos, last_turn_only"
        )
    return options.writes_loss_weights(weight_field_types(schema, options) if kind != "input_ids" else ())


def mask_batch(
    batch: pa.RecordBatch | pa.Table,
    markers: Markers | None,
    options: MaskOptions,
    tally: Tally,
    *,
    tokenizer: Any = None,
    kind: str | None = None,
    first_row: int = 0,
    source: str = "input",
    encoded: Any = None,
    truncated_at: int | None = None,
    write_weights: bool | None = None,
) -> pa.Table:
    """Label one batch; return the rows to keep (as a Table) and add what happened to ``tally``.

    ``encoded``: the batch's ``chat.encode_batch.EncodedBatch`` when it was rendered and tokenised elsewhere
    (in a worker process); otherwise chat and prompt/completion rows are encoded here with ``tokenizer``.

    ``markers=None`` trains every token (the policy's "no masking" outcome, e.g. raw text).
    ``first_row`` is the batch's first row in the whole input, so that errors and invalid rows
    are named by the row the user knows. ``truncated_at``: the length the rows were cut to before
    they came here (a trainer's ``max_length``), so that dropped rows are told as cut. ``write_weights``: whether
    the job's output has a ``loss_weights`` column (decided once per job from its schema, ``writes_weights``;
    default: decided from this batch's schema).
    """
    table = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
    kind = kind or input_kind(table.schema, options, source=source)
    if write_weights is None:
        write_weights = writes_weights(table.schema, options, kind, source=source)
    broken = zeroed = None
    keep_valid = None
    data_mask = None  # which tokens are message text (known only for rows rendered here)
    if kind == "input_ids":
        input_ids = table.column(options.input_ids_column)
        prompt_lengths = None
        size = vocabulary_size(tokenizer)
        if size is not None:
            try:
                check_vocabulary(input_ids, size, first_row=first_row)
            except ValueError as exc:
                raise ValueError(f"{source}: column {options.input_ids_column!r}: {exc}") from None
    else:
        if tokenizer is None and encoded is None:
            raise ValueError(
                f"{source}: column {_text_column(table.column_names, kind, options)!r} "
                "needs a tokenizer to render and tokenise it; pass tokenizer= (--tokenizer DIR), or give pre-tokenised "
                f"{options.input_ids_column!r} with markers"
            )
        started = time.perf_counter()
        if encoded is None:
            encoded = encode_rows(tokenizer, table, kind, options, first_row=first_row, markers=markers)
        for row, message in encoded.errors:  # text from data or the template: one line, escaped and cut
            tally.add_invalid(row, one_line(message))
        for row, reason, message in encoded.dropped:
            if reason == INVALID:  # a tool call's arguments nested too deep to read (chat.json_text)
                tally.add_invalid(row, one_line(message))
            else:
                tally.add_rejected(row, reason, one_line(message))
        tally.add_special(encoded.special_rows, encoded.special_example)
        tally.add_shapes(getattr(encoded, "shapes", None) or {})
        if getattr(encoded, "media_ids", ()):  # chats through a processor: their image tokens, counted apart
            values = encoded.input_ids.values.to_numpy(zero_copy_only=False)
            tally.media_tokens += int(np.isin(values, np.asarray(encoded.media_ids, dtype=values.dtype)).sum())
        tally.time("tokenize", time.perf_counter() - started)
        for stage, seconds in encoded.seconds.items():
            tally.time(stage, seconds)
        keep_valid = encoded.valid
        table = table.filter(pa.array(keep_valid)) if not keep_valid.all() else table
        input_ids = encoded.input_ids
        prompt_lengths = encoded.prompt_lengths
        data_mask = encoded.in_content

    started = time.perf_counter()
    if isinstance(input_ids, pa.ChunkedArray) and (
            input_ids.num_chunks == 1 or prompt_lengths is not None or markers is None or data_mask is not None):
        input_ids = input_ids.combine_chunks() if input_ids.num_chunks != 1 else input_ids.chunk(0)
    # (else the chunks are labelled one by one, in place: a Dataset's row groups are not copied together)
    media_span = getattr(encoded, "media_span", None)  # rows through a processor: each image's tokens never train
    media_span = media_span if media_span is not None and media_span.any() else None
    if prompt_lengths is not None:
        labels, trained, outcomes, counts = _label_by_position(input_ids, prompt_lengths, options)
    elif isinstance(markers, FromRendering):
        if kind == "input_ids":
            raise ValueError(
                f"{source}: column {options.input_ids_column!r} holds token ids, which carry no rendering to label from; "
                "this chat template's markers cannot be read, so give the chat rows (messages) instead, or markers "
                "(--markers FILE.json / markers=)")
        labels, trained, outcomes, counts, broken = _label_from_rendering(input_ids, table, kind, tokenizer, options,
                                                                          tally, first_row, keep_valid, encoded)
        if media_span is not None:
            labels, trained, counts = _untrain(labels, trained, outcomes, media_span, options.ignore_index)
    elif markers is None:
        try:
            labels, trained, outcomes, counts = _label_everything(input_ids, options)
        except ValueError as exc:
            raise ValueError(f"{source}: column {options.input_ids_column!r}: {_renumber(str(exc), first_row, keep_valid)}") from None
        if media_span is not None:  # no markers: every token trains, the images' tokens excepted
            labels, trained, counts = _untrain(labels, trained, outcomes, media_span, options.ignore_index)
    else:
        engine_started = time.perf_counter()
        try:
            result = label_batch(
                input_ids, markers, backend=options.backend, last_turn_only=options.last_turn_only,
                ignore_index=options.ignore_index, dtype=options.label_dtype, data_mask=data_mask,
            )
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"{source}: column {options.input_ids_column!r}: {_renumber(str(exc), first_row, keep_valid)}") from None
        labels, trained, outcomes, counts = result.labels, result.trained_tokens, result.outcomes, result.counts
        if media_span is not None:  # plain text inside an image (Idefics3's tile tags) too
            labels, trained, counts = _untrain(labels, trained, outcomes, media_span, options.ignore_index)
        tally.time("engine", time.perf_counter() - engine_started)
        roles = getattr(encoded, "roles", None) if kind != "input_ids" else None
        if roles is not None:  # checked on the marker labels, before weights apply (docs/weights.md)
            broken, relabelled = _check_roles(input_ids, labels, roles, options, tally, first_row, keep_valid,
                                              rows_of=None if media_span is not None else (table, kind, tokenizer))
            if relabelled is not None:  # rows labelled from the rendering instead: their counts follow
                labels, row_trained = relabelled
                trained = row_trained
                lengths = _lengths(input_ids)
                outcomes = np.where(trained > 0, Outcome.TRAINED,
                                    np.where(outcomes == Outcome.TRAINED, Outcome.EMPTY_RESPONSE, outcomes)).astype(np.int8)
                counts = OutcomeCounts.from_rows(outcomes, trained, lengths)
    weights = None
    if write_weights or _weighing(options, encoded if kind != "input_ids" else None):
        started_weights = time.perf_counter()
        planned = getattr(encoded, "weights", None) if kind != "input_ids" else None
        if not write_weights and not options.token_weights() and media_span is None and _plain(planned):
            # every trained token weighs 1 (a source column asked for the weights' accounting only): from the counts
            _count_plain(trained, options, tally, table)
        else:
            labels, weights, trained, outcomes, zeroed, odd = _apply_weights(
                input_ids, labels, outcomes, planned, markers if prompt_lengths is None else None, options, tally,
                table, tokenizer, media_span, write_weights)
            if not write_weights and odd is not None:
                _refuse_unwritten_weight(odd, options, source)
        counts = OutcomeCounts.from_rows(outcomes, trained, _lengths(input_ids))
        tally.time("weights", time.perf_counter() - started_weights)
    if broken is not None and broken.any():  # these rows leave the batch before anything is counted or written
        whole = ~broken
        table, input_ids, labels = table.filter(pa.array(whole)), input_ids.filter(pa.array(whole)), \
            labels.filter(pa.array(whole))
        weights = weights.filter(pa.array(whole)) if weights is not None else None
        zeroed = zeroed[whole] if zeroed is not None else None
        outcomes, trained = outcomes[whole], trained[whole]
        counts = OutcomeCounts.from_rows(outcomes, trained, _lengths(input_ids))
        keep_valid = keep_valid.copy()
        keep_valid[np.flatnonzero(keep_valid)[broken]] = False
    has_assistant = None
    if counts.rows_dropped and kind == "messages" and not (zeroed is not None and bool(
            zeroed[outcomes != Outcome.TRAINED].all())):
        has_assistant = _has_assistant(table, options)
        if has_assistant is not None:
            # a chat with no assistant message has no response, whatever its template writes at its end (Mistral-v3's
            # [/INST] opens an empty one): the same reason on every family
            silent = (outcomes == Outcome.EMPTY_RESPONSE) & ~has_assistant
            if silent.any():
                outcomes = np.where(silent, Outcome.NO_RESPONSE, outcomes).astype(np.int8)
                counts = OutcomeCounts.from_rows(outcomes, trained, _lengths(input_ids))
    tally.counts = tally.counts + counts
    if tally.dropped_example is None and counts.rows_dropped:
        r = int(np.flatnonzero(outcomes != Outcome.TRAINED)[0])
        tally.dropped_example = (input_ids[r].as_py() or [], labels[r].as_py() or [])
    if counts.rows_dropped:
        limit = truncated_at or (options.max_length if kind != "input_ids" else None)
        _note_drops(tally, input_ids, labels, outcomes, limit, first_row, keep_valid, zeroed, has_assistant)
    if options.keep_columns is not None:  # passthrough columns left out before the rows are kept: a zero-copy select
        table = table.select(kept_columns(table.column_names, options, kind, source=source))
    columns = {}
    if kind != "input_ids":
        columns[options.input_ids_column] = input_ids
    if options.labels_column:
        columns[options.labels_column] = labels
    if options.completion_mask_column:
        columns[options.completion_mask_column] = _mask_from_labels(labels, options.ignore_index)
    if write_weights:
        columns[options.loss_weights_column] = weights if weights is not None else _ones_where_trained(labels, options)
    for name, column in columns.items():
        table = table.append_column(name, column)
    if not options.keep_dropped:
        keep = outcomes == Outcome.TRAINED
        if not keep.all():
            table = keep_rows(table, keep)
    tally.rows_out += table.num_rows
    tally.time("label", time.perf_counter() - started)
    return table


# Kept rows in at most this many runs are returned as slices of the batch: no copy at all (the Parquet writer and
# every caller take chunked columns); more runs are copied into one chunk instead.
MAX_KEPT_RUNS = 256


def keep_rows(table: pa.Table, keep: np.ndarray) -> pa.Table:
    """``table.filter(keep)`` without copying what it keeps. Rows are dropped rarely, so the kept ones come in a few
    runs, each a zero-copy slice. Arrow's filter copies every column, its lists of numbers at about 100 MB/s, into
    memory it has to fault in (0.7 s for the ids and labels of 16,000 ShareGPT rows, more than labelling them)."""
    edges = np.flatnonzero(np.diff(np.concatenate([[False], keep, [False]]).astype(np.int8)))
    starts, ends = edges[::2], edges[1::2]
    if starts.shape[0] <= MAX_KEPT_RUNS:
        if starts.shape[0] == 1:
            return table.slice(int(starts[0]), int(ends[0] - starts[0]))
        return pa.concat_tables([table.slice(int(a), int(b - a)) for a, b in zip(starts, ends)]) if starts.shape[0] \
            else table.slice(0, 0)
    mask = pa.array(keep)
    return pa.Table.from_arrays([_keep_list(column, keep, mask) for column in table.columns], schema=table.schema)


def _keep_list(column: pa.ChunkedArray, keep: np.ndarray, mask: pa.Array) -> pa.ChunkedArray | pa.Array:
    """The rows of one column that ``keep`` keeps: by NumPy for a list of numbers whose kept rows are not null (a row
    that failed is null, and is dropped), else Arrow's filter."""
    kind = column.type
    plain = (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and \
        (pa.types.is_integer(kind.value_type) or pa.types.is_floating(kind.value_type))
    if not plain or column.num_chunks != 1:
        return column.filter(mask)
    array = column.chunk(0)
    if array.values.null_count or (array.null_count and not array.is_valid().to_numpy(zero_copy_only=False)[keep].all()):
        return column.filter(mask)  # (a null row that is kept: Arrow keeps it null)
    offsets = array.offsets.to_numpy()
    values = array.values.to_numpy()
    kept = np.zeros(int(keep.sum()) + 1, dtype=offsets.dtype)
    np.cumsum(np.diff(offsets)[keep], out=kept[1:])
    # the kept rows come in runs between the dropped ones: one copy of each run's values
    edges = np.flatnonzero(np.diff(np.concatenate([[False], keep, [False]]).astype(np.int8)))
    pieces = [values[offsets[a]:offsets[b]] for a, b in zip(edges[::2], edges[1::2])]
    joined = np.concatenate(pieces) if pieces else values[:0]
    return type(array).from_arrays(pa.array(kept), pa.array(joined, type=kind.value_type))


def _untrain(labels: pa.Array, trained: np.ndarray, outcomes: np.ndarray, where: np.ndarray, ignore_index: int):
    """``labels`` with the tokens ``where`` is True (a bool per token, back to back) set to ``ignore_index``, and the
    trained tokens and counts that follow."""
    values = pc.list_flatten(labels).to_numpy(zero_copy_only=False).copy()
    hit = where & (values != ignore_index)
    values[hit] = ignore_index
    lengths = _lengths(labels).astype(np.int64)
    trained = trained - np.bincount(np.repeat(np.arange(lengths.shape[0]), lengths)[hit], minlength=lengths.shape[0])
    return _rebuild(labels, values, lengths), trained, OutcomeCounts.from_rows(outcomes, trained, lengths)


def _lengths(input_ids) -> np.ndarray:
    """Tokens per row (0 for a null row). Read off the offsets buffer where there are no null rows: a compute call
    releases the GIL, and on a job's labelling thread taking it back waits for the rendering thread (up to the
    interpreter's switch interval, 5 ms, each time)."""
    if isinstance(input_ids, pa.Array) and not input_ids.null_count:
        return _flat_rows(input_ids)[2]
    return pc.fill_null(pc.list_value_length(input_ids), 0).to_numpy(zero_copy_only=False)


def _flat_rows(array: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(values, row_starts, lengths)`` of a list array with no null rows, zero-copy (``rows_from_arrow``), the rows
    back to back from ``values[0]``; None where a null row makes them not so."""
    if array.null_count:
        return None
    rows = rows_from_arrow(array)
    return rows.values, rows.starts.astype(np.int64), (rows.ends - rows.starts).astype(np.int64)


def _weighing(options: MaskOptions, encoded: Any) -> bool:
    """Do weights change anything in this batch: a marker-level choice, or a row whose messages ask for weights?"""
    if options.token_weights() or options.source_column:
        return True
    planned = getattr(encoded, "weights", None)
    return planned is not None and any(plan is not None for plan in planned.plans)


def _plain(planned) -> bool:
    """No row of the batch asks for a weight of its own (every plan None, or one weight of 1 for every turn)."""
    return planned is None or all(plan is None or (not plan.exact and plan.uniform == 1.0) for plan in planned.plans)


def _count_plain(trained: np.ndarray, options: MaskOptions, tally: Tally, table) -> None:
    """The weights' accounting of a batch where every trained token weighs 1: the marker labels' counts."""
    total = int(trained.sum())
    tally.add_weights({"assistant": [total, float(total)]} if total else {},
                      _sources(table, options, trained, trained.astype(np.float64)))


def _apply_weights(input_ids, labels, outcomes, planned, markers, options, tally, table, tokenizer, media_span=None,
                   write_weights=True):
    """Weights for a labelled batch (``engine/weights.py``); labels where they change. Returns the labels, the weights
    (``list<float32>``, None unless ``write_weights``), trained tokens and outcomes per row, the rows the weights left
    with nothing trained, and the first weight other than 0 or 1 when they are not written (else None).
    ``media_span``: a bool per token inside an image (chats through a processor), weighed 0 whatever the options."""
    if isinstance(input_ids, pa.ChunkedArray):
        input_ids = input_ids.combine_chunks()
    if isinstance(labels, pa.ChunkedArray):
        labels = labels.combine_chunks()
    # the buffers as they are (no compute call: see _lengths); null rows hold no tokens
    flat_ids, flat_label_rows = _flat_rows(input_ids), _flat_rows(labels)
    if flat_ids is not None and flat_label_rows is not None and np.array_equal(flat_ids[1], flat_label_rows[1]):
        ids, _, lengths = flat_ids
        flat_labels = flat_label_rows[0]
    else:
        lengths = _lengths(input_ids).astype(np.int64)
        ids = pc.list_flatten(input_ids).to_numpy(zero_copy_only=False)
        flat_labels = pc.list_flatten(labels).to_numpy(zero_copy_only=False)
    if markers is not None:
        end = markers.end
    else:  # no markers, or plain-text prompt/completion: the EOS appended after the completion stops it
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        end = ((eos,),) if eos is not None else ()
    weighed = weigh_tokens(ids, lengths, flat_labels, options.ignore_index, planned, end, options, never=media_span)
    row_tokens = weighed.row_tokens
    tally.add_weights(weighed.by_role, _sources(table, options, row_tokens, weighed.row_mass))
    if weighed.changed:
        labels = _rebuild(input_ids, weighed.labels, lengths)
    before = outcomes == Outcome.TRAINED
    outcomes = np.where(row_tokens > 0, Outcome.TRAINED,
                        np.where(before, Outcome.EMPTY_RESPONSE, outcomes)).astype(np.int8)
    zeroed = before & (row_tokens == 0)
    weights = None
    if write_weights:
        weights = weights_to_arrow(input_ids if not input_ids.null_count else _rebuild(input_ids, ids, lengths),
                                   weighed.weights)
    odd = None
    if weighed.odd and not write_weights:  # the value, for the refusal only (a pass over every weight)
        values = weighed.weights
        odd = float(values[(values != 0) & (values != 1)][0])
    return labels, weights, row_tokens, outcomes, zeroed, odd


def _rebuild(like, values, lengths) -> pa.Array:
    """A list array of ``values`` with the rows of ``lengths``, null where ``like`` is (list or large list as it).
    Where ``like``'s rows lie back to back from its first value, its own offsets are shared (no compute call)."""
    if isinstance(like, pa.Array) and not like.null_count and len(like):
        rows = rows_from_arrow(like)
        if rows.base == 0 and rows.values.shape[0] == values.shape[0]:
            values = np.ascontiguousarray(values)
            return labels_to_arrow(like, pa.py_buffer(values), values.dtype)
    offsets = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    mask = pa.array(~like.is_valid().to_numpy(zero_copy_only=False)) if like.null_count else None
    arr = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.ascontiguousarray(values)), mask=mask)
    return arr.cast(pa.list_(arr.type.value_type)) if not pa.types.is_large_list(like.type) else arr


def _sources(table, options, row_tokens, row_mass) -> dict | None:
    """Trained tokens and weight mass per value of ``options.source_column`` (rows, tokens, mass)."""
    name = options.source_column
    if not name:
        return None
    if name not in table.column_names:
        raise ValueError(f"source_column={name!r} is not a column of the input; the columns are {table.column_names}")
    column = table.column(name)
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        # a dict over the batch's values (a few thousand): compute calls would each hand the GIL to the rendering
        # thread and wait to take it back
        codes: dict = {}
        index = np.fromiter((codes.setdefault(value, len(codes)) for value in column.to_pylist()), dtype=np.int64,
                            count=len(column))
        labels = ["(null)" if value is None else value for value in codes]
    else:
        column = column.combine_chunks().cast(pa.string())
        encoded = pc.dictionary_encode(column)
        index = pc.fill_null(encoded.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)
        labels = [str(v) for v in encoded.dictionary.to_pylist()] + ["(null)"]
        index = np.where(index < 0, len(labels) - 1, index)
    rows = np.bincount(index, minlength=len(labels))
    tokens = np.bincount(index, weights=row_tokens, minlength=len(labels))
    mass = np.bincount(index, weights=row_mass, minlength=len(labels))
    return {labels[i]: [int(rows[i]), int(tokens[i]), float(mass[i])] for i in range(len(labels)) if rows[i]}


def _refuse_unwritten_weight(odd: float, options: MaskOptions, source: str) -> None:
    raise ValueError(
        f"{source}: a weight of {odd} occurs, but no {options.loss_weights_column!r} column is being "
        "written (the options and the input's schema promised 0/1 weights only); pass loss_weights=True "
        "(--loss-weights) so that the weights are written"
    )


def _ones_where_trained(labels, options: MaskOptions) -> pa.Array:
    """Weights 1 where a label trains and 0 elsewhere (the column asked for, where no weight source applied)."""
    if isinstance(labels, pa.ChunkedArray):
        labels = labels.combine_chunks()
    values = pc.list_flatten(labels).to_numpy(zero_copy_only=False)
    return weights_to_arrow(_rebuild(labels, values, _lengths(labels).astype(np.int64)),
                            (values != options.ignore_index).astype(np.float32))


_ROW = re.compile(r"\brow (\d+)\b")


def _check_roles(input_ids, labels, roles, options, tally, first_row, keep_valid, rows_of=None):
    """The role invariant (docs/masking-rule.md): per row, does a token of user, system or tool text train, or a
    token of an assistant's content or tool-call arguments not? One pass over the batch's tokens.

    A row that breaks it under the markers is labelled from its rendering instead (``chat.turn_spans``: each
    assistant turn found by rendering up to it and through it), when ``rows_of`` (the batch's ``(table, kind,
    tokenizer)``) gives its messages; it is kept when those labels keep the invariant, and counted as
    ``labelled_from_rendering``. The rows that still break it are counted as ``template_breaks_roles``, with the
    first token that does. Returns the rows that break it (a bool per row) and, when some row was labelled from
    its rendering, ``(labels, trained tokens per row)`` for the whole batch (else None).

    With ``last_turn_only`` earlier assistant turns are meant to stay untrained, so only the first half is checked.
    """
    lengths = _lengths(input_ids).astype(np.int64)
    flat = pc.list_flatten(labels).to_numpy(zero_copy_only=False)
    if flat.shape[0] != roles.role.shape[0]:  # never: both come from the same ids
        raise AssertionError(f"lossmask: {flat.shape[0]} labels but {roles.role.shape[0]} role marks; please report this")
    bad = role_breaks(flat != options.ignore_index, roles, options.last_turn_only)
    broken = np.zeros(lengths.shape[0], dtype=bool)
    if not bad.any():
        return broken, None
    row_of = np.repeat(np.arange(lengths.shape[0]), lengths)
    broken[row_of[bad]] = True
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    index = np.flatnonzero(keep_valid) if keep_valid is not None else None

    def row_number(r: int) -> int:
        return first_row + (int(index[r]) if index is not None and r < index.size else int(r))

    relabelled = None
    over_budget: set = set()
    fixed = _from_rendering(input_ids, flat, starts, lengths, np.flatnonzero(broken), roles, options, rows_of,
                            over_budget)
    if fixed:
        flat = flat.copy()
        for r, trained_here in fixed.items():
            at = slice(int(starts[r]), int(starts[r] + lengths[r]))
            row_bad = role_breaks(trained_here, _slice_roles(roles, at), options.last_turn_only)
            if row_bad.any():
                continue
            ids = pc.list_flatten(input_ids[r : r + 1]).to_numpy(zero_copy_only=False)
            flat[at] = np.where(trained_here, ids, options.ignore_index)
            broken[r] = False
            bad[at] = False
            tally.add_from_rendering(row_number(r), "its assistant turns, found from the rendering, keep the role "
                                     "invariant; the markers' labels did not")
        if fixed.keys() - set(np.flatnonzero(broken).tolist()):
            values = flat.astype(options.label_dtype, copy=False)
            running = np.concatenate([[0], np.cumsum(flat != options.ignore_index)])
            trained = running[starts + lengths] - running[starts]
            relabelled = (_rebuild(input_ids if not isinstance(input_ids, pa.ChunkedArray) else input_ids.combine_chunks(),
                                   values, lengths), trained)
    firsts = np.flatnonzero(bad)
    for r in np.flatnonzero(broken):
        if int(r) in over_budget:  # the rendering could not tell within the row's time: dropped under that name
            tally.add_rejected(row_number(int(r)), RENDERING_OVER_BUDGET, over_budget_message(options.max_row_rendering_seconds))
            continue
        at = int(firsts[np.searchsorted(firsts, starts[r])])
        tally.add_rejected(row_number(int(r)), TEMPLATE_BREAKS_ROLES, breaks_message(roles, at, int(starts[r])))
    return broken, relabelled


def _label_from_rendering(input_ids, table, kind, tokenizer, options, tally, first_row, keep_valid, encoded=None):
    """Every row labelled from its own rendering (``chat.turn_spans.label_from_rendering``): the template's markers
    cannot be read. A row whose turns cannot be found is counted as ``template_breaks_roles`` and dropped, one that
    takes longer than ``max_row_rendering_seconds`` as ``rendering_over_budget``."""
    ct = chat_tokenizer(tokenizer)
    chats = getattr(encoded, "chats", None)
    if chats is None or len(chats) != table.num_rows or options.truncation == "history":
        # (read from the table again; a row that kept only its last turns is labelled from its whole chat, as before)
        chats = chats_of_rows(ct, table, kind, options, range(table.num_rows))
    result = label_from_rendering(ct, chats, input_ids, last_turn_only=options.last_turn_only,
                                  ignore_index=options.ignore_index, dtype=options.label_dtype,
                                  special_tokens_in_content=options.special_tokens_in_content,
                                  texts=getattr(encoded, "texts", None),
                                  seconds_per_row=options.max_row_rendering_seconds)
    index = np.flatnonzero(keep_valid) if keep_valid is not None else None
    broken = np.zeros(len(result.outcomes), dtype=bool)
    for r, reason, message in result.rejected:  # these rows leave the batch, counted by their reason
        tally.add_rejected(first_row + (int(index[r]) if index is not None and r < index.size else int(r)), reason,
                           message)
        broken[r] = True
    return result.labels, result.trained_tokens, result.outcomes, result.counts, broken


def _slice_roles(roles, at: slice):
    return type(roles)(role=roles.role[at], message=roles.message[at], names=roles.names)


def _from_rendering(input_ids, flat, starts, lengths, rows, roles, options, rows_of, over_budget: set) -> dict:
    """``{row: trained bool per token}`` for the ``rows`` whose assistant turns can be found from their rendering
    (``chat.turn_spans``); rows that cannot be rendered again, or are not the conversation given, are left out, and
    those that take longer than ``max_row_rendering_seconds`` are added to ``over_budget``."""
    if rows_of is None:
        return {}
    table, kind, tokenizer = rows_of
    if tokenizer is None or kind == "input_ids":
        return {}
    ct = chat_tokenizer(tokenizer)
    found = {}
    for r, (messages, tools) in zip(rows.tolist(), chats_of_rows(ct, table, kind, options, rows)):
        if not messages or not (flat[int(starts[r]): int(starts[r] + lengths[r])] != options.ignore_index).any():
            continue  # markers that train nothing of the row are not this template's: no rendering stands in for them
        ids = pc.list_flatten(input_ids[r : r + 1]).to_numpy(zero_copy_only=False)
        try:
            trained = trained_from_rendering(ct, messages, ids, tools=tools, last_turn_only=options.last_turn_only,
                                             special_tokens_in_content=options.special_tokens_in_content,
                                             deadline=time.monotonic() + options.max_row_rendering_seconds)
        except RenderingOverBudget:
            over_budget.add(r)
            continue
        if trained is not None:
            found[r] = trained
    return found


def _has_assistant(table: pa.Table, options: MaskOptions) -> np.ndarray | None:
    """Per row of a batch of chats, does it hold an assistant message (read from the Arrow column, vectorised)? None
    when the messages do not say their role in a way read here (ShareGPT's speakers)."""
    chat_column = options.chat_column(table.column_names)
    if chat_column not in table.column_names:
        return None
    chats = table.column(chat_column).combine_chunks()
    turns = pc.list_flatten(chats)
    if isinstance(turns, pa.ExtensionArray):  # arrow.json: each message is its JSON text
        turns = turns.storage
    is_assistant = None
    if pa.types.is_struct(turns.type) and turns.type.get_field_index("role") >= 0:
        is_assistant = pc.fill_null(pc.equal(pc.struct_field(turns, "role"), "assistant"), False)
    elif pa.types.is_string(turns.type) or pa.types.is_large_string(turns.type):
        is_assistant = pc.fill_null(pc.match_substring_regex(turns, r'"role"\s*:\s*"assistant"'), False)
    if is_assistant is None:
        return None
    parents = pc.list_parent_indices(chats).to_numpy(zero_copy_only=False)
    hits = parents[is_assistant.to_numpy(zero_copy_only=False)]
    return np.bincount(hits, minlength=len(table)) > 0


def _note_drops(tally, input_ids, labels, outcomes, limit, first_row, keep_valid, zeroed=None,
                has_assistant=None) -> None:
    """Count the dropped rows of a batch by what they show (``engine.outcomes.classify_drops``), one example each;
    ``has_assistant``: per row, whether the chat holds an assistant message (``_has_assistant``)."""
    lengths = _lengths(input_ids)
    dropped, causes = classify_drops(outcomes, lengths, has_assistant=has_assistant, max_length=limit, zeroed=zeroed)
    tally.tokens_dropped += int(lengths[dropped].sum())
    index = np.flatnonzero(keep_valid) if keep_valid is not None else None
    for code in np.unique(causes):
        cause = CAUSES[int(code)]
        rows = dropped[causes == code]
        tally.drop_causes[cause] = tally.drop_causes.get(cause, 0) + int(rows.size)
        if cause not in tally.drop_examples:
            r = int(rows[0])
            row = first_row + (int(index[r]) if index is not None and r < index.size else r)
            tally.drop_examples[cause] = (row, input_ids[r].as_py() or [], labels[r].as_py() or [])


def _renumber(message: str, first_row: int, valid: np.ndarray | None) -> str:
    """Engine errors count rows from the batch start; name the row of the whole input instead."""
    index = np.flatnonzero(valid) if valid is not None else None

    def absolute(match: re.Match) -> str:
        r = int(match.group(1))
        if index is not None and r < index.size:
            r = int(index[r])
        return f"row {first_row + r}"

    return _ROW.sub(absolute, message, count=1)


def vocabulary_size(tokenizer: Any) -> int | None:
    """How many token ids a tokenizer (or ``ChatTokenizer``) has, added tokens included; None when unknown."""
    if tokenizer is None:
        return None
    try:
        return len(getattr(tokenizer, "tokenizer", tokenizer))
    except TypeError:
        return None


def _with_values(arr: pa.Array, rows: TokenRows, values: np.ndarray) -> pa.Array:
    """A list array shaped like ``arr`` holding ``values``, one per value of ``rows`` (from ``rows_from_arrow``)."""
    values = np.ascontiguousarray(values)
    return labels_to_arrow(arr, pa.py_buffer(values), values.dtype, base=rows.base)


def _label_everything(input_ids: pa.Array, options: MaskOptions):
    """No markers (the policy decided not to mask): every token trains."""
    rows = rows_from_arrow(input_ids)
    check_label_range(rows, np.dtype(options.label_dtype))
    lengths = rows.lengths
    values = rows.values.astype(options.label_dtype)  # a null row stays null (its validity is kept)
    outcomes = np.where(lengths > 0, Outcome.TRAINED, Outcome.EMPTY).astype(np.int8)
    trained = lengths
    return _with_values(input_ids, rows, values), trained, outcomes, OutcomeCounts.from_rows(outcomes, trained, lengths)


def _label_by_position(input_ids: pa.Array, prompt_lengths: np.ndarray, options: MaskOptions):
    """Plain-text prompt/completion: the first ``prompt_lengths[r]`` tokens of row ``r`` are masked, the rest trains."""
    rows = rows_from_arrow(input_ids)
    lengths = rows.lengths.astype(np.int64)
    # the values each row spans, a null row's included, so that positions line up with the buffer
    spans = np.diff(np.append(rows.starts, rows.values.shape[0])).astype(np.int64)
    values = rows.values.astype(options.label_dtype)
    prompt = np.minimum(prompt_lengths.astype(np.int64), lengths)
    position = np.arange(values.shape[0], dtype=np.int64) - np.repeat(rows.starts.astype(np.int64), spans)
    values[position < np.repeat(prompt, spans)] = options.ignore_index
    trained = lengths - prompt
    outcomes = np.where(lengths == 0, Outcome.EMPTY, np.where(trained > 0, Outcome.TRAINED, Outcome.EMPTY_RESPONSE))
    outcomes = outcomes.astype(np.int8)
    return _with_values(input_ids, rows, values), trained, outcomes, OutcomeCounts.from_rows(outcomes, trained, lengths)


def _mask_from_labels(labels: Any, ignore_index: int) -> pa.Array:
    if isinstance(labels, pa.ChunkedArray):
        return pa.chunked_array([_mask_from_labels(c, ignore_index) for c in labels.chunks])
    rows = rows_from_arrow(labels)
    return _with_values(labels, rows, (rows.values != ignore_index).astype(np.int8))
