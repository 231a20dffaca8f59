"""The fast tokeniser (``fastokens``) against Hugging Face ``tokenizers``: the same ids on every family it supports.

For each of the shared families: the conversations of ``examples/chats.jsonl`` and the built-in probes
(``verify.probe_conversations``: whitespace, Unicode, tools, reasoning), rendered with the family's
template (with and without the generation prompt), plus their raw contents and some edge texts, are
encoded by ``ChatTokenizer.encode_flat`` and by ``tokenizers`` directly; the ids must be equal. Families
``fastokens`` refuses are encoded with ``tokenizers`` after one ``FastTokenizerWarning``.
"""

from __future__ import annotations

import json
import pickle
import warnings

import numpy as np
import pytest

from conftest import REPO_ROOT, chat_tokenizer, tokenizer_families

pytest.importorskip("fastokens", reason="fastokens is not installed (pip install 'lossmask[fast]')")

from lossmask.chat.fast_tokens import FastTokenizerWarning, FastTokens  # noqa: E402

EDGE_TEXTS = [
    "", " ", "\n", "\n\n\n", "  two leading spaces", "trailing spaces   ", "\ttab\tseparated\t", "a\r\nb",
    "emoji 🙂🚀 and CJK 中文字符 and Arabic العربية", "digits 1234567890 3.14159 1e-9", "ALLCAPS camelCase snake_case",
    "<|im_start|>assistant\n<|im_end|></s><s>[INST] <start_of_turn>model\n<|eot_id|>", "x" * 3000,
    "def f(a, b):\n    return a + b\n\n\n    indented\n", "’quotes’ “double” — dashes … ellipsis",
]


def _texts(ct) -> list[str]:
    from lossmask.chat.probes import probe_conversations

    chats = [json.loads(line)["messages"] for line in (REPO_ROOT / "examples" / "chats.jsonl").read_text().splitlines()]
    conversations = [(c, None) for c in chats if c] + [(list(p.messages), p.tools) for p in probe_conversations()]
    texts = list(EDGE_TEXTS)
    for messages, tools in conversations:
        texts += [m["content"] for m in messages if isinstance(m.get("content"), str)]
        for prompt in (False, True):
            try:
                texts.append(ct.render(messages, tools=tools, add_generation_prompt=prompt))
            except Exception:  # noqa: BLE001 - templates reject roles, tools, shapes: those texts are not rows
                pass
    return texts


def _reference(ct, texts):
    encodings = ct.tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    return [e.ids for e in encodings]


@pytest.mark.parametrize("family", tokenizer_families() or ["qwen2.5"])
def test_fast_ids_equal_tokenizers(family):
    ct = chat_tokenizer(family)
    texts = _texts(ct)
    ct.begin_job()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ct.fast_tokens.ready()  # a small batch does not wait for the load; here it must be the fast path
        flat = ct.encode_flat(texts)
    said = [w for w in caught if issubclass(w.category, FastTokenizerWarning)]
    rows = [flat.ids[a:b].tolist() for a, b in zip(flat.offsets[:-1], flat.offsets[1:])]
    assert rows == _reference(ct, texts)
    fast = ct.fast_tokens
    if fast.reason is None:
        assert fast.proven and not said
    else:  # unsupported here: said once, then tokenizers, silently
        # (said here, or already by an earlier test on this shared tokenizer)
        assert (len(said) == 1 and "encoding with tokenizers" in str(said[0].message)) or (not said and fast._said), said
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ct.encode_flat(texts[:3])


def test_disagreement_switches_back_naming_the_text():
    """A fast encoder that gives other ids (here: another vocabulary's) is refused on the first batch."""
    ct = chat_tokenizer("qwen2.5")
    other = chat_tokenizer("llama-3.1")  # read, not changed: the FastTokens below is a new one of its own
    wrong = FastTokens(other, "llama-3.1 ids for a qwen2.5 job")
    texts = ["same text in both? no", "The capital of France is Paris."]
    reference = ct._encode_reference
    wrong.ready()
    with pytest.warns(FastTokenizerWarning, match=r"differ on text 0 of the first batch at token \d+"):
        assert wrong.encode(texts, reference) is None
    assert wrong.reason is not None and wrong.encode(texts, reference) is None  # stays off


def test_proof_runs_once_per_job_and_workers_reload():
    ct = chat_tokenizer("qwen2.5")
    ct.begin_job()
    ct.fast_tokens.ready()
    ct.encode_flat(["hello world"])
    fast = ct.fast_tokens
    if fast.reason is not None:
        pytest.skip(f"fastokens does not load qwen2.5 here: {fast.reason}")
    assert fast.proven
    ct.begin_job()
    assert not fast.proven
    copy = pickle.loads(pickle.dumps(fast))  # a spawned worker: unloaded, proves again
    assert copy._tokenizer is None and not copy.proven
    early = copy.encode(["hello world"], ct._encode_reference)  # still loading: None (tokenizers), no waiting
    assert early is None or copy.proven
    copy.ready()
    ids, offsets = copy.encode(["hello world"], ct._encode_reference)
    assert copy.proven and ids.tolist() == _reference(ct, ["hello world"])[0] and offsets.tolist() == [0, len(ids)]


def test_switched_off_by_environment(monkeypatch):
    from lossmask import ChatTokenizer

    monkeypatch.setenv("LOSSMASK_FAST_TOKENIZER", "0")
    ct = ChatTokenizer(chat_tokenizer("qwen2.5").tokenizer)  # a new adapter (its own fast encoder) on the loaded one
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flat = ct.encode_flat(["hello world", ""])
    assert ct.fast_tokens.off and ct.fast_tokens._tokenizer is None
    assert np.diff(flat.offsets).tolist() == [len(x) for x in _reference(ct, ["hello world", ""])]
