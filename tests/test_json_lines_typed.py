"""JSON Lines read as typed Arrow: messages as ``list<struct>``, parsed once; JSON text only where a type changes."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lossmask.jobs.read_json as inputs
from lossmask.jobs.inputs import open_inputs
from lossmask.jobs.stream import mask_files

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])


def chat(i: int) -> list[dict]:
    return [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]


def write_lines(path, rows) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def read_all(path) -> tuple[pa.Schema, list[dict]]:
    files = open_inputs(path)
    return files.schema, [row for batch in files.batches(3) for row in batch.to_pylist()]


def test_messages_are_read_as_a_list_of_structs_with_the_other_columns_typed(tmp_path):
    rows = [{"id": str(i), "messages": chat(i), "turns": i, "score": 0.5 + i, "ok": bool(i % 2), "ids": [1, 2, i],
             "tags": ["a"], "day": "2024-01-02"} for i in range(7)]
    write_lines(tmp_path / "in.jsonl", rows)
    schema, read = read_all(tmp_path / "in.jsonl")
    assert schema.field("messages").type == pa.list_(MESSAGE)
    assert [schema.field(n).type for n in ("id", "turns", "score", "ok", "ids", "tags", "day")] == [
        pa.string(), pa.int64(), pa.float64(), pa.bool_(), pa.list_(pa.int64()), pa.list_(pa.string()), pa.string()]
    assert read == rows  # text that looks like a date stays text


def test_sharegpt_turns_and_keys_some_messages_lack_are_struct_fields(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo", "name": "bot"}]}] * 4
    write_lines(tmp_path / "in.jsonl", rows)
    schema, read = read_all(tmp_path / "in.jsonl")
    assert pa.types.is_struct(schema.field("conversations").type.value_type)
    assert read[0]["conversations"][0] == {"from": "human", "value": "hi", "name": None}


def test_the_first_rows_are_parsed_once_for_the_schema_and_the_reading(tmp_path, monkeypatch):
    write_lines(tmp_path / "in.jsonl", [{"messages": chat(i)} for i in range(50)])
    calls = []
    real = inputs._arrow_json
    monkeypatch.setattr(inputs, "_arrow_json", lambda *a: calls.append(a[1]) or real(*a))
    files = open_inputs(tmp_path / "in.jsonl")
    assert sum(batch.num_rows for batch in files.batches(8)) == 50
    assert calls == [None]  # one parse, its types inferred; no second one with the schema


@pytest.mark.parametrize("second", [
    [{"role": "user", "content": [{"type": "text", "text": "parts"}]}],  # content: a string, then a list
    [{"role": "user", "content": "hi", "weight": 0}],  # a number in a message
    ["not an object"],
])
def test_a_message_whose_type_changes_between_rows_is_read_as_it_is(tmp_path, second):
    rows = [{"messages": chat(0)}, {"messages": second}, {"messages": chat(2)}]
    write_lines(tmp_path / "in.jsonl", rows)
    schema, read = read_all(tmp_path / "in.jsonl")
    assert schema.field("messages").type == pa.list_(pa.json_())
    assert [[json.loads(m) for m in row["messages"]] for row in read] == [row["messages"] for row in rows]


def test_a_column_of_nulls_stays_json_text_and_reads_a_later_value(tmp_path, monkeypatch):
    monkeypatch.setattr(inputs, "INFER_LINES", 4)
    rows = [{"messages": chat(i), "meta": None} for i in range(9)]
    rows[7]["meta"] = {"source": "web"}
    write_lines(tmp_path / "in.jsonl", rows)
    schema, read = read_all(tmp_path / "in.jsonl")
    assert schema.field("messages").type == pa.list_(MESSAGE) and schema.field("meta").type == pa.json_()
    assert [row["meta"] for row in read] == [None] * 7 + ['{"source": "web"}', None]


@pytest.mark.parametrize("late, says", [
    ({"role": "user", "content": "hi", "name": "bob"}, r"line 8: an object of 'messages' has key 'name', which none"),
    ({"role": "user", "content": ["a list"]}, r"line 8: 'messages' holds .*which does not fit"),
])
def test_a_message_unlike_those_of_the_first_rows_names_the_line(tmp_path, monkeypatch, late, says):
    monkeypatch.setattr(inputs, "INFER_LINES", 4)
    rows = [{"messages": chat(i)} for i in range(9)]
    rows[7]["messages"] = [late]
    write_lines(tmp_path / "in.jsonl", rows)
    files = open_inputs(tmp_path / "in.jsonl")
    assert files.schema.field("messages").type == pa.list_(MESSAGE)
    with pytest.raises(ValueError, match=r"in\.jsonl, " + says):
        list(files.batches(3))


def test_bytes_that_are_not_utf8_after_the_first_rows_name_the_line(tmp_path, monkeypatch):
    monkeypatch.setattr(inputs, "INFER_LINES", 4)
    lines = [json.dumps({"messages": chat(i)}).encode() for i in range(9)]
    lines[6] = lines[6].replace(b"answer", b"caf\xe9")
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(ValueError, match=r"in\.jsonl, line 7: not UTF-8"):
        list(open_inputs(tmp_path / "in.jsonl").batches(3))


def test_files_whose_messages_carry_different_keys_are_united(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_lines(folder / "a.jsonl", [{"messages": chat(0)}])
    write_lines(folder / "b.jsonl", [{"messages": [{**chat(1)[0], "name": "bob"}, chat(1)[1]]}])
    schema, read = read_all(folder)
    assert schema.field("messages").type.value_type.names == ["role", "content", "name"]
    assert [row["messages"][0].get("name") for row in read] == [None, "bob"]


def test_rows_after_blank_lines_are_named_by_their_line(tmp_path):
    (tmp_path / "in.jsonl").write_text("\n".join([json.dumps({"messages": chat(0)}), "", json.dumps({"messages": chat(1)})]))
    files = open_inputs(tmp_path / "in.jsonl")
    assert sum(batch.num_rows for batch in files.batches(10)) == 2
    assert files.where(1) == f"{tmp_path / 'in.jsonl'}, line 3"


def test_json_lines_label_as_the_same_rows_from_parquet(tmp_path):
    from conftest import chat_tokenizer

    tok = chat_tokenizer("qwen2.5")
    rows = [{"messages": [{"role": "system", "content": "Be brief."}] * (i % 2) + chat(i)} for i in range(40)]
    write_lines(tmp_path / "in.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    mask_files(tmp_path / "in.jsonl", tmp_path / "a.parquet", tokenizer=tok, batch_size=16)
    mask_files(tmp_path / "in.parquet", tmp_path / "b.parquet", tokenizer=tok, batch_size=16)
    a, b = pq.read_table(tmp_path / "a.parquet"), pq.read_table(tmp_path / "b.parquet")
    assert a.equals(b)


def test_the_row_count_is_known_when_the_rows_read_for_the_schema_are_the_whole_file(tmp_path, monkeypatch):
    write_lines(tmp_path / "in.jsonl", [{"messages": chat(i)} for i in range(12)])
    assert open_inputs(tmp_path / "in.jsonl").count_rows() == 12
    monkeypatch.setattr(inputs, "INFER_LINES", 5)
    assert open_inputs(tmp_path / "in.jsonl").count_rows() is None


def test_a_line_nested_deeper_than_arrow_reads_is_named_not_a_crash(tmp_path):
    deep = '{"messages": ' + "[" * 30_000 + "]" * 30_000 + "}"
    lines = [json.dumps({"messages": chat(0)}), deep]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"in\.jsonl, line 2: nested too deep"):
        list(open_inputs(tmp_path / "in.jsonl").batches(4))
