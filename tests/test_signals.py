"""SIGTERM and Ctrl-C that land while the labelling kernel runs: one line, exit 128 + the signal, nothing left.

A job labels 2 million pre-tokenised rows with ``--markers`` (the kernel is most of its time) and is
stopped at several delays after its partial output appears. Whatever the kernel was doing, the job must
end with the documented line and status, with no traceback, no partial file and no lock beside the
output.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lossmask
from conftest import wait_for_partial_output
from test_stream import MARKERS

ROWS = 2_000_000
CHAT = np.array([1, 3, 9, 4, 1, 2, 7, 8, 4], np.int32)  # a user turn, then an assistant turn


@pytest.fixture(scope="module")
def big_input(tmp_path_factory):
    folder = tmp_path_factory.mktemp("signals")
    offsets = np.arange(0, (ROWS + 1) * len(CHAT), len(CHAT), dtype=np.int32)
    ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.tile(CHAT, ROWS)))
    pq.write_table(pa.table({"input_ids": ids}), folder / "in.parquet", row_group_size=100_000)
    MARKERS.to_json(folder / "m.json")
    return folder


def _stop_job(folder, signals: list[int], delay: float) -> tuple[subprocess.Popen, str]:
    out = folder / "out.parquet"
    job = subprocess.Popen([sys.executable, "-m", "lossmask", "mask", str(folder / "in.parquet"), str(out),
                            "--markers", str(folder / "m.json"), "--batch-size", "20000", "--no-progress"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_partial_output(job, folder)
    time.sleep(delay)  # the labelling loop runs from the moment the partial output exists
    if job.poll() is not None:
        job.communicate()
        out.unlink(missing_ok=True)  # the next case expects the folder as it was
        pytest.skip("the job ended before it could be stopped")
    for k, signum in enumerate(signals):
        if k:
            time.sleep(0.05)
        job.send_signal(signum)
    _, err = job.communicate(timeout=300)  # a hang guard: it stops within a second when quiet
    return job, err


@pytest.mark.parametrize("delay", [0.0, 0.1, 0.2, 0.3, 0.5])
@pytest.mark.parametrize("signals", [[signal.SIGTERM], [signal.SIGINT], [signal.SIGINT, signal.SIGINT]],
                         ids=["sigterm", "sigint", "sigint-twice"])
def test_a_signal_while_the_kernel_labels_stops_the_job_with_one_line_and_leaves_nothing(big_input, signals, delay):
    job, err = _stop_job(big_input, signals, delay)
    name = signal.Signals(signals[0]).name
    out = big_input / "out.parquet"
    assert job.returncode == 128 + signals[0], err
    assert err == (f"lossmask mask: stopped by {name}; the partial output was removed, and {out} is as it was before "
                   "the job\n")
    assert sorted(os.listdir(big_input)) == ["in.parquet", "m.json"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_signal_that_lands_inside_the_kernel_is_raised_once_the_kernel_call_ends(signum, request):
    """In process, where it can be seen: the signal arrives while the labelling kernel runs (the block calls it until
    the handler has run, and once more), is held there, and is raised as ``JobStopped`` when the block ends, after
    the kernel returned whole. Raised inside numba's dispatch instead, it gave ``SystemError`` and two tracebacks."""
    import threading

    from lossmask.jobs import stopping

    offsets = np.arange(0, (ROWS + 1) * len(CHAT), len(CHAT), dtype=np.int64)
    ids = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.tile(CHAT, ROWS)))
    lossmask.label_batch(ids[:10], MARKERS)  # compiled (or loaded from the cache) before the clock starts
    calls, held_at_signal = [], []
    real_handler = stopping._on_signal

    def handler(sig, frame):
        held_at_signal.append(stopping._STATE["held"])
        real_handler(sig, frame)

    before = {sig: signal.getsignal(sig) for sig in stopping.STOP_SIGNALS}
    request.addfinalizer(lambda: [signal.signal(sig, h) for sig, h in before.items()])  # a stop leaves them ignored
    with stopping.stop_on_signals():
        signal.signal(signum, handler)
        timer = threading.Timer(0.05, os.kill, (os.getpid(), signum))
        timer.start()
        with pytest.raises(stopping.JobStopped) as stopped:
            with stopping.kernel_call():
                deadline = time.monotonic() + 60
                while not held_at_signal and time.monotonic() < deadline:
                    calls.append(lossmask.label_batch(ids, MARKERS).counts.rows)
                calls.append(lossmask.label_batch(ids, MARKERS).counts.rows)
        timer.join()
    assert held_at_signal == [1] and stopped.value.signum == signum
    assert len(calls) >= 2 and set(calls) == {ROWS}  # every call inside the block ran to its end


def test_a_signal_while_a_batch_is_handed_between_threads_is_raised_once_it_is_taken(request):
    """The signal arrives while the main thread waits for another thread's batch on a queue: it is held there, and
    raised as ``JobStopped`` once the batch is taken. Raised inside the queue's lock code, it could leave the lock
    released for the other thread or a wake-up lost, and the job's clean-up then waited for a thread never woken."""
    import queue
    import threading

    from lossmask.jobs import stopping

    handed, waiting, held_at_signal, taken = queue.Queue(maxsize=1), threading.Event(), [], []
    real_handler = stopping._on_signal

    def handler(sig, frame):
        held_at_signal.append(stopping._STATE["held"])
        real_handler(sig, frame)

    def reader():  # the signal once the main thread waits, the batch once the handler has run (deadlines: hang guards)
        waiting.wait(120)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 60
        while not held_at_signal and time.monotonic() < deadline:
            time.sleep(0.001)
        handed.put("batch")

    before = {sig: signal.getsignal(sig) for sig in stopping.STOP_SIGNALS}
    request.addfinalizer(lambda: [signal.signal(sig, h) for sig, h in before.items()])  # a stop leaves them ignored
    with stopping.stop_on_signals():
        signal.signal(signal.SIGTERM, handler)
        thread = threading.Thread(target=reader)
        thread.start()
        with pytest.raises(stopping.JobStopped) as stopped:
            with stopping.handing_over():
                waiting.set()
                taken.append(handed.get(timeout=120))
        thread.join()
    assert held_at_signal == [1] and taken == ["batch"] and stopped.value.signum == signal.SIGTERM


def test_sighup_stops_the_job_as_sigterm_does_and_leaves_nothing(big_input):
    """Closing the terminal sends SIGHUP: the job ends as under SIGTERM, with no partial output and no lock."""
    job, err = _stop_job(big_input, [signal.SIGHUP], 0.1)
    out = big_input / "out.parquet"
    assert job.returncode == 128 + signal.SIGHUP, err
    assert err == f"lossmask mask: stopped by SIGHUP; the partial output was removed, and {out} is as it was before the job\n"
    assert sorted(os.listdir(big_input)) == ["in.parquet", "m.json"]


def test_a_job_started_with_sighup_ignored_keeps_it_ignored():
    """``nohup lossmask mask ...``: the job was started to outlive its terminal, and does."""
    from lossmask.jobs import stopping

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with stopping.stop_on_signals():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == stopping._on_signal
    finally:
        signal.signal(signal.SIGHUP, before)
