"""Message text checked against its rendering: tool-call arguments, which turn a drop is blamed on, bounded
rendering, ``verify`` agreeing with the messages path, and text that spells special tokens.

Where a behaviour belongs to one template family, its test runs on that family's real tokenizer.
"""

from __future__ import annotations

import json

import pytest

from conftest import chat_tokenizer
from lossmask.chat.encode_rendered import encode_rendered
from lossmask.chat.locate import locate_messages

# Function-calling shapes as public benchmarks write them: "type": "dict" schemas, dotted names, floats,
# nested arrays, booleans and strings side by side.
BENCH_TOOLS = [{
    "type": "function",
    "function": {
        "name": "geometry.area.circle",
        "description": "The area of circles.",
        "parameters": {"type": "dict", "properties": {
            "radius": {"type": "float", "description": "radius"},
            "centers": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
            "units": {"type": "string"}, "exact": {"type": "boolean"}},
            "required": ["radius"]},
    },
}]
BENCH_ARGUMENTS = [
    {"radius": 1.5},
    {"radius": 2.0, "centers": [[1, 2], [3, 4]]},
    {"radius": 0.25, "centers": [[0, 10]], "units": "cm", "exact": False},
]


def _bench_chat(arguments) -> list[dict]:
    return [
        {"role": "user", "content": "What is the area of that circle?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "geometry.area.circle", "arguments": arguments}}]},
        {"role": "tool", "content": "7.0686"},
        {"role": "assistant", "content": "The area is about 7.07."},
    ]


def _dropped(ct, messages, tools=None, text=None):
    text = ct.render(messages, tools=tools) if text is None else text
    return encode_rendered(ct, [text], [messages]).dropped


# -- tool-call arguments are checked by their values ------------------------------------------------------


@pytest.mark.parametrize("arguments", BENCH_ARGUMENTS, ids=["float", "nested-arrays", "mixed"])
def test_glm4_key_value_arguments_with_numbers_are_kept(arguments):
    """GLM-4 writes <arg_key>radius</arg_key><arg_value>1.5</arg_value>: every value is there, so the row is
    kept, and the call's values lie in message text."""
    ct = chat_tokenizer("glm-4")
    messages = _bench_chat(arguments)
    text = ct.render(messages, tools=BENCH_TOOLS)
    assert "<arg_value>" in text
    assert _dropped(ct, messages, text=text) == []
    spans = locate_messages(text, messages).spans
    value_at = text.index("<arg_key>radius</arg_key>\n<arg_value>") + len("<arg_key>radius</arg_key>\n<arg_value>")
    # the value is message text (inert for markers)
    assert any(s <= value_at < e for s, e in spans)


def test_a_value_the_template_lost_is_still_content_dropped():
    """The check by values still bites: a rendering that lost one value (or a nested array item) drops the row."""
    ct = chat_tokenizer("glm-4")
    messages = _bench_chat({"radius": 2.0, "centers": [[1, 2], [3, 4]]})
    text = ct.render(messages, tools=BENCH_TOOLS)
    assert _dropped(ct, messages, text=text) == []
    for lost in ("[[1, 2], [3, 4]]", "2.0"):
        broken = text.replace(f"<arg_value>{lost}</arg_value>", "<arg_value></arg_value>")
        assert broken != text
        (row, reason, why), = _dropped(ct, messages, text=broken)
        assert reason == "content_dropped" and "message 1 (assistant)" in why and "tool call arguments" in why
    # a number must be found whole: 1 is not inside 10
    messages = _bench_chat({"radius": 1})
    text = ct.render(messages, tools=BENCH_TOOLS)
    assert _dropped(ct, messages, text=text) == []
    assert _dropped(ct, messages, text=text.replace("<arg_value>1</arg_value>", "<arg_value>10</arg_value>"))


# A DeepSeek-V4-style rendering: parameters as markup, strings raw and other values as JSON.
V4_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>"
    "{% elif m.role == 'assistant' %}<｜Assistant｜>{{ m.content or '' }}"
    "{% for tc in m.tool_calls or [] %}<｜DSML｜invoke name=\"{{ tc.function.name }}\">\n"
    "{% for k, v in tc.function.arguments.items() %}"
    "<｜DSML｜parameter name=\"{{ k }}\" string=\"{{ 'true' if v is string else 'false' }}\">"
    "{{ v if v is string else v | tojson }}</｜DSML｜parameter>\n{% endfor %}</｜DSML｜invoke>{% endfor %}"
    "<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


def _v4_text(messages) -> str:
    """What the V4 encoder writes, in Python: a JSON-string argument is parsed before it is written."""
    out = []
    for m in messages:
        if m["role"] == "user":
            out.append(f"<｜User｜>{m['content']}")
        elif m["role"] == "tool":
            out.append(f"<｜tool▁output▁begin｜>{m['content']}<｜tool▁output▁end｜>")
        else:
            out.append(f"<｜Assistant｜>{m.get('content') or ''}")
            for call in m.get("tool_calls", ()):
                f = call["function"]
                arguments = json.loads(f["arguments"]) if isinstance(f["arguments"], str) else f["arguments"]
                out.append(f'<｜DSML｜invoke name="{f["name"]}">\n')
                for k, v in arguments.items():
                    string = isinstance(v, str)
                    out.append(f'<｜DSML｜parameter name="{k}" string="{str(string).lower()}">'
                               f"{v if string else json.dumps(v)}</｜DSML｜parameter>\n")
                out.append("</｜DSML｜invoke>")
            out.append("<｜end▁of▁sentence｜>")
    return "".join(out)


@pytest.mark.parametrize("arguments", BENCH_ARGUMENTS, ids=["float", "nested-arrays", "mixed"])
@pytest.mark.parametrize("given_as", ["dict", "json-string"])
def test_deepseek_v4_style_markup_arguments_are_kept(arguments, given_as):
    from lossmask.chat.tokenizer import ChatTokenizer

    base = chat_tokenizer("deepseek-v3.1")
    ct = ChatTokenizer(base.tokenizer, chat_template=V4_TEMPLATE, name="deepseek-v4-style")
    value = arguments if given_as == "dict" else json.dumps(arguments)
    messages = _bench_chat(value)
    text = ct.render(_bench_chat(arguments)) if given_as == "dict" else _v4_text(messages)
    assert "<｜DSML｜parameter" in text
    assert _dropped(ct, messages, text=text) == []
    if given_as == "dict":
        assert text == _v4_text(messages)  # the template and the encoder agree
    broken = text.replace('string="false">' + json.dumps(arguments["radius"]), 'string="false">0')
    assert _dropped(ct, messages, text=broken)[0][1] == "content_dropped"


# -- a dropped turn is blamed on itself -------------------------------------------------------------------


@pytest.mark.parametrize("role", ["ipython", "tool"])
def test_llama31_tool_result_quoted_by_the_reply_is_kept(role):
    """Llama-3.1 writes a tool result through tojson ("He said \\"sunny\\""); a reply that quotes the raw text
    must not take the tool turn's place, which made the row content_dropped, blamed on the reply."""
    ct = chat_tokenizer("llama-3.1")
    call = {"type": "function", "function": {"name": "weather.get", "arguments": {"city": "Paris", "days": 2}}}
    for result, reply in (('He said "sunny"', 'The tool says: He said "sunny".'), ("Sunny\n21 C", "Sunny\n21 C")):
        messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": [call]},
                    {"role": role, "content": result}, {"role": "assistant", "content": reply}]
        assert _dropped(ct, messages) == []


def test_a_dropped_tool_turn_is_named_not_the_reply_after_it():
    """Phi-3 drops tool messages; the reply quotes the result, so the in-order search found the result there
    and named the reply as dropped. The message named is the tool turn."""
    ct = chat_tokenizer("phi-3")
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Let me look."},
                {"role": "tool", "content": "Sunny, 21 C"}, {"role": "assistant", "content": "Sunny, 21 C in Paris."}]
    (row, reason, why), = _dropped(ct, messages)
    assert reason == "content_dropped"
    assert why.startswith("message 2 (tool): its content"), why


# -- gpt-oss drops the second of two parallel calls -------------------------------------------------------


@pytest.mark.parametrize("second", ["weather.get", "weather.forecast"])
def test_gpt_oss_second_parallel_call_with_the_same_arguments_is_content_dropped(second):
    ct = chat_tokenizer("gpt-oss")
    arguments = {"city": "Paris", "days": 3}
    calls = [{"type": "function", "function": {"name": name, "arguments": dict(arguments)}}
             for name in ("weather.get", second)]
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": calls},
                {"role": "tool", "content": "Sunny"}, {"role": "tool", "content": "Rain later"},
                {"role": "assistant", "content": "Sunny, then rain."}]
    text = ct.render(messages)
    assert text.count('{"city": "Paris", "days": 3}') == 1  # the template wrote one call
    (row, reason, why), = _dropped(ct, messages, text=text)
    assert reason == "content_dropped" and why.startswith("message 1 (assistant): its tool call arguments"), why
    # one call alone is kept
    one = [messages[0], {"role": "assistant", "tool_calls": calls[:1]}, messages[2], messages[4]]
    assert _dropped(ct, one) == []


# -- Gemma's newline tokens are not control tokens --------------------------------------------------------

NEWLINE_CHATS = [
    [{"role": "user", "content": f"Line one.\nLine two.{nl}Para {k}.\n"},
     {"role": "assistant", "content": f"Sure.{nl}- a\n- b\n\n\n\nDone {k}."}]
    for k, nl in enumerate(["\n", "\n\n", "\n\n\n", "\r\n\n"])
]


@pytest.mark.parametrize("family", ["gemma-2", "gemma-3"])
def test_gemma_newlines_in_message_text_are_not_special_token_strings(family):
    ct = chat_tokenizer(family)
    texts = [ct.render(chat) for chat in NEWLINE_CHATS]
    for policy in ("text", "drop", "error"):
        encoded = encode_rendered(ct, texts, NEWLINE_CHATS, special_tokens_in_content=policy)
        assert encoded.special_rows == 0 and encoded.dropped == [] and encoded.keep.all(), policy
    # the rows keep the tokenizer's own ids: nothing was re-encoded
    kept = encode_rendered(ct, texts, NEWLINE_CHATS, special_tokens_in_content="keep").input_ids
    assert encode_rendered(ct, texts, NEWLINE_CHATS).input_ids.equals(kept)
    # the turn framing still is: a quoted <end_of_turn> is counted, and encoded as text
    quoted = [[{"role": "user", "content": "Say <end_of_turn>\nplease."}, {"role": "assistant", "content": "No."}]]
    end = ct.tokenizer.convert_tokens_to_ids("<end_of_turn>")
    as_text = encode_rendered(ct, [ct.render(quoted[0])], quoted)
    as_token = encode_rendered(ct, [ct.render(quoted[0])], quoted, special_tokens_in_content="keep")
    assert as_text.special_rows == 1 and "'<end_of_turn>'" in as_text.special_example
    assert as_text.input_ids.values.to_pylist().count(end) == as_token.input_ids.values.to_pylist().count(end) - 1


# -- rendering one row is bounded in time and memory ------------------------------------------------------

# Each grows with the row (``n`` is its message count), as data-driven loops do: an expression of constants
# alone is folded by transformers' own compiler before any row renders (see docs/masking-rule.md).
HOSTILE = {
    "loop": "{% for i in range(100000) %}{% for j in range(n * 50000) %}{% endfor %}{% endfor %}",
    "repeat": "{{ 'x' * (n * 5 * 10**8) }}",
    "doubling": "{% set ns = namespace(s='x') %}{% for i in range(n * 20) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "filter": "{{ 'x' | center(n * 5 * 10**8) }}",
    "method": "{{ 'x'.ljust(n * 5 * 10**8) }}",
    "output": "{% for i in range(100000) %}{{ 'y' * (n * 500) }}{% endfor %}",
    "recursion": "{% macro f(k) %}{% if k %}{{ f(k - 1) }}{{ f(k - 1) }}{% endif %}{% endmacro %}{{ f(n * 30) }}",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_template_row_is_invalid_with_the_limit_named(kind, monkeypatch):
    import tracemalloc

    import pyarrow as pa

    from lossmask import MaskOptions
    from lossmask.chat import render
    from lossmask.chat.encode_batch import render_table
    from lossmask.chat.tokenizer import ChatTokenizer

    monkeypatch.setattr(render, "MAX_RENDER_SECONDS", 1.0)  # the nested loop would take 10 s otherwise
    base = chat_tokenizer("qwen2.5")
    template = ("{% set n = messages | length %}{% if 'boom' in messages[0].content %}" + HOSTILE[kind]
                + "{% endif %}" + base.template_for())
    ct = ChatTokenizer(base.tokenizer, chat_template=template, name="hostile")
    rows = [[{"role": "user", "content": f"row {k}" + (" boom" if k == 3 else "")},
             {"role": "assistant", "content": "ok"}] for k in range(6)]
    table = pa.table({"messages": rows})
    tracemalloc.start()
    try:
        rendered = render_table(ct, table, "messages", MaskOptions())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rendered.valid.tolist() == [True, True, True, False, True, True]
    (row, why), = rendered.errors
    assert row == 3 and any(bound in why for bound in ("MAX_RENDER_SECONDS", "MAX_RENDER_STEPS", "MAX_RENDER_CHARS")), why
    if kind != "output":  # 100 MB of output: whichever bound it meets first
        assert ("over 1 seconds" in why or "MAX_RENDER_STEPS" in why) == (kind in ("loop", "recursion")), why
    assert peak < 2**30, peak  # bytes: the 1 GB string is never built
    assert rendered.texts[0] == base.render(rows[0])


def _hostile_tokenizer(kind):
    from lossmask.chat.tokenizer import ChatTokenizer

    base = chat_tokenizer("qwen2.5")
    template = ("{% set n = messages | length %}{% if 'boom' in messages[0].content %}" + HOSTILE[kind]
                + "{% endif %}" + base.template_for())
    return base, ChatTokenizer(base.tokenizer, chat_template=template, name="hostile")


@pytest.mark.parametrize("path", ["rows with tools", "encode_chats", "render", "verify"])
@pytest.mark.parametrize("kind", ["loop", "repeat", "output"])
def test_every_render_path_is_bounded(path, kind, monkeypatch):
    """Not only the direct renderer: rows with tools, Python chats, one render, verify's renders."""
    import tracemalloc

    import pyarrow as pa

    from lossmask import MaskOptions
    from lossmask.chat import render
    from lossmask.chat.encode_batch import render_table
    from lossmask.chat.render import RenderLimitError

    monkeypatch.setattr(render, "MAX_RENDER_SECONDS", 1.0)
    # the bounds lowered (the hostile loops' constant ranges still under the steps), so that each path meets one
    # within a few thousand turns rather than a million: the real bounds are test_a_hostile_template_row_...'s
    monkeypatch.setattr(render, "MAX_RENDER_STEPS", 2**17)
    monkeypatch.setattr(render, "MAX_RENDER_CHARS", 2**20)
    monkeypatch.setattr(render, "MAX_RENDER_BUILT", 2**22)
    base, ct = _hostile_tokenizer(kind)
    rows = [[{"role": "user", "content": f"row {k}" + (" boom" if k == 1 else "")},
             {"role": "assistant", "content": "ok"}] for k in range(3)]
    tracemalloc.start()
    try:
        if path == "rows with tools":
            tools = [{"type": "function", "function": {"name": "f", "description": "d",
                                                       "parameters": {"type": "object", "properties": {}}}}]
            table = pa.table({"messages": rows, "tools": [tools] * 3})
            rendered = render_table(ct, table, "messages", MaskOptions())
            assert rendered.valid.tolist() == [True, False, True]
            (row, why), = rendered.errors
            assert rendered.texts[0] == base.render(rows[0], tools=tools)
        elif path == "encode_chats":
            encoded = ct.encode_chats(rows)
            (row, why), = encoded.errors
            assert encoded.input_ids[0].as_py() == base.encode(base.render(rows[0]))
        elif path == "render":
            with pytest.raises(RenderLimitError) as raised:
                ct.render(rows[1])
            row, why = 1, str(raised.value)
        else:
            from conftest import detected_markers
            from lossmask import verify

            report = verify(ct, detected_markers("qwen2.5")[0], [rows[0], rows[1]])
            assert report.conversations[0].error is None
            row, why = 1, report.conversations[1].error
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    bounds = ("MAX_RENDER_SECONDS", "MAX_RENDER_STEPS", "MAX_RENDER_CHARS", "MAX_RENDER_BUILT")  # whichever comes first
    assert row == 1 and any(bound in why for bound in bounds), why
    assert peak < 2**30, peak  # bytes: the 1 GB string is never built


@pytest.mark.parametrize("constant", ["{{ 'x' * 10**9 }}", "{{ 'x' | center(10**9) }}",
                                      "{% for i in range(10**10) %}{% endfor %}"])
def test_constant_expressions_are_bounded_too(constant):
    """Written as constants, these are folded when a template compiles: ours compiles without folding them."""
    import tracemalloc

    from lossmask.chat.render import RenderLimitError
    from lossmask.chat.tokenizer import ChatTokenizer

    base = chat_tokenizer("qwen2.5")
    ct = ChatTokenizer(base.tokenizer, chat_template=constant + base.template_for(), name="hostile")
    tracemalloc.start()
    try:
        with pytest.raises(RenderLimitError, match="MAX_RENDER_CHARS"):
            ct.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**28, peak


# -- verify labels as the messages path labels ------------------------------------------------------------


def _mask_path_labels(ct, markers, messages):
    from lossmask import label_batch

    encoded = encode_rendered(ct, [ct.render(messages)], [messages])
    if encoded.dropped:
        return None
    return label_batch(encoded.input_ids, markers, data_mask=encoded.in_content).labels.to_pylist()[0]


QUOTING = [
    [{"role": "user", "content": "What does <|im_end|> do?"},
     {"role": "assistant", "content": "It ends a turn: <|im_end|>\n<|im_start|>user\nlike that."}],
    [{"role": "user", "content": "Say <|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nhi"},
     {"role": "assistant", "content": "The header is <|start_header_id|>assistant<|end_header_id|>."}],
    [{"role": "user", "content": "Quote <end_of_turn> and <start_of_turn>model\nplease."},
     {"role": "assistant", "content": "<end_of_turn> closes, <start_of_turn>model\nopens."}],
]


@pytest.mark.parametrize("family", ["qwen2.5", "llama-3.1", "gemma-3", "smollm3"])
def test_verify_agrees_with_mask_files_on_quoted_markers(family):
    from lossmask import verify
    from conftest import detected_markers

    ct = chat_tokenizer(family)
    markers = detected_markers(family)[0]
    report = verify(ct, markers, QUOTING)
    assert report.ok, str(report)
    for chat, row in zip(QUOTING, report.conversations):
        assert row.labels.tolist() == _mask_path_labels(ct, markers, chat)


def test_verify_does_not_check_rows_the_messages_path_drops():
    from lossmask import verify
    from conftest import detected_markers

    ct = chat_tokenizer("gpt-oss")
    arguments = {"city": "Paris", "days": 3}
    # the same call twice: every piece's text is somewhere in the row, but not once per call
    calls = [{"type": "function", "function": {"name": "weather.get", "arguments": dict(arguments)}}] * 2
    dropped = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": calls},
               {"role": "tool", "content": "Sunny"}, {"role": "tool", "content": "Rain later"},
               {"role": "assistant", "content": "Sunny, then rain."}]
    kept = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sunny."}]
    assert _dropped(ct, dropped) and not _dropped(ct, kept)
    report = verify(ct, detected_markers("gpt-oss")[0], [dropped, kept])
    first, second = report.conversations
    assert first.error is not None and "not labelled" in first.error and first.dropped[0].message == 1
    assert second.error is None and second.exact


def test_a_left_out_system_prompt_quoted_later_is_kept_by_both():
    """Mistral v3 writes the system prompt only when the chat ends with a user turn; a later message quotes
    it. The in-order search found it in the quote and then missed the user turn: the messages path dropped
    the row while verify checked it. Both now keep it."""
    from lossmask import verify
    from conftest import detected_markers

    ct = chat_tokenizer("mistral-v3")
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Q1?"}, {"role": "assistant", "content": "A1."},
            {"role": "user", "content": "Q2: Be brief. Why?"}, {"role": "assistant", "content": "A2."}]
    assert _dropped(ct, chat) == []
    markers = detected_markers("mistral-v3")[0]
    (row,) = verify(ct, markers, [chat]).conversations
    assert row.exact and row.labels.tolist() == _mask_path_labels(ct, markers, chat)


def test_falcon_rewritten_blank_lines_are_checked_like_the_messages_path():
    """Falcon writes a message's blank lines as single newlines: the messages path finds the text with any
    whitespace between its words, and verify refused the row (123 of 149 real ShareGPT rows). Both now label it."""
    from lossmask import verify
    from conftest import detected_markers

    ct = chat_tokenizer("falcon")
    chat = [{"role": "user", "content": "Two paragraphs, please.\n\nThanks."},
            {"role": "assistant", "content": "First paragraph.\n\nSecond paragraph.\r\nThird line."},
            {"role": "user", "content": "And again?"},
            {"role": "assistant", "content": "Once more.\n\n\nDone."}]
    assert "First paragraph.\n\nSecond" not in ct.render(chat)  # the template does rewrite it
    markers = detected_markers("falcon")[0]
    (row,) = verify(ct, markers, [chat]).conversations
    assert row.error is None and row.exact, row
    assert row.labels.tolist() == _mask_path_labels(ct, markers, chat)
