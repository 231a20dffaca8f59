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

from .locate import locate_messages
from .render import ChatTemplateError


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


def role_breaks(trained: np.ndarray, roles: Any, last_turn_only: bool = False) -> np.ndarray:
    """Per token: does it break the role invariant under labels that train ``trained`` (a bool per token)? A token
    of user, system or tool text trains, or one of an assistant's content or tool-call arguments does not
    (``roles``: ``encode_rendered.RoleTokens``; with ``last_turn_only`` only the first half is asked)."""
    assistant = roles.names.index("assistant") + 1 if "assistant" in roles.names else -1
    bad = (roles.role > 0) & (roles.role != assistant) & trained
    if not last_turn_only:
        bad |= (roles.role == assistant) & ~trained
    return bad


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
    from ..engine.outcomes import TEMPLATE_BREAKS_ROLES, Outcome, OutcomeCounts

    ids = encoded.input_ids
    result = label_batch(ids, markers, backend=backend, last_turn_only=last_turn_only, ignore_index=ignore_index,
                         dtype=dtype, data_mask=encoded.in_content)
    roles = encoded.roles
    if roles is None or not roles.role.any():
        return result
    flat = pc.list_flatten(result.labels).to_numpy(zero_copy_only=False)
    bad = role_breaks(flat != ignore_index, roles, last_turn_only)
    if not bad.any():
        return result
    lengths = pc.fill_null(pc.list_value_length(ids), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    flat_ids = pc.list_flatten(ids).to_numpy(zero_copy_only=False)
    row_of = np.repeat(np.arange(lengths.shape[0]), lengths)
    flat = flat.copy()
    rejected, from_rendering = [], []
    null = ~np.asarray(ids.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    for r in np.unique(row_of[bad]).tolist():
        at = slice(int(starts[r]), int(starts[r] + lengths[r]))
        messages, tools = encoded.chats[r] if r < len(encoded.chats) and encoded.chats[r] else (None, None)
        if not (flat[at] != ignore_index).any():  # trains nothing: counted by its outcome, as any such row
            continue
        trained = None
        if messages:
            trained = trained_from_rendering(encoded.tokenizer, messages, flat_ids[at], tools=tools,
                                             last_turn_only=last_turn_only,
                                             special_tokens_in_content=encoded.special_tokens_in_content)
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
