"""Labelled rows as text a person reads: token texts with the trained ones highlighted or [bracketed].

The report's examples, the safety net's message, ``lossmask mask --show`` and ``lossmask example`` all
print rows this way.
"""

from __future__ import annotations

from typing import Callable, Sequence


def render_tokens(texts: list[str], trained, *, colour: bool) -> str:
    """Token texts joined by spaces, trained ones highlighted (ANSI colour) or [bracketed]."""
    return " ".join(
        (f"\x1b[1;30;42m{text}\x1b[0m" if colour else f"[{text}]") if is_trained else text
        for text, is_trained in zip(texts, trained)
    )


def format_row(
    token_ids: Sequence[int],
    labels: Sequence[int],
    decode: Callable[[int], str],
    *,
    ignore_index: int = -100,
    max_tokens: int = 200,
) -> str:
    """A row as text with trained tokens in [brackets]; long rows keep their last ``max_tokens``."""
    start = max(0, len(token_ids) - max_tokens)
    texts = [repr(decode(int(t)))[1:-1] for t in token_ids[start:]]
    trained = [int(label) != ignore_index for label in labels[start:]]
    return ("... " if start else "") + render_tokens(texts, trained, colour=False)


def escaped(text: str) -> str:
    """``text`` with every character that is not printable (a newline, a tab, an escape) written the way ``repr``
    writes it, so that a file name (or any value) printed in an error or warning line keeps the line one line."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def warnings_on_one_line(command: str) -> None:
    """Each warning a command gives is one line on stderr (``lossmask mask: warning: ...``), as its errors are: no
    source line, no file and line number of the code that warned."""
    import warnings

    warnings.formatwarning = lambda message, *_, **__: f"{command}: warning: {escaped(str(message))}\n"
