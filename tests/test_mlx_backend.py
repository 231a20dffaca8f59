"""The MLX backend equals the reference (SPEC.md) bit for bit; runs on mlx[cpu]."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lossmask
from lossmask import Markers

mx = pytest.importorskip("mlx.core")
from lossmask.engine.kernels import mlx_kernel, reference  # noqa: E402

from backend_cases import as_arrow, markers, padded, rows, value_types  # noqa: E402

SETTINGS = settings(max_examples=60, deadline=None)


@contextmanager
def eager():
    """Property tests draw new markers each time; compiling each (~1 s on the CPU) would dominate.
    The compiled program runs in test_compiled_program_equals_reference."""
    mx.disable_compile()
    try:
        yield
    finally:
        mx.enable_compile()


@SETTINGS
@given(batch=rows, m=markers(), value_type=value_types, last_turn_only=st.booleans())
def test_label_batch_equals_reference(batch, m, value_type, last_turn_only):
    arr = as_arrow(batch, value_type)
    want = lossmask.label_batch(arr, m, backend="numpy", last_turn_only=last_turn_only)
    with eager():
        got = lossmask.label_batch(arr, m, backend="mlx", last_turn_only=last_turn_only)
        mask = lossmask.trainable_mask(arr, m, backend="mlx", last_turn_only=last_turn_only)
    assert got.labels.equals(want.labels)
    np.testing.assert_array_equal(got.outcomes, want.outcomes)
    np.testing.assert_array_equal(got.trained_tokens, want.trained_tokens)
    assert mask.equals(lossmask.trainable_mask(arr, m, backend="numpy", last_turn_only=last_turn_only))


@SETTINGS
@given(batch=rows, m=markers(), last_turn_only=st.booleans())
def test_trained_padded_equals_reference(batch, m, last_turn_only):
    ids, lengths = padded(batch)
    with eager():
        got = np.array(mlx_kernel.trained_padded(mx.array(ids), mx.array(lengths), m, last_turn_only=last_turn_only))
    for r, row in enumerate(batch):
        row = np.asarray(row or [], dtype=np.int64)
        want = reference.trained_positions(row, m, last_turn_only=last_turn_only)[0]
        np.testing.assert_array_equal(got[r, : len(row)], want)
        assert not got[r, len(row):].any()  # padding (id 0, which matches patterns) never trained


def test_compiled_program_equals_reference():
    """The same shape twice runs the mx.compile'd program (compiling costs ~1 s per shape on the CPU)."""
    rng = np.random.default_rng(1)
    m = Markers(response=[[1, 2], [3]], instruction=[[1], [2, 3, 4]], end=[[4], [0, 1]], mask_out=[[2, 2]])
    batch = [rng.integers(0, 5, n).tolist() for n in (0, 7, 40, 33, 1)]
    arr = pa.array(batch, type=pa.list_(pa.int32()))
    for lto in (False, True):
        want = lossmask.label_batch(arr, m, backend="numpy", last_turn_only=lto)
        program = mlx_kernel.compiled_program(m, lto)
        for _ in range(2):
            got = lossmask.label_batch(arr, m, backend="mlx", last_turn_only=lto)
            assert got.labels.equals(want.labels)
            np.testing.assert_array_equal(got.outcomes, want.outcomes)
        assert len(program.seen) == 1


def test_one_huge_row_and_numpy_padded_input_equal_numba():
    rng = np.random.default_rng(3)
    m = Markers(response=[[1, 2, 3]], instruction=[[1]], end=[[4]], mask_out=[[2, 2]])
    row = rng.integers(0, 6, 300_000).astype(np.int64)
    arr = pa.array([row, None, row[:11]], type=pa.large_list(pa.int64()))
    for lto in (False, True):
        want = lossmask.label_batch(arr, m, backend="numba", last_turn_only=lto)
        got = lossmask.label_batch(arr, m, backend="mlx", last_turn_only=lto)
        assert got.labels.equals(want.labels)
        np.testing.assert_array_equal(got.outcomes, want.outcomes)
    ids = np.stack([row[:500], row[500:1000]])
    lengths = np.array([500, 123])
    np.testing.assert_array_equal(
        lossmask.make_labels(ids, m, backend="mlx", lengths=lengths),
        lossmask.make_labels(ids, m, backend="numba", lengths=lengths),
    )


def test_negative_id_is_reported_with_its_row():
    with pytest.raises(ValueError, match="row 2 holds the negative token id -1 at position 0"):
        lossmask.make_labels([[1], [], [-1, 1]], Markers(response=[[1]]), backend="mlx")


def test_bucket_limits_widths():
    widths = {mlx_kernel.bucket(n) for n in range(1, 5000)}
    assert len(widths) < 60
    assert all(mlx_kernel.bucket(n) >= n and mlx_kernel.bucket(n) <= max(64, n * 1.125) for n in range(1, 5000))
