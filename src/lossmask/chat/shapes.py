"""Conversation shapes as a policy: what real chat dumps hold, made renderable before the template sees it.

Public dumps hold conversations that open with an assistant message (a ShareGPT page scraped mid-chat),
repeat a role (a user who sent two messages), hold an empty message, or store messages as ShareGPT's
``{from, value}`` and content as a list of OpenAI text parts. Many templates raise on these ("roles must
alternate"), and some render them in a way that trains user text (Phi-3 writes ``<|assistant|>`` after
every user message). So each row is normalised here, by ``MaskOptions``, and every change is counted by
shape; nothing is left to the template's exception:

- ShareGPT messages become ``{role, content}`` through ``MaskOptions.role_map`` (speakers matched in any case:
  ``Human`` is ``human``); a speaker the map does not name makes the row ``invalid``, naming the key, the speaker
  and the map. LLaMA-Factory's tool form is read natively: a ``function_call`` message (its value
  ``{"name", "arguments"}`` JSON, or a list of them) becomes an assistant message with ``tool_calls``, an
  ``observation`` a tool result; a value that is not a call makes the row ``invalid``;
- content given as text parts is joined into one string ("\\n" between parts, as vLLM does) when the
  template takes strings only; a part that is not text (an image) makes the row ``invalid``;
- ``empty_messages="drop"``: a user, assistant or system message with no text and nothing else is dropped;
- ``leading_assistant="drop"``: messages before the first user message, other than system, are dropped
  (FastChat and LLaMA-Factory do the same);
- ``consecutive_roles="merge"``: consecutive plain messages of one role are joined with a blank line;
- ``drop_system_message``: every system message is removed (axolotl's and LLaMA-Factory's option; a template
  that writes a default system prompt when none is given still writes it);
- a row that the policy left without a user message followed by an assistant message is dropped as
  ``no_exchange`` (a row that came without one is labelled as before and shows why it trains nothing).

``unusual`` marks the rows whose shape the marker probes did not cover (anything but an optional system
message, then user and assistant messages alternating, each a non-empty string); the role invariant is
checked on those (``encode_rendered``), or on every row with ``check_roles="all"``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..engine.outcomes import NO_EXCHANGE
from .json_text import loads_nested
from .locate import PLAIN_KEYS, weighed_only

ROLES_MERGED = "roles_merged"
LEADING_ASSISTANT_DROPPED = "leading_assistant_dropped"
EMPTY_MESSAGES_DROPPED = "empty_messages_dropped"
CONTENT_PARTS_JOINED = "content_parts_joined"
SHAREGPT_READ = "sharegpt_messages_read"
SYSTEM_DROPPED = "system_messages_dropped"
VALUE_PARTS_READ = "v1_content_parts_read"
CALL_IDS_WRITTEN = "tool_call_ids_written"
SHAPES = (LEADING_ASSISTANT_DROPPED, ROLES_MERGED, EMPTY_MESSAGES_DROPPED, CONTENT_PARTS_JOINED, SHAREGPT_READ,
          SYSTEM_DROPPED, VALUE_PARTS_READ, CALL_IDS_WRITTEN)
# the types of LLaMA-Factory's v1 content parts (``{"type", "value"}``) that are read as text, reasoning and tool calls
VALUE_PART_TYPES = ("text", "reasoning", "tool_call")
MERGE_SEPARATOR = "\n\n"
PART_SEPARATOR = "\n"
# where each joined part lies in the joined content, kept when a part carries more than its text (a weight):
# [(begin, end), part] pairs that chat/weights.py reads
PART_SPANS = "lossmask_part_spans"
_MERGEABLE = ("user", "assistant", "system")
# ShareGPT speakers whose value is a tool call (LLaMA-Factory's tool form), read as an assistant message's tool_calls
CALL_SPEAKERS = frozenset(("function_call",))


@dataclass
class Shaped:
    """The conversations after the policy (None where the row left the batch), and what happened.

    ``invalid`` and ``dropped``: ``(index, message)`` of the rows refused (``invalid``) or dropped as
    ``no_exchange``; ``shapes``: rows changed, per shape; ``unusual``: a bool per conversation."""

    conversations: list[Any]
    invalid: list[tuple[int, str]] = field(default_factory=list)
    dropped: list[tuple[int, str, str]] = field(default_factory=list)
    shapes: dict[str, int] = field(default_factory=dict)
    unusual: list[bool] = field(default_factory=list)


def normalise_shapes(conversations: Sequence[Any], options: Any, *, takes_parts: bool = True,
                     call_ids: bool = False) -> Shaped:
    """Apply the shape policy of ``options`` to each conversation (a list of messages; None or empty left as is).
    ``call_ids``: the template requires tool-call ids (``needs_call_ids``); calls without one are given one."""
    roles = options.roles()
    every_row = options.check_roles == "all"
    out = Shaped(list(conversations), shapes={shape: 0 for shape in SHAPES})
    for r, messages in enumerate(out.conversations):
        if not messages or not isinstance(messages, list):
            out.unusual.append(every_row)
            continue
        if _plain_alternating(messages) and not (options.drop_system_message and _role(messages[0]) == "system"):
            out.unusual.append(every_row)  # most rows: nothing to do
            continue
        changed: set[str] = set()
        try:
            messages = _read_messages(messages, roles, takes_parts, changed)
        except ValueError as exc:
            out.invalid.append((r, str(exc)))
            out.conversations[r] = None
            out.unusual.append(every_row)
            continue
        if call_ids and _write_call_ids(messages):
            changed.add(CALL_IDS_WRITTEN)
        dropped_any = False
        if options.drop_system_message:
            kept = [m for m in messages if _role(m) != "system"]
            if len(kept) != len(messages):
                changed.add(SYSTEM_DROPPED)
            messages = kept
        if options.empty_messages == "drop":
            kept = [m for m in messages if not _empty(m)]
            if len(kept) != len(messages):
                changed.add(EMPTY_MESSAGES_DROPPED)
                dropped_any = True
            messages = kept
        if options.leading_assistant == "drop":
            first_user = next((i for i, m in enumerate(messages) if _role(m) == "user"), len(messages))
            kept = [m for m in messages[:first_user] if _role(m) == "system"] + messages[first_user:]
            if len(kept) != len(messages):
                changed.add(LEADING_ASSISTANT_DROPPED)
                dropped_any = True
            messages = kept
        if options.consecutive_roles == "merge":
            merged = _merge_consecutive(messages)
            if len(merged) != len(messages):
                changed.add(ROLES_MERGED)
            messages = merged
        for shape in changed:
            out.shapes[shape] += 1
        if dropped_any and not _has_exchange(messages):
            done = ", ".join(sorted(changed - {SHAREGPT_READ, CONTENT_PARTS_JOINED, VALUE_PARTS_READ, CALL_IDS_WRITTEN}))
            out.dropped.append((r, NO_EXCHANGE, f"no user message followed by an assistant message is left ({done})"))
            out.conversations[r] = None
            out.unusual.append(every_row)
            continue
        out.conversations[r] = messages
        out.unusual.append(every_row or not _plain_alternating(messages))
    return out


def _plain_alternating(messages: list) -> bool:
    """An optional system message, then user and assistant alternating, each ``{role, content}`` with text (and
    perhaps a weight: a number or boolean under a weight field's name, which no template reads)."""
    start = 1 if messages and type(messages[0]) is dict and messages[0].get("role") == "system" else 0
    if (len(messages) - start) % 2 or len(messages) == start:
        return False
    for i, message in enumerate(messages):
        if type(message) is not dict:
            return False
        if message.keys() != PLAIN_KEYS and not weighed_only(message):
            return False
        content = message["content"]
        if type(content) is not str or not content.strip():
            return False
        expected = "system" if i < start else ("user" if (i - start) % 2 == 0 else "assistant")
        if message["role"] != expected:
            return False
    return True


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else None


def without_nulls(value: Any) -> Any:
    """``value`` with every null-valued key of its objects left out, at every depth (lists keep their items).

    Arrow stores tool calls and tools as structs unified across rows: each call's arguments (and each tool's
    schema) get every key any other one has, as null (``get_time`` gets ``"unit": null``). No template can tell
    such a key from data, and one that writes it trains an argument the data never had. So null keys of tool
    calls given as objects, and of tools, are not data (docs/inputs.md); arguments given as JSON text keep theirs."""
    if type(value) is dict:
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if type(value) is list:
        return [without_nulls(v) for v in value]
    return value


def _read_messages(messages: list, roles: dict[str, str], takes_parts: bool, changed: set[str]) -> list:
    """ShareGPT messages as ``{role, content}``, text parts joined where the template takes strings only, and the
    null keys of tool calls left out (``without_nulls``)."""
    out = []
    for index, message in enumerate(messages):
        if type(message) is dict and type(message.get("tool_calls")) is list:
            message = {**message, "tool_calls": without_nulls(message["tool_calls"])}
        if isinstance(message, dict) and "role" not in message and "from" in message:
            speaker = message["from"]
            role = speaker_role(speaker, roles)
            if role is None:
                shown = ", ".join(f"{k}={v}" for k, v in roles.items())
                raise ValueError(
                    f"message {index} has 'from': {speaker!r}, a speaker the role map does not name (ShareGPT messages "
                    f"are read as 'from' -> role and 'value' -> content; the map is {shown}); add it with "
                    f"--role-map {speaker}=ROLE (role_map={{{speaker!r}: ROLE}})"
                )
            rest = {k: v for k, v in message.items() if k not in ("from", "value")}
            if role == "assistant" and str(speaker).lower() in CALL_SPEAKERS:
                message = {"role": "assistant", "content": "", "tool_calls": _tool_calls(index, message.get("value")),
                           **rest}
            else:
                message = {"role": role, "content": message.get("value"), **rest}
            changed.add(SHAREGPT_READ)
        if isinstance(message, dict) and _holds_value_parts(message.get("content")):
            message = _value_parts_read(index, message)
            changed.add(VALUE_PARTS_READ)
        if isinstance(message, dict) and isinstance(message.get("content"), list) and not takes_parts:
            texts = []
            for part in message["content"]:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if isinstance(part, dict) and kind in (None, "text") and not isinstance(part.get("text"), str):
                    text = part.get("text")
                    shown = "missing" if "text" not in part else "null" if text is None else f"a {type(text).__name__}"
                    raise ValueError(
                        f"message {index} ({message.get('role')}) holds a text part whose 'text' is {shown}, not a "
                        "string; give it a string (\"\" for no text) or remove the part (LLaMA-Factory's v1 parts hold "
                        "it under 'value')"
                    )
                if not isinstance(part, dict) or kind not in (None, "text"):
                    raise ValueError(
                        f"message {index} ({message.get('role')}) holds a content part of type {kind!r}; this chat "
                        "template takes text only, so the row cannot be rendered without losing it"
                    )
                texts.append(part["text"])
            message = {**message, "content": PART_SEPARATOR.join(texts)}
            if any(set(part) - {"type", "text"} for part in message_parts(messages[index])):
                at, spans = 0, []
                for part, text in zip(message_parts(messages[index]), texts):
                    spans.append(((at, at + len(text)), part))
                    at += len(text) + len(PART_SEPARATOR)
                message[PART_SPANS] = spans
            changed.add(CONTENT_PARTS_JOINED)
        out.append(message)
    return out


def _holds_value_parts(content: Any) -> bool:
    """LLaMA-Factory's v1 content: a list of parts ``{"type", "value"}`` (no part holds OpenAI's ``text``)."""
    return (type(content) is list and any(type(part) is dict and "value" in part for part in content)
            and not any(type(part) is dict and "text" in part for part in content))


def _value_parts_read(index: int, message: dict) -> dict:
    """A message of LLaMA-Factory v1 parts as the template takes it, as LLaMA-Factory's own v1 renderer reads them: the
    ``text`` values joined (with nothing between) as its content, the ``reasoning`` values as ``reasoning_content``,
    each ``tool_call`` value (``{"name", "arguments"}`` JSON) as one of its ``tool_calls``."""
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict] = []
    for part in message["content"]:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        value = part.get("value") if isinstance(part, dict) else None
        if kind not in VALUE_PART_TYPES:
            raise ValueError(
                f"message {index} ({message.get('role')}) holds a v1 content part of type {kind!r}; LLaMA-Factory's "
                f"v1 parts read here are {', '.join(VALUE_PART_TYPES)} (images, videos and audio go through a "
                "processor as image parts: docs/vision.md)"
            )
        if not isinstance(value, str):
            shown = "missing" if "value" not in part else "null" if value is None else f"a {type(value).__name__}"
            raise ValueError(
                f"message {index} ({message.get('role')}) holds a {kind!r} part whose 'value' is {shown}, not a "
                "string; give it a string (\"\" for no text) or remove the part"
            )
        if kind == "text":
            texts.append(value)
        elif kind == "reasoning":
            reasoning.append(value)
        else:
            calls += _tool_calls(index, value, kind)
    out = {key: item for key, item in message.items() if key != "content"}
    out["content"] = "".join(texts)
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    if calls:
        out["tool_calls"] = calls
    return out


# LLaMA-Factory's media placeholders in message text, per media column; image and video placeholders become parts
PLACEHOLDERS = {"images": "<image>", "videos": "<video>", "audios": "<audio>"}
_PLACEHOLDER_PARTS = {"<image>": "image", "<video>": "video"}
_PLACEHOLDER_SPLIT = re.compile("(<image>|<video>)")


def read_placeholders(conversations: list, media: dict[str, list], *, processor: bool) -> list[tuple[int, str]]:
    """LLaMA-Factory's multimodal rows: ``<image>`` / ``<video>`` placeholders in message text, with the row's media
    in the ``images`` / ``videos`` columns (``media``: column -> how many items each row holds). Through a processor,
    each string content that holds a placeholder becomes parts (``{"type": "image"}`` ...), in order, which the path
    of a processor matches with the column (``chat/encode_media.py``); ``conversations`` is changed in place. Returns
    ``(row, message)`` for the rows that cannot be read so, which are never kept as text: a row with audio, a row with
    placeholders and media but no processor, a row whose placeholders and media differ in number, and a row with a
    placeholder for a medium it has no item of (no such column, or none in this row: ``<audio>`` beside images only)."""
    invalid: list[tuple[int, str]] = []
    for r, messages in enumerate(conversations):
        given = {column: values[r] for column, values in media.items() if values[r]}
        if not messages:
            continue
        # (through a processor, an <image> or <video> with no item is named by the processor's path: typed in text)
        orphan = _orphan_placeholder(messages, given, ("images", "videos") if processor else ())
        if orphan is not None:
            invalid.append((r, orphan))
            continue
        if not given:
            continue
        if "audios" in given:
            invalid.append((r, "holds audio (column 'audios'); lossmask reads text, images and videos, and never keeps "
                               "an audio row as text: leave it out, or remove its audio and <audio> placeholders"))
            continue
        texts = [m["content"] for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)]
        counts = {column: sum(text.count(PLACEHOLDERS[column]) for text in texts) for column in given}
        if not any(counts.values()):
            continue
        shown = " and ".join(f"{n} {PLACEHOLDERS[c]} placeholder{'s' * (n != 1)}" for c, n in counts.items() if n)
        if not processor:
            invalid.append((r, f"holds {shown} with media in column(s) {', '.join(map(repr, given))}: a chat with "
                               "images or videos is read through the model's processor (--tokenizer its folder: "
                               "docs/vision.md); with a text tokenizer it would train as text"))
            continue
        wrong = [c for c in given if counts[c] != given[c]]
        if wrong:
            c = wrong[0]
            invalid.append((r, f"holds {counts[c]} {PLACEHOLDERS[c]} placeholder(s) but {given[c]} item(s) in column "
                               f"{c!r}; give one placeholder per item, in order"))
            continue
        conversations[r] = [_placeholder_parts(m) for m in messages]
    return invalid


def _orphan_placeholder(messages: list, given: dict, left: tuple = ()) -> str | None:
    """What to say of a row whose text holds a placeholder for a medium it has no item of (None: there is none);
    ``left``: the media columns whose placeholders another path names."""
    texts = [m["content"] for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)]
    for column, placeholder in PLACEHOLDERS.items():
        if column in given or column in left:
            continue
        n = sum(text.count(placeholder) for text in texts)
        if n:
            return (f"holds {n} {placeholder} placeholder{'s' * (n != 1)} but no item in column {column!r}: the "
                    f"row's {column} are missing, and the placeholder would train as text; give the {column}, or "
                    "remove the placeholder")
    return None


def _placeholder_parts(message: Any) -> Any:
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str) or not _PLACEHOLDER_SPLIT.search(content):
        return message
    parts = [{"type": _PLACEHOLDER_PARTS[piece]} if piece in _PLACEHOLDER_PARTS else {"type": "text", "text": piece}
             for piece in _PLACEHOLDER_SPLIT.split(content) if piece]
    return {**message, "content": parts}


def speaker_role(speaker: Any, roles: dict[str, str]) -> str | None:
    """The role of a ShareGPT speaker: the map's entry for it as written, else for it in any case (``Human``)."""
    if speaker in roles:
        return roles[speaker]
    if isinstance(speaker, str):
        folded = speaker.casefold()
        return next((role for name, role in roles.items() if name.casefold() == folded), None)
    return None


def _tool_calls(index: int, value: Any, kind: str = "function_call") -> list[dict]:
    """LLaMA-Factory's ``function_call`` value, ``{"name", "arguments"}`` JSON (or a list of them for parallel
    calls), as OpenAI ``tool_calls``; the arguments are kept as given (an object, or JSON text)."""
    try:
        calls = loads_nested(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        calls = None
    calls = [calls] if isinstance(calls, dict) else calls
    if not isinstance(calls, list) or not calls or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) and c["name"].strip() for c in calls):
        shown = value if not isinstance(value, str) or len(value) <= 60 else value[:57] + "..."
        raise ValueError(
            f"message {index} holds a {kind!r} whose value {shown!r} is not a tool call: LLaMA-Factory writes it as "
            'JSON text {"name": ..., "arguments": {...}} (or a list of them)'
        )
    return [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}}
            for c in calls]


def read_tools(value: Any) -> list | None:
    """A row's ``tools`` as the template takes them: JSON text decoded (LLaMA-Factory stores the list as a string,
    ``"[]"`` when there is none), null keys left out (``without_nulls``), and a bare function schema ``{"name", "parameters", ...}`` wrapped as OpenAI's
    ``{"type": "function", "function": ...}``. None when the row has none; ValueError when it is not a list of them."""
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = loads_nested(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"holds text that is not JSON ({exc}); write the tools as a JSON list of function "
                             "schemas") from None
    if value is None:
        return None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise ValueError(f"holds a {type(value).__name__}, not a list of function schemas")
    value = without_nulls(value)  # the keys Arrow's struct unification added
    return [{"type": "function", "function": tool} if "name" in tool and "function" not in tool else tool
            for tool in value] or None


def message_parts(message: Any) -> list:
    """The content parts of a message (ShareGPT's ``value`` too)."""
    content = message.get("content", message.get("value")) if isinstance(message, dict) else None
    return content if isinstance(content, list) else []


def _empty(message: Any) -> bool:
    """A user, assistant or system message with no text and nothing else (no tool calls, no reasoning)."""
    if not isinstance(message, dict) or message.get("role") not in _MERGEABLE or not set(message) <= PLAIN_KEYS | {"name"}:
        return False
    content = message.get("content", 0)  # a message without content is left to the template
    return (isinstance(content, str) and not content.strip()) or (isinstance(content, list) and not content)


def _merge_consecutive(messages: list) -> list:
    out: list = []
    for message in messages:
        previous = out[-1] if out else None
        if (previous is not None and _mergeable(previous) and _mergeable(message)
                and previous["role"] == message["role"]):
            out[-1] = {**previous, "content": previous["content"] + MERGE_SEPARATOR + message["content"]}
        else:
            out.append(message)
    return out


def _mergeable(message: Any) -> bool:
    # only {role, content}: a name, tool calls or reasoning would be lost or misplaced by joining
    return (isinstance(message, dict) and message.get("role") in _MERGEABLE and message.keys() == PLAIN_KEYS
            and isinstance(message.get("content"), str))


def _has_exchange(messages: list) -> bool:
    seen_user = False
    for message in messages:
        role = _role(message)
        if role == "user":
            seen_user = True
        elif role == "assistant" and seen_user:
            return True
    return False


CALL_ID_WIDTH = 9  # Mistral's templates take ids of exactly 9 characters


def _write_call_ids(messages: list) -> bool:
    """Give each tool call without an ``id`` one, and each tool result without a ``tool_call_id`` the id of the call it
    answers (the results after an assistant message answer its calls in order; a result beyond them, the last call).
    The ids are the call's number in the chat from 1, zero-padded to ``CALL_ID_WIDTH`` digits (``000000001``): the same
    data always renders the same. ``messages`` is changed in place (its messages are copied first); True when an id was
    written."""
    written, number, pending, answered = False, 0, [], 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list) and calls:
            ids, copied = [], []
            for call in calls:
                number += 1
                if isinstance(call, dict) and not call.get("id"):
                    call = {**call, "id": f"{number:0{CALL_ID_WIDTH}d}"}
                    written = True
                copied.append(call)
                ids.append(call.get("id") if isinstance(call, dict) else None)
            messages[i] = {**message, "tool_calls": copied}
            pending, answered = ids, 0
        elif message.get("role") == "tool" and not message.get("tool_call_id") and pending:
            messages[i] = {**message, "tool_call_id": pending[min(answered, len(pending) - 1)]}
            answered += 1
            written = True
    return written


def needs_call_ids(tok: Any) -> bool:
    """Does the chat template refuse a tool call without an id that it renders with one (Mistral-v3, Mistral-Nemo)?"""
    cached = getattr(tok, "_needs_call_ids", None)
    if cached is not None:
        return cached
    call = {"type": "function", "function": {"name": "probe", "arguments": {"x": 1}}}
    probe = [{"role": "user", "content": "Qz7p1"}, {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "content": "Qz7p2"}, {"role": "assistant", "content": "Qz7p3"}]
    result = False
    try:
        tok.render(probe)
    except Exception:  # noqa: BLE001 - a template that raises here may want ids: try with them
        with_ids = [dict(m) for m in probe]
        try:
            if _write_call_ids(with_ids):
                tok.render(with_ids)
                result = True
        except Exception:  # noqa: BLE001 - it refuses tool calls for another reason
            result = False
    try:
        tok._needs_call_ids = result
    except AttributeError:
        pass
    return result


def takes_content_parts(tok: Any) -> bool:
    """Does the chat template render a list of text parts as its text (and not as a Python repr)?"""
    cached = getattr(tok, "_takes_content_parts", None)
    if cached is not None:
        return cached
    probe = [{"role": "user", "content": [{"type": "text", "text": "Qz7p1"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "Qz7p2"}]}]
    try:
        text = tok.render(probe)
        result = "Qz7p1" in text and "Qz7p2" in text and "'type'" not in text and '"type"' not in text
    except Exception:  # noqa: BLE001 - a template that raises on parts does not take them
        result = False
    try:
        tok._takes_content_parts = result
    except AttributeError:
        pass
    return result
