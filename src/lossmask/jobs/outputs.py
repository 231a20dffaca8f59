"""Where a masking job writes: checked before the job starts, written under partial names, committed together.

A job writes each of its outputs (the data, and the report when asked) to a hidden partial file beside
its target, ``.NAME.PID.partial``, and renames them all onto their targets only when the whole job
succeeded; on any failure the partials are removed, so a target is either the previous file or the
complete new one. A partial whose process is gone (a killed job) is removed when the next job on the
same target starts. OS errors become one ``OutputError`` line naming the path and the cause.

While a job writes, it holds a lock on its output (``output_lock``: ``.NAME.lock`` beside it), so that a
second job on the same output is refused instead of both writing and one report disagreeing with the
file. The output is Parquet: a name that says another format (``out.jsonl``) is refused.
"""

from __future__ import annotations

import os
import re
import shutil
from contextlib import contextmanager
from typing import Iterable, Iterator

PARQUET_CODECS = ("snappy", "zstd", "lz4", "gzip", "brotli", "none")
# suffixes that name another format than the Parquet a job writes
OTHER_FORMATS = {".jsonl": "JSON Lines", ".json": "JSON", ".ndjson": "JSON Lines", ".csv": "CSV", ".tsv": "TSV",
                 ".txt": "text", ".arrow": "Arrow IPC", ".feather": "Feather", ".ipc": "Arrow IPC",
                 ".gz": "gzip", ".bz2": "bzip2", ".zst": "zstd", ".xz": "xz", ".zip": "zip"}


class OutputError(OSError):
    """An output location that cannot be written (missing or unwritable folder, a folder in the way, disk full)."""


def check_output(path: str | os.PathLike, *, what: str = "output", inputs: Iterable[str] = ()) -> str:
    """``path`` as a string, after checking that a job can write there; raises ``OutputError`` or ``ValueError``."""
    path = os.fspath(path)
    real = os.path.realpath(path)
    for source in inputs:
        if os.path.realpath(source) == real:
            raise ValueError(f"{what} {path} is the input {source} ({real}); write the {what} to another path")
    if os.path.isdir(path):
        example = os.path.join(path, "masked.parquet" if what == "output" else "report.json")
        raise OutputError(f"{path}: is a folder; pass a file path for the {what} (e.g. {example})")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise OutputError(f"{path}: the folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"{path}: the folder {folder} is not writable")
    return path


def check_output_format(path: str) -> None:
    """Refuse an output whose suffix names another format than Parquet (``out.jsonl`` would hold Parquet), and ``-``
    (which would be a file named ``-``: Parquet is written to a file, renamed onto its name when the job succeeds)."""
    if path == "-":
        raise ValueError("OUTPUT -: a job writes Parquet to a file, not to stdout (the file is renamed into place "
                         "only when the job succeeds); pass a file path such as out.parquet")
    suffix = os.path.splitext(path)[1].lower()
    if suffix in OTHER_FORMATS:
        stem = os.path.basename(path)[: -len(suffix)]
        stem = os.path.splitext(stem)[0] if os.path.splitext(stem)[1].lower() in OTHER_FORMATS else stem
        raise ValueError(f"{path}: the name says {OTHER_FORMATS[suffix]}, but a job writes Parquet; name the output "
                         f"{stem}.parquet (pyarrow or pandas convert it if you need {OTHER_FORMATS[suffix]})")


def check_compression(compression: object) -> None:
    """Refuse a Parquet codec that does not exist or that this pyarrow was built without, listing those there are."""
    if not isinstance(compression, str):
        return  # a dict per column, or None: pyarrow judges it
    import pyarrow as pa

    name = compression.lower()
    if name not in PARQUET_CODECS or (name != "none" and not pa.Codec.is_available(name)):
        there = [codec for codec in PARQUET_CODECS if codec == "none" or pa.Codec.is_available(codec)]
        raise ValueError(f"compression={compression!r} is not a Parquet codec here; pass one of {', '.join(there)} "
                         "(--compression)")


_HELD_LOCKS: set[int] = set()  # the descriptors of the output locks this process holds


def _close_inherited_locks() -> None:
    """In a forked child (a worker): close the lock descriptors it inherited. A ``flock`` lock lasts while any
    descriptor of it is open, so a child that kept one would hold its job's lock after the job ended."""
    for fd in _HELD_LOCKS:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD_LOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_locks)


def lock_name(path: str) -> str:
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.lock")


@contextmanager
def output_lock(path: str) -> Iterator[str]:
    """Hold the lock of output ``path`` while the block runs; raise ``OutputError`` naming the job that holds it.

    The lock is ``flock`` on ``.NAME.lock`` beside the output, which holds the pid of its job: the system
    releases it when that process ends, however it ends, so a lock file left by a killed job stops nobody. A
    process forked by the job (a worker) closes its copy of the lock at once, so that it never holds it.
    The file is removed on the way out. (Where ``fcntl`` is missing, as on Windows, no lock is taken.)
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield lock_name(path)
        return
    lock = lock_name(path)
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise as_output_error(exc, lock) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise OutputError(f"{path}: another lossmask job (pid {holder}) is writing this output now ({lock} is "
                              "locked); wait for it to end, or write to another path") from None
        # its last holder may have removed the file between our open and our lock: then lock the new one
        try:
            current = os.path.samestat(os.fstat(fd), os.stat(lock))
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)
    _HELD_LOCKS.add(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield lock
    finally:
        remove_quietly(lock)  # before the lock goes, so that the next job locks a file that stays
        _HELD_LOCKS.discard(fd)
        os.close(fd)


def partial_name(path: str) -> str:
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.{os.getpid()}.partial")


def remove_stale_partials(path: str) -> list[str]:
    """Remove the partials of ``path`` left by jobs whose process is gone; one message per removal."""
    folder, name = os.path.split(os.path.abspath(path))
    pattern = re.compile(rf"^\.{re.escape(name)}\.(\d+)\.partial$")
    messages = []
    try:
        entries = os.listdir(folder)
    except OSError:
        return messages
    for entry in entries:
        match = pattern.match(entry)
        if not match or int(match.group(1)) == os.getpid() or _alive(int(match.group(1))):
            continue
        stale = os.path.join(folder, entry)
        try:
            if os.path.isdir(stale) and not os.path.islink(stale):
                shutil.rmtree(stale)
            else:
                os.remove(stale)
        except OSError:
            continue
        messages.append(f"removed {stale}: a partial output left by process {match.group(1)}, which is gone")
    return messages


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def remove_quietly(path: str | None) -> None:
    if path is None:
        return
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)
    except OSError:
        pass


def commit(pairs: list[tuple[str, str]]) -> None:
    """Rename each ``(partial, target)`` onto its target; if one rename fails, the targets already renamed go too."""
    done = []
    try:
        for partial, target in pairs:
            os.replace(partial, target)
            done.append(target)
    except OSError as exc:
        for target in done:
            remove_quietly(target)
        for partial, _ in pairs:
            remove_quietly(partial)
        raise as_output_error(exc, pairs[len(done)][1]) from None


def as_output_error(exc: OSError, path: str) -> OutputError:
    """One line: the path and the cause (``No space left on device``, ``File too large``...)."""
    if isinstance(exc, OutputError):
        return exc
    cause = exc.strerror or (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    cause = re.sub(r"^\[Errno \d+\] ", "", cause)
    error = OutputError(f"{path}: cannot write ({cause})")
    error.errno = exc.errno
    return error
