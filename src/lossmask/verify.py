"""`verify`: an independent ground truth for "what must be trained", and a check of markers against it.

The ground truth never looks at markers. For each conversation it renders the chat with the
tokenizer's own template and tokenises it as training does (``tokenizer.py``), finds where each
message's text landed (its contents are located in the rendered text in order), and applies the rule
of SPEC.md, "What must be trained" (written out in docs/masking-rule.md):

* an assistant turn starts training where the generation prompt ends: the text that
  ``add_generation_prompt=True`` appends after the previous message is the header, and the header
  is not trained; what the template writes after it (Qwen3's empty ``<think>`` block, gpt-oss's
  ``<|channel|>final<|message|>``, GLM's ``\\n<think></think>\\n``) is generated, so it is trained;
* it stops training after the stop token: the last special token of the turn's own closing text
  (the closing the template writes after the turn both when it is the last message and when
  another follows: ``<|im_end|>``, ``<|eot_id|>``, Llama-2's `` </s>``...); when the turn has no
  closing of its own, the first special token after it (GLM's next role token, gpt-oss's
  ``<|end|>``/``<|return|>``); when there is none before the next message (Falcon), nothing after
  the content is trained;
* a copy of the assistant header inside a turn (gpt-oss writes one per channel) is a header and is
  not trained; everything outside assistant turns (system, user, tool results) is not trained.

A token counts as trained when its first character lies in a trained span. The markers are then
applied with ``make_labels`` and every token is compared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from .content import MissingText, find_marker_text, message_pieces, missing_message_text  # noqa: F401
from .labels import make_labels
from .markers import Markers
from .tokenizer import ChatTemplateError, ChatTokenizer, load_tokenizer


class GroundTruthError(ValueError):
    """The rule could not be applied to a conversation (a message could not be located...)."""


class ContentDroppedError(GroundTruthError):
    """The template dropped or rewrote a message's text: the row is not the conversation it was given."""

    def __init__(self, name: str, dropped: Sequence[MissingText]):
        self.dropped = tuple(dropped)
        shown = "; ".join(str(d) for d in self.dropped[:3]) + (f"; and {len(self.dropped) - 3} more" if len(self.dropped) > 3 else "")
        super().__init__(
            f"{name}: the chat template dropped or rewrote message text, so the row is not the conversation it was "
            f"given and is not labelled: {shown}"
        )


# -- conversations ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Conversation:
    """A named conversation: messages, and the tools offered to the template (or None)."""

    name: str
    messages: tuple[Mapping[str, Any], ...]
    tools: tuple[Mapping[str, Any], ...] | None = None

    @classmethod
    def coerce(cls, obj: Any, index: int) -> "Conversation":
        if isinstance(obj, Conversation):
            return obj
        if isinstance(obj, Mapping):
            if "messages" not in obj:
                raise TypeError(f"conversation {index} is a mapping without 'messages' (keys: {sorted(obj)})")
            tools = obj.get("tools")
            return cls(str(obj.get("name", f"conversation {index}")), tuple(obj["messages"]), tuple(tools) if tools else None)
        if isinstance(obj, Sequence) and not isinstance(obj, (str, bytes)):
            return cls(f"conversation {index}", tuple(obj))
        raise TypeError(
            f"conversation {index} is a {type(obj).__name__}; pass a list of messages, "
            "a mapping with 'messages' (and 'tools'), or a lossmask.verify.Conversation"
        )


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _assistant(content: str, reasoning: str | None = None) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:  # Qwen3/GLM read reasoning_content, gpt-oss/SmolLM3 read thinking
        message["reasoning_content"] = reasoning
        message["thinking"] = reasoning
    return message


def probe_conversations(*, system: bool = True, tools: bool = True, reasoning: bool = True) -> list[Conversation]:
    """The built-in probes: multi-turn, with and without system, whitespace, Unicode, tools, reasoning.

    Every content is unique, so that the ground truth can find each message in the rendered text.
    Callers drop the probes a template cannot render (see ``renderable_probes``).
    """
    user, assistant = (lambda text: {"role": "user", "content": text}), _assistant
    probes = [
        Conversation("single", (user("Say hello."), assistant("Hello there!"))),
        Conversation("plain", (
            user("What is the capital of France?"), assistant("Paris."),
            user("And of Spain?"), assistant("Madrid, of course!"),
            user("Thanks"), assistant("You are welcome 3"),
        )),
        Conversation("whitespace", (
            user("  leading spaces and a trailing newline\n"), assistant("  Two leading spaces, a trailing space "),
            user("\n\nnew lines\naround\n\n"), assistant("\nline one\nline two\n"),
            user("tab\tin the middle."), assistant("ends with two newlines\n\n"),
        )),
        Conversation("leading", (
            user("one"), assistant(" one leading space"),
            user("two"), assistant("\n\nstarts with two newlines"),
            user("three"), assistant("   three leading spaces"),
            user("four"), assistant("\tstarts with a tab"),
            user("five"), assistant(" \nspace then newline"),
        )),
        Conversation("unicode", (
            user("Ünïcödé — 日本語で答えて？"), assistant("はい、日本語です。🙂"),
            user("Ça va? ¿Qué tal? Привет"), assistant("Très bien — Всё хорошо ✓"),
        )),
        Conversation("code", (
            user("Write x=1 in Python:"), assistant("```python\nx = 1\nprint(x)\n```"),
            user("[brackets] {braces} <angles>"), assistant("<tag>[1]</tag> {\"k\": 2}"),
        )),
    ]
    probes += _boundary_probes()
    if system:
        probes += [
            Conversation("system", (
                {"role": "system", "content": "You are terse and exact."},
                user("Name a colour."), assistant("Blue."),
                user("Another one?"), assistant("Green, then."),
            )),
        ]
    if reasoning:
        probes += [
            Conversation("reasoning", (
                user("Is 7 prime?"), assistant("Yes, 7 is prime.", "Seven has no divisor but 1 and itself."),
                user("Is 9 prime?"), assistant("No: 9 = 3 x 3.", "Nine is three times three."),
            )),
        ]
    if reasoning:
        probes += [
            Conversation("reasoning-in-content", (  # R1-style datasets: templates parse </think> out
                user("Is 11 prime?"), assistant("<think>\nEleven has no divisor.\n</think>\n\nYes, 11 is prime."),
                user("Is 15 prime?"), assistant("<think>\nFifteen is three times five.\n</think>\n\nNo: 15 = 3 x 5."),
            )),
        ]
    if tools:
        for form in ("object", "json"):
            probes += _tool_probes(form)
    return probes


_COUNTRY = {"Oslo": "NO", "Bergen": "NO", "Rome": "IT", "Lima": "PE", "Cairo": "EG", "Quito": "EC"}


def _tool_call(call_id: str, city: str, form: str) -> dict:
    # the argument value occurs nowhere else in the conversation, so that a dropped call shows
    arguments: Any = {"city": f"{city}, {_COUNTRY[city]}"}
    if form == "json":
        arguments = json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def _tool_probes(form: str) -> list[Conversation]:
    """A single and a parallel tool call, each followed by its results, a final answer and one more turn.

    ``form``: the tool-call arguments as an ``"object"`` or as a ``"json"`` string; templates accept
    one or the other (DeepSeek-V3 concatenates a string, Llama-3.1 serialises an object)."""
    user, assistant, suffix = (lambda text: {"role": "user", "content": text}), _assistant, "" if form == "object" else "-json"
    city = "Oslo" if form == "object" else "Bergen"
    single = Conversation(f"tool{suffix}", (
        user(f"What is the weather in {city}?"),
        {"role": "assistant", "content": "", "tool_calls": [_tool_call("call12345", city, form)]},
        {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": "minus three, snowing"},
        assistant(f"It is -3 °C and snowing in {city}."),
        user("And tomorrow?"), assistant("I cannot see tomorrow's forecast."),
    ), (WEATHER_TOOL,))
    first, second = ("Rome", "Lima") if form == "object" else ("Cairo", "Quito")
    parallel = Conversation(f"parallel-tools{suffix}", (
        user(f"Weather in {first} and in {second}?"),
        {"role": "assistant", "content": "", "tool_calls": [
            _tool_call("call23456", first, form), _tool_call("call34567", second, form)]},
        {"role": "tool", "tool_call_id": "call23456", "name": "get_weather", "content": "twenty-one, sunny"},
        {"role": "tool", "tool_call_id": "call34567", "name": "get_weather", "content": "fourteen, cloudy"},
        assistant(f"{first}: 21 °C and sunny; {second}: 14 °C and cloudy."),
        user("Which is warmer?"), assistant(f"{first} is warmer."),
    ), (WEATHER_TOOL,))
    return [single, parallel]


# The kinds of conversation ``lossmask detect`` and docs/conformance.md report, and the probes of each.
KINDS = ("plain", "system", "multi-turn", "tools", "parallel tools", "reasoning")


def probe_kind(name: str) -> str:
    """The kind of a built-in probe, by its name."""
    if name == "single":
        return "plain"
    if name == "system":
        return "system"
    if name.startswith("parallel-tools"):
        return "parallel tools"
    if name.startswith("tool"):
        return "tools"
    if name.startswith("reasoning"):
        return "reasoning"
    return "multi-turn"


def _boundary_whitespace() -> list[str]:
    """Whitespace that can merge with a header's last token or a closing's first one."""
    out = []
    for a in " \n\t":
        out.append(a)
        for b in " \n\t":
            out.append(a + b)
            out += [a + b + c for c in " \n"]
    out += [" " * k for k in range(4, 9)] + ["\n" * k for k in range(4, 7)]
    out += ["\n" + " " * k for k in (3, 4, 6, 8)] + ["\n\n" + " " * k for k in (2, 4)] + ["\r\n", "\r\n\r\n"]
    return list(dict.fromkeys(out))


def _boundary_probes(turns: int = 8) -> list[Conversation]:
    """Assistant contents that start, and user contents that end, with every whitespace run above.

    Where a template does not trim, such whitespace merges with the header's last token or the
    next header's first one, and each merge is another in-context variant to find.
    """
    runs = _boundary_whitespace()
    probes = []
    for first in range(0, len(runs), turns):
        messages: list[dict] = []
        for k, ws in enumerate(runs[first : first + turns], start=first):
            messages.append({"role": "user", "content": f"boundary question {k}{ws}"})
            messages.append(_assistant(f"{ws}boundary answer {k}{ws}"))
        probes.append(Conversation(f"boundary-{first // turns}", tuple(messages)))
    return probes


_WHITESPACE_TOKEN_CHARS = frozenset(" \n\t\rĠĊĉč▁")  # raw and byte-level / SentencePiece spellings


def vocabulary_probes(tokenizer: Any, headers: Sequence[str], *, turns: int = 8) -> list[Conversation]:
    """Probes for the whitespace tokens of this vocabulary that can merge with a header's edge.

    A header that ends with whitespace (``assistant\n``) merges with a content that starts with
    whitespace into one token (``\n\n``, ``\n    ``) whenever the vocabulary has one; a header that
    starts with whitespace (`` [/INST]``, ``\n\nUser:``) merges with a content that ends with it. Each
    whitespace-only token of the vocabulary that starts (ends) with a header's last (first)
    character gives one assistant content that starts (a user and an assistant content that end)
    with the rest of it, unless the built-in boundary probes already try that string.
    """
    ct = load_tokenizer(tokenizer)
    ends = {h[-1] for h in headers if h and h[-1].isspace()}
    starts = {h[0] for h in headers if h and h[0].isspace()}
    if not ends and not starts:
        return []
    vocab = ct.tokenizer.get_vocab()
    ids = [i for t, i in vocab.items() if t and all(c in _WHITESPACE_TOKEN_CHARS for c in t)]
    ids += [vocab[t] for t in ("<0x0A>", "<0x09>", "<0x0D>") if t in vocab]
    texts = {ct.tokenizer.decode([i]) for i in ids}
    known = set(_boundary_whitespace())
    leading = sorted({t[1:] for t in texts for c in ends if len(t) > 1 and t.startswith(c) and not t.strip()} - known)
    trailing = sorted({t[:-1] for t in texts for c in starts if len(t) > 1 and t.endswith(c) and not t.strip()} - known)
    pairs = [(lead, "") for lead in leading] + [("", trail) for trail in trailing]
    probes = []
    for first in range(0, len(pairs), turns):
        messages: list[dict] = []
        for k, (lead, trail) in enumerate(pairs[first : first + turns], start=first):
            messages.append({"role": "user", "content": f"vocabulary question {k}{trail}"})
            messages.append(_assistant(f"{lead}vocabulary answer {k}{trail}"))
        probes.append(Conversation(f"vocabulary-{first // turns}", tuple(messages)))
    return probes


# -- locating messages in rendered text --------------------------------------------------------


def _pieces(message: Mapping[str, Any]) -> list[str]:
    """The texts of one message that a template copies verbatim: reasoning, content, tool calls."""
    return [text for _, text in message_pieces(message)]


def locate_messages(
    text: str, messages: Sequence[Mapping[str, Any]], *, stripped: bool = False
) -> list[tuple[int, int] | None]:
    """``(start, end)`` of each message's verbatim pieces in ``text``, searched in order; None when absent.

    A piece is looked for as written, then stripped (templates that trim). A message whose pieces
    are all absent (a dropped system prompt, stripped reasoning) is None and the search goes on.
    ``stripped=True`` looks for the stripped pieces only: a piece's trailing whitespace may be the
    template's own (Falcon trims contents and then writes ``\n\n``).
    """
    spans: list[tuple[int, int] | None] = []
    cursor = 0
    for message in messages:
        found: list[tuple[int, int]] = []
        for piece in _pieces(message):
            # pieces usually come in this order (reasoning, content, tool calls): look after the
            # previous one first, so that a piece repeated inside another is not taken for it
            after = found[-1][1] if found else cursor
            at = _find(text, piece, after, stripped)
            if at is None and after != cursor:
                at = _find(text, piece, cursor, stripped)
            if at is not None:
                found.append(at)
        if found:
            span = (min(a for a, _ in found), max(b for _, b in found))
            spans.append(span)
            cursor = span[1]
        else:
            spans.append(None)
    return spans


def _find(text: str, piece: str, start: int, stripped: bool = False) -> tuple[int, int] | None:
    for candidate in (piece.strip(),) if stripped else (piece, piece.strip()):
        at = text.find(candidate, start)
        if at >= 0:
            return at, at + len(candidate)
    return None


# -- the ground truth ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    """One assistant turn of a rendered conversation, in characters of the rendered text."""

    message: int  # index in the conversation
    header: str  # the text the generation prompt supplies (not trained)
    start: int  # first trained character (where the generation prompt ends)
    end: int  # one past the last trained character (the end of the stop token)
    stop: int | None  # token index of the stop token, None when the turn has none
    next_start: int  # where the next located message starts (len(text) when none follows)


@dataclass(frozen=True)
class GroundTruth:
    """A rendered, tokenised conversation and, per token, whether the rule trains it."""

    name: str
    text: str
    ids: np.ndarray
    offsets: np.ndarray
    should_train: np.ndarray  # bool per token
    turns: tuple[Turn, ...]
    # trained tokens that no marker set can train: a copy of the assistant header inside a turn
    # (gpt-oss writes '<|start|>assistant' again between the analysis and the final channel; the
    # model generates it, but it is token for token the header that opens a turn)
    header_copies: np.ndarray | None = field(default=None, repr=False, compare=False)
    dropped: tuple[MissingText, ...] = ()  # reasoning the template dropped (earlier turns on Qwen3, gpt-oss)


def _last_located(spans: Sequence[tuple[int, int] | None]) -> int | None:
    for index in range(len(spans) - 1, -1, -1):
        if spans[index] is not None:
            return index
    return None


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def ground_truth(tokenizer: Any, conversation: Any) -> GroundTruth:
    """Render ``conversation`` and decide, from the rule alone, which tokens must be trained."""
    ct = load_tokenizer(tokenizer)
    conv = Conversation.coerce(conversation, 0)
    messages, tools = list(conv.messages), conv.tools
    text = ct.render(messages, tools=tools)
    missing = missing_message_text(text, messages)
    lost = [m for m in missing if m.part != "reasoning"]
    if lost:
        raise ContentDroppedError(conv.name, lost)
    ids, offsets = ct.encode_with_offsets(text)
    spans = locate_messages(text, messages)
    stripped_spans = locate_messages(text, messages, stripped=True)
    special = np.fromiter((int(t) in ct.special_ids for t in ids), dtype=bool, count=len(ids))
    added = np.fromiter((int(t) in ct.added_ids for t in ids), dtype=bool, count=len(ids))
    starts = offsets[:, 0]

    assistant_turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    turns: list[Turn] = []
    closings: list[str] = []  # per-turn closings seen in this conversation (with a special token)
    pending_last: list[tuple[int, int, str, int]] = []
    for i in assistant_turns:
        start, header = _turn_start(ct, conv, messages, i, text, spans, stripped_spans, offsets, special)
        # look for the turn's own text after its header (content may repeat header text: 'assistant')
        span = _shift(locate_messages(text[start:], [messages[i]], stripped=True)[0], start)
        if span is None and _pieces(messages[i]):
            # the template rewrote the reply (Falcon turns blank lines into single newlines): what it
            # renders is not the message, so no truth can be read off it; say so rather than guess
            raise GroundTruthError(
                f"{conv.name}: the text of assistant message {i} does not occur in the rendered conversation "
                "(the template rewrites it), so its ground truth cannot be established"
            )
        content_end = span[1] if span is not None else start
        content_end = max(content_end, start)
        following = next((spans[j] for j in range(i + 1, len(messages)) if spans[j] is not None), None)
        if following is not None:
            # the closing the template writes for this turn both as the last message and mid-chat
            alone = ct.render(messages[: i + 1], tools=tools)
            alone_span = locate_messages(alone, messages[: i + 1], stripped=True)[i]
            alone_end = alone_span[1] if alone_span is not None else len(alone)
            between = text[content_end : following[0]]
            closing = between[: _common_prefix(alone[alone_end:], between)]
            stop = _last_special(special, offsets, content_end, content_end + len(closing))
            if stop is None:  # no end-of-turn token of its own: the first special token that follows stops it
                stop = _first_special(special, starts, content_end, following[0])
            if stop is None:  # an end-of-turn token added without the special flag (community ChatML)
                stop = _last_special(added, offsets, content_end, content_end + len(closing))
            if stop is not None and offsets[stop, 1] <= content_end + len(closing):
                closings.append(closing)
            turns.append(_make_turn(i, header, start, content_end, stop, offsets, following[0]))
        else:
            pending_last.append((i, start, header, content_end))
    for i, start, header, content_end in pending_last:  # the last turn: end of text follows
        rest = text[content_end:]
        known = [c for c in closings if rest.startswith(c)]
        if known:
            hi = content_end + len(max(known, key=len))
            stop = _last_special(special, offsets, content_end, hi)
            if stop is None:
                stop = _last_special(added, offsets, content_end, hi)
        else:
            stop = _first_special(special, starts, content_end, len(text))
            if stop is None:  # an end-of-turn token added without the special flag
                stop = _first_special(added, starts, content_end, len(text))
        turns.append(_make_turn(i, header, start, content_end, stop, offsets, len(text)))

    should = np.zeros(len(ids), dtype=bool)
    copies = np.zeros(len(ids), dtype=bool)
    for turn in turns:
        inside = (starts >= turn.start) & (starts < turn.end)
        should |= inside
        if turn.header:  # a copy of the header inside the turn was generated (gpt-oss channels): trained
            at = text.find(turn.header, turn.start)
            while 0 <= at < turn.end:
                copies |= inside & (starts >= at) & (starts < at + len(turn.header))
                at = text.find(turn.header, at + len(turn.header))
    return GroundTruth(conv.name, text, ids, offsets, should, tuple(sorted(turns, key=lambda t: t.start)),
                       header_copies=copies, dropped=tuple(missing))


def _shift(span: tuple[int, int] | None, by: int) -> tuple[int, int] | None:
    return None if span is None else (span[0] + by, span[1] + by)


def _make_turn(message, header, start, content_end, stop, offsets, next_start) -> Turn:
    end = int(offsets[stop, 1]) if stop is not None else content_end
    return Turn(message, header, start, max(end, start), stop, next_start)


def _last_special(special, offsets, lo, hi) -> int | None:
    hits = np.flatnonzero(special & (offsets[:, 0] >= lo) & (offsets[:, 1] <= hi))
    return int(hits[-1]) if hits.size else None


def _first_special(special, starts, lo, hi) -> int | None:
    hits = np.flatnonzero(special & (starts >= lo) & (starts < hi))
    return int(hits[0]) if hits.size else None


def _anchor(prompt: str, before, text: str, spans, stripped_spans) -> tuple[int | None, int, int, bool]:
    """``(message, end in prompt, end in text, stripped)``: the last message of the generation prompt
    found in both renderings, where the prompt's tail follows it in the chat when possible.

    Tried in order: the messages as written (a content's trailing whitespace, when the template
    keeps it, belongs to the content, not to the header after it); stripped (a trimmed edge that
    coincides with template text in one rendering only); then any occurrence of the anchor's text
    that the tail follows (the in-order search took a look-alike, e.g. a dropped system prompt that
    a later message quotes). ``end in text`` is -1 when the anchor is nowhere in the chat.
    """
    fallback = None
    for stripped, chat_spans in ((False, spans), (True, stripped_spans)):
        prompt_spans = locate_messages(prompt, before, stripped=stripped)
        anchor = _last_located(prompt_spans)
        if anchor is None:
            return None, 0, 0, stripped
        prompt_at = prompt_spans[anchor][1]
        tail = prompt[prompt_at:]
        if chat_spans[anchor] is not None and text.startswith(tail, chat_spans[anchor][1]):
            return anchor, prompt_at, chat_spans[anchor][1], stripped
        anchor_text = prompt[prompt_spans[anchor][0] : prompt_at]
        at = text.find(anchor_text)
        while at >= 0:
            if text.startswith(tail, at + len(anchor_text)):
                return anchor, prompt_at, at + len(anchor_text), stripped
            at = text.find(anchor_text, at + 1)
        if fallback is None:  # no tail match anywhere: the prefill case, decided by the caller
            fallback = (anchor, prompt_at, chat_spans[anchor][1] if chat_spans[anchor] is not None else -1, stripped)
    return fallback


def _turn_start(
    ct: ChatTokenizer, conv: Conversation, messages, i: int, text: str, spans, stripped_spans, offsets, special
) -> tuple[int, str]:
    """Where assistant turn ``i`` starts training in ``text``, and the header text before it."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    before = messages[:i]
    try:
        # an opening assistant turn (a greeting) has the generation prompt of an empty chat
        prompt = ct.render(before, tools=conv.tools, add_generation_prompt=True)
        no_prompt = ct.render(before, tools=conv.tools, add_generation_prompt=False)
    except ChatTemplateError as exc:
        raise GroundTruthError(
            f"the template cannot render the generation prompt before message {i}: {exc}"
        ) from exc
    anchor, prompt_at, text_at, stripped = _anchor(prompt, before, text, spans, stripped_spans)
    tail = prompt[prompt_at:]
    if text_at < 0:
        raise GroundTruthError(
            f"message {anchor} ({messages[anchor].get('role')}) is in the generation prompt before message {i} "
            "but could not be found in the rendered chat"
        )
    if prompt == no_prompt and not tail:
        raise GroundTruthError(
            f"the template writes nothing after message {i - 1} even with add_generation_prompt=True "
            "(it has no generation prompt), so where an assistant turn starts cannot be told from the template"
        )
    if prompt == no_prompt and spans[i] is not None and not messages[i].get("tool_calls"):
        gap = text[text_at + len(tail) : spans[i][0]]
        if gap.replace("<think>", "", 1).strip():  # R1-style content starts with its own <think>
            raise GroundTruthError(
                f"add_generation_prompt=True adds nothing after message {i - 1}, and the rendered "
                f"chat has {gap!r} between there and the assistant's content: the template has no generation "
                "prompt, so the assistant header cannot be told from what the model generates"
            )
    located = locate_messages(no_prompt, before, stripped=stripped)
    no_prompt_anchor = located[anchor][1] if anchor is not None and located[anchor] else 0
    added_at = _common_prefix(tail, no_prompt[no_prompt_anchor:])  # where add_generation_prompt's text begins
    if text.startswith(tail, text_at):
        start = text_at + len(tail)
    else:
        # The prompt ends with a prefill this turn does not have (Qwen3 with enable_thinking=False
        # writes '<think>\n\n</think>\n\n' in the prompt and in the last turn only): accepted when the
        # turn's own text starts right where the two part, after some of the header.
        shared = _common_prefix(tail, text[text_at:])
        # part at a token boundary of the prompt ('<think>' and '<tool_call>' share '<t')
        _, prompt_offsets = ct.encode_with_offsets(prompt)
        boundaries = prompt_offsets[:, 0][prompt_offsets[:, 0] <= prompt_at + shared]
        if boundaries.size:
            shared = max(0, min(shared, int(boundaries.max()) - prompt_at))
        own = spans[i][0] if spans[i] is not None else None
        gap = text[text_at + shared : own] if own is not None else ""
        if own is None or shared <= added_at or (gap.strip() and not messages[i].get("tool_calls")):
            raise GroundTruthError(
                f"the generation prompt before message {i} ends {tail!r}, but the rendered chat "
                f"continues {text[text_at:text_at + len(tail) + 20]!r}; the template renders the turn boundary "
                "differently with add_generation_prompt=True"
            )
        start = text_at + shared
    header_at = text_at + added_at
    if header_at == start:
        # add_generation_prompt adds nothing (Llama-2, Mistral, Phi-3: the user turn writes the cue):
        # the header is the tail from its last special token on, or the whole tail
        header_at = text_at
        inside = np.flatnonzero((starts >= text_at) & (starts < start) & special)
        if inside.size:
            header_at = int(starts[inside[-1]])
    else:
        # a common prefix may end inside a token ('<|end|>\n<|' shared by '<|assistant|>' and
        # '<|endoftext|>'): the header starts at the start of that token
        covering = np.flatnonzero((starts < header_at) & (ends > header_at) & (starts >= text_at))
        if covering.size:
            header_at = int(starts[covering[0]])
    return start, text[header_at:start]


# -- the check -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConversationReport:
    """One conversation: tokens checked, and where markers and the ground truth disagree."""

    name: str
    tokens: int
    expected_trained: int
    missing: tuple[int, ...] = ()  # token positions that should be trained and are not
    extra: tuple[int, ...] = ()  # token positions that are trained and should not be
    error: str | None = None  # the ground truth could not be built
    truth: GroundTruth | None = field(default=None, repr=False, compare=False)
    labels: np.ndarray | None = field(default=None, repr=False, compare=False)
    # what the template dropped: message text (the conversation is then not checked, ``error`` says so),
    # or reasoning of earlier turns (checked as rendered)
    dropped: tuple[MissingText, ...] = ()
    # trained tokens no marker set can train (a header copy inside a turn, gpt-oss); not counted as missing
    beyond_markers: tuple[int, ...] = ()

    @property
    def exact(self) -> bool:
        return self.error is None and not self.missing and not self.extra


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify`` found: per conversation, and in total. ``ok`` when every token agrees."""

    tokenizer: str
    markers: Markers
    conversations: tuple[ConversationReport, ...]
    decode: Any = field(default=None, repr=False, compare=False)
    notes: tuple[str, ...] = ()  # what the user should know about these markers (from detection)
    # per kind of conversation (from detection): (kind, "exact" or "not rendered", detail)
    kinds: tuple[tuple[str, str, str], ...] = ()

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.conversations)

    @property
    def missing(self) -> int:
        return sum(len(c.missing) for c in self.conversations)

    @property
    def extra(self) -> int:
        return sum(len(c.extra) for c in self.conversations)

    @property
    def errors(self) -> int:
        return sum(c.error is not None for c in self.conversations)

    @property
    def beyond_markers(self) -> int:
        return sum(len(c.beyond_markers) for c in self.conversations)

    @property
    def dropped(self) -> tuple[tuple[str, MissingText], ...]:
        """``(conversation, what)`` for every message text the template dropped."""
        return tuple((c.name, d) for c in self.conversations for d in c.dropped)

    @property
    def ok(self) -> bool:
        return bool(self.conversations) and all(c.exact for c in self.conversations)

    def __bool__(self) -> bool:
        return self.ok

    def summary(self) -> str:
        if not self.conversations:
            return "nothing checked: no conversations"
        verdict = "exact" if self.ok else "MISMATCH"
        text = (
            f"{verdict}: {len(self.conversations)} conversations, {self.tokens} tokens checked, "
            f"{self.missing} missing (should be trained, are not), {self.extra} extra (trained, should not be)"
        )
        if self.errors:
            text += f", {self.errors} not checkable"
        if self.beyond_markers:
            text += (f"; {self.beyond_markers} trained tokens no marker can train (a copy of the assistant header "
                     "inside a turn), so they are not trained")
        return text

    def __str__(self) -> str:
        lines = [f"verify {self.tokenizer}: {self.summary()}"]
        lines += [f"  note: {note}" for note in self.notes]
        lines += [f"  {kind}: {status}" + (f" ({detail})" if detail else "") for kind, status, detail in self.kinds]
        for c in self.conversations:
            if c.error is not None:
                lines.append(f"  {c.name}: not checked: {c.error}")
                continue
            reasoning = sorted({d.message for d in c.dropped if d.part == "reasoning"})
            dropped = f"; the template dropped the reasoning of message {', '.join(map(str, reasoning))}" if reasoning else ""
            if not c.exact:
                lines.append(f"  {c.name}: {len(c.missing)} missing, {len(c.extra)} extra of {c.tokens} tokens{dropped}")
                lines += ["    " + line for line in _describe(c, self.decode)]
            else:
                beyond = f", {len(c.beyond_markers)} beyond any marker" if c.beyond_markers else ""
                lines.append(f"  {c.name}: exact ({c.expected_trained} of {c.tokens} tokens trained{beyond}){dropped}")
        return "\n".join(lines)


def _describe(report: ConversationReport, decode, *, limit: int = 3) -> list[str]:
    """A few mismatches, each with the tokens around it; [trained] tokens in brackets, ^ marks the bad one."""
    if report.truth is None or report.labels is None or decode is None:
        return []
    ids = report.truth.ids
    trained = report.labels != -100
    lines = []
    for kind, positions in (("missing", report.missing), ("extra", report.extra)):
        for pos in positions[:limit]:
            lo, hi = max(0, pos - 6), min(len(ids), pos + 5)
            parts = []
            for k in range(lo, hi):
                token = repr(decode([int(ids[k])]))[1:-1]
                token = f"[{token}]" if trained[k] else token
                parts.append(f"^{token}" if k == pos else token)
            lines.append(f"{kind} at token {pos}: {' '.join(parts)}")
        if len(positions) > limit:
            lines.append(f"... and {len(positions) - limit} more {kind}")
    return lines


class Unchecked(NamedTuple):
    """A conversation whose ground truth could not be built: why, and what the template dropped."""

    name: str
    error: str
    dropped: tuple[MissingText, ...] = ()


def check(tokenizer: Any, markers: Markers, truths: Sequence[GroundTruth | tuple]) -> VerifyReport:
    """Compare ``make_labels`` under ``markers`` with ground truths already built (or their errors)."""
    ct = load_tokenizer(tokenizer)
    reports = []
    rows = [t for t in truths if isinstance(t, GroundTruth)]
    labels = make_labels([t.ids.tolist() for t in rows], markers) if rows else []
    by_truth = iter(labels)
    for t in truths:
        if not isinstance(t, GroundTruth):
            name, error, *rest = t
            reports.append(ConversationReport(name, 0, 0, error=error, dropped=tuple(rest[0]) if rest else ()))
            continue
        got = np.asarray(next(by_truth), dtype=np.int64)
        trained = got != -100
        copies = t.header_copies if t.header_copies is not None else np.zeros(len(t.ids), dtype=bool)
        missing = tuple(int(k) for k in np.flatnonzero(t.should_train & ~trained & ~copies))
        beyond = tuple(int(k) for k in np.flatnonzero(t.should_train & ~trained & copies))
        extra = tuple(int(k) for k in np.flatnonzero(trained & ~t.should_train))
        reports.append(ConversationReport(t.name, len(t.ids), int(t.should_train.sum()), missing, extra, truth=t,
                                          labels=got, dropped=t.dropped, beyond_markers=beyond))
    return VerifyReport(ct.name, markers, tuple(reports), decode=ct.decode)


def build_truths(tokenizer: Any, conversations: Sequence[Any]) -> list[GroundTruth | Unchecked]:
    """The ground truth of each conversation, or ``Unchecked(name, error, dropped)`` where it cannot be built."""
    ct = load_tokenizer(tokenizer)
    out: list[GroundTruth | tuple[str, str]] = []
    for index, obj in enumerate(conversations):
        conv = Conversation.coerce(obj, index)
        try:
            out.append(ground_truth(ct, conv))
        except (GroundTruthError, ChatTemplateError) as exc:
            out.append(Unchecked(conv.name, str(exc), getattr(exc, "dropped", ())))
    return out


def renderable_probes(tokenizer: Any) -> list[Conversation]:
    """The built-in probes this template can render (templates raise on a system role, on tools...)."""
    return sort_probes(tokenizer)[0]


def sort_probes(tokenizer: Any) -> tuple[list[Conversation], dict[str, str]]:
    """``(renderable, {name: why not})``: the built-in probes the template renders, and the others.

    A probe is not renderable when the template raises on it, or (tool probes) writes none of its
    tool calls: a template that accepts arguments only as objects, or only as JSON strings, renders
    the probes of that form only.
    """
    ct = load_tokenizer(tokenizer)
    kept, skipped = [], {}
    for probe in probe_conversations():
        try:
            text = ct.render(probe.messages, tools=probe.tools)
        except ChatTemplateError as exc:
            skipped[probe.name] = f"the template raised: {str(exc).split(': ', 1)[-1][:160]}"
            continue
        if probe.tools:
            calls = [call["function"]["name"] for m in probe.messages for call in m.get("tool_calls") or ()]
            if text.split(probe.messages[0]["content"], 1)[-1].count("get_weather") < 1 and calls:
                skipped[probe.name] = "the template writes no tool call (it ignores tool_calls)"
                continue
        kept.append(probe)
    return kept, skipped


def verify(tokenizer: Any, markers: Markers, conversations: Sequence[Any] | None = None) -> VerifyReport:
    """Check ``markers`` against the ground truth on ``conversations`` (default: the built-in probes).

    ``tokenizer``: anything ``lossmask.load_tokenizer`` accepts. ``conversations``: lists of
    messages, or mappings with ``"messages"`` (and ``"tools"``). Returns a ``VerifyReport``:
    ``report.ok``, totals, and per conversation the missing and extra token positions. A conversation
    the template drops message text of (Phi-3 drops tool messages, Qwen2.5 a message with an unknown
    role) is not checked: ``report.dropped`` names the message (index and role). To find rows whose
    messages quote a marker's text (pre-tokenised ids of such rows cannot be trusted), use
    ``lossmask.find_marker_text``.
    """
    if not isinstance(markers, Markers):
        raise TypeError(f"markers must be a lossmask.Markers, got {type(markers).__name__}")
    ct = load_tokenizer(tokenizer)
    if conversations is None:  # the probes; those the template drops a message of render no kind to check
        truths = [t for t in build_truths(ct, renderable_probes(ct)) if not (isinstance(t, Unchecked) and t.dropped)]
        return check(ct, markers, truths)
    return check(ct, markers, build_truths(ct, conversations))
