"""Where each message's text lies in a rendered chat, and whether the template kept it at all.

lossmask renders every chat row itself, so it can say which characters of the rendered row are
message text (data) and which the template wrote (structure). ``locate_messages`` finds each
message's pieces in the rendered text, in order:

- the content (a string, or the ``text`` parts of a list of parts); assistant content holding a reasoning
  close tag (``</think>``, R1-style data) is two pieces, the reasoning before the tag and the answer
  after it, because templates move, reformat or drop the part before the tag;
- the reasoning fields (``reasoning_content``, ``reasoning``, ``thinking``);
- each tool call's name and arguments (a JSON string, or an object's string values).

A piece is looked for as written, then stripped (Llama-3 trims contents), then with every
whitespace run allowed to be any whitespace run (Falcon rewrites blank lines and CRLF).

**Required pieces** are the content's answer part, text parts and tool-call arguments. A message
counts as present when each of its required pieces is found. Reasoning, the reasoning part of
R1-style content and tool names are looked for (their text is data too) but never required:
templates keep or drop reasoning by their own policy (Qwen3 and gpt-oss keep only the latest
turn's; Llama-3 renders none), which changes what trains but not where a turn starts or stops.
System messages are not required of a template that drops every system message (Phi-3): the model
never sees one, at training or inference. Everything else missing (Phi-3 drops tool messages and
the tool calls themselves; Qwen2.5 skips a message whose role it does not know) is ``missing``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Located:
    """``spans``: ``(start, end)`` character ranges of message text found in the rendering, sorted and
    disjoint. ``missing``: ``(message index, role, what)`` of the first message the template dropped or
    rewrote beyond recognition, or None."""

    spans: tuple[tuple[int, int], ...]
    missing: tuple[int, str, str] | None
    # ``(start, end, message index, required)`` of every piece found, unmerged: which message each span is
    # text of, for the role invariant (text of a user, system or tool message never trains, an assistant's does)
    pieces: tuple[tuple[int, int, int, bool], ...] = ()


def message_pieces(message: Any) -> list[tuple[str, bool, str]]:
    """``(text, required, what)`` for each piece of one message, in the order templates write them."""
    if not isinstance(message, dict) and not isinstance(message, Mapping):
        return []
    content = message.get("content")
    if len(message) <= 2 and isinstance(content, str) and THINK_CLOSE not in content:  # {role, content}: most rows
        return [(content, True, "content")] if content.strip() else []
    pieces: list[tuple[str, bool, str]] = []
    for key in REASONING_KEYS:
        value = message.get(key)
        if isinstance(value, str) and value.strip():
            pieces.append((value, False, key))
    if isinstance(content, str):
        if THINK_CLOSE in content and message.get("role") == "assistant":
            reasoning, _, answer = content.rpartition(THINK_CLOSE)
            reasoning = reasoning.replace(THINK_OPEN, "", 1)
            if reasoning.strip():
                pieces.append((reasoning, False, "reasoning in content"))
            if answer.strip():
                pieces.append((answer, True, "content"))
        elif content.strip():
            pieces.append((content, True, "content"))
    elif isinstance(content, (list, tuple)):
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str) and part["text"].strip():
                pieces.append((part["text"], True, "content"))
    for call in message.get("tool_calls") or ():
        function = call.get("function", call) if isinstance(call, Mapping) else {}
        if not isinstance(function, Mapping):
            continue
        if isinstance(function.get("name"), str) and function["name"].strip():
            pieces.append((function["name"], False, "tool call name"))
        arguments = function.get("arguments")
        if isinstance(arguments, Mapping):  # as the template's tojson writes it, else each string value
            pieces.append((_ObjectText(arguments), True, "tool call arguments"))
        elif isinstance(arguments, str) and arguments.strip():
            pieces.append((arguments, True, "tool call arguments"))
    return pieces


def _strings(value: Any) -> list[str]:
    """The string leaves of a JSON value (an object's keys are the template's business, not data)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def locate_messages(text: str, messages: Sequence[Any], *, system_optional: bool = False) -> Located:
    """Find every message's pieces in ``text`` (in order); see the module docstring for the rule."""
    # Most rows are {role, content} messages whose content the template writes as it is: each found by
    # its first characters and one compare (a quarter of the time of the general walk below, which gives
    # the same spans for them).
    spans: list[tuple[int, int]] = []
    pieces: list[tuple[int, int, int, bool]] = []
    cursor = 0
    for index, message in enumerate(messages):
        content = message.get("content") if type(message) is dict and len(message) <= 2 else None
        if type(content) is not str or THINK_CLOSE in content:
            break
        if not content.strip():
            continue
        at = text.find(content[:16], cursor)  # a short needle, then one compare: twice as fast as finding it all
        if at >= 0 and not text.startswith(content, at):
            at = text.find(content, cursor)
        if at < 0:
            break
        cursor = at + len(content)
        spans.append(_core(text, (at, cursor)))
        pieces.append((*spans[-1], index, True))
    else:
        return Located(_merge(spans), None, tuple(pieces))
    return _locate_pieces(text, messages, system_optional)


def _locate_pieces(text: str, messages: Sequence[Any], system_optional: bool) -> Located:
    spans: list[tuple[int, int]] = []
    pieces: list[tuple[int, int, int, bool]] = []
    missing = None
    cursor = 0
    for index, message in enumerate(messages):
        role = str(message.get("role")) if isinstance(message, (dict, Mapping)) else "?"
        after = cursor
        for piece, required, what in message_pieces(message):
            found = _find(text, piece, after)
            if found is None and after != cursor:  # pieces out of the usual order
                found = _find(text, piece, cursor)
            if found is None:
                if required and missing is None and not (system_optional and role == "system"):
                    missing = (index, role, what)
                continue
            spans.append(_core(text, found))
            pieces.append((*spans[-1], index, required))
            after = found[1]
        cursor = max(cursor, after)
    return Located(_merge(spans), missing, tuple(pieces))


class _ObjectText(str):
    """An object's arguments: its JSON text as tojson writes it (``str`` of this), else its string values."""

    def __new__(cls, value: Mapping):
        self = super().__new__(cls, json.dumps(value, ensure_ascii=False))
        self.forms = (json.dumps(value, ensure_ascii=False), json.dumps(value), json.dumps(value, separators=(",", ":")))
        self.leaves = [v for v in _strings(value) if v.strip()]
        return self


def _find(text: str, piece: str, start: int) -> tuple[int, int] | None:
    if isinstance(piece, _ObjectText):
        for form in piece.forms:
            at = text.find(form, start)
            if at >= 0:
                return at, at + len(form)
        # each value as a JSON string or an XML-style element (GLM writes <arg_value>v</arg_value>); a bare
        # value could be any later text that quotes it
        found = [_find_first(text, (f'"{leaf}"', json.dumps(leaf), f">{leaf}<"), start) for leaf in piece.leaves]
        if not found or None in found:
            return None
        return min(f[0] for f in found) + 1, max(f[1] for f in found) - 1
    at = text.find(piece, start)
    if at >= 0:
        return at, at + len(piece)
    # a string the template wrote through tojson (gpt-oss's tool results, Qwen2.5's string arguments)
    for escaped in {json.dumps(piece, ensure_ascii=False)[1:-1], json.dumps(piece)[1:-1]} - {piece}:
        at = text.find(escaped, start)
        if at >= 0:
            return at, at + len(escaped)
    stripped = piece.strip()
    at = text.find(stripped, start)
    if at >= 0:
        return at, at + len(stripped)
    words = stripped.split()
    if len(words) > 1:
        match = re.compile(r"\s+".join(map(re.escape, words))).search(text, start)
        if match:
            return match.span()
    return None


def _core(text: str, span: tuple[int, int]) -> tuple[int, int]:
    """The span without its edge whitespace: a template that strips a content may leave its own newline
    where the content's was, and whitespace at the edges is where header variants merge; only the core is data."""
    start, end = span
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


def _find_first(text: str, forms: Sequence[str], start: int) -> tuple[int, int] | None:
    hits = [(at, at + len(form)) for form in forms for at in [text.find(form, start)] if at >= 0]
    return min(hits) if hits else None


def _merge(spans: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return tuple(out)
