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


def test_only_the_program_sets_the_allocator_for_a_long_job(monkeypatch, capsys):
    """``lossmask`` (the program) keeps glibc's heaps small before it runs; ``main`` from Python changes nothing
    process-wide."""
    calls = []
    monkeypatch.setattr("lossmask.jobs.allocator.keep_heaps_small", lambda: calls.append(1) or True)
    assert main([]) == 2 and calls == []  # (no command: usage, exit status 2)
    monkeypatch.setattr(cli, "main", lambda argv=None: 0)
    assert cli.command() == 0 and calls == [1]


_BLOCK_MAPPED_AGAIN = """
import ctypes, sys
from lossmask.jobs.allocator import keep_heaps_small
set_now = keep_heaps_small()
libc = ctypes.CDLL(None)

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
# glibc raises its mmap threshold past a mapped block once that block is freed: the next one of that size then
# comes from the heap, and stays there when freed, unless the threshold was fixed
libc.free(libc.malloc(3 << 20))
mapped = libc.mallinfo2().hblks
block = libc.malloc((3 << 20) - (64 << 10))
print(set_now, libc.mallinfo2().hblks > mapped)
"""


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="glibc's allocator")
@pytest.mark.parametrize("environment, expected", [({}, "True True"), ({"MALLOC_ARENA_MAX": "4"}, "False False"),
                                                   ({"LOSSMASK_MALLOC": "default"}, "False False")])
def test_the_allocator_setting_holds_and_the_environment_wins(environment, expected):
    import ctypes
    import subprocess
    import sys

    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("not glibc 2.33 or later")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LOSSMASK_MALLOC"}
    out = subprocess.run([sys.executable, "-c", _BLOCK_MAPPED_AGAIN], env={**env, **environment},
                         capture_output=True, text=True, check=True).stdout.split()
    assert " ".join(out) == expected
