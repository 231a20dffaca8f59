"""Rows with tools or tool calls read off their shape's sentinel rendering label as their own renders from the row's start.

``chat.shape_cache.tool_shape`` keys a row by everything but its free texts (contents, reasoning, the strings in a
call's arguments, or the arguments' JSON text): roles, ids, names, argument keys, numbers, the tools. Each shape is learnt
once, on the chat with a sentinel per text, and a row is read off it where its rendering is the sentinel rendering with
its texts in place (each as it is or JSON-escaped, one way only) and the message search finds its messages at the
shape's places; else it renders its own turns. The reference is each row rendered from its start, turn by turn
(``_SHORT_CONTEXTS = False``, no shapes): on every template of llama.cpp's collection, for the agent chats (a call with
its result, parallel calls, reasoning, system + tools; arguments as objects and as JSON text) and long traces, read
off a shape the first time and again with other texts (holding sentinels, the template's own header, quotes,
backslashes, non-ASCII letters), the labels are the same, or both none.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
import template_collection as collection  # noqa: E402
from test_template_collection import NAMES, _folder  # noqa: E402

sys.path.pop(0)

import lossmask  # noqa: E402
from lossmask.chat import shape_cache, turn_spans  # noqa: E402


def _retexted(messages: list[dict], change) -> list[dict]:
    """The chat with each text ``tool_shape`` substitutes changed by ``change`` (JSON-text arguments parsed, changed
    and written again)."""

    def arguments(value):
        if isinstance(value, str):
            try:
                return json.dumps(arguments(json.loads(value)), ensure_ascii=False)
            except ValueError:
                return change(value)
        if isinstance(value, dict):
            return {k: arguments(v) for k, v in value.items()}
        if isinstance(value, list):
            return [arguments(v) for v in value]
        return value

    out = []
    for m in messages:
        m = dict(m)
        for key in ("content", "reasoning_content"):
            if isinstance(m.get(key), str) and m[key].strip() == m[key] and m[key] and "think>" not in m[key]:
                m[key] = change(m[key])
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": arguments(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def _variants(messages: list[dict], header: str) -> list[list[dict]]:
    return [messages,
            _retexted(messages, lambda s: f"{s} {shape_cache.sentinel(0)}, {shape_cache.sentinel(3)}."),
            _retexted(messages, lambda s: f"{s} {header} sure"),
            _retexted(messages, lambda s: f'{s} "quoted", back\\slash, caf\u00e9 \u2014 ok')]


def _chats(tok) -> list[tuple[str, list, list | None]]:
    header = collection.quoting_chat(tok)[0]["content"]
    chats = []
    for kind in collection.agent_chats():
        chat = collection.agent_chat(tok, kind)
        if chat is not None:
            chats += [(kind, v, chat[1]) for v in _variants(chat[0], header)]
    for as_json in (False, True):
        messages, tools = collection.call_trace(6, as_json=as_json)
        if collection.render(tok, messages, tools=tools) is not None:
            chats += [("calls after one user", v, tools) for v in _variants(messages, header)]
            break
    for as_json in (False, True):
        messages, tools = collection.agent_trace(24, as_json=as_json)
        if collection.render(tok, messages, tools=tools) is not None:
            chats += [("trace", v, tools) for v in _variants(messages, header)]
            break
    return [(kind, m, t) for kind, m, t in chats if collection.render(tok, m, tools=t) is not None]


def _labels(ct, messages, tools, ids, shapes: bool, monkeypatch) -> list:
    monkeypatch.setattr(turn_spans, "_SHORT_CONTEXTS", shapes)
    found = []
    for last_turn_only in (False, True):
        trained, _ = turn_spans.label_row_from_rendering(ct, messages, ids, tools=tools, last_turn_only=last_turn_only)
        found.append(None if trained is None else trained.tolist())
    monkeypatch.setattr(turn_spans, "_SHORT_CONTEXTS", True)
    return found


def _count_reads(monkeypatch) -> list[bool]:
    """A list that gets, for each call of ``ShapeCache.read_tools``, whether it read the row off its shape."""
    reads: list[bool] = []
    original = shape_cache.ShapeCache.read_tools

    def counted(self, *args):
        found = original(self, *args)
        reads.append(found is not None)
        return found

    monkeypatch.setattr(shape_cache.ShapeCache, "read_tools", counted)
    return reads


def _same_as_reference(ct, chats, monkeypatch) -> list[bool]:
    ct._shape_cache = shape_cache.ShapeCache()
    reads = _count_reads(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        encoded = ct.encode_chats([{"messages": m, "tools": t} for _, m, t in chats])
    for (kind, messages, tools), ids in zip(chats, encoded.input_ids.to_pylist()):
        if ids is None:
            continue
        ids = np.asarray(ids)
        assert _labels(ct, messages, tools, ids, True, monkeypatch) == \
            _labels(ct, messages, tools, ids, False, monkeypatch), kind
    return reads


@pytest.mark.parametrize("name", NAMES)
def test_tool_call_rows_read_off_their_shape_label_as_renders_from_the_row_start(name, monkeypatch):
    tok = collection.tokenizer_for((_folder() / f"{name}.jinja").read_text(encoding="utf-8"))
    chats = _chats(tok)
    if not chats:
        pytest.skip(f"transformers renders none of the agent chats with {name}")
    _same_as_reference(lossmask.load_tokenizer(tok), chats, monkeypatch)


@pytest.mark.parametrize("name", ["Qwen-Qwen2.5-7B-Instruct", "Qwen3-Coder", "Qwen3.5-4B",
                                  "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "MiniMax-M2", "GLM-4.6"])
def test_json_and_xml_parameter_calls_are_read_off_their_shape(name, monkeypatch):
    """Templates that write arguments as JSON (Qwen2.5) and as XML parameters or key/value markup (Qwen3-Coder, Qwen3.5,
    Nemotron-3, MiniMax, GLM): parallel calls and long traces, with texts quoting sentinels, the header, quotes and
    non-ASCII letters, are read off their shape (no turn rendered), every row of them."""
    tok = collection.tokenizer_for((_folder() / f"{name}.jinja").read_text(encoding="utf-8"))
    chats = [c for c in _chats(tok) if c[0] in ("parallel calls", "tool call", "calls after one user", "trace")]
    assert {c[0] for c in chats} >= {"parallel calls", "tool call", "calls after one user", "trace"}, name
    reads = _same_as_reference(lossmask.load_tokenizer(tok), chats, monkeypatch)
    assert reads and all(reads), (name, reads)


# a template that branches on an argument's value (a note before a long city name) and one that rewrites a tool result
# (spaces as underscores): the sentinel rendering with a row's texts in place is not the row's rendering, so the row renders its own
BRANCHES = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
            "{% for c in m.tool_calls or [] %}{% if c.function.arguments.city | length > 8 %}(long) {% endif %}"
            "<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
            "<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
REWRITES = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'tool' %}{{ m.content | replace(' ', '_') }}"
            "{% elif m.content %}{{ m.content }}{% endif %}"
            "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}"
            "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _weather(city: str, result: str) -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}
    return [{"role": "user", "content": "Weather there?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": result}, {"role": "assistant", "content": "Done."}]


@pytest.mark.parametrize("template", [BRANCHES, REWRITES], ids=["branches", "rewrites"])
def test_a_template_that_branches_on_or_rewrites_a_text_falls_back_and_stays_exact(template, monkeypatch):
    ct = lossmask.load_tokenizer(collection.tokenizer_for(template))
    missed = _weather("Tromsoe-by-the-sea", "snow") if template is BRANCHES else _weather("Oslo", "Snow all day")
    chats = [("learnt", _weather("Oslo", "SNOW"), None), ("missed", missed, None), ("read", _weather("Rome", "SUN"), None)]
    reads = _same_as_reference(ct, chats, monkeypatch)
    # each row asked twice (all turns, the last turn only): the learning row and the third row are read off the shape;
    # the second is not (its rendering is not the shape's; where the template rewrote a text, the message search does
    # not find it, and the row is not asked at all: no labels, as from renders from the row's start)
    assert reads == ([True, True, False, False, True, True] if template is BRANCHES else [True, True, True, True]), reads


def test_a_shape_is_keyed_by_everything_but_the_texts():
    """Rows that differ only in their texts share a shape; a different id, function name, argument key, number or
    tool does not."""
    base = _weather("Oslo", "snow")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    key, texts = shape_cache.tool_shape(base, tools, [1, 3])
    assert texts == ["Weather there?", "Oslo", "snow", "Done."]
    assert shape_cache.tool_shape(_weather("Rome", "sun, 20 degrees"), tools, [1, 3])[0] == key
    other_id = [dict(m, tool_call_id="c2") if m["role"] == "tool" else m for m in base]
    other_key = [base[0], {**base[1], "tool_calls": [{**base[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"town": "Oslo"}}}]}] + base[2:]
    other_number = [base[0], {**base[1], "tool_calls": [{**base[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]}] + base[2:]
    for other, other_tools in ((other_id, tools), (other_key, tools), (other_number, tools), (base, None)):
        assert shape_cache.tool_shape(other, other_tools, [1, 3])[0] != key
    assert shape_cache.tool_shape([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}],
                                  None, [1]) is None  # a plain chat: plain_shape's
    # the sentinel chat has a sentinel where each text was, in the same order
    dummy = shape_cache.with_sentinels(base)
    assert shape_cache.tool_shape(dummy, tools, [1, 3]) == (key, [shape_cache.sentinel(k) for k in range(4)])
