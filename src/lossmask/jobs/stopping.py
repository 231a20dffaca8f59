"""SIGTERM, Ctrl-C and SIGHUP stop a job between kernel calls, never inside compiled code.

A Python signal handler runs in the main thread at the next point where the interpreter checks for
signals. Inside a numba dispatch (loading a cached kernel, unboxing its arguments) such a point is
C code calling back into Python: an exception raised there leaves the dispatcher returning a result with
an exception set (``SystemError``), and the job ends with two tracebacks instead of its clean-up. So,
while the command line runs a job (``stop_on_signals``), a signal raises ``JobStopped`` at once only
where no kernel is being called; inside ``kernel_call`` (the labelling step of one batch, a fraction of
a second) it is held, and raised as the block ends. The same holds inside ``handing_over``: where the main
thread hands a batch to another thread or takes one from it (a queue, a future). Raised there, inside the
lock and condition code of ``threading`` and ``queue``, the stop could leave a lock released for the thread
that held it or a wake-up lost, and the job's clean-up then waited forever for a thread that was never
woken. A second signal while the job already stops is ignored, so that the clean-up (partial files, the
lock) runs to its end.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name))
# SIGHUP (the terminal closed) stops a job as SIGTERM does, unless the job was started to outlive its terminal
# (``nohup``: the signal ignored when the process began), which it then keeps doing


class JobStopped(BaseException):
    """A stop signal, raised in the main thread: a ``BaseException``, as ``KeyboardInterrupt`` is, so that no
    ``except Exception`` keeps the job going, and the job's clean-up runs on the way out."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum, self.name = signum, signal.Signals(signum).name


_STATE = {"held": 0, "pending": None, "stopping": False}


def _on_signal(signum: int, frame) -> None:
    if _STATE["stopping"]:  # the job is already on its way out
        return
    if _STATE["held"]:
        _STATE["pending"] = _STATE["pending"] or signum
        return
    _STATE["stopping"] = True
    raise JobStopped(signum)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within this block, SIGTERM, SIGINT and SIGHUP raise ``JobStopped`` (between kernel calls); the handlers that were
    there before come back at its end, unless a signal stopped the job: then further ones are ignored (``SIG_IGN``,
    which the interpreter keeps while it finalises), so that a second Ctrl-C while the process exits does not kill
    it by the signal. Outside the main thread, where signals
    cannot be handled, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _STATE.update(held=0, pending=None, stopping=False)
    before = {signum: signal.signal(signum, _on_signal) for signum in STOP_SIGNALS
              if not (signum == getattr(signal, "SIGHUP", None) and signal.getsignal(signum) == signal.SIG_IGN)}
    try:
        yield
    finally:
        for signum, handler in before.items():  # after a stop, ignored: the exit may take a while (threads end)
            signal.signal(signum, signal.SIG_IGN if _STATE["stopping"] else handler)


@contextlib.contextmanager
def kernel_call() -> Iterator[None]:
    """Hold a stop signal that arrives in this block (main thread) until the block ends, then raise it."""
    with _held():
        yield


@contextlib.contextmanager
def handing_over() -> Iterator[None]:
    """Hold a stop signal while the main thread hands work to another thread or waits for it (``queue.Queue.put``,
    ``Future.result``, the next batch of a reading thread), then raise it: never inside a lock's code."""
    with _held():
        yield


@contextlib.contextmanager
def _held() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _STATE["held"] += 1
    try:
        yield
    finally:
        _STATE["held"] -= 1
    if not _STATE["held"] and _STATE["pending"] is not None and not _STATE["stopping"]:
        _STATE["stopping"] = True
        raise JobStopped(_STATE["pending"])
