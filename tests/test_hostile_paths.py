"""Hostile paths: one file under two names, names with control characters, a full TMPDIR, OUTPUT ``-``.

Jobs run on token ids with ``MARKERS`` (no tokenizer), through the command line where the contract is the
exit status and one line on stderr.
"""

from __future__ import annotations

import os

import pyarrow.parquet as pq

from lossmask.jobs.stream import mask_files

from test_hostile import CHAT, partials, run_cli
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
