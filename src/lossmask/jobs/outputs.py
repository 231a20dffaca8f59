"""Where a masking job writes: checked before the job starts, written under partial names, committed together.

A job writes each of its outputs (the data, and the report when asked) to a hidden partial file beside
its target, ``.NAME.PID.partial``, and renames them all onto their targets only when the whole job
succeeded; on any failure the partials are removed, so a target is either the previous file or the
complete new one. A partial whose process is gone (a killed job) is removed when the next job on the
same target starts. OS errors become one ``OutputError`` line naming the path and the cause.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Iterable


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
