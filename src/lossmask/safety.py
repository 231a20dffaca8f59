"""The dropped-row safety net: stop a job when too many rows would train nothing, and say why.

A marker set that matches nothing drops every row; truncation at the maximum length drops rows whose
assistant turns were cut. Both are silent in most tools. Here the outcome counts that the kernel
returns anyway are checked once per job (or per batch), and the error names the likely cause.
"""

from __future__ import annotations

from typing import Callable, Sequence

from .outcomes import Outcome, OutcomeCounts

DEFAULT_MAX_DROP_FRACTION = 0.30


class TooManyDroppedRows(ValueError):
    """More rows than allowed end with no trained token."""

    def __init__(self, message: str, counts: OutcomeCounts):
        super().__init__(message)
        self.counts = counts


def likely_cause(counts: OutcomeCounts) -> str:
    """One sentence on why rows were dropped, from which reason dominates."""
    dropped = counts.dropped
    reason = max(dropped, key=dropped.get) if counts.rows_dropped else None
    if reason == Outcome.NO_RESPONSE.reason:
        return (
            "most dropped rows contain no response pattern at all: the markers match nothing in this data. "
            "They were probably derived from another tokenizer or chat template, or tokenised out of context; "
            "derive them from the tokenizer that tokenised the data (lossmask.resolve_markers / `lossmask detect`)"
        )
    if reason == Outcome.EMPTY_RESPONSE.reason:
        return (
            "most dropped rows have a response header with nothing after it: truncation at the maximum length "
            "cut every assistant token. Raise the maximum length, or filter out rows whose prompt alone fills it"
        )
    if reason == Outcome.EMPTY.reason:
        return "most dropped rows have no tokens at all (empty or null input_ids): check the tokenisation step"
    return "no rows were dropped"


def check_drop_fraction(
    counts: OutcomeCounts,
    *,
    max_drop_fraction: float = DEFAULT_MAX_DROP_FRACTION,
    example: str | None = None,
) -> None:
    """Raise ``TooManyDroppedRows`` when more than ``max_drop_fraction`` of the rows train nothing.

    ``example``: one dropped row, rendered for a person (see ``format_row``), shown in the error.
    """
    if not 0.0 <= max_drop_fraction <= 1.0:
        raise ValueError(f"max_drop_fraction={max_drop_fraction!r} must be a fraction in [0, 1] (e.g. 0.30)")
    if counts.rows == 0 or counts.rows_dropped / counts.rows <= max_drop_fraction:
        return
    fraction = counts.rows_dropped / counts.rows
    breakdown = ", ".join(f"{reason}: {n}" for reason, n in counts.dropped.items() if n)
    message = (
        f"{counts.rows_dropped} of {counts.rows} rows ({fraction:.1%}) would train no token "
        f"(allowed: {max_drop_fraction:.0%}; {breakdown}). Likely cause: {likely_cause(counts)}."
    )
    if example:
        message += f"\nExample dropped row (trained tokens in [brackets]):\n  {example}"
    message += "\nTo go on anyway, raise max_drop_fraction (--max-drop-fraction 1.0 keeps going whatever drops)."
    raise TooManyDroppedRows(message, counts)


def format_row(
    token_ids: Sequence[int],
    labels: Sequence[int],
    decode: Callable[[int], str],
    *,
    ignore_index: int = -100,
    max_tokens: int = 200,
) -> str:
    """A row as text with trained tokens in [brackets]; long rows keep their last ``max_tokens``."""
    from .example import render_tokens

    start = max(0, len(token_ids) - max_tokens)
    texts = [repr(decode(int(t)))[1:-1] for t in token_ids[start:]]
    trained = [int(label) != ignore_index for label in labels[start:]]
    return ("... " if start else "") + render_tokens(texts, trained, colour=False)
