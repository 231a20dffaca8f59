"""The report of a masking job: what came in, what went out, and why every missing row is missing.

One ``MaskReport`` describes a whole job (a file, a dataset, a Ray run). It is built from the
engine's ``OutcomeCounts`` plus the rows rejected before labelling (``invalid``: the chat template
refused them, or they could not be read as a chat), and it always adds up::

    rows_in == rows_out + sum(dropped.values())

``dropped`` counts the rows that were removed, by reason; with ``keep_dropped`` the rows that train
nothing stay in the output and are counted under ``kept_untrained`` instead.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from ..chat.shapes import LEADING_ASSISTANT_DROPPED
from ..engine.outcomes import DROP_REASONS, INVALID, REJECTED_REASONS, SHAPE_REASONS, WEIGHTS_ZERO, Outcome
from ..engine.patterns import Markers
from ..engine.tally import Tally
from .display import escaped


@dataclass(frozen=True)
class MaskReport:
    """What a masking job did. ``to_dict`` / ``to_json`` give the JSON of ``--report``."""

    rows_in: int
    rows_out: int
    dropped: dict[str, int]
    kept_untrained: dict[str, int]
    tokens_in: int
    tokens_trained: int
    markers: dict[str, list[list[int]]] | None
    markers_source: str
    invalid_examples: tuple[str, ...] = ()
    seconds: dict[str, float] = field(default_factory=dict)
    input: str | None = None
    output: str | None = None
    messages: tuple[str, ...] = ()
    special_tokens_in_content: int = 0  # rows whose message text held a special-token string
    special_tokens_example: str | None = None
    dropped_examples: tuple[str, ...] = ()  # rows dropped before labelling (content_dropped, ...)
    tokens_dropped: int = 0  # tokens of the removed rows (0 with keep_dropped): tokens_in - tokens_dropped were written
    marker_texts: dict[str, list[str]] | None = None  # each marker pattern decoded, when a tokenizer was at hand
    shapes: dict[str, int] = field(default_factory=dict)  # rows the conversation-shape policy changed, per shape
    media_tokens: int = 0  # of tokens_in: image tokens (chats through a processor), never trained
    # rows kept whose marker labels broke the role invariant: labelled from the rendering (docs/masking-rule.md)
    labelled_from_rendering: int = 0
    labelled_from_rendering_example: str | None = None
    # where weights applied (docs/weights.md): role -> {tokens, weight}; source value -> {rows, tokens, weight}
    weights_by_role: dict[str, dict[str, float]] = field(default_factory=dict)
    weights_by_source: dict[str, dict[str, float]] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        tally: Tally,
        *,
        markers: Markers | None,
        markers_source: str,
        keep_dropped: bool,
        input: str | None = None,
        output: str | None = None,
        messages: tuple[str, ...] | list[str] = (),
        decode: Callable[[int], str] | None = None,
    ) -> "MaskReport":
        untrained = _weights_apart(tally.counts.dropped, tally.drop_causes.get(WEIGHTS_ZERO, 0))
        dropped = {reason: 0 for reason in DROP_REASONS} if keep_dropped else dict(untrained)
        dropped[INVALID] = tally.invalid
        for reason in REJECTED_REASONS:
            dropped[reason] = tally.rejected.get(reason, 0)
        for reason in SHAPE_REASONS:  # listed when they happened, so that reports of plain rows keep their keys
            if tally.rejected.get(reason):
                dropped[reason] = tally.rejected[reason]
        report = cls(
            rows_in=tally.rows_in,
            rows_out=tally.rows_out,
            dropped=dropped,
            kept_untrained=dict(untrained) if keep_dropped else {reason: 0 for reason in DROP_REASONS},
            tokens_in=tally.counts.tokens,
            tokens_trained=tally.counts.tokens_trained,
            markers=None if markers is None else markers.to_dict(),
            markers_source=markers_source,
            invalid_examples=tuple(tally.invalid_examples),
            seconds=dict(tally.seconds),
            input=input,
            output=output,
            messages=tuple(messages),
            special_tokens_in_content=tally.special_rows,
            special_tokens_example=tally.special_example,
            dropped_examples=tuple(tally.rejected_examples),
            tokens_dropped=0 if keep_dropped else tally.tokens_dropped,
            marker_texts=None if markers is None or decode is None or not hasattr(markers, "response")
            else marker_texts(markers.to_dict(), decode),
            shapes={shape: rows for shape, rows in tally.shapes.items() if rows},
            media_tokens=tally.media_tokens,
            labelled_from_rendering=tally.from_rendering,
            labelled_from_rendering_example=tally.from_rendering_example,
            weights_by_role={role: {"tokens": int(t), "weight": round(float(m), 6)}
                             for role, (t, m) in tally.weights_by_role.items()},
            weights_by_source={value: {"rows": int(r), "tokens": int(t), "weight": round(float(m), 6)}
                               for value, (r, t, m) in sorted(tally.weights_by_source.items())},
        )
        if report.rows_in != report.rows_out + report.rows_dropped:
            raise AssertionError(  # a bug in lossmask, never the user's data
                f"lossmask report does not add up: rows_in={report.rows_in}, rows_out={report.rows_out}, "
                f"dropped={report.dropped}; please report this"
            )
        return report

    @property
    def rows_dropped(self) -> int:
        return sum(self.dropped.values())

    @property
    def rows_untrained(self) -> int:
        """Rows that train nothing: the removed ones (invalid included) plus any kept with ``keep_dropped``."""
        return self.rows_dropped + sum(self.kept_untrained.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows_in": self.rows_in,
            "rows_out": self.rows_out,
            "dropped": dict(self.dropped),
            "kept_untrained": dict(self.kept_untrained),
            "tokens_in": self.tokens_in,
            "tokens_trained": self.tokens_trained,
            "tokens_dropped": self.tokens_dropped,
            "markers": self.markers,
            "markers_source": self.markers_source,
            "marker_texts": self.marker_texts,
            "invalid_examples": list(self.invalid_examples),
            "seconds": {stage: round(value, 6) for stage, value in self.seconds.items()},
            "input": self.input,
            "output": self.output,
            "messages": list(self.messages),
            "special_tokens_in_content": self.special_tokens_in_content,
            "special_tokens_example": self.special_tokens_example,
            "dropped_examples": list(self.dropped_examples),
            "shapes": dict(self.shapes),
            **({"media_tokens": self.media_tokens} if self.media_tokens else {}),  # only for chats with images
            **({"labelled_from_rendering": self.labelled_from_rendering,
                "labelled_from_rendering_example": self.labelled_from_rendering_example}
               if self.labelled_from_rendering else {}),
            **({"weights_by_role": dict(self.weights_by_role)} if self.weights_by_role else {}),
            **({"weights_by_source": dict(self.weights_by_source)} if self.weights_by_source else {}),
        }

    def to_json(self, path: str | os.PathLike | None = None, *, indent: int | None = 2) -> str:
        """The report as JSON; also written to ``path`` when one is given."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
        return text

    def drop_line(self) -> str:
        """One line on the removed rows: how many, and why (rows are numbered from 0 in every message)."""
        if not self.rows_dropped:
            return f"dropped no row of {self.rows_in:,}"
        reasons = ", ".join(f"{reason} {n:,}" for reason, n in self.dropped.items() if n)
        share = f" ({self.rows_dropped / self.rows_in:.1%})" if self.rows_in else ""
        return f"dropped {self.rows_dropped:,} of {self.rows_in:,} rows{share}: {reasons}"

    def summary(self, decode: Callable[[int], str] | None = None) -> str:
        """A few lines for a terminal: rows, drops by reason, tokens, markers and their source, time.

        ``decode`` (token id -> text) shows the markers as text next to their ids."""
        lines = [
            f"rows in: {self.rows_in:,}   rows out: {self.rows_out:,}   dropped: {self.rows_dropped:,}"
            + (f" ({self.rows_dropped / self.rows_in:.1%})" if self.rows_in else ""),
        ]
        reasons = ", ".join(f"{reason} {n:,}" for reason, n in self.dropped.items() if n)
        if reasons:
            lines.append(f"  dropped by reason: {reasons}")
        kept = ", ".join(f"{reason} {n:,}" for reason, n in self.kept_untrained.items() if n)
        if kept:
            lines.append(f"  kept although nothing trains (keep_dropped): {kept}")
        for example in self.invalid_examples:
            lines.append(f"  invalid {example} (rows counted from 0)")
        for example in self.dropped_examples:
            lines.append(f"  {example}")
        if self.weights_by_role:
            roles = ", ".join(f"{role} {v['tokens']:,} tokens / {v['weight']:,.1f}" for role, v in self.weights_by_role.items())
            lines.append(f"trained tokens / weight mass by role: {roles}")
        for value, v in self.weights_by_source.items():
            lines.append(f"  source {value!r}: {v['rows']:,} rows, {v['tokens']:,} trained tokens, weight mass "
                         f"{v['weight']:,.1f}")
        if self.shapes:
            changed = ", ".join(f"{shape} {n:,}" for shape, n in self.shapes.items())
            lines.append(f"conversation shapes changed before rendering (rows): {changed}; see docs/inputs.md")
            lines.extend(_shape_sentences(self.shapes, self.rows_in))
        if self.labelled_from_rendering:
            lines.append(
                f"labelled_from_rendering: {self.labelled_from_rendering:,} rows whose turns the markers cannot tell "
                f"apart, each assistant turn found from the rendering (e.g. {self.labelled_from_rendering_example}); "
                "see docs/masking-rule.md"
            )
        if self.special_tokens_in_content:
            lines.append(
                f"special tokens in message text: {self.special_tokens_in_content:,} rows "
                f"(e.g. {self.special_tokens_example}); see special_tokens_in_content"
            )
        tokens_out = self.tokens_in - self.tokens_dropped
        share = f" ({self.tokens_trained / tokens_out:.1%})" if tokens_out else ""
        line = f"tokens trained: {self.tokens_trained:,} of {tokens_out:,} in the rows written{share}"
        if self.tokens_dropped:
            line += f"; the dropped rows held {self.tokens_dropped:,} more"
        lines.append(line)
        if self.media_tokens:
            lines.append(f"media tokens (images and videos, never trained): {self.media_tokens:,} of the {self.tokens_in:,} tokens "
                         f"in; text tokens: {self.tokens_in - self.media_tokens:,}")
        if self.markers is None and self.markers_source == "position":
            lines.append("markers: none needed, prompt tokens are masked by position")
        elif self.markers is None:
            lines.append(f"markers ({self.markers_source}): none, the full sequence trains")
        elif self.markers_source == "rendered" or "from_rendering" in self.markers:
            lines.append("markers (rendered): this chat template's token markers cannot be read, so each row was labelled "
                         "from its own rendering (its assistant turns found by rendering the conversation up to and "
                         "through each)")
        else:
            lines.append(f"markers ({self.markers_source}):")
            texts = marker_texts(self.markers, decode) if decode is not None else self.marker_texts
            lines.extend("  " + line for line in marker_lines(self.markers, texts))
        lines.extend(self._time_lines())
        lines.extend(map(escaped, self.messages))  # one line each, whatever the file names hold
        return "\n".join(lines)

    def _time_lines(self) -> list[str]:
        total = self.seconds.get("total")
        if not total:
            return []
        setup = self.seconds.get("setup", 0.0)
        rows_time = max(total - setup, 1e-9)
        line = (f"time: {total:.2f} s = set-up {setup:.2f} s (opening the input, loading the tokenizer, choosing and "
                f"verifying the markers) + {rows_time:.2f} s for the rows ({self.rows_in / rows_time:,.0f} rows/s, "
                f"{self.tokens_in / rows_time:,.0f} tokens/s")
        engine = self.seconds.get("engine")
        if engine and self.tokens_in >= 1_000_000:
            line += f"; the labelling engine alone {self.tokens_in / engine / 1e6:,.0f} M tokens/s"
        line += ")"
        lines = [line]
        if self.rows_in < 100_000:
            lines.append("  (a small job: loading the tokenizer and resolving the markers dominate; "
                         "the throughput figures in docs/benchmarks.md are measured on a million rows)")
        return lines


def _shape_sentences(shapes: dict[str, int], rows_in: int) -> list[str]:
    """What a shape change that costs trained text means for the data, in one plain sentence each."""
    rows = shapes.get(LEADING_ASSISTANT_DROPPED, 0)
    if not rows:
        return []
    share = f" ({rows / rows_in:.1%})" if rows_in else ""
    return [f"  {LEADING_ASSISTANT_DROPPED}: {rows:,} of {rows_in:,} rows{share} opened with an assistant message before "
            "any user message, and that message was removed, so it does not train; --leading-assistant keep "
            "(leading_assistant=\"keep\") keeps it where the template renders a chat that opens so"]


def marker_texts(markers: dict[str, list[list[int]]], decode: Callable[[int], str]) -> dict[str, list[str]]:
    """Each pattern of each kind as text (token by token through ``decode``)."""
    return {kind: ["".join(decode(int(t)) for t in ids) for ids in patterns] for kind, patterns in markers.items()}


def marker_lines(markers: dict[str, list[list[int]]], texts: dict[str, list[str]] | None = None) -> list[str]:
    """One line per marker kind and distinct text, its ids beside it; patterns that differ from another
    only by trailing whitespace (a header merged with the reply's leading whitespace) are counted
    as its variants instead of listed."""
    lines = []
    width = max((len(kind) for kind, patterns in markers.items() if patterns), default=0)
    for kind, patterns in markers.items():
        if not patterns:
            continue
        for ids, text, variants in group_variants(patterns, (texts or {}).get(kind)):
            shown = f"{text!r} = {ids}" if text is not None else f"{ids}"
            more = f"  + {variants} whitespace variant{'s' * (variants != 1)}" if variants else ""
            lines.append(f"{kind:<{width}}  {shown}{more}")
    return lines


def group_variants(patterns: list[list[int]], texts: list[str] | None = None):
    """``(ids, text, n_variants)`` per group of patterns whose text is the same but for trailing whitespace
    (without ``texts``: patterns sharing all but their last id); the shortest pattern speaks for its group."""
    groups: dict = {}
    for i, ids in enumerate(patterns):
        text = texts[i] if texts is not None and i < len(texts) else None
        if text is not None:
            key = text.rstrip() if text.strip() else text
        else:
            key = tuple(ids[:-1]) if len(ids) > 1 else tuple(ids)
        groups.setdefault(key, []).append((list(ids), text))
    out = []
    for members in groups.values():
        members.sort(key=lambda m: (len(m[1]) if m[1] is not None else 0, len(m[0])))
        ids, text = members[0]
        out.append((ids, text, len(members) - 1))
    return out


def _weights_apart(untrained: dict[str, int], zeroed: int) -> dict[str, int]:
    """The rows that train nothing by outcome, with those whose weights were all 0 (a ``weight: 0``, ``false``, a
    weight too small for float32) counted under ``weights_zero`` rather than ``empty_response``: listed only when some
    row has it, so that reports of other jobs keep their keys."""
    if not zeroed:
        return dict(untrained)
    out = dict(untrained)
    empty = Outcome.EMPTY_RESPONSE.reason
    out[empty] = out.get(empty, 0) - zeroed
    out[WEIGHTS_ZERO] = zeroed
    return out
