"""Every accepted input shape, zero-copy where promised, and clear errors on bad input."""

import numpy as np
import pyarrow as pa
import pytest

import lossmask
from lossmask import Markers

M = Markers(response=[[1, 2]], instruction=[[1, 3]], end=[[4]])
ROWS = [[1, 3, 9, 4, 1, 2, 7, 8, 4, 5], [1, 2, 6], [], [5, 5]]
EXPECTED = [[-100] * 6 + [7, 8, 4, -100], [-100, -100, 6], [], [-100, -100]]


@pytest.mark.parametrize("list_type", [pa.list_, pa.large_list])
@pytest.mark.parametrize("value_type", [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint16(), pa.uint32(), pa.uint64()])
def test_list_arrays_of_any_integer_type(list_type, value_type):
    arr = pa.array(ROWS, type=list_type(value_type))
    out = lossmask.make_labels(arr, M)
    assert out.type == list_type(pa.int64())
    assert out.to_pylist() == EXPECTED


def test_output_reuses_the_offsets_and_validity_buffers():
    arr = pa.array(ROWS + [None], type=pa.list_(pa.int32()))
    out = lossmask.make_labels(arr, M)
    assert out.buffers()[1].address == arr.buffers()[1].address
    assert out.buffers()[0].address == arr.buffers()[0].address
    assert out.to_pylist() == EXPECTED + [None]


def test_sliced_arrays_keep_their_offset():
    arr = pa.array([[5]] * 3 + ROWS + [[1, 2, 3]], type=pa.large_list(pa.int32()))
    sliced = arr.slice(3, len(ROWS))
    out = lossmask.make_labels(sliced, M)
    assert out.to_pylist() == EXPECTED
    # labelled over the slice's own values: no buffer the size of the parent
    assert len(out.values) == sum(map(len, ROWS))
    # a slice from the start still shares the input's offsets buffer
    head = arr.slice(0, 5)
    assert lossmask.make_labels(head, M).buffers()[1].address == head.buffers()[1].address
    # a slice with null rows keeps them null
    with_nulls = pa.array([[1, 2, 5]] + ROWS + [None, [1, 2, 6]], type=pa.list_(pa.int64())).slice(1)
    assert lossmask.make_labels(with_nulls, M).to_pylist() == EXPECTED + [None, [-100, -100, 6]]
    # a slice of the child (values with their own offset) is read at the right place too
    child_sliced = pa.ListArray.from_arrays(pa.array([0, 3, 5], pa.int32()), pa.array([9, 9, 1, 2, 8, 1, 2, 7], pa.int64()).slice(2))
    assert lossmask.make_labels(child_sliced, M).to_pylist() == [[-100, -100, 8], [-100, -100]]


def test_null_rows_stay_null_even_when_they_span_values():
    offsets = pa.array([0, 3, 6, 8], pa.int32())
    values = pa.array([1, 2, 5, 1, 2, 5, 1, 2], pa.int64())
    mask = pa.array([True, False, True])
    arr = pa.ListArray.from_arrays(offsets, values, mask=pa.compute.invert(mask))
    assert arr.to_pylist() == [[1, 2, 5], None, [1, 2]]
    result = lossmask.label_batch(arr, M)
    assert result.labels.to_pylist() == [[-100, -100, 5], None, [-100, -100]]
    assert result.outcomes.tolist() == [0, 3, 2]
    assert result.counts.tokens == 5


def test_chunked_arrays_give_chunked_labels_and_rows_are_numbered_across_chunks():
    chunked = pa.chunked_array([pa.array(ROWS[:2], pa.list_(pa.int32())), pa.array(ROWS[2:], pa.list_(pa.int32()))])
    result = lossmask.label_batch(chunked, M)
    assert isinstance(result.labels, pa.ChunkedArray) and result.labels.num_chunks == 2
    assert result.labels.to_pylist() == EXPECTED
    assert result.outcomes.tolist() == [0, 0, 3, 1]
    bad = pa.chunked_array([pa.array([[1, 2]], pa.list_(pa.int32())), pa.array([[5], [5, -7]], pa.list_(pa.int32()))])
    with pytest.raises(ValueError, match=r"row 2 holds the negative token id -7 at position 1"):
        lossmask.make_labels(bad, M)
    empty = pa.chunked_array([], type=pa.list_(pa.int32()))
    assert lossmask.make_labels(empty, M).to_pylist() == []


def test_empty_inputs():
    assert lossmask.make_labels([], M) == []
    assert lossmask.make_labels(pa.array([], pa.list_(pa.int32())), M).to_pylist() == []


@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_negative_ids_name_the_row_and_position(backend):
    with pytest.raises(ValueError, match=r"row 1 holds the negative token id -100 at position 2"):
        lossmask.make_labels([[1, 2], [5, 5, -100]], M, backend=backend)


def test_nulls_inside_a_row_name_the_row():
    arr = pa.array([[1, 2, 3], [4, None, 5]], type=pa.list_(pa.int64()))
    with pytest.raises(ValueError, match="row 1 has a null token at position 1"):
        lossmask.make_labels(arr, M)
    with pytest.raises(ValueError, match="row 1 has a null token at position 1"):
        lossmask.make_labels([[1, 2, 3], [4, None, 5]], M)


def test_a_null_child_value_outside_any_row_is_not_an_error():
    arr = pa.ListArray.from_arrays(pa.array([1, 3], pa.int32()), pa.array([None, 1, 2], pa.int64()))
    assert lossmask.make_labels(arr, M).to_pylist() == [[-100, -100]]


@pytest.mark.parametrize(
    "bad, words",
    [
        (pa.array([[1.0, 2.0]]), "holds double values"),
        (pa.array([["a"]]), "holds string values"),
        (pa.array([1, 2]), "must be a list array"),
        ([[1, 2.5]], r"row 0 holds 2.5 at position 1"),
        ([[1], "abc"], "row 1 is str"),
        ([[True]], "row 0 holds True"),
        ({"input_ids": [[1]]}, "dict is not supported"),
        (np.array([[1.5]]), "dtype float64"),
    ],
)
def test_non_integer_input_is_a_type_error(bad, words):
    with pytest.raises(TypeError, match=words):
        lossmask.make_labels(bad, M, lengths=[1] if isinstance(bad, np.ndarray) else None)


def test_padded_input_checks_its_lengths():
    rows = np.zeros((2, 3), np.int32)
    with pytest.raises(ValueError, match=r"lengths\[1\] = 4 is outside \[0, 3\]"):
        lossmask.make_labels(rows, M, lengths=[1, 4])
    with pytest.raises(ValueError, match="one per row"):
        lossmask.make_labels(rows, M, lengths=[1])
    with pytest.raises(TypeError, match="pass both or neither"):
        lossmask.make_labels(rows, M)


def test_unknown_backend_and_wrong_markers():
    with pytest.raises(ValueError, match=r"unknown backend 'cuda'; pass one of"):
        lossmask.make_labels([[1]], M, backend="cuda")
    with pytest.raises(TypeError, match="must be a lossmask.Markers"):
        lossmask.make_labels([[1]], {"response": [[1]]})
