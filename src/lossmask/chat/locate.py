"""Where each message's text lies in a rendered chat, and whether the template kept it at all.

lossmask renders every chat row itself, so it can say which characters of the rendered row are
message text (data) and which the template wrote (structure). ``locate_messages`` finds each
message's pieces in the rendered text, in order:

- the content (a string, or the ``text`` parts of a list of parts); assistant content holding a reasoning
  close tag (``</think>``) that opens with ``<think>`` (R1-style data) is two pieces, the reasoning up to the
  first close tag and the answer after it, because templates move, reformat or drop the part before the tag.
  Any other ``</think>`` (a second one, one in content that does not open with ``<think>``, one beside a
  reasoning field) is answer text: DeepSeek-V3 keeps only what follows the last tag, and a row that loses
  answer text so is ``content_dropped``;
- the reasoning fields (``reasoning_content``, ``reasoning``, ``thinking``);
- each tool call's name and arguments: the JSON text as ``tojson`` writes it, else the arguments' values
  (every scalar, in the forms templates print it, found in order): GLM-4 and DeepSeek-V4 write
  arguments as key/value markup (``<arg_key>a</arg_key><arg_value>1.5</arg_value>``), not JSON; arguments
  that print no value (``{}``, empty strings) are found by the call's name, as those templates write nothing else.

A piece is looked for as written, then stripped (Llama-3 trims contents), then with every
whitespace run allowed to be any whitespace run (Falcon rewrites blank lines and CRLF); where a string
is also written through ``tojson`` (Llama-3.1's tool results), the nearest of its forms wins, so that a
later reply quoting the raw text does not take the message's place. A text with edge whitespace that a
template trims may also occur as written later in the row (``"7 "`` trimmed to ``7``, then ``"7 year olds"`` in
a later reply): found there, it would take the later text's place and leave the messages between unfound; so a
row with a message missing is located again with each such text looked for trimmed first, and that reading is
used when it finds every message. The pieces of one message never
share characters: gpt-oss drops the second of two parallel calls, and the second call's arguments must
not be found inside the first's (when equal) nor, by their values, inside the reasoning it writes before
the call (which may name the second call and quote its values).

When a message is missing, the blame goes to the message the template dropped: an earlier message whose
text was only found inside the missing message's text (a dropped tool result quoted by the reply after
it) is the one named.

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
import threading
from collections import OrderedDict
from dataclasses import dataclass
from collections.abc import Mapping, Sequence
from typing import Any

from ..options import WEIGHT_FIELDS
from .json_text import loads_nested

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
    # what each piece of ``pieces`` is (``message_pieces``'s ``what``: "content", "tool call arguments", a reasoning
    # key...), for weights that apply to part of a message (content parts, reasoning)
    kinds: tuple[str, ...] = ()


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
        if THINK_CLOSE in content and message.get("role") == "assistant" and r1_style(message):
            reasoning, _, answer = content.partition(THINK_CLOSE)
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
        name = function.get("name") if isinstance(function.get("name"), str) else ""
        arguments = function.get("arguments")
        given = isinstance(arguments, Mapping) or (isinstance(arguments, str) and bool(arguments.strip()))
        piece = _Arguments(arguments, name.strip()) if given else None
        if name.strip() and not (piece is not None and piece.name):  # else the arguments are found at the name
            pieces.append((name, False, "tool call name"))
        if piece is not None:
            pieces.append((piece, True, "tool call arguments"))
    return pieces


def r1_style(message: Mapping) -> bool:
    """Does the content open with ``<think>`` (R1-style reasoning, up to the first ``</think>``), with no reasoning
    field beside it? Otherwise a ``</think>`` in the content is answer text."""
    content = message.get("content")
    return isinstance(content, str) and content.lstrip().startswith(THINK_OPEN) and \
        not any(isinstance(message.get(key), str) and message[key].strip() for key in REASONING_KEYS)


def stray_think(message: Any, what: str) -> str:
    """What to add to a missing content's report when a ``</think>`` in it is answer text (``message_pieces``)."""
    content = message.get("content") if isinstance(message, Mapping) else None
    if what != "content" or not isinstance(content, str) or THINK_CLOSE not in content:
        return ""
    return f"; it holds {THINK_CLOSE!r}, and this template keeps only the text after that tag"


def _leaves(value: Any) -> list[Any]:
    """The scalar leaves of a JSON value, in order (an object's keys are the template's business, not data); an
    empty object or list is a leaf of its own (GLM-4 writes ``<arg_value>[]</arg_value>``)."""
    if isinstance(value, Mapping) and value:
        return [s for v in value.values() for s in _leaves(v)]
    if isinstance(value, (list, tuple)) and value:
        return [s for v in value for s in _leaves(v)]
    return [value]


PLAIN_KEYS = frozenset(("role", "content"))  # a message the template writes as plain text
_WEIGHT_KEYS = frozenset(WEIGHT_FIELDS)  # a message's own weight, read by chat/weights.py, never by a template


def weighed_only(message: dict) -> bool:
    """``{role, content}`` and weight fields holding a number or a boolean, nothing else: rendered as a plain message."""
    extra = message.keys() - PLAIN_KEYS
    return len(message) == len(extra) + 2 and extra <= _WEIGHT_KEYS and \
        all(type(message[key]) in (bool, int, float) for key in extra)


def locate_messages(text: str, messages: Sequence[Any], *, system_optional: bool = False) -> Located:
    """Find every message's pieces in ``text`` (in order); see the module docstring for the rule."""
    # Most rows are {role, content} messages whose content the template writes as it is: each found by
    # its first characters and one compare (a quarter of the time of the general walk below, which gives
    # the same spans for them).
    spans: list[tuple[int, int]] = []
    pieces: list[tuple[int, int, int, bool]] = []
    cursor = 0
    for index, message in enumerate(messages):
        content = message.get("content") if type(message) is dict and (len(message) <= 2 or weighed_only(message)) \
            else None
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
        return Located(_merge(spans), None, tuple(pieces), ("content",) * len(pieces))
    located = _RECENT.get(text, messages, system_optional)
    if located is not None:
        return located
    located = _locate_pieces(text, messages, system_optional)
    if located.missing is not None:  # text a template trims may recur later as written: look for it trimmed first
        trimmed = _locate_pieces(text, messages, system_optional, trimmed=True)
        if trimmed.missing is None:
            located = trimmed
    _RECENT.put(text, messages, system_optional, located)
    return located


class _Recent:
    """The general walk's last answers, kept by the rendered text's identity: a row's messages are located when its
    batch is encoded, and again when its turns are labelled from its rendering (``turn_spans``), on the same text
    object and the same message objects. An answer is given again only for that very text and those very messages
    (and the same ``system_optional``); at most ``max_chars`` characters of text are kept, the oldest dropped first."""

    def __init__(self, max_chars: int = 1 << 23):
        self.max_chars, self.chars = max_chars, 0
        self.entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, text: str, messages: Sequence[Any], system_optional: bool) -> Located | None:
        entry = self.entries.get(id(text))
        if entry is None or entry[0] is not text or entry[2] != system_optional or len(entry[1]) != len(messages) \
                or not all(a is b for a, b in zip(entry[1], messages)):
            return None
        return entry[3]

    def put(self, text: str, messages: Sequence[Any], system_optional: bool, located: Located) -> None:
        if len(text) > self.max_chars:
            return
        with self._lock:
            old = self.entries.pop(id(text), None)
            if old is not None:
                self.chars -= len(old[0])
            self.entries[id(text)] = (text, tuple(messages), system_optional, located)
            self.chars += len(text)
            while self.chars > self.max_chars:
                self.chars -= len(self.entries.popitem(last=False)[1][0])


_RECENT = _Recent()


def _locate_pieces(text: str, messages: Sequence[Any], system_optional: bool, skip: frozenset = frozenset(),
                   trimmed: bool = False) -> Located:
    spans: list[tuple[int, int]] = []
    pieces: list[tuple[int, int, int, bool]] = []
    kinds: list[str] = []
    missing = None
    cursor = 0
    found_at: list[tuple[int, list[tuple[int, int]]]] = []  # per message: the cursor before it, its pieces' spans
    for index, message in enumerate(messages):
        role = str(message.get("role")) if isinstance(message, (dict, Mapping)) else "?"
        if index in skip:
            found_at.append((cursor, []))
            continue
        after = cursor
        # this message's pieces never share characters: a call's arguments are not found by their values inside
        # its reasoning (gpt-oss drops a second parallel call, and reasoning that names it is not the call)
        mine: list[tuple[int, int]] = []
        for piece, required, what in message_pieces(message):
            if trimmed and type(piece) is str:
                piece = piece.strip()
            found = _find_clear(text, piece, after, mine)
            if found is None and after != cursor:  # pieces out of the usual order
                found = _find_clear(text, piece, cursor, mine)
            if found is None:
                if required and missing is None and not (system_optional and role == "system"):
                    blamed = _blame(text, piece, found_at, messages)
                    if blamed is not None and system_optional and blamed[1] == "system":
                        # a system prompt the template leaves out, quoted by a later message (Mistral v3
                        # writes it only when the chat ends with a user turn): it is absent, not there
                        return _locate_pieces(text, messages, system_optional, skip | {blamed[0]}, trimmed)
                    missing = blamed or (index, role, what)
                continue
            mine.append(found)
            spans.append(_core(text, found))
            pieces.append((*spans[-1], index, required))
            kinds.append(what)
            after = found[1]
        found_at.append((cursor, mine))
        cursor = max(cursor, after)
    return Located(_merge(spans), missing, tuple(pieces), tuple(kinds))


def _find_clear(text: str, piece: str, start: int, taken: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """``_find``, skipping occurrences that overlap a span in ``taken``."""
    found = _find(text, piece, start)
    while found is not None and any(found[0] < e and s < found[1] for s, e in taken):
        found = _find(text, piece, found[0] + 1)
    return found


def _blame(text: str, piece: str, found_at, messages) -> tuple[int, str, str] | None:
    """The message the template dropped, when it is not the one whose ``piece`` is missing: the first earlier
    message found past where ``piece`` occurs when searched from before it (a dropped tool result quoted by
    the reply after it took the reply's place; a dropped system prompt quoted by a later user turn). Arguments found value by value
    spread over the row, so that their span says nothing about which message holds them: None."""
    if isinstance(piece, _Arguments):
        return None
    for index, (before, mine) in enumerate(found_at):
        if not mine:
            continue
        occurs = _find(text, piece, before)
        if occurs is not None and occurs[0] < max(e for _, e in mine):
            role = str(messages[index].get("role")) if isinstance(messages[index], Mapping) else "?"
            what = next((w for _, required, w in message_pieces(messages[index]) if required), "content")
            return index, role, what
    return None


class _Arguments(str):
    """A tool call's arguments (an object, or its JSON text). ``str`` of it is the text as given (or as
    ``tojson`` writes an object); ``forms``: the JSON texts a template may write; ``leaves``: for each scalar
    value, the forms a template prints it in, for templates that write key/value markup instead of JSON.
    ``name``: the call's name, the one text left to find when the arguments print no value (``{}``, or only empty
    strings: GLM-4 and DeepSeek-V4 write nothing for them)."""

    def __new__(cls, arguments: Any, name: str = ""):
        value = arguments
        if isinstance(arguments, str):
            try:
                value = loads_nested(arguments)
            except json.JSONDecodeError:
                value = None
        first = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        self = super().__new__(cls, first)
        forms = [first]
        if isinstance(value, (Mapping, list)):
            written = first if value is arguments else json.dumps(value, ensure_ascii=False)
            forms += [written, written if written.isascii() else json.dumps(value),
                      json.dumps(value, separators=(",", ":"))]
        self.forms = tuple(dict.fromkeys(forms))
        # how far past its end a value's match may look (a number's or word's last character, ``]]>``), and more
        self.reach = max(map(len, self.forms)) + 8
        values = _leaves(value) if isinstance(value, (Mapping, list)) and value else []
        patterns = {id(v): _leaf_pattern(v) for v in values}  # (each value's pattern made once, for both orders)
        self.leaves = [patterns[id(v)] for v in values if patterns[id(v)] is not None]
        # the values in the order of their sorted keys, for templates that write an object's keys sorted (Gemma-4)
        ordered = _leaves(_sorted_keys(value)) if self.leaves else []
        if [id(v) for v in ordered] == [id(v) for v in values]:
            self.orders = [self.leaves]
        else:
            ordered = [p for p in (patterns[id(v)] if id(v) in patterns else _leaf_pattern(v) for v in ordered)
                       if p is not None]
            self.orders = [self.leaves] + ([ordered] if ordered != self.leaves else [])
        self.name = name if isinstance(value, (Mapping, list)) and not self.leaves else ""
        # the string values, which templates copy verbatim (the raw text when it is not a JSON object or list)
        self.strings = ([v for v in _leaves(value) if isinstance(v, str) and v.strip()]
                        if isinstance(value, (Mapping, list)) else [first])
        return self


def _sorted_keys(value: Any) -> Any:
    """A JSON value with every object's keys sorted, at every depth."""
    if isinstance(value, Mapping):
        return {k: _sorted_keys(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, (list, tuple)):
        return [_sorted_keys(v) for v in value]
    return value


def _leaf_pattern(value: Any) -> Any:
    """How a template may print one argument value: a string quoted as JSON or Python, or raw between markup
    (``>v<``, whitespace around it allowed), a number as JSON or Python writes it, a boolean or null as JSON or
    Python; a number or word is matched whole (``1`` is not found inside ``10``); an empty object or list as ``{}`` or
    ``[]``. Empty strings print as nothing: None. A string is matched by ``_TextValue`` (found with ``str.find``: a
    pattern compiled per value cost more than searching the row); the rest by a compiled pattern (``re`` caches those
    by their text, and a row's numbers and words repeat). Either has ``span(text, pos, endpos)``."""
    if isinstance(value, str):
        return _TextValue(value) if value.strip() else None
    if isinstance(value, (Mapping, list, tuple)):  # an empty object or list, as JSON or Python writes it
        return _Pattern(r"\{\s*\}" if isinstance(value, Mapping) else r"\[\s*\]")
    if isinstance(value, bool) or value is None:
        words = {"true", "True"} if value is True else {"false", "False"} if value is False else {"null", "None"}
        return _Pattern(r"(?<!\w)(?:" + "|".join(sorted(words)) + r")(?!\w)")
    if isinstance(value, (int, float)):
        forms = {json.dumps(value), repr(value), str(value)}
        if isinstance(value, float) and value.is_integer():
            forms.add(str(int(value)))
        number = "|".join(re.escape(f) for f in sorted(forms, key=len, reverse=True))
        return _Pattern(r"(?<![\w.])(?:" + number + r")(?![\w]|\.\d)")
    return None


class _Pattern:
    """A leaf matched by a regular expression (compiled through ``re``'s cache: the same text is compiled once)."""

    __slots__ = ("pattern",)

    def __init__(self, pattern: str):
        self.pattern = re.compile(pattern)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Pattern) and other.pattern == self.pattern

    def span(self, text: str, pos: int, endpos: int) -> tuple[int, int] | None:
        match = self.pattern.search(text, pos, endpos)
        return None if match is None else match.span()


_MARKUP_BEFORE, _MARKUP_AFTER = ">]", "<[]"
_CDATA_OPEN, _CDATA_CLOSE = "<![CDATA[", "]]>"


class _TextValue:
    r"""A string argument value (not only whitespace), as a template may print it, searched as a regular expression
    would search ``quoted | (?<=[>\]])\s*(?:raw)\s*(?=[<\[\]]) | (?<=<!\[CDATA\[)(?:raw)(?=\]\]>)``: quoted as JSON
    or as Python writes it (pythonic calls: ``f(city='Paris')``); raw between markup with any whitespace around it
    (``<arg_value>v</arg_value>``: GLM-4; ``<parameter=city>\nv\n</parameter>``: Qwen3-Coder, Nemotron-3;
    ``<city>v]<]minimax[>[</city>``: MiniMax-M3), the whitespace inside the match; or in a CDATA block (MiniCPM5
    wraps a value holding ``<``: ``<![CDATA[v]]>``). The markup is the template's, outside the match. The leftmost
    match wins; at one start, a quoted form (the longest) before the markup."""

    __slots__ = ("quoted", "raw", "core")

    def __init__(self, value: str):
        written = json.dumps(value, ensure_ascii=False)
        forms = {written, written if written.isascii() else json.dumps(value), f"'{value}'", repr(value)}
        self.quoted = tuple(sorted(forms, key=len, reverse=True))
        self.raw = tuple(sorted({value, value.strip()}, key=len, reverse=True))
        self.core = value.strip()

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _TextValue) and other.quoted == self.quoted and other.raw == self.raw

    def span(self, text: str, pos: int, endpos: int) -> tuple[int, int] | None:
        endpos = min(endpos, len(text))
        best = None  # (start, rank, end): at one start, a quoted form wins over the markup, the markup over CDATA
        for rank, form in enumerate(self.quoted):
            at = text.find(form, pos, endpos)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, rank, at + len(form))
        limit = endpos if best is None else best[0] + 1  # a later start loses
        found = self._markup(text, pos, endpos, limit)
        if found is not None and (best is None or found[0] < best[0]):
            best = (found[0], len(self.quoted), found[1])
        limit = endpos if best is None else best[0] + 1
        for raw in self.raw:
            at = text.find(_CDATA_OPEN + raw + _CDATA_CLOSE, max(pos - len(_CDATA_OPEN), 0), endpos)
            start = at + len(_CDATA_OPEN)
            if at >= 0 and start < limit and (best is None or start < best[0]):
                best = (start, len(self.quoted) + 1, start + len(raw))
        return None if best is None else (best[0], best[2])

    def _markup(self, text: str, pos: int, endpos: int, limit: int) -> tuple[int, int] | None:
        """The first match between markup that starts before ``limit``: the value's core with the whitespace run
        before it, after ``>`` or ``]``; then whitespace up to ``<``, ``[`` or ``]`` (before ``endpos``)."""
        core = self.core
        at = text.find(core, pos, endpos)
        while at >= 0:
            start = at
            while start > pos and text[start - 1].isspace():
                start -= 1
            if start >= limit:
                return None
            end = at + len(core)
            if start > 0 and text[start - 1] in _MARKUP_BEFORE:
                after = end
                while after < endpos and text[after].isspace():
                    after += 1
                if after < endpos and text[after] in _MARKUP_AFTER:
                    return start, after
            at = text.find(core, at + 1, endpos)
        return None


def find_piece(text: str, piece: str, start: int = 0) -> tuple[int, int] | None:
    """Where one piece of ``message_pieces`` occurs in ``text`` from ``start``, found as ``locate_messages`` finds it."""
    return _find(text, piece, start)


def _find(text: str, piece: str, start: int) -> tuple[int, int] | None:
    if isinstance(piece, _Arguments):
        if piece.leaves:
            # the values in their first order found first: where no JSON text of the call starts before a little past
            # them, no later one changes them (below), and the rest of the row is not searched for it
            near = _leaves_span(text, piece.orders[0], start, len(text))
            if near is not None and not _written_before(text, piece, start, near[1] + piece.reach):
                return near
        found = _find_first(text, piece.forms, start) or _find_text(text, str(piece), start)
        if found is None and piece.name:  # no value to find: the call is there when its name is
            return _find_text(text, piece.name, start)
        if not piece.leaves:
            return found
        # each value in order, after the last: the call's own text (an earlier look-alike is not the call); it wins
        # over the JSON text when it ends before that (a later tool result that echoes the arguments as JSON)
        for leaves in piece.orders:
            span = _leaves_span(text, leaves, start, found[0] if found is not None else len(text))
            if span is not None:
                return span
        return found
    return _find_text(text, piece, start)


def _leaves_span(text: str, leaves: Sequence[Any], start: int, end: int) -> tuple[int, int] | None:
    """From the first value's start to the last's end, each value found after the one before, all before ``end``."""
    at, first = start, None
    for leaf in leaves:
        match = leaf.span(text, at, end)
        if match is None:
            return None
        first = match[0] if first is None else first
        at = match[1]
    return first, at


def _written_before(text: str, piece: "_Arguments", start: int, reach: int) -> bool:
    """Might the JSON text of a call (any form ``_find`` takes for it) start in ``text`` from ``start`` before
    ``reach``? (False is certain; True may be wrong, and only costs the full search.) The values found ending
    ``_Arguments.reach`` before ``reach`` are those found before any later JSON text: a value's match, and what it looks
    at past its end, lies before it."""
    raw = str(piece)
    forms = (*piece.forms, *_escaped(raw), raw.strip(), *raw.split()[:1])
    return any(text.find(form, start, reach + len(form) - 1) >= 0 for form in forms if form)


def _escaped(piece: str) -> list[str]:
    """``piece`` as ``tojson`` writes a string (without the quotes), where that differs from the piece (it does not
    where every character is printable ASCII, neither a quote nor a backslash)."""
    if piece.isascii() and piece.isprintable() and '"' not in piece and "\\" not in piece:
        return []
    return [*({json.dumps(piece, ensure_ascii=False)[1:-1], json.dumps(piece)[1:-1]} - {piece})]


def _find_text(text: str, piece: str, start: int) -> tuple[int, int] | None:
    # as written, or as tojson writes a string (gpt-oss's tool results, Llama-3.1's ipython turns): the nearest
    # form, so that a later message quoting the raw text does not stand in for an escaped one here
    found = _find_first(text, [piece, *_escaped(piece)], start)
    if found is not None:
        return found
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
    """The first of ``forms`` to occur from ``start`` (at one start, the shorter): each form after the first is looked
    for only before the best found so far, so a form the row never writes is not searched for to its end."""
    best = None
    for form in forms:
        at = text.find(form, start) if best is None else text.find(form, start, best[0] + len(form))
        if at >= 0 and (best is None or (at, at + len(form)) < best):
            best = (at, at + len(form))
    return best


def _merge(spans: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return tuple(out)
