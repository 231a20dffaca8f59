"""Agent data on every real chat template of llama.cpp's collection: tool calls, results, parallel calls, reasoning.

For each template, the kinds of ``template_collection.agent_chats`` it renders (a call with its result, parallel
calls, reasoning as a field and as ``<think>`` text, text quoting control tokens, system + tools), stored as JSON
Lines and read as Arrow (so each call's arguments and each tool get the other calls' keys as null), go through the
three doors: ``mask_files``, ``hf.mask_dataset`` and ``encode_chats`` + ``label_batch``. Each row must be kept, and each token must train exactly as
the oracle says (``template_collection.expected_training``: written from ``apply_chat_template``'s prefix renders and
each id's bytes, not from lossmask's code): a turn from the model's first token (past the header the generation prompt
writes) through its stop or closing, every call's arguments included; no header, user, system or tool text. The three
doors give the same labels.
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
from test_template_collection import NAMES, _folder  # noqa: E402

sys.path.pop(0)

# Templates whose agent chats transformers' sandbox will not render (Kimi-K2 calls list.append), or that need
# ``documents`` / ``functions``: there is no oracle for them, and they are not asked here.
NO_ORACLE = ("fireworks-ai-llama-3-firefunction-v2",)


def _rows(tok) -> list[tuple[str, list, list | None]]:
    rows = []
    for kind in collection.agent_chats():
        chat = collection.agent_chat(tok, kind)
        if chat is not None:
            rows.append((kind, *chat))
    return rows


@pytest.mark.parametrize("name", [n for n in NAMES if n not in NO_ORACLE])
def test_agent_chats_train_each_turn_through_its_stop_and_nothing_else_on_every_door(name, tmp_path):
    import datasets

    import lossmask
    import lossmask.hf

    tok = collection.tokenizer_for((_folder() / f"{name}.jinja").read_text(encoding="utf-8"))
    rows = _rows(tok)
    if not rows:
        pytest.skip(f"transformers renders none of the agent chats with {name}")
    source = tmp_path / "agent.jsonl"
    source.write_text("".join(json.dumps({"messages": m, "tools": t}) + "\n" for _, m, t in rows))
    # one adapter over the tokenizer for every door: what it reads off the template once, each door reuses (a door
    # given the Hugging Face tokenizer itself: test_null_keys_from_arrow_are_not_arguments)
    ct = lossmask.load_tokenizer(tok)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resolution = lossmask.resolve_markers(ct)
        report = lossmask.mask_files(source, tmp_path / "out.parquet", tokenizer=ct, max_drop_fraction=1.0)
    assert resolution.source != "none", f"{name} renders agent chats, yet the full sequence would train"
    assert report.rows_out == len(rows), f"{name} ({resolution.source}) dropped an agent chat: {report.summary()}"
    table = pq.read_table(tmp_path / "out.parquet")
    ids, labels = table["input_ids"].to_pylist(), table["labels"].to_pylist()
    for (kind, messages, tools), row_ids, row_labels in zip(rows, ids, labels):
        found = collection.agent_problems(tok, messages, tools, row_ids, row_labels)
        assert not found, (name, resolution.source, kind, found[:6])

    # the same rows through a datasets.Dataset (Arrow structs, null keys and all) and through encode_chats
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dataset = datasets.Dataset.from_json(str(source))
        through_hf = lossmask.hf.mask_dataset(dataset, ct, quiet=True, max_drop_fraction=1.0)
        encoded = ct.encode_chats([{"messages": m, "tools": t} for _, m, t in rows])
        labelled = lossmask.label_batch(encoded, resolution.markers)
    assert through_hf["labels"] == labels, f"{name}: hf.mask_dataset labels otherwise than mask_files"
    assert labelled.rejected == (), (name, labelled.rejected)
    assert encoded.input_ids.to_pylist() == ids and labelled.labels.to_pylist() == labels, \
        f"{name}: encode_chats + label_batch labels otherwise than mask_files"


def test_null_keys_from_arrow_are_not_arguments(tmp_path):
    """Two calls with different argument keys, stored as Parquet: each call's arguments get the other's keys as null.
    Those keys are not rendered, on either door: ``get_time`` gets no ``"unit"``."""
    import pyarrow as pa

    import lossmask
    import lossmask.hf

    tok = collection.tokenizer_for((_folder() / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(encoding="utf-8"))
    rows = [{"messages": m, "tools": t} for m, t in [collection.agent_chats()["parallel calls"]]]
    table = pa.Table.from_pylist(rows)
    arguments = table.column("messages").type.value_type.field("tool_calls").type.value_type.field("function").type
    assert {f.name for f in arguments.field("arguments").type} == {"city", "unit", "zone", "hours"}
    pq.write_table(table, tmp_path / "calls.parquet")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lossmask.mask_files(tmp_path / "calls.parquet", tmp_path / "out.parquet", tokenizer=tok)
    ids = pq.read_table(tmp_path / "out.parquet")["input_ids"][0].as_py()
    text = tok.decode(ids)
    assert '"zone": "Pacific/Fiji", "hours": 17}' in text and '"unit": null' not in text and "null" not in text, text
    messages, tools = collection.agent_chats()["parallel calls"]
    assert text == collection.render(tok, messages, tools=tools)
