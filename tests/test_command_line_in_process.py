"""``lossmask.cli.main`` called from Python (a test, a notebook) leaves the process as it found it: the warning
format, the signal handlers and the environment; while it runs, only lossmask's own warnings are reformatted."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import warnings

import pytest

import lossmask.cli as cli
from lossmask.cli import main

from conftest import tokenizer_path

ADVICE = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


def test_calling_the_command_line_leaves_the_process_as_it_was(tmp_path, monkeypatch):
    monkeypatch.delenv(ADVICE, raising=False)
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                               {"role": "assistant", "content": "Hello."}]}) + "\n")
    formatwarning = warnings.formatwarning
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGXFSZ, signal.SIGTERM, signal.SIGINT)}
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            pytest.warns(UserWarning, match="'wizard'"):
        # a warning lossmask gives (a weight for a role no template writes) goes through the CLI's format
        assert main(["mask", str(source), str(tmp_path / "out.parquet"), "--tokenizer", str(tokenizer_path("chatml")),
                     "--no-progress", "--weights-by-role", "wizard=1"]) == 0
    assert warnings.formatwarning is formatwarning
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    assert ADVICE not in os.environ
    later = warnings.formatwarning("from another library", UserWarning, "/elsewhere/library.py", 7)
    assert not later.startswith("lossmask") and "library.py:7: UserWarning: from another library" in later


def test_a_caller_setting_of_the_environment_is_kept(monkeypatch, capsys):
    monkeypatch.setenv(ADVICE, "0")
    assert main(["detect", str(tokenizer_path("chatml"))]) == 0
    assert os.environ[ADVICE] == "0"


def test_during_a_job_only_lossmask_warnings_are_one_line():
    own = os.path.join(os.path.dirname(cli.__file__), "options.py")
    with cli._warnings_on_one_line():
        assert warnings.formatwarning("a role no template writes", UserWarning, own, 3) == \
            "lossmask mask: warning: a role no template writes\n"
        other = warnings.formatwarning("deprecated", FutureWarning, "/elsewhere/library.py", 9)
    assert other.startswith("/elsewhere/library.py:9: FutureWarning: deprecated")
