"""A collator for TRL's ``SFTTrainer`` and ``transformers.Trainer`` that labels each batch with the engine.

``CompletionCollator`` takes tokenised rows (``{"input_ids": [...]}``, optionally ``"seq_lengths"``
for packed rows and ``"labels"``), pads them, and builds labels per SPEC.md with the torch backend on
the batch's device. Padding is told by position, never by the pad id (a pad id equal to EOS leaves the
real EOS trained). Padding-free batches are one flattened row with ``position_ids`` and
``cu_seq_lens_*`` as TRL builds them, labels masked at every sequence start.

Rows may carry their own ``loss_weights`` (a float per token, as ``lossmask mask`` writes them with
weights); the collator pads them with 0 and lays them out as ``input_ids`` (padding-free included).
``prompt_loss_weight`` > 0 gives rows without them 1 on trained tokens and the weight on the other
real tokens. Either way the batch gets a ``loss_weights`` tensor; ``weighted_cross_entropy`` is the
matching loss (sum(w * nll) / sum(w), or per sequence), ``WeightedLoss`` passes it as a trainer's
``compute_loss_func`` and ``WeightedLossMixin`` builds it into a trainer
(``class T(WeightedLossMixin, SFTTrainer)``). docs/weighted-loss.md has the account.

Importing this module imports torch; ``import lossmask`` does not import this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import numpy as np
import torch

from .engine import buffers, get_backend
from .engine.patterns import Markers

torch_kernel = get_backend("torch")


@dataclass(frozen=True, kw_only=True)
class CompletionCollator:
    """Pads tokenised rows and labels them per SPEC.md; a drop-in ``data_collator`` for TRL / transformers.

    - ``padding_side``: ``"right"`` or ``"left"`` (ignored when ``padding_free``).
    - ``padding_free``: flatten the batch into one row with ``position_ids`` and ``cu_seq_lens_q/k``,
      ``max_length_q/k`` and ``seq_idx``, as TRL's own collator does (use it with flash attention).
    - ``row_labels``: ``"rebuild"`` (default) labels every row here, ignoring a ``labels`` field (TRL's
      dataset preparation fills one with a copy of ``input_ids``); ``"keep"`` uses the rows' own labels, or, for
      rows written without them (``labels_column=None``), their ``completion_mask``.
    - ``prompt_loss_weight``: 0 drops prompt tokens from the loss; > 0 adds ``loss_weights`` for
      ``weighted_cross_entropy`` / ``WeightedLoss`` / ``WeightedLossMixin`` (rows without their own).

    Rows that carry ``loss_weights`` (one float >= 0 per token of ``input_ids``) keep them: padded with
    0, laid out as the tokens (padding-free too), cut as TRL cut ``input_ids`` when they are longer
    (``truncation_mode``), and their labels follow them (the id where the weight is > 0, ``ignore_index``
    where it is 0), whatever ``row_labels`` says. In a batch mixing rows with and without them, the
    others get 1 on trained tokens and ``prompt_loss_weight`` on their other real tokens. Every
    sequence's first token has weight 0 (nothing predicts it).
    - ``device``: where to build the batch and its labels (``"cuda"``); ``None`` keeps it on the CPU and
      lets the trainer move it. With ``"cuda"`` use ``dataloader_num_workers=0`` and
      ``dataloader_pin_memory=False`` (only CPU tensors can be pinned).

    - ``pad_token_id``: the id written at padding positions. Padding is told by position, so any id is
      safe (a pad equal to EOS never masks the real EOS); ``None`` takes ``tokenizer``'s pad id, else its
      EOS (as TRL does for tokenizers without a pad token, e.g. Llama 3), else 0.
    - ``truncation_mode``: how rows were cut when their ``seq_lengths`` add up to more than their tokens
      (``SFTConfig(max_length=...)`` shorter than rows packed beforehand: TRL cuts ``input_ids``, not
      ``seq_lengths``): ``"keep_start"`` (TRL's default) or ``"keep_end"``, as ``SFTConfig.truncation_mode``.

    Rows packed by TRL carry ``seq_lengths``; each packed sequence is labelled on its own.

    Rows arrive as token ids, so the collator cannot tell message text from the template's markup:
    a marker's text inside a message (``[/INST]`` typed by a user on Llama-2, a quoted ``<|im_end|>``
    tokenised as the control token) acts as the marker here. Rows labelled by ``lossmask.mask_files``
    or ``lossmask.hf.mask_dataset`` from messages keep message text inert; use them with
    ``row_labels="keep"``.
    """

    markers: Markers
    pad_token_id: int | None = None
    tokenizer: Any = field(default=None, repr=False, compare=False)
    padding_side: Literal["right", "left"] = "right"
    padding_free: bool = False
    pad_to_multiple_of: int | None = None
    return_position_ids: bool = False
    last_turn_only: bool = False
    row_labels: Literal["rebuild", "keep"] = "rebuild"
    prompt_loss_weight: float = 0.0
    ignore_index: int = -100
    truncation_mode: Literal["keep_start", "keep_end"] = "keep_start"
    device: str | torch.device | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.markers, Markers):
            raise TypeError(
                f"markers must be a lossmask.Markers, got {type(self.markers).__name__}; "
                "build one with Markers(response=[[...]], ...) or Markers.from_json(path)"
            )
        if self.pad_token_id is None:
            object.__setattr__(self, "pad_token_id", pad_id_of(self.tokenizer))
        if isinstance(self.pad_token_id, bool) or not isinstance(self.pad_token_id, (int, np.integer)) or self.pad_token_id < 0:
            raise ValueError(f"pad_token_id={self.pad_token_id!r}; pass an int >= 0, or tokenizer= (its pad id, else its EOS)")
        if self.truncation_mode not in ("keep_start", "keep_end"):
            raise ValueError(f"truncation_mode={self.truncation_mode!r}; pass 'keep_start' or 'keep_end' (SFTConfig.truncation_mode)")
        if self.padding_side not in ("right", "left"):
            raise ValueError(f"padding_side={self.padding_side!r}; pass 'right' or 'left'")
        if self.row_labels not in ("rebuild", "keep"):
            raise ValueError(f"row_labels={self.row_labels!r}; pass 'rebuild' (label here) or 'keep' (use the rows' labels)")
        if self.pad_to_multiple_of is not None and (not isinstance(self.pad_to_multiple_of, int) or self.pad_to_multiple_of < 1):
            raise ValueError(f"pad_to_multiple_of={self.pad_to_multiple_of!r}; pass a positive int or None")
        if not isinstance(self.prompt_loss_weight, (int, float)) or not 0.0 <= self.prompt_loss_weight <= 1.0:
            raise ValueError(f"prompt_loss_weight={self.prompt_loss_weight!r}; pass a float in [0, 1] (0 drops prompt tokens)")

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        if len(examples) == 0:
            raise ValueError("the collator got an empty batch; pass at least one row")
        layout = _Layout.build(examples, padding_free=self.padding_free, padding_side=self.padding_side,
                               pad_to_multiple_of=self.pad_to_multiple_of, truncation_mode=self.truncation_mode)
        device = torch.device(self.device) if self.device is not None else torch.device("cpu")
        size = layout.n_rows * layout.width
        n_seqs = layout.seq_starts.shape[0]
        negative = np.flatnonzero(layout.values < 0)
        if negative.size:
            r = int(np.searchsorted(layout.row_offsets, negative[0], side="right") - 1)
            raise ValueError(
                f"row {r} holds the negative token id {int(layout.values[negative[0]])} at position "
                f"{int(negative[0] - layout.row_offsets[r])}; token ids must be >= 0 (already padded with -100? "
                "pass the rows unpadded)"
            )
        # The batch is laid out on the host with NumPy (no per-row Python), then labelled in torch on
        # `device` without a host sync: every index the labelling needs is known here.
        ids_np = np.full(size, self.pad_token_id, dtype=np.int64)
        ids_np[layout.flatpos] = layout.values
        seg_np = np.full(size, n_seqs, dtype=np.int64)
        seg_np[layout.flatpos] = np.repeat(np.arange(n_seqs, dtype=np.int64), layout.seq_ends - layout.seq_starts)
        seq_first_np = layout.seq_starts[layout.seq_ends > layout.seq_starts]
        ids = torch.from_numpy(ids_np).to(device)
        given = _row_weights(examples, layout, self.truncation_mode)
        if given is not None and given.has.all():
            # every row brings its weights, and labels follow them: no marker labelling to do
            weights_np = np.zeros(size, dtype=np.float32)
            weights_np[layout.flatpos] = given.values
            weights_np[seq_first_np] = 0.0  # nothing before a sequence start predicts it
            real_np = np.zeros(size, dtype=bool)
            real_np[layout.flatpos] = True
            labels = torch.from_numpy(np.where(weights_np > 0, ids_np, self.ignore_index)).to(device)
            weights, real = torch.from_numpy(weights_np).to(device), torch.from_numpy(real_np).to(device)
        else:
            labels, real = self._marker_labels(examples, layout, ids, seg_np, n_seqs, size, device)
            weights = None
            if given is not None:  # some rows bring weights: theirs, and labels following them
                row_weights_np = np.zeros(size, dtype=np.float32)
                row_weights_np[layout.flatpos] = given.values
                has_np = np.zeros(size, dtype=bool)
                has_np[layout.flatpos] = given.has
                row_weights, has = torch.from_numpy(row_weights_np).to(device), torch.from_numpy(has_np).to(device)
                labels = torch.where(has, torch.where(row_weights > 0, ids, self.ignore_index), labels)
            seq_first = torch.from_numpy(seq_first_np).to(device)
            labels[seq_first] = self.ignore_index  # nothing before a sequence start predicts it (TRL does the same)
            if self.prompt_loss_weight > 0 or given is not None:
                weights = torch.where(labels != self.ignore_index, 1.0, torch.where(real, float(self.prompt_loss_weight), 0.0))
                if given is not None:
                    weights = torch.where(has, row_weights, weights)
                weights[seq_first] = 0.0

        shape = (layout.n_rows, layout.width)
        out: dict[str, Any] = {"input_ids": ids.reshape(shape), "labels": labels.reshape(shape)}
        if self.padding_free or self.return_position_ids:
            position_ids = np.zeros(size, dtype=np.int64)
            position_ids[layout.flatpos] = layout.position_in_seq
            out["position_ids"] = torch.from_numpy(position_ids).to(device).reshape(shape)
        if self.padding_free:
            # as TRL: every position 0 starts a sequence, tail padding included (each pad its own sequence)
            cu = np.append(np.flatnonzero(position_ids == 0), size).astype(np.int32)
            lengths = np.diff(cu)
            out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = torch.from_numpy(cu).to(device)
            out["max_length_q"] = out["max_length_k"] = int(lengths.max(initial=0))
            seq_idx = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
            out["seq_idx"] = torch.from_numpy(seq_idx).to(device)[None]
        else:
            out["attention_mask"] = real.to(torch.int64).reshape(shape)
        if weights is not None:
            out["loss_weights"] = weights.to(torch.float32).reshape(shape)
        return out

    def _marker_labels(self, examples, layout: "_Layout", ids, seg_np, n_seqs: int, size: int, device):
        """Labels from the markers (or the rows' own, with ``row_labels="keep"``) and the real-token mask."""
        result = torch_kernel.label_flat(ids, torch.from_numpy(seg_np).to(device), n_seqs, self.markers,
                                         last_turn_only=self.last_turn_only)
        labels = torch.where(result.trained, ids, self.ignore_index)
        if self.row_labels == "keep":
            given = _row_labels(examples, layout, self.ignore_index)
            if given is not None:
                kept = np.full(size, self.ignore_index, dtype=np.int64)
                kept[layout.flatpos] = given
                labels = torch.from_numpy(kept).to(device)
        return labels, result.inside


@dataclass(frozen=True)
class _Layout:
    """Where every real token of a batch goes in the flat ``[n_rows * width]`` buffer, and its sequences."""

    values: np.ndarray  # tokens, rows back to back
    flatpos: np.ndarray  # int64, position of each token in the flat buffer
    n_rows: int
    width: int
    seq_starts: np.ndarray  # int64 flat bounds of every sequence (a packed row holds several)
    seq_ends: np.ndarray
    seq_row: np.ndarray  # the example each sequence comes from
    position_in_seq: np.ndarray  # int64, per token
    row_offsets: np.ndarray  # int64 [n_examples + 1], tokens per example, cumulated

    @classmethod
    def build(cls, examples, *, padding_free: bool, padding_side: str, pad_to_multiple_of: int | None,
              truncation_mode: str = "keep_start") -> "_Layout":
        try:
            ids = [example["input_ids"] for example in examples]
        except (KeyError, TypeError):
            raise TypeError("each row must be a dict with an 'input_ids' list of token ids (tokenise first)") from None
        if isinstance(ids[0], torch.Tensor):  # a dataset formatted as torch
            ids = [row.cpu().numpy() if isinstance(row, torch.Tensor) else row for row in ids]
        rows = buffers.rows_from_arrow(buffers.rows_from_pylist(ids))
        values, row_starts = rows.values, rows.starts.astype(np.int64)
        lengths = rows.lengths.astype(np.int64)
        n_examples, total = len(ids), int(lengths.sum())
        row_offsets = np.concatenate([[0], np.cumsum(lengths)])
        seq_lengths, seq_row = _sequence_lengths(examples, lengths, truncation_mode)

        if padding_free:
            n_rows, width = 1, _round_up(total, pad_to_multiple_of)
            flatpos = np.arange(total, dtype=np.int64)
        else:
            n_rows, width = n_examples, _round_up(int(lengths.max(initial=0)), pad_to_multiple_of)
            token_row = np.repeat(np.arange(n_examples, dtype=np.int64), lengths)
            col = np.arange(total, dtype=np.int64) - np.repeat(row_starts - row_starts[0], lengths)
            if padding_side == "left":
                col += (width - lengths)[token_row]
            flatpos = token_row * width + col
        seq_cu = np.concatenate([[0], np.cumsum(seq_lengths)])
        flat_ext = np.append(flatpos, n_rows * width)
        seq_starts = flat_ext[seq_cu[:-1]]
        position_in_seq = np.arange(total, dtype=np.int64) - np.repeat(seq_cu[:-1], seq_lengths)
        return cls(
            values=np.ascontiguousarray(values[row_starts[0] : row_starts[0] + total]) if n_examples else values,
            flatpos=flatpos, n_rows=n_rows, width=width, seq_starts=seq_starts, seq_ends=seq_starts + seq_lengths,
            seq_row=seq_row, position_in_seq=position_in_seq, row_offsets=row_offsets,
        )


def _round_up(n: int, multiple: int | None) -> int:
    n = max(n, 1)
    return n if multiple is None else -(-n // multiple) * multiple


def _sequence_lengths(examples, lengths: np.ndarray, truncation_mode: str = "keep_start") -> tuple[np.ndarray, np.ndarray]:
    """Lengths of the sequences packed in each row (one per row when rows carry no ``seq_lengths``).

    Rows cut after packing (``seq_lengths`` adding up to more than the row) have their ``seq_lengths``
    cut the same way: from the end (``keep_start``) or from the start (``keep_end``).
    """
    if "seq_lengths" not in examples[0]:
        return lengths, np.arange(len(lengths))
    try:
        packed = buffers.rows_from_arrow(buffers.rows_from_pylist([example["seq_lengths"] for example in examples]))
    except KeyError:
        raise ValueError("some rows carry 'seq_lengths' and some do not; pack all rows of a dataset or none") from None
    seq_lengths = packed.values[packed.starts[0] : packed.starts[0] + int(packed.lengths.sum())].astype(np.int64) if len(
        packed) else np.zeros(0, np.int64)
    seq_row = np.repeat(np.arange(len(lengths)), packed.lengths)
    if (seq_lengths < 0).any():
        r = int(seq_row[np.argmax(seq_lengths < 0)])
        raise ValueError(f"row {r}: seq_lengths holds a negative length; seq_lengths must split input_ids exactly "
                         "(as TRL's pack_dataset writes them)")
    per_row = np.zeros(len(lengths), dtype=np.int64)
    np.add.at(per_row, seq_row, seq_lengths)
    short = np.flatnonzero(per_row < lengths)
    if short.size:
        r = int(short[0])
        raise ValueError(
            f"row {r}: seq_lengths add up to {int(per_row[r])} but the row has {int(lengths[r])} tokens; "
            "seq_lengths must split input_ids exactly (as TRL's pack_dataset writes them)"
        )
    if (per_row > lengths).any():  # truncated after packing: cut each row's sequences to its length
        seq_lengths, seq_row = cut_packed_sequences(seq_lengths, seq_row, per_row, lengths, from_start=truncation_mode == "keep_end")
    return seq_lengths, seq_row


def cut_packed_sequences(seq_lengths, seq_row, per_row, lengths, *, from_start: bool):
    """Sequences of each row clipped to the row's kept tokens; sequences cut away entirely are removed."""
    first = np.concatenate([[0], np.cumsum(per_row)[:-1]])  # where each row's sequences start, before the cut
    begin = np.concatenate([[0], np.cumsum(seq_lengths)[:-1]]) - first[seq_row]  # sequence start within its row
    end = begin + seq_lengths
    lo = (per_row - lengths)[seq_row] if from_start else np.zeros_like(begin)
    hi = lo + lengths[seq_row]
    cut = np.clip(np.minimum(end, hi) - np.maximum(begin, lo), 0, None)
    keep = cut > 0
    return cut[keep], seq_row[keep]


def pad_id_of(tokenizer: Any) -> int:
    """The tokenizer's pad id, else its EOS id, else 0 (padding is told by position: the id never trains)."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)  # a lossmask ChatTokenizer or an mlx-lm wrapper
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tok, name, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


WEIGHTS_COLUMN = "loss_weights"


@dataclass(frozen=True)
class _RowWeights:
    """The rows' own weights, token by token in ``_Layout.values`` order; ``has`` marks rows that carry them."""

    values: np.ndarray  # float32 [total]; 0 where a row carries none
    has: np.ndarray  # bool [total]


def _row_weights(examples, layout: _Layout, truncation_mode: str) -> _RowWeights | None:
    """Each row's ``loss_weights``, checked (finite, >= 0, one per token) and cut as TRL cut its ``input_ids``.

    TRL truncates ``input_ids`` and ``labels`` but leaves other columns whole, so weights longer than
    their row are cut the same way (``keep_start``: the first tokens' weights; ``keep_end``: the last).
    """
    found = [example.get(WEIGHTS_COLUMN) if isinstance(example, dict) else None for example in examples]
    if all(w is None for w in found):
        return None
    found = [w.detach().cpu().numpy() if isinstance(w, torch.Tensor) else w for w in found]
    import pyarrow as pa

    try:
        array = pa.array(found, type=pa.large_list(pa.float32()))
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as exc:
        raise TypeError(f"loss_weights must be lists of floats, one per token of input_ids ({exc})") from None
    has_row = np.asarray(array.is_valid(), dtype=bool)
    offsets = np.asarray(array.offsets, dtype=np.int64)
    given = np.diff(offsets)
    n = np.diff(layout.row_offsets)
    short = np.flatnonzero(has_row & (given < n))
    if short.size:
        r = int(short[0])
        raise ValueError(f"row {r} has {int(given[r])} loss_weights for {int(n[r])} input_ids; "
                         "pass one weight per token (as `lossmask mask` writes them)")
    skip = np.where(has_row & (truncation_mode == "keep_end"), given - n, 0)
    total = int(layout.row_offsets[-1])
    has = np.repeat(has_row, n)
    source = np.repeat(offsets[:-1] + skip, n) + (np.arange(total, dtype=np.int64) - np.repeat(layout.row_offsets[:-1], n))
    flat = np.asarray(array.values.to_numpy(zero_copy_only=False), dtype=np.float32) if len(array.values) else np.zeros(1, np.float32)
    values = np.where(has, flat[np.where(has, source, 0)], np.float32(0.0)).astype(np.float32)
    bad = np.flatnonzero(has & ~(np.isfinite(values) & (values >= 0)))
    if bad.size:
        r = int(np.searchsorted(layout.row_offsets, bad[0], side="right") - 1)
        raise ValueError(f"row {r} holds the loss weight {float(values[bad[0]])} at position "
                         f"{int(bad[0] - layout.row_offsets[r])}; weights must be finite and >= 0 (0 drops the token)")
    return _RowWeights(values=values, has=has)


def _row_labels(examples, layout: _Layout, ignore_index: int = -100) -> np.ndarray | None:
    """The rows' own labels, flat; from ``completion_mask`` (the ids where it is 1) for rows written without labels."""
    key = "labels" if any("labels" in example for example in examples) else "completion_mask"
    has = [key in example for example in examples]
    if not any(has):
        return None
    if not all(has):
        raise ValueError(f"some rows carry {key!r} and some do not; with row_labels='keep' every row needs them")
    given = buffers.rows_from_arrow(buffers.rows_from_pylist([example[key] for example in examples]))
    if not np.array_equal(given.lengths, np.diff(layout.row_offsets)):
        r = int(np.flatnonzero(given.lengths != np.diff(layout.row_offsets))[0])
        raise ValueError(f"row {r} has {int(given.lengths[r])} {key} for {int(np.diff(layout.row_offsets)[r])} input_ids")
    start = int(given.starts[0])
    values = given.values[start : start + int(layout.row_offsets[-1])]
    if key == "labels":
        return values
    return np.where(values != 0, layout.values, ignore_index)


# -- loss -----------------------------------------------------------------------------------------


def weighted_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, loss_weights: torch.Tensor, *,
                           per_sequence: bool = False, position_ids: torch.Tensor | None = None,
                           ignore_index: int = -100, total: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token cross-entropy, each target weighted by its own weight: sum(w * nll) / sum(w).

    ``targets`` are the batch's ``input_ids`` (or its ``labels``: a target at ``ignore_index`` counts 0);
    the target at position ``t + 1`` is predicted from the logits at ``t`` and weighted by
    ``loss_weights[t + 1]`` (the weight of the token predicted). With weight 1 on trained tokens and 0
    elsewhere this is the usual mean over trained tokens.

    ``per_sequence=True``: the mean over sequences of each sequence's weighted mean, so a long answer
    counts as much as a short one; sequences are the rows, or, with ``position_ids`` (packed or
    padding-free batches), the runs that start at each position 0. Sequences with no weight are left out.
    A batch with no weight at all gives 0.

    ``total``: divide by this instead of the batch's own weight sum (per sequence: its count of sequences with
    weight), as ``_window_total`` gives it for a whole accumulated batch: the micro-batches' losses then add up
    to the accumulated batch's weighted mean.
    """
    weights, target = _target_weights(targets, loss_weights, ignore_index)
    flat_logits = logits[..., :-1, :].reshape(-1, logits.shape[-1]).float()
    nll = torch.nn.functional.cross_entropy(flat_logits, torch.where(target == ignore_index, 0, target).reshape(-1),
                                            reduction="none")
    weighted = nll * weights.reshape(-1)
    tiny = torch.finfo(torch.float32).tiny
    if not per_sequence:
        return weighted.sum() / (weights.sum() if total is None else total).clamp(min=tiny)
    mass, sequence = _sequence_mass(target, weights, position_ids)
    summed = torch.zeros(mass.shape[0], device=weights.device).index_add_(0, sequence, weighted)
    live = mass > 0
    return torch.where(live, summed / mass.clamp(min=tiny), 0.0).sum() / (live.sum() if total is None else total).clamp(min=1)


def _target_weights(targets: torch.Tensor, loss_weights: torch.Tensor, ignore_index: int):
    """The weight of each shifted target (0 where the target is ``ignore_index``), and the targets."""
    target = targets[..., 1:]
    weights = loss_weights[..., 1:].to(torch.float32)
    return torch.where(target == ignore_index, 0.0, weights), target


def _sequence_mass(target: torch.Tensor, weights: torch.Tensor, position_ids: torch.Tensor | None):
    """The weight of each sequence (slots past the last one hold 0) and the sequence of each target (flat)."""
    sequence = _target_sequences(target, position_ids).reshape(-1)
    slots = sequence.numel() + 1  # an upper bound on the sequences: no host sync to count them
    return torch.zeros(slots, device=weights.device).index_add_(0, sequence, weights.reshape(-1)), sequence


def _batch_total(batch: Any, *, per_sequence: bool = False, ignore_index: int = -100,
                targets: str = "input_ids") -> torch.Tensor | None:
    """What ``weighted_cross_entropy`` divides one batch's loss by: the weight of its targets, or (per sequence)
    its count of sequences with weight; None for a batch without ``labels``. A batch without ``loss_weights`` weighs
    1 on each trained label (as ``WeightedLoss`` takes it). ``targets``: the batch's ``input_ids`` when their shape
    is the labels' (as the loss takes them), else its labels."""
    weights, labels = batch.get(WEIGHTS_COLUMN), batch.get("labels")
    if labels is None or not torch.is_tensor(labels):
        return None
    ids = batch.get(targets)
    if weights is None:
        weights, target_ids = (labels != ignore_index).to(torch.float32), labels
    else:
        target_ids = ids if ids is not None and ids.shape == labels.shape else labels
    shifted, target = _target_weights(target_ids, weights, ignore_index)
    if not per_sequence:
        return shifted.sum()
    mass, _ = _sequence_mass(target, shifted, batch.get("position_ids"))
    return (mass > 0).sum().to(torch.float32)


def _window_total(trainer: Any, batches: Sequence[Any], device: Any, *, per_sequence: bool = False,
                 ignore_index: int = -100) -> torch.Tensor | None:
    """``_batch_total`` over the micro-batches of one accumulated batch (``Trainer.get_batch_samples`` fetches them
    all before the first forward), over every process under ``average_tokens_across_devices`` (as the Trainer
    counts ``num_items_in_batch``); None when a micro-batch has no weights."""
    totals = [_batch_total(b, per_sequence=per_sequence, ignore_index=ignore_index) for b in batches]
    if not totals or any(t is None for t in totals):
        return None
    total = torch.stack([t.to(device) for t in totals]).sum()
    args = getattr(trainer, "args", None)
    if getattr(args, "average_tokens_across_devices", False) and getattr(args, "world_size", 1) > 1:
        total = trainer.accelerator.gather(total).sum()
    return total


def _watch_windows(trainer: Any, keep: Any) -> None:
    """Wrap ``trainer.get_batch_samples`` so that each accumulated batch's micro-batches go to ``keep(trainer,
    batches, device)`` as they are fetched (it works out their ``_window_total`` with the settings of that moment)."""
    fetch = getattr(trainer, "get_batch_samples", None)
    if not callable(fetch):
        return
    fetch = getattr(fetch, "_lossmask_fetch", fetch)  # attached twice: wrap the trainer's own once

    def get_batch_samples(epoch_iterator, num_batches, device):
        batches, num_items = fetch(epoch_iterator, num_batches, device)
        keep(trainer, batches, device)
        return batches, num_items

    get_batch_samples._lossmask_fetch = fetch
    trainer.get_batch_samples = get_batch_samples


def _target_sequences(target: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """The sequence each shifted target belongs to: its row, or its run of ``position_ids`` (a new one at each 0)."""
    if position_ids is None:
        rows = target.shape[0] if target.dim() > 1 else 1
        return torch.arange(rows, device=target.device).reshape(-1, *([1] * (target.dim() - 1))).expand_as(target)
    starts = (position_ids.reshape(-1) == 0).to(torch.int64)
    return (torch.cumsum(starts, 0) - 1).clamp(min=0).reshape(position_ids.shape)[..., 1:]


def share_of_accumulated_batch(labels: torch.Tensor, num_items_in_batch: Any, ignore_index: int = -100) -> torch.Tensor:
    """This micro-batch's trained targets over ``num_items_in_batch`` (what the Trainer counted over the
    accumulated batch, on every device when ``average_tokens_across_devices``): the factor that turns a
    micro-batch's weighted mean into its part of the accumulated batch's loss."""
    mine = (labels[..., 1:] != ignore_index).sum().to(torch.float32)
    total = torch.as_tensor(num_items_in_batch, device=mine.device).to(torch.float32).reshape(-1)[0]
    return mine / total.clamp(min=1)


def prompt_weighted_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_weights: torch.Tensor) -> torch.Tensor:
    """``weighted_cross_entropy(logits, input_ids, loss_weights)``: the loss that matches the collator's
    ``loss_weights`` (from ``prompt_loss_weight`` or the rows' own weights), over their sum."""
    return weighted_cross_entropy(logits, input_ids, loss_weights)


@dataclass
class WeightedLoss:
    """The weighted loss as a ``Trainer`` / ``SFTTrainer`` ``compute_loss_func``.

        loss = WeightedLoss(per_sequence=False)
        trainer = SFTTrainer(model=model, args=args, train_dataset=ds, data_collator=collator, compute_loss_func=loss)
        loss.attach(trainer)

    transformers calls ``compute_loss_func(outputs, labels, num_items_in_batch=...)``: the batch's other
    inputs never reach it, and the model is called with all of them, ``loss_weights`` included.
    ``attach`` hooks the trainer's model (a forward pre-hook, torch's own API) so that each forward
    hands ``loss_weights``, ``input_ids`` and ``position_ids`` to this loss and the model never sees
    ``loss_weights``; it also keeps the ``loss_weights`` column through ``remove_unused_columns``.
    A batch without ``loss_weights`` gets the usual mean over its labels.

    Gradient accumulation: attached to a trainer, each micro-batch's loss is its weighted sum over the weight
    of the whole accumulated batch (per sequence: over its count of sequences), which ``attach`` reads from
    the trainer's ``get_batch_samples``; the micro-batches then add up to the weighted mean of the accumulated
    batch, exactly. Attached to a model only, with ``num_items_in_batch`` (the trained targets of the
    accumulated batch), each micro-batch's weighted mean counts in proportion to its trained targets.
    """

    per_sequence: bool = False
    ignore_index: int = -100
    _batch: dict = field(default_factory=dict, repr=False, compare=False)
    _window: Any = field(default=None, repr=False, compare=False)

    def attach(self, trainer_or_model: Any) -> "WeightedLoss":
        """Hook the model (a trainer's ``model``, or a model) so that it hands this loss its batch; returns self."""
        model = getattr(trainer_or_model, "model", None) if not isinstance(trainer_or_model, torch.nn.Module) else trainer_or_model
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"attach takes a transformers Trainer or a torch model, got {type(trainer_or_model).__name__}")
        if getattr(model, "_lossmask_weighted_loss_hook", None) is not None:
            model._lossmask_weighted_loss_hook.remove()
        model._lossmask_weighted_loss_hook = model.register_forward_pre_hook(self._take_batch, with_kwargs=True)
        if model is not trainer_or_model:
            keep_weight_columns(trainer_or_model)
            _watch_windows(trainer_or_model, self._keep_window)
        return self

    def _keep_window(self, trainer, batches, device):
        # read per_sequence and ignore_index now, not at attach: a loss switched after it was installed (by
        # train_on_responses_only) divides by the window its own mean needs
        self._window = _window_total(trainer, batches, device, per_sequence=self.per_sequence,
                                     ignore_index=self.ignore_index)

    def _take_batch(self, module, args, kwargs):
        self._batch = {"loss_weights": kwargs.pop(WEIGHTS_COLUMN, None), "input_ids": kwargs.get("input_ids"),
                       "position_ids": kwargs.get("position_ids")}
        return args, kwargs

    def __call__(self, outputs: Any, labels: torch.Tensor | None, num_items_in_batch: Any = None) -> torch.Tensor:
        if labels is None:
            raise ValueError("WeightedLoss got labels=None; the batches need 'labels' (CompletionCollator writes them)")
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
        batch, self._batch = self._batch, {}
        weights, input_ids = batch.get("loss_weights"), batch.get("input_ids")
        if weights is None:
            weights, targets = (labels != self.ignore_index).to(torch.float32), labels
        else:
            targets = input_ids if input_ids is not None and input_ids.shape == labels.shape else labels
        window = self._window if num_items_in_batch is not None else None  # None in evaluation
        loss = weighted_cross_entropy(logits, targets, weights, per_sequence=self.per_sequence,
                                      position_ids=batch.get("position_ids"), ignore_index=self.ignore_index,
                                      total=window)
        if num_items_in_batch is not None and window is None:
            loss = loss * share_of_accumulated_batch(labels, num_items_in_batch, self.ignore_index)
        return loss


def keep_weight_columns(trainer: Any) -> None:
    """Keep ``labels`` and ``loss_weights`` through the Trainer's ``remove_unused_columns`` (it keeps only the
    model's forward arguments, and TRL's ``SFTTrainer`` only ``input_ids``, ``labels`` and ``seq_lengths``)."""
    setup = getattr(trainer, "_set_signature_columns_if_needed", None)
    if callable(setup):
        setup()
    columns = getattr(trainer, "_signature_columns", None)
    if isinstance(columns, list):
        columns.extend(c for c in ("labels", WEIGHTS_COLUMN) if c not in columns)


class WeightedLossMixin:
    """Trainer mixin: when the batch has ``loss_weights`` (the rows' own, or ``CompletionCollator(prompt_loss_weight=...)``),
    the loss is ``weighted_cross_entropy``; otherwise the trainer's own. ``class T(WeightedLossMixin, SFTTrainer)``;
    set ``loss_per_sequence = True`` on the class for the per-sequence mean.

    Gradient accumulation as ``WeightedLoss``: each micro-batch's weighted sum is divided by the weight of the
    whole accumulated batch (per sequence: its count of sequences), read in ``get_batch_samples``, so the
    micro-batches add up to the accumulated batch's weighted mean; without ``num_items_in_batch`` (the Trainer
    counts nothing), the Trainer averages the micro-batches.
    """

    loss_per_sequence: bool = False
    _lossmask_window: Any = None

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._lossmask_window = _window_total(self, batches, device, per_sequence=self.loss_per_sequence)
        return batches, num_items

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        columns = getattr(self, "_signature_columns", None)
        if isinstance(columns, list) and WEIGHTS_COLUMN not in columns:
            columns.append(WEIGHTS_COLUMN)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        weights = inputs.pop(WEIGHTS_COLUMN, None)
        if weights is None:
            return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        forward = {k: v for k, v in inputs.items() if k != "labels"}
        outputs = model(**forward, use_cache=False)
        window = self._lossmask_window if num_items_in_batch is not None and "labels" in inputs else None
        loss = weighted_cross_entropy(outputs.logits, inputs["input_ids"], weights, per_sequence=self.loss_per_sequence,
                                      position_ids=inputs.get("position_ids"), total=window)
        if num_items_in_batch is not None and "labels" in inputs:
            if window is None:
                loss = loss * share_of_accumulated_batch(inputs["labels"], num_items_in_batch)
            args = getattr(self, "args", None)
            if getattr(args, "average_tokens_across_devices", False):  # as Trainer.compute_loss: DDP averages ranks
                loss = loss * getattr(getattr(self, "accelerator", None), "num_processes", 1)
        return (loss, outputs) if return_outputs else loss


PromptWeightedLossMixin = WeightedLossMixin  # the name before per-token weights (prompt_loss_weight only)
