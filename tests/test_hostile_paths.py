"""Hostile paths: one file under two names, names with control characters, a full TMPDIR, OUTPUT ``-``.

Jobs run on token ids with ``MARKERS`` (no tokenizer), through the command line where the contract is the
exit status and one line on stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq

from lossmask.jobs.stream import mask_files

from test_hostile import CHAT, partials, run_cli, small_filesystem
from test_stream import MARKERS, write_input


def test_a_file_and_its_hard_link_under_one_glob_are_read_once_and_said(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_input(data / "a.parquet", [CHAT] * 6)
    os.link(data / "a.parquet", data / "b.parquet")  # the same file (device and inode) under a second name
    for source in (str(data / "*.parquet"), data):
        report = mask_files(source, tmp_path / "out.parquet", markers=MARKERS)
        assert report.rows_in == 6 == report.rows_out, source
        assert pq.read_table(tmp_path / "out.parquet").num_rows == 6
    said = [m for m in report.messages if "b.parquet" in m]
    assert said == [f"skipped {data / 'b.parquet'}: the same file as {data / 'a.parquet'} (a hard link), read once"]
    assert said[0] in report.summary()


def test_a_newline_in_a_file_name_is_escaped_and_the_error_stays_one_line(tmp_path):
    MARKERS.to_json(tmp_path / "m.json")
    bad = tmp_path / "bad\nname.jsonl"
    bad.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 2,\n')
    code, _, err = run_cli(bad, tmp_path / "out.parquet", "--markers", tmp_path / "m.json")
    assert code == 1 and err == f"lossmask mask: error: {tmp_path}/bad\\nname.jsonl, line 2: not valid JSON " \
                                "(Expecting value at column 21)\n"
    data = tmp_path / "data"  # a file found in a folder, named by the row's location
    data.mkdir()
    write_input(data / "a.parquet", [CHAT] * 3)
    write_input(data / "b\nc.parquet", [CHAT, [1, 2, -3]])
    code, _, err = run_cli(data, tmp_path / "out.parquet", "--markers", tmp_path / "m.json")
    assert code == 1 and err.count("\n") == 1 and f"row 4 ({data}/b\\nc.parquet, row 1) holds the negative" in err
    code, _, err = run_cli(tmp_path / "missing\nname.jsonl", tmp_path / "out.parquet", "--markers", tmp_path / "m.json")
    assert code == 1 and err == f"lossmask mask: error: {tmp_path}/missing\\nname.jsonl: no such file or folder\n"
    os.link(data / "a.parquet", data / "a~\tlink.parquet")  # a report line naming a skipped file
    code, out, _ = run_cli(data / "a*.parquet", tmp_path / "out.parquet", "--markers", tmp_path / "m.json")
    assert code == 0 and f"skipped {data}/a~\\tlink.parquet: the same file as {data}/a.parquet" in out
    assert not partials(tmp_path)


def test_a_full_tmpdir_while_stdin_is_copied_is_one_line_naming_stdin_and_tmpdir(tmp_path):
    MARKERS.to_json(tmp_path / "m.json")
    with open(tmp_path / "in.jsonl", "w") as fh:  # 1.5 MB of JSON Lines, for a 64 KiB TMPDIR
        fh.writelines(json.dumps({"input_ids": CHAT, "note": "x" * 200}) + "\n" for _ in range(6000))
    with small_filesystem(tmp_path / "tmp", size="64k"), open(tmp_path / "in.jsonl", "rb") as stdin:
        done = subprocess.run([sys.executable, "-m", "lossmask", "mask", "-", str(tmp_path / "out.parquet"),
                               "--markers", str(tmp_path / "m.json"), "--no-progress"], stdin=stdin,
                              capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})
        assert done.returncode == 1 and done.stderr == (
            f"lossmask mask: error: <stdin>: cannot copy the stream to a temporary file in TMPDIR ({tmp_path / 'tmp'}): "
            "No space left on device; set TMPDIR to a folder with room for the whole input, or pass the input as a "
            "file\n")
        assert os.listdir(tmp_path / "tmp") == []
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "m.json", "tmp"]


def test_output_dash_is_refused_with_what_to_pass_instead(tmp_path, monkeypatch):
    write_input(tmp_path / "in.parquet", [CHAT] * 3)
    MARKERS.to_json(tmp_path / "m.json")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli("in.parquet", "-", "--markers", "m.json")
    assert code == 1 and out == "" and err == (
        "lossmask mask: error: OUTPUT -: a job writes Parquet to a file, not to stdout (the file is renamed into place "
        "only when the job succeeds); pass a file path such as out.parquet\n")
    assert sorted(os.listdir(tmp_path)) == ["in.parquet", "m.json"]
