"""Labelled rows as text a person reads: token texts with the trained ones highlighted or [bracketed].

The report's examples, the safety net's message, ``lossmask mask --show`` and ``lossmask example`` all
print rows this way. ``preview_lines`` prints a long row readably: one line per message, and past a budget of
tokens each message keeps its head and tail, with the count of what was left out where ``…`` stands.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Sequence

import numpy as np

from ..chat.quoting import SHORT, described, escaped, json_kind, quoted, shortened  # noqa: F401 (their home for jobs/)

SHOW_TOKENS = 200  # the tokens ``lossmask mask --show`` prints of a row, at most (``--show-tokens``)
_MESSAGE_MIN = 8  # past the budget, a message keeps at least its first 4 and last 4 tokens, else it is left out whole


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


def message_starts(token_ids: Sequence[int], trained: Sequence[bool],
                   headers: Sequence[Sequence[int]] = (), texts: Sequence[str] | None = None) -> list[int]:
    """Where each message of a labelled row begins, as token positions (0 first).

    A message begins where one of ``headers`` (the instruction and response markers: token-id patterns) begins,
    and after each trained run (a reply's end, unless a header follows within 4 tokens; with ``texts``, the
    tokens' text, past the whitespace that follows the reply). Without headers, each trained run begins a
    message too.
    """
    ids = np.asarray(token_ids, dtype=np.int64)
    mask = np.asarray(trained, dtype=bool)
    found: set[int] = set()
    for pattern in headers:
        pattern = [int(t) for t in pattern]
        if not pattern or len(pattern) > len(ids):
            continue
        for at in np.flatnonzero(ids[:len(ids) - len(pattern) + 1] == pattern[0]).tolist():
            if ids[at:at + len(pattern)].tolist() == pattern:
                found.add(at)
    switches = np.flatnonzero(mask[1:] != mask[:-1]) + 1
    starts = {0} | found
    for at in switches.tolist():
        if not mask[at] and not any(at < h <= at + 4 for h in found):  # the end of a trained run
            while texts is not None and at < len(ids) and not texts[at].strip():
                at += 1  # the line break after a stop token ends the reply's line
            starts.add(at)
        elif mask[at] and not headers:  # no markers (prompts masked by position): the completion starts here
            starts.add(at)
    return sorted(s for s in starts if s < len(ids))


def preview_lines(texts: list[str], trained: Sequence[bool], starts: Sequence[int], *,
                  max_tokens: int = SHOW_TOKENS, colour: bool = False) -> tuple[list[str], int]:
    """A labelled row, one line per message (``starts``: where each begins), trained tokens highlighted or
    [bracketed], and how many tokens were left out. A row longer than ``max_tokens`` (0: no limit) shows about
    ``max_tokens`` of its tokens: each message its head and tail with ``… N tokens …`` between, and when there are
    too many messages for that, the first and last ones, with ``… N messages (M tokens) …`` in place of the rest."""
    n = len(texts)
    bounds = list(zip(starts, list(starts[1:]) + [n])) if n else []
    if not max_tokens or n <= max_tokens:
        return [render_tokens(texts[a:b], trained[a:b], colour=colour) for a, b in bounds], 0
    keep = max(2, max_tokens // _MESSAGE_MIN)
    middle, left_out = None, 0
    if len(bounds) > keep:
        head, tail = bounds[:(keep + 1) // 2], bounds[len(bounds) - keep // 2:]
        middle = (len(bounds) - len(head) - len(tail), tail[0][0] - head[-1][1])
        left_out += middle[1]
        bounds = head + tail
    lines = []
    for k, ((a, b), share) in enumerate(zip(bounds, _shares([b - a for a, b in bounds], max_tokens))):
        if middle is not None and k == (keep + 1) // 2:
            lines.append(_dim(f"… {middle[0]:,} messages ({_tokens(middle[1])}) …", colour))
        if b - a - share < _MESSAGE_MIN // 2:  # leaving out a few tokens would save less than its note takes
            lines.append(render_tokens(texts[a:b], trained[a:b], colour=colour))
            continue
        first, last = a + (share + 1) // 2, b - share // 2
        left_out += last - first
        lines.append(" ".join((render_tokens(texts[a:first], trained[a:first], colour=colour),
                               _dim(f"… {_tokens(last - first)} …", colour),
                               render_tokens(texts[last:b], trained[last:b], colour=colour))))
    return lines, left_out


def _tokens(n: int) -> str:
    return f"{n:,} token{'s' * (n != 1)}"


def _shares(lengths: list[int], budget: int) -> list[int]:
    """Tokens each message may show: the budget shared out evenly, a short message's unused share going to the
    longer ones, and never under ``_MESSAGE_MIN`` (so a row with many messages may show a little over budget)."""
    shares = [0] * len(lengths)
    left, todo = budget, sorted(range(len(lengths)), key=lengths.__getitem__)
    for done, k in enumerate(todo):
        share = max(_MESSAGE_MIN, left // (len(todo) - done))
        shares[k] = min(lengths[k], share)
        left = max(0, left - shares[k])
    return shares


def _dim(text: str, colour: bool) -> str:
    return f"\x1b[2m{text}\x1b[0m" if colour else text


MAX_LINE = 600  # characters of one line of data or template text in a report or a message
MAX_ERROR_LINE = 2000  # characters of one line of an error or a warning the commands print, whatever it quotes


def one_line(text: str, limit: int = MAX_LINE) -> str:
    """``text`` from data or a template (a role, a speaker, a template's error), ``escaped`` and cut to ``limit``
    characters, so that it prints as one line of bounded length."""
    line = escaped(str(text))
    return line if len(line) <= limit else f"{line[:limit - 40]}... ({len(line) - limit + 40:,} characters more)"


@contextmanager
def warnings_on_one_line(command: str):
    """While a command runs, each warning it gives is one line on stderr (``lossmask lora: warning: ...``), as its
    errors are: no source line, no file and line number of the code that warned. The warning format the process had
    is put back when the command ends (a command called from Python leaves the process as it found it)."""
    import warnings

    before = warnings.formatwarning
    warnings.formatwarning = lambda message, *_, **__: f"{command}: warning: {one_line(message, MAX_ERROR_LINE)}\n"
    try:
        yield
    finally:
        warnings.formatwarning = before
