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
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

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


class ShapeCache:
    """The shapes learnt for one tokenizer: per shape, the template's text around the contents of its sentinel
    rendering (``pieces``, one more than the messages) and each turn's span as places (``_place``)."""

    def __init__(self, max_shapes: int = MAX_SHAPES):
        self.max_shapes = max_shapes
        self.shapes: OrderedDict = OrderedDict()
        self._lock = threading.Lock()  # (a job's batches may be labelled on threads that share the tokenizer)

    def __getstate__(self) -> dict:  # (a worker process gets the shapes learnt so far, and a lock of its own)
        return {"max_shapes": self.max_shapes,
                "shapes": OrderedDict((k, v) for k, v in self.shapes.items() if type(v) is tuple)}

    def __setstate__(self, state: dict) -> None:
        self.max_shapes, self.shapes, self._lock = state["max_shapes"], state["shapes"], threading.Lock()

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
