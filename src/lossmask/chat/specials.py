"""Special-token strings inside message text: which ones stay tokens, and how the rest are encoded as text.

A Hugging Face tokenizer splits every added token out of whatever text it is given, so a user
message holding ``<|im_end|>\\n<|im_start|>assistant\\n`` becomes the control tokens themselves. Like
tiktoken, which refuses special tokens in text unless they are allowed, lossmask encodes them as
ordinary text by default. Which strings count, decided once per tokenizer from its own template
(``ContentTokens.of``):

- **structural** tokens: every token flagged special that the template writes (or the tokenizer's
  BOS/EOS/PAD/UNK), and every added token the template writes outside an assistant turn's body in a
  chat without tools (headers, closings, BOS/EOS: the framing of every turn; community ChatML
  fine-tunes add ``<|im_end|>`` without the special flag). A special token the template never
  writes (LFM2's ``<|tool_call_start|>``, which LFM2 data writes into the reply) can be no marker
  and frames nothing: it stays a token.
  In message text they are encoded as ordinary text (``special_tokens_in_content="text"``). An added
  token not flagged special whose string plain text tokenises to anyway (Gemma's newline runs) is not
  one: encoding it as text changes nothing (``_text_tokenises_to``).
- **body** tokens: added tokens that the template writes only inside an assistant turn's body, after
  the generation prompt (``<think>``/``</think>`` on Qwen3, ``<tool_call>`` on Qwen2.5,
  ``[TOOL_CALLS]`` on Mistral, ``<|channel|>`` on gpt-oss): what the model generates as tokens at
  inference, so they stay tokens in message text too.
- every other added token (Gemma's HTML and whitespace tokens; Qwen2.5's ``<tool_call>``, which its
  template writes only around tool calls and in the tool instructions) is ordinary vocabulary,
  tokenised as it always is.

Encoding as text works on the rendered row (``TextEncoder.encode``): the tokenizer splits added
tokens out before normalisation and pre-tokenisation, so cutting the row at the template's own
structural tokens, emitting their ids, and tokenising the pieces between them with a copy of the
tokenizer that encodes structural tokens as text gives the ids the whole row would get, except
that the message text's special-token strings are text. The copy keeps each piece's prefix-space
handling (a Metaspace ``prepend_scheme="first"`` piece that does not start the row gets none); the
offsets of an added token with ``lstrip``/``rstrip`` already cover the whitespace it swallows.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np


@dataclass(frozen=True)
class ContentTokens:
    """The decision for one tokenizer: ``structural`` (text in content) and ``body`` (tokens) ids.

    ``pattern`` finds structural token strings; ``drops_system``: the template renders no system
    message at all (Phi-3), so a missing system prompt is not a dropped message.
    """

    structural: dict[int, str]
    body: dict[int, str]
    drops_system: bool
    pattern: re.Pattern | None = field(default=None, compare=False)

    @classmethod
    def of(cls, ct: Any) -> "ContentTokens":
        """Render the built-in probes and sort the added tokens by where the template writes them."""
        from .locate import locate_messages
        from .probes import renderable_probes

        added = ct.tokenizer.added_tokens_decoder
        contents = {int(i): str(t.content) for i, t in added.items()}
        inside: set[int] = set()
        outside: set[int] = set()
        framing: set[int] = set()  # outside a body in a chat without tools: every chat's turn framing
        for probe in renderable_probes(ct):
            messages = list(probe.messages)
            text = ct.render(messages, tools=probe.tools)
            located = locate_messages(text, messages)
            bodies = _assistant_bodies(ct, text, messages, probe.tools, located)
            ids, offsets = ct.encode_with_offsets(text)
            for token, (start, end) in zip(ids.tolist(), offsets.tolist()):
                if token not in contents or text[start:end].strip() != contents[token].strip():
                    continue
                if any(s <= start and end <= e for s, e in located.spans):
                    continue  # a probe's own text
                if any(s <= start < e for s, e in bodies):
                    inside.add(token)
                else:
                    outside.add(token)
                    if not probe.tools:
                        framing.add(token)
        controls = {ct.tokenizer.bos_token_id, ct.tokenizer.eos_token_id, ct.tokenizer.pad_token_id,
                    ct.tokenizer.unk_token_id}
        body = {i: contents[i] for i in inside - outside - controls}
        # a special token the template never writes (LFM2's <|tool_call_start|>, which its data puts in the
        # reply itself) is no marker and no framing: it stays a token, as the model generates it
        written = (inside | outside | controls) & set(ct.special_ids)
        structural = {i: contents[i] for i in written | framing if i not in body and i in contents}
        structural = {i: s for i, s in structural.items() if s}
        for i in _text_tokenises_to(ct, {i: s for i, s in structural.items() if i not in set(ct.special_ids)}):
            del structural[i]
        drops_system = _drops_system(ct)
        return cls(structural, body, drops_system, _alternation(structural.values()))

    def find(self, text: str, start: int = 0, end: int | None = None) -> re.Match | None:
        """The first structural token string in ``text[start:end]``."""
        if self.pattern is None:
            return None
        return self.pattern.search(text, start, len(text) if end is None else end)


def _text_tokenises_to(ct: Any, candidates: dict[int, str]) -> set[int]:
    """The added tokens (not flagged special) that their own string, encoded as plain text, gives anyway.

    Gemma's vocabulary holds newline runs (``\n``, ``\n\n``...) as added tokens; its template writes ``\n``
    between turns, so they look like framing. Yet plain text tokenises to the same ids, so encoding them
    as text changes nothing: counting them would call every newline in a message a special-token string
    (and re-encode, drop or refuse nearly every row). Such a token is no control token.
    """
    # Plain text gives only ids of the tokenizer's model (no added token is split out, no post-processor
    # runs), so an added token outside the model's vocabulary (DeepSeek's <｜Assistant｜>, Qwen's
    # <|im_end|>) never qualifies. Asking the model is a lookup; the copy below serialises
    # and parses the whole tokenizer (a second and more for a 128k vocabulary).
    model = getattr(getattr(ct.tokenizer, "backend_tokenizer", None), "model", None)
    if model is not None:
        candidates = {i: s for i, s in candidates.items() if model.id_to_token(i) is not None}
    if not candidates:
        return set()
    from tokenizers import Tokenizer

    data = json.loads(ct.tokenizer.backend_tokenizer.to_str())
    for entry in data.get("added_tokens", []):
        entry["special"] = True  # with encode_special_tokens, no added token is split out: the text alone
    plain = Tokenizer.from_str(json.dumps(data))
    plain.encode_special_tokens = True
    return {i for i, s in candidates.items() if plain.encode(s, add_special_tokens=False).ids == [i]}


def _alternation(strings) -> re.Pattern | None:
    strings = sorted(set(strings), key=len, reverse=True)
    if not strings:
        return None
    by_first: dict[str, list[str]] = {}
    for s in strings:
        by_first.setdefault(s[0], []).append(s[1:])
    # one branch per first character, so that the search dispatches on it
    branches = [re.escape(first) + "(?:" + "|".join(re.escape(rest) for rest in rests) + ")"
                for first, rests in by_first.items()]
    return re.compile("|".join(branches))


def _assistant_bodies(ct, text, messages, tools, located) -> list[tuple[int, int]]:
    """Character ranges of assistant turns' bodies: from where the generation prompt ends to the turn's last text."""
    from .locate import locate_messages

    bodies = []
    for k, message in enumerate(messages):
        if not (isinstance(message, dict) and message.get("role") == "assistant"):
            continue
        try:
            prompt = ct.render(messages[:k], tools=tools, add_generation_prompt=True) if k else ""
        except Exception:  # noqa: BLE001 - a template that cannot render this prefix
            continue
        upto = locate_messages(text, messages[: k + 1]).spans
        end = upto[-1][1] if upto else None
        if not prompt or not text.startswith(prompt) or end is None or end <= len(prompt):
            continue
        bodies.append((len(prompt), end))
    return bodies


def _drops_system(ct) -> bool:
    marker = "lossmask probe system prompt 7f3a"
    try:
        text = ct.render([{"role": "system", "content": marker}, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "ok"}])
    except Exception:  # noqa: BLE001 - a template that refuses system messages (Gemma-2)
        return False
    return marker not in text


class TextEncoder:
    """Encodes rendered rows with message text's structural-token strings as ordinary text."""

    def __init__(self, ct: Any, tokens: ContentTokens):
        from tokenizers import Tokenizer

        self.tokens = tokens
        data = json.loads(ct.tokenizer.backend_tokenizer.to_str())
        for entry in data.get("added_tokens", []):
            entry["special"] = int(entry["id"]) in tokens.structural
        self.first = Tokenizer.from_str(json.dumps(data))
        self.first.encode_special_tokens = True
        self.later = self.first
        if _set_prepend_never(data.get("pre_tokenizer")):
            self.later = Tokenizer.from_str(json.dumps(data))
            self.later.encode_special_tokens = True

    def encode(self, text: str, ids: np.ndarray, offsets: np.ndarray, spans: Sequence[tuple[int, int]]):
        """``(ids, offsets)`` of ``text``, given its ordinary encoding and the message text ``spans``.

        The ordinary encoding's structural tokens outside ``spans`` are the template's own: the row is
        cut there and the pieces between are encoded with the text tokenizer.
        """
        structural = self.tokens.structural
        span_starts = np.asarray([s for s, _ in spans], dtype=np.int64)
        span_ends = np.asarray([e for _, e in spans], dtype=np.int64)
        out_ids: list[np.ndarray] = []
        out_offsets: list[np.ndarray] = []
        cursor = 0

        def piece(upto: int) -> None:
            if upto <= cursor:
                return
            tok = self.first if cursor == 0 else self.later
            enc = tok.encode(text[cursor:upto], add_special_tokens=False)
            out_ids.append(np.asarray(enc.ids, dtype=np.int64))
            out_offsets.append(np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2) + cursor)

        for token, (start, end) in zip(ids.tolist(), offsets.tolist()):
            if token not in structural:
                continue
            k = int(np.searchsorted(span_starts, start, side="right")) - 1
            if k >= 0 and start < span_ends[k]:
                continue  # inside message text: becomes text
            piece(start)
            out_ids.append(np.asarray([token], dtype=np.int64))
            out_offsets.append(np.asarray([[start, end]], dtype=np.int64))
            cursor = end
        piece(len(text))
        if not out_ids:
            return np.zeros(0, np.int64), np.zeros((0, 2), np.int64)
        return np.concatenate(out_ids), np.concatenate(out_offsets)


def _set_prepend_never(pre_tokenizer: Any) -> bool:
    """Turn Metaspace ``prepend_scheme="first"`` into ``"never"`` in place; True when there was one."""
    if not isinstance(pre_tokenizer, dict):
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any([_set_prepend_never(p) for p in pre_tokenizer.get("pretokenizers", [])])
    if pre_tokenizer.get("type") == "Metaspace" and pre_tokenizer.get("prepend_scheme") == "first":
        pre_tokenizer["prepend_scheme"] = "never"
        return True
    return False
