"""Prompt/completion rows labelled as TRL's ``SFTTrainer`` documents them, on real tokenizers (no peer installed).

What TRL documents (``sft_trainer.md``, "Expected dataset type and format" and ``completion_only_loss``):

- a **standard** prompt/completion row is tokenised as the tokenizer's own ``__call__`` tokenises text, so the ids
  open with whatever the tokenizer adds before a text (Gemma's ``<bos>``, Llama-3's and SmolLM3's
  ``<|begin_of_text|>``; nothing on Qwen2.5); the EOS is appended to the completion unless it ends with it; the loss
  is computed on the completion only;
- a **conversational** prompt/completion row (``prompt`` a list of messages, ``completion`` the assistant's
  message) is rendered with the chat template, and ``completion_only_loss`` (on by default for such rows) trains
  the completion only: whatever the prompt holds, assistant turns included, does not train.

lossmask applies its marker rule inside the completion (docs/masking-rule.md): the completion's turn trains through
its stop token; TRL also trains the template's whitespace after it (Qwen's and Gemma's ``\\n``), which lossmask
never does, in any row kind.
"""

from __future__ import annotations

import sys

import pyarrow as pa
import pytest

from conftest import FIXTURES, chat_tokenizer, detected_markers
from lossmask import MaskOptions
from lossmask.engine.tally import Tally
from lossmask.jobs.batch_step import mask_batch

sys.path.insert(0, str(FIXTURES))
from loaded_once import folders_loaded_once  # noqa: E402

sys.path.pop(0)

FAMILIES = ("gemma-3", "smollm3", "qwen2.5", "llama-3.1")
# what each tokenizer's own __call__ puts before a text (its tokenizer.json post-processor)
BOS = {"gemma-3": [2], "smollm3": [128000], "qwen2.5": [], "llama-3.1": [128000]}


def _mask(family: str, table: pa.Table, markers=None, **options) -> pa.Table:
    return mask_batch(table, markers, MaskOptions(**options), Tally(), tokenizer=chat_tokenizer(family),
                      kind="prompt_completion")


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_text_rows_open_with_what_the_tokenizer_adds_before_a_text(family):
    ct = chat_tokenizer(family)
    prompts, completions = ["The sky is", "", "Translate: chat"], [" blue.", "Nothing.", " cat"]
    out = _mask(family, pa.table({"prompt": prompts, "completion": completions}))
    for prompt, completion, ids, labels in zip(prompts, completions, out.column("input_ids").to_pylist(),
                                               out.column("labels").to_pylist()):
        own = list(ct.tokenizer(prompt)["input_ids"])  # the tokenizer's own __call__, as TRL tokenises the prompt
        assert own[:len(BOS[family])] == BOS[family]
        assert ids == own + ct.encode(completion) + [ct.eos_token_id]
        assert labels == [-100] * len(own) + ids[len(own):]  # the BOS and the prompt never train


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_text_rows_never_double_the_bos_or_the_eos(family):
    ct = chat_tokenizer(family)
    bos, eos = ct.tokenizer.bos_token, ct.tokenizer.eos_token
    table = pa.table({"prompt": [(bos or "") + "Hi"], "completion": [" there" + eos]})
    # the special-token strings kept as control tokens: the prompt's own BOS and the completion's own EOS stand
    ids = _mask(family, table, special_tokens_in_content="keep").column("input_ids").to_pylist()[0]
    assert ids == BOS[family] + ct.encode("Hi") + ct.encode(" there") + [ct.eos_token_id]
    # as text (the default), they are the row's words, and the row takes its own BOS and EOS
    ids = _mask(family, table).column("input_ids").to_pylist()[0]
    assert ids[:len(BOS[family]) + 1] != BOS[family] * 2 and ids[-1] == ct.eos_token_id
    assert ids.count(ct.eos_token_id) == 1


HISTORY = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."},
           {"role": "user", "content": "And doubled?"}]
COMPLETION = [{"role": "assistant", "content": "It is 8."}]


def _trl_completion_start(ct, prompt, completion) -> tuple[list[int], int]:
    """TRL's documented split of a conversational row: the ids of prompt + completion rendered by the template, and
    where the completion starts (the end of what they share with the prompt rendered with its generation prompt)."""
    full = list(ct.tokenizer.apply_chat_template(prompt + completion, tokenize=True, return_dict=True)["input_ids"])
    alone = list(ct.tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                                  return_dict=True)["input_ids"])
    shared = next((k for k, (a, b) in enumerate(zip(alone, full)) if a != b), min(len(alone), len(full)))
    return full, shared


@pytest.mark.parametrize("family", FAMILIES)
def test_conversational_rows_train_the_completion_only(family):
    ct = chat_tokenizer(family)
    markers, _ = detected_markers(family)
    table = pa.table({"prompt": [HISTORY, HISTORY[:1]], "completion": [COMPLETION, COMPLETION]})
    out = _mask(family, table, markers)
    for prompt, ids, labels in zip(table.column("prompt").to_pylist(), out.column("input_ids").to_pylist(),
                                   out.column("labels").to_pylist()):
        full, start = _trl_completion_start(ct, prompt, COMPLETION)
        assert ids == full
        trained = [k for k, label in enumerate(labels) if label != -100]
        assert trained and trained[0] >= start  # nothing of the prompt trains, its assistant turn included
        assert ct.decode([ids[k] for k in trained]) == "It is 8." + ct.decode([ids[trained[-1]]])
        # what TRL trains beyond it is the template's whitespace after the stop token, never a word
        assert ct.decode([ids[k] for k in range(start, len(ids)) if labels[k] == -100]).strip() == ""


@pytest.mark.parametrize("family", FAMILIES)
def test_train_prompt_turns_trains_the_row_as_a_messages_row(family):
    markers, _ = detected_markers(family)
    table = pa.table({"prompt": [HISTORY], "completion": [COMPLETION]})
    out = _mask(family, table, markers, train_prompt_turns=True)
    chat = mask_batch(pa.table({"messages": [HISTORY + COMPLETION]}), markers, MaskOptions(), Tally(),
                      tokenizer=chat_tokenizer(family), kind="messages")
    assert out.column("labels").to_pylist() == chat.column("labels").to_pylist()
    trained = [i for i, label in zip(out.column("input_ids").to_pylist()[0], out.column("labels").to_pylist()[0])
               if label != -100]
    assert "It is 4." in chat_tokenizer(family).decode(trained)


def test_a_completion_of_several_messages_trains_each_of_its_assistant_turns():
    ct = chat_tokenizer("qwen2.5")
    markers, _ = detected_markers("qwen2.5")
    call = {"type": "function", "function": {"name": "double", "arguments": {"x": 4}}}
    completion = [{"role": "assistant", "content": "", "tool_calls": [call]},
                   {"role": "tool", "content": "8"}, {"role": "assistant", "content": "It is 8."}]
    out = _mask("qwen2.5", pa.table({"prompt": [HISTORY], "completion": [completion]}), markers)
    ids, labels = out.column("input_ids").to_pylist()[0], out.column("labels").to_pylist()[0]
    text = ct.decode([i for i, label in zip(ids, labels) if label != -100])
    assert "double" in text and "It is 8." in text  # the call and the answer train
    assert "It is 4." not in text and "<tool_response>" not in text  # the prompt's turn and the tool's result do not


def test_a_prompt_without_an_assistant_turn_is_labelled_as_before():
    markers, _ = detected_markers("llama-3.1")
    table = pa.table({"prompt": [HISTORY[:1]], "completion": [COMPLETION]})
    tally = Tally()
    out = mask_batch(table, markers, MaskOptions(), tally, tokenizer=chat_tokenizer("llama-3.1"),
                     kind="prompt_completion")
    chat = mask_batch(pa.table({"messages": [HISTORY[:1] + COMPLETION]}), markers, MaskOptions(), Tally(),
                      tokenizer=chat_tokenizer("llama-3.1"), kind="messages")
    assert out.column("labels").to_pylist() == chat.column("labels").to_pylist()
    assert not tally.weights_by_role  # no row weighed by message: the plain path


def test_cli_train_prompt_turns_trains_the_prompts_assistant_turn(tmp_path):
    import json

    import pyarrow.parquet as pq

    from conftest import tokenizer_path
    from lossmask.cli import main

    with open(tmp_path / "in.jsonl", "w", encoding="utf-8") as out:
        out.write(json.dumps({"prompt": HISTORY, "completion": COMPLETION}) + "\n")
    ct = chat_tokenizer("qwen2.5")
    trained = {}
    for flags in ([], ["--train-prompt-turns"]):
        with folders_loaded_once("qwen2.5"):  # the folder answered by the tokenizer loaded once per test run
            assert main(["mask", str(tmp_path / "in.jsonl"), str(tmp_path / "out.parquet"), "--tokenizer",
                         str(tokenizer_path("qwen2.5")), "--no-progress", *flags]) == 0
        table = pq.read_table(tmp_path / "out.parquet")
        ids, labels = table.column("input_ids").to_pylist()[0], table.column("labels").to_pylist()[0]
        trained[bool(flags)] = ct.decode([i for i, label in zip(ids, labels) if label != -100])
    assert trained == {False: "It is 8.<|im_end|>", True: "It is 4.<|im_end|>It is 8.<|im_end|>"}
