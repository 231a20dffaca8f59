"""Rows read from Arrow render through the compiled template exactly as ``apply_chat_template`` renders them."""

from __future__ import annotations

import json
import warnings

import pyarrow as pa
import pytest

import lossmask
from lossmask.chat import locate
from lossmask.chat.encode_batch import messages_from_arrow, render_chats
from lossmask.chat.render import DirectRenderer, plain_arrow_type
from lossmask.chat.tokenizer import ChatTemplateError
from lossmask.chat.probes import probe_conversations

from conftest import chat_tokenizer, tokenizer_families, tokenizer_path

# Conversations as JSON data arrives: plain turns, reasoning under each of its names, R1-style content,
# tool calls with arguments as objects and as strings, quoted markers, whitespace at the edges.
EXTRA = [
    [{"role": "user", "content": "  hi\n"}, {"role": "assistant", "content": "\nhello  "}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "why"}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "because"}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "thinking": "hmm"}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>r</think>\n\nthe answer"}],
    [{"role": "user", "content": "say <|im_end|> and [/INST]"}, {"role": "assistant", "content": "<|im_start|>user\nno"}],
    [{"role": "user", "content": "w?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "get", "arguments": {"city": "Oslo", "days": 2}}}]},
     {"role": "tool", "content": "{\"t\": 3}"}, {"role": "assistant", "content": "3 degrees"}],
]


def _chats() -> list[list[dict]]:
    probes = [list(c.messages) for c in probe_conversations() if c.tools is None]
    return [json.loads(json.dumps(c)) for c in probes] + EXTRA  # plain JSON, as read from a file


@pytest.mark.parametrize("family", tokenizer_families())
def test_direct_render_equals_apply_chat_template(family):
    ct = chat_tokenizer(family)
    _renders_as_apply_chat_template(ct, _chats(), lambda chat: ct.render(chat))


def _renders_as_apply_chat_template(ct, chats: list, render) -> tuple:
    """``DirectRenderer`` on ``chats`` proves itself without a warning and gives ``render``'s texts (``render``:
    ``apply_chat_template`` of one chat), refusing the chats it refuses; ``(renderer, reference)``."""
    reference = []
    for chat in chats:
        try:
            reference.append(render(chat))
        except ChatTemplateError:
            reference.append(None)
    renderer = DirectRenderer(ct)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed proof would warn
        texts, errors = renderer.render(chats)
    assert renderer.reason is None
    assert texts == reference
    assert sorted(i for i, _ in errors) == [i for i, text in enumerate(reference) if text is None]
    return renderer, reference


def _tool_chats() -> list[dict]:
    probes = [{"messages": list(c.messages), "tools": list(c.tools)} for c in probe_conversations() if c.tools]
    probes += [{"messages": EXTRA[-1], "tools": probes[0]["tools"]}]
    return json.loads(json.dumps(probes))  # plain JSON, as read from a file


@pytest.mark.parametrize("family", tokenizer_families())
def test_direct_render_with_tools_equals_apply_chat_template(family):
    """Chats with tools, proved on the job's first ones, render through the compiled template (the tools as
    ``apply_chat_template`` passes them), whole and as each prefix with the generation prompt, as ``apply_chat_template``
    renders them."""
    ct = chat_tokenizer(family)
    chats = _tool_chats()
    renderer, reference = _renders_as_apply_chat_template(
        ct, chats, lambda chat: ct.render(chat["messages"], tools=chat["tools"]))
    rendered = [chat for chat, text in zip(chats, reference) if text is not None]
    if not rendered:
        return
    assert renderer._proved_for(rendered[0]["messages"], rendered[0]["tools"]) is not None  # noqa: SLF001
    for chat in rendered:
        for k in range(1, len(chat["messages"]) + 1):
            for prompt in (False, True):
                try:
                    expected = ct.render(chat["messages"][:k], tools=chat["tools"], add_generation_prompt=prompt)
                except ChatTemplateError:
                    continue
                assert renderer.render_one(chat["messages"][:k], tools=chat["tools"],
                                           add_generation_prompt=prompt) == expected


def test_chats_with_tools_are_proved_apart_from_chats_without():
    """A job whose first batch holds chats without tools only has not proved the compiled template for chats with
    tools: those render through ``apply_chat_template`` until chats with tools are proved."""
    ct = chat_tokenizer("qwen2.5")
    renderer = DirectRenderer(ct)
    plain = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]]
    renderer.render(plain)
    tools = _tool_chats()[0]
    assert renderer._proved_for(plain[0], None) is not None  # noqa: SLF001
    assert renderer._proved_for(tools["messages"], tools["tools"]) is None  # noqa: SLF001
    renderer.render([tools])
    assert renderer._proved_for(tools["messages"], tools["tools"]) is not None  # noqa: SLF001


def test_template_kwargs_reach_every_render_of_a_job():
    """The batch render of Python chats used to leave the tokenizer's template variables out."""
    from lossmask.chat.tokenizer import ChatTokenizer

    template = "{% for m in messages %}{{ prefix }}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    ct = ChatTokenizer(chat_tokenizer("qwen2.5").tokenizer, chat_template=template, template_kwargs={"prefix": "P:"})
    chats = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(3)]
    expected = [f"P:q{i}<|im_end|>P:a{i}<|im_end|>" for i in range(3)]
    assert [ct.render(chat) for chat in chats] == expected
    assert render_chats(ct, chats)[0] == expected
    assert DirectRenderer(ct).render(chats)[0] == expected


def test_a_renderer_that_differs_is_dropped_for_the_job_with_a_warning():
    ct = chat_tokenizer("qwen2.5")
    renderer = DirectRenderer(ct)
    renderer._compile = lambda template: _Changed()  # noqa: SLF001 - as a transformers that renders otherwise would
    chats = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]] * 3
    with pytest.warns(UserWarning, match="differs from apply_chat_template on chat 0"):
        texts, errors = renderer.render(chats)
    assert renderer.reason is not None and not errors
    assert texts == [ct.render(chats[0])] * 3


class _Changed:
    def generate(self, **kwargs):  # what render.render_bounded reads
        yield "something else"


def test_plain_arrow_types():
    assert plain_arrow_type(pa.list_(pa.struct([("role", pa.string()), ("content", pa.large_string())])))
    assert plain_arrow_type(pa.list_(pa.struct([("n", pa.int64()), ("x", pa.float32()), ("b", pa.bool_())])))
    assert not plain_arrow_type(pa.list_(pa.struct([("when", pa.timestamp("s"))])))
    assert not plain_arrow_type(pa.list_(pa.struct([("data", pa.binary())])))
    assert not plain_arrow_type(pa.list_(pa.map_(pa.string(), pa.string())))


@pytest.mark.parametrize("family", ["qwen2.5", "llama-3", "gemma-3", "falcon", "mistral-v1", "gpt-oss"])
def test_fast_location_equals_the_general_walk(family):
    """The {role, content} fast path of locate_messages finds the spans the walk over pieces finds."""
    ct = chat_tokenizer(family)
    column = pa.array(_chats())
    checked = 0
    for chat in messages_from_arrow(column):
        try:
            text = ct.render(chat)
        except ChatTemplateError:
            continue
        for drops_system in (False, True):
            assert locate.locate_messages(text, chat, system_optional=drops_system) == \
                locate._locate_pieces(text, chat, drops_system)  # noqa: SLF001
        checked += 1
    assert checked >= 5
