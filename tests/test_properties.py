"""The numba kernel against the reference of SPEC.md, on random rows and random markers.

A small vocabulary makes matches frequent, overlapping and repeated; patterns of every kind are
drawn from the same vocabulary so that they collide with each other too.
"""

import numpy as np
import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lossmask
from lossmask import Markers

VOCAB = 6
token = st.integers(0, VOCAB - 1)
pattern = st.lists(token, min_size=1, max_size=5)
row = st.lists(token, min_size=0, max_size=60)

markers_strategy = st.builds(
    Markers,
    response=st.lists(pattern, min_size=1, max_size=3),
    instruction=st.lists(pattern, max_size=3),
    end=st.lists(pattern, max_size=3),
    mask_out=st.lists(pattern, max_size=2),
)

VALUE_TYPES = [pa.int32(), pa.int64(), pa.uint32()]


@st.composite
def arrow_batches(draw):
    """A List/LargeList array, maybe with null rows, maybe a slice of a bigger one, maybe chunked."""
    rows = draw(st.lists(st.one_of(row, st.none()) if draw(st.booleans()) else row, max_size=25))
    list_type = draw(st.sampled_from([pa.list_, pa.large_list]))(draw(st.sampled_from(VALUE_TYPES)))
    head = draw(st.lists(row, max_size=3))
    tail = draw(st.lists(row, max_size=3))
    arr = pa.array(head + rows + tail, type=list_type).slice(len(head), len(rows))
    if rows and draw(st.booleans()):
        cut = draw(st.integers(0, len(rows)))
        return pa.chunked_array([arr.slice(0, cut), arr.slice(cut)], type=list_type)
    return arr


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(batch=arrow_batches(), markers=markers_strategy, last_turn_only=st.booleans())
def test_numba_equals_reference(batch, markers, last_turn_only):
    fast = lossmask.label_batch(batch, markers, last_turn_only=last_turn_only)
    slow = lossmask.label_batch(batch, markers, last_turn_only=last_turn_only, backend="numpy")
    assert fast.labels.to_pylist() == slow.labels.to_pylist()
    assert fast.labels.type == slow.labels.type
    np.testing.assert_array_equal(fast.outcomes, slow.outcomes)
    np.testing.assert_array_equal(fast.trained_tokens, slow.trained_tokens)
    assert fast.counts == slow.counts


@SETTINGS
@given(batch=arrow_batches(), markers=markers_strategy, last_turn_only=st.booleans())
def test_mask_is_the_same_decision_as_labels(batch, markers, last_turn_only):
    labels = lossmask.make_labels(batch, markers, last_turn_only=last_turn_only, dtype="int32", ignore_index=-1)
    mask = lossmask.trainable_mask(batch, markers, last_turn_only=last_turn_only)
    reference = lossmask.trainable_mask(batch, markers, last_turn_only=last_turn_only, backend="numpy")
    assert mask.to_pylist() == reference.to_pylist()
    for label_row, mask_row in zip(labels.to_pylist(), mask.to_pylist()):
        assert (label_row is None) == (mask_row is None)
        if label_row is not None:
            assert [int(label != -1) for label in label_row] == mask_row


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(row, min_size=1, max_size=10), markers=markers_strategy, width_extra=st.integers(0, 5))
def test_padded_numpy_equals_the_list_form(rows, markers, width_extra):
    width = max(map(len, rows)) + width_extra
    padded = np.full((len(rows), width), VOCAB - 1, dtype=np.int64)  # padding that looks like real tokens
    for r, ids in enumerate(rows):
        padded[r, : len(ids)] = ids
    lengths = np.array([len(ids) for ids in rows])
    out = lossmask.make_labels(padded, markers, lengths=lengths)
    expected = lossmask.make_labels(rows, markers, backend="numpy")
    assert [out[r, : lengths[r]].tolist() for r in range(len(rows))] == expected
    assert all((out[r, lengths[r] :] == -100).all() for r in range(len(rows)))


def test_one_huge_row_and_many_empty_rows():
    rng = np.random.default_rng(7)
    markers = Markers(response=[[1, 2]], instruction=[[1]], end=[[3]], mask_out=[[4, 4]])
    rows = [rng.integers(0, VOCAB, 200_000).tolist()] + [[]] * 1000 + [[1, 2, 5]]
    fast = lossmask.label_batch(rows, markers)
    slow = lossmask.label_batch(rows, markers, backend="numpy")
    assert fast.labels == slow.labels
    np.testing.assert_array_equal(fast.outcomes, slow.outcomes)


def test_parallel_and_serial_kernels_agree(monkeypatch):
    """Small batches run serially; force the parallel compilation onto random data too."""
    from lossmask.engine.kernels import numba_kernel

    rng = np.random.default_rng(11)
    markers = Markers(response=[[1, 2], [1, 2, 2]], instruction=[[1]], end=[[3], [3, 4]], mask_out=[[5, 0]])
    rows = [rng.integers(0, VOCAB, rng.integers(0, 80)).tolist() for _ in range(3000)]
    for last_turn_only in (False, True):
        serial = lossmask.label_batch(rows, markers, last_turn_only=last_turn_only)
        monkeypatch.setattr(numba_kernel, "PARALLEL_MIN_TOKENS", 0)
        parallel = lossmask.label_batch(rows, markers, last_turn_only=last_turn_only)
        monkeypatch.undo()
        reference = lossmask.label_batch(rows, markers, last_turn_only=last_turn_only, backend="numpy")
        assert serial.labels == parallel.labels == reference.labels
        np.testing.assert_array_equal(parallel.outcomes, reference.outcomes)
        np.testing.assert_array_equal(parallel.trained_tokens, reference.trained_tokens)


def test_the_two_schedules_are_two_functions():
    """numba caches by Python function: one body behind both would load one schedule for both."""
    from lossmask.engine.kernels import numba_kernel

    for parallel, serial, block in ((numba_kernel._label_rows_parallel, numba_kernel._label_rows_serial,
                                     numba_kernel._label_block),
                                    (numba_kernel._direct_rows_parallel, numba_kernel._direct_rows_serial,
                                     numba_kernel._direct_block)):
        assert parallel.targetoptions.get("parallel")
        # the serial schedule is Python around the compiled block, itself compiled without parallel=True
        assert not hasattr(serial, "targetoptions") and not block.targetoptions.get("parallel")
        assert parallel.py_func.__qualname__ != block.py_func.__qualname__
