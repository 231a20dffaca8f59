"""Each assistant turn's span found once per conversation shape, then read off each row by one string comparison.

Labels from the rendering (``turn_spans``) render, per assistant turn, the prompt and the turn. For plain chats
(``{role, content}`` messages, no tools) the template's own text does not depend on what the messages say, only on
their roles: the rendering is the template's text with each message's content in its place. So the turns of one
*shape* (the sequence of roles, and which turns are asked for) are found once, on the conversation with a sentinel
content per message (letters and digits, one per message, that no template rewrites), and kept as places relative
to the contents: "3 characters past the end of message 2's content".

A row of that shape is then checked, not trusted: the sentinel rendering with the row's contents put in place of
the sentinels must be the row's rendering exactly (one string comparison), and each content must be where the
message search (``locate.locate_messages``) finds it. Where both hold, the row's spans are the shape's places
shifted by its contents' lengths. Where either fails (a template that trims, escapes or branches on a content;
a content found earlier in the template's text), the row is labelled by its own renders, as a row of a shape
never seen. A content that holds a sentinel changes nothing: sentinels are looked for in the sentinel rendering
only, never in a row.

A shape is learnt the first time it is seen, or the second for a long one (``LEARN_AT_ONCE``: a row of a long shape
seen once, as a single long trace, pays no extra renders). Its places are read only once a row of it, labelled by
its own renders, has its turns at the same places (``TRIES`` rows are tried, then the shape is given up); a place
inside a content, which a content's length cannot shift, is never kept. The shapes are kept per tokenizer in a
bounded least-recently-used table (``MAX_SHAPES``).

A chat with tools or tool calls has a shape too (``tool_shape``): everything but its free texts (contents, reasoning,
the strings in a call's arguments), each of which gets a sentinel. It is learnt the first time it is seen, and the
row that taught it is read off it like any other: where its rendering is the sentinel rendering with its texts in
place (each written as it is or JSON-escaped, the one form the template's next text follows), and the message search
finds each of its pieces (contents, arguments, names) at the shape's places. Its spans then go to the row-by-row
token code (``turn_spans.trained_from_rendering``), not the batch's compiled pass.
"""

from __future__ import annotations

import bisect
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

MAX_SHAPES = 512  # shapes kept per tokenizer (learnt ones and ones seen once), least recently used dropped first

# a shape of up to this many messages is learnt the first time it is seen; a longer one (a long trace, which may never
# recur) the second time, so that a row of a shape seen once pays no extra renders
LEARN_AT_ONCE = 64

# a shape's sentinel places are checked against the rows' own renders until one agrees; past this many rows that do
# not (a template that branches on what the messages say), the shape is not read off
TRIES = 4

_SEEN = object()  # a shape seen once: learnt when it is seen again
_UNFIT = object()  # a shape whose turns cannot be read off a sentinel rendering: each row renders its own


@dataclass
class _Pending:
    """A shape's sentinel rendering, cut (``pieces``), and its turns' places, not yet checked against a row of it."""

    pieces: tuple
    places: tuple
    tries: int = 0

Spans = list  # [(start, text end, end, followed, parted)] as ``turn_spans`` gives them


def sentinel(k: int) -> str:
    """Message ``k``'s sentinel content: letters and digits no template rewrites, none a part of another's."""
    return f"Zq{k}Xj"


def plain_shape(messages: Sequence[Any], tools: Any, turns: Sequence[int]) -> tuple | None:
    """The shape of a plain chat: its roles and the turns asked for. None for any other chat (tools, a message with
    other fields, a content that is not text, blank, has whitespace at its edges, or holds ``</think>``), which
    is labelled by its own renders."""
    if tools:
        return None
    roles = []
    for m in messages:
        if type(m) is not dict or len(m) != 2:
            return None
        content, role = m.get("content"), m.get("role")
        if type(content) is not str or type(role) is not str or not content or content.strip() != content \
                or "</think>" in content:
            return None
        roles.append(role)
    return tuple(roles), tuple(turns)


# -- tool-call rows ---------------------------------------------------------------------------------------------

_TEXT_KEYS = frozenset(("content", "reasoning_content", "reasoning", "thinking"))
_SLOT = ("$",)  # a substituted text's place in a tool shape's key (no literal's key is this tuple)
_ESCAPED = re.compile(r'[^ -~]|["\\]')  # a character that JSON escaping may write otherwise


class _NoShape(Exception):
    """A row whose shape cannot be told: a value no key can stand for."""


def tool_shape(messages: Sequence[Any], tools: Any, turns: Sequence[int]) -> tuple[tuple, list[str]] | None:
    """``(key, texts)`` of a chat with tools or tool calls: ``texts`` are its free texts in order (each message's
    content and reasoning, each string in a call's arguments, or the arguments' JSON text where they are a string),
    each one non-blank with no whitespace at its edges and no think tag; ``key`` is everything else as it is (roles,
    the other fields, ids, names, argument keys, numbers) with a slot for each text, the tools and the turns asked
    for. None for a chat with neither tools nor tool calls (``plain_shape``'s) or one holding a value JSON cannot
    hold."""
    if not tools and not any(type(m) is dict and (m.get("tool_calls") or m.get("role") == "tool") for m in messages):
        return None
    texts: list[str] = []
    try:
        key = ("tools", _literal(tools), tuple(_message_key(m, texts, None) for m in messages), tuple(turns))
    except _NoShape:
        return None
    return _Key(key), texts


class _Key:
    """A tool shape's key: its nested tuple, hashed once (a long trace's key is looked up more than once a row)."""

    __slots__ = ("parts", "hash")

    def __init__(self, parts: tuple):
        self.parts, self.hash = parts, hash(parts)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: Any) -> bool:
        return type(other) is _Key and self.hash == other.hash and self.parts == other.parts

    def __getstate__(self) -> tuple:
        return self.parts

    def __setstate__(self, parts: tuple) -> None:
        self.parts, self.hash = parts, hash(parts)


def with_sentinels(messages: Sequence[Any]) -> list[dict]:
    """The chat with each of ``tool_shape``'s texts replaced by its sentinel (``sentinel(k)`` for the ``k``-th)."""
    out: list = []
    texts: list[str] = []
    for m in messages:
        _message_key(m, texts, out)
    return out


def _message_key(message: Any, texts: list, copy: list | None) -> tuple:
    """One message's part of a tool shape's key (texts appended to ``texts``); with ``copy``, its sentinel copy
    appended there (the sentinels counted on from ``copy``'s texts so far)."""
    if type(message) is not dict:
        raise _NoShape
    key, out = [], {}
    for name, value in message.items():
        if name in _TEXT_KEYS and type(value) is str:
            part, out[name] = _text(value, texts, copy)
        elif name == "tool_calls" and type(value) is list:
            calls = [_call(c, texts, copy) for c in value]
            part, out[name] = ("l",) + tuple(k for k, _ in calls), [c for _, c in calls]
        else:
            part, out[name] = _literal(value), value
        key.append((name, part))
    if copy is not None:
        copy.append(out)
    return tuple(key)


def _call(call: Any, texts: list, copy: list | None) -> tuple[tuple, Any]:
    if type(call) is not dict:
        return _literal(call), call
    key, out = [], {}
    for name, value in call.items():
        if name == "arguments":
            part, out[name] = _arguments(value, texts, copy)
        elif name == "function" and type(value) is dict:
            inner = [(k, _arguments(v, texts, copy) if k == "arguments" else (_literal(v), v)) for k, v in value.items()]
            part, out[name] = ("d",) + tuple((k, p[0]) for k, p in inner), {k: p[1] for k, p in inner}
        else:
            part, out[name] = _literal(value), value
        key.append((name, part))
    return ("d",) + tuple(key), out


def _arguments(value: Any, texts: list, copy: list | None) -> tuple[Any, Any]:
    """A call's arguments: each string in them a text (a JSON string given whole is one text)."""
    kind = type(value)
    if kind is str:
        return _text(value, texts, copy)
    if kind is dict:
        parts = [(k, _arguments(v, texts, copy)) for k, v in value.items()]
        return ("d",) + tuple((k, p[0]) for k, p in parts), {k: p[1] for k, p in parts}
    if kind is list:
        parts = [_arguments(v, texts, copy) for v in value]
        return ("l",) + tuple(p[0] for p in parts), [p[1] for p in parts]
    return _literal(value), value


def _text(value: str, texts: list, copy: list | None) -> tuple[Any, str]:
    if not value or value.strip() != value or "<think>" in value or "</think>" in value:
        return value, value  # (kept in the key as it is)
    texts.append(value)
    return _SLOT, sentinel(len(texts) - 1) if copy is not None else value


def _literal(value: Any) -> Any:
    kind = type(value)
    if kind is str:
        return value
    if value is None or kind in (bool, int, float):
        return kind.__name__, value
    if kind is dict:
        return ("d",) + tuple((k, _literal(v)) for k, v in value.items())
    if kind in (list, tuple):
        return ("l",) + tuple(_literal(v) for v in value)
    raise _NoShape


def _forms(value: str) -> tuple[str, ...]:
    """How a template may write a text: as it is, or escaped as ``tojson`` writes it inside a JSON string."""
    if _ESCAPED.search(value) is None:
        return (value,)
    forms = [value]
    for ascii_only in (False, True):
        escaped = json.dumps(value, ensure_ascii=ascii_only)[1:-1]
        if escaped not in forms:
            forms.append(escaped)
    return tuple(forms)


class ShapeCache:
    """The shapes learnt for one tokenizer: per shape, the template's text around the contents of its sentinel
    rendering (``pieces``, one more than the messages) and each turn's span as places (``_place``)."""

    def __init__(self, max_shapes: int = MAX_SHAPES):
        self.max_shapes = max_shapes
        self.shapes: OrderedDict = OrderedDict()
        self._lock = threading.Lock()  # (a job's batches may be labelled on threads that share the tokenizer)
        # tool shapes whose learning row was read off them, and not: past ``TRIES`` more misses than reads, a tool
        # shape is no longer learnt (a template that branches on its texts would make each new shape cost twice)
        self.tool_reads = self.tool_misses = 0

    def __getstate__(self) -> dict:  # (a worker process gets the shapes learnt so far, and a lock of its own)
        return {"max_shapes": self.max_shapes,
                "shapes": OrderedDict((k, v) for k, v in self.shapes.items() if type(v) is tuple)}

    def __setstate__(self, state: dict) -> None:
        self.max_shapes, self.shapes, self._lock = state["max_shapes"], state["shapes"], threading.Lock()
        self.tool_reads = self.tool_misses = 0

    def __len__(self) -> int:
        return len(self.shapes)

    def spans(self, key: tuple, messages: Sequence[dict], text: str) -> Spans | None:
        """The row's spans read off its shape, or None: a shape not learnt, or a row that differs from it."""
        read = self.read(key, messages, text)
        return None if read is None else read[0]

    def known(self, key: tuple) -> bool:
        """Has shape ``key`` been learnt (or found unfit)? A shape seen once, or never, has not."""
        entry = self.shapes.get(key)
        return entry is _UNFIT or type(entry) is tuple

    def read(self, key: tuple, messages: Sequence[dict], text: str) -> tuple[Spans, list[int]] | None:
        """``(spans, bounds)``: the row's spans read off its shape, and where each content lies in ``text``
        (``[0, start 0, end 0, start 1, ...]``, as the message search finds them); None for a shape not learnt or a
        row that differs from it."""
        with self._lock:
            entry = self.shapes.get(key)
            if type(entry) is not tuple:
                return None
            self.shapes.move_to_end(key)
        pieces, places = entry
        bounds = _bounds(pieces, [m["content"] for m in messages], text)
        if bounds is None:
            return None
        return [(bounds[a] + da, bounds[b] + db, bounds[c] + dc, follows, parted)
                for (a, da), (b, db), (c, dc), follows, parted in places], bounds

    def learn(self, key: tuple, messages: Sequence[dict], text: str, spans: Spans,
              render: Callable[[list], str], find: Callable[[list, str], Spans | None]) -> None:
        """A row of shape ``key`` whose spans its own renders found: note the shape's first sighting, or at its
        second learn it from the sentinel conversation (``render``: its rendering; ``find``: its spans), kept only
        where the row's spans sit at the same places."""
        entry = self.shapes.get(key)
        if entry is None and len(messages) > LEARN_AT_ONCE:
            self._put(key, _SEEN)
            return
        if entry is None or entry is _SEEN:
            entry = self._sentinel_places(messages, render, find)
        if type(entry) is _Pending:
            entry = self._checked(entry, messages, text, spans)
            self._put(key, entry)

    def read_tools(self, key: tuple, texts: Sequence[str], text: str, located: Any) -> Spans | None:
        """The spans of a row with tool calls read off its shape (``tool_shape``), or None: a shape not learnt, or a
        row whose rendering is not the shape's with its texts in place (each written as it is or JSON-escaped, one
        way only), or whose messages the message search (``located``, the row's) finds elsewhere than the shape's."""
        with self._lock:
            entry = self.shapes.get(key)
            if type(entry) is not tuple:
                return None
            self.shapes.move_to_end(key)
        pieces, order, places, piece_places = entry
        bounds = _filled(pieces, order, texts, text)
        if bounds is None or len(located.pieces) != len(piece_places) or \
                not np.array_equal(_places(bounds, located.pieces), piece_places):
            return None
        return [(bounds[a] + da, bounds[b] + db, bounds[c] + dc, follows, parted)
                for (a, da), (b, db), (c, dc), follows, parted in places]

    def learns_tools(self) -> bool:
        """Are new tool shapes still learnt (not past ``TRIES`` more learning rows missed than read)?"""
        return self.tool_misses < self.tool_reads + TRIES

    def learn_tools(self, key: tuple, dummy: list, texts: int, render: Callable[[list], str],
                    locate: Callable[[list, str], Any], find: Callable[[list, str, Any], Spans | None]) -> None:
        """Learn tool shape ``key`` from its sentinel chat ``dummy`` (``with_sentinels``, ``texts`` sentinels):
        ``render`` renders it, ``locate`` finds its messages, ``find`` its spans. ``_UNFIT`` where the template
        writes a sentinel twice, or a turn's span or a message's piece cannot be placed."""
        self._put(key, self._tool_places(dummy, texts, render, locate, find))

    def learnt(self, read: bool) -> None:
        """Count whether a tool shape's learning row was read off it."""
        with self._lock:
            if read:
                self.tool_reads += 1
            else:
                self.tool_misses += 1

    @staticmethod
    def _tool_places(dummy, texts, render, locate, find) -> Any:
        try:
            rendered = render(dummy)
        except Exception:  # (a template that refuses the sentinels: each row renders its own)
            return _UNFIT
        found = []
        for k in range(texts):
            s = sentinel(k)
            at = rendered.find(s)
            if at >= 0:
                if rendered.find(s, at + 1) >= 0:  # written twice: not one substitution
                    return _UNFIT
                found.append((at, k))
        found.sort()
        pieces, order, bounds, cursor = [], [], [0], 0
        for at, k in found:
            pieces.append(rendered[cursor:at])
            order.append(k)
            cursor = at + len(sentinel(k))
            bounds += [at, cursor]
        pieces.append(rendered[cursor:])
        located = locate(dummy, rendered)
        spans = find(dummy, rendered, located) if located.missing is None else None
        if spans is None:
            return _UNFIT
        places = []
        for s0, t0, e0, f0, p0 in spans:
            here = [_place(bounds, x) for x in (s0, t0, e0)]
            if None in here:
                return _UNFIT
            places.append((*here, f0, p0))
        piece_places = _places(bounds, located.pieces)
        if (piece_places[:, [0, 2]] < 0).any():
            return _UNFIT
        return tuple(pieces), tuple(order), tuple(places), piece_places

    def _put(self, key: tuple, value: Any) -> None:
        with self._lock:
            self.shapes[key] = value
            self.shapes.move_to_end(key)
            while len(self.shapes) > self.max_shapes:
                self.shapes.popitem(last=False)

    @staticmethod
    def _sentinel_places(messages, render, find) -> Any:
        """The shape's sentinel rendering cut at the sentinels, and its turns' places (``_Pending``); ``_UNFIT`` where
        the template does not write each sentinel once as it is, or a turn's span cannot be placed."""
        sentinels = [sentinel(k) for k in range(len(messages))]
        dummy = [{"role": m["role"], "content": s} for m, s in zip(messages, sentinels)]
        try:
            rendered = render(dummy)
        except Exception:  # (a template that refuses the sentinels: each row renders its own)
            return _UNFIT
        pieces, cursor = [], 0
        for s in sentinels:
            at = rendered.find(s, cursor)
            if at < 0 or rendered.find(s, at + 1) >= 0:  # rewritten, or written twice: not a plain substitution
                return _UNFIT
            pieces.append(rendered[cursor:at])
            cursor = at + len(s)
        pieces.append(rendered[cursor:])
        own = _bounds(pieces, sentinels, rendered)
        found = find(dummy, rendered) if own is not None else None
        if found is None:
            return _UNFIT
        places = []
        for s0, t0, e0, f0, p0 in found:
            here = [_place(own, x) for x in (s0, t0, e0)]
            if None in here:
                return _UNFIT
            places.append((*here, f0, p0))
        return _Pending(tuple(pieces), tuple(places))

    @staticmethod
    def _checked(pending: _Pending, messages, text, spans) -> Any:
        """The shape, learnt, where the row's own spans sit at its places; else still pending (``_UNFIT`` after
        ``TRIES`` rows)."""
        row = _bounds(pending.pieces, [m["content"] for m in messages], text)
        if row is not None and len(spans) == len(pending.places) and all(
                [_place(row, x) for x in (s, t, e)] == list(place[:3]) and (f, p) == place[3:]
                for (s, t, e, f, p), place in zip(spans, pending.places)):
            return pending.pieces, pending.places
        pending.tries += 1
        return _UNFIT if pending.tries >= TRIES else pending


def _bounds(pieces: Sequence[str], contents: Sequence[str], text: str) -> list[int] | None:
    """``[0, start 0, end 0, start 1, end 1, ...]`` of each content in ``text`` when ``text`` is ``pieces`` with the
    contents between them, and the message search finds each content there; None else."""
    if len(text) != sum(map(len, pieces)) + sum(map(len, contents)) or "".join(
            [p + c for p, c in zip(pieces, contents)] + [pieces[-1]]) != text:
        return None
    bounds, cursor, at = [0], 0, 0
    for piece, content in zip(pieces, contents):
        at += len(piece)
        # as ``locate_messages`` finds a plain content: its first characters, then the whole, from the last one's end
        found = text.find(content[:16], cursor)
        if found >= 0 and not text.startswith(content, found):
            found = text.find(content, cursor)
        if found != at:
            return None
        cursor = at = at + len(content)
        bounds += [found, at]
    return bounds


def _filled(pieces: Sequence[str], order: Sequence[int], texts: Sequence[str], text: str) -> list[int] | None:
    """``[0, start, end, ...]`` of each text placed in ``text`` (in ``order``) when ``text`` is ``pieces`` with a form of
    each text between them (``_forms``: the one form that the next piece follows); None else."""
    bounds, at = [0], 0
    for j, k in enumerate(order):
        if not text.startswith(pieces[j], at):
            return None
        at += len(pieces[j])
        fits = [f for f in _forms(texts[k]) if text.startswith(f, at) and text.startswith(pieces[j + 1], at + len(f))]
        if len(fits) != 1:
            return None
        bounds += [at, at + len(fits[0])]
        at += len(fits[0])
    if at + len(pieces[-1]) != len(text) or not text.startswith(pieces[-1], at):
        return None
    return bounds


def _places(bounds: list[int], pieces: Sequence[tuple]) -> np.ndarray:
    """Each message piece ``(start, end, message index, required)`` as a row ``[j, start - bounds[j], k, end - bounds[k],
    index, required]`` (``_place``'s places of its start and end); a place inside a text is ``-1, -1``."""
    at = np.asarray(pieces, dtype=np.int64).reshape(-1, 4)
    edges = np.asarray(bounds, dtype=np.int64)
    out = np.empty((at.shape[0], 6), dtype=np.int64)
    for column, x in ((0, at[:, 0]), (2, at[:, 1])):
        j = np.searchsorted(edges, x, "right") - 1
        inside = (j % 2 == 1) & (x > edges[j])
        out[:, column] = np.where(inside, -1, j)
        out[:, column + 1] = np.where(inside, -1, x - edges[j])
    out[:, 4:] = at[:, 2:]
    return out


def _place(bounds: list[int], x: int) -> tuple[int, int] | None:
    """``x`` as (the last bound at or before it, how far past it): None inside a content, where a content's own
    length would move it."""
    j = bisect.bisect_right(bounds, x) - 1
    if j % 2 == 1 and x > bounds[j]:
        return None
    return j, x - bounds[j]


def cache_of(ct: Any) -> ShapeCache | None:
    """The tokenizer's shape cache, made on first use (None for a stand-in that keeps no attributes)."""
    cache = getattr(ct, "_shape_cache", None)
    if cache is None:
        cache = ShapeCache()
        try:
            ct._shape_cache = cache
        except AttributeError:
            return None
    return cache
