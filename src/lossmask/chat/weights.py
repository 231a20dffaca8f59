"""What each message asks to weigh, read off the messages and their located text: one ``RowPlan`` per chat row.

The labels come from the markers; weights refine them (docs/weights.md). This module reads, per message (Python
over messages, as locating already is), the sources that only the messages know:

- the role's weight (``MaskOptions.weights_by_role`` / ``roles_to_train``);
- the message's own fields (``weight``, ``train``, ``training``, ``loss``, ``loss_scale``, ``loss_weight``, or the
  one ``weight_field`` names): a ``false`` switches the message off, else the first number is its weight, else a
  ``true`` gives 1 (ms-swift's ``loss: true, loss_scale: 0.5`` weighs 0.5);
- character spans inside the content (axolotl ``[{begin_offset, end_offset, train[, weight]}]``, end inclusive: only
  the spans train, and only in a message that weighs > 0), and content parts carrying ``train`` / ``weight``;
- the reasoning policy (reasoning text, and the template's text before the answer, take a weight) and the
  empty-think rule (an empty ``<think></think>`` block before the answer is masked).

Most rows need none of it: every assistant turn takes one weight (``uniform``) and no character offsets are
needed. A row whose turns differ, or that weighs part of a message or another role's text, is ``exact``: its
tokens are placed by their character offsets, and ``engine/weights.py`` applies the plan to the labels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Mapping, Sequence

import numpy as np

from ..options import MAX_WEIGHT
from .locate import REASONING_KEYS, THINK_CLOSE, THINK_OPEN
from .shapes import PART_SPANS

REASONING_KINDS = frozenset((*REASONING_KEYS, "reasoning in content"))


@dataclass
class RowPlan:
    """The weights one row asks for.

    ``uniform``: the weight of every assistant turn (used when not ``exact``). ``exact`` rows also carry:
    ``weights`` and ``roles`` per message; ``pieces``: ``(start, end, message, required)`` of the located text, sorted
    (the
    pieces of a message of another role that weighs > 0 are characters whose tokens take its weight, before any
    segment); ``segments``: ``(start, end, weight, message, assistant)``: characters whose tokens take ``weight`` (a token
    that straddles a segment's edge takes the lower of the two weights); ``leads``: ``(message, answer_start,
    weight)``: the trained tokens of that message's turn before ``answer_start`` (reasoning) take ``weight``."""

    uniform: float = 1.0
    exact: bool = False
    weights: list[float] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)
    pieces: list[tuple[int, int, int, bool]] = field(default_factory=list)
    segments: Sequence[tuple[int, int, float, int, bool]] = ()  # a list where the row has some
    leads: Sequence[tuple[int, int, float]] = ()


DEFAULT_PLAN = RowPlan()


@dataclass(frozen=True)
class WeightReader:
    """What ``plan_row`` reads from ``MaskOptions``, read once per batch."""

    fields: tuple[str, ...]
    keys: frozenset
    detail_key: str | None
    plain_roles: bool
    assistant_weight: float
    reasoning_weight: float | None
    mask_empty_think: bool
    by_role: dict  # role -> the weight of its messages without a field of their own (the assistant's included)
    # by_roles' memo: a role sequence -> (its shared plan, or None where each row needs its own; its weights; the
    # roles as strings)
    known_roles: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, options: Any) -> "WeightReader":
        if isinstance(options, cls):
            return options
        roles = options.role_weights()
        reasoning = options.reasoning
        return cls(options.weight_fields(), frozenset(options.weight_fields()), options.detail_field,
                   roles == {"assistant": 1.0}, roles.get("assistant", 1.0),
                   None if reasoning == "train" else 0.0 if reasoning == "mask" else float(reasoning),
                   bool(options.mask_empty_think), {**roles, "assistant": roles.get("assistant", 1.0)})

    def by_roles(self, roles: tuple) -> tuple[RowPlan | None, tuple[float, ...], tuple[str, ...]]:
        """What a role sequence alone gives, worked out once per sequence (a batch's rows share a few): the plan rows
        that weigh by role alone share (None where each needs its own: another role's text trains), each message's
        weight, and the roles as strings."""
        try:
            known = self.known_roles.get(roles)
        except TypeError:  # a role that cannot be a key (odd data): taken by its string
            roles = tuple(map(str, roles))
            known = self.known_roles.get(roles)
        if known is None:
            named = tuple(role if type(role) is str else str(role) for role in roles)
            # a role's weight; weights never make other roles' text train unless a role option asks for that role
            weights = tuple(self.by_role.get(role, 0.0) for role in named)
            # every assistant turn weighs the role's weight: exact only where another role's text trains
            exact = any(w > 0 for w, role in zip(weights, named) if role != "assistant")
            known = self.known_roles[roles] = (None if exact else RowPlan(uniform=self.assistant_weight), weights, named)
        return known


def _several_calls(messages: Sequence[Any]) -> bool:
    """Does an assistant message hold more than one tool call, or text beside its calls?"""
    return any(type(m) is dict and m.get("role") == "assistant" and type(m.get("tool_calls")) is list
               and (len(m["tool_calls"]) > 1 or (type(m.get("content")) is str and m["content"].strip()))
               for m in messages)


def plan_row(text: str, messages: Sequence[Any], located: Any, options: Any, row: int = 0,
             trained_from: int | None = None) -> RowPlan | None:
    """The weights of one rendered row (None: every assistant turn weighs 1 and nothing else applies).
    ``options``: the job's ``MaskOptions``, or its ``WeightReader`` (made once per batch). ``trained_from``: the
    assistant messages before this index weigh 0 whatever else they say (a conversational prompt's own turns: only
    the completion trains); None where none is to be left out."""
    reader = WeightReader.of(options)
    fields, detail_key = reader.fields, reader.detail_key
    has_reasoning = not REASONING_KINDS.isdisjoint(located.kinds)
    carries = _carries(messages, reader.keys, detail_key)  # "fields", True (spans or parts too) or False
    # an assistant message of several calls (or text and calls): the template may write a header between them that the
    # model writes too
    # (muse-glimmer: ``<|eom|><|start|>assistant to=get_time``), and its runs are joined (engine/weights, step 2)
    joins = _several_calls(messages)
    if reader.plain_roles and not has_reasoning and not reader.mask_empty_think and not carries and trained_from is None \
            and not joins:
        return None
    shared, by_role, roles = reader.by_roles(_roles(messages))
    weights = _with_fields(messages, by_role, roles, reader, row) if carries else by_role
    if trained_from is not None:  # a new list: the row is no longer the one its roles alone describe
        weights = [0.0 if index < trained_from and role == "assistant" else weight
                   for index, (weight, role) in enumerate(zip(weights, roles))]
    characters = has_reasoning or reader.mask_empty_think or carries is True  # something to place within a message
    if weights is by_role and not characters and not joins:  # roles alone (no field changed a weight): most rows
        return shared if shared is not None else RowPlan(reader.assistant_weight, True, by_role, roles,
                                                         sorted(located.pieces))
    turns = {w for w, r in zip(weights, roles) if r == "assistant"}
    uniform = next(iter(turns)) if len(turns) == 1 else reader.assistant_weight
    others = any(w > 0 for w, r in zip(weights, roles) if r != "assistant")
    if len(turns) <= 1 and not others and not characters and not joins:
        return RowPlan(uniform=uniform)  # one weight for every turn: no characters to look at
    plan = RowPlan(uniform, False, weights, roles, sorted(located.pieces), [], [])
    if not characters:
        # turns that weigh differently, or other roles' text that trains (its pieces weigh as its message does:
        # engine/weights reads them off the pieces): nothing more to read per message
        plan.exact = True
        return plan
    by_message: dict[int, list[tuple[int, int, str]]] = {}
    for (start, end, index, _), kind in zip(located.pieces, located.kinds):
        by_message.setdefault(index, []).append((start, end, kind))
    reasoning_weight = reader.reasoning_weight
    leading = has_reasoning or reader.mask_empty_think  # can an assistant turn have a lead (reasoning, empty think)?
    previous_end = 0
    for index, message in enumerate(messages):
        own = by_message.get(index, [])
        role, weight = roles[index], weights[index]
        if carries is True and isinstance(message, dict):
            # spans and parts are checked in every message, and weigh only in one that trains (its own flag wins)
            found = _detail_segments(text, message, own, detail_key, weight, role == "assistant", index, row) + \
                _part_segments(text, message, own, fields, weight, role == "assistant", index, row)
            if weight > 0:
                plan.segments += found
        if role == "assistant" and leading:
            thinking = [p for p in own if p[2] in REASONING_KINDS]
            answers = [s for s, _, kind in own if kind not in REASONING_KINDS and (not thinking or s >= thinking[0][1])]
            answer_start = min(answers) if answers else len(text)
            if thinking and reasoning_weight is not None:
                plan.leads.append((index, answer_start, reasoning_weight))
            elif not thinking and reader.mask_empty_think and own and _empty_think(text, previous_end, min(answers or [0])):
                plan.leads.append((index, answer_start, 0.0))
        if own and leading:
            previous_end = max(e for _, e, _ in own)
    plan.exact = bool(len(turns) > 1 or others or plan.segments or plan.leads or has_reasoning)
    return plan


_ROLE = itemgetter("role")


def _with_fields(messages: Sequence[Any], by_role: tuple[float, ...], roles: tuple[str, ...], reader: WeightReader,
                 row: int) -> Sequence[float]:
    """The messages' weights once their own fields have their say: a field overrides its role's weight, for the
    roles that train (the others' stay 0). ``by_role`` itself where no field changes a weight."""
    weights: Sequence[float] = by_role
    for index, message in enumerate(messages):
        if type(message) is dict and len(message) <= 2:  # {role, content}: no field (the call costs more)
            continue
        value = _field(message, reader.fields, row, index)
        if value is not None and value != weights[index] and roles[index] in reader.by_role:
            if weights is by_role:
                weights = list(by_role)
            weights[index] = value
    return weights


def _roles(messages: Sequence[Any]) -> tuple:
    """Each message's role as it is ("?" for what is not a message): strings but in odd data."""
    try:
        return tuple(map(_ROLE, messages))  # a dict each, with a role: nearly every row, at C speed
    except (KeyError, TypeError):
        return tuple(message.get("role") if type(message) is dict else "?" for message in messages)


def _carries(messages: Sequence[Any], keys: frozenset, detail_key: str | None) -> bool | str:
    """Does any message carry a weight field (``"fields"``), or character spans or weighted parts (True)?"""
    found: bool | str = False
    for message in messages:
        if type(message) is not dict or len(message) <= 2 and type(message.get("content")) is not list:
            continue
        if detail_key and message.get(detail_key) or PART_SPANS in message:
            return True
        if not keys.isdisjoint(message.keys()):
            found = "fields"
        content = message.get("content")
        if type(content) is list and any(type(p) is dict and not keys.isdisjoint(p.keys()) for p in content):
            return True
    return found


def _field(message: Any, fields: tuple[str, ...], row: int, index: int, where: str = "") -> float | None:
    """The message's (or part's, or span's) weight from ``fields``; None when it has none of them.

    A boolean switches: ``false`` in any of the fields makes the weight 0, ``true`` alone makes it 1. A number is a
    weight: the first number among the fields is the weight of a message no ``false`` switched off (ms-swift's
    ``loss: true, loss_scale: 0.5`` weighs 0.5). Every value is checked, even after the one that decides."""
    if type(message) is not dict and not isinstance(message, Mapping):
        return None
    if len(message) <= 2 and not where:  # {role, content}: no field (most messages; parts always look)
        return None
    number = switch = None
    for key in fields:
        value = message.get(key)
        if value is None:
            continue
        kind = type(value)
        if kind is bool:
            switch = value and switch is not False
        elif (kind is float or kind is int or isinstance(value, (int, float))) and 0 <= value <= MAX_WEIGHT:
            if number is None:  # NaN and inf fail the comparison; -0.0 is 0
                number = float(value) + 0.0
        elif isinstance(value, (int, float)) and value > MAX_WEIGHT:
            raise ValueError(f"row {row}, message {index}{where}: {key}={value!r} is beyond float32's range; a weight "
                             f"must be at most {MAX_WEIGHT:.8g} (loss_weights are float32)")
        else:
            raise ValueError(f"row {row}, message {index}{where}: {key}={value!r} is not a weight; a message's {key!r} "
                             "must be true/false or a number >= 0 (pass weight_field=None to ignore such fields, or "
                             "weight_field='NAME' to read another)")
    if switch is False:
        return 0.0
    return number if number is not None else None if switch is None else 1.0


def _content_start(text: str, message: Mapping, own: list[tuple[int, int, str]]) -> int | None:
    """Where character 0 of a string content lies in ``text``, when the template wrote it verbatim (or trimmed)."""
    content = message.get("content")
    if not isinstance(content, str) or THINK_CLOSE in content:
        return None
    found = [(s, e) for s, e, kind in own if kind == "content"]
    if len(found) != 1:
        return None
    start, end = found[0]
    lead = len(content) - len(content.lstrip())
    if text[start:end] != content.strip():
        return None
    return start - lead


def _detail_segments(text, message, own, detail_key, weight, assistant, index, row) -> list:
    """axolotl's character spans (``end_offset`` inclusive) as segments of the rendered text. As in axolotl, only the
    spans train: the message's characters that no span covers weigh 0, and a ``train: true`` span takes the message's
    weight (a message that weighs 0, ``training: false``, trains nothing). Every span is checked first: offsets must
    be integers within the message's content, else an error names the row, the message and the span."""
    details = message.get(detail_key) if detail_key else None
    if not details:
        return []
    if not isinstance(details, (list, tuple)):
        raise ValueError(f"row {row}, message {index}: {detail_key!r} must be a list of "
                         "{begin_offset, end_offset, train} objects (or pass detail_field=None)")
    content = message.get("content")
    size = len(content) if isinstance(content, str) else None
    spans = []
    for k, detail in enumerate(details):
        where = f"row {row}, message {index}, {detail_key} span {k}"
        if not isinstance(detail, Mapping) or not {"begin_offset", "end_offset"} <= set(detail):
            raise ValueError(f"{where}: {detail!r}; each span needs begin_offset and end_offset (inclusive), and "
                             "train or weight")
        begin, end = (_offset(detail, key, size, where) for key in ("begin_offset", "end_offset"))
        if end < begin:
            raise ValueError(f"{where}: end_offset={end} is before begin_offset={begin} (end_offset is inclusive: "
                             "a span of one character has begin_offset == end_offset)")
        train = detail.get("train")
        if detail.get("weight") is not None:
            value = _field(detail, ("weight",), row, index, f", {detail_key} span {k}")
        elif train is None or type(train) is bool:
            value = weight if train is not False else 0.0
        else:
            raise ValueError(f"{where}: train={train!r}; pass true or false (or a weight >= 0 as weight)")
        spans.append((begin, end + 1, value))
    if weight <= 0:  # the message's own flag wins: nothing in it trains
        return []
    # the characters no span covers, in content offsets (unknown where the content is not one string)
    gaps, at = [], 0
    for begin, end, _ in sorted(spans):
        if begin > at:
            gaps.append((at, begin, 0.0))
        at = max(at, end)
    if size is not None and at < size:
        gaps.append((at, size, 0.0))
    origin = _content_start(text, message, own)
    if origin is None:  # the template rewrote the content: the whole content takes the lowest weight
        lowest = min(value for _, _, value in gaps + spans)
        return [(s, e, min(lowest, weight), index, assistant) for s, e, kind in own if kind == "content"]
    return [(origin + begin, origin + end, value, index, assistant) for begin, end, value in gaps + spans]


def _offset(detail: Mapping, key: str, size: int | None, where: str) -> int:
    """A span's offset: an integer (an integral float, as Arrow may read it) within the content's ``size``
    characters."""
    value = detail[key]
    if type(value) is not bool and isinstance(value, (int, float)) and value == value and float(value).is_integer() \
            and 0 <= value and (size is None or value < size):
        return int(value)
    within = f"0..{size - 1}" if size else "0 or more" if size is None else "none: the content is empty"
    raise ValueError(f"{where}: {key}={value!r} is not a character offset within the message's content "
                     f"(integers, {within}; end_offset is inclusive)")


def _part_segments(text, message, own, fields, weight, assistant, index, row) -> list:
    """Content parts carrying a weight field: their located text takes it (text parts are located in order; parts
    that the shape policy joined into one string are placed by their spans in it)."""
    if PART_SPANS in message:
        origin = _content_start(text, message, own)
        out = []
        for k, ((begin, end), part) in enumerate(message[PART_SPANS]):
            value = _field(part, fields, row, index, f", content part {k}")
            if value is None:
                continue
            value = weight if value == 1.0 else value
            if origin is None:
                out += [(s, e, min(value, weight), index, assistant) for s, e, kind in own if kind == "content"]
            else:
                out.append((origin + begin, origin + end, value, index, assistant))
        return out
    content = message.get("content")
    if not isinstance(content, (list, tuple)):
        return []
    texts = [p for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str) and p["text"].strip()]
    found = [(s, e) for s, e, kind in own if kind == "content"]
    out = []
    for k, (part, (start, end)) in enumerate(zip(texts, found)):
        value = _field(part, fields, row, index, f", content part {k}")
        if value is not None:
            out.append((start, end, weight if value == 1.0 else value, index, assistant))
    return out


def _empty_think(text: str, start: int, end: int) -> bool:
    """Does the template's text before an answer hold an empty ``<think></think>`` block?"""
    before = text[start:end]
    opened = before.rfind(THINK_OPEN)
    return opened >= 0 and before.find(THINK_CLOSE, opened) >= 0 and \
        not before[opened + len(THINK_OPEN):before.find(THINK_CLOSE, opened)].strip()
