"""An output the user chooses: which input columns are written beside the token columns (``keep_columns``), and a
compact trained mask (``labels_column=None`` with ``completion_mask``) that carries exactly what labels carry."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
import pyarrow.parquet as pq
import pytest

import lossmask
from lossmask import MaskOptions
from lossmask.cli import main

from conftest import tokenizer_path

CHATS = Path(__file__).resolve().parent.parent / "examples" / "chats.jsonl"
FAMILY = "qwen2.5"


def _chats(tmp_path: Path, rows: int = 40) -> Path:
    """The example chats with an ``id`` and a ``source`` column beside ``messages``, as a Parquet file."""
    table = pj.read_json(CHATS).slice(0, rows)
    table = table.append_column("id", pa.array(range(table.num_rows))).append_column(
        "source", pa.array(["a", "b"] * (table.num_rows // 2) + ["a"] * (table.num_rows % 2)))
    path = tmp_path / "chats.parquet"
    pq.write_table(table, path)
    return path


def _mask(source: Path, out: Path, **fields) -> tuple[pa.Table, lossmask.MaskReport]:
    report = lossmask.mask_files(str(source), str(out), tokenizer=str(tokenizer_path(FAMILY)), progress=False, **fields)
    return pq.read_table(out), report


def _flat(column: pa.ChunkedArray) -> np.ndarray:
    return pc.list_flatten(column.combine_chunks()).to_numpy(zero_copy_only=False)


def _offsets(column: pa.ChunkedArray) -> np.ndarray:
    return pc.list_value_length(column.combine_chunks()).to_numpy(zero_copy_only=False)


def test_the_default_output_keeps_every_input_column_first(tmp_path):
    out, _ = _mask(_chats(tmp_path), tmp_path / "out.parquet")
    assert out.column_names == ["messages", "id", "source", "input_ids", "labels"]


def test_keep_columns_writes_only_the_input_columns_named_in_the_input_order(tmp_path):
    source = _chats(tmp_path)
    default, _ = _mask(source, tmp_path / "default.parquet")
    out, _ = _mask(source, tmp_path / "out.parquet", keep_columns=["source", "id"])
    assert out.column_names == ["id", "source", "input_ids", "labels"]
    for name in out.column_names:
        assert out.column(name).equals(default.column(name))


def test_no_input_column_leaves_only_the_token_columns_with_the_same_ids_and_labels(tmp_path):
    source = _chats(tmp_path)
    default, default_report = _mask(source, tmp_path / "default.parquet")
    out, report = _mask(source, tmp_path / "out.parquet", keep_columns=[])
    assert out.column_names == ["input_ids", "labels"]
    assert out.column("input_ids").equals(default.column("input_ids"))
    assert out.column("labels").equals(default.column("labels"))
    assert report.tokens_trained == default_report.tokens_trained
    assert report.rows_out == default_report.rows_out


def test_source_column_is_counted_even_when_it_is_not_written(tmp_path):
    source = _chats(tmp_path)
    _, default_report = _mask(source, tmp_path / "default.parquet", source_column="source")
    _, report = _mask(source, tmp_path / "out.parquet", source_column="source", keep_columns=[])
    assert report.weights_by_source == default_report.weights_by_source
    assert set(report.weights_by_source) == {"a", "b"}


def test_dropped_rows_kept_with_keep_dropped_come_without_the_dropped_columns(tmp_path):
    source = _chats(tmp_path, rows=120)  # rows 63.. hold an empty chat and chats with no answer
    default, default_report = _mask(source, tmp_path / "default.parquet", keep_dropped=True)
    out, report = _mask(source, tmp_path / "out.parquet", keep_dropped=True, keep_columns=["id"])
    assert default_report.rows_dropped > 0
    assert out.column_names == ["id", "input_ids", "labels"]
    assert out.num_rows == default.num_rows
    assert out.column("id").equals(default.column("id"))
    assert out.column("labels").equals(default.column("labels"))


@pytest.mark.parametrize("kind", ["prompt_completion", "alpaca", "input_ids"])
def test_every_input_kind_drops_its_passthrough_columns(tmp_path, kind):
    if kind == "prompt_completion":
        table = pa.table({"prompt": ["The sky is", "Two and two"], "completion": [" blue.", " make four."], "id": [1, 2]})
    elif kind == "alpaca":
        table = pa.table({"instruction": ["Name a colour.", "Add 2 and 2."], "input": ["", ""],
                          "output": ["Blue.", "4."], "id": [1, 2]})
    else:
        table = pa.table({"input_ids": pa.array([[1, 2, 3], [4, 5]], pa.list_(pa.int32())), "id": [1, 2]})
    source = tmp_path / "in.parquet"
    pq.write_table(table, source)
    # (ids that hold no response marker train nothing: kept, as dropped rows, to compare)
    default, _ = _mask(source, tmp_path / "default.parquet", keep_dropped=True, max_drop_fraction=1.0)
    out, _ = _mask(source, tmp_path / "out.parquet", keep_columns=[], keep_dropped=True, max_drop_fraction=1.0)
    # given ids are a token column: kept whatever keep_columns says
    assert out.column_names == ["input_ids", "labels"]
    assert out.column("labels").equals(default.column("labels"))
    assert out.column("input_ids").equals(default.column("input_ids"))


def test_the_compact_mask_is_the_labels_trained_flags_bit_for_bit(tmp_path):
    source = _chats(tmp_path, rows=120)
    default, default_report = _mask(source, tmp_path / "default.parquet")
    out, report = _mask(source, tmp_path / "out.parquet", labels_column=None, completion_mask=True, keep_columns=[])
    assert out.schema == pa.schema([("input_ids", pa.list_(pa.int32())), ("completion_mask", pa.list_(pa.int8()))])
    assert out.column("input_ids").equals(default.column("input_ids"))
    assert np.array_equal(_offsets(out.column("completion_mask")), _offsets(default.column("labels")))
    expected = (_flat(default.column("labels")) != -100).astype(np.int8)
    assert np.array_equal(_flat(out.column("completion_mask")), expected)
    # the report counts what trains from the labelling, whichever columns carry it
    assert report.tokens_trained == default_report.tokens_trained == int(expected.sum())
    assert "tokens trained" in report.summary()


def test_int32_labels_hold_the_same_values(tmp_path):
    source = _chats(tmp_path)
    default, _ = _mask(source, tmp_path / "default.parquet")
    out, _ = _mask(source, tmp_path / "out.parquet", label_dtype="int32")
    assert out.schema.field("labels").type == pa.list_(pa.int32())
    assert np.array_equal(_flat(out.column("labels")), _flat(default.column("labels")))


def test_the_compact_mask_goes_with_weights_when_they_are_written(tmp_path):
    source = _chats(tmp_path)
    out, _ = _mask(source, tmp_path / "out.parquet", labels_column=None, completion_mask=True, loss_weights=True,
                   keep_columns=[])
    assert out.column_names == ["input_ids", "completion_mask", "loss_weights"]
    assert np.array_equal(_flat(out.column("loss_weights")) > 0, _flat(out.column("completion_mask")) == 1)


def test_a_column_the_input_lacks_is_refused_naming_it_and_the_columns_it_has(tmp_path):
    with pytest.raises(ValueError, match=r"keep_columns names 'sorce', which the input does not have; its columns are "
                                         r"\['messages', 'id', 'source'\]"):
        _mask(_chats(tmp_path), tmp_path / "out.parquet", keep_columns=["id", "sorce"])
    assert not (tmp_path / "out.parquet").exists()


def test_no_labels_without_a_completion_mask_is_refused_saying_what_to_pass():
    with pytest.raises(ValueError, match=r"pass completion_mask=True too \(--labels-column none --completion-mask\)"):
        MaskOptions(labels_column=None)
    with pytest.raises(TypeError, match="keep_columns"):
        MaskOptions(keep_columns=[1])
    assert MaskOptions(keep_columns="id, source").keep_columns == ("id", "source")
    assert MaskOptions(keep_columns="").keep_columns == ()


def test_the_command_line_writes_the_output_chosen(tmp_path, capsys):
    source = _chats(tmp_path)
    out = tmp_path / "out.parquet"
    assert main(["mask", str(source), str(out), "--tokenizer", str(tokenizer_path(FAMILY)), "--no-progress",
                 "--labels-column", "none", "--completion-mask", "--drop-input-columns", "--show", "1"]) == 0
    assert pq.read_schema(out).names == ["input_ids", "completion_mask"]
    shown = capsys.readouterr().out
    assert "first row of" in shown and "tokens trained" in shown
    assert main(["mask", str(source), str(out), "--tokenizer", str(tokenizer_path(FAMILY)), "--no-progress",
                 "--keep-columns", "id"]) == 0
    assert pq.read_schema(out).names == ["id", "input_ids", "labels"]
    assert main(["mask", str(source), str(out), "--tokenizer", str(tokenizer_path(FAMILY)), "--no-progress",
                 "--keep-columns", "id", "--drop-input-columns"]) == 1
    assert "pass one" in capsys.readouterr().err


def test_preview_of_the_compact_mask_matches_the_labels_preview(tmp_path):
    from lossmask.jobs.stream import preview_rows

    source = _chats(tmp_path)
    _mask(source, tmp_path / "default.parquet")
    _mask(source, tmp_path / "out.parquet", labels_column=None, completion_mask=True)
    assert preview_rows(tmp_path / "out.parquet", None, rows=3, labels_column=None,
                        completion_mask_column="completion_mask") == preview_rows(tmp_path / "default.parquet", None,
                                                                                  rows=3)


def test_hf_mask_dataset_writes_the_output_chosen_and_pad_by_position_reads_it():
    datasets = pytest.importorskip("datasets")
    from lossmask.hf import PadByPosition, mask_dataset

    rows = pj.read_json(CHATS).slice(0, 24)
    dataset = datasets.Dataset(rows.append_column("id", pa.array(range(rows.num_rows))))
    tok = str(tokenizer_path(FAMILY))
    default = mask_dataset(dataset, tok, quiet=True)
    kept = mask_dataset(dataset, tok, keep_columns=["id"], quiet=True)
    assert kept.column_names == ["id", "input_ids", "labels"]
    assert list(kept.features) == kept.column_names
    compact = mask_dataset(dataset, tok, keep_columns=[], labels_column=None, completion_mask=True, quiet=True)
    assert compact.column_names == ["input_ids", "completion_mask"]
    collate = PadByPosition(pad_token_id=0, return_tensors="np")
    ours, theirs = collate([compact[i] for i in range(8)]), collate([default[i] for i in range(8)])
    assert np.array_equal(ours["labels"], theirs["labels"])
    streamed = mask_dataset(dataset.to_iterable_dataset(), tok, keep_columns=["id"], quiet=True)
    assert list(next(iter(streamed))) == ["id", "input_ids", "labels"]


def test_train_on_responses_only_refuses_an_output_without_labels():
    from lossmask.hf import train_on_responses_only

    class Trainer:
        processing_class = None

    with pytest.raises(ValueError, match="labels_column=None cannot apply"):
        train_on_responses_only(Trainer(), tokenizer=str(tokenizer_path(FAMILY)), labels_column=None,
                                completion_mask=True)


def test_the_collator_keeps_the_rows_compact_mask_as_their_labels(tmp_path):
    pytest.importorskip("torch")
    from lossmask.collator import CompletionCollator

    source = _chats(tmp_path)
    default, _ = _mask(source, tmp_path / "default.parquet")
    compact, _ = _mask(source, tmp_path / "out.parquet", labels_column=None, completion_mask=True)
    markers = lossmask.resolve_markers(str(tokenizer_path(FAMILY))).markers
    collate = CompletionCollator(markers=markers, pad_token_id=0, row_labels="keep")
    ours = collate(compact.select(["input_ids", "completion_mask"]).slice(0, 8).to_pylist())
    theirs = collate(default.select(["input_ids", "labels"]).slice(0, 8).to_pylist())
    assert ours["labels"].equal(theirs["labels"])


def test_the_mlx_feed_reads_the_compact_mask_as_the_labels(tmp_path):
    pytest.importorskip("mlx.core")
    from lossmask import mlx as lm

    source = _chats(tmp_path)
    _mask(source, tmp_path / "default.parquet")
    _mask(source, tmp_path / "out.parquet", labels_column=None, completion_mask=True, keep_columns=[])
    _, labels = lm.read_parquet(tmp_path / "default.parquet")
    ids, from_mask = lm._read_token_table(tmp_path / "out.parquet")[:2]
    assert np.array_equal(_flat(pa.chunked_array([from_mask])), _flat(pa.chunked_array([labels])))


def test_trl_trains_what_the_compact_mask_says_with_completion_only_loss(tmp_path):
    datasets = pytest.importorskip("datasets")
    transformers = pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    pytest.importorskip("torch")
    from lossmask.hf import mask_dataset

    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_path(FAMILY)), local_files_only=True)
    dataset = datasets.Dataset(pj.read_json(CHATS).slice(0, 8))
    default = mask_dataset(dataset, str(tokenizer_path(FAMILY)), quiet=True)
    compact = mask_dataset(dataset, str(tokenizer_path(FAMILY)), keep_columns=[], labels_column=None,
                           completion_mask=True, quiet=True)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=2048))
    # TRL reads completion_mask only with completion_only_loss=True: its default is decided from prompt/completion
    # columns, which this output has none of (docs/inputs.md, "The output's columns")
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to=[],
                         use_cpu=True, save_strategy="no", disable_tqdm=True, completion_only_loss=True)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=compact, processing_class=tok)
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    batch = trainer.data_collator(rows)
    for r, row in enumerate(default):
        n = len(row["input_ids"])
        assert batch["labels"][r, :n].tolist() == row["labels"]


def test_an_input_column_left_out_may_share_a_name_with_an_output_column(tmp_path):
    source = _chats(tmp_path)
    first, _ = _mask(source, tmp_path / "first.parquet")
    stale = first.drop_columns(["input_ids"]).set_column(first.column_names.index("labels") - 1, "labels",
                                                           pa.array([[0]] * first.num_rows))
    pq.write_table(stale, tmp_path / "stale.parquet")
    with pytest.raises(ValueError, match=r"already has column\(s\) \['labels'\].*or leave them out"):
        _mask(tmp_path / "stale.parquet", tmp_path / "out.parquet")
    again, _ = _mask(tmp_path / "stale.parquet", tmp_path / "out.parquet", keep_columns=["messages", "id"])
    assert again.column_names == ["messages", "id", "input_ids", "labels"]
    assert again.column("labels").equals(first.column("labels"))


def test_hf_features_follow_the_new_column_where_a_stale_one_of_its_name_is_left_out():
    datasets = pytest.importorskip("datasets")
    from lossmask.hf import mask_dataset

    rows = pj.read_json(CHATS).slice(0, 12)
    stale = datasets.Dataset(rows.append_column("labels", pa.array([["old"]] * rows.num_rows)))
    out = mask_dataset(stale, str(tokenizer_path(FAMILY)), keep_columns=["messages"], quiet=True)
    assert out.features["labels"] == datasets.Features.from_arrow_schema(
        pa.schema([("labels", pa.list_(pa.int64()))]))["labels"]
    assert out.features["messages"] == stale.features["messages"]
