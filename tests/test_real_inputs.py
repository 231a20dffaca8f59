"""Inputs as real datasets arrive: compressed, piped, JSON arrays, globs over symlinks, hostile lines and
columns, a stopped job, two jobs on one output, and misleading names.

Each test names the input and what the job does with it. Jobs run on token ids with ``MARKERS`` (no
tokenizer), so each test takes well under a second or two.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lossmask.cli import main
from lossmask.jobs.stream import mask_files

from conftest import wait_for_partial_output
from test_stream import MARKERS, write_input

CHAT = [1, 3, 9, 4, 1, 2, 7, 8, 4]  # a user turn, then an assistant turn that trains 7 8 4
ROWS = [{"id": i, "input_ids": CHAT} for i in range(7)]
LINES = "".join(json.dumps(row) + "\n" for row in ROWS).encode()


def run_cli(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["mask", *map(str, args), "--no-progress"])
    return code, out.getvalue(), err.getvalue()


def run_cli_process(*args, stdin: bytes | None = None, preexec_fn=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lossmask", "mask", *map(str, args), "--no-progress"],
                          input=stdin, capture_output=True, preexec_fn=preexec_fn, timeout=60)


def compress(codec: str, data: bytes) -> bytes:
    if codec == "gzip":
        return gzip.compress(data)
    if codec == "bz2":
        return bz2.compress(data)
    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, "zstd") as stream:
        stream.write(data)
    return sink.getvalue().to_pybytes()


def ids_out(path) -> list[int]:
    return pq.read_table(path).column("id").to_pylist()


@pytest.fixture
def markers_file(tmp_path):
    MARKERS.to_json(tmp_path / "m.json")
    return tmp_path / "m.json"


# -- 6: compressed and piped input, JSON arrays -------------------------------------------------------------


@pytest.mark.parametrize("codec, name", [("gzip", "in.jsonl.gz"), ("zstd", "in.jsonl.zst"), ("bz2", "in.jsonl.bz2"),
                                         ("gzip", "in.json.gz"), ("zstd", "in.ndjson.zst"), ("bz2", "in"),
                                         ("zstd", "in.data")])
def test_compressed_json_lines_are_read(tmp_path, codec, name):
    (tmp_path / name).write_bytes(compress(codec, LINES))  # "in" and "in.data": told by the magic bytes
    report = mask_files(tmp_path / name, tmp_path / "out.parquet", markers=MARKERS)
    assert report.rows_in == len(ROWS) == report.rows_out
    assert ids_out(tmp_path / "out.parquet") == list(range(len(ROWS)))


def test_a_truncated_compressed_file_is_one_line_naming_it(tmp_path, markers_file):
    data = compress("gzip", LINES * 50)
    (tmp_path / "in.jsonl.gz").write_bytes(data[: len(data) // 2])
    code, _, err = run_cli(tmp_path / "in.jsonl.gz", tmp_path / "out.parquet", "--markers", markers_file)
    assert code == 1 and err.count("\n") == 1 and "in.jsonl.gz" in err and "gzip" in err, err
    assert not (tmp_path / "out.parquet").exists()


def test_a_pipe_is_read_once(tmp_path):
    """``<(zcat x.jsonl.gz)`` is a pipe named /dev/fd/N: the rows are read, once, and the compression is seen."""
    for payload in (LINES, compress("gzip", LINES)):
        read_end, write_end = os.pipe()

        def feed():
            with os.fdopen(write_end, "wb") as fh:
                fh.write(payload)

        writer = threading.Thread(target=feed)
        writer.start()
        try:
            report = mask_files(f"/dev/fd/{read_end}", tmp_path / "out.parquet", markers=MARKERS)
        finally:
            writer.join()
            os.close(read_end)
        assert report.rows_in == len(ROWS) == report.rows_out
        assert ids_out(tmp_path / "out.parquet") == list(range(len(ROWS)))
    assert sorted(os.listdir(tmp_path)) == ["out.parquet"]


@pytest.mark.parametrize("source, codec", [("-", None), ("/dev/stdin", "zstd")])
def test_stdin_is_read_once(tmp_path, markers_file, source, codec):
    data = LINES if codec is None else compress(codec, LINES)
    done = run_cli_process(source, tmp_path / "out.parquet", "--markers", markers_file, stdin=data)
    assert done.returncode == 0, done.stderr
    assert ids_out(tmp_path / "out.parquet") == list(range(len(ROWS)))


@contextlib.contextmanager
def unblocked(fifo):
    """While the test runs, open ``fifo`` for writing and close it again whenever a reader waits on it, so that a
    reader that opens it a second time (or a FIFO nobody writes) gets an end of file instead of waiting for ever."""
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # no reader at the moment
                pass
            stop.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()


def test_a_fifo_is_read_once_and_one_in_a_folder_does_not_hang(tmp_path):
    fifo = tmp_path / "live.jsonl"
    os.mkfifo(fifo)

    def feed():
        with open(fifo, "wb") as fh:
            fh.write(LINES)

    writer = threading.Thread(target=feed)
    writer.start()
    time.sleep(0.05)
    with unblocked(fifo):  # started after the writer, so that the first reader meets the data
        report = mask_files(fifo, tmp_path / "out.parquet", markers=MARKERS)
        writer.join()
        assert report.rows_in == len(ROWS) == report.rows_out
        # a folder holding a FIFO that nobody writes: the FIFO is left out, and said so
        folder = tmp_path / "data"
        folder.mkdir()
        (folder / "a.jsonl").write_bytes(LINES)
        os.mkfifo(folder / "b.jsonl")
        with unblocked(folder / "b.jsonl"):
            report = mask_files(folder, tmp_path / "out.parquet", markers=MARKERS)
    assert report.rows_in == len(ROWS) == report.rows_out
    assert any("b.jsonl" in m and "not a regular file" in m for m in report.messages), report.messages


def test_json_array_files_are_read_as_rows(tmp_path, markers_file):
    (tmp_path / "records.json").write_text(json.dumps(ROWS))  # what pandas to_json(orient="records") writes
    (tmp_path / "pretty.json").write_text(json.dumps(ROWS, indent=2))  # json.dump(rows, fh, indent=2)
    (tmp_path / "pretty.json.gz").write_bytes(compress("gzip", json.dumps(ROWS, indent=2).encode()))
    for name in ("records.json", "pretty.json", "pretty.json.gz"):
        report = mask_files(tmp_path / name, tmp_path / "out.parquet", markers=MARKERS, batch_size=3)
        assert report.rows_in == len(ROWS) == report.rows_out, name
        assert ids_out(tmp_path / "out.parquet") == list(range(len(ROWS)))
    # an error names the row of the array (0-based, as lossmask numbers rows)
    text = json.dumps(ROWS[:3])[:-1] + ', {"id": 3, "input_ids": [1, 2,]}]'
    (tmp_path / "bad.json").write_text(text)
    code, _, err = run_cli(tmp_path / "bad.json", tmp_path / "out2.parquet", "--markers", markers_file)
    assert code == 1 and err.count("\n") == 1 and "bad.json, row 3: not valid JSON" in err, err
    (tmp_path / "list.json").write_text(json.dumps([ROWS[0], [1, 2]]))
    code, _, err = run_cli(tmp_path / "list.json", tmp_path / "out2.parquet", "--markers", markers_file)
    assert code == 1 and "list.json, row 1: holds a list, not a JSON object" in err, err
    assert not (tmp_path / "out2.parquet").exists()


# -- 7: a recursive glob through a symlink loop ---------------------------------------------------------------


def test_symlink_loop_glob_reads_each_file_once(tmp_path):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "other").mkdir()
    write_input(data / "a.parquet", [CHAT] * 3)
    write_input(data / "sub" / "b.parquet", [CHAT] * 2)
    os.symlink("..", data / "sub" / "up")  # a loop: glob.glob listed each file 41 times
    os.symlink("../a.parquet", data / "sub" / "same.parquet")  # another name for a.parquet
    for source in (str(data / "**" / "*.parquet"), str(data / "**"), data):
        report = mask_files(source, tmp_path / "out.parquet", markers=MARKERS)
        assert report.rows_in == 5 == report.rows_out, source
        assert ids_out(tmp_path / "out.parquet") == [0, 1, 2, 0, 1]  # the first name of each file, in sorted order
    assert any("same.parquet" in m and "a.parquet" in m for m in report.messages), report.messages


def test_two_symlink_loops_are_walked_once_each(tmp_path):
    """With two loops, glob.glob would walk 2^40 paths (every mix of the two up to the kernel's 40 links), so this
    asks the walk itself rather than a job, which on a glob without loop checks would never end."""
    from lossmask.jobs.locations import glob_files

    data = tmp_path / "data"
    for sub in ("a", "b"):
        (data / sub).mkdir(parents=True)
        os.symlink("..", data / sub / "up")
        write_input(data / sub / "x.parquet", [CHAT])
    found = glob_files(str(data / "**" / "*.parquet"))
    assert found == [str(data / "a" / "x.parquet"), str(data / "b" / "x.parquet")]  # no folder entered from within
    report = mask_files(str(data / "**" / "*.parquet"), tmp_path / "out.parquet", markers=MARKERS)
    assert report.rows_in == 2 == report.rows_out


# -- 9: one line naming file and line or row, never a traceback -----------------------------------------------


def test_deeply_nested_json_line_is_one_line(tmp_path, markers_file):
    deep = '{"input_ids": [1, 2, 7], "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
    (tmp_path / "deep.jsonl").write_text(json.dumps(ROWS[0]) + "\n" + deep)
    code, _, err = run_cli(tmp_path / "deep.jsonl", tmp_path / "out.parquet", "--markers", markers_file)
    assert code == 1 and err.count("\n") == 1 and "deep.jsonl, line 2: " in err and "nested" in err, err
    (tmp_path / "deep.json").write_text("[" + json.dumps(ROWS[0]) + ", " + deep.strip() + "]")
    code, _, err = run_cli(tmp_path / "deep.json", tmp_path / "out.parquet", "--markers", markers_file)
    assert code == 1 and err.count("\n") == 1 and "deep.json, row 1: " in err and "nested" in err, err
    assert not (tmp_path / "out.parquet").exists()


def test_unknown_compression_is_refused_with_the_codecs(tmp_path, markers_file):
    (tmp_path / "in.jsonl").write_bytes(LINES)
    code, _, err = run_cli(tmp_path / "in.jsonl", tmp_path / "out.parquet", "--markers", markers_file,
                           "--compression", "rar")
    assert code == 1 and err.count("\n") == 1, err
    assert "'rar'" in err and all(codec in err for codec in ("snappy", "zstd", "gzip", "none")), err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "m.json"]
    assert run_cli(tmp_path / "in.jsonl", tmp_path / "out.parquet", "--markers", markers_file,
                   "--compression", "ZSTD")[0] == 0


def test_lone_surrogate_names_file_and_line(tmp_path, markers_file):
    for value in ('"\\ud800"', '{"text": "ok \\udfff"}'):  # a string column, and text inside an object
        lines = [json.dumps(row) for row in ROWS]
        lines[2] = '{"id": 2, "input_ids": [1, 2, 7], "note": ' + value + "}"
        (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
        code, _, err = run_cli(tmp_path / "in.jsonl", tmp_path / "out.parquet", "--markers", markers_file)
        assert code == 1 and err.count("\n") == 1 and "in.jsonl, line 3: " in err and "surrogate" in err, err
    # a pair (an emoji written with ASCII escapes) is text
    (tmp_path / "in.jsonl").write_text('{"id": 0, "input_ids": [1, 2, 7], "note": "\\ud83d\\ude00"}\n')
    assert run_cli(tmp_path / "in.jsonl", tmp_path / "out.parquet", "--markers", markers_file)[0] == 0
    assert pq.read_table(tmp_path / "out.parquet").column("note").to_pylist() == ["\U0001F600"]


def _invalid_utf8_strings(values: list[bytes]) -> pa.Array:
    """A string array holding the bytes as they are (Arrow checks UTF-8 only when asked to)."""
    offsets = [0]
    for value in values:
        offsets.append(offsets[-1] + len(value))
    return pa.StringArray.from_buffers(len(values), pa.array(offsets, pa.int32()).buffers()[1],
                                       pa.py_buffer(b"".join(values)))


def test_invalid_utf8_in_a_parquet_string_column_names_file_and_row(tmp_path, markers_file):
    folder = tmp_path / "data"
    folder.mkdir()
    write_input(folder / "a.parquet", [CHAT] * 4, note=pa.array(["x"] * 4))
    notes = [b"fine", b"caf\xe9", b"ok"]
    write_input(folder / "b.parquet", [CHAT] * 3, note=_invalid_utf8_strings(notes))
    code, _, err = run_cli(folder, tmp_path / "out.parquet", "--markers", markers_file)
    assert code == 1 and err.count("\n") == 1 and "b.parquet, row 1: " in err and "'note'" in err, err
    assert "UTF-8" in err
    # inside messages-like structs too
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    chats = pa.array([[{"role": "user", "content": "hi"}]] * 2, pa.list_(message))
    content = _invalid_utf8_strings([b"hi", b"\xff"])
    bad = pa.ListArray.from_arrays(chats.offsets, pa.StructArray.from_arrays([chats.values.field(0), content],
                                                                             ["role", "content"]))
    pq.write_table(pa.table({"id": [0, 1], "input_ids": [CHAT, CHAT], "chat": bad}), tmp_path / "c.parquet")
    code, _, err = run_cli(tmp_path / "c.parquet", tmp_path / "out.parquet", "--markers", markers_file)
    assert code == 1 and err.count("\n") == 1 and "c.parquet, row 1: " in err and "'chat'" in err, err
    assert not (tmp_path / "out.parquet").exists()


# -- 10: the length of one line is bounded ---------------------------------------------------------------------


def test_a_line_over_the_limit_is_one_error_line(tmp_path, markers_file):
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as fh:
        fh.write(LINES)
        fh.truncate(len(LINES) + (64 << 20) + 10)  # a sparse run of 64 MiB of NUL bytes, with no line end
    code, _, err = run_cli(path, tmp_path / "out.parquet", "--markers", markers_file)
    assert code == 1 and err.count("\n") == 1, err
    assert f"big.jsonl, line {len(ROWS) + 1}: " in err and "64 MiB" in err, err
    assert not (tmp_path / "out.parquet").exists()


def test_dev_zero_ends_with_one_error_line(tmp_path, markers_file):
    resource = pytest.importorskip("resource")

    def limit():  # so that a reader without a bound fails here instead of taking the machine's memory
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    done = run_cli_process("/dev/zero", tmp_path / "out.parquet", "--markers", markers_file, "--input-format", "json",
                           preexec_fn=limit)
    assert done.returncode == 1, done.stderr
    err = done.stderr.decode()
    assert err.count("\n") == 1 and "/dev/zero, line 1: " in err and "64 MiB" in err, err
    assert sorted(os.listdir(tmp_path)) == ["m.json"]


# -- 11: SIGTERM -------------------------------------------------------------------------------------------------


def test_sigterm_exits_143_with_one_line_and_leaves_nothing(tmp_path, markers_file):
    write_input(tmp_path / "in.parquet", [CHAT] * 20_000)  # in batches of 1 row: seconds of work, so it is stopped
    job = subprocess.Popen([sys.executable, "-m", "lossmask", "mask", str(tmp_path / "in.parquet"),
                            str(tmp_path / "out.parquet"), "--markers", str(markers_file), "--batch-size", "1",
                            "--no-progress"], stderr=subprocess.PIPE, text=True)
    if not wait_for_partial_output(job, tmp_path):
        pytest.skip("the job finished before it could be stopped")
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=300)  # a hang guard: it ends within a second when quiet
    assert job.returncode == 143, err
    assert err.count("\n") == 1 and "stopped by SIGTERM" in err and "partial output was removed" in err, err
    assert sorted(os.listdir(tmp_path)) == ["in.parquet", "m.json"]


# -- 12: two jobs on one output ----------------------------------------------------------------------------------


def test_a_second_job_on_one_output_is_refused_naming_the_first(tmp_path, markers_file):
    from lossmask.jobs.outputs import output_lock

    (tmp_path / "in.jsonl").write_bytes(LINES)
    out = tmp_path / "out.parquet"
    with output_lock(str(out)):  # what a job holds while it writes out.parquet
        code, _, err = run_cli(tmp_path / "in.jsonl", out, "--markers", markers_file)
        assert code == 1 and err.count("\n") == 1 and f"pid {os.getpid()}" in err and "out.parquet" in err, err
        assert not out.exists()
    code, _, err = run_cli(tmp_path / "in.jsonl", out, "--markers", markers_file)
    assert code == 0, err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "m.json", "out.parquet"]  # the lock went with the job
    # a lock file left by a killed job (nobody holds it) does not stop the next one
    (tmp_path / ".out.parquet.lock").write_text("999999\n")
    assert run_cli(tmp_path / "in.jsonl", out, "--markers", markers_file)[0] == 0
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "m.json", "out.parquet"]


# -- 13: misleading messages -------------------------------------------------------------------------------------


def test_missing_tokenizer_folder_says_it_does_not_exist(tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    for folder in (tmp_path / "nope", "./no/such/tokenizer"):
        code, _, err = run_cli(tmp_path / "in.jsonl", tmp_path / "out.parquet", "--tokenizer", folder)
        assert code == 1 and err.count("\n") == 1 and f"{folder}" in err and "does not exist" in err, err
        assert "Repo id" not in err


def test_output_named_for_another_format_is_refused(tmp_path, markers_file):
    (tmp_path / "in.jsonl").write_bytes(LINES)
    for name in ("out.jsonl", "out.json", "out.csv", "out.arrow", "out.jsonl.gz"):
        code, _, err = run_cli(tmp_path / "in.jsonl", tmp_path / name, "--markers", markers_file)
        assert code == 1 and err.count("\n") == 1 and name in err and ".parquet" in err, err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "m.json"]
    for name in ("out.parquet", "out.pq", "out"):  # Parquet names, and a name without a suffix
        assert run_cli(tmp_path / "in.jsonl", tmp_path / name, "--markers", markers_file)[0] == 0


def test_input_ids_and_messages_says_which_is_used(tmp_path, markers_file):
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    pq.write_table(pa.table({"input_ids": [CHAT] * 3, "messages": [chat] * 3}), tmp_path / "in.parquet")
    with pytest.warns(UserWarning) as caught:
        report = mask_files(tmp_path / "in.parquet", tmp_path / "out.parquet", markers=MARKERS)
    said = [str(w.message) for w in caught if "messages" in str(w.message)]
    assert len(said) == 1, said
    assert "'input_ids'" in said[0] and "--input-ids-column" in said[0], said[0]
    assert report.rows_out == 3
    done = run_cli_process(tmp_path / "in.parquet", tmp_path / "out.parquet", "--markers", markers_file)
    err = done.stderr.decode()
    assert done.returncode == 0 and err.count("has both") == 1 and "--input-ids-column" in err, err
