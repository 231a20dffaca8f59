"""A job's worker processes die with it, and a killed worker ends its job cleanly.

Each case runs ``lossmask mask --num-proc 2`` as a process of its own and kills a process of it with SIGKILL (what the
out-of-memory killer or a scheduler's hard kill sends): the job itself, or one of its workers. Whatever was killed,
no process of the job may be left, nothing may be left beside the output but what the next job cleans, and a rerun
on the same output must start at once. Time limits are generous: the machines that run the suite are shared.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process table in /proc")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "chats.jsonl"


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _wait(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.fixture
def chats(tmp_path) -> Path:
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(EXAMPLES.read_text().splitlines() * 200) + "\n")  # 24,000 rows: a few seconds of work
    return path


def _job(chats: Path, out: Path, *extra: str) -> subprocess.Popen:
    from conftest import tokenizer_path

    return subprocess.Popen([sys.executable, "-m", "lossmask", "mask", str(chats), str(out), "--tokenizer",
                             str(tokenizer_path("qwen2.5")), "--num-proc", "2", "--no-progress",
                             "--max-drop-fraction", "1", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})


def _partial(folder: Path) -> Path | None:
    return next((p for p in folder.iterdir() if p.name.endswith(".partial")), None)


def _cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _started(job: subprocess.Popen, folder: Path, *, joined: bool) -> list[int]:
    """The job's two workers, once both have labelled for a while (and, with ``joined``, once a part has been
    joined into the output)."""
    def ready() -> bool:
        workers = _children(job.pid)
        if job.poll() is not None or len(workers) < 2 or min(map(_cpu_seconds, workers)) < 0.5:
            return False
        partial = _partial(folder)
        try:
            return partial is not None and (not joined or partial.stat().st_size > 4)  # more than the magic bytes
        except FileNotFoundError:
            return False

    if not _wait(ready, 240):
        job.kill()
        _, err = job.communicate()
        pytest.fail(f"the job did not start its workers: {err[-2000:]}")
    return _children(job.pid)


@pytest.mark.parametrize("joined", [False, True], ids=["while-labelling", "while-parts-are-joined"])
def test_sigkill_of_the_job_ends_its_workers_and_a_rerun_on_the_same_output_starts_at_once(tmp_path, chats, joined):
    out = tmp_path / "out.parquet"
    job = _job(chats, out)
    workers = _started(job, tmp_path, joined=joined)
    job.kill()
    job.wait(60)  # (its stderr stays open while any worker lives)
    _all_gone(workers)
    job.communicate(timeout=60)
    small = tmp_path / "small.jsonl"
    small.write_text(EXAMPLES.read_text())
    rerun = subprocess.run([sys.executable, "-m", "lossmask", "mask", str(small), str(out), "--tokenizer",
                            str(_tokenizer()), "--no-progress", "--max-drop-fraction", "1"],
                           capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "another lossmask job" not in rerun.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl", "out.parquet", "small.jsonl"]


def _one_line_after_a_worker_died(job: subprocess.Popen, workers: list[int], timeout: float) -> list[str]:
    """The job's stderr lines once one of its ``workers`` was killed: it must end (``timeout``, a hang guard) with
    exit 1 and one line naming the signal and the rows the worker held, its workers gone."""
    try:
        _, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [*_children(job.pid), job.pid]:
            os.kill(pid, signal.SIGKILL)
        job.communicate()
        pytest.fail("the job did not end after one of its workers was killed")
    finally:
        _all_gone(workers)
    assert job.returncode == 1, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert "killed by signal 9 (SIGKILL" in lines[0] and " while it held rows " in lines[0], lines[0]
    return lines


def _all_gone(workers: list[int]) -> None:
    """Fail if a worker outlives its job, killing it so that the test leaves none behind either."""
    if _wait(lambda: not any(_alive(w) for w in workers), 30):
        return
    for pid in workers:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    pytest.fail("a worker outlived its job")


def _tokenizer() -> Path:
    from conftest import tokenizer_path

    return tokenizer_path("qwen2.5")


@pytest.mark.parametrize("joined, parquet", [(False, False), (True, False), (True, True)],
                         ids=["while-labelling", "while-parts-are-joined", "reading-its-own-row-groups"])
def test_sigkill_of_a_worker_ends_the_job_with_one_line_and_leaves_nothing(tmp_path, chats, joined, parquet):
    out = tmp_path / "out.parquet"
    if parquet:  # row groups small enough for the workers to read them themselves (jobs/slices.py)
        import pyarrow.json as pj
        import pyarrow.parquet as pq

        pq.write_table(pj.read_json(chats), tmp_path / "chats.parquet", row_group_size=1_000)
        chats.unlink()
        chats = tmp_path / "chats.parquet"
    job = _job(chats, out, "--report", str(tmp_path / "report.json"))
    workers = _started(job, tmp_path, joined=joined)
    os.kill(workers[0], signal.SIGKILL)
    lines = _one_line_after_a_worker_died(job, workers, 120)
    # the rows' lines once the parent has them; the file at least (a worker killed as parts are joined may hold a
    # slice whose lines the parent has not taken yet)
    assert ("chats.parquet" if parquet else "chats.jsonl") in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [chats.name]


# The job, run by a script that pauses it as it starts to commit its output (every part copied in, the footer not yet
# written): it says so in a file (READY), then waits for another (GO), so that a test kills a process at that stage
# without racing a clock.
_PAUSED_AT_COMMIT = """
import os, sys, time
from lossmask.jobs.parquet_parts import PartsFile
ready, go = sys.argv[1], sys.argv[2]
close = PartsFile.close
def paused(self):
    open(ready, "w").close()
    deadline = time.monotonic() + 300  # a hang guard, far past any wait of the test
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.01)
    return close(self)
PartsFile.close = paused
from lossmask.cli import main
sys.exit(main(sys.argv[3:]))
"""


def _job_paused_at_commit(tmp_path: Path, chats: Path):
    """A two-worker job on ``chats`` held just before it commits its output: ``(job, its workers, OUTPUT, the file
    that lets it go on)``."""
    out, ready, go = tmp_path / "out.parquet", tmp_path / "ready", tmp_path / "go"
    job = subprocess.Popen([sys.executable, "-c", _PAUSED_AT_COMMIT, str(ready), str(go), "mask", str(chats),
                            str(out), "--tokenizer", str(_tokenizer()), "--num-proc", "2", "--no-progress",
                            "--max-drop-fraction", "1", "--report", str(tmp_path / "report.json")],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if not _wait(lambda: ready.exists() or job.poll() is not None, 300):
        job.kill()
    if not ready.exists():
        _, err = job.communicate(timeout=60)
        pytest.fail(f"the job did not reach its commit: {err[-2000:]}")
    workers = _children(job.pid)
    assert len(workers) == 2
    return job, workers, out, go


def test_sigkill_of_the_job_while_it_commits_its_output_ends_its_workers_and_the_rerun_cleans_up(tmp_path, chats):
    job, workers, out, go = _job_paused_at_commit(tmp_path, chats)
    job.kill()
    job.wait(60)
    _all_gone(workers)
    job.communicate(timeout=60)
    assert _partial(tmp_path) is not None  # left for the next job on OUTPUT to remove
    rerun = subprocess.run([sys.executable, "-m", "lossmask", "mask", str(chats), str(out), "--tokenizer",
                            str(_tokenizer()), "--no-progress", "--max-drop-fraction", "1", "--num-proc", "2"],
                           capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl", "out.parquet", "ready"]


def _exited(pid: int) -> bool:
    """Whether every thread of ``pid`` has ended: only then does its parent see it end (a killed process's main
    thread shows as a zombie while its other threads are still ending)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    return not any(_alive(int(task)) for task in tasks)


def test_sigkill_of_a_worker_while_the_job_commits_its_output_stops_it_with_one_line(tmp_path, chats):
    job, workers, out, go = _job_paused_at_commit(tmp_path, chats)
    os.kill(workers[0], signal.SIGKILL)
    assert _wait(lambda: _exited(workers[0]), 120)
    go.touch()
    lines = _one_line_after_a_worker_died(job, workers, 60)  # the job ends at once
    assert "chats.jsonl, lines " in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl", "go", "ready"]


def test_the_line_of_a_killed_worker_names_the_signal_and_the_rows_it_held():
    from lossmask.jobs.workers import WorkerDied

    died = str(WorkerDied(-signal.SIGKILL, 4_000, 512, where="chats.jsonl, lines 4001-4512"))
    assert died.startswith("a worker process was killed by signal 9 (SIGKILL, most often the out-of-memory killer) "
                           "while it held rows 4000-4511 (chats.jsonl, lines 4001-4512); ")
    assert "\n" not in died
    assert "a worker process exited with status 3 before it took any rows; " in str(WorkerDied(3))


@pytest.mark.parametrize("shape", ["jsonl", "json.gz"], ids=["json-lines", "gzip-json-array"])
def test_stdin_read_by_workers_gives_the_file_and_report_of_one_process(tmp_path, chats, shape):
    """Stdin is copied to a temporary file once (JSON Lines, or a gzip JSON array, decompressed once more), which the
    workers then read in byte ranges: the same output and report as one process, the copies removed."""
    import gzip
    import json

    import pyarrow.parquet as pq

    source = chats
    if shape == "json.gz":
        source = tmp_path / "chats.json.gz"
        source.write_bytes(gzip.compress(("[" + ",\n".join(chats.read_text().splitlines()) + "]").encode()))
        chats.unlink()
    outputs = {}
    for procs in ("1", "2"):
        out, report = tmp_path / f"out{procs}.parquet", tmp_path / f"report{procs}.json"
        with open(source, "rb") as stdin:
            done = subprocess.run([sys.executable, "-m", "lossmask", "mask", "-", str(out), "--tokenizer",
                                   str(_tokenizer()), "--num-proc", procs, "--no-progress", "--max-drop-fraction", "1",
                                   "--report", str(report)], stdin=stdin, capture_output=True, text=True, timeout=600,
                                  env={**os.environ, "PYTHONWARNINGS": "ignore", "TMPDIR": str(tmp_path)})
        assert done.returncode == 0, done.stderr[-2000:]
        counts = json.loads(report.read_text())
        outputs[procs] = pq.read_table(out), {k: v for k, v in counts.items() if k not in ("seconds", "messages", "output")}
    assert outputs["1"][0].equals(outputs["2"][0]) and outputs["1"][1] == outputs["2"][1]
    assert outputs["2"][1]["rows_in"] == 24_000
    assert sorted(p.name for p in tmp_path.iterdir()) == [source.name, "out1.parquet", "out2.parquet",
                                                        "report1.json", "report2.json"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="elsewhere the copy is removed at exit, not on SIGKILL")
def test_sigkill_of_a_job_reading_stdin_leaves_no_copy_of_it(tmp_path, chats):
    """Stdin's copy is unlinked as soon as it is made (the job and its workers read it through the job's descriptor),
    so a job killed while its workers label leaves nothing in ``TMPDIR``."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    out = tmp_path / "out.parquet"
    with open(chats, "rb") as stdin:
        job = subprocess.Popen([sys.executable, "-m", "lossmask", "mask", "-", str(out), "--tokenizer",
                                str(_tokenizer()), "--num-proc", "2", "--no-progress", "--max-drop-fraction", "1"],
                               stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONWARNINGS": "ignore", "TMPDIR": str(temporary)})
    workers = _started(job, tmp_path, joined=False)
    job.kill()
    job.wait(60)
    _all_gone(workers)
    job.communicate(timeout=60)
    assert list(temporary.iterdir()) == []
