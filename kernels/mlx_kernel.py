"""The MLX engine: the torch engine's array program (see ``torch_kernel.py``) in MLX operations.

Equal to ``reference.py`` bit for bit, compiled with ``mx.compile`` once per set of markers. MLX
recompiles for every new shape, so buffers are padded up to a few widths (``bucket``): positions
added that way lie in no segment and take part in nothing. Array operations only, no custom Metal
kernel, so the same program runs on every MLX device, ``mlx[cpu]`` included.

- ``label_rows``: the kernel contract of ``lossmask.engine.kernels`` (NumPy in and out);
- ``trained_padded``: the decision for a right-padded ``[B, T]`` batch with ``lengths`` (what
  ``lossmask.mlx`` feeds to the loss).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from ..outcomes import Outcome
from ..patterns import END, INSTRUCTION, MASK_OUT, RESPONSE, Markers


def bucket(n: int, *, minimum: int = 64) -> int:
    """``n`` rounded up to one of 8 widths per power of two (at most 12.5% more), and at least ``minimum``."""
    if n <= minimum:
        return minimum
    step = 1 << max(0, n.bit_length() - 4)
    return -(-n // step) * step


def _patterns(markers: Markers) -> list[tuple[int, tuple[int, ...]]]:
    c = markers.compiled()
    offsets, tokens = c.offsets.tolist(), c.tokens.tolist()
    return [(int(c.kinds[k]), tuple(tokens[offsets[k] : offsets[k + 1]])) for k in range(len(c.kinds))]


def _shift_right(marks: mx.array, by: int) -> mx.array:
    n = marks.shape[0]
    if by >= n:
        return mx.zeros_like(marks)
    return mx.concatenate([mx.zeros((by,), dtype=marks.dtype), marks[: n - by]])


def _same_segment_ahead(seg: mx.array, inside: mx.array, by: int) -> mx.array:
    """Is ``s`` in a segment that also holds ``s + by``? (Segments are contiguous runs of one id.)"""
    n = seg.shape[0]
    if by >= n:
        return mx.zeros((n,), dtype=mx.bool_)
    same = seg[by:] == seg[: n - by]
    if by:
        same = mx.concatenate([same, mx.zeros((by,), dtype=mx.bool_)])
    return mx.logical_and(same, inside)


def _program(patterns, last_turn_only: bool, has_mask_out: bool):
    """The engine over a flat buffer, as a function of arrays only (so that it compiles).

    ``seg[i]``: segment of position ``i`` (``n_segs`` = none, each segment one contiguous run);
    ``slots``: zeros of length ``n_segs + 1``, which fixes ``n_segs`` for the per-segment sums.
    """

    def run(values: mx.array, seg: mx.array, slots: mx.array):
        n = values.shape[0]
        n_segs = slots.shape[0] - 1
        pos = mx.arange(n, dtype=mx.int32)
        inside = seg < n_segs
        first = inside
        if n > 1:
            changed = mx.concatenate([mx.ones((1,), dtype=mx.bool_), seg[1:] != seg[:-1]])
            first = mx.logical_and(inside, changed)
        none = mx.full((n,), -1, dtype=mx.int32)
        open_mark = mx.zeros((n,), dtype=mx.bool_)
        close_mark = first  # a close at every segment start cuts off what lies before it
        response_at = mx.zeros((n,), dtype=mx.bool_)
        last_open, cover = none, none
        fits_cache = {}
        for kind, pattern in patterns:
            length = len(pattern)
            if length not in fits_cache:
                fits_cache[length] = (_same_segment_ahead(seg, inside, length - 1), _same_segment_ahead(seg, inside, length))
            fits, ahead = fits_cache[length]
            found = mx.zeros((n,), dtype=mx.bool_)
            if length <= n:
                width = n - length + 1
                window = values[:width] == pattern[0]
                for k in range(1, length):
                    window = mx.logical_and(window, values[k : k + width] == pattern[k])
                if width < n:
                    window = mx.concatenate([window, mx.zeros((n - width,), dtype=mx.bool_)])
                found = mx.logical_and(window, fits)
            ends_before_hi = mx.logical_and(found, ahead)
            if kind == RESPONSE:
                open_mark = mx.logical_or(open_mark, _shift_right(ends_before_hi, length))
                close_mark = mx.logical_or(close_mark, found)
                response_at = mx.logical_or(response_at, found)
                if last_turn_only:
                    last_open = mx.where(found, mx.maximum(last_open, pos + length), last_open)
            elif kind == INSTRUCTION:
                close_mark = mx.logical_or(close_mark, found)
            elif kind == END:
                close_mark = mx.logical_or(close_mark, _shift_right(ends_before_hi, length))
            elif kind == MASK_OUT:
                cover = mx.where(found, mx.maximum(cover, pos + length), cover)
        # one running maximum: an open at p is 2p, a close 2p + 1 (a close wins a tie, as SPEC.md says)
        events = mx.where(close_mark, 2 * pos + 1, mx.where(open_mark, 2 * pos, none))
        latest = mx.cummax(events, axis=0)
        trained = mx.logical_and(inside, mx.logical_and(latest >= 0, latest % 2 == 0))
        if has_mask_out:
            trained = mx.logical_and(trained, mx.cummax(cover, axis=0) <= pos)
        if last_turn_only:
            row_last = (slots - 1).at[seg].maximum(last_open)
            trained = mx.logical_and(trained, latest // 2 == row_last[seg])
        counts = slots.at[seg].add(trained.astype(mx.int32))
        responses = slots.at[seg].add(response_at.astype(mx.int32))
        bad = (slots + n).at[seg].minimum(mx.where(values < 0, pos, n))
        return trained, counts[:n_segs], responses[:n_segs] > 0, mx.where(bad < n, bad, -1)[:n_segs]

    return run


class _Program:
    """The program for one set of markers: eager the first time a shape is seen, compiled when it recurs.

    Compiling (which on the CPU builds native code) costs far more than one eager pass, so it is
    paid only for shapes that come back: the bucketed widths of a training feed, not one-off calls.
    """

    def __init__(self, markers: Markers, last_turn_only: bool):
        self.eager = _program(_patterns(markers), bool(last_turn_only), bool(markers.mask_out))
        self.compiled = mx.compile(self.eager)
        self.seen: set[tuple] = set()

    def __call__(self, *arrays):
        key = tuple((a.shape, a.dtype) for a in arrays)
        if key in self.seen:
            return self.compiled(*arrays)
        self.seen.add(key)
        return self.eager(*arrays)


@lru_cache(maxsize=64)
def compiled_program(markers: Markers, last_turn_only: bool) -> _Program:
    """``run(values, seg, slots) -> (trained, trained_tokens, has_response, first_bad)``, compiled when a shape recurs."""
    return _Program(markers, bool(last_turn_only))


def trained_padded(input_ids: mx.array, lengths: mx.array, markers: Markers, *, last_turn_only: bool = False) -> mx.array:
    """Bool ``[B, T]``: is each token trained? Row ``r`` holds ``lengths[r]`` real tokens from the left."""
    batch, width = input_ids.shape
    lengths = lengths.astype(mx.int32)
    col = mx.arange(width, dtype=mx.int32)
    seg = mx.where(col[None, :] < lengths[:, None], mx.arange(batch, dtype=mx.int32)[:, None], batch).reshape(-1)
    slots = mx.zeros((batch + 1,), dtype=mx.int32)
    trained = compiled_program(markers, last_turn_only)(input_ids.reshape(-1), seg, slots)[0]
    return trained.reshape(batch, width)


def label_rows(values, starts, ends, markers: Markers, *, last_turn_only, ignore_index, out, write_mask):
    """Backend entry point (see ``lossmask.engine.kernels``): one compiled pass over a bucketed copy of the buffer."""
    n_rows = len(starts)
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.maximum(np.asarray(ends, dtype=np.int64), starts)
    lengths = ends - starts
    # A compact copy: rows back to back from 0, then dead padding up to the bucket.
    cu = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    total = int(cu[-1])
    if total >= 2**31 - 1:
        raise ValueError(f"the mlx backend labels at most 2**31 - 2 tokens per call, got {total}; pass smaller batches")
    index = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1] - starts, lengths)
    values = np.asarray(values)
    flat = values[index] if total else np.zeros(0, dtype=values.dtype)
    if flat.dtype.kind == "u":
        flat = flat.astype(np.int64)
    n, n_segs = bucket(total), bucket(n_rows, minimum=8)
    padded = np.zeros(n, dtype=flat.dtype)
    padded[:total] = flat
    seg = np.full(n, n_segs, dtype=np.int32)
    seg[:total] = np.repeat(np.arange(n_rows, dtype=np.int32), lengths)
    run = compiled_program(markers, bool(last_turn_only))
    trained, counts, has_response, bad = run(mx.array(padded), mx.array(seg), mx.zeros((n_segs + 1,), dtype=mx.int32))
    mx.eval(trained, counts, has_response, bad)
    trained = np.array(trained, copy=False)[:total]
    if write_mask:
        out[index] = trained
    else:
        out[index] = np.where(trained, flat, ignore_index)
    counts = np.array(counts)[:n_rows].astype(np.int64)
    has_response = np.array(has_response)[:n_rows]
    bad = np.array(bad)[:n_rows].astype(np.int64)
    first_bad = np.where(bad >= 0, index[np.maximum(bad, 0)] if total else -1, -1)
    outcomes = np.where(has_response, int(Outcome.EMPTY_RESPONSE), int(Outcome.NO_RESPONSE))
    outcomes = np.where(counts > 0, int(Outcome.TRAINED), outcomes)
    outcomes = np.where(lengths == 0, int(Outcome.EMPTY), outcomes).astype(np.int8)
    return counts, outcomes, first_bad
