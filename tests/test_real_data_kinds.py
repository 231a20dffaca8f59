"""Kinds of row that real public data holds (BFCL, Glaive, LLaMA-Factory's samples) and peers' dataset forms.

Each test runs on a real tokenizer with its real chat template (``conftest.chat_tokenizer``), on rows written
here in the shape those datasets have; a row the template changes is counted, never labelled silently.
"""

from __future__ import annotations

import json
import warnings

import pyarrow.parquet as pq
import pytest

from conftest import chat_tokenizer
from test_conversation_shapes import _trained_text
from lossmask import mask_files
from lossmask.chat.encode_rendered import encode_rendered
from lossmask.chat.locate import locate_messages

U = lambda text: {"role": "user", "content": text}  # noqa: E731
A = lambda text: {"role": "assistant", "content": text}  # noqa: E731


def _dropped(ct, messages, tools=None, text=None):
    text = ct.render(messages, tools=tools) if text is None else text
    return encode_rendered(ct, [text], [messages]).dropped


def _mask(tmp_path, family, rows, name="in.jsonl", **options):
    path = tmp_path / name
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    out = tmp_path / (name + ".parquet")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = mask_files(path, out, tokenizer=chat_tokenizer(family), max_drop_fraction=1.0, **options)
    assert report.rows_in == report.rows_out + sum(report.dropped.values())
    return report, pq.read_table(out)


# -- a tool call whose arguments print no value ----------------------------------------------------------


def _call_chat(arguments, name="get_time") -> list[dict]:
    return [
        U("What time is it?"),
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "content": "12:00"},
        A("It is noon."),
    ]


@pytest.mark.parametrize("arguments", [{}, {"zone": ""}, {"zones": []}], ids=["empty", "empty-string", "empty-list"])
def test_glm4_tool_call_with_no_argument_values_is_kept(arguments):
    """GLM-4 writes nothing for ``{}`` (and an empty value as ``<arg_value></arg_value>``): the call is there, found
    by its name (and an empty list by its ``[]``), so the row is kept."""
    ct = chat_tokenizer("glm-4")
    messages = _call_chat(arguments)
    text = ct.render(messages)
    assert "<tool_call>get_time" in text
    assert _dropped(ct, messages, text=text) == []
    located = locate_messages(text, messages)
    at = text.index("get_time", text.index("<tool_call>"))
    assert located.missing is None
    assert any(s <= at < e and index == 1 for s, e, index, _ in located.pieces)  # the name is the call's text


def test_glm4_tool_call_with_empty_arguments_trains_end_to_end(tmp_path):
    report, table = _mask(tmp_path, "glm-4", [{"messages": _call_chat({})}], check_roles="all")
    assert report.rows_out == 1 and sum(report.dropped.values()) == 0
    trained = _trained_text("glm-4", table)
    assert "get_time" in trained and "It is noon." in trained and "What time" not in trained


# DeepSeek-V4's call markup, reduced to what an assistant call writes: the name, then one parameter per key.
V4_CALLS = (
    "{% for m in messages %}{% if m.role == 'assistant' %}<｜Assistant｜>"
    "{% for tc in m.tool_calls or [] %}<｜DSML｜invoke name=\"{{ tc.function.name }}\">\n"
    "{% for k, v in tc.function.arguments.items() %}<｜DSML｜parameter name=\"{{ k }}\">{{ v }}</｜DSML｜parameter>\n"
    "{% endfor %}</｜DSML｜invoke>{% endfor %}{{ m.content or '' }}<｜end▁of▁sentence｜>"
    "{% else %}<｜{{ m.role }}｜>{{ m.content }}{% endif %}{% endfor %}"
)


def test_deepseek_v4_style_tool_call_with_empty_arguments_is_kept():
    from lossmask.chat.tokenizer import ChatTokenizer

    ct = ChatTokenizer(chat_tokenizer("deepseek-v3.1").tokenizer, chat_template=V4_CALLS, name="deepseek-v4-style")
    messages = _call_chat({})
    text = ct.render(messages)
    assert '<｜DSML｜invoke name="get_time">\n</｜DSML｜invoke>' in text
    assert _dropped(ct, messages, text=text) == []


def test_a_dropped_call_with_empty_arguments_is_still_content_dropped():
    """The name stands in for the arguments only where the template wrote it: a rendering without the call drops
    the row, naming the call's message."""
    ct = chat_tokenizer("glm-4")
    messages = _call_chat({})
    text = ct.render(messages)
    broken = text.replace("<tool_call>get_time", "<tool_call>")
    (row, reason, why), = _dropped(ct, messages, text=broken)
    assert reason == "content_dropped" and "message 1 (assistant)" in why


# -- a stray </think> inside an answer ------------------------------------------------------------------

# The shape of a real answer (LLaMA-Factory's reasoning/tool-use sample): a long reply that quotes the close tag
# part-way through, with no <think> before it; its reasoning, where there is some, is a field of its own.
STRAY_ANSWER = ("Apologies, but the scheduling tool cannot send that message: it takes a date, a recipient and a "
                "body, and the request gives no recipient. " * 8 + "</think> Please tell me who should receive it, "
                "and I will schedule the email for Friday at nine.")


@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-v3.1"])
@pytest.mark.parametrize("reasoning", [None, "The user wants an email scheduled."], ids=["no-reasoning", "field"])
def test_deepseek_answer_cut_at_a_stray_think_close_is_content_dropped(tmp_path, family, reasoning):
    """DeepSeek-V3 and V3.1 keep only the text after the last ``</think>``: the answer before it is gone from the
    row, so the row is counted as ``content_dropped``, naming the message and the tag."""
    ct = chat_tokenizer(family)
    answer = {"role": "assistant", "content": STRAY_ANSWER,
              **({"reasoning_content": reasoning} if reasoning else {})}
    messages = [U("Schedule an email for Friday at nine."), answer]
    text = ct.render(messages)
    assert STRAY_ANSWER.partition("</think>")[0].strip() not in text
    (row, reason, why), = _dropped(ct, messages, text=text)
    assert reason == "content_dropped" and "message 1 (assistant)" in why and "'</think>'" in why
    report, table = _mask(tmp_path, family, [{"messages": messages}, {"messages": [U("Hi."), A("Hello.")]}])
    assert report.dropped.get("content_dropped") == 1 and report.rows_out == 1


@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-v3.1"])
def test_a_second_think_close_is_answer_text(family):
    """In ``<think>r</think>a</think>b`` the reasoning ends at the first tag; a template that keeps only ``b``
    lost answer text."""
    ct = chat_tokenizer(family)
    messages = [U("How do reasoning tags close?"),
                A("<think>\nThe user asks about tags.\n</think>\n\nA block closes with </think> and the answer follows.")]
    text = ct.render(messages)
    dropped = _dropped(ct, messages, text=text)
    if "A block closes with </think>" in text:  # V3.1 strips the reasoning of this turn only
        assert dropped == []
    else:
        (row, reason, why), = dropped
        assert reason == "content_dropped" and "message 1 (assistant)" in why


@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-v3.1", "qwen3"])
def test_r1_style_reasoning_in_content_is_still_kept(family):
    ct = chat_tokenizer(family)
    messages = [U("Is 11 prime?"), A("<think>\nEleven has no divisor.\n</think>\n\nYes, 11 is prime.")]
    assert _dropped(ct, messages) == []


# -- gpt-oss: a parallel call the template drops, named in the reasoning --------------------------------


def _parallel_chat(thinking: str) -> list[dict]:
    call = lambda name, arguments: {"type": "function", "function": {"name": name, "arguments": arguments}}  # noqa: E731
    return [
        U("Fetch top news in Canada in English, and backlinks for the domain example.es."),
        {"role": "assistant", "thinking": thinking,
         "tool_calls": [call("top_news", {"region": "CA", "hl": "en"}),
                        call("exact_url_non_english", {"domain": "example.es"})]},
    ]


@pytest.mark.parametrize("thinking", [
    "Two calls are needed: top_news with region CA, then exact_url_non_english with domain \"example.es\".",
    "Two calls are needed: the news first, then the backlinks.",
], ids=["reasoning-names-the-second-call", "reasoning-without-it"])
def test_gpt_oss_second_parallel_call_dropped_by_the_template_is_content_dropped(thinking):
    """gpt-oss writes only the first of an assistant message's calls. Where its reasoning (which it renders before
    a last call) names the second call and quotes its value, that text is reasoning, not the call: the row is
    ``content_dropped`` either way."""
    ct = chat_tokenizer("gpt-oss")
    messages = _parallel_chat(thinking)
    text = ct.render(messages)
    assert thinking in text and "functions.exact_url_non_english" not in text
    (row, reason, why), = _dropped(ct, messages, text=text)
    assert reason == "content_dropped" and "message 1 (assistant)" in why and "tool call arguments" in why


def test_pieces_of_one_message_never_share_characters():
    """A call found by its values is found outside its message's reasoning: the row rendered with both calls is
    kept, each call located at its own text."""
    from lossmask.chat.tokenizer import ChatTokenizer

    template = ("{% for m in messages %}{% if m.role == 'user' %}<u>{{ m.content }}</u>{% else %}<a>"
                "{% if m.thinking %}<r>{{ m.thinking }}</r>{% endif %}{% for c in m.tool_calls %}<c>{{ c.function.name }}"
                "{% for k, v in c.function.arguments.items() %}<v>{{ v }}</v>{% endfor %}</c>{% endfor %}</a>"
                "{% endif %}{% endfor %}")
    ct = ChatTokenizer(chat_tokenizer("gpt-oss").tokenizer, chat_template=template, name="markup-calls")
    messages = _parallel_chat("Call top_news with >CA< and >en<, then exact_url_non_english with >example.es<.")
    text = ct.render(messages)
    located = locate_messages(text, messages)
    assert located.missing is None
    calls = text.index("</r>")
    required = [(s, e) for s, e, index, req in located.pieces if index == 1 and req]
    assert len(required) == 2 and all(s > calls for s, _ in required)


# -- LLaMA-Factory's ShareGPT tool form -------------------------------------------------------------------

NOTE_TOOLS = json.dumps([{  # LLaMA-Factory stores the tools as JSON text, each a bare function schema
    "name": "create_reminder", "description": "Create a reminder at a time.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}, "hour": {"type": "integer"}},
                   "required": ["text", "hour"]},
}])
TOOL_FORM = {"conversations": [
    {"from": "human", "value": "Remind me to water the ferns at seven."},
    {"from": "function_call", "value": json.dumps({"name": "create_reminder",
                                                   "arguments": {"text": "water the ferns", "hour": 19}})},
    {"from": "observation", "value": json.dumps({"status": "created", "id": "rem-4417"})},
    {"from": "gpt", "value": "Done: you will be reminded to water the ferns at 19:00."},
], "tools": NOTE_TOOLS}
NO_TOOLS = {"conversations": [{"from": "human", "value": "Hello, who are you?"},
                              {"from": "gpt", "value": "An assistant that can set reminders."}], "tools": "[]"}


@pytest.mark.parametrize("family", ["qwen2.5", "llama-3.1"])
def test_llamafactory_sharegpt_tool_form_is_read_natively(tmp_path, family):
    """``function_call`` becomes the assistant's tool call, ``observation`` its result, and the JSON-text ``tools``
    (even ``"[]"``) are decoded: every row is kept, the call and the reply train, the human and tool text do not."""
    report, table = _mask(tmp_path, family, [TOOL_FORM, NO_TOOLS])
    assert report.rows_out == 2 and sum(report.dropped.values()) == 0
    trained = _trained_text(family, table, 0)
    assert "create_reminder" in trained and "water the ferns" in trained and "19" in trained
    assert "Done: you will be reminded" in trained
    assert "rem-4417" not in trained and "Remind me" not in trained
    assert "create_reminder" in chat_tokenizer(family).decode(table.column("input_ids")[0].as_py()[:400])  # tools
    assert "An assistant that can set reminders." in _trained_text(family, table, 1)


def test_a_function_call_that_is_not_a_call_is_invalid_naming_the_message(tmp_path):
    bad = {"conversations": [TOOL_FORM["conversations"][0], {"from": "function_call", "value": "water the ferns"},
                             *TOOL_FORM["conversations"][2:]], "tools": NOTE_TOOLS}
    bad_tools = {**TOOL_FORM, "tools": "[{\"name\": "}
    report, _ = _mask(tmp_path, "qwen2.5", [bad, bad_tools, TOOL_FORM])
    assert report.rows_out == 1 and report.dropped.get("invalid") == 2
    text = json.dumps(report.to_dict())
    assert "message 1 holds a 'function_call'" in text and "column 'tools'" in text and "not JSON" in text


def test_sharegpt_speakers_match_in_any_case(tmp_path):
    rows = [{"conversations": [{"from": "Human", "value": "Name a prime."}, {"from": "GPT", "value": "Seven."}]}]
    report, table = _mask(tmp_path, "qwen2.5", rows)
    assert report.rows_out == 1
    assert "Seven." in _trained_text("qwen2.5", table) and "Name a prime" not in _trained_text("qwen2.5", table)


def test_a_file_with_messages_and_conversations_warns_naming_the_file(tmp_path):
    """Only ``messages`` is read; ``conversations`` beside it is not dropped without a word."""
    row = {"messages": [U("Name a prime."), A("Seven.")],
           "conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Teal."}]}
    path = tmp_path / "both.jsonl"
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    with pytest.warns(UserWarning, match=r"both\.jsonl has both 'messages' and 'conversations'.*--messages-column"):
        report = mask_files(path, tmp_path / "out.parquet", tokenizer=chat_tokenizer("qwen2.5"))
    assert report.rows_out == 1
    report = mask_files(path, tmp_path / "out2.parquet", tokenizer=chat_tokenizer("qwen2.5"),
                        messages_column="conversations")
    assert "Teal." in _trained_text("qwen2.5", pq.read_table(tmp_path / "out2.parquet"))


# -- the structure of a message with no text --------------------------------------------------------------


@pytest.mark.parametrize("family", ["phi-3", "qwen2.5"])
def test_structure_of_an_empty_user_message_never_trains(tmp_path, family):
    """With empty messages and repeated roles kept, Phi-3 writes ``<|assistant|>`` after the first user message and
    ``<|user|><|end|>`` for the empty one, which the markers then train. The empty message has no text to check, so
    its whole turn is checked: the row is counted (``template_breaks_roles``) and no kept row trains user structure."""
    rows = [{"messages": [U("Hello there."), U(""), A("Hi, how can I help?")]},
            {"messages": [U("Name a prime."), A("Seven.")]}]
    report, table = _mask(tmp_path, family, rows, consecutive_roles="keep", empty_messages="keep")
    kept = [_trained_text(family, table, r) for r in range(table.num_rows)]
    assert all("<|user|>" not in text and "user\n" not in text for text in kept)
    assert any("Seven." in text for text in kept)
    if family == "phi-3":
        assert report.rows_out + report.dropped.get("template_breaks_roles", 0) == 2
        assert report.rows_out == 1 or any("Hi, how can I help?" in text for text in kept)
    else:  # ChatML writes the empty turn apart: nothing to drop
        assert report.rows_out == 2


# -- peers' options: drop_system_message -------------------------------------------------------------------


def test_drop_system_message_removes_system_messages_and_counts_them(tmp_path):
    rows = [{"messages": [{"role": "system", "content": "Answer like a pirate."}, U("Name a prime."), A("Seven.")]},
            {"messages": [U("Name a colour."), A("Teal.")]}]
    report, table = _mask(tmp_path, "llama-3", rows, drop_system_message=True)
    ct = chat_tokenizer("llama-3")
    assert report.rows_out == 2 and report.shapes == {"system_messages_dropped": 1}
    assert "pirate" not in ct.decode(table.column("input_ids")[0].as_py())
    assert "Seven." in _trained_text("llama-3", table, 0)
    report, table = _mask(tmp_path, "llama-3", rows, name="again.jsonl")
    assert "pirate" in ct.decode(table.column("input_ids")[0].as_py())


def test_drop_system_message_cli_flag_reaches_the_job(tmp_path):
    import contextlib
    import io

    from conftest import tokenizer_path
    from lossmask.cli import main

    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "system", "content": "Answer like a pirate."}, U("Hi."),
                                             A("Ahoy.")]}) + "\n", encoding="utf-8")
    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
        main(["mask", "--help"])
    assert "--drop-system-message" in help_text.getvalue()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(["mask", str(path), str(tmp_path / "out.parquet"), "--tokenizer", str(tokenizer_path("llama-3")),
                     "--no-progress", "--drop-system-message", "--report", str(tmp_path / "r.json")])
    assert code == 0
    assert json.loads((tmp_path / "r.json").read_text())["shapes"] == {"system_messages_dropped": 1}


# -- peers' options: truncation that keeps the last turns whole ----------------------------------------------

LONG_CHAT = [{"role": "system", "content": "Be brief."},
             U("Tell me about rivers. " * 40), A("Rivers flow to the sea. " * 40),
             U("And lakes? " * 30), A("Lakes are still water. " * 30),
             U("Which is older?"), A("Many lakes are older than the rivers that feed them.")]


@pytest.mark.parametrize("family", ["llama-3", "qwen2.5"])
def test_history_truncation_drops_the_earliest_exchanges_whole(tmp_path, family):
    """``truncation="history"`` with ``max_length``: the earliest exchanges go, whole, until the row fits, so the
    last turn is kept whole and trains (LLaMA-Factory's ``mask_history``, here with ``last_turn_only``); the system
    prompt stays. ``truncation="end"`` cuts the tail instead."""
    ct = chat_tokenizer(family)
    limit = len(ct.encode_texts_with_offsets([ct.render([LONG_CHAT[0], *LONG_CHAT[3:]])])[0][0]) + 4
    rows = [{"messages": LONG_CHAT}, {"messages": [U("Hi."), A("Hello.")]}]
    report, table = _mask(tmp_path, family, rows, max_length=limit, truncation="history", last_turn_only=True)
    assert report.rows_out == 2 and report.shapes.get("earliest_turns_dropped") == 1
    text = ct.decode(table.column("input_ids")[0].as_py())
    assert len(table.column("input_ids")[0]) <= limit
    assert "Be brief." in text and "Tell me about rivers" not in text and "And lakes?" in text
    assert _trained_text(family, table, 0).strip().startswith("Many lakes are older than the rivers that feed them.")
    assert "Lakes are still water" not in _trained_text(family, table, 0)
    report, table = _mask(tmp_path, family, rows, name="end.jsonl", max_length=limit, last_turn_only=True)
    assert "Many lakes" not in _trained_text(family, table, 0)
    assert "Tell me about rivers" in ct.decode(table.column("input_ids")[0].as_py())


def test_truncation_option_is_checked_and_the_flag_is_documented():
    import contextlib
    import io

    from lossmask import MaskOptions
    from lossmask.cli import main

    with pytest.raises(ValueError, match="truncation='start'"):
        MaskOptions(truncation="start")
    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
        main(["mask", "--help"])
    assert "--truncation" in help_text.getvalue()
