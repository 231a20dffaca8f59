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

This is a render per assistant turn, so it is done only for the rare rows whose marker labels break the
invariant; their new labels are checked again before they are kept (``jobs.batch_step``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa

from .encode_batch import json_values, messages_from_arrow
from .locate import locate_messages
from .render import ChatTemplateError
from .shapes import normalise_shapes, takes_content_parts


def trained_from_rendering(ct: Any, messages: Sequence[Mapping[str, Any]], ids: np.ndarray, *,
                           tools: Any = None, last_turn_only: bool = False,
                           special_tokens_in_content: str = "text") -> np.ndarray | None:
    """A bool per token of ``ids`` (the row as the messages path encoded it, perhaps cut at a maximum length):
    inside an assistant turn found from the rendering. None when it cannot be told: a rendering the template
    refuses, ids that are not this conversation's, a turn that does not continue the rendering before it."""
    messages = list(messages)
    try:
        text = ct.render(messages, tools=tools)
    except ChatTemplateError:
        return None
    row, offsets = _encode(ct, text, messages, special_tokens_in_content)
    ids = np.asarray(ids)
    if row.shape[0] < ids.shape[0] or not np.array_equal(row[: ids.shape[0]], ids):
        return None
    starts = offsets[: ids.shape[0], 0]
    special = np.fromiter((int(t) in ct.special_ids for t in ids), dtype=bool, count=ids.shape[0])
    turns = [i for i, m in enumerate(messages) if isinstance(m, Mapping) and m.get("role") == "assistant"]
    if last_turn_only:
        turns = turns[-1:]
    trained = np.zeros(ids.shape[0], dtype=bool)
    for i in turns:
        try:
            prompt = ct.render(messages[:i], tools=tools, add_generation_prompt=True)
            through = ct.render(messages[: i + 1], tools=tools)
        except ChatTemplateError:
            return None
        start = common_prefix(prompt, through)
        if not text.startswith(through[:start]):
            return None
        end = start + common_prefix(through[start:], text[start:])
        inside = np.flatnonzero((starts >= start) & (starts < end))
        if not inside.size:
            continue
        stops = inside[special[inside]]
        if stops.size:
            last = int(stops[-1])
        else:
            last_char = start + len(text[start:end].rstrip())
            kept = inside[starts[inside] < last_char]
            if not kept.size:
                continue
            last = int(kept[-1])
        trained[int(inside[0]): last + 1] = True
    return trained


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
    """How many leading characters two strings share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def chats_of_rows(ct: Any, table: Any, kind: str, options: Any, rows: Sequence[int]) -> list[tuple[list | None, Any]]:
    """``(messages, tools)`` of some rows of an Arrow batch, as the messages path rendered them: read from the chat
    column (or prompt + completion) and put through the shape policy (``shapes.normalise_shapes``)."""
    take = pa.array(list(rows), type=pa.int64())
    if kind == "messages":
        conversations = messages_from_arrow(table.column(options.chat_column(table.column_names)).take(take))
    else:
        prompts = messages_from_arrow(table.column(options.prompt_column).take(take))
        completions = messages_from_arrow(table.column(options.completion_column).take(take))
        conversations = [None if p is None or c is None else p + c for p, c in zip(prompts, completions)]
    tools = json_values(table.column("tools").take(take)) if "tools" in table.column_names else [None] * len(take)
    shaped = normalise_shapes(conversations, options, takes_parts=takes_content_parts(ct))
    return [(messages, tool or None) for messages, tool in zip(shaped.conversations, tools)]
