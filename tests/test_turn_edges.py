"""Where a turn starts when the header's last character and the reply's first word are one token.

A header that ends in a space (``<|Assistant|>: ``) merges with the reply's first word (`` I``): no marker set can see
such a reply (its header pattern ends in a token the row does not hold), so verification refuses the markers and each
row is labelled from its rendering. There the token that holds the reply's first word trains (the model must learn to
write it), the header does not, and the stop does.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pq = pytest.importorskip("pyarrow.parquet")

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
import template_collection as collection  # noqa: E402

sys.path.pop(0)

MERGING_HEADER = (
    "{% for m in messages %}{% if m.role == 'user' %}<|User|>: {{ m.content }}\n"
    "{% else %}<|Assistant|>: {{ m.content }}<|end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|Assistant|>: {% endif %}"
)
CHATS = [
    [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "I am fine today."}],
    [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello friend."},
     {"role": "user", "content": "Again"}, {"role": "assistant", "content": "I said hello."}],
]


def test_a_reply_merged_with_its_header_trains_from_its_first_word(tmp_path):
    import lossmask

    tok = collection.tokenizer_for(MERGING_HEADER)
    assert tok.tokenize(": I") == [":", "ĠI"]  # the header's space and the reply's first word are one token
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resolution = lossmask.resolve_markers(tok)
        source = tmp_path / "chats.jsonl"
        source.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
        report = lossmask.mask_files(source, tmp_path / "out.parquet", tokenizer=tok)
    assert resolution.source == "rendered", resolution.reason
    assert report.rows_out == len(CHATS), report.summary()
    table = pq.read_table(tmp_path / "out.parquet")
    trained = [tok.decode([t for t in labels if t != -100]) for labels in table["labels"].to_pylist()]
    assert trained == [" I am fine today.<|end|>", " Hello friend.<|end|> I said hello.<|end|>"]
    for chat, ids, labels in zip(CHATS, table["input_ids"].to_pylist(), table["labels"].to_pylist()):
        assert collection.agent_problems(tok, chat, None, ids, labels) == []
