"""The probe conversations: chats built to show what a chat template writes, and where.

Each probe is a small conversation (plain, with a system prompt, multi-turn, tool calls in every
argument form, parallel calls, reasoning) with message texts no template writes itself. Rendering
them tells the template's own text from the messages': marker detection and ``verify`` read the
assistant turns' boundaries off them, and ``specials`` reads which added tokens the template writes
as structure. ``sort_probes`` keeps the ones a template can render.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .render import ChatTemplateError


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
            "a mapping with 'messages' (and 'tools'), or a lossmask.chat.probes.Conversation"
        )


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        # (each parameter described, as real schemas are: Command-R+ writes a parameter's description, and raises
        # without one)
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city's name."}},
                       "required": ["city"]},
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


def vocabulary_probes(ct: Any, headers: Sequence[str], *, turns: int = 8) -> list[Conversation]:
    """Probes for the whitespace tokens of this vocabulary that can merge with a header's edge.

    A header that ends with whitespace (``assistant\n``) merges with a content that starts with
    whitespace into one token (``\n\n``, ``\n    ``) whenever the vocabulary has one; a header that
    starts with whitespace (`` [/INST]``, ``\n\nUser:``) merges with a content that ends with it. Each
    whitespace-only token of the vocabulary that starts (ends) with a header's last (first)
    character gives one assistant content that starts (a user and an assistant content that end)
    with the rest of it, unless the built-in boundary probes already try that string. ``ct``: a
    ``ChatTokenizer``.
    """
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


def renderable_probes(ct: Any) -> list[Conversation]:
    """The built-in probes this template can render (templates raise on a system role, on tools...)."""
    return sort_probes(ct)[0]


def sort_probes(ct: Any) -> tuple[list[Conversation], dict[str, str]]:
    """``(renderable, {name: why not})``: the built-in probes the template renders, and the others.

    ``ct``: a ``ChatTokenizer`` (``load_tokenizer`` makes one from anything). A probe is not renderable
    when the template raises on it, or (tool probes) writes none of its tool calls: a template that
    accepts arguments only as objects, or only as JSON strings, renders the probes of that form only.
    """
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
