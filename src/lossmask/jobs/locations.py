"""Where a job's rows are: the files an input names (a file, a folder, a glob or a list), each read once, and
temporary copies of what can be read only once.

A file reached under two names (a symlink, a hard link, a recursive glob through a symlink loop) is read once:
files are told apart by device and inode. A FIFO or device found in a folder is left out. Input that can only be
read once (stdin, a pipe, a FIFO) is first copied to a temporary file: on Linux one unlinked at once and read through
the job's descriptor, so that nothing is left whatever ends the job; elsewhere removed when the job ends, and at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import fnmatch
import glob
import os
import stat
import sys
from typing import Any

from . import formats
from .formats import _MAGIC, _too_long

PARTIAL_SUFFIX = ".partial"
STDIN = "<stdin>"  # the name of input "-" in messages


def _list_paths(input: Any) -> tuple[list[str], str, bool, list[str]]:
    """``(paths, a name for errors, whether the paths were named one by one, messages on paths left out)``."""
    if isinstance(input, (list, tuple)):
        paths = [os.fspath(p) for p in input]
        if not paths:
            raise FileNotFoundError("input=[]: no file given")
        missing = [p for p in paths if p != "-" and not os.path.exists(p)]
        if missing:
            raise FileNotFoundError(f"{missing[0]}: no such file or folder")
        paths = [STDIN if p == "-" else p for p in paths]
        return paths, (f"{len(paths)} files" if len(paths) != 1 else paths[0]), True, []
    source = os.fspath(input)
    if source == "-":
        return [STDIN], STDIN, True, []
    if any(ch in source for ch in "*?["):
        paths, skipped = _once_each(glob_files(source))
        if not paths:
            raise FileNotFoundError(f"{source}: the pattern matches no file")
        return paths, source, False, skipped
    if os.path.isdir(source):
        found = sorted(
            os.path.join(root, name) for root, folders, names in os.walk(source) for name in names
            if not name.startswith((".", "_"))
        )
        paths, skipped = _once_each(found)
        if not paths:
            raise FileNotFoundError(f"{source}: the folder holds no data file")
        return paths, source, False, skipped
    if os.path.exists(source):
        return [source], source, True, []
    raise FileNotFoundError(f"{source}: no such file or folder")


def _once_each(paths: list[str]) -> tuple[list[str], list[str]]:
    """The regular files of ``paths``, each under the first of its names; and messages on those left out.

    A FIFO or device in a folder is left out: opening it could wait for ever for a writer."""
    kept, seen, skipped, again = [], {}, [], []
    for path in paths:
        try:
            info = os.stat(path)
        except OSError as exc:
            skipped.append(f"skipped {path}: {exc.strerror or exc} (a broken link?)")
            continue
        if not stat.S_ISREG(info.st_mode):
            skipped.append(f"skipped {path}: not a regular file (a FIFO, socket or device); name it alone to read it")
            continue
        file = (info.st_dev, info.st_ino)  # one file under two names: symbolic links and hard links alike
        if file in seen:
            again.append((path, seen[file]))
            continue
        seen[file] = path
        kept.append(path)
    if len(again) <= 3:
        skipped += [f"skipped {path}: the same file as {first} ({_link_kind(path, first)}), read once"
                    for path, first in again]
    else:
        skipped.append(f"skipped {len(again):,} paths that name files already read (through symbolic or hard links), "
                       f"e.g. {again[0][0]}, the same file as {again[0][1]}")
    return kept, skipped


def _link_kind(path: str, first: str) -> str:
    return "a symbolic link" if os.path.realpath(path) == os.path.realpath(first) else "a hard link"


def glob_files(pattern: str) -> list[str]:
    """The files matching ``pattern`` in sorted order, as ``glob.glob(pattern, recursive=True)`` finds them, except
    that ``**`` does not enter a folder that holds itself (``sub/up -> ..``): ``glob`` would list every file once
    per turn of such a loop (41 times, up to the kernel's limit on symbolic links), and 2^40 times with two loops.
    Names starting with ``.`` are matched only by pattern parts that start with ``.``, as in ``glob``."""
    if "**" not in pattern:
        return sorted(path for path in glob.glob(pattern) if os.path.isfile(path))
    parts = pattern.split(os.sep)
    fixed = 0
    while fixed < len(parts) and not glob.has_magic(parts[fixed]):
        fixed += 1
    base = os.sep.join(parts[:fixed]) or (os.sep if pattern.startswith(os.sep) else "")
    rest = tuple(parts[fixed:])
    found: list[str] = []

    hidden = any(part.startswith(".") for part in rest)

    def walk(folder: str, names: tuple[str, ...], ancestors: frozenset) -> None:
        try:
            entries = sorted(os.scandir(folder or os.curdir), key=lambda entry: entry.name)
        except OSError:
            return
        for entry in entries:
            path = os.path.join(folder, entry.name) if folder else entry.name
            inner = names + (entry.name,)
            try:
                is_dir = entry.is_dir()  # through symbolic links, as glob goes
            except OSError:
                continue
            if is_dir and (hidden or not entry.name.startswith(".")):
                real = os.path.realpath(path)
                if real not in ancestors:  # a folder that holds itself is not entered again
                    walk(path, inner, ancestors | {real})
            elif not is_dir and _path_matches(rest, inner) and os.path.isfile(path):
                found.append(path)

    if os.path.isdir(base or os.curdir):
        walk(base, (), frozenset({os.path.realpath(base or os.curdir)}))
    return sorted(found)


def _path_matches(parts: tuple[str, ...], names: tuple[str, ...]) -> bool:
    """Whether the path ``names`` (its parts) matches the pattern ``parts``, ``**`` standing for any folders."""
    if not parts:
        return not names
    if parts[0] == "**":
        return any(_path_matches(parts[1:], names[i:]) for i in range(len(names) + 1)
                   if not any(name.startswith(".") for name in names[:i]))
    return bool(names) and _name_matches(parts[0], names[0]) and _path_matches(parts[1:], names[1:])


def _name_matches(part: str, name: str) -> bool:
    if name.startswith(".") and not part.startswith("."):
        return False
    return fnmatch.fnmatch(name, part)


def _read_once(path: str) -> bool:
    """Whether ``path`` can only be read once: stdin, a pipe or FIFO (``<(zcat x.gz)`` is /dev/fd/63), a device.
    Anything under /dev or /proc counts, since on some systems /dev/stdin shares its offset with fd 0."""
    if path == STDIN or path.startswith(("/dev/", "/proc/")):
        return True
    mode = os.stat(path).st_mode
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


_COPIES: set[str] = set()


def _copy_stream(path: str) -> str:
    """Copy stdin, a pipe or a FIFO to a temporary file once, and return its path (``_temporary``: on Linux a file
    already unlinked, read through this process's descriptor, so that nothing is left whatever ends the job).

    Unless the stream is a compressed or a Parquet/Arrow file, a run of ``formats.MAX_LINE_BYTES`` without a line
    end stops the copy there (``/dev/zero`` would otherwise fill the disk). A temporary folder that is full
    or cannot be written is one line naming the stream and ``TMPDIR``, and what to do."""
    import tempfile

    try:
        local, folder = _temporary(".copy")
    except OSError as exc:
        raise _no_room(path, tempfile.gettempdir(), exc) from None
    reading = False
    try:
        with open(local, "wb") as out, (sys.stdin.buffer if path == STDIN else open(path, "rb")) as stream:
            check = None
            while True:
                reading = True
                chunk = stream.read(1 << 20)
                reading = False
                if not chunk:
                    break
                if check is None:
                    check = None if chunk.startswith((b"PAR1", b"ARROW1", b"FEA1", *(m for m, _ in _MAGIC))) \
                        else LineGuard()
                if check is not None and not check.feed(chunk):
                    raise _too_long(path, "line", check.line)
                out.write(chunk)
    except OSError as exc:
        remove_copy(local)
        if reading:  # the stream's own error
            raise
        raise _no_room(path, folder, exc) from None
    except BaseException:
        remove_copy(local)
        raise
    return local


def _temporary(suffix: str) -> tuple[str, str]:
    """A new empty temporary file: ``(the path to open it by, its folder)``. On Linux it is unlinked at once and
    opened through this process's descriptor (``/proc/PID/fd/N``, which workers open too), so that nothing is left
    whatever ends the job, SIGKILL included; elsewhere it is removed with the job, and at exit. ``remove_copy``
    closes or removes it."""
    import tempfile

    fd, copy = tempfile.mkstemp(prefix="lossmask-input-", suffix=suffix)
    local = f"/proc/{os.getpid()}/fd/{fd}"
    if sys.platform.startswith("linux") and os.path.exists(local):
        os.remove(copy)
        _HELD[local] = fd
        return local, os.path.dirname(copy)
    os.close(fd)
    _COPIES.add(copy)
    if len(_COPIES) == 1:
        atexit.register(_remove_copies)
    return copy, os.path.dirname(copy)


class LineGuard:
    """Whether the lines of a stream fed to it chunk by chunk stay within ``formats.MAX_LINE_BYTES``; ``line``: the line
    being read (1-based)."""

    def __init__(self) -> None:
        self.line, self.since = 1, 0

    def feed(self, chunk: bytes) -> bool:
        end = chunk.rfind(b"\n")
        if end < 0:
            self.since += len(chunk)
        else:
            self.line += chunk.count(b"\n")
            self.since = len(chunk) - end - 1
        return self.since <= formats.MAX_LINE_BYTES


_HELD: dict[str, int] = {}  # a copy's path as the workers open it -> this process's descriptor of it


def decompressed_copy(path: str) -> tuple[str, Any] | None:
    """The JSON file ``path`` (gzip, bzip2 or zstd) decompressed once into a temporary file: ``(its path, the
    ``array_items.ArrayScan`` of a JSON array, None for JSON Lines)``. The decompression stays bounded as when the
    parent reads the file: it stops at a line (or an item) longer than ``formats.MAX_LINE_BYTES``, and None is returned, as
    for a file that cannot be decompressed or a temporary folder without room: the parent then reads the file
    itself and names the fault. The copy is a ``_temporary`` file: nothing is left whatever ends the job (on Linux).
    ``remove_copy`` closes it."""
    import zlib

    import pyarrow as pa

    from .array_items import FINE, WHITE, ArrayScan
    from .formats import _open_json

    try:
        local, _ = _temporary(".json")
    except OSError:
        return None
    scan = None
    try:
        source, _ = _open_json(path)
        with source, open(local, "wb") as out:
            guard: Any = None
            while True:
                chunk = source.read(4 << 20)
                if not chunk:
                    break
                if guard is None:
                    array = chunk.lstrip(b"\xef\xbb\xbf" + WHITE).startswith(b"[")
                    guard = ArrayScan(FINE) if array else LineGuard()
                    scan = guard if array else None
                if not guard.feed(chunk):
                    raise EOFError("too long")
                out.write(chunk)
        if scan is not None and not scan.finish():
            raise EOFError("not an array that can be cut")
    except (OSError, EOFError, ValueError, zlib.error, pa.ArrowException):
        remove_copy(local)
        return None
    return local, scan


def remove_copy(local: str) -> None:
    """Remove a temporary copy (``_copy_stream``, ``decompressed_copy``)."""
    fd = _HELD.pop(local, None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
    else:
        _remove_copy(local)


def _no_room(path: str, folder: str, exc: OSError) -> OSError:
    error = OSError(f"{path}: cannot copy the stream to a temporary file in TMPDIR ({folder}): {exc.strerror or exc}; "
                    "set TMPDIR to a folder with room for the whole input, or pass the input as a file")
    error.errno = exc.errno
    return error


def _remove_copy(copy: str) -> None:
    _COPIES.discard(copy)
    try:
        os.remove(copy)
    except OSError:
        pass


def _remove_copies() -> None:
    for copy in list(_COPIES):
        _remove_copy(copy)
