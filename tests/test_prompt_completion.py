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

import pyarrow as pa
import pytest

from conftest import chat_tokenizer, detected_markers
from lossmask import MaskOptions
from lossmask.engine.tally import Tally
from lossmask.jobs.batch_step import mask_batch

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
