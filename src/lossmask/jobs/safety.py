"""The dropped-row safety net: stop a job when too many rows would train nothing, and say why.

A marker set that matches nothing drops every row; truncation at the maximum length drops rows whose
assistant turns were cut. Both are silent in most tools. Here the outcome counts that the kernel
returns anyway are checked once per job (or per batch), and the error names the likely cause.
"""

from __future__ import annotations

from ..engine.outcomes import (
    CUT_BY_TRUNCATION,
    HEADER_ONLY,
    MARKERS_MATCH_NOTHING,
    NO_ASSISTANT_TURN,
    WEIGHTS_ZERO,
    Outcome,
    OutcomeCounts,
)
from ..options import DEFAULT_MAX_DROP_FRACTION


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


def _cause_sentence(cause: str, n: int, total: int, truncation: str | None) -> str:
    share = f"{n} of {total} dropped rows"
    if cause == NO_ASSISTANT_TURN:
        return (f"{share} have no assistant message at all: there is nothing to train in them. "
                "Check the role names (lossmask trains the 'assistant' role) or filter those rows out")
    if cause == CUT_BY_TRUNCATION:
        limit = truncation or "the maximum length"
        return (f"{share} reach {limit}: truncation cut their assistant turns (or the assistant header itself). "
                "Raise that length, or filter out rows whose prompt alone fills it")
    if cause == MARKERS_MATCH_NOTHING:
        return (f"{share} are whole and contain no response marker: the markers match nothing in them. "
                "They were probably derived from another tokenizer or chat template, or tokenised out of context; "
                "derive them from the tokenizer that tokenised the data (lossmask.resolve_markers / `lossmask detect`)")
    if cause == HEADER_ONLY:
        return (f"{share} have a response marker with nothing trainable after it, though they were not cut "
                "(empty assistant messages, or a template that writes no stop token)")
    if cause == WEIGHTS_ZERO:
        return (f"{share} had assistant turns the markers train, and every one of them weighs 0 (a message field "
                "such as weight: 0, or the role and reasoning options): nothing is left to train. Check those fields, "
                "or pass weight_field=None (--weight-field none) to ignore them")
    return f"{share} have no tokens at all (empty or null input_ids): check the tokenisation step"


def check_drop_fraction(
    counts: OutcomeCounts,
    *,
    max_drop_fraction: float = DEFAULT_MAX_DROP_FRACTION,
    example: str | None = None,
    causes: dict[str, int] | None = None,
    examples: dict[str, str] | None = None,
    truncation: str | None = None,
) -> None:
    """Raise ``TooManyDroppedRows`` when more than ``max_drop_fraction`` of the rows train nothing.

    ``causes`` (from ``classify_drops``, added up): dropped rows per cause, each named in the message
    with its example row from ``examples`` (rendered for a person, see ``display.format_row``); ``truncation``
    names the length that cut rows (e.g. ``"max_length=40 (SFTConfig.max_length)"``). Without
    ``causes`` the message guesses from the engine's reasons and shows ``example``.
    """
    if not 0.0 <= max_drop_fraction <= 1.0:
        raise ValueError(f"max_drop_fraction={max_drop_fraction!r} must be a fraction in [0, 1] (e.g. 0.30)")
    if counts.rows == 0 or counts.rows_dropped / counts.rows <= max_drop_fraction:
        return
    fraction = counts.rows_dropped / counts.rows
    breakdown = ", ".join(f"{reason}: {n}" for reason, n in counts.dropped.items() if n)
    message = (
        f"{counts.rows_dropped} of {counts.rows} rows ({fraction:.1%}) would train no token "
        f"(allowed: {max_drop_fraction:.0%}; {breakdown})."
    )
    found = {cause: n for cause, n in (causes or {}).items() if n}
    if found:
        message += " What the dropped rows show:"
        for cause, n in sorted(found.items(), key=lambda item: -item[1]):
            message += f"\n- {_cause_sentence(cause, n, counts.rows_dropped, truncation)}."
            if examples and examples.get(cause):
                message += f"\n  Example, {examples[cause]}"
    else:
        message += f" Likely cause: {likely_cause(counts)}."
        if example:
            message += f"\nExample dropped row (trained tokens in [brackets]):\n  {example}"
    message += "\nTo go on anyway, raise max_drop_fraction (--max-drop-fraction 1.0 keeps going whatever drops)."
    raise TooManyDroppedRows(message, counts)
