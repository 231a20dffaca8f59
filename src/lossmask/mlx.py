"""The MLX-LM feed: a dataset, ``iterate_batches`` and a loss for ``mlx_lm.tuner.trainer.train`` / ``evaluate``.

    from lossmask import mlx as lm
    train_set, valid_set, _ = lm.load_dataset("data/", tokenizer)
    train(model, optimizer, train_set, valid_set, args=args,
          iterate_batches=lm.iterate_batches, loss=lm.make_loss(prompt_loss_weight=0.0))

What it does differently from mlx-lm's own path:

- every assistant turn of a multi-turn row trains (per-token masks from the engine, on the batch, in
  MLX); ``--mask-prompt`` trains only the last message;
- padding targets are excluded from the loss (mlx-lm's ``default_loss`` counts one pad target per
  padded row);
- batch widths are bucketed (8 widths per power of two) so that the compiled step recompiles rarely;
- rows are sorted by their real token length (mlx-lm's ``CacheDataset`` sorts by the length of the
  raw JSON object);
- an empty file, mixed row shapes in one split, or masking asked for on text rows raise an error
  naming the file and the row.

Importing this module imports MLX; ``import lossmask`` does not import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pyarrow as pa

from . import batches
from .kernels import mlx_kernel
from .labels import label_batch
from .markers import Markers
from .outcomes import OutcomeCounts
from .safety import DEFAULT_MAX_DROP_FRACTION, TooManyDroppedRows, check_drop_fraction

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
    (mlx-lm's behaviour without ``--mask-prompt``). ``counts`` are the rows' outcomes (SPEC.md); rows
    that train nothing are left out unless ``drop_untrained=False``; more than ``max_drop_fraction``
    of them raises ``TooManyDroppedRows`` with the likely cause. ``dataset[i]`` is
    ``(tokens, 0)`` as mlx-lm's datasets give it. ``data_mask`` (from ``ChatTokenizer.encode_chats``'s
    ``in_content``) marks message-text tokens, which no marker may match; pre-tokenised rows have
    none, so there a marker's text inside a message acts as the marker.
    """

    def __init__(self, input_ids: Any, markers: Markers | None, *, mask_prompt: bool = True, drop_untrained: bool = True,
                 max_drop_fraction: float = DEFAULT_MAX_DROP_FRACTION, name: str = "dataset",
                 data_mask: np.ndarray | None = None):
        if mask_prompt and not isinstance(markers, Markers):
            raise TypeError(f"{name}: mask_prompt=True needs markers (a lossmask.Markers, e.g. lossmask.detect_markers(tokenizer))")
        array = input_ids if not isinstance(input_ids, (list, tuple)) else batches.rows_from_pylist(list(input_ids))
        self.name = name
        self.markers = markers
        self.mask_prompt = bool(mask_prompt)
        self.counts: OutcomeCounts | None = None
        if mask_prompt:
            labelled = label_batch(array, markers, data_mask=data_mask)
            self.counts = labelled.counts
            try:
                check_drop_fraction(labelled.counts, max_drop_fraction=max_drop_fraction)
            except TooManyDroppedRows as exc:
                raise TooManyDroppedRows(f"{name}: {exc}", exc.counts) from None
            if drop_untrained and not labelled.keep.all():
                array = array.filter(pa.array(labelled.keep))
        rows = batches.rows_from_arrow(array)
        lengths = rows.lengths.astype(np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.values = _compact(rows, lengths).astype(np.int32)
        self.lengths = lengths

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def __getitem__(self, index: int) -> tuple[list[int], int]:
        return self.values[self.offsets[index] : self.offsets[index + 1]].tolist(), 0

    def itemlen(self, index: int) -> int:
        return int(self.lengths[index])

    def __repr__(self) -> str:
        return f"MaskedDataset({self.name!r}, rows={len(self)}, mask_prompt={self.mask_prompt})"


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
        raise ValueError(f"{path} has no rows; remove the file or put one JSON object per line in it")
    return rows


def tokenize_rows(rows: Sequence[dict], tokenizer: Any, *, features: Features = Features(), mask_prompt: bool = True,
                  name: str = "rows"):
    """Token ids (a LargeList array) of rows of one shape, as mlx-lm renders them, and that shape."""
    ids, shape, _ = _tokenize_rows(rows, tokenizer, features=features, mask_prompt=mask_prompt, name=name)
    return ids, shape


def _tokenize_rows(rows, tokenizer, *, features, mask_prompt, name, special_tokens_in_content: str = "text"):
    """``tokenize_rows`` plus, for chat and completion rows, which tokens are message text (``in_content``)."""
    from .tokenizer import load_tokenizer

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
    ct = load_tokenizer(tokenizer)
    if first == "text":
        if mask_prompt:
            raise ValueError(
                f"{name} holds text rows ({features.text!r}), which have no prompt/response structure to mask; "
                "pass mask_prompt=False to train on every token, or write the rows as chat 'messages'"
            )
        texts = [row[features.text] for row in rows]
        encoded = ct.encode_texts(texts)
        eos = ct.eos_token_id
        if eos is not None:  # mlx-lm appends EOS to text rows that lack it
            ids = [r if (r and r[-1] == eos) else r + [eos] for r in encoded.to_pylist()]
            encoded = pa.array(ids, type=pa.large_list(pa.int32()))
        return encoded, first, None
    if first == "completions":
        conversations = [
            {"messages": [{"role": "user", "content": row[features.prompt]},
                          {"role": "assistant", "content": row[features.completion]}],
             "tools": row.get(features.tools)}
            for row in rows
        ]
    else:
        conversations = [{"messages": row[features.chat], "tools": row.get(features.tools)} for row in rows]
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
    return encoded.input_ids, first, encoded.in_content


def load_dataset(
    data: str | Path,
    tokenizer: Any,
    *,
    markers: Markers | None = None,
    mask_prompt: bool = True,
    drop_untrained: bool = True,
    max_drop_fraction: float = DEFAULT_MAX_DROP_FRACTION,
    prompt_feature: str = "prompt",
    completion_feature: str = "completion",
    chat_feature: str = "messages",
    text_feature: str = "text",
    special_tokens_in_content: str = "text",
) -> tuple[MaskedDataset | list, MaskedDataset | list, MaskedDataset | list]:
    """``(train, valid, test)`` from an mlx-lm data folder (``train.jsonl``, optional ``valid.jsonl`` / ``test.jsonl``).

    A missing split is ``[]``, as in mlx-lm. ``markers`` default to ``lossmask.detect_markers(tokenizer)``
    (only needed when ``mask_prompt``). Message text is data: special-token strings in it are encoded
    as text (``special_tokens_in_content``, as in ``lossmask.MaskOptions``) and no marker can match
    inside it.
    """
    folder = Path(data)
    if not folder.is_dir():
        raise ValueError(f"data={str(data)!r} is not a folder; pass a folder holding train.jsonl (and valid.jsonl, test.jsonl)")
    if not (folder / "train.jsonl").is_file():
        raise ValueError(f"{folder} has no train.jsonl; mlx-lm data folders hold train.jsonl, valid.jsonl and test.jsonl")
    features = Features(prompt=prompt_feature, completion=completion_feature, chat=chat_feature, text=text_feature)
    if mask_prompt and markers is None:
        from .detect import detect_markers

        markers = detect_markers(tokenizer)
    out = []
    for split in SPLITS:
        path = folder / f"{split}.jsonl"
        if not path.is_file():
            out.append([])
            continue
        ids, _, in_content = _tokenize_rows(read_jsonl(path), tokenizer, features=features, mask_prompt=mask_prompt,
                                            name=str(path), special_tokens_in_content=special_tokens_in_content)
        out.append(MaskedDataset(ids, markers, mask_prompt=mask_prompt, drop_untrained=drop_untrained,
                                 max_drop_fraction=max_drop_fraction, name=str(path), data_mask=in_content))
    return tuple(out)  # type: ignore[return-value]


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
    the groups come in random order (``seed``); ``loop=False`` stops after one pass. Rows longer
    than ``max_seq_length`` are cut there (and labelled as cut). ``trained`` comes from the MLX
    engine on the batch itself.
    """
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
    rng = np.random.default_rng(seed)
    while True:
        for g in rng.permutation(len(groups)):
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
    if dataset.mask_prompt:
        trained = mlx_kernel.trained_padded(tokens, lengths_mx, dataset.markers)
    else:
        trained = mx.arange(width)[None, :] < lengths_mx[:, None]
    return tokens, trained, lengths_mx


def make_loss(*, prompt_loss_weight: float = 0.0):
    """A loss ``(model, tokens, trained, lengths) -> (loss, n)`` for mlx-lm's ``train`` / ``evaluate``.

    The mean next-token cross-entropy over trained targets; with ``prompt_loss_weight`` = w > 0, the
    other real targets (prompt, system, tool output) count with weight w and ``n`` is the weight sum.
    Padding targets never count.
    """
    if isinstance(prompt_loss_weight, bool) or not isinstance(prompt_loss_weight, (int, float)) or not (
        0.0 <= prompt_loss_weight <= 1.0
    ):
        raise ValueError(f"prompt_loss_weight={prompt_loss_weight!r}; pass a float in [0, 1] (0 drops prompt tokens)")
    weight = float(prompt_loss_weight)

    def loss(model, tokens, trained, lengths):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        logits = model(inputs)
        target_trained = trained[:, 1:]
        if weight == 0.0:
            weights = target_trained.astype(mx.float32)
            n = target_trained.sum()
        else:
            real = mx.arange(1, tokens.shape[1])[None, :] < lengths[:, None]
            weights = mx.where(target_trained, 1.0, mx.where(real, weight, 0.0)).astype(mx.float32)
            n = weights.sum()
        ce = nn.losses.cross_entropy(logits, targets) * weights
        return ce.astype(mx.float32).sum() / mx.maximum(n, 1), n

    return loss


masked_loss = make_loss()
