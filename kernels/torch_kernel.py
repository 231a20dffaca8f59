"""The torch engine: SPEC.md as a few whole-tensor operations, on whatever device the tokens live.

Equal to ``reference.py`` bit for bit. There is no loop over rows or tokens, only over the
patterns. The tokens are one flat buffer cut into *segments* (rows, or the sequences of a packed
row), given as a segment id per position; positions outside every segment (padding) take part in
nothing. For each pattern, shifted comparisons give its match starts, kept where the whole match
lies in one segment (again a shifted comparison, of the segment ids: no gathers). Matches become
OPEN / CLOSE / mask_out events at absolute positions, and "the latest event at or before ``i``" of
SPEC.md is one running maximum (``cummax``) over the whole buffer, with an open at ``p`` coded
``2p`` and a close ``2p + 1`` so that a tie is masked. A CLOSE at every segment's first position
cuts off the events of the segments before it; an event one past a segment's last token (a
response header that ends the row) is left out of the running maximum and counts only for "a
response pattern occurs" and ``max(OPEN)``, which are per-segment reductions (``scatter``).

Three entry points:

- ``label_rows``: the kernel contract of ``lossmask.engine.kernels`` (NumPy in and out, on the CPU);
- ``label_padded``: a ``[B, T]`` tensor with ``lengths`` or an ``attention_mask`` (right or left
  padding), on the tensor's device: what the collator calls;
- ``label_segments``: a flat tensor cut by ``cu_seq_lens``, for padding-free and packed batches.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from ..outcomes import Outcome
from ..patterns import END, INSTRUCTION, MASK_OUT, RESPONSE, Markers


@dataclass(frozen=True)
class SegmentLabels:
    """What one pass over a flat buffer found: a decision per position and counts per segment."""

    trained: torch.Tensor  # bool [N]; False outside every segment
    inside: torch.Tensor  # bool [N]; is the position in a segment?
    trained_tokens: torch.Tensor  # int64 [S]
    has_response: torch.Tensor  # bool [S]
    first_bad: torch.Tensor  # int64 [S]: position of the segment's first negative id, or -1


def _patterns(markers: Markers) -> list[tuple[int, tuple[int, ...]]]:
    c = markers.compiled()
    offsets = c.offsets.tolist()
    tokens = c.tokens.tolist()
    return [(int(c.kinds[k]), tuple(tokens[offsets[k] : offsets[k + 1]])) for k in range(len(c.kinds))]


def _match_starts(values: torch.Tensor, pattern: tuple[int, ...]) -> torch.Tensor:
    """Bool [N]: does ``pattern`` start at ``s`` (segments not yet considered)?"""
    n, length = values.shape[0], len(pattern)
    found = torch.zeros(n, dtype=torch.bool, device=values.device)
    if length > n:
        return found
    width = n - length + 1
    window = values[:width] == pattern[0]
    for k in range(1, length):
        window &= values[k : k + width] == pattern[k]
    found[:width] = window
    return found


def _same_segment_ahead(seg: torch.Tensor, inside: torch.Tensor, by: int) -> torch.Tensor:
    """Bool [N]: is ``s`` in a segment that also holds ``s + by``? (Segments are contiguous runs of one id.)"""
    n = seg.shape[0]
    out = torch.zeros(n, dtype=torch.bool, device=seg.device)
    if by < n:
        out[: n - by] = seg[by:] == seg[: n - by]
    return out & inside


def _shift_right(marks: torch.Tensor, by: int) -> torch.Tensor:
    """``out[i] = marks[i - by]`` (False where ``i < by``)."""
    out = torch.zeros_like(marks)
    if by < marks.shape[0]:
        out[by:] = marks[: marks.shape[0] - by]
    return out


def label_flat(values: torch.Tensor, seg: torch.Tensor, n_segs: int, markers: Markers, *,
               last_turn_only: bool = False) -> SegmentLabels:
    """The engine on a flat buffer: ``seg[i]`` (int64) is the segment of position ``i``, ``n_segs`` for none.

    Each segment must be one contiguous run of positions; segments need not be sorted or adjacent.
    No gathers: "inside one segment" is a shifted comparison of ``seg``, and a CLOSE event at every
    segment's first position cuts off the events of whatever lies before it.
    """
    device = values.device
    n = values.shape[0]
    pos = torch.arange(n, device=device, dtype=torch.int64)
    inside = seg < n_segs
    first = inside.clone()
    if n > 1:
        first[1:] &= seg[1:] != seg[:-1]
    minus_one = torch.full((n,), -1, dtype=torch.int64, device=device)

    open_mark = torch.zeros(n, dtype=torch.bool, device=device)
    close_mark = first.clone()
    response_at = torch.zeros(n, dtype=torch.bool, device=device)
    last_open = minus_one  # per start s: s + len(P) of the longest response P matching there
    cover = minus_one  # per start s: end of a mask_out match starting at s
    fits_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for kind, pattern in _patterns(markers):
        length = len(pattern)
        if length not in fits_cache:  # the match lies in one segment / the position after it too
            fits_cache[length] = (_same_segment_ahead(seg, inside, length - 1), _same_segment_ahead(seg, inside, length))
        fits, ends_before_hi = fits_cache[length]
        found = _match_starts(values, pattern) & fits
        if kind == RESPONSE:
            open_mark |= _shift_right(found & ends_before_hi, length)
            close_mark |= found
            response_at |= found
            if last_turn_only:
                last_open = torch.where(found, torch.maximum(last_open, pos + length), last_open)
        elif kind == INSTRUCTION:
            close_mark |= found
        elif kind == END:
            close_mark |= _shift_right(found & ends_before_hi, length)
        elif kind == MASK_OUT:
            cover = torch.where(found, torch.maximum(cover, pos + length), cover)

    # One running maximum over both kinds of event: an open at p is 2p, a close at p is 2p + 1, so
    # the latest event wins and a close beats an open at the same position (a tie is masked).
    events = torch.where(close_mark, 2 * pos + 1, torch.where(open_mark, 2 * pos, minus_one))
    latest = torch.cummax(events, dim=0).values
    trained = inside & (latest >= 0) & (latest % 2 == 0)
    if markers.mask_out:
        trained &= torch.cummax(cover, dim=0).values <= pos
    if last_turn_only:
        row_last = torch.full((n_segs + 1,), -1, dtype=torch.int64, device=device)
        row_last.scatter_reduce_(0, seg, last_open, reduce="amax")
        trained &= latest // 2 == row_last[seg]

    trained_tokens = torch.zeros(n_segs + 1, dtype=torch.int64, device=device)
    trained_tokens.scatter_add_(0, seg, trained.to(torch.int64))
    responses = torch.zeros(n_segs + 1, dtype=torch.int64, device=device)
    responses.scatter_add_(0, seg, response_at.to(torch.int64))
    bad = torch.full((n_segs + 1,), n, dtype=torch.int64, device=device)
    bad.scatter_reduce_(0, seg, torch.where(values < 0, pos, n), reduce="amin")
    first_bad = torch.where(bad < n, bad, -1)
    return SegmentLabels(trained, inside, trained_tokens[:n_segs], responses[:n_segs] > 0, first_bad[:n_segs])


def segments_of(n: int, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``seg`` for ``label_flat`` from sorted, non-overlapping ``[starts[g], ends[g])`` over ``n`` positions."""
    pos = torch.arange(n, device=starts.device, dtype=torch.int64)
    n_segs = starts.shape[0]
    if n_segs == 0:
        return torch.zeros(n, dtype=torch.int64, device=starts.device)
    seg = torch.searchsorted(starts, pos, right=True) - 1
    inside = (seg >= 0) & (pos < ends[seg.clamp(min=0)])
    return torch.where(inside, seg, n_segs)


def outcomes_of(lengths: torch.Tensor, result: SegmentLabels) -> torch.Tensor:
    """``Outcome`` codes per segment (int8)."""
    codes = torch.where(result.has_response, int(Outcome.EMPTY_RESPONSE), int(Outcome.NO_RESPONSE))
    codes = torch.where(result.trained_tokens > 0, int(Outcome.TRAINED), codes)
    codes = torch.where(lengths == 0, int(Outcome.EMPTY), codes)
    return codes.to(torch.int8)


def label_segments(
    values: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    markers: Markers,
    *,
    last_turn_only: bool = False,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Labels for a flat ``values`` [N] cut into sequences by ``cu_seq_lens`` ([S + 1], from 0), on its device.

    Positions past ``cu_seq_lens[-1]`` (padding) get ``ignore_index``. Returns int64 [N].
    """
    if values.ndim != 1:
        raise ValueError(f"values must be 1-D (a flattened batch), got shape {tuple(values.shape)}; flatten it first")
    cu = cu_seq_lens.to(device=values.device, dtype=torch.int64)
    starts, ends = cu[:-1], cu[1:]
    result = label_flat(values, segments_of(values.shape[0], starts, ends), starts.shape[0], markers,
                        last_turn_only=last_turn_only)
    return torch.where(result.trained, values.to(torch.int64), ignore_index)


def padded_bounds(
    input_ids: torch.Tensor, *, lengths: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
    padding_side: str = "right",
) -> tuple[torch.Tensor, torch.Tensor]:
    """First and one-past-last real position of each row of a ``[B, T]`` batch (int64 [B] each)."""
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, width], got shape {tuple(input_ids.shape)}")
    batch, width = input_ids.shape
    if (lengths is None) == (attention_mask is None):
        raise TypeError("pass exactly one of lengths= (real tokens per row) or attention_mask= (1 on real tokens)")
    if attention_mask is not None:
        if tuple(attention_mask.shape) != (batch, width):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected {(batch, width)}")
        mask = attention_mask.to(device=input_ids.device).bool()
        lengths = mask.sum(dim=1)
        # the first real position: right padding starts at 0, left padding ends at the width
        lo = torch.where(lengths > 0, mask.to(torch.int32).argmax(dim=1), 0).to(torch.int64)
        span = torch.arange(width, device=input_ids.device)
        expected = (span >= lo[:, None]) & (span < (lo + lengths)[:, None])
        if not torch.equal(expected, mask):
            raise ValueError(
                "attention_mask has holes (a row's real tokens are not one contiguous run); lossmask labels "
                "one sequence per row: pass packed rows through the collator with seq_lengths, or cu_seq_lens "
                "to label_segments"
            )
        return lo, lo + lengths.to(torch.int64)
    lengths = torch.as_tensor(lengths, device=input_ids.device).to(torch.int64)
    if tuple(lengths.shape) != (batch,):
        raise ValueError(f"lengths must hold {batch} values (one per row), got shape {tuple(lengths.shape)}")
    if bool(((lengths < 0) | (lengths > width)).any()):
        r = int(torch.nonzero((lengths < 0) | (lengths > width))[0, 0])
        raise ValueError(f"lengths[{r}] = {int(lengths[r])} is outside [0, {width}], the width of input_ids")
    if padding_side == "right":
        return torch.zeros_like(lengths), lengths
    if padding_side == "left":
        return width - lengths, torch.full_like(lengths, width)
    raise ValueError(f"padding_side={padding_side!r}; pass 'right' or 'left'")


def label_padded(
    input_ids: torch.Tensor,
    markers: Markers,
    *,
    lengths: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    padding_side: str = "right",
    last_turn_only: bool = False,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Labels (int64 ``[B, T]``) for a padded batch, computed on ``input_ids.device``.

    Real tokens are told from padding by position, from ``lengths`` (with ``padding_side``) or from
    ``attention_mask``, never by the pad id: a pad id equal to EOS leaves the real EOS trained.
    """
    if not isinstance(markers, Markers):
        raise TypeError(f"markers must be a lossmask.Markers, got {type(markers).__name__}")
    lo, hi = padded_bounds(input_ids, lengths=lengths, attention_mask=attention_mask, padding_side=padding_side)
    batch, width = input_ids.shape
    values = input_ids.reshape(-1)
    col = torch.arange(width, device=input_ids.device, dtype=torch.int64)[None, :]
    row = torch.arange(batch, device=input_ids.device, dtype=torch.int64)[:, None]
    seg = torch.where((col >= lo[:, None]) & (col < hi[:, None]), row, batch).reshape(-1)
    result = label_flat(values, seg, batch, markers, last_turn_only=last_turn_only)
    first_bad = result.first_bad
    if bool((first_bad >= 0).any()):
        r = int(torch.nonzero(first_bad >= 0)[0, 0])
        index = int(first_bad[r])
        raise ValueError(
            f"row {r} holds the negative token id {int(values[index])} at position {index - r * width}; token ids "
            "must be >= 0 (is padding marked with -100? pad with a real id and pass lengths or attention_mask)"
        )
    return torch.where(result.trained, values.to(torch.int64), ignore_index).reshape(batch, width)


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    if array.dtype.kind == "u" and array.dtype.itemsize > 1:  # torch reads few unsigned types
        array = array.astype(np.int64)
    with warnings.catch_warnings():  # Arrow buffers are read-only; they are only read here
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(array))


def label_rows(values, starts, ends, markers: Markers, *, last_turn_only, ignore_index, out, write_mask):
    """Backend entry point (see ``lossmask.engine.kernels``): one pass over the whole buffer, on the CPU."""
    n_rows = len(starts)
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.maximum(np.asarray(ends, dtype=np.int64), starts)
    lengths = ends - starts
    ordered = n_rows < 2 or bool((starts[1:] >= ends[:-1]).all())
    if ordered:
        index = None
        flat = np.asarray(values)
        pos = np.arange(flat.shape[0], dtype=np.int64)
        seg = np.searchsorted(starts, pos, side="right") - 1
        seg = np.where((seg >= 0) & (pos < ends[np.maximum(seg, 0)]), seg, n_rows) if n_rows else np.zeros_like(pos)
    else:  # rows out of order or overlapping: label a compact copy, then write back
        cu = np.concatenate([[0], np.cumsum(lengths)])
        index = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1] - starts, lengths)
        flat = np.asarray(values)[index]
        seg = np.repeat(np.arange(n_rows, dtype=np.int64), lengths)
    flat_t = _as_tensor(flat)
    result = label_flat(flat_t, torch.from_numpy(seg), n_rows, markers, last_turn_only=bool(last_turn_only))
    first_bad = result.first_bad.numpy()
    if index is not None:
        first_bad = np.where(first_bad >= 0, index[np.maximum(first_bad, 0)], -1)
    if write_mask:
        labels = result.trained
    else:
        labels = torch.where(result.trained, flat_t.to(torch.int64), ignore_index)
    labels = labels.numpy().astype(out.dtype, copy=False)
    if index is not None:
        out[index] = labels
    else:
        np.copyto(out, labels, where=result.inside.numpy())
    outcomes = outcomes_of(torch.from_numpy(lengths), result).numpy()
    return result.trained_tokens.numpy(), outcomes, first_bad
