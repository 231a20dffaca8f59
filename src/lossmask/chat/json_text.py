"""JSON text inside a row's values (tool-call arguments, a ShareGPT ``function_call``, a ``tools`` column),
decoded with a depth limit.

Python's reader recurses once per level and stops near the interpreter's recursion limit with
``RecursionError``, and a value nested almost that deep breaks the code that walks it next (the template's
``tojson``, the search for a call's printed values). So such text is refused past ``MAX_JSON_DEPTH`` levels
of arrays and objects, with a ``ValueError`` the caller names the row by. The depth is measured only when the
text holds more opening brackets than that (counted in C), so ordinary values cost one count.
"""

from __future__ import annotations

import json
from typing import Any

MAX_JSON_DEPTH = 256  # levels of arrays and objects in JSON text held in a value


def loads_nested(text: str) -> Any:
    """``json.loads(text)``; ValueError (``json.JSONDecodeError`` for text that is not JSON) when the text is nested
    deeper than ``MAX_JSON_DEPTH``."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(_too_deep(None)) from None
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH:
        depth = _depth(value)
        if depth > MAX_JSON_DEPTH:
            raise ValueError(_too_deep(depth))
    return value


def _too_deep(depth: int | None) -> str:
    levels = f"{depth:,} levels deep" if depth else "deeper than Python's JSON reader goes"
    return (f"JSON text nested {levels}, over {MAX_JSON_DEPTH} levels of arrays and objects (MAX_JSON_DEPTH); "
            "flatten it")


def _depth(value: Any) -> int:
    """The levels of arrays and objects in a decoded value, walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in item if isinstance(child, (dict, list)))
    return deepest
