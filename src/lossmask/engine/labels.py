"""The public labelling operations: ``make_labels``, ``trainable_mask`` and ``label_batch``.

Each call validates once, turns its input into flat buffers (``buffers.py``), makes one call into
the chosen kernel per Arrow chunk, raises on what the kernel reported, and gives back the same row
structure it was given.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from . import buffers, kernels
from .buffers import TokenRows
from .kernels import get_backend
from .outcomes import Outcome, OutcomeCounts
from .patterns import Markers


# Tiers. The default backend is numba, whose kernel costs about 4 CPU-s to compile on a fresh install and about 0.8
# to import numba and load it from numba's cache later: more than the NumPy reference (kernels/reference.py, the
# oracle every backend is tested against, so the labels are the same) takes for a few hundred rows. So what a process
# labels by default goes to the reference until its estimated cost would pass REFERENCE_SECONDS, or numba's kernel
# is loaded (by a larger batch, or an explicit backend="numba"): the README's example, a marker check or a notebook's
# few rows never compile, and a large job pays the compile once, as before, after at most that much slower labelling.
# The reference's cost, fitted on real rows (0.7-1.5x of what it spent): 0.2 ms a row, 45 us a row and pattern
# (a response pattern counts twice: it opens and closes), 0.04 us a token and pattern. Qwen2.5's 69 patterns: 900-token
# ShareGPT rows 5.6 ms each, 30-token rows 3.2 ms; DeepSeek-V3's 5 on the README example: 116 rows in 74 ms.
REFERENCE_SECONDS = 0.25
_ROW_SECONDS, _ROW_PATTERN_SECONDS, _TOKEN_PATTERN_SECONDS = 200e-6, 45e-6, 0.04e-6
_NUMBA_KERNEL = f"{kernels.__name__}.{kernels.BACKENDS['numba'][0]}"  # in sys.modules once numba's kernel is loaded
_tier_lock = threading.Lock()
_reference_left = REFERENCE_SECONDS


def _kernel_for(backend: str | None, rows: TokenRows, markers: Markers):
    """The kernel module for ``rows``: ``backend``'s, or by the tiers above when it is None."""
    global _reference_left
    if backend is not None or _NUMBA_KERNEL in sys.modules:
        return get_backend(backend)
    patterns = 2 * len(markers.response) + len(markers.instruction) + len(markers.end) + len(markers.mask_out)
    cost = (len(rows.starts) * (_ROW_SECONDS + patterns * _ROW_PATTERN_SECONDS)
            + int(rows.lengths.sum()) * patterns * _TOKEN_PATTERN_SECONDS)
    with _tier_lock:
        if cost <= _reference_left:
            _reference_left -= cost
            return get_backend("numpy")
        _reference_left = 0.0
    return get_backend(backend)


@dataclass(frozen=True)
class LabelledBatch:
    """Labels for a batch, with what each row ended as, from the same kernel pass.

    ``labels`` has the structure of the input (a list array for a list array, ...).
    ``trained_tokens[r]`` and ``outcomes[r]`` (``Outcome`` codes) describe row ``r``;
    ``counts`` adds them up.
    """

    labels: Any
    trained_tokens: np.ndarray
    outcomes: np.ndarray
    counts: OutcomeCounts
    # rows of ``ChatTokenizer.encode_chats`` output: ``(row, reason, message)`` of those whose labels are null
    # (``template_breaks_roles``), and the rows labelled from their rendering (``labelled_from_rendering``)
    rejected: tuple = ()
    from_rendering: tuple = ()

    @property
    def keep(self) -> np.ndarray:
        """A boolean per row: does it train at least one token?"""
        return self.outcomes == Outcome.TRAINED


def make_labels(
    input_ids: Any,
    markers: Markers,
    *,
    backend: str | None = None,
    last_turn_only: bool = False,
    ignore_index: int = -100,
    dtype: Any = "int64",
    lengths: Any = None,
) -> Any:
    """Labels per SPEC.md: the token id where it is trained, ``ignore_index`` elsewhere.

    ``input_ids``: a ``pyarrow`` List/LargeList array of integers (sliced arrays and null rows
    welcome) or a ChunkedArray of them, Python lists of lists, or a 2-D NumPy array with
    ``lengths`` (real tokens per row; the rest is padding, labelled ``ignore_index``).
    Returns the same structure; Arrow outputs reuse the input's offsets buffer, and their labels are a
    new buffer from Arrow's memory pool, which keeps freed pages mapped: batch after batch, labels land
    in memory that is already mapped instead of paying a page fault per 4 KiB (``bench_engine.py``
    compares ``make_labels`` with the kernel writing into a warm buffer).

    Token ids cannot tell message text from the template's markup: a marker's text inside a message
    acts as the marker. Rows rendered by lossmask carry a mask that prevents it (``label_batch(data_mask=)``).
    """
    return label_batch(
        input_ids, markers, backend=backend, last_turn_only=last_turn_only,
        ignore_index=ignore_index, dtype=dtype, lengths=lengths,
    ).labels


def trainable_mask(
    input_ids: Any,
    markers: Markers,
    *,
    backend: str | None = None,
    last_turn_only: bool = False,
    lengths: Any = None,
) -> Any:
    """The same decision as ``make_labels``, as 0/1 ``int8`` (TRL's ``completion_mask``)."""
    return _label(input_ids, markers, backend, last_turn_only, 0, np.dtype(np.int8), lengths, write_mask=True).labels


def label_batch(
    input_ids: Any,
    markers: Markers,
    *,
    backend: str | None = None,
    last_turn_only: bool = False,
    ignore_index: int = -100,
    dtype: Any = "int64",
    lengths: Any = None,
    data_mask: np.ndarray | None = None,
) -> LabelledBatch:
    """``make_labels`` plus per-row trained-token counts and outcomes, in one pass.

    ``data_mask``: a bool per token of a list-array ``input_ids`` (its rows' tokens back to back,
    as ``.flatten()`` gives them), True for tokens that are message text (``encode_rendered``
    gives it). No pattern can match such a token, so message text never opens, closes or extends a
    span; it is still trained where its span is. Pre-tokenised ``input_ids`` carry no such mask: a
    marker's text inside a message there acts as the marker.

    ``input_ids`` may also be what ``ChatTokenizer.encode_chats`` returns (``EncodedChats``): its data mask is
    used, and its rows are held to the role invariant, as ``mask_files`` holds them (``EncodedChats.label``).
    """
    label_chats = getattr(input_ids, "label", None)
    if callable(label_chats) and hasattr(input_ids, "in_content"):  # EncodedChats (chat stage): it labels itself
        return label_chats(markers, backend=backend, last_turn_only=last_turn_only, ignore_index=ignore_index,
                           dtype=dtype)
    label_dtype = buffers.resolve_label_dtype(dtype)
    info = np.iinfo(label_dtype)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)) or not (
        info.min <= ignore_index <= info.max
    ):
        raise ValueError(f"ignore_index={ignore_index!r} must be an integer that fits {label_dtype.name}")
    if data_mask is not None and np.any(data_mask):
        return _label_with_data(input_ids, markers, backend, last_turn_only, int(ignore_index), label_dtype, data_mask)
    return _label(input_ids, markers, backend, last_turn_only, int(ignore_index), label_dtype, lengths, write_mask=False)


def inert_id(markers: Markers) -> int:
    """A token id that occurs in no pattern of ``markers`` (one past the largest)."""
    largest = max((int(t) for kind in markers.to_dict().values() for p in kind for t in p), default=-1)
    return largest + 1


def _label_with_data(input_ids, markers, backend, last_turn_only, ignore_index, out_dtype, data_mask) -> LabelledBatch:
    """Label a scratch copy whose message-text tokens are an id no pattern holds; put the real ids back."""
    if not isinstance(markers, Markers):
        raise TypeError(f"markers must be a lossmask.Markers, got {type(markers).__name__}")
    if isinstance(input_ids, pa.ChunkedArray):
        input_ids = input_ids.combine_chunks() if input_ids.num_chunks != 1 else input_ids.chunk(0)
    if not isinstance(input_ids, pa.Array):
        raise TypeError("data_mask goes with a pyarrow List/LargeList array of input_ids")
    rows = buffers.rows_from_arrow(input_ids)
    lengths = rows.lengths.astype(np.int64)
    data_mask = np.asarray(data_mask, dtype=bool)
    if data_mask.shape != (int(lengths.sum()),):
        raise ValueError(f"data_mask has {data_mask.shape[0]} entries; the rows hold {int(lengths.sum())} tokens")
    cu = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    position = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1] - rows.starts.astype(np.int64), lengths)
    where = position[data_mask]  # where the message-text tokens lie in the values buffer
    scratch = np.array(rows.values, copy=True)
    inert = inert_id(markers)
    scratch[where] = inert if inert != ignore_index else inert + 1  # never read as "untrained"
    kernel = _kernel_for(backend, rows, markers)
    buffer = _label_buffer(input_ids, rows, out_dtype)
    out = np.frombuffer(buffer, dtype=out_dtype)
    trained, outcomes, first_bad = kernel.label_rows(
        scratch, rows.starts, rows.ends, markers,
        last_turn_only=last_turn_only, ignore_index=ignore_index, out=out, write_mask=False,
    )
    _raise_on_negative_ids(rows, first_bad)
    trained_text = where[out[where] != ignore_index]
    out[trained_text] = rows.values[trained_text]
    labels = buffers.labels_to_arrow(input_ids, buffer, out_dtype, base=rows.base)
    return _assemble(labels, [(trained, outcomes, rows.lengths)])


def _label(input_ids, markers, backend, last_turn_only, ignore_index, out_dtype, lengths, *, write_mask) -> LabelledBatch:
    if not isinstance(markers, Markers):
        raise TypeError(
            f"markers must be a lossmask.Markers, got {type(markers).__name__}; "
            "build one with Markers(response=[[...]], ...) or Markers.from_json(path)"
        )
    if backend is not None:
        get_backend(backend)  # an unknown or uninstalled backend says so before any input is read

    def run(rows: TokenRows, out: np.ndarray):
        if not write_mask:
            buffers.check_label_range(rows, out.dtype)
        trained, outcomes, first_bad = _kernel_for(backend, rows, markers).label_rows(
            rows.values, rows.starts, rows.ends, markers,
            last_turn_only=last_turn_only, ignore_index=ignore_index, out=out, write_mask=write_mask,
        )
        _raise_on_negative_ids(rows, first_bad)
        return trained, outcomes, rows.lengths

    if lengths is not None or isinstance(input_ids, np.ndarray):
        if not isinstance(input_ids, np.ndarray) or lengths is None:
            raise TypeError("lengths goes with a 2-D NumPy input_ids (rows padded to one width); pass both or neither")
        rows = buffers.rows_from_padded(input_ids, lengths)
        out = np.full(input_ids.shape, 0 if write_mask else ignore_index, dtype=out_dtype)
        return _assemble(out, [run(rows, out.reshape(-1))])

    if isinstance(input_ids, (list, tuple)):
        array = buffers.rows_from_pylist(list(input_ids))
        result = _label_arrow_chunks([array], run, out_dtype)
        return LabelledBatch(result.labels.to_pylist(), result.trained_tokens, result.outcomes, result.counts)

    if isinstance(input_ids, pa.ChunkedArray):
        return _label_arrow_chunks(input_ids.chunks, run, out_dtype, chunked_type=input_ids.type)
    if isinstance(input_ids, pa.Array):
        return _label_arrow_chunks([input_ids], run, out_dtype)
    raise TypeError(
        f"input_ids of type {type(input_ids).__name__} is not supported; pass a pyarrow List/LargeList array "
        "(or ChunkedArray), a list of lists of ints, or a 2-D NumPy array with lengths="
    )


def _label_arrow_chunks(chunks, run, out_dtype, *, chunked_type=None) -> LabelledBatch:
    labels, per_row, first_row = [], [], 0
    for chunk in chunks:
        rows = buffers.rows_from_arrow(chunk, first_row=first_row)
        buffer = _label_buffer(chunk, rows, out_dtype)
        per_row.append(run(rows, np.frombuffer(buffer, dtype=out_dtype)))
        labels.append(buffers.labels_to_arrow(chunk, buffer, out_dtype, base=rows.base))
        first_row += len(chunk)
    if chunked_type is None:
        return _assemble(labels[0], per_row)
    value_type = pa.from_numpy_dtype(out_dtype)
    out_type = pa.list_(value_type) if pa.types.is_list(chunked_type) else pa.large_list(value_type)
    return _assemble(pa.chunked_array(labels, type=out_type), per_row)


def _label_buffer(chunk: pa.Array, rows: TokenRows, dtype: np.dtype) -> pa.Buffer:
    """The child buffer of the output list array, sized like the input's values.

    Allocated from Arrow's memory pool, which keeps freed pages for reuse: batch after batch, the
    labels land in memory that is already mapped, instead of paying a page fault per 4 KiB. The
    values span exactly the rows (``rows_from_arrow``) and the kernel writes every position inside a
    row; only values under null rows are not, so those batches are zeroed first.
    """
    buffer = pa.allocate_buffer(rows.values.shape[0] * dtype.itemsize)
    if chunk.null_count:
        np.frombuffer(buffer, dtype=dtype)[:] = 0
    return buffer


def _assemble(labels, per_row) -> LabelledBatch:
    if len(per_row) == 1:  # one chunk: its arrays as they are
        trained, outcomes, lengths = per_row[0]
    elif per_row:
        trained, outcomes, lengths = (np.concatenate(parts) for parts in zip(*per_row))
    else:
        trained, outcomes, lengths = np.zeros(0, np.int64), np.zeros(0, np.int8), np.zeros(0, np.int64)
    return LabelledBatch(labels, trained, outcomes, OutcomeCounts.from_rows(outcomes, trained, lengths))


def _raise_on_negative_ids(rows: TokenRows, first_bad: np.ndarray) -> None:
    bad_rows = np.flatnonzero(first_bad >= 0)
    if bad_rows.size:
        r = int(bad_rows[0])
        index = int(first_bad[r])
        raise ValueError(
            f"row {rows.first_row + r} holds the negative token id {int(rows.values[index])} at position "
            f"{index - int(rows.starts[r])}; token ids must be >= 0 (is padding marked with -100 or -1?)"
        )
