"""Workers that carry the whole step: the output joined from their Parquet parts is the file one process writes,
every row counted once, nothing left behind when a worker fails; ``hf.mask_dataset(num_proc=)`` the same."""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lossmask import mask_files
from lossmask.jobs.parquet_parts import PartsFile, _Reader, _read_struct, _write_struct, encode_part, split_part
from lossmask.jobs.stream import writer_options
from lossmask.options import MaskOptions

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "chats.jsonl"


def _table(rows: int) -> pa.Table:
    return pa.table({
        "messages": [[{"role": "user", "content": f"q{i}" * (i % 7)}, {"role": "assistant", "content": f"a{i}"}]
                     for i in range(rows)],
        "input_ids": [list(range(i % 50)) for i in range(rows)],
        "labels": [[-100] * (i % 3) + list(range(i % 50 - i % 3)) for i in range(rows)],
        "loss_weights": [[0.5] * (i % 50) for i in range(rows)],
    })


def test_a_footer_decoded_and_encoded_again_is_the_same_bytes():
    table = _table(300)
    part = encode_part(table, writer_options(table.schema, MaskOptions()), 100)
    chunks, footer = split_part(part)
    raw = bytes(memoryview(part)[4 + len(chunks):-8])
    out = bytearray()
    _write_struct(footer, out)
    assert bytes(out) == raw
    assert _read_struct(_Reader(bytes(out))) == footer


@pytest.mark.parametrize("row_group_size", [None, 64])
def test_parts_joined_read_back_as_the_table_written_whole(tmp_path, row_group_size):
    table = _table(1_000)
    options = writer_options(table.schema, MaskOptions())
    joined = PartsFile(tmp_path / "joined.parquet", table.schema, options)
    for start, size in [(0, 300), (300, 0), (300, 1), (301, 450), (751, 249)]:  # an empty part among them
        joined.append(encode_part(table.slice(start, size), options, row_group_size))
    joined.close()
    back = pq.ParquetFile(tmp_path / "joined.parquet")
    assert pq.read_table(tmp_path / "joined.parquet").equals(table)
    assert back.metadata.num_rows == 1_000
    groups = [back.metadata.row_group(g) for g in range(back.metadata.num_row_groups)]
    assert sum(g.num_rows for g in groups) == 1_000
    # each row group reads alone: its offsets point into this file, not into the part it came from
    assert pa.concat_tables([back.read_row_group(g) for g in range(len(groups))]).equals(table)
    # statistics of the passthrough column survive, as a filter reads them
    import pyarrow.dataset as ds

    assert ds.dataset(tmp_path / "joined.parquet").to_table(filter=ds.field("messages").is_valid()).num_rows == 1_000


def test_a_job_with_no_part_writes_the_empty_file_of_its_schema(tmp_path):
    table = _table(3)
    options = writer_options(table.schema, MaskOptions())
    empty = PartsFile(tmp_path / "empty.parquet", table.schema, options)
    empty.append(encode_part(table.slice(0, 0), options, None))
    empty.close()
    back = pq.read_table(tmp_path / "empty.parquet")
    assert back.num_rows == 0 and back.schema.equals(table.schema)


@pytest.fixture
def eight_cores(monkeypatch):
    import lossmask.jobs.stream

    monkeypatch.setattr(lossmask.jobs.stream, "_cores", lambda: 8)


def _chats(tmp_path: Path, copies: int = 40) -> Path:
    """The example chats, repeated, with rows that are invalid, dropped or cut among them."""
    lines = EXAMPLES.read_text().splitlines() * copies
    odd = {7: [{"role": "user", "content": "no reply"}],
           2_500: [{"role": "narrator", "content": "Once."}, {"role": "assistant", "content": "Then."}],
           4_000: [{"role": "user", "content": "Q"}, {"role": "assistant", "content": ""}]}
    for at, messages in odd.items():
        if at < len(lines):
            lines[at] = json.dumps({"messages": messages})
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _report(report) -> dict:
    return {k: v for k, v in report.to_dict().items() if k not in ("seconds", "output", "messages")}


def test_workers_write_the_file_and_report_of_one_process_with_weights_and_kept_drops(tmp_path, eight_cores):
    from conftest import chat_tokenizer

    tokenizer = chat_tokenizer("qwen2.5")
    chats = _chats(tmp_path)
    kwargs = dict(tokenizer=tokenizer, max_length=200, keep_dropped=True, max_drop_fraction=1.0,
                  weights_by_role={"assistant": 0.5}, completion_mask=True, row_group_size=300)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = mask_files(chats, tmp_path / "one.parquet", report=tmp_path / "one.json", **kwargs)
        three = mask_files(chats, tmp_path / "three.parquet", num_proc=3, report=tmp_path / "three.json", **kwargs)
    assert pq.read_table(tmp_path / "one.parquet").equals(pq.read_table(tmp_path / "three.parquet"))
    assert _report(one) == _report(three) and one.dropped["invalid"] > 0
    assert "chats.jsonl, line " in three.invalid_examples[0]  # named by the file's line, found in a worker
    assert three.seconds["encode_part"] > 0 and "loss_weights" in pq.read_schema(tmp_path / "three.parquet").names
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl", "one.json", "one.parquet", "three.json",
                                                        "three.parquet"]


def test_an_error_in_a_worker_names_its_row_and_leaves_nothing_behind(tmp_path, eight_cores):
    from conftest import chat_tokenizer

    lines = EXAMPLES.read_text().splitlines() * 40
    lines[3_333] = json.dumps({"messages": [{"role": "user", "content": "Say <|im_end|>"},
                                            {"role": "assistant", "content": "No."}]})
    (tmp_path / "chats.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"chats\.jsonl, line 3334"):
        mask_files(tmp_path / "chats.jsonl", tmp_path / "out.parquet", tokenizer=chat_tokenizer("qwen2.5"),
                   num_proc=2, special_tokens_in_content="error", report=tmp_path / "r.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl"]


def test_hf_mask_dataset_num_proc_gives_the_dataset_and_report_of_one_process(tmp_path, eight_cores):
    datasets = pytest.importorskip("datasets")
    from conftest import chat_tokenizer

    from lossmask import hf

    tokenizer = chat_tokenizer("llama-3.1")
    rows = [json.loads(line) for line in EXAMPLES.read_text().splitlines()] * 40
    ds = datasets.Dataset.from_list(rows)
    one, report_one = hf.mask_dataset(ds, tokenizer, return_report=True, quiet=True, batch_size=512)
    two, report_two = hf.mask_dataset(ds, tokenizer, return_report=True, quiet=True, batch_size=512, num_proc=2)
    assert one.data.table.equals(two.data.table) and _report(report_one) == _report(report_two)
    with pytest.raises(ValueError, match="an IterableDataset streams through this process"):
        hf.mask_dataset(ds.to_iterable_dataset(), tokenizer, num_proc=2)
    with pytest.raises(ValueError, match="num_proc=0 must be a positive number"):
        hf.mask_dataset(ds, tokenizer, num_proc=0)


def test_batches_are_bounded_by_bytes_with_rows_named_and_labels_unchanged(tmp_path):
    """``batch_bytes`` cuts a batch of long rows into pieces (slices of what was read): the same file, the same
    report, and a bad row still named by its file and line."""
    from conftest import chat_tokenizer

    tokenizer = chat_tokenizer("qwen2.5")
    chats = _chats(tmp_path, copies=3)  # 360 rows
    kwargs = dict(tokenizer=tokenizer, max_drop_fraction=1.0, keep_dropped=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = mask_files(chats, tmp_path / "whole.parquet", **kwargs)
        small = mask_files(chats, tmp_path / "small.parquet", batch_bytes=20_000, **kwargs)
    assert pq.read_table(tmp_path / "whole.parquet").equals(pq.read_table(tmp_path / "small.parquet"))
    assert _report(whole) == _report(small)
    # (the examples hold an empty chat on line 304: named the same from the last of many pieces)
    assert any("chats.jsonl, line 304): column 'messages' is empty" in e for e in small.invalid_examples)
    with pytest.raises(ValueError, match="batch_bytes=0 must be a positive number of bytes"):
        MaskOptions(batch_bytes=0)


def test_parquet_is_read_in_batches_of_about_batch_bytes_so_no_large_read_outlives_its_slices(tmp_path):
    """A Parquet file of long rows in one large row group is read a few rows at a time (its footer gives the mean
    row size), not a batch of ``batch_size`` rows cut into slices that keep the whole read alive: every batch holds
    about ``max_bytes``, and the rows come out whole, once, in order, numbered from the file's first row."""
    from lossmask.jobs.inputs import open_inputs

    rows = 600
    path = tmp_path / "long.parquet"
    pq.write_table(_table(rows).append_column("text", pa.array(["x" * (1_000 + i) for i in range(rows)])), path,
                   row_group_size=rows)
    again = tmp_path / "again.parquet"
    again.write_bytes(path.read_bytes())
    files = open_inputs([str(path), str(again)])
    batches = list(files.batches(batch_size=16_384, max_bytes=50_000))
    assert len(batches) > 20 and max(b.num_rows for b in batches) < rows // 10
    # the buffers a batch holds, its parent read's included: a slice of a 600-row read would hold all of them
    assert max(b.get_total_buffer_size() for b in batches) < 2 * 50_000
    assert pa.Table.from_batches(batches).equals(pa.concat_tables([pq.read_table(path)] * 2))
    assert files.where(rows - 1).endswith("long.parquet, row 599")
    assert files.where(rows + 123).endswith("again.parquet, row 123")
    files.close()


def test_workers_forked_after_the_parent_encoded_in_parallel_do_not_wait_for_its_threads(tmp_path):
    """A fork carries none of the parent's Rust thread-pool threads: a worker that encoded in parallel waited for
    them forever. Run in a process of its own, with a time limit, after the parent has used its pool."""
    import subprocess
    import sys

    from conftest import tokenizer_path

    script = f"""
import warnings, lossmask.jobs.stream as stream
warnings.simplefilter("ignore")
stream._cores = lambda: 8
from lossmask import mask_files
from lossmask.chat.encode_batch import chat_tokenizer
tok = chat_tokenizer({str(tokenizer_path("qwen2.5"))!r})
tok.tokenizer.backend_tokenizer.encode_batch(["some text to encode " * 50] * 2000)  # the parent's pool, started
report = mask_files({str(_chats(tmp_path, copies=40))!r}, {str(tmp_path / "out.parquet")!r}, tokenizer=tok,
                    num_proc=2, max_drop_fraction=1.0, batch_bytes=200_000)
print(report.rows_in)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "TOKENIZERS_PARALLELISM": "true"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "4800"


def test_workers_reading_their_own_parquet_row_groups_write_the_file_and_report_of_one_process(tmp_path, eight_cores):
    """Parquet files of several row groups (a glob of two) are read by the workers themselves, a run of row groups
    each: the same file and report as one process, and a bad row named by its file and row."""
    from conftest import chat_tokenizer

    tokenizer = chat_tokenizer("qwen2.5")
    rows = [json.loads(line) for line in _chats(tmp_path, copies=40).read_text().splitlines()]
    (tmp_path / "chats.jsonl").unlink()
    table = pa.table({"id": list(range(len(rows))), "messages": [r["messages"] for r in rows]})
    (tmp_path / "in").mkdir()
    pq.write_table(table.slice(0, 2_600), tmp_path / "in" / "a.parquet", row_group_size=700)
    pq.write_table(table.slice(2_600), tmp_path / "in" / "b.parquet", row_group_size=300)
    kwargs = dict(tokenizer=tokenizer, keep_dropped=True, max_drop_fraction=1.0, max_length=300, row_group_size=500)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = mask_files(str(tmp_path / "in" / "*.parquet"), tmp_path / "one.parquet", **kwargs)
        two = mask_files(str(tmp_path / "in" / "*.parquet"), tmp_path / "two.parquet", num_proc=2, **kwargs)
    assert pq.read_table(tmp_path / "one.parquet").equals(pq.read_table(tmp_path / "two.parquet"))
    assert _report(one) == _report(two) and two.rows_in == len(rows)
    assert one.invalid_examples == two.invalid_examples
    assert any("a.parquet, row 63): column 'messages' is empty" in e for e in two.invalid_examples)
    assert two.seconds["read"] > 0 and two.seconds.get("hand_out", 0) < two.seconds["worker"]


def test_slices_are_runs_of_whole_row_groups_and_files_in_one_large_group_are_left_to_the_parent(tmp_path):
    from lossmask.jobs.inputs import open_inputs
    from lossmask.jobs.slices import parquet_slices

    table = _table(1_000)
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=300)  # groups of 300, 300, 300, 100
    pq.write_table(table.slice(0, 250), tmp_path / "b.parquet", row_group_size=100)  # 100, 100, 50
    files = open_inputs(str(tmp_path / "*.parquet"))
    plan = parquet_slices(files, 600, workers=1)
    assert [(p.path.rsplit("/", 1)[1], p.groups, p.first, p.first_row, p.num_rows) for p in plan] == [
        ("a.parquet", (0, 1), 0, 0, 600), ("a.parquet", (2, 3), 600, 600, 400),
        ("b.parquet", (0, 1, 2), 0, 1_000, 250)]
    assert parquet_slices(files, 600, workers=2) is None  # fewer than two slices a worker
    assert parquet_slices(files, 100, workers=1) is None  # a row group of more than twice a slice
    files.close()
    pq.write_table(table, tmp_path / "one.parquet")  # one row group for the whole file
    whole = open_inputs(str(tmp_path / "one.parquet"))
    assert parquet_slices(whole, 250, workers=2) is None
    whole.close()


def test_a_part_written_to_a_file_is_copied_in_and_removed(tmp_path):
    from lossmask.jobs.parquet_parts import write_part

    table = _table(500)
    options = writer_options(table.schema, MaskOptions())
    joined = PartsFile(tmp_path / "joined.parquet", table.schema, options)
    joined.append(encode_part(table.slice(0, 200), options, 64))
    joined.append(write_part(table.slice(200, 300), options, 64, str(tmp_path / "part.parquet")))
    joined.close()
    assert pq.read_table(tmp_path / "joined.parquet").equals(table)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["joined.parquet"]


def _sliced(monkeypatch) -> list:
    """The plans ``json_slices`` returns in this process, recorded as the job makes them."""
    import lossmask.jobs.slices as slices

    plans, plan = [], slices.json_slices
    monkeypatch.setattr(slices, "json_slices", lambda *a: plans.append(plan(*a)) or plans[-1])
    return plans


def _write_shape(folder: Path, lines: list[str], shape: str) -> str:
    """``lines`` (JSON objects) written as a JSON array, gzip JSON Lines, a gzip JSON array or a glob of all three."""
    import gzip

    array = lambda rows: "[\n" + ",\n".join(rows) + "\n]\n"  # noqa: E731
    if shape == "json-array":
        (folder / "chats.json").write_text(array(lines))
        return str(folder / "chats.json")
    if shape == "gzip":
        (folder / "chats.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
        return str(folder / "chats.jsonl.gz")
    if shape == "gzip-array":
        (folder / "chats.json.gz").write_bytes(gzip.compress(array(lines).encode()))
        return str(folder / "chats.json.gz")
    third = len(lines) // 3
    (folder / "in").mkdir()
    (folder / "in" / "a.json").write_text("[" + ",".join(lines[:third]) + "]")  # one line
    (folder / "in" / "b.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines[third:2 * third]) + "\n").encode()))
    (folder / "in" / "c.jsonl").write_text("\n".join(lines[2 * third:]) + "\n")
    return str(folder / "in" / "*")


@pytest.mark.parametrize("shape", ["json-array", "gzip", "gzip-array", "glob"])
def test_workers_slicing_json_arrays_and_compressed_json_write_the_file_and_report_of_one_process(
        tmp_path, eight_cores, monkeypatch, shape):
    """JSON arrays and gzip JSON (Lines or array) are cut into byte ranges that the workers read themselves (a
    compressed file from its decompressed copy): the same file, report and row names as one process, nothing left."""
    import tempfile

    from conftest import chat_tokenizer

    lines = _chats(tmp_path, copies=40).read_text().splitlines()
    (tmp_path / "chats.jsonl").unlink()
    source = _write_shape(tmp_path, lines, shape)
    temporary = tmp_path.parent / f"{tmp_path.name}-tmp"  # where the decompressed copies are made
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    plans = _sliced(monkeypatch)
    kwargs = dict(tokenizer=chat_tokenizer("qwen2.5"), keep_dropped=True, max_drop_fraction=1.0, max_length=300,
                  batch_size=256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = mask_files(source, tmp_path / "one.parquet", **kwargs)
        two = mask_files(source, tmp_path / "two.parquet", num_proc=2, **kwargs)
    assert len(plans) == 1 and plans[0] is not None and len(plans[0]) >= 4  # read by the workers, in slices
    assert pq.read_table(tmp_path / "one.parquet").equals(pq.read_table(tmp_path / "two.parquet"))
    assert _report(one) == _report(two) and one.invalid_examples == two.invalid_examples
    assert two.rows_in == len(lines) and one.invalid_examples
    if shape == "glob":
        assert any("a.json, row " in e for e in two.invalid_examples)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [Path(source).name if shape != "glob" else "in", "one.parquet", "two.parquet"])
    assert list(temporary.iterdir()) == []


@pytest.mark.parametrize("fault", ["not-json", "unbalanced", "not-an-object", "no-comma", "not-utf-8",
                                   "trailing-comma", "after-the-array"])
@pytest.mark.parametrize("gzipped", [False, True], ids=["plain", "gzip"])
def test_a_malformed_item_of_a_json_array_read_by_workers_is_the_line_of_one_process(tmp_path, eight_cores, fault,
                                                                                       gzipped, monkeypatch):
    """Past the first rows (which fix the schema), a fault that an item holds is found by the worker reading it;
    one at the array's end makes the parent read the file itself. Either way: one process's line."""
    import gzip

    from conftest import chat_tokenizer

    rows = EXAMPLES.read_text().splitlines() * 100  # 12,000 items; item 11,000 is past the first rows
    text = "[\n" + ",\n".join(rows) + "\n]\n"
    at = text.index(rows[11_000], sum(len(r) + 2 for r in rows[:11_000]))
    broken = {"not-json": text[:at] + '{"messages": nope}' + text[at + len(rows[11_000]):],
              "unbalanced": text[:at] + '{"messages": [}' + text[at + len(rows[11_000]):],
              "not-an-object": text[:at] + "[1, 2]" + text[at + len(rows[11_000]):],
              "no-comma": text[:at - 2] + " " + text[at - 1:],
              "not-utf-8": None,
              "trailing-comma": text.rstrip()[:-1].rstrip() + ",\n]",
              "after-the-array": text + "{}"}[fault]
    data = broken.encode() if broken is not None else text[:at + 18].encode() + b"\xff" + text[at + 19:].encode()
    source = tmp_path / ("chats.json.gz" if gzipped else "chats.json")
    source.write_bytes(gzip.compress(data) if gzipped else data)
    kwargs = dict(tokenizer=chat_tokenizer("qwen2.5"), max_drop_fraction=1.0, batch_size=256)
    plans = _sliced(monkeypatch)
    with pytest.raises(ValueError) as one:
        mask_files(source, tmp_path / "one.parquet", **kwargs)
    with pytest.raises(ValueError) as two:
        mask_files(source, tmp_path / "two.parquet", num_proc=2, **kwargs)
    assert str(one.value) == str(two.value) and len(str(two.value).splitlines()) == 1
    assert "chats.json" in str(two.value)
    assert (plans == [None]) == (fault in ("unbalanced", "trailing-comma", "after-the-array"))
    if fault != "after-the-array":  # the item at fault (the one before a missing comma; after a trailing one)
        assert re.search(r", row (10999|11000|12000): ", str(two.value))
    assert sorted(p.name for p in tmp_path.iterdir()) == [source.name]


def test_json_array_items_are_found_in_any_chunks_as_a_plain_scan_finds_them():
    """The scan's kernel (``array_items.ArrayScan``) against a plain byte-by-byte reading, on arrays whose strings
    hold brackets, commas, quotes and runs of backslashes, fed in chunks that cut them anywhere."""
    import io
    import random

    from lossmask.jobs.array_items import ArrayScan, reference_item_commas, scan_array

    rng = random.Random(7)
    text = lambda: "".join(rng.choice(['a', '\\', '"', ',', '[', '{', '}', ']', ' ', 'é', '\n'])  # noqa: E731
                           for _ in range(rng.randint(0, 12)))
    for _ in range(60):
        items = [{"k" + text(): [text(), {"x": text()}, 1]} for _ in range(rng.randint(1, 30))]
        data = json.dumps(items, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1])).encode()
        commas = reference_item_commas(data)
        for chunk in (1, 3, 64, 1 << 20):
            scan = ArrayScan(rng.choice([1, 50, 10 ** 6]))
            for at in range(0, len(data), chunk):
                assert scan.feed(data[at:at + chunk])
            assert scan.finish() and scan.items == len(items)
            assert all(comma in commas for comma, _ in scan.cuts)
            assert scan.separators == len(commas)
            read = []
            for start, end, first, count in scan.ranges:
                assert first == len(read) and (end == len(data) - 1 or end in commas)
                read += json.loads(b"[" + data[start:end] + b"]")
                assert len(read) == first + count
            assert read == items
    for data, items in [(b"[]", 0), (b" [ ] \n", 0), (b"\xef\xbb\xbf[{}]", 1)]:
        scan = scan_array(io.BytesIO(data), 1)
        assert not scan.failed and scan.items == items
    for data in [b"[1,2,]", b"[1,2] x", b"[1,2", b"[1]]", b"x[1]", b'["a]', b"{}", b"[1}"]:
        assert scan_array(io.BytesIO(data), 1).failed


def test_json_lines_slices_are_cut_at_line_ends_and_counted_with_their_blank_lines(tmp_path):
    from lossmask.jobs.inputs import open_inputs
    from lossmask.jobs.slices import _json_lines_file_slices, count_json_lines, counted

    rows = [json.dumps({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]})
            for i in range(300)]
    text = "\n".join(rows[:100]) + "\n\n  \n" + "\r\n".join(rows[100:200]) + "\r\n\t\n" + "\n".join(rows[200:])  # no end
    (tmp_path / "a.jsonl").write_text(text)
    (tmp_path / "b.jsonl").write_text("\n".join(rows[:50]) + "\n")
    files = open_inputs(str(tmp_path / "*.jsonl"))
    plan = [piece for path in files.paths for piece in _json_lines_file_slices(path, files._local(path), 1_000)]
    data = {p: open(files._local(p), "rb").read() for p in files.paths}
    assert all(p.start == 0 or data[p.path][p.start - 1:p.start] == b"\n" for p in plan)  # each starts a line
    assert [(p.path, p.end) for p in plan if p.end == len(data[p.path])] == [(path, len(data[path])) for path in data]
    pieces = list(counted(plan, map(count_json_lines, plan)))
    assert sum(p.num_rows for p in pieces) == 350
    lines = {}
    for piece in pieces:
        files.record(piece)
        for row, n, line, unit in piece.segments():
            for k in range(n):
                lines[row + k] = (piece.path, line + k)
    real = [(str(tmp_path / "a.jsonl"), n + 1) for n, raw in enumerate(text.split("\n")) if raw.strip()]
    real += [(str(tmp_path / "b.jsonl"), n + 1) for n in range(50)]
    assert [lines[r] for r in range(350)] == real
    assert files.where(150) == f"{tmp_path / 'a.jsonl'}, line {real[150][1]}" and real[150][1] == 153


def test_a_compressed_file_is_decompressed_once_to_a_copy_that_is_gone_once_closed(tmp_path):
    import gzip

    from lossmask.jobs.inputs import open_inputs
    from lossmask.jobs.slices import JsonArraySlice, JsonLinesSlice, json_slices

    line = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress((line + "\n").encode() * 20_000))
    (tmp_path / "b.json.gz").write_bytes(gzip.compress(("[" + ",\n".join([line] * 20_000) + "]").encode()))
    files = open_inputs(str(tmp_path / "*.gz"))
    plan = json_slices(files, 1_000, 2)
    assert {type(p) for p in plan} == {JsonLinesSlice, JsonArraySlice} and len(plan) >= 8
    copies = {p.local for p in plan}
    assert len(copies) == 2 and all(os.path.getsize(c) > 1_000_000 for c in copies)
    assert sum(p.num_rows for p in plan if isinstance(p, JsonArraySlice)) == 20_000
    files.close()
    assert not any(os.path.exists(c) for c in copies)
    (tmp_path / "c.json.gz").write_bytes(gzip.compress(("[" + ",".join([line] * 10_001) + "] and more").encode()))
    assert json_slices(open_inputs(tmp_path / "c.json.gz"), 1_000, 2) is None  # the parent reads it, and says so


def test_workers_reading_their_own_json_lines_write_the_file_and_report_of_one_process(tmp_path, eight_cores):
    """A glob of JSON Lines files with blank lines, CRLF line ends and bad rows among them: the workers read byte
    ranges of the files themselves, with the same file, report and row names as one process."""
    from conftest import chat_tokenizer

    lines = _chats(tmp_path, copies=40).read_text().splitlines()
    (tmp_path / "chats.jsonl").unlink()
    lines[1_234] = '{"messages": [{"role": "user", "content": "broken"'  # not JSON: named by its line
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("\n".join(lines[:2_000]) + "\n\n\n" + "\r\n".join(lines[2_000:3_000]))
    (tmp_path / "in" / "b.jsonl").write_text("\n  \n".join(lines[3_000:]) + "\n")
    kwargs = dict(tokenizer=chat_tokenizer("qwen2.5"), keep_dropped=True, max_drop_fraction=1.0, max_length=300)
    source = str(tmp_path / "in" / "*.jsonl")
    with pytest.raises(ValueError) as one_error:
        mask_files(source, tmp_path / "one.parquet", **kwargs)
    with pytest.raises(ValueError) as two_error:
        mask_files(source, tmp_path / "two.parquet", num_proc=2, **kwargs)
    assert str(one_error.value) == str(two_error.value) and "a.jsonl, line 1235: not valid JSON" in str(two_error.value)
    (tmp_path / "in" / "a.jsonl").write_text((tmp_path / "in" / "a.jsonl").read_text().replace(lines[1_234], lines[0]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = mask_files(source, tmp_path / "one.parquet", **kwargs)
        two = mask_files(source, tmp_path / "two.parquet", num_proc=2, **kwargs)
    assert pq.read_table(tmp_path / "one.parquet").equals(pq.read_table(tmp_path / "two.parquet"))
    assert _report(one) == _report(two) and two.rows_in == len(lines)
    assert one.invalid_examples == two.invalid_examples
    assert any("a.jsonl, line 64): column 'messages' is empty" in e for e in two.invalid_examples)
    assert two.seconds["read"] > 0 and two.seconds.get("hand_out", 0) < two.seconds["worker"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "one.parquet", "two.parquet"]


def test_hf_workers_read_their_shards_from_the_dataset_arrow_cache_files(tmp_path, eight_cores, monkeypatch):
    """A dataset loaded from disk (two cache files, joined) is labelled by workers that map its Arrow files
    themselves: the dataset and report of one process. One selected, renamed or built in memory is handed out as
    batches."""
    datasets = pytest.importorskip("datasets")
    from conftest import chat_tokenizer

    from lossmask import hf
    from lossmask.jobs.slices import ArrowSlice, dataset_slices

    rows = [json.loads(line) for line in _chats(tmp_path, copies=40).read_text().splitlines()]  # two workers' worth
    datasets.Dataset.from_list(rows[:1_000]).save_to_disk(tmp_path / "a")
    datasets.Dataset.from_list(rows[1_000:]).save_to_disk(tmp_path / "b")
    ds = datasets.concatenate_datasets([datasets.load_from_disk(tmp_path / "a"), datasets.load_from_disk(tmp_path / "b")])
    plan = dataset_slices(ds, 700)
    assert plan is not None and [p.num_rows for p in plan] == [700] * 6 + [600]
    assert all(isinstance(p, ArrowSlice) and len(p.files) == 2 for p in plan)
    for other in (datasets.Dataset.from_list(rows[:10]), ds.select([3, 1, 2]), ds.rename_column("messages", "m")):
        assert dataset_slices(other, 700) is None
    tokenizer = chat_tokenizer("qwen2.5")
    kwargs = dict(return_report=True, quiet=True, keep_dropped=True, max_drop_fraction=1.0)
    one, report_one = hf.mask_dataset(ds, tokenizer, **kwargs)
    import os

    import lossmask.jobs.slices as slices

    read = slices.read_arrow_slice
    (tmp_path / "reads").mkdir()

    def reading(piece):  # (the forked workers have it too): which process read which shard
        (tmp_path / "reads" / f"{os.getpid()}-{piece.first}").touch()
        return read(piece)

    monkeypatch.setattr(slices, "read_arrow_slice", reading)
    two, report_two = hf.mask_dataset(ds, tokenizer, num_proc=2, **kwargs)
    readers = {int(p.name.split("-")[0]) for p in (tmp_path / "reads").iterdir()}
    assert len(readers) == 2 and os.getpid() not in readers
    assert one.data.table.equals(two.data.table) and _report(report_one) == _report(report_two)
    assert report_one.invalid_examples == report_two.invalid_examples and report_two.rows_in == len(rows)
