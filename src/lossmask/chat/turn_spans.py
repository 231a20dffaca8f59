"""Each assistant turn's tokens found from the rendering alone: for the rows the markers cannot tell apart.

A template can write a turn with no header of its own: DeepSeek-V3 writes a tool call that follows a tool
result straight after ``<｜tool▁output▁end｜>``, with no ``<｜Assistant｜>``. No marker opens such a turn, so
the markers leave it untrained and the row breaks the role invariant (docs/masking-rule.md). lossmask rendered
the row itself, so it can find the turn another way, by rendering the conversation twice per assistant turn:

- up to the turn, with the generation prompt (what the model is given before it writes the turn);
- through the turn, as the last message.

The two renderings agree up to where the turn starts; the second one goes on with the turn, as far as it
agrees with the whole conversation's rendering. Of those tokens the turn trains up to its last special token
(its stop: ``<｜end▁of▁sentence｜>``, ``<|im_end|>``), or up to its last character other than whitespace when
it has none (Falcon). A token trains when its first character lies in the span, as in ``markers.verify``.

Each of those renders is made from a short context where it can stand for the whole: the system message, the
turn's last user message and the messages since the last assistant message before the turn. Its tail after the
message before the turn is read as the whole rendering's, when the part of the history it writes (from the first of
those messages to that message's end) is the row's text exactly; else the turn is rendered from the row's start. So
a row's work grows with its length, not its square; the row's time is bounded all the same
(``MaskOptions.max_row_rendering_seconds``: ``RenderingOverBudget``).

This is two renders per assistant turn. With verified token markers it is done only for the rare rows whose marker
labels break the invariant; their new labels are checked again before they are kept (``jobs.batch_step``). A
template whose markers cannot be read at all (2026's reasoning templates: the generation prompt opens a think block
that the history writes another way; GLM-4.6, whose turns close at the next role token) is labelled this way for
every row: ``FromRendering`` stands where the markers would, and each row keeps the role invariant or is counted.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa

from .locate import locate_messages
from .render import ChatTemplateError
from .shape_cache import cache_of, plain_shape, tool_shape, with_sentinels


@dataclass(frozen=True)
class FromRendering:
    """Stands where ``Markers`` would when a template's token markers cannot be read: each row is labelled from
    its own rendering (``label_from_rendering``), its assistant turns found by rendering the conversation up to
    and through each. Token ids alone carry no rendering: pre-tokenised rows need ``Markers``."""

    end: tuple = ()  # no stop pattern: each turn's stop token is found in its rendering
    mask_out: tuple = ()

    def to_dict(self) -> dict:
        return {"from_rendering": True}

    def __str__(self) -> str:
        return "labels from each row's rendering (no token markers)"


class RenderingOverBudget(Exception):
    """Labelling one row from its rendering went past its deadline (``MaskOptions.max_row_rendering_seconds``): the
    row is dropped as ``rendering_over_budget``, never waited on."""

    def __init__(self, seconds: float | None = None):
        self.seconds = seconds
        super().__init__(over_budget_message(seconds))


def over_budget_message(seconds: float | None) -> str:
    within = f"{seconds:g} seconds" if seconds is not None else "its time"
    return (f"labelling it from its rendering took more than {within} (max_row_rendering_seconds): the row is too long "
            "for its template to be followed turn by turn in that time")


def check_deadline(deadline: float | None, seconds: float | None = None) -> None:
    """Raise ``RenderingOverBudget`` once the monotonic clock is past ``deadline`` (None: no bound)."""
    if deadline is not None and time.monotonic() > deadline:
        raise RenderingOverBudget(seconds)


NOT_FOUND = ("its assistant turns cannot be found from the rendering: the chat template writes the conversation "
             "before a turn otherwise than its generation prompt does")


def trained_from_rendering(ct: Any, messages: Sequence[Mapping[str, Any]], ids: np.ndarray, *,
                           tools: Any = None, last_turn_only: bool = False,
                           special_tokens_in_content: str = "text", text: str | None = None,
                           offsets: np.ndarray | None = None, located: Any = None,
                           deadline: float | None = None) -> np.ndarray | None:
    """A bool per token of ``ids`` (the row as the messages path encoded it, perhaps cut at a maximum length):
    inside an assistant turn found from the rendering. None when it cannot be told: a rendering the template
    refuses, ids that are not this conversation's, a turn whose prompt disagrees with the text before it.

    ``text`` / ``offsets``: the row's rendering and each token's character span in it, when the caller has them
    (the batch step does): the row is then not rendered and encoded again. ``deadline``: a ``time.monotonic()`` past
    which it stops with ``RenderingOverBudget`` (checked before each turn's renders)."""
    messages = list(messages)
    ids = np.asarray(ids)
    try:
        if text is None:
            text = ct.render(messages, tools=tools)
    except ChatTemplateError:
        return None
    if offsets is None:
        row, offsets = _encode(ct, text, messages, special_tokens_in_content)
        if row.shape[0] < ids.shape[0] or not np.array_equal(row[: ids.shape[0]], ids):
            return None
    offsets = np.asarray(offsets)[: ids.shape[0]]
    turns = [i for i, m in enumerate(messages) if isinstance(m, Mapping) and m.get("role") == "assistant"]
    if last_turn_only:
        turns = turns[-1:]
    spans = turn_spans(ct, messages, text, turns, tools=tools, located=located, deadline=deadline)
    if spans is None:
        return None
    starts, ends = offsets[:, 0], offsets[:, 1]
    special = np.isin(ids, special_id_array(ct))
    trained = np.zeros(ids.shape[0], dtype=bool)
    near = _TokenWindow(starts, ends)
    for start, content_end, end, follows, parted in spans:
        # a token the span's start cuts into is written by the model where the prompt goes on otherwise there (the
        # prompt's ``<|channel>`` and the reply's ``<think>`` share "<"), where it is a special token (``<think>`` in
        # the prompt, ``</think>`` in the history), or where it holds the reply's first word (a header's last space
        # merged with it: ``: I``). Whitespace alone merged with the header's end is the header's, as its markers have it.
        lo, hi = near.crossing(start)
        straddles = lo + np.flatnonzero((starts[lo:hi] < start) & (ends[lo:hi] > start))
        cut = straddles[special[straddles] | parted]
        if not cut.size and straddles.size and text[start:int(ends[straddles[0]])].strip():
            cut = straddles[:1]
        first = int(starts[cut[0]]) if cut.size else start
        # (a special token that only begins in the span is not the turn's: the renderings parted inside it, as
        # <|user|> and <|endoftext|> share "<|")
        lo, hi = near.starting(first, end)
        inside = lo + np.flatnonzero((starts[lo:hi] >= first) & (starts[lo:hi] < end)
                                     & ((ends[lo:hi] <= end) | ~special[lo:hi]))
        if not inside.size:
            continue
        stops = inside[special[inside] & (ends[inside] > content_end)]
        if stops.size and closes_turns(ct):  # the turn's own stop: its last special token after the text
            last = int(stops[-1])
        else:
            # no stop of its own: the model stops by writing the next message's first token (GLM's <|user|>, and its
            # <|observation|> after a call's own </tool_call>), or the history closes the turn with a special token
            # that the turn rendered last leaves out (Apriel)
            if stops.size:
                last = int(stops[-1])
            else:
                last_char = start + len(text[start:end].rstrip())
                kept = inside[starts[inside] < last_char]
                if not kept.size:
                    continue
                last = int(kept[-1])
            after = last + 1
            while after < ids.shape[0] and not special[after] and not text[starts[after]:ends[after]].strip():
                after += 1
            if follows and after < ids.shape[0] and special[after] and not text[end:starts[after]].strip():
                last = after
        trained[int(inside[0]): last + 1] = True
    return trained


class _TokenWindow:
    """The tokens that can meet a span of characters, found by bisection where the tokens' starts and ends both rise
    (as a row's do): each span's masks are then made over those tokens alone, not the whole row. Where they do not
    rise, the window is the whole row, and the masks give the same tokens."""

    def __init__(self, starts: np.ndarray, ends: np.ndarray):
        # (contiguous int64 copies, made once: a strided column, or another integer type, would be copied by each search)
        self.starts, self.ends = np.ascontiguousarray(starts, np.int64), np.ascontiguousarray(ends, np.int64)
        self.n = int(starts.shape[0])
        self.sorted = bool(self.n < 2 or ((np.diff(starts) >= 0).all() and (np.diff(ends) >= 0).all()))

    def crossing(self, at: int) -> tuple[int, int]:
        """Covers the tokens with ``start < at < end``."""
        if not self.sorted:
            return 0, self.n
        return int(np.searchsorted(self.ends, at, "right")), int(np.searchsorted(self.starts, at, "left"))

    def starting(self, a: int, b: int) -> tuple[int, int]:
        """Covers the tokens with ``a <= start < b``."""
        if not self.sorted:
            return 0, self.n
        return int(np.searchsorted(self.starts, a, "left")), int(np.searchsorted(self.starts, b, "left"))

    def within(self, a: int, b: int) -> tuple[int, int]:
        """Covers the tokens with ``start >= a`` and ``end <= b``."""
        if not self.sorted:
            return 0, self.n
        lo, hi = int(np.searchsorted(self.starts, a, "left")), int(np.searchsorted(self.ends, b, "right"))
        return lo, max(lo, hi)


def _render(ct: Any, messages: list, tools: Any, add_generation_prompt: bool) -> str:
    """A prefix of a conversation, rendered: through the job's direct renderer where it has one (``ChatTokenizer``)."""
    direct = getattr(type(ct), "direct_render", None)
    if direct is not None:
        return ct.direct_render.render_one(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    return ct.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)


def _start_after(ct: Any, messages: list, i: int, prompt: str, text: str, ends_by_message: dict
                 ) -> tuple[int, int] | None:
    """Where turn ``i`` starts in ``text`` (and where in ``prompt`` that is), from the generation prompt's tail after the text of the last message before
    the turn that has text in both: that tail (the header) followed in ``text`` as far as it agrees."""
    earlier = [m for m in ends_by_message if m < i]
    if not earlier:
        return None
    last = max(earlier)
    own = locate_messages(prompt, messages[:i], system_optional=ct.content_tokens.drops_system)
    in_prompt = max((b for _, b, index, _ in own.pieces if index == last), default=None)
    if own.missing is not None or in_prompt is None:
        return None
    after = ends_by_message[last]
    shared = common_prefix(prompt[in_prompt:], text[after:])
    return after + shared, in_prompt + shared


def closes_turns(ct: Any) -> bool:
    """Does the template close an assistant's reply with a control token of its own (``<|im_end|>``, ``<|eot_id|>``)?
    Where it does not (GLM-4: the model stops by writing the next role's token, ``<|user|>``, ``<|observation|>``), a
    control token inside a turn (``</tool_call>``) closes a call, not the turn, and the turn's stop is the next
    message's first token. Read once per tokenizer off what the template writes after a reply that ends the chat."""
    cached = getattr(ct, "_closes_turns", None)
    if cached is not None:
        return cached
    exchange = [{"role": "user", "content": "Qz7p1"}, {"role": "assistant", "content": "Qz7p2"}]
    result = True  # a template that cannot render the probe: as before, the last control token stops the turn
    try:
        through = _render(ct, exchange, None, False)
        closing = through[through.rindex("Qz7p2") + len("Qz7p2"):]
        result = bool(closing.strip()) and bool(
            np.isin(np.asarray(ct.encode_with_offsets(closing)[0]), special_id_array(ct)).any())
    except (ChatTemplateError, ValueError):
        pass
    try:
        ct._closes_turns = result
    except AttributeError:
        pass
    return result


def special_id_array(ct: Any) -> np.ndarray:
    """The ids of the tokenizer's control tokens, as an array made once per tokenizer, for ``np.isin``: a turn's stop is
    one of them. Those flagged special, and every added token with visible text (Phi-3's ``<|end|>`` is added, not
    flagged special); not an added run of whitespace (Gemma-3 adds ``\n\n``...), which no turn stops on."""
    cached = getattr(ct, "_special_id_array", None)
    if cached is None:
        ids = set(ct.special_ids)
        added = getattr(getattr(ct, "tokenizer", None), "added_tokens_decoder", None) or {}
        ids.update(int(i) for i, token in added.items() if str(getattr(token, "content", token)).strip())
        cached = np.fromiter(sorted(ids), dtype=np.int64)
        try:
            ct._special_id_array = cached
        except AttributeError:  # a stand-in without attributes: made again next time
            pass
    return cached


def turn_spans(ct: Any, messages: list, text: str, turns: Sequence[int], *,
               tools: Any = None, located: Any = None, deadline: float | None = None
               ) -> list[tuple[int, int, int, bool, bool]] | None:
    """``(start, text end, end, followed, parted)`` in ``text`` for each assistant turn of ``turns``: where the model
    starts writing it (past what the generation prompt supplies), where its own text ends, where the turn ends,
    whether another message follows it, and whether the prompt goes on otherwise at the start (rather than ending
    there). None when a turn cannot be found so. Past ``deadline`` (``time.monotonic()``), ``RenderingOverBudget``.

    The start is where the conversation before the turn, rendered with the generation prompt, stops agreeing
    with ``text``; it must lie past every earlier message's text (else the template rewrites the history as the
    conversation goes on, and no prefix tells the turn). The end is where the conversation through the turn,
    rendered with the turn last, stops agreeing with ``text``; where that rendering writes the turn otherwise
    than the history does (a think block kept only for the last turn), the turn ends where its own tail, after
    its text, stops agreeing instead.

    Both renderings are made from a short context where it can stand for the whole (``_short_renders``): the messages
    since the turn's last user message or its last assistant message, after the system message and that user
    message, so that a row costs work in proportion to its length, not its square. Each is used only where the part
    of the history it rewrites is the row's text exactly; else the turn is rendered from the row's start.

    A plain chat of a shape seen before, or a chat with tools or tool calls whose shape is learnt, is not rendered at
    all: its spans are read off the shape's sentinel rendering where the row's rendering is that rendering with its
    texts in place (``shape_cache``)."""
    cache = key = None
    if _SHORT_CONTEXTS and _SHAPES:
        key = plain_shape(messages, tools, turns)
        cache = cache_of(ct) if key is not None else None
        if cache is not None:
            spans = cache.spans(key, messages, text)
            if spans is not None:
                return spans
        elif key is None:
            spans = _tool_shape_spans(ct, messages, text, turns, tools, located, deadline)
            if spans is not None:
                return spans
    spans = _rendered_spans(ct, messages, text, turns, tools=tools, located=located, deadline=deadline)
    if cache is not None and spans is not None:
        cache.learn(key, messages, text, spans, render=lambda dummy: _render(ct, dummy, tools, False),
                    find=lambda dummy, rendered: _rendered_spans(ct, dummy, rendered, turns, tools=tools,
                                                                 deadline=deadline))
    return spans


def _tool_shape_spans(ct: Any, messages: list, text: str, turns: Sequence[int], tools: Any, located: Any,
                      deadline: float | None) -> list | None:
    """``turn_spans`` of a row with tools or tool calls read off its shape (``shape_cache.tool_shape``), learnt the
    first time it is seen from its sentinel chat's own renders (while the tokenizer's learning rows are mostly read
    off their new shape); None where the row is not read so."""
    shape = tool_shape(messages, tools, turns)
    cache = cache_of(ct) if shape is not None else None
    if cache is None:
        return None
    key, texts = shape
    if located is None:
        located = locate_messages(text, messages, system_optional=ct.content_tokens.drops_system)
    if located.missing is not None:
        return None
    if cache.known(key):
        return cache.read_tools(key, texts, text, located)
    if not cache.learns_tools():
        return None
    check_deadline(deadline)
    drops_system = ct.content_tokens.drops_system
    cache.learn_tools(key, with_sentinels(messages), len(texts), render=lambda dummy: _render(ct, dummy, tools, False),
                      locate=lambda dummy, rendered: locate_messages(rendered, dummy, system_optional=drops_system),
                      find=lambda dummy, rendered, found: _rendered_spans(ct, dummy, rendered, turns, tools=tools,
                                                                           located=found, deadline=deadline))
    spans = cache.read_tools(key, texts, text, located)
    cache.learnt(spans is not None)
    return spans


def _rendered_spans(ct: Any, messages: list, text: str, turns: Sequence[int], *, tools: Any = None,
                    located: Any = None, deadline: float | None = None) -> list | None:
    """``turn_spans`` from the row's own renders."""
    if located is None:
        located = locate_messages(text, messages, system_optional=ct.content_tokens.drops_system)
    if located.missing is not None:
        return None
    ends_by_message: dict[int, int] = {}
    starts_by_message: dict[int, int] = {}
    for a, b, index, _ in located.pieces:
        ends_by_message[index] = max(b, ends_by_message.get(index, 0))
        starts_by_message[index] = min(a, starts_by_message.get(index, a))
    history = _History(messages, ends_by_message)
    spans = []
    for i in turns:
        check_deadline(deadline)
        span = _FALLBACK
        if _SHORT_CONTEXTS:
            try:
                span = _span(ct, messages, i, text, _short_renders(ct, messages, i, text, tools, history, starts_by_message),
                             ends_by_message, starts_by_message, history.before(i), tools, deadline)
            except _Fallback:
                span = _FALLBACK
        if span is _FALLBACK:
            try:
                prompt = _render(ct, messages[:i], tools, True)
                through = _render(ct, messages[: i + 1], tools, False)
            except ChatTemplateError:
                return None
            span = _span(ct, messages, i, text, _Renders(0, prompt, through, through, messages[: i + 1], False),
                         ends_by_message, starts_by_message, history.before(i), tools, deadline)
        if span is None:
            return None
        spans.append(span)
    return spans


NEXT = {"role": "user", "content": "Next."}  # the message after the row's last, to tell what ends the conversation

# the turns rendered from a short context where it stands for the whole (tests set it False to compare with the renders
# from the row's start, which are the reference)
_SHORT_CONTEXTS = True
# plain chats of a shape seen before read off its sentinel rendering (tests set it False to compare with each row's
# own renders)
_SHAPES = True


class _Fallback(Exception):
    """A short context does not stand for the whole conversation here: render the turn from the row's start."""


_FALLBACK = object()


@dataclass(frozen=True)
class _Renders:
    """The conversation rendered up to a turn (``prompt``) and through it (``through``), as what follows ``base`` in the
    row's text: the whole renderings are ``text[:base] + prompt`` and ``text[:base] + through``. ``whole`` is the
    rendering ``through`` was cut from, of ``whole_messages`` (the turn last); ``short``: made from a short context."""

    base: int
    prompt: str
    through: str
    whole: str
    whole_messages: list
    short: bool
    context: Any = None  # the short context (``_Context``) they were rendered from


class _History:
    """Per message index: the last message before it with text in the row, the furthest end of the text before it, and
    the last user and assistant messages before it (looked up by bisection: no pass over the row per turn)."""

    def __init__(self, messages: list, ends_by_message: dict[int, int]):
        import bisect

        self._bisect = bisect.bisect_left
        self.ends = ends_by_message
        self.with_text = sorted(ends_by_message)
        self.furthest = list(np.maximum.accumulate([ends_by_message[m] for m in self.with_text])) if self.with_text else []
        roles = [m.get("role") if isinstance(m, Mapping) else None for m in messages]
        self.users = [k for k, r in enumerate(roles) if r == "user"]
        self.assistants = [k for k, r in enumerate(roles) if r == "assistant"]
        self.system_first = bool(roles) and roles[0] == "system"

    def _last(self, found: list, i: int) -> int | None:
        at = self._bisect(found, i)
        return found[at - 1] if at else None

    def last_with_text(self, i: int) -> int | None:
        return self._last(self.with_text, i)

    def before(self, i: int) -> int:
        at = self._bisect(self.with_text, i)
        return int(self.furthest[at - 1]) if at else 0

    def last_user(self, i: int) -> int | None:
        return self._last(self.users, i)

    def last_assistant(self, i: int) -> int | None:
        return self._last(self.assistants, i)


def _short_renders(ct: Any, messages: list, i: int, text: str, tools: Any, history: _History,
                   starts_by_message: dict[int, int]) -> _Renders:
    """Turn ``i``'s prompt and through rendered from a short context: the system message, the turn's last user message,
    and the messages from the later of that user message and the last assistant message before the turn (with the
    message before that assistant message, where it is not the user message: a tool result). Their tails
    after the message before the turn stand for the whole renderings' tails where the context's own messages render
    as the row's text does, from the first of them to that message's end (``_Fallback`` else)."""
    user, last = history.last_user(i), history.last_with_text(i)
    if user is None or last is None:
        raise _Fallback
    base = history.before(i)
    assistant = history.last_assistant(i)
    first = user if assistant is None else max(user, assistant)
    if last < first or history.ends[last] != base:  # (the text before the turn ends with that message's)
        raise _Fallback
    # (and the message before ``first`` where it is not that user message, a tool result before a call: the template's
    # text before ``first`` then follows the message it follows in the row, ``</tool_response>`` and all)
    lead = [first - 1] if first - 1 > user else []
    window = ([0] if history.system_first and user > 0 else []) + ([user] if user < first else []) + lead \
        + list(range(first, i))
    if len(window) >= i:  # no shorter than the row's start: rendered from there
        raise _Fallback
    near = min((starts_by_message[m] for m in range(first, i) if m in starts_by_message), default=None)
    if near is None or base < near:
        raise _Fallback
    short = [messages[m] for m in window]
    try:
        prompt = _render(ct, short, tools, True)
        through = _render(ct, short + [messages[i]], tools, False)
    except ChatTemplateError:
        raise _Fallback from None
    header = history.before(first)  # the template's text before the first message, as the row writes it
    if header > near:
        raise _Fallback
    context = _Context(short, tuple(window), first, last, text[header:base], near - header)
    return _Renders(base, prompt[context.tail(ct, prompt, short):], through[context.tail(ct, through, short + [messages[i]]):],
                    through, short + [messages[i]], True, context)


@dataclass(frozen=True)
class _Context:
    """A short context: its messages (``window``: their indexes in the row), the first of those after the system and
    user messages it keeps, the last message with text before the turn, and the row's text from the end of the text
    before the first (``header`` characters of the template's text before the first's) to the end of the last
    (``own``)."""

    messages: list
    window: tuple
    first: int
    last: int
    own: str
    header: int

    def tail(self, ct: Any, rendered: str, rendered_messages: list) -> int:
        """Where in ``rendered`` (of the context's messages and more) the tail after message ``last`` starts, when the
        history it writes from message ``first`` to there, with the template's text before it, is the row's text
        exactly; ``_Fallback`` else. (That text places the message: "e" is found in a default system prompt too.)"""
        found = locate_messages(rendered, rendered_messages, system_optional=ct.content_tokens.drops_system)
        if found.missing is not None:
            raise _Fallback
        n = len(self.window)
        starts = [a for a, _, index, _ in found.pieces if index < n and self.window[index] >= self.first]
        ends = [b for _, b, index, _ in found.pieces if index < n and self.window[index] == self.last]
        if not starts or not ends or min(starts) < self.header or \
                rendered[min(starts) - self.header:max(ends)] != self.own:
            raise _Fallback
        return max(ends)


def _span(ct: Any, messages: list, i: int, text: str, renders: _Renders, ends_by_message: dict[int, int],
          starts_by_message: dict[int, int], before: int, tools: Any, deadline: float | None
          ) -> tuple[int, int, int, bool, bool] | None:
    """Turn ``i``'s span (``turn_spans``) from its renders. Read from ``renders.base`` on, the renders need no copy of
    the row before it; a short context that meets a case only the whole renderings tell raises ``_Fallback``."""
    base, prompt, through = renders.base, renders.prompt, renders.through
    # (a prompt that goes on past the header can share the reply's first characters: "Here are" / "Hello")
    opens = starts_by_message.get(i, len(text))
    if renders.short and opens < base:
        raise _Fallback
    agreed = base + common_prefix(prompt, text[base: base + len(prompt)])
    start = in_prompt = min(agreed, opens)
    if start < before:  # the history is written otherwise as the chat goes on (Mistral moves the system prompt
        # into the last user turn): the prompt's tail after the last text before the turn, where the row has it
        if renders.short:
            raise _Fallback
        found = _start_after(ct, messages, i, prompt, text, ends_by_message)
        if found is None or found[0] < before or found[0] > opens:
            return None
        start, in_prompt = found
    # the header as the prompt writes it, whitespace runs allowed to differ from the history's (Hermes writes
    # ``</tool_response><|im_end|>`` in the prompt, ``</tool_response>\n<|im_end|>`` in the history)
    in_prompt, start = agree_but_whitespace(prompt, in_prompt - base, text, start, opens)
    in_prompt += base
    parted = in_prompt < base + len(prompt) and start < opens
    content_end = max(ends_by_message.get(i, start), start)
    end = start
    if through[: start - base] == text[base:start]:  # the through rendering starts with the row up to the start
        end = start + common_prefix(through[start - base:], text[start: start + len(through) - (start - base)])
    if end < content_end:
        whole = renders.whole
        own = locate_messages(whole, renders.whole_messages, system_optional=ct.content_tokens.drops_system)
        last = len(renders.whole_messages) - 1
        own_end = max((b for _, b, index, _ in own.pieces if index == last), default=None)
        if own.missing is not None or own_end is None:
            if renders.short:
                raise _Fallback
            return None
        end = content_end + common_prefix(whole[own_end:], text[content_end: content_end + len(whole) - own_end])
    through_end = base + len(through)
    if i + 1 < len(messages) and content_end <= end < through_end and not through.startswith(text[base:through_end]):
        # the turn rendered last closes otherwise than the history does after its text (Apriel writes the call's
        # id only when a result follows): the turn ends at the stop that its own closing ends with, found in the
        # history before the next message
        end = _through_stop(ct, through[end - base:], text, end, starts_by_message.get(i + 1, len(text)))
    if i + 1 == len(messages) and end > content_end:
        # the row's last message: what the template writes after it only when the conversation ends (Phi-3's
        # <|endoftext|> after the stop) is not the turn's; the chat rendered going on with a user message parts there
        check_deadline(deadline)
        going_on, at = None, 0  # (read from ``base`` on when rendered from the short context)
        if renders.short:
            try:
                going = renders.whole_messages + [NEXT]
                going_on = _render(ct, going, tools, False)
            except ChatTemplateError:
                raise _Fallback from None
            going_on, at = going_on[renders.context.tail(ct, going_on, going):], base
        else:
            try:
                going_on = _render(ct, messages + [NEXT], tools, False)
            except ChatTemplateError:
                going_on = None
        if going_on is not None and going_on.startswith(text[at:content_end]):
            end = max(content_end, min(end, at + common_prefix(going_on, text[at: at + len(going_on)])))
    return start, content_end, end, i + 1 < len(messages), parted


def _through_stop(ct: Any, closing: str, text: str, at: int, limit: int) -> int:
    """Past the first occurrence in ``text[at:limit]`` of the last control token of ``closing`` (the tail of the turn
    rendered last, from where it parts from the history); ``at`` when there is none."""
    ids, offsets = ct.encode_with_offsets(closing)
    special = np.flatnonzero(np.isin(np.asarray(ids), special_id_array(ct)))
    if not special.size:
        return at
    a, b = (int(x) for x in np.asarray(offsets)[special[-1]])
    found = text.find(closing[a:b], at, limit)
    return at if found < 0 else found + (b - a)


def agree_but_whitespace(a: str, i: int, b: str, j: int, limit: int) -> tuple[int, int]:
    """How far ``a`` from ``i`` and ``b`` from ``j`` (up to ``limit``) agree when a whitespace run in either may differ
    from the other's, as ``(i, j)`` past the agreement. Advanced only where it gets past a character other than
    whitespace of ``a``, or to its end: whitespace alone that leads a reply stays the reply's. A header's length of
    characters, not the row's."""
    i0, j0 = i, j
    while i < len(a) and j < limit:
        if a[i] == b[j]:
            i, j = i + 1, j + 1
        elif a[i].isspace():
            i += 1
        elif b[j].isspace():
            j += 1
        else:
            break
    if i < len(a) and not a[i0:i].strip():
        return i0, j0
    return i, j


def label_row_from_rendering(ct: Any, messages: Sequence[Mapping[str, Any]], ids: np.ndarray, *, tools: Any = None,
                              last_turn_only: bool = False, special_tokens_in_content: str = "text",
                              text: str | None = None, offsets: np.ndarray | None = None,
                              deadline: float | None = None) -> tuple[np.ndarray | None, str | None]:
    """``(trained, None)``: a bool per token of ``ids``, found from the rendering, keeping the role invariant; or
    ``(None, why)`` when the turns cannot be found or their labels would train a user, system or tool message's
    text (or leave an assistant's untrained). Past ``deadline`` (``time.monotonic()``), ``RenderingOverBudget``."""
    messages = list(messages)
    try:
        text = ct.render(messages, tools=tools) if text is None else text
    except ChatTemplateError as exc:
        return None, str(exc).split("\n", 1)[0]
    ids = np.asarray(ids)
    if offsets is None:  # (the caller read them off the ids' bytes where it could)
        row, offsets = _encode(ct, text, messages, special_tokens_in_content)
        if row.shape[0] < ids.shape[0] or not np.array_equal(row[: ids.shape[0]], ids):
            return None, "its token ids are not those of its rendering"
    located = locate_messages(text, messages, system_optional=ct.content_tokens.drops_system)
    trained = trained_from_rendering(ct, messages, ids, tools=tools, last_turn_only=last_turn_only, text=text,
                                     offsets=offsets, located=located, deadline=deadline)
    if trained is None:
        return None, NOT_FOUND
    starts, ends = offsets[: ids.shape[0], 0], offsets[: ids.shape[0], 1]
    last_assistant = max((i for i, m in enumerate(messages) if isinstance(m, Mapping) and m.get("role") == "assistant"),
                         default=-1)
    near = _TokenWindow(starts, ends)
    if near.sorted and located.pieces:
        return _held_to_roles(trained, near, messages, located.pieces, last_turn_only, last_assistant)
    for a, b, index, required in located.pieces:
        lo, hi = near.within(a, b)
        inside = slice(lo, hi)
        inside = np.flatnonzero((starts[inside] >= a) & (ends[inside] <= b) & (ends[inside] > starts[inside])) + lo
        role = messages[index].get("role") if isinstance(messages[index], Mapping) else None
        if role == "assistant":
            if required and (not last_turn_only or index == last_assistant) and not trained[inside].all():
                return None, f"the text of message {index} (assistant) does not train in the turn found for it"
        elif trained[inside].any():
            return None, f"the text of message {index} ({role}) would train: {NOT_FOUND}"
    return trained, None


def _held_to_roles(trained: np.ndarray, near: _TokenWindow, messages: list, pieces: Sequence[tuple], last_turn_only: bool,
                   last_assistant: int) -> tuple[np.ndarray | None, str | None]:
    """``label_row_from_rendering``'s check of each message piece's tokens, for all pieces at once where the tokens'
    starts and ends rise: each piece's tokens (those wholly inside it, not empty) counted by running sums."""
    at = np.asarray(pieces, dtype=np.int64).reshape(-1, 4)
    lo = np.searchsorted(near.starts, at[:, 0], "left")
    hi = np.maximum(lo, np.searchsorted(near.ends, at[:, 1], "right"))
    shown = near.ends > near.starts
    tokens = np.concatenate([[0], np.cumsum(shown)])
    trained_tokens = np.concatenate([[0], np.cumsum(shown & trained[: near.n])])
    inside, trains = tokens[hi] - tokens[lo], trained_tokens[hi] - trained_tokens[lo]
    roles = [m.get("role") if isinstance(m, Mapping) else None for m in messages]
    index = at[:, 2]
    assistant = np.asarray([r == "assistant" for r in roles], dtype=bool)[index]
    asked = (at[:, 3] != 0) & ((index == last_assistant) if last_turn_only else True)
    bad = np.flatnonzero((assistant & asked & (trains < inside)) | (~assistant & (trains > 0)))
    if not bad.size:
        return trained, None
    k = int(index[bad[0]])
    if assistant[bad[0]]:
        return None, f"the text of message {k} (assistant) does not train in the turn found for it"
    return None, f"the text of message {k} ({roles[k]}) would train: {NOT_FOUND}"


def label_from_rendering(ct: Any, chats: Sequence[Any], input_ids: pa.Array, *, last_turn_only: bool = False,
                         ignore_index: int = -100, dtype: Any = "int64", special_tokens_in_content: str = "text",
                         texts: Sequence[str | None] | None = None, seconds_per_row: float | None = None) -> Any:
    """Labels of a batch of chat rows (``input_ids``, one row per entry of ``chats``: ``(messages, tools)`` or None
    for a null row), each found from its rendering (``label_row_from_rendering``). ``texts``: each row's rendering,
    when the caller has it. A row whose turns cannot be found keeps null labels and is listed in ``rejected`` as
    ``template_breaks_roles``; one that takes longer than ``seconds_per_row`` (default
    ``options.DEFAULT_ROW_RENDERING_SECONDS``) is stopped there and listed as ``rendering_over_budget``. Returns an
    ``engine.labels.LabelledBatch``."""
    import pyarrow.compute as pc

    from ..engine.buffers import resolve_label_dtype
    from ..engine.labels import LabelledBatch
    from ..engine.outcomes import RENDERING_OVER_BUDGET, TEMPLATE_BREAKS_ROLES, Outcome, OutcomeCounts
    from ..options import DEFAULT_ROW_RENDERING_SECONDS

    seconds = DEFAULT_ROW_RENDERING_SECONDS if seconds_per_row is None else seconds_per_row
    if isinstance(input_ids, pa.ChunkedArray):
        input_ids = input_ids.combine_chunks()
    lengths = pc.fill_null(pc.list_value_length(input_ids), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat_ids = pc.list_flatten(input_ids).to_numpy(zero_copy_only=False)
    trained = np.zeros(flat_ids.shape[0], dtype=bool)
    null = ~np.asarray(input_ids.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    outcomes = np.full(lengths.shape[0], Outcome.EMPTY, dtype=np.int8)
    rejected = []
    spans, placed = None, np.zeros(lengths.shape[0], dtype=bool)
    if texts is not None and len(texts) == lengths.shape[0] and not null.any():
        # each token's characters read off the bytes its id stands for: no second call into the tokeniser (``spans_of``
        # reads ``ids`` and ``offsets`` of a ``tokenizer.FlatIds``; this module is below ``tokenizer``, so a stand-in)
        flat = SimpleNamespace(ids=flat_ids.astype(np.int32, copy=False), offsets=offsets)
        spans, placed = ct.spans_of(list(texts), flat)
    read = _read_off_shapes(ct, chats, texts, spans, placed, null, lengths, offsets, flat_ids, last_turn_only,
                            seconds) if spans is not None else {}
    for r in range(lengths.shape[0]):
        chat = chats[r] if r < len(chats) else None
        if null[r] or not chat or not lengths[r]:
            continue
        messages, tools = chat if isinstance(chat, tuple) else (chat, None)
        at = slice(int(offsets[r]), int(offsets[r + 1]))
        if r in read:
            trained[at] = read[r]
            outcomes[r] = Outcome.TRAINED if read[r].any() else Outcome.EMPTY_RESPONSE
            continue
        if not any(isinstance(m, Mapping) and m.get("role") == "assistant" for m in messages):
            outcomes[r] = Outcome.NO_RESPONSE
            continue
        try:
            row, why = label_row_from_rendering(ct, messages, flat_ids[at], tools=tools, last_turn_only=last_turn_only,
                                                special_tokens_in_content=special_tokens_in_content,
                                                text=texts[r] if texts is not None else None,
                                                offsets=spans[at] if placed[r] else None,
                                                deadline=time.monotonic() + seconds)
        except RenderingOverBudget:
            rejected.append((r, RENDERING_OVER_BUDGET, over_budget_message(seconds)))
            null[r] = True
            continue
        if row is None:
            rejected.append((r, TEMPLATE_BREAKS_ROLES, why))
            null[r] = True
            continue
        trained[at] = row
        outcomes[r] = Outcome.TRAINED if row.any() else Outcome.EMPTY_RESPONSE
    label_dtype = resolve_label_dtype(dtype)
    values = np.where(trained, flat_ids, ignore_index).astype(label_dtype, copy=False)
    labels = type(input_ids).from_arrays(pa.array(offsets.astype(input_ids.offsets.type.to_pandas_dtype())),
                                         pa.array(values), mask=pa.array(null) if null.any() else None)
    running = np.concatenate([[0], np.cumsum(trained)])
    trained_tokens = np.where(null, 0, running[offsets[1:]] - running[offsets[:-1]])
    counts = OutcomeCounts.from_rows(outcomes, trained_tokens, np.where(null, 0, lengths))
    # (every row comes from its rendering here, and the source says so: ``from_rendering`` lists the rows that the
    # markers could not read, of which there are none)
    return LabelledBatch(labels, trained_tokens, outcomes, counts, rejected=tuple(rejected))


def _read_off_shapes(ct: Any, chats: Sequence[Any], texts: Sequence[str | None], token_spans: np.ndarray,
                     placed: np.ndarray, null: np.ndarray, lengths: np.ndarray, offsets: np.ndarray,
                     flat_ids: np.ndarray, last_turn_only: bool, seconds: float) -> dict:
    """``{row: trained bool per token}`` for the rows of a batch whose spans are read off a learnt shape
    (``shape_cache``) and whose tokens ``engine.turn_tokens`` labels for the whole batch at once; the others
    are left to ``label_row_from_rendering``, row by row."""
    cache = cache_of(ct) if _SHORT_CONTEXTS and _SHAPES else None
    if cache is None:
        return {}
    rows, spans, span_offsets, pieces, piece_offsets = [], [], [0], [], [0]
    for r in range(lengths.shape[0]):
        chat = chats[r] if r < len(chats) else None
        if null[r] or not chat or not lengths[r] or not placed[r] or texts[r] is None:
            continue
        messages, tools = chat if isinstance(chat, tuple) else (chat, None)
        turns = [i for i, m in enumerate(messages) if type(m) is dict and m.get("role") == "assistant"]
        if not turns:
            continue
        turns = turns[-1:] if last_turn_only else turns
        key = plain_shape(messages, tools, turns)
        if key is None:
            continue
        if not cache.known(key):  # the row's own renders, which learn its shape for it and the rows after it
            try:
                turn_spans(ct, messages, texts[r], turns, tools=tools, deadline=time.monotonic() + seconds)
            except RenderingOverBudget:  # (left to the row-by-row code, which counts it)
                continue
        found = cache.read(key, messages, texts[r])
        if found is None:
            continue
        rows.append(r)
        for s in found[0]:
            spans += s[:3]
        span_offsets.append(span_offsets[-1] + len(found[0]))
        # each message's text: an assistant's trains whole (only the last one's with last_turn_only), others' not at all
        bounds, last = found[1], turns[-1]
        for k, role in enumerate(key[0]):
            pieces += (bounds[2 * k + 1], bounds[2 * k + 2],
                       (-1 if last_turn_only and k != last else 1) if role == "assistant" else 0)
        piece_offsets.append(piece_offsets[-1] + len(key[0]))
    if not rows:
        return {}
    from ..engine.turn_tokens import trained_by_spans  # (numba: loaded on first use)

    at = np.asarray(rows)
    trained = np.zeros(flat_ids.shape[0], dtype=bool)
    special = np.isin(flat_ids, special_id_array(ct))
    done = trained_by_spans(token_spans, special, offsets[at], offsets[at + 1], [len(texts[r]) for r in rows], spans,
                            span_offsets, pieces, piece_offsets, closes_turns(ct), trained)
    return {r: trained[int(offsets[r]): int(offsets[r + 1])] for r, ok in zip(rows, done.tolist()) if ok}


def _encode(ct: Any, text: str, messages: list, special_tokens_in_content: str) -> tuple[np.ndarray, np.ndarray]:
    """Ids and character offsets of ``text`` as the messages path encodes it (special-token strings in message
    text as text, unless kept as tokens)."""
    ids, offsets = ct.encode_with_offsets(text)
    if special_tokens_in_content == "keep":
        return np.asarray(ids), np.asarray(offsets)
    spans = locate_messages(text, messages, system_optional=ct.content_tokens.drops_system).spans
    if any(ct.content_tokens.find(text, s, e) for s, e in spans):
        ids, offsets = ct.text_encoder.encode(text, ids, offsets, spans)
    return np.asarray(ids), np.asarray(offsets)


def common_prefix(a: str, b: str) -> int:
    """How many leading characters two strings share (slices compared in C, halving: no loop over characters)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid
    return low


def role_breaks(trained: np.ndarray, roles: Any, last_turn_only: bool = False) -> np.ndarray:
    """Per token: does it break the role invariant under labels that train ``trained`` (a bool per token)? A token
    of user, system or tool text trains, or one of an assistant's content or tool-call arguments does not
    (``roles``: ``encode_rendered.RoleTokens``; with ``last_turn_only`` only the first half is asked)."""
    assistant = roles.names.index("assistant") + 1 if "assistant" in roles.names else -1
    bad = (roles.role > 0) & (roles.role != assistant) & trained
    if not last_turn_only:
        bad |= (roles.role == assistant) & ~trained
    return bad


def message_gaps(trained: np.ndarray, roles: Any, row_of: np.ndarray) -> np.ndarray:
    """Per token: inside a run of untrained tokens, none of them message text, between two trained runs of one assistant
    message (the template's text inside one turn: muse-glimmer's ``<|eom|><|start|>assistant to=get_time`` between
    two calls, gpt-oss's header between analysis and answer). The run after it holds that message's text; the run
    before it holds it too, or no message text at all (reasoning, which the role tokens leave out). NumPy passes over
    the batch, no loop over tokens."""
    n = trained.shape[0]
    gaps = np.zeros(n, dtype=bool)
    if "assistant" not in roles.names or n < 3:
        return gaps
    assistant = roles.names.index("assistant") + 1
    text = roles.role > 0
    positions = np.arange(n)
    # the nearest message-text token at or before / at or after each token, and the nearest untrained one
    text_before = np.maximum.accumulate(np.where(text, positions, -1))
    text_after = np.minimum.accumulate(np.where(text, positions, n)[::-1])[::-1]
    untrained_before = np.maximum.accumulate(np.where(~trained, positions, -1))
    untrained_after = np.minimum.accumulate(np.where(~trained, positions, n)[::-1])[::-1]
    texts_so_far = np.cumsum(text)
    # the untrained runs: [start, end)
    starts = np.flatnonzero(~trained & np.concatenate([[True], trained[:-1]]))
    ends = np.minimum.accumulate(np.where(trained, positions, n)[::-1])[::-1][starts]
    keep = (starts > 0) & (ends < n)
    starts, ends = starts[keep], ends[keep]
    if not starts.size:
        return gaps
    before, after = starts - 1, ends
    no_text = texts_so_far[ends - 1] - texts_so_far[before] == 0
    same_row = (row_of[before] == row_of[after])
    nxt = text_after[after]
    has_next = nxt < n
    nxt_c = np.where(has_next, nxt, 0)
    # the run after the gap reaches the assistant message's text
    ok_after = has_next & (roles.role[nxt_c] == assistant) & (untrained_after[after] > nxt_c) & (row_of[nxt_c] == row_of[after])
    prv = text_before[before]
    prv_c = np.maximum(prv, 0)
    same_message = (prv >= 0) & (roles.message[prv_c] == roles.message[nxt_c]) & (roles.role[prv_c] == assistant) \
        & (row_of[prv_c] == row_of[before])
    # before the gap: a run of the same message's text, or a run holding no message text at all
    ok_before = np.where(same_message, untrained_before[before] < prv_c, untrained_before[before] > prv)
    join = no_text & same_row & ok_after & ok_before
    if join.any():
        delta = np.zeros(n + 1, dtype=np.int64)
        np.add.at(delta, starts[join], 1)
        np.add.at(delta, ends[join], -1)
        gaps = np.cumsum(delta)[:-1] > 0
    return gaps


def breaks_message(roles: Any, at: int, row_start: int) -> str:
    """Why a row is dropped as ``template_breaks_roles``: its first token ``at`` (in the batch) that breaks it."""
    role = roles.names[int(roles.role[at]) - 1]
    what = "trains" if role != "assistant" else "does not train"
    return (f"token {at - row_start} lies in the text of message {int(roles.message[at])} ({role}) and {what} under "
            "the markers: the chat template writes this conversation's turns so that the markers cannot tell them "
            "apart, nor its rendering (see docs/masking-rule.md, the role invariant)")


def label_encoded(encoded: Any, markers: Any, *, backend: str | None = None, last_turn_only: bool = False,
                  ignore_index: int = -100, dtype: Any = "int64") -> Any:
    """Labels of ``ChatTokenizer.encode_chats`` output (``EncodedChats.label``), as ``mask_files`` gives them: message
    text inert for markers, and each row held to the role invariant. A row that breaks it under the markers is
    labelled from its rendering (``trained_from_rendering``) when that keeps the invariant (``from_rendering``
    lists it); else its labels are null and ``rejected`` names it (``template_breaks_roles``). A row of which the
    markers train nothing is left so (its outcome says why): such markers are not this template's."""
    import pyarrow.compute as pc

    from ..engine.labels import LabelledBatch, label_batch
    from ..engine.outcomes import RENDERING_OVER_BUDGET, TEMPLATE_BREAKS_ROLES, Outcome, OutcomeCounts
    from ..options import DEFAULT_ROW_RENDERING_SECONDS

    ids = encoded.input_ids
    if isinstance(markers, FromRendering):
        return label_from_rendering(encoded.tokenizer, encoded.chats, ids, last_turn_only=last_turn_only,
                                    ignore_index=ignore_index, dtype=dtype,
                                    special_tokens_in_content=encoded.special_tokens_in_content)
    result = label_batch(ids, markers, backend=backend, last_turn_only=last_turn_only, ignore_index=ignore_index,
                         dtype=dtype, data_mask=encoded.in_content)
    roles = encoded.roles
    if roles is None or not roles.role.any():
        return result
    flat = pc.list_flatten(result.labels).to_numpy(zero_copy_only=False)
    lengths = pc.fill_null(pc.list_value_length(ids), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    row_of = np.repeat(np.arange(lengths.shape[0]), lengths)
    # the runs of one assistant message with only the template's text between them are one turn, as mask_files joins
    # them (engine.weights, step 2): a header the model writes between its calls trains
    gaps = message_gaps(flat != ignore_index, roles, row_of)
    bad = role_breaks((flat != ignore_index) | gaps, roles, last_turn_only)
    if not bad.any() and not gaps.any():
        return result
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    flat_ids = pc.list_flatten(ids).to_numpy(zero_copy_only=False)
    flat = flat.copy()
    flat[gaps] = flat_ids[gaps]
    rejected, from_rendering = [], []
    null = ~np.asarray(ids.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    for r in np.unique(row_of[bad]).tolist():
        at = slice(int(starts[r]), int(starts[r] + lengths[r]))
        messages, tools = encoded.chats[r] if r < len(encoded.chats) and encoded.chats[r] else (None, None)
        if not (flat[at] != ignore_index).any():  # trains nothing: counted by its outcome, as any such row
            continue
        trained = None
        if messages:
            try:
                trained = trained_from_rendering(encoded.tokenizer, messages, flat_ids[at], tools=tools,
                                                 last_turn_only=last_turn_only,
                                                 special_tokens_in_content=encoded.special_tokens_in_content,
                                                 deadline=time.monotonic() + DEFAULT_ROW_RENDERING_SECONDS)
            except RenderingOverBudget:
                rejected.append((r, RENDERING_OVER_BUDGET, over_budget_message(DEFAULT_ROW_RENDERING_SECONDS)))
                null[r] = True
                continue
        part = type(roles)(role=roles.role[at], message=roles.message[at], names=roles.names)
        if trained is not None and not role_breaks(trained, part, last_turn_only).any():
            flat[at] = np.where(trained, flat_ids[at], ignore_index)
            from_rendering.append(r)
            continue
        first = int(starts[r]) + int(np.flatnonzero(bad[at])[0])
        rejected.append((r, TEMPLATE_BREAKS_ROLES, breaks_message(roles, first, int(starts[r]))))
        null[r] = True
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    labels = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat.astype(flat.dtype, copy=False)),
                                           mask=pa.array(null) if null.any() else None)
    labels = labels.cast(result.labels.type) if labels.type != result.labels.type else labels
    running = np.concatenate([[0], np.cumsum(flat != ignore_index)])
    trained_tokens = np.where(null, 0, running[starts + lengths] - running[starts])
    outcomes = np.where(null, Outcome.EMPTY, np.where(trained_tokens > 0, Outcome.TRAINED,
                        np.where(result.outcomes == Outcome.TRAINED, Outcome.EMPTY_RESPONSE, result.outcomes)))
    outcomes = outcomes.astype(result.outcomes.dtype)
    counts = OutcomeCounts.from_rows(outcomes, trained_tokens, np.where(null, 0, lengths))
    return LabelledBatch(labels, trained_tokens, outcomes, counts, rejected=tuple(rejected),
                         from_rendering=tuple(from_rendering))
