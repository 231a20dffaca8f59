"""Plain chats read off their shape's sentinel rendering label as their own renders from the row's start.

``chat.shape_cache`` learns each shape of plain chat (its roles) once, on the conversation with a sentinel content per
message, and reads a row's turns off it where the row's rendering is that rendering with the row's contents in place;
``engine.turn_tokens`` makes those spans the batch's token labels at once (one kernel call, its plain reference held
equal to it here). The reference is each row rendered from its
start, turn by turn (``_SHORT_CONTEXTS = False``, no shapes): on every template of llama.cpp's collection, for rows that
are read off a shape and rows that are not (a template that rewrites or branches on a content), with contents that
hold a sentinel or the template's own header, the labels are the same, or both none.
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
from lossmask.chat import shape_cache, turn_spans  # noqa: E402



def _count_rows_read_off_shapes(monkeypatch) -> list[int]:
    """A list that gets, for each call of ``turn_spans._read_off_shapes``, how many rows it read off a shape."""
    read: list[int] = []
    original = turn_spans._read_off_shapes

    def counted(*args, **kwargs):
        found = original(*args, **kwargs)
        read.append(len(found))
        return found

    monkeypatch.setattr(turn_spans, "_read_off_shapes", counted)
    return read

def _reference(ct, messages, ids, last_turn_only, monkeypatch) -> list | None:
    """The row's labels from renders from its start, turn by turn."""
    monkeypatch.setattr(turn_spans, "_SHORT_CONTEXTS", False)
    try:
        trained, _ = turn_spans.label_row_from_rendering(ct, messages, np.asarray(ids), last_turn_only=last_turn_only)
    finally:
        monkeypatch.setattr(turn_spans, "_SHORT_CONTEXTS", True)
    return None if trained is None else np.where(trained, ids, -100).tolist()


def _read(ct, chats, last_turn_only, monkeypatch) -> tuple[list, int]:
    """The batch's labels as the batch step makes them (each row's rendering given), and how many rows were read off
    a shape."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        encoded = ct.encode_chats([{"messages": m} for m in chats])
    texts = [ct.render(m) for m in chats]
    read = _count_rows_read_off_shapes(monkeypatch)
    result = turn_spans.label_from_rendering(ct, [(m, None) for m in chats], encoded.input_ids,
                                             last_turn_only=last_turn_only, texts=texts)
    return result.labels.to_pylist(), encoded.input_ids.to_pylist(), sum(read)


def _variants(chat: list[dict], quoted: str) -> list[list[dict]]:
    """The chat, and the same shape with other contents: longer ones holding sentinels, and ones quoting the
    template's header."""
    return [chat,
            [{**m, "content": f"{m['content']} {shape_cache.sentinel(0)}, {shape_cache.sentinel(k)}."}
             for k, m in enumerate(chat)],
            [{**m, "content": f"{m['content']} {quoted}"} for m in chat]]


def _same_as_reference(ct, chats, monkeypatch) -> int:
    ct._shape_cache = shape_cache.ShapeCache()
    read = 0
    for last_turn_only in (False, True):
        labels, ids, hits = _read(ct, chats + chats, last_turn_only, monkeypatch)
        read += hits
        for k, (row, row_ids) in enumerate(zip(labels, ids)):
            if row_ids is None:
                continue
            assert row == _reference(ct, (chats + chats)[k], row_ids, last_turn_only, monkeypatch), (k, last_turn_only)
    return read


@pytest.mark.parametrize("name", NAMES)
def test_plain_chats_read_off_their_shape_label_as_renders_from_the_row_start(name, monkeypatch):
    tok = collection.tokenizer_for((_folder() / f"{name}.jinja").read_text(encoding="utf-8"))
    ct = lossmask.load_tokenizer(tok)
    quoted = collection.quoting_chat(tok)[0]["content"]
    chats = [v for c in collection.chats_for(tok) for v in _variants(c, quoted) if collection.render(tok, v) is not None]
    if not chats:
        pytest.skip(f"transformers renders none of the chats with {name}")
    _same_as_reference(ct, chats, monkeypatch)


def test_qwen_rows_of_a_learnt_shape_are_read_off_it_even_quoting_a_sentinel_or_a_marker(monkeypatch):
    """Qwen2.5: rows of one shape, with contents holding the sentinels and the template's own role tokens, are read off
    the shape (no renders of their own) and label as their renders from the row's start do."""
    from conftest import tokenizer_path

    ct = lossmask.load_tokenizer(tokenizer_path("qwen2.5"))
    base = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello, friend."},
            {"role": "user", "content": "And you?"}, {"role": "assistant", "content": "Fine."}]
    chats = _variants(base, "<|im_end|>\n<|im_start|>assistant\nsure") + \
        [[{**m, "content": "".join(shape_cache.sentinel(j) for j in range(4))} for m in base]]
    assert _same_as_reference(ct, chats, monkeypatch) >= 2 * len(chats)


# a template that rewrites a content (upper-case where it is long) and one that branches on it (a note before a
# question): the sentinel rendering with a row's contents in place is not the row's rendering, so the row renders its own
REWRITES = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content | length > 12 %}{{ m.content | upper }}"
            "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
BRANCHES = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if '?' in m.content %}(asks) {% endif %}"
            "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template", [REWRITES, BRANCHES], ids=["rewrites", "branches"])
def test_a_template_that_rewrites_or_branches_on_a_content_falls_back_and_stays_exact(template, monkeypatch):
    ct = lossmask.load_tokenizer(collection.tokenizer_for(template))
    chats = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
             [{"role": "user", "content": "What time is it now?"}, {"role": "assistant", "content": "It is late, sorry."}],
             [{"role": "user", "content": "Hey"}, {"role": "assistant", "content": "Yes."}]]
    _same_as_reference(ct, chats, monkeypatch)
    key = shape_cache.plain_shape(chats[1], None, [1])
    assert ct._shape_cache.known(key) and ct._shape_cache.read(key, chats[1], ct.render(chats[1])) is None
    assert ct._shape_cache.read(key, chats[2], ct.render(chats[2])) is not None


def test_the_shape_cache_keeps_at_most_its_bound_dropping_the_least_recently_used():
    cache = shape_cache.ShapeCache(max_shapes=3)
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]

    def render(dummy):
        return "".join(f"<{m['role']}>{m['content']}</s>" for m in dummy)

    def find(dummy, rendered):
        at = rendered.index(dummy[1]["content"])
        return [(at, at + len(dummy[1]["content"]), at + len(dummy[1]["content"]) + 4, False, False)]

    keys = [(("user", "assistant"), (1,), k) for k in range(5)]
    text = render(messages)
    for key in keys:
        cache.learn(key, messages, text, find(messages, text), render, find)
        assert len(cache) <= 3
    assert [cache.known(k) for k in keys] == [False, False, True, True, True]
    cache.read(keys[2], messages, text)  # used: kept over the least recently used
    cache.learn(keys[0], messages, text, find(messages, text), render, find)
    assert [cache.known(k) for k in keys] == [True, False, True, False, True]
    assert cache.read(keys[2], messages, text)[0] == find(messages, text)


def test_the_turn_tokens_kernel_equals_its_plain_reference():
    """Rows of random tokens (rising, or not; some past their text), control tokens, turn spans and message pieces: the
    compiled pass and its plain reference mark the same tokens and leave the same rows to the row-by-row code."""
    from lossmask.engine import turn_tokens as kernel

    rng = np.random.default_rng(7)
    for _ in range(300):
        n_rows = int(rng.integers(1, 5))
        lengths = rng.integers(0, 30, n_rows)
        spans, pieces, span_offsets, piece_offsets, row_lo, row_hi, texts = [], [], [0], [0], [], [], []
        token_spans, special = [], []
        for length in lengths.tolist():
            cuts = np.sort(rng.integers(0, 60, 2 * length)).reshape(-1, 2) if length else np.zeros((0, 2), np.int64)
            if rng.random() < 0.1 and length > 1:
                cuts = cuts[::-1]  # not rising
            row_lo.append(len(token_spans))
            token_spans += cuts.tolist()
            row_hi.append(len(token_spans))
            special += (rng.random(length) < 0.3).tolist()
            texts.append(int(rng.integers(40, 70)))
            for _ in range(int(rng.integers(0, 3))):
                a, b, c = np.sort(rng.integers(0, 60, 3)).tolist()
                spans += [a, b, c]
            span_offsets.append(len(spans) // 3)
            for _ in range(int(rng.integers(0, 4))):
                a, b = np.sort(rng.integers(0, 60, 2)).tolist()
                pieces += [a, b, int(rng.integers(-1, 2))]
            piece_offsets.append(len(pieces) // 3)
        token_spans = np.asarray(token_spans, np.int32).reshape(-1, 2)
        special = np.asarray(special, bool)
        args = (token_spans, special, np.asarray(row_lo, np.int64), np.asarray(row_hi, np.int64),
                np.asarray(texts, np.int64), np.asarray(spans, np.int64).reshape(-1, 3),
                np.asarray(span_offsets, np.int64), np.asarray(pieces, np.int64).reshape(-1, 3),
                np.asarray(piece_offsets, np.int64))
        for closes in (True, False):
            fast, slow = np.zeros(len(special), bool), np.zeros(len(special), bool)
            done_fast, done_slow = np.zeros(n_rows, bool), np.zeros(n_rows, bool)
            kernel.turn_tokens(*args, closes, fast, done_fast)
            kernel.reference_turn_tokens(*args, closes, slow, done_slow)
            assert done_fast.tolist() == done_slow.tolist() and fast.tolist() == slow.tolist()


def test_every_door_reads_plain_chats_off_their_shape_alike(tmp_path, monkeypatch):
    """Qwen2.5 forced to its rendering, plain chats of three shapes: ``mask_files``, ``hf.mask_dataset`` and
    ``encode_chats`` + ``make_labels`` give each row the labels of its renders from the row's start."""
    import json

    datasets = pytest.importorskip("datasets")
    from conftest import tokenizer_path

    from lossmask.hf import mask_dataset

    words = ["alpha beta", "Gamma, delta?", "<|im_start|>assistant\nquoted", "Zq1Xj and Zq0Xj", "epsilon"]
    chats = []
    for k in range(24):
        turns = 1 + k % 3
        chats.append([{"role": "user" if j % 2 == 0 else "assistant", "content": f"{words[(k + j) % 5]} {k}"}
                      for j in range(2 * turns)])
    ct = lossmask.load_tokenizer(tokenizer_path("qwen2.5"))
    ct._shape_cache = shape_cache.ShapeCache()
    read = _count_rows_read_off_shapes(monkeypatch)
    source = tmp_path / "chats.jsonl"
    source.write_text("\n".join(json.dumps({"messages": c}) for c in chats) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lossmask.mask_files(source, tmp_path / "out.parquet", tokenizer=ct, markers=lossmask.FromRendering(),
                            max_drop_fraction=1.0, keep_dropped=True)
        dataset = mask_dataset(datasets.Dataset.from_dict({"messages": chats}), ct, markers=lossmask.FromRendering())
        encoded = ct.encode_chats(chats)
    assert sum(read) >= len(chats) - 3
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "out.parquet")
    reference = [_reference(ct, c, ids, False, monkeypatch) for c, ids in zip(chats, table["input_ids"].to_pylist())]
    assert table["labels"].to_pylist() == reference
    assert [row["labels"] for row in dataset] == reference
    assert lossmask.make_labels(encoded, lossmask.FromRendering()).to_pylist() == reference
