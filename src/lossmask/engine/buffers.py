"""Token batches in: every accepted input shape as flat buffers ``(values, starts, ends)``, and back.

Accepted: ``pyarrow.ListArray`` / ``LargeListArray`` of any integer type (sliced, with null rows),
``pyarrow.ChunkedArray`` of those, Python lists of lists, and a NumPy 2-D array with ``lengths``.
Arrow inputs are read zero-copy: ``starts``/``ends`` are views of the offsets buffer and ``values``
a view of the child buffer; the output list array reuses the input's offsets and validity buffers.
All checks that need a pass over the data are done here once, or by the kernel (negative ids),
never per row in Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)


@dataclass(frozen=True)
class TokenRows:
    """Rows as the kernels see them: row ``r`` is ``values[starts[r]:ends[r]]``.

    ``first_row`` is the index of row 0 in the caller's whole input (chunks of a ChunkedArray
    start further on), so that errors name the row the user knows. ``base`` is where ``values[0]``
    lies in the Arrow child array: a slice is labelled over its own values only, not its parent's.
    """

    values: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    first_row: int = 0
    base: int = 0

    @property
    def lengths(self) -> np.ndarray:
        return self.ends - self.starts

    def __len__(self) -> int:
        return self.starts.shape[0]


LABEL_DTYPES = {"int64": np.dtype(np.int64), "int32": np.dtype(np.int32)}


def resolve_label_dtype(dtype: Any) -> np.dtype:
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved.name not in LABEL_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not a label dtype; pass 'int64' (the Hugging Face convention) or 'int32'")
    return resolved


def _integer_list_type(arr_type: pa.DataType, what: str) -> None:
    if not (pa.types.is_list(arr_type) or pa.types.is_large_list(arr_type)):
        raise TypeError(
            f"{what} must be a list array of token ids (list<int32>, list<int64>, large_list<...>), got {arr_type}"
        )
    if not pa.types.is_integer(arr_type.value_type):
        raise TypeError(
            f"{what} holds {arr_type.value_type} values; token ids must be integers "
            f"(cast first, e.g. pyarrow.compute.cast(arr, pa.list_(pa.int32())))"
        )


def rows_from_arrow(arr: pa.Array, *, first_row: int = 0) -> TokenRows:
    """Zero-copy views of a List/LargeList array of integers. Raises on nulls inside a row."""
    _integer_list_type(arr.type, "input_ids")
    offsets_type = np.int32 if pa.types.is_list(arr.type) else np.int64
    offsets_buffer = arr.buffers()[1]
    if offsets_buffer is None:  # an array of length 0 may carry no buffers at all
        empty = np.zeros(0, np.int64)
        return TokenRows(np.zeros(0, np.int64), empty, empty, first_row)
    offsets = np.frombuffer(offsets_buffer, dtype=offsets_type)[arr.offset : arr.offset + len(arr) + 1]
    child = arr.values
    starts, ends = offsets[:-1], offsets[1:]
    if arr.null_count:
        # A null row may still span values; it is treated as a row with no tokens.
        ends = np.where(np.asarray(arr.is_valid()), ends, starts)
    if child.null_count:
        _raise_on_null_inside_row(child, starts, ends, first_row)
    # The data buffer itself, not child.to_numpy(): a null outside every row must not force a copy.
    dtype = np.dtype(child.type.to_pandas_dtype())
    lo, hi = int(offsets[0]), int(offsets[-1])
    values = np.frombuffer(child.buffers()[1], dtype=dtype)[child.offset + lo : child.offset + hi]
    if lo:  # a batch sliced out of a bigger array (a Parquet row group, a Dataset batch): re-base, O(rows)
        starts, ends = starts - lo, ends - lo
    return TokenRows(values, starts, ends, first_row, base=lo)


def _raise_on_null_inside_row(child: pa.Array, starts: np.ndarray, ends: np.ndarray, first_row: int) -> None:
    null_positions = np.flatnonzero(np.asarray(child.is_null()))
    rows = np.searchsorted(starts, null_positions, side="right") - 1
    inside = (rows >= 0) & (null_positions < ends[np.maximum(rows, 0)])
    if inside.any():
        k = int(np.argmax(inside))
        row = int(rows[k])
        raise ValueError(
            f"row {first_row + row} has a null token at position {int(null_positions[k] - starts[row])}; "
            "token ids cannot be null (fill or drop such rows before labelling)"
        )


def first_id_at_or_above(rows: TokenRows, upper: int) -> tuple[int, int, int] | None:
    """``(row, position, id)`` of the first token id >= ``upper`` inside a row, or None.

    One vectorised pass (``max``), skipped when the values' dtype cannot reach ``upper``; only a batch
    that holds such an id is searched for it. Values outside every row (under null rows) are ignored.
    """
    values = rows.values
    if values.size == 0 or values.dtype.kind not in "iu" or np.iinfo(values.dtype).max < upper:
        return None
    if int(values.max()) < upper:
        return None
    positions = np.flatnonzero(values >= values.dtype.type(upper))
    row_of = np.searchsorted(rows.starts, positions, side="right") - 1
    inside = (row_of >= 0) & (positions < rows.ends[np.maximum(row_of, 0)])
    if not inside.any():
        return None
    k = int(np.argmax(inside))
    r = int(row_of[k])
    return r, int(positions[k] - rows.starts[r]), int(values[positions[k]])


def check_label_range(rows: TokenRows, label_dtype: np.dtype) -> None:
    """Refuse token ids that labels of ``label_dtype`` cannot hold (they would wrap, e.g. to -100)."""
    limit = int(np.iinfo(label_dtype).max)
    bad = first_id_at_or_above(rows, limit + 1)
    if bad is not None:
        r, position, token = bad
        fix = ("pass label_dtype='int64' (--label-dtype int64)" if label_dtype == np.int32
               else "token ids must be below 2**63; is this column token ids?")
        raise ValueError(f"row {rows.first_row + r} holds the token id {token} at position {position}, which "
                         f"{np.dtype(label_dtype).name} labels cannot hold (at most {limit}); {fix}")


def check_vocabulary(arr: pa.Array | pa.ChunkedArray, size: int, *, first_row: int = 0) -> None:
    """Refuse token ids >= ``size``, the tokenizer's vocabulary (ids the tokenizer does not have)."""
    chunks = arr.chunks if isinstance(arr, pa.ChunkedArray) else [arr]
    for chunk in chunks:
        bad = first_id_at_or_above(rows_from_arrow(chunk, first_row=first_row), size)
        if bad is not None:
            r, position, token = bad
            raise ValueError(
                f"row {first_row + r} holds the token id {token} at position {position}, but the tokenizer has "
                f"{size:,} tokens (ids 0 to {size - 1}); the rows were tokenised with another tokenizer: pass that "
                "one, or --markers FILE.json without --tokenizer"
            )
        first_row += len(chunk)


def labels_to_arrow(arr: pa.Array, values: pa.Buffer, dtype: np.dtype, *, base: int = 0) -> pa.Array:
    """A list array shaped like ``arr`` over the label ``values`` of its rows.

    With ``base == 0`` (a whole array, or a slice from its start) the offsets and validity buffers are
    the input's own, not copied; a slice further in gets offsets re-based by ``base``.
    """
    value_type = pa.from_numpy_dtype(dtype)
    list_type = pa.list_(value_type) if pa.types.is_list(arr.type) else pa.large_list(value_type)
    buffers = arr.buffers()
    if buffers[1] is None:
        return pa.array([], type=list_type)
    child = pa.Array.from_buffers(value_type, values.size // dtype.itemsize, [None, values])
    if base == 0:
        return pa.Array.from_buffers(
            list_type, len(arr), [buffers[0], buffers[1]], null_count=arr.null_count, offset=arr.offset, children=[child]
        )
    offsets = pa.compute.subtract(arr.offsets, pa.scalar(base, arr.offsets.type))
    array_class = pa.ListArray if pa.types.is_list(arr.type) else pa.LargeListArray
    mask = arr.is_null() if arr.null_count else None
    return array_class.from_arrays(offsets, child, type=list_type, mask=mask)


def rows_from_pylist(rows: list, *, first_row: int = 0) -> pa.Array:
    """Python lists of token ids as a LargeList<int64> array, with the row of a bad value named.

    The type is inferred, never forced: forcing int64 would silently truncate 2.5 to 2.
    """
    try:
        array = pa.array(rows, type=None) if rows else pa.array([], type=pa.large_list(pa.int64()))
        value_type = getattr(array.type, "value_type", None)
        if value_type is not None and (pa.types.is_integer(value_type) or pa.types.is_null(value_type)):
            return array.cast(pa.large_list(pa.int64()))
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
        pass
    for r, row in enumerate(rows):
        if row is None:
            continue
        if isinstance(row, (str, bytes)) or not hasattr(row, "__iter__"):
            raise TypeError(f"row {first_row + r} is {type(row).__name__}, not a list of token ids")
        for position, token in enumerate(row):
            if token is None:
                raise ValueError(f"row {first_row + r} has a null token at position {position}")
            if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
                raise TypeError(f"row {first_row + r} holds {token!r} at position {position}; token ids must be integers")
            if not -(2**63) <= token < 2**63:
                raise ValueError(f"row {first_row + r} holds {token} at position {position}, beyond 64-bit token ids")
    raise TypeError("input_ids could not be read as lists of token ids")  # pragma: no cover - all cases named above


def rows_from_padded(input_ids: np.ndarray, lengths: Any) -> TokenRows:
    """A [rows, width] array whose row ``r`` holds ``lengths[r]`` real tokens from the left."""
    if input_ids.ndim != 2:
        raise ValueError(f"a NumPy input must be 2-D [rows, width] with a lengths argument, got shape {input_ids.shape}")
    if input_ids.dtype.kind not in "iu":
        raise TypeError(f"input_ids has dtype {input_ids.dtype}; token ids must be integers")
    n_rows, width = input_ids.shape
    lengths = np.asarray(lengths)
    if lengths.shape != (n_rows,) or lengths.dtype.kind not in "iu":
        raise ValueError(f"lengths must be {n_rows} integers (one per row), got shape {lengths.shape} of {lengths.dtype}")
    bad = np.flatnonzero((lengths < 0) | (lengths > width))
    if bad.size:
        r = int(bad[0])
        raise ValueError(f"lengths[{r}] = {int(lengths[r])} is outside [0, {width}], the width of input_ids")
    values = np.ascontiguousarray(input_ids).reshape(-1)
    starts = np.arange(n_rows, dtype=np.int64) * width
    return TokenRows(values, starts, starts + lengths.astype(np.int64))
