"""Every public path from messages gives the guarantees of ``mask_files``: the conversation-shape policy and the
role invariant, with the rows the markers cannot tell apart labelled from their rendering.

Two rows, each on the real template that mislabels it under the markers alone:

- Falcon, an empty assistant message between two user messages: the markers would train the user text after it
  ("User: Now say something."), since Falcon's turns have no stop token;
- DeepSeek-V3, a tool call right after a tool result: the template writes no assistant header before it, so the
  markers would leave the call untrained. TRL trains it; so does every path here.

Paths: ``ChatTokenizer.encode_chats`` then ``label_batch`` / ``make_labels``, the mlx-lm feed, ``hf.mask_dataset``
(and the collator on its output), the ``train_on_responses_only`` drop-in, and Ray.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

import lossmask
from conftest import chat_tokenizer, tokenizer_path
from test_conversation_shapes import TOOL_AFTER_TOOL  # DeepSeek-V3 writes no header before its second call

U = lambda text: {"role": "user", "content": text}  # noqa: E731
A = lambda text: {"role": "assistant", "content": text}  # noqa: E731


FALCON_EMPTY_REPLY = [U("Say nothing."), A(""), U("Now say something."), A("Something.")]
PLAIN = [U("What is 2 + 2?"), A("It is 4.")]
CASES = {"falcon": FALCON_EMPTY_REPLY, "deepseek-v3": TOOL_AFTER_TOOL}


def _assert_trained_as_trl(family: str, trained: str) -> None:
    """The oracle: what trains in the row of ``family`` (its trained tokens decoded)."""
    if family == "falcon":
        assert "Now say something" not in trained and "User" not in trained and "Say nothing" not in trained, trained
        assert trained.strip() == "Something.", trained
    else:  # both calls train, each through its stop token, and the answer; no tool result, no user text
        assert '"city": "Paris"' in trained and '"city": "Rome"' in trained, trained
        assert "Paris is sunny and Rome is cloudy." in trained and trained.count("<｜end▁of▁sentence｜>") == 3, trained
        assert "Sunny" not in trained and "Cloudy" not in trained and "Weather" not in trained, trained


def _decode(family: str, ids, trained) -> str:
    return chat_tokenizer(family).decode([int(t) for t, keep in zip(ids, trained) if keep])


def _markers(family: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Falcon's no-stop-token note
        return lossmask.detect_markers(chat_tokenizer(family))


@pytest.mark.parametrize("family", sorted(CASES))
def test_encode_chats_then_label_batch_keeps_the_roles(family):
    ct, markers = chat_tokenizer(family), _markers(family)
    encoded = ct.encode_chats([CASES[family], PLAIN])
    labelled = lossmask.label_batch(encoded, markers)
    assert labelled.rejected == ()
    ids, labels = encoded.input_ids.to_pylist(), labelled.labels.to_pylist()
    _assert_trained_as_trl(family, _decode(family, ids[0], [label != -100 for label in labels[0]]))
    assert _decode(family, ids[1], [label != -100 for label in labels[1]]).strip().startswith("It is 4.")
    assert lossmask.make_labels(encoded, markers).to_pylist() == labels
    if family == "falcon":  # the shape policy ran: the empty reply dropped, the two user messages merged
        assert encoded.shapes == {"empty_messages_dropped": 1, "roles_merged": 1}
    else:  # the markers leave the second call untrained: the row is labelled from its rendering
        assert labelled.from_rendering == (0,)


def test_encode_chats_with_the_shape_policy_off_labels_the_falcon_row_from_its_rendering():
    ct, markers = chat_tokenizer("falcon"), _markers("falcon")
    encoded = ct.encode_chats([FALCON_EMPTY_REPLY], options=lossmask.MaskOptions(empty_messages="keep"))
    assert encoded.shapes == {}
    labelled = lossmask.label_batch(encoded, markers)
    assert labelled.from_rendering == (0,) and labelled.rejected == ()
    _assert_trained_as_trl("falcon", _decode("falcon", encoded.input_ids[0].as_py(),
                                             [label != -100 for label in labelled.labels[0].as_py()]))


def test_encode_chats_rows_that_even_the_rendering_cannot_label_are_null_and_named():
    """An opening assistant message on DeepSeek-V3.1 has no header and nothing before it to render a prompt from."""
    ct, markers = chat_tokenizer("deepseek-v3.1"), _markers("deepseek-v3.1")
    opening = [A("Sure, here is the rest."), U("Thanks."), A("It reads the file.")]
    encoded = ct.encode_chats([opening, PLAIN], options=lossmask.MaskOptions(leading_assistant="keep"))
    labelled = lossmask.label_batch(encoded, markers)
    assert [r for r, _, _ in labelled.rejected] == [0] and labelled.rejected[0][1] == "template_breaks_roles"
    assert "message 0 (assistant) and does not train" in labelled.rejected[0][2]
    assert labelled.labels[0].as_py() is None and labelled.keep.tolist() == [False, True]


@pytest.mark.parametrize("family", sorted(CASES))
def test_mlx_feed_keeps_the_roles(family, tmp_path):
    from lossmask.mlx import load_dataset

    with open(tmp_path / "train.jsonl", "w", encoding="utf-8") as fh:
        for chat in (CASES[family], PLAIN):
            fh.write(json.dumps({"messages": chat}) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train, _, _ = load_dataset(tmp_path, tokenizer_path(family))
    assert len(train) == 2 and train.labelled_from_rendering == (1 if family == "deepseek-v3" else 0)
    a, b = int(train.offsets[0]), int(train.offsets[1])
    _assert_trained_as_trl(family, _decode(family, train.values[a:b], train.trained_values[a:b]))


def _messages_dataset(family):
    from datasets import Dataset

    # datasets stores messages of varying keys as JSON: as a Hub dataset of tool calls is read
    return Dataset.from_dict({"messages": [json.dumps(CASES[family]), json.dumps(PLAIN)]}).map(
        lambda row: {"chat": json.loads(row["messages"])}, remove_columns=["messages"]).rename_column("chat", "messages")


@pytest.mark.parametrize("family", sorted(CASES))
def test_hf_mask_dataset_and_the_collator_on_it_keep_the_roles(family):
    pytest.importorskip("datasets")
    torch = pytest.importorskip("torch")
    from lossmask.collator import CompletionCollator
    from lossmask.hf import mask_dataset

    masked, report = mask_dataset(_messages_dataset(family), chat_tokenizer(family), verbose=False, return_report=True)
    assert masked.num_rows == 2 and report.labelled_from_rendering == (1 if family == "deepseek-v3" else 0)
    ids, labels = masked[0]["input_ids"], masked[0]["labels"]
    _assert_trained_as_trl(family, _decode(family, ids, [label != -100 for label in labels]))
    batch = CompletionCollator(markers=_markers(family), tokenizer=chat_tokenizer(family).tokenizer,
                               row_labels="keep")([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in masked])
    got = batch["labels"][0, : len(ids)]
    assert torch.equal(got, torch.tensor(labels))


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("family", sorted(CASES))
def test_train_on_responses_only_keeps_the_roles(family, padding_free, tmp_path):
    """The drop-in on TRL's SFTTrainer: the dataset's labels and, padded or padding-free, the collated batch's."""
    pytest.importorskip("datasets")
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    from lossmask.hf import train_on_responses_only

    tok = chat_tokenizer(family).tokenizer
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512)
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to=[],
                         use_cpu=True, save_strategy="no", disable_tqdm=True, padding_free=padding_free,
                         **({"max_length": None} if padding_free else {}))  # TRL: padding-free rows are not cut
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's notes on padding-free attention and Falcon's stop token
        trainer = trl.SFTTrainer(model=transformers.LlamaForCausalLM(config), args=args,
                                 train_dataset=_messages_dataset(family), processing_class=tok)
        train_on_responses_only(trainer, verbose=False)
    row = trainer.train_dataset[0]
    _assert_trained_as_trl(family, _decode(family, row["input_ids"], [label != -100 for label in row["labels"]]))
    batch = trainer.data_collator([{"input_ids": row["input_ids"], "labels": row["labels"]}])
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    # the collator's labels are the row's, but for the first token, which nothing predicts
    assert labels[1 : len(row["labels"])] == list(row["labels"][1:]), (family, padding_free)


def test_ray_mask_dataset_keeps_the_roles(local_ray):
    ray = local_ray
    import lossmask.ray

    for family in sorted(CASES):
        ds = ray.data.from_items([{"messages": json.dumps(CASES[family])}]).map(
            lambda row: {"messages": json.loads(row["messages"])})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            masked, report = lossmask.ray.mask_dataset(ds, tokenizer=chat_tokenizer(family), batch_size=10)
        rows = list(masked.iter_rows())
        assert len(rows) == 1 and report.rows_out == 1, report.summary()
        assert report.labelled_from_rendering == (1 if family == "deepseek-v3" else 0)
        trained = [label != -100 for label in rows[0]["labels"]]
        _assert_trained_as_trl(family, _decode(family, rows[0]["input_ids"], trained))
