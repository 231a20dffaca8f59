"""Tool-call arguments found in a rendering: a string value searched without a pattern compiled per value finds what
that pattern finds, and on a long trace each call's arguments are found in its own turn."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from conftest import chat_tokenizer
from lossmask.chat.locate import _leaf_pattern, locate_messages


def _reference(value: str) -> re.Pattern:
    """The rule for a string value as one regular expression (the reference the search is held to): quoted as JSON or
    Python, raw between markup with whitespace around it, or in a CDATA block."""
    forms = {json.dumps(value, ensure_ascii=False), json.dumps(value), f"'{value}'", repr(value)}
    quoted = "|".join(re.escape(f) for f in sorted(forms, key=len, reverse=True))
    raw = "|".join(re.escape(f) for f in sorted({value, value.strip()}, key=len, reverse=True))
    return re.compile(rf"{quoted}|(?<=[>\]])\s*(?:{raw})\s*(?=[<\[\]])|(?<=<!\[CDATA\[)(?:{raw})(?=\]\]>)")


_VALUES = st.text(alphabet="ab \n'\"<>]é", min_size=1, max_size=5).filter(str.strip)
_PIECES = st.sampled_from(["a", "b", "ab", " ", "\n", ">", "<", "[", "]", "'", '"', "é", "\\u00e9", "<![CDATA[", "]]>",
                           "<v>", "</v>", "\\n", "\\\""])


@settings(max_examples=3000, deadline=None)
@given(value=_VALUES, pieces=st.lists(st.one_of(_PIECES, _VALUES), max_size=14),
       pos=st.integers(0, 40), short=st.integers(0, 40))
@example(value="a ", pieces=[">", " ", "a ", " ", "<"], pos=1, short=0)
@example(value="a", pieces=["<![CDATA[", "a", "]]>"], pos=9, short=0)
@example(value="a", pieces=["'a'", ">", "a", "<"], pos=0, short=0)
def test_a_string_value_is_found_where_its_pattern_finds_it(value, pieces, pos, short):
    text = "".join(piece if piece is not None else value for piece in pieces)
    for placed in (text, text.replace("a", value, 2)):
        pos_ = min(pos, len(placed))
        endpos = max(pos_, len(placed) - short)
        match = _reference(value).search(placed, pos_, endpos)
        assert _leaf_pattern(value).span(placed, pos_, endpos) == (match.span() if match else None), (placed, pos_, endpos)


def _trace(calls: int, arguments: dict) -> list[dict]:
    messages = [{"role": "user", "content": "Look these words up."}]
    for k in range(calls):
        messages += [{"role": "assistant", "content": "",
                      "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": arguments}}]},
                     {"role": "tool", "content": f"result {k}"}]
    return messages + [{"role": "assistant", "content": "Done."}]


TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up.", "parameters": {
    "type": "object", "properties": {"word": {"type": "string"}, "times": {"type": "integer"}}}}}]


@pytest.mark.parametrize("family", ["qwen2.5", "glm-4"])
def test_each_call_of_a_long_trace_with_identical_arguments_is_found_in_its_own_turn(family):
    """Two hundred calls with the same arguments (JSON for Qwen2.5, key/value markup for GLM-4): each call's arguments
    are found between the result before it and the result after it, never another call's."""
    ct = chat_tokenizer(family)
    messages = _trace(200, {"word": "echo", "times": 2})
    text = ct.render(messages, tools=TOOLS)
    located = locate_messages(text, messages)
    assert located.missing is None
    spans = {}
    for a, b, index, _ in located.pieces:
        spans.setdefault(index, []).append((a, b))
    for k in range(200):
        call, before, after = 1 + 2 * k, 2 * k, 2 + 2 * k
        (a, b), = [span for span, what in zip((p[:2] for p in located.pieces if p[2] == call),
                                              (w for p, w in zip(located.pieces, located.kinds) if p[2] == call))
                   if what == "tool call arguments"]
        assert max(e for _, e in spans[before]) <= a < b <= min(s for s, _ in spans[after])
        assert "echo" in text[a:b] and "2" in text[a:b]
