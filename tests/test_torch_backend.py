"""The torch backend equals the reference (SPEC.md) bit for bit, through every entry point."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lossmask
from lossmask import Markers

torch = pytest.importorskip("torch")
from lossmask.engine.kernels import reference, torch_kernel  # noqa: E402

from backend_cases import as_arrow, markers, padded, rows, value_types  # noqa: E402

SETTINGS = settings(max_examples=60, deadline=None)


@SETTINGS
@given(batch=rows, m=markers(), value_type=value_types, last_turn_only=st.booleans())
def test_label_batch_equals_reference(batch, m, value_type, last_turn_only):
    arr = as_arrow(batch, value_type)
    want = lossmask.label_batch(arr, m, backend="numpy", last_turn_only=last_turn_only)
    got = lossmask.label_batch(arr, m, backend="torch", last_turn_only=last_turn_only)
    assert got.labels.equals(want.labels)
    np.testing.assert_array_equal(got.outcomes, want.outcomes)
    np.testing.assert_array_equal(got.trained_tokens, want.trained_tokens)
    mask = lossmask.trainable_mask(arr, m, backend="torch", last_turn_only=last_turn_only)
    assert mask.equals(lossmask.trainable_mask(arr, m, backend="numpy", last_turn_only=last_turn_only))


def _reference_rows(batch, m, last_turn_only):
    return [
        np.where(reference.trained_positions(np.asarray(r or [], dtype=np.int64), m, last_turn_only=last_turn_only)[0],
                 np.asarray(r or [], dtype=np.int64), -100)
        for r in batch
    ]


@SETTINGS
@given(batch=rows, m=markers(), last_turn_only=st.booleans(), side=st.sampled_from(["right", "left"]))
def test_label_padded_equals_reference(batch, m, last_turn_only, side):
    ids, lengths = padded(batch)
    if side == "left":  # move each row's tokens to the right end
        width = ids.shape[1]
        idx = (np.arange(width)[None, :] - (width - lengths)[:, None]) % width
        ids = np.take_along_axis(ids, idx, axis=1)
    want = _reference_rows(batch, m, last_turn_only)
    ids_t, lengths_t = torch.from_numpy(ids), torch.from_numpy(lengths)
    by_lengths = torch_kernel.label_padded(ids_t, m, lengths=lengths_t, padding_side=side, last_turn_only=last_turn_only)
    span = np.arange(ids.shape[1])[None, :]
    attn = (span < lengths[:, None]) if side == "right" else (span >= ids.shape[1] - lengths[:, None])
    by_mask = torch_kernel.label_padded(ids_t, m, attention_mask=torch.from_numpy(attn.astype(np.int64)),
                                        last_turn_only=last_turn_only)
    for labels in (by_lengths.numpy(), by_mask.numpy()):
        for r, row in enumerate(want):
            real = labels[r, : len(row)] if side == "right" else labels[r, ids.shape[1] - len(row):]
            np.testing.assert_array_equal(real, row)
            assert (labels[r] != -100).sum() == (row != -100).sum()  # padding never trained


@SETTINGS
@given(batch=rows, m=markers(), pad=st.integers(0, 5))
def test_label_segments_equals_reference(batch, m, pad):
    batch = [r or [] for r in batch]
    flat = np.array([t for r in batch for t in r] + [0] * pad, dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum([len(r) for r in batch])]).astype(np.int32)
    got = torch_kernel.label_segments(torch.from_numpy(flat), torch.from_numpy(cu), m).numpy()
    want = np.concatenate(_reference_rows(batch, m, False) + [np.full(pad, -100)]).astype(np.int64)
    np.testing.assert_array_equal(got, want)


def test_rows_out_of_order_with_gaps():
    m = Markers(response=[[1, 2]], instruction=[[1]], end=[[4]])
    values = np.array([1, 2, 7, 4, 9, 1, 2, 1, 2, 8, 8], dtype=np.int32)
    starts, ends = np.array([5, 0, 4, 4]), np.array([11, 3, 4, 5])  # position 3 lies in no row
    outs = []
    for backend in (reference, torch_kernel):
        out = np.full(values.shape, -7, dtype=np.int64)
        result = backend.label_rows(values, starts, ends, m, last_turn_only=False, ignore_index=-100, out=out,
                                    write_mask=False)
        outs.append((out, *result))
    for want, got in zip(*outs):
        np.testing.assert_array_equal(got, want)
    assert outs[1][0][3] == -7  # left alone


def test_one_huge_row_equals_numba():
    rng = np.random.default_rng(5)
    m = Markers(response=[[1, 2, 3]], instruction=[[1]], end=[[4]], mask_out=[[2, 2]])
    row = rng.integers(0, 6, 300_000).astype(np.int32)
    arr = pa.array([row, [], row[:17]], type=pa.list_(pa.int32()))
    for lto in (False, True):
        want = lossmask.label_batch(arr, m, backend="numba", last_turn_only=lto)
        got = lossmask.label_batch(arr, m, backend="torch", last_turn_only=lto, dtype="int32")
        assert got.labels.cast(want.labels.type).equals(want.labels)
        np.testing.assert_array_equal(got.trained_tokens, want.trained_tokens)


def test_negative_id_is_reported_with_its_row():
    m = Markers(response=[[1]])
    with pytest.raises(ValueError, match="row 1 holds the negative token id -100 at position 2"):
        lossmask.make_labels([[1, 2], [1, 2, -100]], m, backend="torch")
    ids = torch.tensor([[1, 2, 3], [1, -1, 0]])
    with pytest.raises(ValueError, match="row 1 holds the negative token id -1 at position 1"):
        torch_kernel.label_padded(ids, m, lengths=torch.tensor([3, 2]))
    # padding is never read: a negative id there is fine
    torch_kernel.label_padded(ids, m, lengths=torch.tensor([3, 1]))


def test_padded_argument_errors():
    m = Markers(response=[[1]])
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(TypeError, match="exactly one of lengths"):
        torch_kernel.label_padded(ids, m)
    with pytest.raises(ValueError, match="outside \\[0, 3\\]"):
        torch_kernel.label_padded(ids, m, lengths=torch.tensor([4]))
    with pytest.raises(ValueError, match="padding_side='middle'"):
        torch_kernel.label_padded(ids, m, lengths=torch.tensor([2]), padding_side="middle")
    with pytest.raises(ValueError, match="holes"):
        torch_kernel.label_padded(ids, m, attention_mask=torch.tensor([[1, 0, 1]]))


def test_gpu_check_script_runs_its_cpu_fallback():
    """benchmarks/gpu_check.py labels on CUDA when there is one; here it must say so and pass on the CPU."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
    done = subprocess.run([sys.executable, str(script), "--rows", "24"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    if not torch.cuda.is_available():
        assert "did NOT run on a GPU" in done.stdout
    assert "all equal to numba" in done.stdout
