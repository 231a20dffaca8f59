"""Labels from the rendering with each turn rendered from a short context equal those rendered from the row's start.

``chat.turn_spans`` renders each assistant turn's prompt and through from the system message, the turn's last user
message and the messages since the last assistant message, and uses them where the part of the history they rewrite is
the row's text exactly; else it renders the turn from the row's start, as it did for every turn before. The renders
from the row's start are the reference here (``_SHORT_CONTEXTS = False``, reachable by no option): on every template
of llama.cpp's collection, for every kind of chat the collection's tests use (plain, system, a user quoting the
template's header, a call with its result, parallel calls, reasoning as a field and as ``<think>`` text, system +
tools) and long agent traces (users, replies, reasoning, single and parallel calls), both give the same labels, or
both none. One test per template covers all its chats.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
import template_collection as collection  # noqa: E402
from test_template_collection import NAMES, _folder  # noqa: E402

sys.path.pop(0)

import lossmask  # noqa: E402
from lossmask.chat import turn_spans  # noqa: E402


def _labels(ct, messages, tools, ids, short: bool, monkeypatch):
    monkeypatch.setattr(turn_spans, "_SHORT_CONTEXTS", short)
    found = []
    for last_turn_only in (False, True):
        trained, why = turn_spans.label_row_from_rendering(ct, messages, ids, tools=tools, last_turn_only=last_turn_only)
        found.append(None if trained is None else trained.tolist())
    return found


def _chats(tok) -> list[tuple[str, list, list | None]]:
    chats = [("chat", c, None) for c in collection.chats_for(tok)]
    for kind in collection.agent_chats():
        chat = collection.agent_chat(tok, kind)
        if chat is not None:
            chats.append((kind, *chat))
    for users_every in (9, 200):  # users now and then, and one user before a long run of calls
        for as_json in (False, True):
            messages, tools = collection.agent_trace(48, as_json=as_json, users_every=users_every)
            if collection.render(tok, messages, tools=tools) is not None:
                chats.append((f"trace, a user every {users_every}", messages, tools))
                break
    for as_json in (False, True):  # calls after one user message: the tool result before each call is in its context
        messages, tools = collection.call_trace(10, as_json=as_json)
        if collection.render(tok, messages, tools=tools) is not None:
            chats.append(("calls after one user", messages, tools))
            break
    return chats


@pytest.mark.parametrize("name", NAMES)
def test_turns_rendered_from_a_short_context_label_as_renders_from_the_row_start(name, monkeypatch):
    tok = collection.tokenizer_for((_folder() / f"{name}.jinja").read_text(encoding="utf-8"))
    ct = lossmask.load_tokenizer(tok)
    chats = _chats(tok)
    if not chats:
        pytest.skip(f"transformers renders none of the chats with {name}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        encoded = ct.encode_chats([{"messages": m, "tools": t} for _, m, t in chats])
    for (kind, messages, tools), ids in zip(chats, encoded.input_ids.to_pylist()):
        if ids is None:
            continue
        ids = np.asarray(ids)
        short = _labels(ct, messages, tools, ids, True, monkeypatch)
        reference = _labels(ct, messages, tools, ids, False, monkeypatch)
        assert short == reference, (name, kind)


def test_a_long_trace_renders_each_turn_from_a_short_context(monkeypatch):
    """Qwen2.5 on a trace of 240 messages (users now and then, or one user before every call): every turn but the first
    is rendered from a handful of messages, so a row's work grows with its length, not its square
    (benchmarks/bench_rendering_mode.py measures it)."""
    from conftest import chat_tokenizer

    ct = chat_tokenizer("qwen2.5")
    rendered = []
    real = turn_spans._render

    def counting(ct, messages, tools, add_generation_prompt):
        rendered.append(len(messages))
        return real(ct, messages, tools, add_generation_prompt)

    monkeypatch.setattr(turn_spans, "_render", counting)
    for users_every in (9, 1000, None):  # None: one user message, then 120 calls with their results
        messages, tools = collection.agent_trace(240, users_every=users_every) if users_every else \
            collection.call_trace(120)
        ids = np.asarray(ct.encode_chats([{"messages": messages, "tools": tools}]).input_ids[0].as_py())
        rendered.clear()
        trained, why = turn_spans.label_row_from_rendering(ct, messages, ids, tools=tools)
        assert trained is not None, why
        long = [n for n in rendered if n > 12]
        assert len(long) <= 3, (users_every, sorted(rendered)[-8:])  # the first turn's two, and the row going on


def test_a_message_whose_text_the_template_writes_elsewhere_too_is_placed_by_the_text_before_it(monkeypatch):
    """Qwen2.5 writes a default system prompt ("You are Qwen, created by Alibaba Cloud. You are a helpful
    assistant."): a user message "e" or "si" is found in it first in a short context. The template's text before the
    message places it, and the labels are those of the renders from the row's start (real ShareGPT rows)."""
    from conftest import chat_tokenizer

    ct = chat_tokenizer("qwen2.5")
    chats = [[{"role": "user", "content": "Write a haiku about rain."}, {"role": "assistant", "content": "Soft rain on the roof."},
              {"role": "user", "content": short}, {"role": "assistant", "content": f"You wrote {short!r}; say more?"},
              {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "Any time."}]
             for short in ("e", "si", "a", "You", "Qwen")]
    encoded = ct.encode_chats(chats)
    for chat, ids in zip(chats, encoded.input_ids.to_pylist()):
        ids = np.asarray(ids)
        assert _labels(ct, chat, None, ids, True, monkeypatch) == _labels(ct, chat, None, ids, False, monkeypatch), chat[2]
