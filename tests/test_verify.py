"""The ground truth (no markers involved) on real templates, and verify's report of markers against it."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import chat_tokenizer
from lossmask import Markers, VerifyReport, verify
from lossmask.chat.probes import Conversation, probe_conversations
from lossmask.markers.verify import ground_truth, locate_messages

CHAT = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Spain?"},
    {"role": "assistant", "content": "Madrid.", "thinking": "Spain: Madrid.", "reasoning_content": "Spain: Madrid."},
]


def trained_spans(truth) -> list[str]:
    """The rendered text of each run of tokens the ground truth trains."""
    out, k, n = [], 0, len(truth.ids)
    while k < n:
        if truth.should_train[k]:
            j = k
            while j < n and truth.should_train[j]:
                j += 1
            out.append(truth.text[truth.offsets[k, 0] : truth.offsets[j - 1, 1]])
            k = j
        else:
            k += 1
    return out


@pytest.mark.parametrize(
    "family, expected",
    [
        ("chatml", ["Paris.<|im_end|>", "Madrid.<|im_end|>"]),
        # the last turn gets a think block from the template; the model generates it, so it trains
        ("qwen3", ["Paris.<|im_end|>", "<think>\nSpain: Madrid.\n</think>\n\nMadrid.<|im_end|>"]),
        # generation stops only at <|return|>/<|call|>: the second '<|start|>assistant' is generated, so it trains
        ("gpt-oss", [
            "<|channel|>final<|message|>Paris.<|end|>",
            "<|channel|>analysis<|message|>Spain: Madrid.<|end|><|start|>assistant<|channel|>final<|message|>Madrid.<|return|>",
        ]),
        # no end-of-turn token: the next role token stops generation; the last turn has no stop
        ("glm-4", ["\n<think></think>\nParis.<|user|>", "\n<think>Spain: Madrid.</think>\nMadrid."]),
        ("llama-2", [" Paris. </s>", " Madrid. </s>"]),
        ("mistral-v1", [" Paris.</s>", " Madrid.</s>"]),
        ("falcon", [" Paris.", " Madrid."]),  # plain-text roles, no stop token at all
        ("deepseek-v3.1", ["Paris.<｜end▁of▁sentence｜>", "Madrid.<｜end▁of▁sentence｜>"]),
        ("llama-3", ["Paris.<|eot_id|>", "Madrid.<|eot_id|>"]),
    ],
)
def test_ground_truth_trains_what_the_model_generates(family, expected):
    assert trained_spans(ground_truth(chat_tokenizer(family), CHAT)) == expected


def test_phi35_trains_end_not_the_final_endoftext():
    truth = ground_truth(chat_tokenizer("phi-3.5"), CHAT)
    ct = chat_tokenizer("phi-3.5")
    trained = [ct.decode([t]) for t in truth.ids[truth.should_train]]
    assert trained.count("<|end|>") == 2 and "<|endoftext|>" not in trained
    assert truth.text.endswith("<|endoftext|>")


def test_ground_truth_masks_system_user_and_tool_turns():
    ct = chat_tokenizer("qwen2.5")
    tool = next(p for p in probe_conversations() if p.name == "tool")
    truth = ground_truth(ct, tool)
    spans = trained_spans(truth)
    assert spans[0].startswith("<tool_call>") and spans[0].endswith("</tool_call><|im_end|>")
    assert not any("minus three" in s or "weather in Oslo?" in s or "You are Qwen" in s for s in spans)


def test_locate_messages_in_order_skipping_dropped_ones():
    text = "<s>U: hi there\nA: hi\nU: bye"
    messages = [{"role": "system", "content": "dropped"}, {"role": "user", "content": "hi there"},
                {"role": "assistant", "content": " hi\n"}, {"role": "user", "content": "  bye "}]
    # as written when the template keeps it, stripped when it trims; a dropped message is None
    assert locate_messages(text, messages) == [None, (6, 14), (17, 21), (24, 27)]


def _qwen_markers(ct, *, end=True, instruction=()):
    header = ct.encode("<|im_start|>assistant\n")
    return Markers(response=[header], end=[ct.encode("<|im_end|>")] if end else (), instruction=instruction)


def test_verify_accepts_exact_markers_on_given_conversations():
    ct = chat_tokenizer("qwen2.5")
    report = verify(ct, _qwen_markers(ct), [CHAT, {"messages": CHAT[:2]}, Conversation("named", tuple(CHAT))])
    assert isinstance(report, VerifyReport) and report.ok and bool(report)
    assert report.missing == report.extra == 0 and report.tokens > 0
    assert [c.name for c in report.conversations] == ["conversation 0", "conversation 1", "named"]
    assert "exact" in str(report)


def test_verify_reports_missing_variants_of_tokenised_strings():
    """The header tokenised on its own misses the in-context variants ('\\n\\n' merges with content)."""
    ct = chat_tokenizer("qwen2.5")
    report = verify(ct, _qwen_markers(ct))
    assert not report.ok and report.missing > 0 and report.extra == 0
    text = str(report)
    assert "MISMATCH" in text and "missing at token" in text and "boundary" in text


def test_verify_reports_extra_tokens_without_an_end_pattern():
    ct = chat_tokenizer("qwen2.5")
    report = verify(ct, _qwen_markers(ct, end=False, instruction=[ct.encode("<|im_start|>")]), [CHAT])
    assert not report.ok and report.missing == 0
    assert report.extra == 2  # the '\n' after each <|im_end|>
    extra = report.conversations[0].extra
    assert [ct.decode([int(report.conversations[0].truth.ids[k])]) for k in extra] == ["\n", "\n"]


def test_verify_conversation_the_template_rejects_is_not_checkable():
    ct = chat_tokenizer("gemma-2")
    markers = Markers(response=[ct.encode("<start_of_turn>model\n")], end=[ct.encode("<end_of_turn>")])
    report = verify(ct, markers, [[{"role": "system", "content": "s"}, *CHAT], CHAT])
    assert not report.ok and report.errors == 1 and report.conversations[1].exact
    assert "not checked" in str(report) and "System role not supported" in str(report)


def test_verify_argument_errors():
    ct = chat_tokenizer("chatml")
    with pytest.raises(TypeError, match="lossmask.Markers"):
        verify(ct, {"response": [[1]]})
    with pytest.raises(TypeError, match="without 'messages'"):
        verify(ct, Markers(response=[[1]]), [{"msgs": []}])


def test_report_counts_every_token():
    ct = chat_tokenizer("chatml")
    report = verify(ct, _qwen_markers(ct), [CHAT])
    truth = report.conversations[0].truth
    assert report.tokens == len(truth.ids) and report.conversations[0].expected_trained == int(np.sum(truth.should_train))


def test_verify_nothing_is_not_ok():
    ct = chat_tokenizer("chatml")
    report = verify(ct, _qwen_markers(ct), [])
    assert not report.ok and report.summary() == "nothing checked: no conversations"


R1_STYLE = [
    {"role": "user", "content": "Q1?"}, {"role": "assistant", "content": "<think>\nR one\n</think>\n\nA one."},
    {"role": "user", "content": "Q2?"}, {"role": "assistant", "content": "<think>\nR two\n</think>\n\nA two."},
]


@pytest.mark.parametrize(
    "family, expected",
    [
        # the template drops the reasoning of every turn: only what it keeps can train
        ("deepseek-v3", ["\n\nA one.<｜end▁of▁sentence｜>", "\n\nA two.<｜end▁of▁sentence｜>"]),
        # reasoning parsed out of the content, kept in the last turn only, reformatted by GLM
        ("qwen3", ["A one.<|im_end|>", "<think>\nR two\n</think>\n\nA two.<|im_end|>"]),
        ("glm-4", ["\n<think></think>\nA one.<|user|>", "\n<think>R two</think>\nA two."]),
        ("chatml", ["<think>\nR one\n</think>\n\nA one.<|im_end|>", "<think>\nR two\n</think>\n\nA two.<|im_end|>"]),
    ],
)
def test_reasoning_written_in_the_content(family, expected):
    assert trained_spans(ground_truth(chat_tokenizer(family), R1_STYLE)) == expected


def test_dropped_system_prompt_whose_text_reappears_later():
    """Mistral v3 renders the system prompt only when the chat ends with a user turn: the prompt
    before turn 1 holds it, the whole chat does not, and a later message quotes it."""
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q1?"}, {"role": "assistant", "content": "A1."},
        {"role": "user", "content": "Q2: Be brief. Why?"}, {"role": "assistant", "content": "A2."},
    ]
    ct = chat_tokenizer("mistral-v3")
    truth = ground_truth(ct, chat)
    assert "Be brief." not in truth.text.split("Q2")[0]  # dropped before Q2
    assert trained_spans(truth) == [" A1.</s>", " A2.</s>"]


def test_a_reply_whose_whitespace_the_template_rewrites_is_judged_by_its_words():
    """Falcon's template turns blank lines into single newlines: the reply is found with any whitespace
    between its words, as the messages path finds it, and its truth is read off that."""
    ct = chat_tokenizer("falcon")
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "One.\n\nTwo."}]
    truth = ground_truth(ct, conv)
    assert truth.text.endswith("Assistant: One.\nTwo.")
    assert trained_spans(truth) == [" One.\nTwo."]
    from conftest import detected_markers

    report = verify(ct, detected_markers("falcon")[0], [conv])
    assert report.ok and report.errors == 0, str(report)


# -- what a template drops, and messages that quote markers ---------------------------------------


def test_missing_message_text_names_each_dropped_piece():
    from lossmask.markers.content import missing_message_text

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "minus three"},
    ]
    text = 'Weather? get_weather {"city": "Oslo"} minus three'
    missing = missing_message_text(text, messages)
    assert [(m.message, m.role, m.part) for m in missing] == [(0, "system", "content"), (2, "assistant", "reasoning")]
    # arguments re-serialised (a JSON string written through tojson) and trimmed contents still count
    again = missing_message_text('"{\\"city\\": \\"Oslo\\"}" get_weather', messages[2:3])
    assert [(m.message, m.part) for m in again] == [(0, "reasoning")]
    assert missing_message_text("x Weather? y", [{"role": "user", "content": "  Weather?\n"}]) == []


@pytest.mark.parametrize(
    "family, messages, dropped",
    [
        # Qwen2.5 skips a message whose role it does not know
        ("qwen2.5", [{"role": "user", "content": "Hi"}, {"role": "critic", "content": "Be nicer."},
                     {"role": "assistant", "content": "Hello!"}], (1, "critic")),
        # Phi-3 drops tool messages: the answer after them follows an empty assistant turn
        ("phi-3", [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Checking."},
                   {"role": "tool", "content": "minus three"}, {"role": "assistant", "content": "It is cold."}],
         (2, "tool")),
    ],
)
def test_verify_reports_a_message_the_template_drops(family, messages, dropped):
    from conftest import detected_markers

    ct = chat_tokenizer(family)
    markers, _ = detected_markers(family)
    report = verify(ct, markers, [messages])
    assert not report.ok and report.errors == 1
    (conv, missing), = report.dropped
    assert (missing.message, missing.role) == dropped
    assert f"message {dropped[0]} ({dropped[1]})" in str(report)


def test_find_marker_text_flags_rows_that_quote_markers():
    from conftest import detected_markers
    from lossmask.markers.content import find_marker_text

    ct = chat_tokenizer("llama-2")
    markers, _ = detected_markers("llama-2")
    rows = [
        [{"role": "user", "content": "Plain question."}, {"role": "assistant", "content": "Plain answer."}],
        [{"role": "user", "content": "What does [/INST] mean?"}, {"role": "assistant", "content": "A tag."}],
        {"messages": [{"role": "user", "content": "Strike"}, {"role": "assistant", "content": "<s>old</s> new"}]},
    ]
    hits = find_marker_text(rows, ct, markers)
    assert [(h.row, h.message, h.role) for h in hits] == [(1, 0, "user"), (2, 1, "assistant")]
    assert hits[0].marker == "[/INST]" and "</s>" in hits[1].marker or "<s>" in hits[1].marker
    assert find_marker_text(rows[:1], ct, markers) == []


def test_probes_are_labelled_in_the_layout_of_a_jobs_chat_rows(monkeypatch):
    """The kernels compile per dtype: probes labelled as the job's rows are (list<int32>) reuse its variant."""
    import pyarrow as pa

    from conftest import detected_markers
    from lossmask.chat.encode_batch import _as_list32
    from lossmask.engine.kernels import numba_kernel

    seen = []
    real = numba_kernel.label_rows

    def spy(values, starts, ends, *args, **kwargs):
        seen.append((values.dtype, starts.dtype))
        return real(values, starts, ends, *args, **kwargs)

    monkeypatch.setattr(numba_kernel, "label_rows", spy)
    markers, _ = detected_markers("qwen2.5")
    assert verify(chat_tokenizer("qwen2.5"), markers).ok
    rows = _as_list32(pa.array([[1, 2]], type=pa.large_list(pa.int64())))  # what a job's chat rows are cast to
    layout = (np.dtype(rows.type.value_type.to_pandas_dtype()), np.dtype(np.int32))
    assert seen and set(seen) == {layout}
