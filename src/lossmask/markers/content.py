"""Message text against a rendered row: what the template dropped, and which messages quote a marker.

``missing_message_text(text, messages)`` lists every piece of message text (content, reasoning,
tool-call name and arguments) that does not occur in ``text``, the row the chat template rendered:
Phi-3 drops tool messages, Qwen2.5 skips a message whose role it does not know, many templates
drop reasoning from earlier turns. A row that lost a message must not be labelled as if nothing
happened (``verify`` reports it; the masking path counts it).

``find_marker_text(conversations, tokenizer, markers)`` lists the messages whose text contains the
text of a marker or of a special token: rows that marker-based labelling of pre-tokenised ids
cannot get right (docs/masking-rule.md, "Limits").

Presence is checked piece by piece anywhere in the row (templates move system prompts), as
written, stripped (templates trim), JSON-escaped (templates that ``tojson`` a string), or with its
whitespace runs collapsed (a template that only rewrites whitespace keeps the text).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..chat.locate import find_piece, message_pieces


@dataclass(frozen=True)
class MissingText:
    """One piece of a message that is not in the rendered row."""

    message: int  # index in the conversation
    role: str
    part: str  # "content", "reasoning", "tool call name" or "tool call arguments"
    text: str  # the piece (shortened)

    def __str__(self) -> str:
        return f"message {self.message} ({self.role}): {self.part} {self.text!r}"


def message_parts(message: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(part, piece)`` for every piece of a message that a template should copy into the row.

    The pieces are ``chat.locate.message_pieces``, the one definition the messages path uses too; ``part``
    names them for reports: "content", "tool call name", "tool call arguments", or "reasoning" for
    reasoning fields and the reasoning part of R1-style content (which templates may drop on purpose).
    """
    return [(what if required or what == "tool call name" else "reasoning", piece)
            for piece, required, what in message_pieces(message)]


def message_texts(message: Mapping[str, Any]) -> list[str]:
    """The texts of one message that a template copies verbatim: each piece, and a tool call's string values
    in place of its arguments (templates re-serialise the rest)."""
    return [text for _, piece in message_parts(message)
            for text in (piece.strings if hasattr(piece, "strings") else [piece])]


class _Row:
    """A rendered row, with the whitespace-collapsed copy computed once."""

    def __init__(self, text: str):
        self.text = text
        self._collapsed: str | None = None

    def holds(self, piece: str) -> bool:
        if piece in self.text or piece.strip() in self.text:
            return True
        escaped = json.dumps(piece, ensure_ascii=False)[1:-1]
        if escaped != piece and (escaped in self.text or json.dumps(piece)[1:-1] in self.text):
            return True
        if self._collapsed is None:
            self._collapsed = " ".join(self.text.split())
        return " ".join(piece.split()) in self._collapsed


def missing_message_text(text: str, messages: Sequence[Mapping[str, Any]]) -> list[MissingText]:
    """Every piece of message text (content, reasoning, tool calls) that ``text`` does not contain.

    ``text``: the row rendered by the chat template from ``messages``. Empty when nothing was dropped.
    Callers decide what a missing part means: a dropped content or tool call changes what the model
    sees, dropped reasoning of earlier turns is what many templates do on purpose (Qwen3, gpt-oss).
    """
    row = _Row(text)
    out = []
    for index, message in enumerate(messages):
        role = str(message.get("role", "?")) if isinstance(message, Mapping) else "?"
        if not isinstance(message, Mapping):
            continue
        for part, piece in message_parts(message):
            if not (find_piece(text, piece) is not None if hasattr(piece, "strings") else row.holds(piece)):
                short = piece if len(piece) <= 60 else piece[:57] + "..."
                out.append(MissingText(index, role, part, short))
    return out


# -- marker text inside messages ---------------------------------------------------------------------


@dataclass(frozen=True)
class MarkerText:
    """A message whose text contains the text of a marker or a special token."""

    row: int
    message: int
    role: str
    marker: str  # the marker text found

    def __str__(self) -> str:
        return f"row {self.row}, message {self.message} ({self.role}): contains {self.marker!r}"


def marker_texts(tokenizer: Any, markers: Any = None) -> list[str]:
    """The texts to look for: every special or added token of the tokenizer, and each marker decoded."""
    from ..chat.tokenizer import load_tokenizer

    ct = load_tokenizer(tokenizer)
    texts = {ct.decode([i]) for i in ct.added_ids}
    if markers is not None:
        for patterns in (markers.response, markers.instruction, markers.end, markers.mask_out):
            texts.update(ct.decode(p) for p in patterns)
    # whitespace-only or empty texts match everywhere; surrounding whitespace is the context's
    return sorted({t.strip() for t in texts if t.strip()}, key=lambda t: (-len(t), t))


def find_marker_text(
    conversations: Sequence[Any], tokenizer: Any, markers: Any = None, *, texts: Sequence[str] | None = None
) -> list[MarkerText]:
    """The messages (row, index, role) whose text contains a marker's or a special token's text.

    ``conversations``: lists of messages, or mappings with ``"messages"``. ``markers``: a
    ``lossmask.Markers`` whose decoded patterns are looked for too (plain-text markers such as
    ``[/INST]`` or ``### Response:``). ``texts``: look for these instead. Such rows are safe when
    lossmask renders and tokenises them itself (content is encoded as data); pre-tokenised ids of
    such rows may hold control tokens that a user typed, and their labels cannot be trusted.
    """
    needles = list(texts) if texts is not None else marker_texts(tokenizer, markers)
    hits = []
    for row, conversation in enumerate(conversations):
        messages = conversation.get("messages", ()) if isinstance(conversation, Mapping) else conversation
        for index, message in enumerate(messages or ()):
            if not isinstance(message, Mapping):
                continue
            for _, piece in message_parts(message):
                found = next((n for n in needles if n in piece), None)
                if found is not None:
                    hits.append(MarkerText(row, index, str(message.get("role", "?")), found))
                    break
    return hits
