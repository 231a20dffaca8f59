"""The MLX-LM feed: a dataset, ``iterate_batches`` and a loss for ``mlx_lm.tuner.trainer.train`` / ``evaluate``.

    from lossmask import mlx as lm
    train_set, valid_set, _ = lm.load_dataset("data/", tokenizer)
    train(model, optimizer, train_set, valid_set, args=args,
          iterate_batches=lm.iterate_batches, loss=lm.make_loss(prompt_loss_weight=0.0))

What it does differently from mlx-lm's own path:

- every assistant turn of a multi-turn row trains (per-token masks from the engine, on the batch, in
  MLX), where mlx-lm's ``--mask-prompt`` trains only the last message (``last_turn_only=True`` does that);
- a split may also be ``lossmask mask`` output (``train.parquet`` with ``input_ids`` / ``labels``, or
  ``completion_mask`` in place of labels, or the same columns as JSONL rows); a ``loss_weights`` column (a float per token) weights the loss:
  sum(w * nll) / sum(w);
- padding targets are excluded from the loss (mlx-lm's ``default_loss`` counts one pad target per
  padded row);
- batch widths are bucketed (8 widths per power of two) so that the compiled step recompiles rarely;
- rows are sorted by their real token length (mlx-lm's ``CacheDataset`` sorts by the length of the
  raw JSON object);
- an empty file or mixed row shapes in one split raise an error naming the file and the row; text rows
  asked to be masked train every token, with a note (as ``lossmask lora`` does);
- a row carrying media in any form raises naming it: an image, video or audio part, an entry in an ``images``,
  ``videos`` or ``audios`` column (any row shape), or a media token in its ids (``lossmask mask`` output of an image
  row, or ``<|image_pad|>`` typed in a message).

Importing this module imports MLX; ``import lossmask`` does not import it.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pyarrow as pa

from .chat.turn_spans import FromRendering
from .engine import buffers, get_backend
from .engine.labels import label_batch
from .engine.outcomes import Outcome, OutcomeCounts
from .engine.patterns import Markers
from .jobs.safety import TooManyDroppedRows, check_drop_fraction
from .options import DEFAULT_MAX_DROP_FRACTION

mlx_kernel = get_backend("mlx")

SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class Features:
    """Which keys of a JSONL row hold what (mlx-lm's ``prompt_feature`` / ``completion_feature`` / ...)."""

    prompt: str = "prompt"
    completion: str = "completion"
    chat: str = "messages"
    text: str = "text"
    tools: str = "tools"

    def shape_of(self, row: Any) -> str | None:
        """``"completions"``, ``"chat"`` or ``"text"`` (mlx-lm's order of precedence), or None."""
        if not isinstance(row, dict):
            return None
        if self.prompt in row and self.completion in row:
            return "completions"
        if self.chat in row:
            return "chat"
        if self.text in row:
            return "text"
        return None


class MaskedDataset:
    """Tokenised rows of one split with the markers that label them.

    Rows are kept as flat buffers (``values``, ``offsets``). ``mask_prompt=False`` trains every token
    (mlx-lm's behaviour without ``--mask-prompt``); ``last_turn_only`` trains only the last assistant turn;
    ``labels`` (aligned with ``input_ids``, ``ignore_index`` where nothing trains, as ``lossmask mask`` writes
    them) are used as they are instead of markers. ``counts`` are the rows' outcomes (SPEC.md); rows
    that train nothing are left out unless ``drop_untrained=False``; more than ``max_drop_fraction``
    of them raises ``TooManyDroppedRows`` with the likely cause. ``dataset[i]`` is
    ``(tokens, 0)`` as mlx-lm's datasets give it. ``data_mask`` (from ``ChatTokenizer.encode_chats``'s
    ``in_content``) marks message-text tokens, which no marker may match; pre-tokenised rows have
    none, so there a marker's text inside a message acts as the marker. ``input_ids`` may be what
    ``encode_chats`` returns (``EncodedChats``): its mask is used and its rows are held to the role invariant, as
    ``lossmask mask`` holds them (a row the markers cannot read is labelled from its rendering; one that even so
    cannot be labelled raises, naming it). ``loss_weights`` (a float >= 0 per
    token, as ``lossmask mask`` writes them) weight each token's loss and say what trains (weight > 0);
    the batches then carry them (``weight_values`` holds them, row after row).
    """

    def __init__(self, input_ids: Any, markers: Markers | None, *, mask_prompt: bool = True, drop_untrained: bool = True,
                 max_drop_fraction: float = DEFAULT_MAX_DROP_FRACTION, last_turn_only: bool = False,
                 labels: Any = None, ignore_index: int = -100, name: str = "dataset",
                 data_mask: np.ndarray | None = None, loss_weights: Any = None):
        chats = input_ids if callable(getattr(input_ids, "label", None)) and hasattr(input_ids, "in_content") else None
        if mask_prompt and labels is None and not isinstance(markers, Markers) and not (
                chats is not None and isinstance(markers, FromRendering)):
            raise TypeError(f"{name}: mask_prompt=True needs markers (a lossmask.Markers, e.g. lossmask.detect_markers(tokenizer)); "
                            "labels from each row's rendering (lossmask.FromRendering) need chat rows, not token ids")
        if chats is not None:
            input_ids, data_mask = chats.input_ids, chats.in_content
        array = _as_rows(input_ids)
        self.name = name
        self.labelled_from_rendering = 0  # rows the markers could not read, labelled from their rendering
        self.markers = markers
        self.mask_prompt = bool(mask_prompt)
        self.last_turn_only = bool(last_turn_only)
        rows = buffers.rows_from_arrow(array)
        lengths = rows.lengths.astype(np.int64)
        trained = None  # per-token trained flags, when the rows came with labels
        weights = None if loss_weights is None else _weights_from_column(loss_weights, lengths, name)
        if weights is not None:  # the weights say what trains (labels, when given, agree with them)
            trained = weights > 0
            self.counts = _counts_from_trained(array, trained, lengths, markers)
            keep = _trained_per_row(trained, lengths) > 0
        elif labels is not None:
            trained = _trained_from_labels(_as_rows(labels), lengths, ignore_index, name)
            self.counts = _counts_from_trained(array, trained, lengths, markers)
            keep = _trained_per_row(trained, lengths) > 0
        elif mask_prompt:
            labelled = label_batch(chats if chats is not None else array, markers, last_turn_only=last_turn_only,
                                   data_mask=data_mask)
            if labelled.rejected:
                row, reason, message = labelled.rejected[0]
                raise ValueError(
                    f"{name}: {len(labelled.rejected)} rows cannot be labelled ({reason}); first: row {row}: {message}. "
                    "Fix or remove them (lossmask mask drops and counts such rows)")
            self.counts, keep = labelled.counts, labelled.keep
            self.labelled_from_rendering = len(labelled.from_rendering)
            if data_mask is not None or chats is not None:  # message text is inert: the labels are fixed here, not re-derived from ids per batch
                trained = _trained_from_labels(labelled.labels, lengths, -100, name)
        else:  # every token trains (mlx-lm without --mask-prompt, text rows)
            keep = lengths > 0
            self.counts = OutcomeCounts.from_rows(np.where(keep, Outcome.TRAINED, Outcome.EMPTY), lengths, lengths)
        try:
            check_drop_fraction(self.counts, max_drop_fraction=max_drop_fraction)
        except TooManyDroppedRows as exc:
            raise TooManyDroppedRows(f"{name}: {exc}", exc.counts) from None
        if drop_untrained and not keep.all():
            if trained is not None:
                trained = trained[np.repeat(keep, lengths)]
            if weights is not None:
                weights = weights[np.repeat(keep, lengths)]
            array = array.filter(pa.array(keep))
            rows = buffers.rows_from_arrow(array)
            lengths = rows.lengths.astype(np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.values = _compact(rows, lengths).astype(np.int32)
        self.lengths = lengths
        self.trained_values = trained
        self.weight_values = weights

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def __getitem__(self, index: int) -> tuple[list[int], int]:
        return self.values[self.offsets[index] : self.offsets[index + 1]].tolist(), 0

    def itemlen(self, index: int) -> int:
        return int(self.lengths[index])

    def __repr__(self) -> str:
        return f"MaskedDataset({self.name!r}, rows={len(self)}, mask_prompt={self.mask_prompt})"


def _as_rows(rows: Any) -> pa.Array:
    return rows if not isinstance(rows, (list, tuple)) else buffers.rows_from_pylist(list(rows))


def _trained_per_row(trained: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Trained tokens of each row, from flat per-token flags."""
    row = np.repeat(np.arange(len(lengths)), lengths)
    return np.bincount(row, weights=trained, minlength=len(lengths)).astype(np.int64)


def _trained_from_labels(labels: pa.Array, lengths: np.ndarray, ignore_index: int, name: str) -> np.ndarray:
    """Flat per-token trained flags from a labels column (``lossmask mask`` output), checked against the ids."""
    given = buffers.rows_from_arrow(labels)
    if not np.array_equal(given.lengths, lengths):
        r = int(np.flatnonzero(given.lengths != lengths)[0])
        raise ValueError(f"{name} row {r} has {int(given.lengths[r])} labels for {int(lengths[r])} input_ids; "
                         "labels must align with input_ids (as `lossmask mask` writes them)")
    return _compact(given, lengths) != ignore_index


def _counts_from_trained(array: pa.Array, trained: np.ndarray, lengths: np.ndarray, markers: Markers | None) -> OutcomeCounts:
    """Outcomes of rows labelled elsewhere: trained when a label is set; otherwise the reason the markers give
    (``no_response`` when there are no markers to tell, ``empty`` for rows with no tokens)."""
    per_row = _trained_per_row(trained, lengths)
    outcomes = np.where(per_row > 0, Outcome.TRAINED, np.where(lengths > 0, Outcome.NO_RESPONSE, Outcome.EMPTY))
    untrained = np.flatnonzero(outcomes == Outcome.NO_RESPONSE)
    if untrained.size and isinstance(markers, Markers):
        why = np.asarray(label_batch(array.take(pa.array(untrained)), markers).outcomes)
        outcomes[untrained] = np.where(why == Outcome.TRAINED, Outcome.NO_RESPONSE, why)
    return OutcomeCounts.from_rows(outcomes.astype(np.int8), per_row, lengths)


def _weights_from_column(column: Any, lengths: np.ndarray, name: str) -> np.ndarray:
    """Flat float32 per-token weights from a ``loss_weights`` column (lists of floats), checked against the ids."""
    import pyarrow.compute as pc

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if not isinstance(column, pa.Array):
        column = pa.array(list(column), type=pa.large_list(pa.float32()))
    column = column.cast(pa.large_list(pa.float32()))
    given = np.asarray(pc.list_value_length(column).fill_null(0), dtype=np.int64)
    if not np.array_equal(given, lengths):
        r = int(np.flatnonzero(given != lengths)[0])
        raise ValueError(f"{name} row {r} has {int(given[r])} loss_weights for {int(lengths[r])} input_ids; "
                         "loss_weights must align with input_ids (as `lossmask mask` writes them)")
    values = np.asarray(pc.list_flatten(column).to_numpy(zero_copy_only=False), dtype=np.float32)
    bad = np.flatnonzero(~(np.isfinite(values) & (values >= 0)))
    if bad.size:
        r = int(np.searchsorted(np.cumsum(lengths), bad[0], side="right"))
        raise ValueError(f"{name} row {r} holds the loss weight {float(values[bad[0]])}; weights must be finite and >= 0 "
                         "(0 drops the token)")
    return values


def _compact(rows, lengths: np.ndarray) -> np.ndarray:
    """The rows' tokens back to back (Arrow rows may be sliced or hold null rows)."""
    cu = np.concatenate([[0], np.cumsum(lengths)])
    index = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1] - rows.starts.astype(np.int64), lengths)
    return np.asarray(rows.values)[index]


# -- reading an mlx-lm data folder -------------------------------------------------------------


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a JSONL file; raises on an empty file or a line that is not a JSON object."""
    path = Path(path)
    rows = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number} is not valid JSON ({exc.msg}); each line must be one JSON object") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number} holds a {type(row).__name__}; each line must be a JSON object")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path} has no rows; put one JSON object per line in it")
    return rows


def tokenize_rows(rows: Sequence[dict], tokenizer: Any, *, features: Features = Features(), mask_prompt: bool = True,
                  name: str = "rows"):
    """Token ids (a LargeList array) of rows of one shape, as mlx-lm renders them, and that shape."""
    ids, shape, _ = _tokenize_rows(rows, tokenizer, features=features, mask_prompt=mask_prompt, name=name)
    return ids, shape


def _tokenize_rows(rows, tokenizer, *, features, mask_prompt, name, special_tokens_in_content: str = "text"):
    """``tokenize_rows`` plus, for chat and completion rows, their ``EncodedChats`` (which tokens are message text,
    and what the role invariant needs)."""
    from .chat.tokenizer import load_tokenizer

    if len(rows) == 0:
        raise ValueError(f"{name} has no rows")
    shapes = [features.shape_of(row) for row in rows]
    first = shapes[0]
    for index, shape in enumerate(shapes):
        if shape is None:
            keys = sorted(rows[index]) if isinstance(rows[index], dict) else type(rows[index]).__name__
            raise ValueError(
                f"{name} row {index} has keys {keys}; expected {features.prompt!r}+{features.completion!r} "
                f"(completions), {features.chat!r} (chat) or {features.text!r} (text); set prompt_feature=, "
                "completion_feature=, chat_feature= or text_feature= to your key names"
            )
        if shape != first:
            raise ValueError(
                f"{name} mixes row shapes: row 0 is {first}, row {index} is {shape}; mlx-lm picks one shape "
                "from the first row and fails or silently misreads the rest. Put one shape per split"
            )
    _refuse_media(rows, features, name)
    ct = load_tokenizer(tokenizer)
    if first == "text":
        if mask_prompt:  # as `lossmask lora` does: said once, and every token trains
            warnings.warn(f"{name} holds text rows ({features.text!r}), which have no turns to mask: every token "
                          "trains (pass mask_prompt=False to say so, or write the rows as chat 'messages')",
                          UserWarning, stacklevel=3)
        texts = [row[features.text] for row in rows]
        encoded = ct.encode_texts(texts)
        eos = ct.eos_token_id
        if eos is not None:  # mlx-lm appends EOS to text rows that lack it
            ids = [r if (r and r[-1] == eos) else r + [eos] for r in encoded.to_pylist()]
            encoded = pa.array(ids, type=pa.large_list(pa.int32()))
        _refuse_media_ids(encoded, ct, name)
        return encoded, first, None
    if first == "completions":
        conversations = [
            {"messages": [{"role": "user", "content": row[features.prompt]},
                          {"role": "assistant", "content": row[features.completion]}],
             "tools": row.get(features.tools)}
            for row in rows
        ]
    else:
        conversations = [{"messages": messages, "tools": row.get(features.tools)}
                         for row, messages in zip(rows, _shaped(rows, ct, features, name))]
    encoded = ct.encode_chats(conversations, special_tokens_in_content=special_tokens_in_content)
    if encoded.errors:
        row, message = encoded.errors[0]
        raise ValueError(f"{name}: {len(encoded.errors)} rows could not be rendered by the chat template; first: {message}")
    if encoded.dropped:
        row, reason, message = encoded.dropped[0]
        raise ValueError(
            f"{name}: {len(encoded.dropped)} rows cannot be labelled ({reason}); first: row {row}: {message}. "
            "Fix or remove them (a message the chat template does not render would leave its turn mislabelled)"
        )
    _refuse_media_ids(encoded.input_ids, ct, name)
    return encoded.input_ids, first, encoded


def _refuse_media(rows: Sequence[dict], features: Features, name: str) -> None:
    """A row of any shape (chat, prompt/completion, text) with an image, video or audio part, or an entry in an
    ``images``, ``videos`` or ``audios`` column (LLaMA-Factory's ``<image>`` / ``<video>`` rows), raises naming the
    row: the feed tokenises text only, so the processor's expansion and the pixels would be missing and a model would
    train on a placeholder with no media behind it (or on text whose media were dropped)."""
    from .chat.media import MEDIA_COLUMNS, image_parts, other_media

    for index, row in enumerate(rows):
        messages = row.get(features.chat) if isinstance(row.get(features.chat), list) else None
        kind = other_media(messages) or ("image" if image_parts(messages) else None)
        where = f"a {kind!r} part" if kind else None
        column = next((c for c in MEDIA_COLUMNS if row.get(c)), None)
        if where is None and column is not None:
            where = f"media in its {column!r} column"
        if where:
            raise ValueError(
                f"{name} row {index} holds {where}; the MLX feed trains text models only and would train its text with "
                "no media behind it. Remove such rows (or train them with lossmask.vision.VisionCollator)")


def _refuse_media_ids(ids: Any, chat: Any, name: str) -> None:
    """A row whose token ids hold a media token (``chat.media.media_token_ids``: a ``lossmask mask`` output of an image
    row, 66 ``<|image_pad|>`` with no pixels; ``<|vision_start|>`` typed in a message, which a text template leaves a
    token) raises naming the row, the token and its position: the feed has no pixels to give the model for it.
    ``chat``: the split's ``ChatTokenizer`` (None: no tokenizer was given, so no vocabulary to read)."""
    import pyarrow.compute as pc

    from .chat.media import media_token_ids

    media = media_token_ids(chat) if chat is not None else {}
    if not media:
        return
    array = ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids
    flat = np.asarray(pc.list_flatten(array).to_numpy(zero_copy_only=False))
    hits = np.flatnonzero(np.isin(flat, np.fromiter(media, dtype=np.int64)))
    if hits.size == 0:
        return
    parents = np.asarray(pc.list_parent_indices(array).to_numpy(zero_copy_only=False))
    row = int(parents[hits[0]])
    position = int(hits[0] - np.searchsorted(parents, row))
    token = int(flat[hits[0]])
    raise ValueError(
        f"{name} row {row} holds the media token {media[token]!r} (id {token}) at position {position} (written for an "
        "image or video, or typed in a message); the MLX feed trains text models only and has no pixels for it. Remove "
        "such rows (or train them with lossmask.vision.VisionCollator)")


def _shaped(rows, ct, features, name) -> list:
    """The chats after the default conversation-shape policy of ``lossmask mask`` (docs/inputs.md): repeated roles
    merged, a leading assistant message and empty messages dropped. Phi-3 trains the second of two user messages
    and DeepSeek-V3.1 leaves an opening assistant message untrained when the template sees them as they are."""
    from .chat.shapes import needs_call_ids, normalise_shapes, takes_content_parts
    from .options import MaskOptions

    shaped = normalise_shapes([row[features.chat] for row in rows], MaskOptions(), takes_parts=takes_content_parts(ct),
                              call_ids=needs_call_ids(ct))
    refused = [(r, message) for r, message in shaped.invalid] + [(r, message) for r, _, message in shaped.dropped]
    if refused:
        row, message = min(refused)
        raise ValueError(f"{name}: {len(refused)} rows hold no conversation to train on; first: row {row}: {message}. "
                         "Fix or remove them (lossmask mask drops and counts such rows)")
    return shaped.conversations


def load_dataset(
    data: str | Path,
    tokenizer: Any,
    *,
    markers: Markers | None = None,
    mask_prompt: bool = True,
    last_turn_only: bool = False,
    drop_untrained: bool = True,
    max_drop_fraction: float = DEFAULT_MAX_DROP_FRACTION,
    prompt_feature: str = "prompt",
    completion_feature: str = "completion",
    chat_feature: str = "messages",
    text_feature: str = "text",
    special_tokens_in_content: str = "text",
) -> tuple[MaskedDataset | list, MaskedDataset | list, MaskedDataset | list]:
    """``(train, valid, test)`` from an mlx-lm data folder.

    Each split is ``{split}.jsonl`` (mlx-lm's chat / completions / text rows, rendered with the
    tokenizer's chat template) or ``{split}.parquet`` (``lossmask mask`` output: ``input_ids`` and, when
    present, ``labels``, which are used as they are). ``train`` is required; a missing ``valid`` or
    ``test`` split is ``[]``, as in mlx-lm (a missing ``valid`` warns: training goes on without
    validation). ``markers`` default to what ``lossmask.resolve_markers(tokenizer, strict=True)`` chooses: detected,
    else the template table, else labels from each row's rendering (``FromRendering``: chat rows only) for a
    template whose token markers cannot be read (only needed when ``mask_prompt``, or to name why rows of a Parquet
    split train nothing). Message text is data:
    special-token strings in it are encoded as text (``special_tokens_in_content``, as in
    ``lossmask.MaskOptions``) and no marker can match inside it.
    """
    folder = Path(data)
    if not folder.is_dir():
        raise ValueError(f"data={str(data)!r} is not a folder; pass a folder holding train.jsonl (and valid.jsonl, test.jsonl)")
    features = Features(prompt=prompt_feature, completion=completion_feature, chat=chat_feature, text=text_feature)
    paths = [split_file(folder, split) for split in SPLITS]
    if paths[0] is None:
        raise ValueError(f"{folder} has no train.jsonl (or train.parquet); mlx-lm data folders hold train.jsonl, "
                         "valid.jsonl and test.jsonl")
    if paths[1] is None:
        warnings.warn(f"{folder} has no valid.jsonl: training goes on without validation (as in mlx-lm)", stacklevel=2)
    if mask_prompt and markers is None:  # the policy: detected, else the table, else labels from each row's rendering
        from .markers.policy import resolve_markers

        markers = resolve_markers(tokenizer, strict=True).markers
    from .chat.tokenizer import load_tokenizer

    chat = load_tokenizer(tokenizer) if tokenizer is not None else None
    out: list[MaskedDataset | list] = []
    for split, path in zip(SPLITS, paths):
        if path is None:
            out.append([])
            continue
        options = dict(mask_prompt=mask_prompt, last_turn_only=last_turn_only, drop_untrained=drop_untrained,
                       max_drop_fraction=max_drop_fraction, name=str(path))
        if path.suffix == ".parquet":
            ids, labels, weights = _read_token_table(path)
            _refuse_media_ids(ids, chat, str(path))
            out.append(MaskedDataset(ids, markers, labels=labels, loss_weights=weights, **options))
            continue
        try:
            rows = read_jsonl(path)
        except ValueError as exc:
            if split == "train" or "has no rows" not in str(exc):
                raise
            raise ValueError(f"{exc}, or remove the file to go without a {split} split") from None
        if TOKENS in rows[0]:  # `lossmask mask` output as JSON lines: input_ids, labels, loss_weights
            ids, labels, weights = _token_columns(rows, str(path))
            _refuse_media_ids(ids, chat, str(path))
            out.append(MaskedDataset(ids, markers, labels=labels, loss_weights=weights, **options))
            continue
        ids, shape, encoded = _tokenize_rows(rows, chat, features=features, mask_prompt=mask_prompt,
                                             name=str(path), special_tokens_in_content=special_tokens_in_content)
        if shape == "text":  # no turns: every token trains
            options["mask_prompt"] = False
        out.append(MaskedDataset(encoded if encoded is not None else ids, markers, **options))
    return tuple(out)  # type: ignore[return-value]


def split_file(folder: Path, split: str) -> Path | None:
    """``{split}.jsonl`` or ``{split}.parquet`` in ``folder`` (None when neither is there; an error when both are)."""
    found = [folder / f"{split}{suffix}" for suffix in (".jsonl", ".parquet") if (folder / f"{split}{suffix}").is_file()]
    if len(found) > 1:
        raise ValueError(f"{folder} holds both {split}.jsonl and {split}.parquet; keep one of them")
    return found[0] if found else None


def read_parquet(path: str | Path) -> tuple[pa.Array, pa.Array | None]:
    """``input_ids`` and ``labels`` (None when absent) of a Parquet file, as ``lossmask mask`` writes it."""
    ids, labels, _ = _read_token_table(path)
    return ids, labels


TOKENS, LABELS, WEIGHTS = "input_ids", "labels", "loss_weights"
MASK = "completion_mask"  # an output written without labels (labels_column=None) carries its trained mask here


def _read_token_table(path: str | Path) -> tuple[pa.Array, pa.Array | None, pa.Array | None]:
    """``input_ids``, ``labels`` and ``loss_weights`` (None when absent) of a Parquet file."""
    import pyarrow.parquet as pq

    names = pq.read_schema(path).names
    if TOKENS not in names:
        raise ValueError(f"{path} has columns {names} but no input_ids; write it with `lossmask mask` "
                         "(or pass JSONL rows: messages, prompt/completion or text)")
    mask = MASK if LABELS not in names and MASK in names else None
    table = pq.read_table(path, columns=[c for c in (TOKENS, LABELS, WEIGHTS, mask) if c in names])
    if table.num_rows == 0:
        raise ValueError(f"{path} has no rows")
    ids, labels, weights = (table.column(c).combine_chunks() if c in names else None for c in (TOKENS, LABELS, WEIGHTS))
    if mask is not None:
        labels = _labels_from_mask(ids, table.column(MASK).combine_chunks(), str(path))
    return ids, labels, weights


def _labels_from_mask(ids: pa.Array, mask: pa.Array, name: str) -> pa.Array:
    """Labels (the id where ``completion_mask`` is 1, -100 elsewhere) for an output written without labels."""
    import pyarrow.compute as pc

    lengths = pc.fill_null(pc.list_value_length(ids), 0).to_numpy(zero_copy_only=False)
    mask_lengths = pc.fill_null(pc.list_value_length(mask), 0).to_numpy(zero_copy_only=False)
    if not np.array_equal(lengths, mask_lengths):
        r = int(np.flatnonzero(lengths != mask_lengths)[0])
        raise ValueError(f"{name} row {r} has {int(mask_lengths[r])} {MASK} values for {int(lengths[r])} input_ids; "
                         f"{MASK} must align with input_ids (as `lossmask mask` writes it)")
    values = np.where(pc.list_flatten(mask).to_numpy(zero_copy_only=False) != 0,
                      pc.list_flatten(ids).to_numpy(zero_copy_only=False), -100).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))


def _token_columns(rows: Sequence[dict], name: str) -> tuple[pa.Array, list | None, list | None]:
    """``input_ids``, ``labels`` and ``loss_weights`` of tokenised JSONL rows; every row holds the same keys."""
    columns = [c for c in (TOKENS, LABELS, WEIGHTS, MASK) if c in rows[0]]
    for index, row in enumerate(rows):
        if [c for c in (TOKENS, LABELS, WEIGHTS, MASK) if c in row] != columns:
            raise ValueError(f"{name} row {index} has keys {sorted(row)} but row 0 has {columns}; "
                             "give every tokenised row the same input_ids / labels / loss_weights keys")
    ids = buffers.rows_from_pylist([row[TOKENS] for row in rows])
    labels = buffers.rows_from_pylist([row[LABELS] for row in rows]) if LABELS in columns else None
    if labels is None and MASK in columns:
        labels = _labels_from_mask(ids, buffers.rows_from_pylist([row[MASK] for row in rows]), name)
    weights = [row[WEIGHTS] for row in rows] if WEIGHTS in columns else None
    return ids, labels, weights


# -- batches and loss ----------------------------------------------------------------------------


def batch_width(longest: int, max_seq_length: int) -> int:
    """The padded width of a batch: bucketed (few distinct widths, few recompiles), capped at ``max_seq_length``."""
    return min(mlx_kernel.bucket(max(longest, 1), minimum=32), max_seq_length)


def iterate_batches(
    dataset: MaskedDataset,
    batch_size: int,
    max_seq_length: int,
    loop: bool = False,
    seed: int | None = None,
    comm_group: Any = None,
) -> Iterator[tuple[mx.array, mx.array, mx.array]]:
    """Batches ``(tokens [B, W] int32, trained [B, W] bool, lengths [B] int32)`` for ``make_loss``.

    Same signature as mlx-lm's ``iterate_batches``. Rows are sorted by token length and grouped;
    the groups come in random order: from ``seed`` when given, else from NumPy's global generator, so
    ``np.random.seed(s)`` (what ``mlx_lm lora --seed`` does) fixes it, as in mlx-lm; ``loop=False`` stops after one pass. Rows longer
    than ``max_seq_length`` are cut there (and labelled as cut). ``trained`` comes from the MLX
    engine on the batch itself. A dataset with ``loss_weights`` yields a fourth array, ``weights``
    ([B, W] float32, 0 on padding), which ``make_loss``'s loss takes.
    """
    if isinstance(dataset, list) and not dataset:
        raise ValueError(
            "iterate_batches got an empty split ([]): lossmask.mlx.load_dataset returns [] for a split whose file "
            "is missing (valid.jsonl or test.jsonl); add that file to the data folder, or do not evaluate on that split"
        )
    if not isinstance(dataset, MaskedDataset):
        raise TypeError(
            f"dataset is a {type(dataset).__name__}; lossmask.mlx.iterate_batches reads a MaskedDataset: "
            "build it with lossmask.mlx.load_dataset(folder, tokenizer)"
        )
    if len(dataset) < batch_size:
        raise ValueError(f"{dataset.name} has {len(dataset)} rows, fewer than batch_size={batch_size}; lower batch_size")
    offset, step = (comm_group.rank(), comm_group.size()) if comm_group is not None else (0, 1)
    if batch_size % step:
        raise ValueError(f"batch_size={batch_size} must be a multiple of the {step} workers")
    order = np.argsort(dataset.lengths, kind="stable")
    groups = [order[i + offset : i + batch_size : step] for i in range(0, len(order) - batch_size + 1, batch_size)]
    # mlx-lm's convention: the order comes from NumPy's global generator (`mlx_lm lora --seed` seeds it with
    # np.random.seed), or from `seed` when one is given (without touching the global state)
    permutation = np.random.RandomState(seed).permutation if seed is not None else np.random.permutation
    while True:
        for g in permutation(len(groups)):
            yield _batch(dataset, groups[g], max_seq_length)
        if not loop:
            return


def _batch(dataset: MaskedDataset, rows: np.ndarray, max_seq_length: int):
    lengths = np.minimum(dataset.lengths[rows], max_seq_length)
    width = batch_width(int(lengths.max()), max_seq_length)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    row = np.repeat(np.arange(len(rows)), lengths)
    col = np.arange(int(cu[-1])) - np.repeat(cu[:-1], lengths)
    tokens = np.zeros((len(rows), width), dtype=np.int32)
    tokens[row, col] = dataset.values[np.repeat(dataset.offsets[rows], lengths) + col]
    tokens = mx.array(tokens)
    lengths_mx = mx.array(lengths.astype(np.int32))
    if dataset.trained_values is not None:
        trained_np = np.zeros((len(rows), width), dtype=bool)
        trained_np[row, col] = dataset.trained_values[np.repeat(dataset.offsets[rows], lengths) + col]
        trained = mx.array(trained_np)
    elif dataset.mask_prompt:
        trained = mlx_kernel.trained_padded(tokens, lengths_mx, dataset.markers, last_turn_only=dataset.last_turn_only)
    else:
        trained = mx.arange(width)[None, :] < lengths_mx[:, None]
    if dataset.weight_values is None:
        return tokens, trained, lengths_mx
    weights = np.zeros((len(rows), width), dtype=np.float32)
    weights[row, col] = dataset.weight_values[np.repeat(dataset.offsets[rows], lengths) + col]
    return tokens, trained, lengths_mx, mx.array(weights)


def make_loss(*, prompt_loss_weight: float = 0.0, per_sequence: bool = False):
    """A loss ``(model, tokens, trained, lengths[, weights]) -> (loss, n)`` for mlx-lm's ``train`` / ``evaluate``.

    The mean next-token cross-entropy over trained targets; with ``prompt_loss_weight`` = w > 0, the
    other real targets (prompt, system, tool output) count with weight w and ``n`` is the weight sum.
    Batches with ``weights`` (a split with ``loss_weights``) are weighted by them instead: each target
    by its own weight, sum(w * nll) / sum(w), ``n`` = sum(w). Padding targets never count.
    ``per_sequence=True``: the mean over rows of each row's weighted mean (a long answer counts as
    much as a short one), and ``n`` is the number of rows that train, so that mlx-lm's ``evaluate``
    averages over rows too.
    """
    if isinstance(prompt_loss_weight, bool) or not isinstance(prompt_loss_weight, (int, float)) or not (
        0.0 <= prompt_loss_weight <= 1.0
    ):
        raise ValueError(f"prompt_loss_weight={prompt_loss_weight!r}; pass a float in [0, 1] (0 drops prompt tokens)")
    weight = float(prompt_loss_weight)
    per_row = bool(per_sequence)

    def loss(model, tokens, trained, lengths, weights=None):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        logits = model(inputs)
        target_trained = trained[:, 1:]
        if weights is not None:
            w = weights[:, 1:].astype(mx.float32)
            n = w.sum()
        elif weight == 0.0:
            w = target_trained.astype(mx.float32)
            n = target_trained.sum()
        else:
            real = mx.arange(1, tokens.shape[1])[None, :] < lengths[:, None]
            w = mx.where(target_trained, 1.0, mx.where(real, weight, 0.0)).astype(mx.float32)
            n = w.sum()
        ce = (nn.losses.cross_entropy(logits, targets) * w).astype(mx.float32)
        if per_row:
            mass = w.sum(axis=1)
            live = mass > 0
            means = mx.where(live, ce.sum(axis=1) / mx.where(live, mass, 1.0), 0.0)
            rows = live.sum()
            return means.sum() / mx.maximum(rows, 1), rows
        return ce.sum() / mx.where(n > 0, n, 1), n

    return loss


masked_loss = make_loss()
