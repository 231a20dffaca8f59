"""Values from the data or a user's file, as a message quotes them: one line, and short.

A message that names a value (a URL, a dataset's name, a key, a column) shows it ``escaped`` (a newline or an escape
sequence written as ``repr`` writes it, so that an error stays one line and cannot set a terminal's title) and cut
to ``SHORT`` characters with the count of the whole (``shortened``, ``quoted``), so that a 200,000-character value
makes a line of about a hundred. ``jobs/display.py`` gives them to the jobs and the faces.
"""

from __future__ import annotations

import json
from typing import Any

def escaped(text: str, keep: str = "") -> str:
    """``text`` with every character that is not printable (a newline, a tab, an escape) written the way ``repr``
    writes it, so that a file name (or any value) printed in an error or warning line keeps the line one line.
    ``keep``: characters left as they are (``lossmask show`` keeps a chat's newlines and tabs)."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch in keep else repr(ch)[1:-1] for ch in text)


SHORT = 80  # characters of one value from the data (a URL, a name, a column, a key) that a message quotes


def shortened(text: str, limit: int = SHORT) -> str:
    """``text`` from the data, ``escaped`` and cut to its first ``limit`` characters with the count of the whole
    (``https://example.com/aaaa… (200,000 characters)``), so that a message quoting it stays short."""
    text = str(text)
    if len(text) <= limit:
        return escaped(text)
    return f"{escaped(text[:limit])}… ({len(text):,} characters)"


def quoted(value: Any, limit: int = SHORT) -> str:
    """``value`` from the data as a message quotes it: a string as ``repr`` writes it, anything else as a short
    ``repr`` (``reprlib``: a few items of a list, a few levels of nesting), in both cases cut as ``shortened`` does."""
    if isinstance(value, str):
        if len(value) <= limit:
            return repr(value)
        head = repr(value[:limit])
        return f"{head[:-1]}…{head[-1]} ({len(value):,} characters)"
    import reprlib

    short = reprlib.Repr()
    short.maxstring = short.maxother = limit
    text = short.repr(value)
    return text if len(text) <= limit else f"{text[:limit]}…"


def json_kind(value: Any) -> str:
    """What a value read from JSON is, in words: ``an object``, ``a list``, ``a string``, ``a number``, ``null``..."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def described(value: Any) -> str:
    """A value read from JSON as a message names it: ``null``, ``true``, or what it is and the value ``quoted``
    (``a number (42)``, ``a list (['from'])``)."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return f"{json_kind(value)} ({quoted(value)})"
