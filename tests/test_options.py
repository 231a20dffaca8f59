"""MaskOptions: one checked value for every masking entry point."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lossmask
from lossmask import MaskOptions

MARKERS = lossmask.Markers(response=[[1, 2]], instruction=[[1, 3]], end=[[4]])


def test_resolve_takes_fields_and_the_completion_mask_shorthand():
    assert MaskOptions.resolve() == MaskOptions()
    options = MaskOptions.resolve(max_length=8, completion_mask=True)
    assert options.max_length == 8 and options.completion_mask_column == "completion_mask"
    assert MaskOptions.resolve(options, keep_dropped=True) == MaskOptions(max_length=8, completion_mask_column="completion_mask",
                                                                         keep_dropped=True)
    assert MaskOptions.resolve(options) is options


@pytest.mark.parametrize("fields, message", [
    ({"max_lenght": 8}, "unknown masking option"),
    ({"batch_size": 0}, "batch_size=0"),
    ({"max_drop_fraction": 1.5}, "max_drop_fraction=1.5"),
    ({"label_dtype": "float32"}, "label_dtype='float32'"),
    ({"completion_mask": 3}, "completion_mask=3"),
])
def test_bad_options_name_the_problem(fields, message):
    with pytest.raises((TypeError, ValueError), match=message):
        MaskOptions.resolve(**fields)


def test_mask_files_takes_the_options_object(tmp_path):
    ids = pa.array([[1, 3, 9, 4, 1, 2, 7, 8, 4], [5, 6]], type=pa.list_(pa.int32()))
    pq.write_table(pa.table({"input_ids": ids}), tmp_path / "in.parquet")
    options = MaskOptions(keep_dropped=True, max_drop_fraction=1.0, completion_mask_column="mask")
    report = lossmask.mask_files(tmp_path / "in.parquet", tmp_path / "out.parquet", markers=MARKERS, options=options)
    out = pq.read_table(tmp_path / "out.parquet")
    assert report.rows_out == 2 and out.column("mask").to_pylist()[0] == [0, 0, 0, 0, 0, 0, 1, 1, 1]
    with pytest.raises(TypeError, match="unknown masking option"):
        lossmask.mask_files(tmp_path / "in.parquet", tmp_path / "x.parquet", markers=MARKERS, keepdropped=True)
